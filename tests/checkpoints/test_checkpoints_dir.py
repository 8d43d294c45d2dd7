"""Checkpoint directories in the authors' release layout -> DCFormerLM.

Tiny directories are written here (tests/checkpoints/checkpoint_dir_cases.py: official
names and shapes, the derived dw_m / qkw_m copies, qkw_m a view of qkw's
storage in .bin files) as .bin or .safetensors, sharded or not, in bfloat16,
float16 or float32. Loading one must give the logits of the direct state-dict
conversion of the same (rounded) weights, and float32 ones those of the
independent float64 official forward (test_checkpoints.official_forward).
The .bin reader is weights-only and needs no torch: it is also run with torch
blocked in a subprocess.
"""

import json
import os
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest

import keras

from tests.checkpoints import checkpoint_dir_cases as cases
from dcmha.checkpoints import (from_official_state_dict, load_official_state_dict,
                               read_torch_bin, write_official_directory)
from dcmha.models import DCFormerLM
from tests.checkpoints.test_checkpoints import official_forward

IDS = np.array([[3, 17, 40, 5, 64, 9, 33], [50, 2, 8, 71, 1, 0, 95]])


def _logits(model, ids=IDS):
    return np.asarray(keras.ops.convert_to_numpy(model(ids)), np.float64)


@pytest.fixture(scope="module")
def state_dict():
    return cases.tiny_state_dict()


@pytest.mark.parametrize("format,dtype,num_shards", [
    ("bin", "bfloat16", 1), ("bin", "float32", 3), ("safetensors", "float16", 1),
    ("safetensors", "bfloat16", 2)])
def test_directory_logits_equal_direct_conversion(tmp_path, state_dict, format, dtype,
                                                  num_shards):
    directory = cases.write_release_dir(tmp_path / "ckpt", state_dict, format=format,
                                        dtype=dtype, num_shards=num_shards, tokenizer=False)
    got = _logits(DCFormerLM.from_preset(str(directory)))
    want = _logits(from_official_state_dict(cases.rounded(state_dict, dtype),
                                            cases.TINY_CONFIG))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_float32_directory_equals_official_forward(tmp_path, state_dict):
    directory = cases.write_release_dir(tmp_path / "ckpt", state_dict, format="bin",
                                        tokenizer=False)
    want = official_forward(state_dict, cases.TINY_CONFIG, IDS)
    np.testing.assert_allclose(_logits(DCFormerLM.from_preset(directory)), want,
                               rtol=1e-4, atol=1e-3)


def test_bin_view_entries_read_through_offset_and_strides(tmp_path):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    views = {"tail_t": ("base", 7, (3, 2), (1, 6)), "row": ("base", 12, (6,), (1,))}
    write_official_directory(tmp_path, {"base": base}, {}, format="bin", views=views)
    sd = read_torch_bin(tmp_path / "pytorch_model.bin")
    np.testing.assert_array_equal(sd["base"], base)
    # element [i, j] of a view is storage[offset + i * stride[0] + j * stride[1]]
    np.testing.assert_array_equal(
        sd["tail_t"], base.reshape(-1)[7 + np.add.outer(np.arange(3), 6 * np.arange(2))])
    np.testing.assert_array_equal(sd["row"], base[2])


def test_bin_matches_torch_both_ways(tmp_path):
    torch = pytest.importorskip("torch")
    t = torch.randn(5, 6).to(torch.bfloat16)
    saved = {"a": t, "a_view": t.view(6, 5)[1:].t(), "h": torch.randn(3, dtype=torch.float16),
             "p": torch.nn.Parameter(torch.randn(2, 2)), "i": torch.arange(4)}
    torch.save(saved, tmp_path / "torch.bin")
    ours = read_torch_bin(tmp_path / "torch.bin")
    for k, v in saved.items():
        v = v.detach()
        np.testing.assert_array_equal(ours[k], (v.float() if v.is_floating_point() else v)
                                      .numpy(), err_msg=k)
    # Our writer's archive, read by torch's own weights-only loader.
    arrays = {"x": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)}
    for dtype in ("float32", "float16", "bfloat16"):
        write_official_directory(tmp_path / dtype, arrays, {}, format="bin", dtype=dtype,
                                 views={"x_t": ("x", 1, (4, 2), (1, 4))})
        loaded = torch.load(tmp_path / dtype / "pytorch_model.bin", weights_only=True)
        assert str(loaded["x"].dtype) == f"torch.{dtype}"
        mine = read_torch_bin(tmp_path / dtype / "pytorch_model.bin")
        for k in ("x", "x_t"):
            np.testing.assert_array_equal(loaded[k].float().numpy(), mine[k], err_msg=k)


_BLOCKED_TORCH = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None          # any `import torch` now raises ImportError
    import numpy as np
    from dcmha.checkpoints import load_official_state_dict
    sd = load_official_state_dict(sys.argv[1])
    want = np.load(sys.argv[2])
    assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None], "torch imported"
    assert sorted(sd) == sorted(want.files), (sorted(sd), sorted(want.files))
    for k in want.files:
        np.testing.assert_array_equal(sd[k], want[k], err_msg=k)
    print("read", len(sd), "entries without torch")
""")


def test_bin_reader_works_without_torch(tmp_path, state_dict):
    directory = cases.write_release_dir(tmp_path / "ckpt", state_dict, format="bin",
                                        dtype="bfloat16", num_shards=2, tokenizer=False)
    want = load_official_state_dict(directory)
    G, C, K, R2, M = want["layers.0.attention.dyn_w_proj.qkw"].shape
    assert want["layers.0.attention.dyn_w_proj.qkw_m"].shape == (G * C * K, R2 * M)
    np.testing.assert_array_equal(want["layers.0.attention.dyn_w_proj.qkw_m"].reshape(-1),
                                  want["layers.0.attention.dyn_w_proj.qkw"].reshape(-1))
    np.savez(tmp_path / "want.npz", **want)
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    out = subprocess.run([sys.executable, "-c", _BLOCKED_TORCH, str(directory),
                          str(tmp_path / "want.npz")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"read {len(want)} entries without torch" in out.stdout


def test_bin_reader_refuses_other_globals(tmp_path):
    # A pickle that would call os.system when unpickled by a plain Unpickler.
    evil = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00truet\x85R."
    path = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", evil)
    with pytest.raises(ValueError, match=r"^pytorch_model\.bin: refusing to unpickle the global "
                                         r"'os\.system'"):
        read_torch_bin(path)


def test_directory_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(cases.TINY_CONFIG))
    with pytest.raises(ValueError, match="holds no weights: expected model.safetensors"):
        DCFormerLM.from_preset(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"norm.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(ValueError, match="names the shard '../elsewhere.safetensors', which is "
                                         "not a file"):
        DCFormerLM.from_preset(str(tmp_path))
    with pytest.raises(ValueError, match="Unknown preset 'no/such/dir'"):
        DCFormerLM.from_preset("no/such/dir")
    with pytest.raises(ValueError, match=r"`format` must be 'safetensors' or 'bin'. "
                                         r"Received: format='npz'"):
        write_official_directory(tmp_path / "w", {}, {}, format="npz")


def test_hf_handle_errors():
    pytest.importorskip("huggingface_hub")
    with pytest.raises(ValueError, match=r"A Hugging Face handle is 'hf://owner/name'. "
                                         r"Received: 'hf://just-a-name'"):
        DCFormerLM.from_preset("hf://just-a-name")
    # No network here (and no such repository anywhere): one clear line.
    with pytest.raises(OSError) as info:
        DCFormerLM.from_preset("hf://dcmha-tests/no-such-checkpoint")
    message = str(info.value)
    assert message.startswith("Could not download hf://dcmha-tests/no-such-checkpoint from the "
                              "Hugging Face Hub (")
    assert "\n" not in message


def test_import_dcmha_never_imports_keras_hub():
    code = ("import sys, dcmha, dcmha.checkpoints, dcmha.models, dcmha.hub; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('keras_hub', 'tokenizers', 'safetensors')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
