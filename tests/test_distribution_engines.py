"""Distributed engines, each in two processes (or on two devices) on this machine, against
one process on the full batch: the recipes of docs/distribution.md, run as written.

Each recipe trains a tiny DCFormerLM (4 composition groups, T = 96, where ``"auto"``
takes the compiled C-kernel paths on CPU) for three SGD steps on ``"auto"`` and on
``"ops"`` and writes the weights; the test runs it once with two workers and once with
one, on fresh local ports, under a time limit (stragglers are killed), and compares the
weights relative to the size of the update. Each engine runs in the pytest step of its
Keras backend (the recipes run in their own processes).
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import keras

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "distribution.md"
#: Seconds a launch may take (both workers together) before its processes are killed.
LIMIT = 240
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
    """Run the commands together (each in its own process group); kill every one still
    running at the deadline or when another fails. Returns their outputs; asserts that
    each exited with 0."""
    procs = [subprocess.Popen(a, env=e, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for a, e in zip(argvs, envs)]
    deadline, outs = time.monotonic() + timeout, []
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                outs.append(f"killed after {timeout} s")
                break
            if p.returncode != 0:
                break
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, out in zip(procs, outs + [""] * len(procs)):
        assert p.returncode == 0, out[-4000:]
    return outs


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
    outs = {}
    for world in (2, 1):
        port = free_port()
        envs = [base_env("jax", XLA_FLAGS="--xla_force_host_platform_device_count=4",
                         KERAS_DISTRIBUTION_JOB_ADDRESSES=f"localhost:{port}",
                         KERAS_DISTRIBUTION_NUM_PROCESSES=str(world),
                         KERAS_DISTRIBUTION_PROCESS_ID=str(i)) for i in range(world)]
        outs[world] = tmp_path / f"w{world}.npz"
        launch([[sys.executable, str(script), str(outs[world])] + IMPLEMENTATIONS] * world,
               envs)
    diffs = check(outs[1], outs[2], start_weights())
    assert sorted(diffs) == [f"{i}/{l}" for i in IMPLEMENTATIONS
                             for l in ("data_parallel", "model_parallel")]


def _torchrun(tmp_path, name):
    script = tmp_path / name
    script.write_text(recipe(name))
    outs = {}
    for world in (2, 1):
        outs[world] = tmp_path / f"w{world}.npz"
        launch([[sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                 "--master-addr=localhost", f"--master-port={free_port()}", str(script),
                 str(outs[world])] + IMPLEMENTATIONS], [base_env("torch")])
    diffs = check(outs[1], outs[2], start_weights())
    assert sorted(diffs) == IMPLEMENTATIONS


@on_backend("torch")
def test_torch_ddp(tmp_path):
    auto_takes_a_kernel("torch")
    _torchrun(tmp_path, "train_ddp.py")


@on_backend("torch")
def test_torch_fsdp2(tmp_path):
    _torchrun(tmp_path, "train_fsdp.py")


@on_backend("tensorflow")
def test_tensorflow_mirrored_strategy_fit(tmp_path):
    auto_takes_a_kernel("tf_cpu")
    script = tmp_path / "train_mirrored.py"
    script.write_text(recipe("train_mirrored.py"))
    outs = {}
    for replicas in (2, 1):
        outs[replicas] = tmp_path / f"w{replicas}.npz"
        launch([[sys.executable, str(script), str(outs[replicas])] + IMPLEMENTATIONS],
               [base_env("tensorflow", REPLICAS=str(replicas))])
    diffs = check(outs[1], outs[2], start_weights())
    assert sorted(diffs) == IMPLEMENTATIONS
