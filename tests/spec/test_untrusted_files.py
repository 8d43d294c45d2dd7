"""Untrusted files: every crafted checkpoint, config, index, tokenizer.json and conformance
fixture (tests/spec/untrusted_cases.py) is refused with a ValueError (or OSError) naming the
file, quickly and within a memory limit; valid torch-saved and safetensors files load to
the values torch holds.

The crafted files are loaded in one child process under RLIMIT_AS (1 GiB) with a
10-second alarm per file, so that a hang, a runaway allocation or a crash shows as that
case's failure instead of taking the test run down.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.spec import untrusted_cases as uc

MEMORY_LIMIT = 1 << 30
ALARM_SECONDS = 10
#: A refusal takes well under a second; the bound leaves room for a loaded machine.
SECONDS = 3.0
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    jobs = []
    for name, make in uc.ALL_CASES.items():
        path = make(str(tmp_path_factory.mktemp(name)))
        jobs.append((name, uc.LOADERS[uc.prefix_of(name)], str(path)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, "-c", uc.CHILD, str(MEMORY_LIMIT), json.dumps(jobs),
                           str(ALARM_SECONDS)], capture_output=True, text=True, env=env,
                          timeout=ALARM_SECONDS * len(jobs) + 120)
    found = {}
    for line in proc.stdout.splitlines():
        row = json.loads(line)
        found[row["case"]] = row
    return proc, found


@pytest.mark.parametrize("name", sorted(uc.ALL_CASES))
def test_crafted_file_is_refused_naming_it(refusals, name):
    proc, found = refusals
    assert name in found, (f"the child stopped before {name} (return code {proc.returncode}):"
                           f" {proc.stderr[-3000:]}")
    row = found[name]
    assert row["error"] in ("ValueError", "OSError"), row
    assert uc.EXPECTED_NAME[uc.prefix_of(name)] in row["message"], row
    assert len(row["message"]) < 1500, row        # nothing unbounded formatted
    assert row["seconds"] < SECONDS, row


def test_child_exits_cleanly(refusals):
    proc, found = refusals
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(found) == sorted(uc.ALL_CASES)


# ---------------------------------------------------------------------------
# Valid files still load to torch's values
# ---------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _torch_values(t):
    """NumPy values of a tensor; bfloat16 and float8 (which NumPy lacks) as float32."""
    t = t.detach()
    widen = t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
    return (t.float() if widen else t).numpy()


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_torch_saved_files_load_to_torch_values(tmp_path, protocol, dtype):
    from dcmha.checkpoints import read_torch_bin

    g = torch.Generator().manual_seed(protocol)
    base = torch.randn(6, 10, generator=g).to(getattr(torch, dtype))
    lin = torch.nn.Linear(3, 2).to(getattr(torch, dtype))
    saved = {"base": base, "view_t": base.view(10, 6)[2:].t(), "row": base[3],
             "strided": base[:, ::3], "offset": base.view(-1)[7:19].view(3, 4),
             "empty": base[:0], "ids": torch.arange(5), "flags": torch.tensor([True, False]),
             "param": torch.nn.Parameter(base[:2].clone()), **{
                 f"lin.{k}": v for k, v in lin.state_dict().items()}}
    path = tmp_path / "pytorch_model.bin"
    torch.save(saved, path, pickle_protocol=protocol)
    ours = read_torch_bin(path)
    assert sorted(ours) == sorted(saved)
    for k, v in saved.items():
        want = _torch_values(v)
        assert ours[k].shape == want.shape, k
        assert ours[k].dtype == want.dtype, k
        np.testing.assert_array_equal(ours[k], want, err_msg=k)


def test_state_dict_with_metadata_loads(tmp_path):
    # Module.state_dict() carries `_metadata` (module versions) as the OrderedDict's state.
    from dcmha.checkpoints import read_torch_bin

    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    sd = module.state_dict()
    assert hasattr(sd, "_metadata")
    torch.save(sd, tmp_path / "m.bin")
    ours = read_torch_bin(tmp_path / "m.bin")
    assert sorted(ours) == sorted(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(ours[k], _torch_values(v), err_msg=k)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn",
                                   "float8_e5m2", "int64", "bool"])
def test_safetensors_files_load_to_torch_values(tmp_path, dtype):
    st = pytest.importorskip("safetensors.torch")
    from dcmha.checkpoints import read_safetensors

    g = torch.Generator().manual_seed(1)
    values = torch.randn(3, 5, generator=g) * 40
    if dtype == "int64":
        t = torch.arange(15).view(3, 5)
    elif dtype == "bool":
        t = values > 0
    else:
        t = values.to(getattr(torch, dtype))
    specials = {"float8_e4m3fn": [448.0, -448.0, 2.0 ** -9, float("nan")],
                "float8_e5m2": [57344.0, float("-inf"), 2.0 ** -16, float("nan")]}
    if dtype in specials:            # the extremes and NaN of each float8 type
        t[0, :4] = torch.tensor(specials[dtype]).to(t.dtype)
    st.save_file({"t": t, "scalar": t[0, 0].clone(), "empty": t[:0].clone()},
                 str(tmp_path / "model.safetensors"))
    ours = read_safetensors(tmp_path / "model.safetensors")
    for name, want in (("t", t), ("scalar", t[0, 0]), ("empty", t[:0])):
        want = _torch_values(want)
        assert ours[name].shape == want.shape, name
        assert ours[name].dtype == want.dtype, name
        np.testing.assert_array_equal(ours[name], want, err_msg=name)


def test_n_layer_table_not_built_for_a_config_the_weights_cannot_fill():
    from dcmha.checkpoints import official_model_arguments

    config = {"vocab_size": 8, "n_layer": 10**9, "n_head": 2, "dim": 4, "intermediate_size": 8}
    with pytest.raises(ValueError, match=r"^Config 'n_layer' is 1000000000, but the state dict "
                                         r"holds only 1 entries"):
        official_model_arguments({"w": np.zeros(2, np.float32)}, config)
