"""Distributed engines, each in two processes (or on two devices) on this machine, against
one process on the full batch: the recipes of docs/distribution.md, run as written.

Each recipe trains a tiny DCFormerLM (4 composition groups, T = 96, where ``"auto"``
takes the compiled C-kernel paths on CPU) for three SGD steps on ``"auto"`` and on
``"ops"`` and writes the weights; the test runs it once with two workers and once with
one, on fresh local ports, under a time limit (stragglers are killed), and compares the
weights relative to the size of the update (the JAX reference: one process of one
device). Each engine runs in the pytest step of its
Keras backend (the recipes run in their own processes).
"""

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import keras

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "distribution.md"
#: Seconds a launch may take (all its processes together) before they are killed.
LIMIT = 480
#: The largest weight difference allowed, times max(1, the largest change of a weight over
#: the three steps): float32 sums in another order (per-device shares, the all-reduce),
#: as in test_distribution.py's 8-device comparison.
TOL = 1e-5


def recipe(name):
    """The code block of docs/distribution.md whose first line is ``# name``."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    found = [b for b in blocks if b.startswith(f"# {name}\n")]
    assert len(found) == 1, f"docs/distribution.md has {len(found)} blocks named {name}"
    return found[0]


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(argvs, envs, timeout=LIMIT):
    """Run the commands at once (each in its own process group) and wait for them all;
    kill every one still running at the deadline or once one has failed. Asserts that
    each exited with 0; returns their outputs (stdout and stderr)."""
    logs = [tempfile.TemporaryFile("w+") for _ in argvs]     # a pipe could fill and block
    procs = [subprocess.Popen(a, env=e, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
             for a, e, log in zip(argvs, envs, logs)]
    deadline, outs = time.monotonic() + timeout, {}
    try:
        while len(outs) < len(procs) and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if i not in outs and p.poll() is not None:
                    logs[i].seek(0)
                    outs[i] = logs[i].read()
            if any(procs[i].returncode for i in outs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for i, p in enumerate(procs):
        out = outs.get(i, f"killed after {timeout} s (or after another process failed)")
        assert p.returncode == 0, out[-4000:]
    return [outs[i] for i in range(len(procs))]


def base_env(backend, **extra):
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONHASHSEED="0", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    env.update(extra)
    return env


def compare(one, many):
    """{key: difference / update size} of each weight group (by prefix before the index)."""
    a, b = np.load(one), np.load(many)
    assert sorted(a.files) == sorted(b.files)
    groups = {}
    for key in a.files:
        groups.setdefault(key.rsplit("/", 1)[0], []).append(key)
    return {g: max(float(np.abs(a[k] - b[k]).max()) for k in keys) for g, keys in
            groups.items()}


def check(one, many, start):
    """Every run's weights equal one process's within TOL (see there)."""
    diffs = compare(one, many)
    first = np.load(one)
    for group, diff in diffs.items():
        keys = [k for k in first.files if k.rsplit("/", 1)[0] == group]
        update = max(float(np.abs(first[k] - start[int(k.rsplit("/", 1)[1])]).max())
                     for k in keys)
        assert update > 1e-3, (group, update)          # the steps moved the weights
        assert diff <= TOL * max(1.0, update), (group, diff, update)
    return diffs


def start_weights():
    """The recipes' model before training (same seed) on this process's backend."""
    from dcmha.models import DCFormerLM

    keras.utils.set_random_seed(0)
    model = DCFormerLM(vocab_size=64, num_layers=1, hidden_dim=32, num_heads=8,
                       num_groups=4, intermediate_dim=64, seed=3)
    model.build((None, None))
    return [keras.ops.convert_to_numpy(w) for w in model.weights]


def auto_takes_a_kernel(expected):
    """``"auto"`` takes ``expected`` for the recipes' attention call on one device."""
    from dcmha import registry
    from dcmha.call import describe

    q = keras.ops.zeros((8, 96, 8, 4))
    pre = {"static": keras.ops.zeros((4, 2, 2))}
    rows = registry.explain(describe(q, q, q, num_groups=4, pre=pre, use_causal_mask=True))
    assert rows[-1] == (expected, None), rows


def on_backend(name):
    return pytest.mark.skipif(keras.backend.backend() != name,
                              reason=f"runs in the {name} backend's step")


IMPLEMENTATIONS = ["auto", "ops"]


@on_backend("jax")
def test_jax_model_parallel_and_data_parallel(tmp_path):
    auto_takes_a_kernel("jax_cpu")
    script = tmp_path / "train_jax.py"
    script.write_text(recipe("train_jax.py"))
    outs, argvs, envs = {}, [], []
    # Two processes of 4 devices each (a (2, 4) mesh), and one process of one device.
    for world, devices in ((2, 4), (1, 1)):
        port, outs[world] = free_port(), tmp_path / f"w{world}.npz"
        for i in range(world):
            argvs.append([sys.executable, str(script), str(outs[world])] + IMPLEMENTATIONS)
            envs.append(base_env(
                "jax", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                KERAS_DISTRIBUTION_JOB_ADDRESSES=f"localhost:{port}",
                KERAS_DISTRIBUTION_NUM_PROCESSES=str(world), KERAS_DISTRIBUTION_PROCESS_ID=str(i)))
    launch(argvs, envs)
    diffs = check(outs[1], outs[2], start_weights())
    assert sorted(diffs) == [f"{i}/{l}" for i in IMPLEMENTATIONS
                             for l in ("data_parallel", "model_parallel")]


def _torchrun(tmp_path, name):
    script = tmp_path / name
    script.write_text(recipe(name))
    outs = {world: tmp_path / f"w{world}.npz" for world in (2, 1)}
    launch([[sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
             "--master-addr=localhost", f"--master-port={free_port()}", str(script),
             str(out)] + IMPLEMENTATIONS for world, out in outs.items()],
           [base_env("torch")] * len(outs))
    diffs = check(outs[1], outs[2], start_weights())
    assert sorted(diffs) == IMPLEMENTATIONS


@on_backend("torch")
def test_torch_ddp(tmp_path):
    auto_takes_a_kernel("torch")
    _torchrun(tmp_path, "train_ddp.py")


@on_backend("torch")
def test_torch_fsdp2(tmp_path):
    auto_takes_a_kernel("torch")
    _torchrun(tmp_path, "train_fsdp.py")


@on_backend("tensorflow")
def test_tensorflow_mirrored_strategy_fit(tmp_path):
    auto_takes_a_kernel("tf_cpu")
    script = tmp_path / "train_mirrored.py"
    script.write_text(recipe("train_mirrored.py"))
    outs = {replicas: tmp_path / f"w{replicas}.npz" for replicas in (2, 1)}
    launch([[sys.executable, str(script), str(out)] + IMPLEMENTATIONS for out in outs.values()],
           [base_env("tensorflow", REPLICAS=str(replicas)) for replicas in outs])
    diffs = check(outs[1], outs[2], start_weights())
    assert sorted(diffs) == IMPLEMENTATIONS


_CACHE_CHECK = """
import numpy as np, torch, keras
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from dcmha import engines
from dcmha.models import DCFormerLM

torch.distributed.init_process_group("gloo")
x = torch.as_tensor(np.array([[3, 5]], "int32"))        # a decoding-sized call: 2 rows
batch = torch.as_tensor(np.arange(16).reshape(2, 8).astype("int32"))
for engine in ("ddp", "fsdp2"):
    keras.utils.set_random_seed(0)
    model = DCFormerLM(vocab_size=64, num_layers=1, hidden_dim=32, num_heads=8,
                       num_groups=4, intermediate_dim=64, seed=3)
    model.build((None, None))
    if engine == "ddp":
        module = torch.nn.parallel.DistributedDataParallel(model)
        weights = lambda: [v.value for v in model.trainable_variables]
        call = lambda: module(x, training=False)
    else:
        module = engines.torch_module(model)
        fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
        weights = lambda: [getattr(p, "full_tensor", lambda: p)() for p in module.parameters()]
        call = lambda: module(x, training=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    with torch.no_grad():
        for _ in range(3):                              # the cached concatenation is built
            call()
    module(batch).square().mean().backward()
    optimizer.step()
    with torch.no_grad():
        got = call()
        fresh = model.stateless_call([w.detach().clone() for w in weights()], [], x,
                                     training=False)[0]
    print("DIFF", engine, float((got - fresh).abs().max()))
torch.distributed.destroy_process_group()
"""


@on_backend("torch")
def test_torch_engines_never_serve_a_stale_fused_projection(tmp_path):
    """The fused decoding projection keeps a concatenation of each layer's weights while
    they are unchanged (same tensor, same version). DDP updates the model's parameters in
    place (a new version); FSDP2 gathers into the same tensors without a new version,
    which ``dcmha.engines.torch_module`` answers with fresh views. After an optimizer
    step a decoding-sized forward equals one from copies of the new weights."""
    script = tmp_path / "cache_check.py"
    script.write_text(_CACHE_CHECK)
    env = base_env("torch", MASTER_ADDR="localhost", MASTER_PORT=str(free_port()), RANK="0",
                   WORLD_SIZE="1")
    out, = launch([[sys.executable, str(script)]], [env])
    diffs = {ln.split()[1]: float(ln.split()[2]) for ln in out.splitlines()
             if ln.startswith("DIFF ")}
    assert diffs == {"ddp": 0.0, "fsdp2": 0.0}, out[-3000:]


# ---------------------------------------------------------------------------
# The helpers' own contracts (in-process)
# ---------------------------------------------------------------------------

@on_backend("jax")
def test_multi_host_mesh_and_gathered_weights_on_one_process():
    import jax

    from dcmha import distribution as ddist
    from dcmha.models import DCFormerLM

    n = jax.local_device_count()
    mesh = ddist.multi_host_mesh()
    assert tuple(mesh.shape) == (1, n) and tuple(mesh.axis_names) == ("data", "model")
    with pytest.raises(ValueError, match=re.escape(
            f"`model_size` must divide the {n} devices of each process. "
            f"Received: model_size={n + 1}")):
        ddist.multi_host_mesh(n + 1)
    with pytest.raises(ValueError, match=re.escape(
            "`model_size` must be a positive integer. Received: model_size=0")):
        ddist.multi_host_mesh(0)
    model = DCFormerLM(vocab_size=16, num_layers=1, hidden_dim=8, num_heads=2, seed=1)
    model.build((None, None))
    got = ddist.gathered_weights(model)
    assert len(got) == len(model.weights)
    for a, b in zip(got, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_torch_module_validates_its_model():
    from dcmha import engines
    from dcmha.models import DCFormerLM

    model = DCFormerLM(vocab_size=16, num_layers=1, hidden_dim=8, num_heads=2, seed=1)
    if keras.backend.backend() != "torch":
        message = ("`torch_module` needs the Keras torch backend. Received: the active Keras "
                   f"backend is {keras.backend.backend()!r}")
    else:
        message = "`model` must be a built keras.Model. Received: DCFormerLM (not built)"
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        engines.torch_module(model)


@on_backend("torch")
def test_torch_module_is_the_model_on_its_parameters():
    """Without an engine: the module's output is the model's, its gradients reach its
    parameters, and ``write_back`` puts changed parameters into the model."""
    import torch

    from dcmha import engines
    from dcmha.models import DCFormerLM

    model = DCFormerLM(vocab_size=16, num_layers=1, hidden_dim=8, num_heads=2, num_groups=2,
                       seed=1)
    model.build((None, None))
    module = engines.torch_module(model)
    x = torch.as_tensor(np.arange(12).reshape(2, 6).astype("int32"))
    ref = keras.ops.convert_to_numpy(model(x))
    np.testing.assert_array_equal(module(x, training=False).detach().numpy(), ref)
    assert not any(p is v.value for p, v in zip(module.parameters(), model.trainable_variables))
    module(x).square().mean().backward()
    assert all(p.grad is not None for p in module.parameters())
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(0.5)
    module.write_back()
    for p, v in zip(module.parameters(), model.trainable_variables):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), p.detach().numpy())
