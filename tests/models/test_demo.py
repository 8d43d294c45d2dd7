"""`python -m dcmha demo` with tiny settings: outputs exist, the summary has both models."""

import json
import os

import pytest

import keras

from dcmha import __main__ as cli
from dcmha import demo

BACKEND = keras.backend.backend()


def test_cli_usage(capsys):
    assert cli.main([]) == 2
    assert cli.main(["bogus"]) == 2
    assert "Unknown command 'bogus'" in capsys.readouterr().err
    assert cli._backend_from_argv(["--steps", "3", "--backend", "jax"]) == "jax"
    assert cli._backend_from_argv(["--backend=torch"]) == "torch"


@pytest.mark.skipif(BACKEND == "numpy", reason="the demo trains; the numpy backend cannot")
def test_demo_tiny(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = cli.main(["demo", "--backend", BACKEND, "--steps", "3", "--output", str(out),
                   "--seq-len", "16", "--batch-size", "2", "--layers", "2", "--hidden-dim", "32",
                   "--heads", "2", "--eval-points", "2", "--val-windows", "4",
                   "--sample-length", "8", "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    for name in ("summary.txt", "results.json", "loss_curves.png", "sample.txt"):
        assert (out / name).stat().st_size > 0, name
    summary = (out / "summary.txt").read_text()
    rows = [line for line in summary.splitlines()
            if line.startswith(("DCFormer (DCMHA)", "Transformer++ (MHA)"))]
    assert len(rows) == 2 and "val ppl" in summary
    # The one-seed table says what it is and carries the multi-seed study's result.
    assert "One seed (seed " in summary and demo.STUDY in summary
    assert ("ONNX export:" in summary) or ("ONNX export unavailable:" in summary)
    if "ONNX export:" in summary:
        assert (out / "dcformer.onnx").stat().st_size > 0
    results = json.loads((out / "results.json").read_text())
    assert results["backend"] == BACKEND and results["steps"] == 3
    assert [len(r["val_loss"]) for r in results["records"]] == [2, 2]
    assert results["records"][0]["parameters"] > results["records"][1]["parameters"]
    assert "DCFormer sample" in printed and (out / "loss_curves.png").read_bytes()[:4] == \
        b"\x89PNG"
    assert os.path.isfile(out / "sample.txt")
