"""`python -m dcmha.export` keeps its word, and the ONNX file writer (any Keras backend).

The CLI exports every model README names (a functional model with DCMHA, a saved
DCFormerLM: plain, --decode, --fp16), exits non-zero when verification fails, and
leaves nothing at the output path on any failure. The writer keeps the mode of the
file it replaces, writes through a symlink, and never touches the process umask.
"""

import os
import stat

import onnx
import pytest
from onnx import TensorProto, helper

keras = pytest.importorskip("keras")
pytest.importorskip("onnxruntime")

from dcmha.export import __main__ as cli  # noqa: E402
from dcmha.export import core  # noqa: E402

D = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{"lm": a saved tiny DCFormerLM, "functional": a saved functional model with DCMHA}."""
    from dcmha.layers import DCMHA
    from dcmha.models import DCFormerLM

    folder = tmp_path_factory.mktemp("models")
    keras.utils.set_random_seed(5)
    lm = DCFormerLM(vocab_size=32, num_layers=2, hidden_dim=D, num_heads=4, sliding_window=3,
                    window_pattern="LG", rope_max_wavelength=100.0)
    lm.build((None, None))
    lm.save(folder / "lm.keras")
    x = keras.Input((None, D), name="x")
    h = DCMHA(num_heads=2, key_dim=4, rank=1, name="attention")(x, x, use_causal_mask=True)
    h = keras.layers.LayerNormalization(name="norm")(h + x)
    keras.Model(x, keras.layers.Dense(1, name="head")(h)).save(folder / "functional.keras")
    return {"lm": str(folder / "lm.keras"), "functional": str(folder / "functional.keras")}


def _leftovers(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith(".tmp-"))


def _errors(text):
    return [float(line.split("max rel error ")[1]) for line in text.splitlines()
            if "max rel error" in line]


@pytest.mark.parametrize("model,flags", [
    ("lm", []), ("lm", ["--decode"]), ("lm", ["--fp16"]), ("functional", ["--fp16"]),
    ("lm", ["--decode", "--no-compose-nodes"]),
])
def test_cli_exports_and_verifies(tmp_path, capsys, saved, model, flags):
    out = tmp_path / "m.onnx"
    assert cli.main([saved[model], str(out), "--length", "5", *flags]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[-1] == f"wrote {out}"
    errors = _errors(text)
    dtype = "float16" if "--fp16" in flags else "float32"
    assert errors and max(errors) <= cli.MAX_REL[dtype]
    proto = onnx.load(str(out))
    assert len([n for n in proto.graph.node if n.domain == "dcmha"]) == (2 if model == "lm" else 1)
    assert ("cache_update_index" in [i.name for i in proto.graph.input]) == ("--decode" in flags)
    # each compose a dcmha.Compose* function unless --no-compose-nodes
    composes = sorted(f.name for f in proto.functions if f.name.startswith("Compose"))
    n_dcmha = len(proto.functions) - len([f for f in proto.functions
                                          if f.name in core.KERNEL_OPS])
    assert bool(composes) == ("--no-compose-nodes" not in flags)
    assert f"{n_dcmha} DCMHA function(s), " in text
    assert _leftovers(tmp_path) == []


def test_cli_fails_when_verification_fails(tmp_path, capsys, saved, monkeypatch):
    import dcmha.export

    real_verify = dcmha.export.verify

    def nan_verify(path, obj, inputs, **kwargs):     # as if the graph computed NaN
        report = real_verify(path, obj, inputs, **kwargs)
        report["outputs"]["output"]["max_rel"] = float("nan")
        return report

    monkeypatch.setattr(dcmha.export, "verify", nan_verify)
    out = tmp_path / "m.onnx"
    out.write_bytes(b"previous")
    os.chmod(out, 0o640)
    assert cli.main([saved["lm"], str(out), "--length", "4"]) == 1
    err = capsys.readouterr().err
    assert err == ("error: verification failed, nothing written: onnxruntime differs from Keras: "
                   "'output' max rel error nan (allowed 1.0e-04, --max-rel)\n")
    assert out.read_bytes() == b"previous" and stat.S_IMODE(out.stat().st_mode) == 0o640
    assert _leftovers(tmp_path) == []
    # --max-rel below what the export reaches fails too, and creates nothing.
    monkeypatch.setattr(dcmha.export, "verify", real_verify)
    new = tmp_path / "new.onnx"
    assert cli.main([saved["lm"], str(new), "--length", "4", "--max-rel", "0"]) == 1
    assert "error: verification failed, nothing written" in capsys.readouterr().err
    assert not new.exists() and _leftovers(tmp_path) == []


def test_cli_missing_output_directory(tmp_path, capsys):
    # Checked before the model is loaded: the model path does not exist either.
    out = tmp_path / "missing" / "m.onnx"
    assert cli.main([str(tmp_path / "nope.keras"), str(out)]) == 2
    assert capsys.readouterr().err == (
        f"error: cannot write {out}: `path` must be in an existing directory; "
        f"{os.path.realpath(tmp_path / 'missing')!r} does not exist. "
        f"Received: path={str(out)!r}\n")
    assert cli.main([str(tmp_path / "nope.keras"), str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: cannot write {tmp_path}: `path` must be a file path, not a directory. "
        f"Received: path={str(tmp_path)!r}\n")


def test_cli_export_error_writes_nothing(tmp_path, capsys, saved):
    out = tmp_path / "m.onnx"
    assert cli.main([saved["functional"], str(out), "--opset", "5"]) == 1
    assert capsys.readouterr().err == (
        "error: export failed, nothing written: ValueError: `opset` must be an integer in "
        f"[18, {onnx.defs.onnx_opset_version()}]. Received: opset=5\n")
    assert not out.exists() and _leftovers(tmp_path) == []


# ---------------------------------------------------------------------------
# The file writer (dcmha.export.core.save_model / atomic_output)
# ---------------------------------------------------------------------------

def _identity_model(name="y"):
    graph = helper.make_graph([helper.make_node("Identity", ["x"], [name])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _output_name(path):
    return onnx.load(str(path)).graph.output[0].name


def test_overwrite_keeps_the_mode(tmp_path):
    path = tmp_path / "m.onnx"
    core.save_model(_identity_model("first"), path)
    os.chmod(path, 0o604)
    core.save_model(_identity_model("second"), path)
    assert _output_name(path) == "second"
    assert stat.S_IMODE(path.stat().st_mode) == 0o604
    assert _leftovers(tmp_path) == []


def test_new_file_gets_the_umask_mode_without_changing_the_umask(tmp_path, monkeypatch):
    real_umask = os.umask
    old = real_umask(0o027)           # a umask under which mkstemp's 0o600 would differ
    try:
        reference = tmp_path / "plain.txt"
        reference.write_text("")      # the mode the OS gives any new file under this umask

        def no_umask(mask):
            raise AssertionError("the writer must not call os.umask (process-wide)")

        monkeypatch.setattr(os, "umask", no_umask)
        path = tmp_path / "m.onnx"
        core.save_model(_identity_model(), path)
    finally:
        real_umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(reference.stat().st_mode)


def test_symlink_is_written_through(tmp_path):
    target = tmp_path / "real.onnx"
    core.save_model(_identity_model("first"), target)
    os.chmod(target, 0o640)
    link = tmp_path / "link.onnx"
    link.symlink_to(target)
    core.save_model(_identity_model("second"), link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert _output_name(target) == "second" and stat.S_IMODE(target.stat().st_mode) == 0o640
    dangling = tmp_path / "dangling.onnx"       # a link whose target does not exist yet
    dangling.symlink_to(tmp_path / "made.onnx")
    core.save_model(_identity_model("third"), dangling)
    assert dangling.is_symlink() and _output_name(tmp_path / "made.onnx") == "third"
    assert _leftovers(tmp_path) == []


def test_failed_write_leaves_the_target_untouched(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"previous")
    bad = _identity_model()
    bad.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(onnx.checker.ValidationError):
        core.save_model(bad, path)
    assert path.read_bytes() == b"previous" and _leftovers(tmp_path) == []


def test_writer_missing_directory(tmp_path):
    path = tmp_path / "missing" / "m.onnx"
    with pytest.raises(ValueError) as e:
        core.save_model(_identity_model(), path)
    assert str(e.value) == (f"`path` must be in an existing directory; "
                            f"{os.path.realpath(tmp_path / 'missing')!r} does not exist. "
                            f"Received: path={str(path)!r}")
    assert not (tmp_path / "missing").exists()

