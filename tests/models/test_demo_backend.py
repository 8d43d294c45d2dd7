"""The command lines on a fresh machine: no KERAS_BACKEND, no keras.json.

`dcmha._keras_backend.ensure_keras_backend` picks the first installed of jax,
torch, tensorflow before Keras is imported, says so on stderr, and exits with
what to install when none is (any Keras backend; the checks never import one, so
tools/test_all.py runs the module once, in the keras-numpy step).
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

keras = pytest.importorskip("keras")

from dcmha import _keras_backend as kb  # noqa: E402

PICKED = "dcmha: no Keras backend configured; using {} (set KERAS_BACKEND to choose).\n"

pytestmark = pytest.mark.backend_independent


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """As before Keras's first import, with nothing configured; returns a function that
    makes only the given frameworks importable (as far as find_spec tells)."""
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.delitem(sys.modules, "keras")
    real = importlib.util.find_spec

    def only(*names):
        def find_spec(name, *args, **kwargs):
            if name in kb.CANDIDATES and name not in names:
                return None
            return real(name, *args, **kwargs)
        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return only


def _write_config(tmp_path, **config):
    (tmp_path / "keras_home").mkdir(exist_ok=True)
    (tmp_path / "keras_home" / "keras.json").write_text(json.dumps(config))


def test_picks_the_first_installed(fresh, capsys):
    fresh("torch", "tensorflow")
    assert kb.ensure_keras_backend() == "torch"
    assert os.environ["KERAS_BACKEND"] == "torch"
    assert capsys.readouterr().err == PICKED.format("torch")


def test_none_installed(fresh):
    fresh()
    with pytest.raises(SystemExit) as e:
        kb.ensure_keras_backend()
    assert e.value.code == ('dcmha: no Keras backend is installed (none of jax, torch, '
                            'tensorflow can be imported). Install one, e.g. pip install '
                            '"dcmha[jax]" (or "dcmha[torch]", "dcmha[tensorflow]").')
    assert "KERAS_BACKEND" not in os.environ


def test_configured_backend_is_kept(fresh, tmp_path, capsys):
    fresh("jax", "torch")
    _write_config(tmp_path, backend="torch")
    assert kb.ensure_keras_backend() == "torch"
    assert "KERAS_BACKEND" not in os.environ and capsys.readouterr().err == ""
    os.environ["KERAS_BACKEND"] = "numpy"          # not a framework to look for
    assert kb.ensure_keras_backend() == "numpy" and capsys.readouterr().err == ""


def test_keras_json_naming_a_missing_framework(fresh, tmp_path, capsys):
    # Keras writes keras.json with its default "tensorflow" on its first import, even when
    # KERAS_BACKEND chose another backend: such a value is not taken as the user's choice.
    fresh("jax")
    _write_config(tmp_path, backend="tensorflow")
    assert kb.ensure_keras_backend() == "jax"
    path = os.path.join(str(tmp_path / "keras_home"), "keras.json")
    assert capsys.readouterr().err == (
        f"dcmha: the Keras backend 'tensorflow' set in {path} is not installed; using jax "
        "(set KERAS_BACKEND to choose).\n")


def test_keras_json_without_backend_or_unreadable(fresh, tmp_path, capsys):
    fresh("jax")
    _write_config(tmp_path, floatx="float32")
    assert kb.ensure_keras_backend() == "jax" and capsys.readouterr().err == PICKED.format("jax")
    del os.environ["KERAS_BACKEND"]
    (tmp_path / "keras_home" / "keras.json").write_text("{not json")
    assert kb.ensure_keras_backend() == "jax" and capsys.readouterr().err == PICKED.format("jax")


def test_explicit_backend_not_installed(fresh, monkeypatch):
    fresh("jax")
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    with pytest.raises(SystemExit) as e:
        kb.ensure_keras_backend()
    assert e.value.code == ('dcmha: KERAS_BACKEND=tensorflow but tensorflow is not installed. '
                            'Install it (pip install "dcmha[tensorflow]") or unset KERAS_BACKEND '
                            'to use an installed backend.')


def test_keras_already_imported_is_left_alone(monkeypatch, capsys):
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    assert kb.ensure_keras_backend() is None
    assert "KERAS_BACKEND" not in os.environ and capsys.readouterr().err == ""


def test_keras_home_default(monkeypatch, tmp_path):
    monkeypatch.delenv("KERAS_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert kb.keras_config_path() == str(tmp_path / ".keras" / "keras.json")


def test_demo_picks_before_running(monkeypatch):
    from dcmha import __main__ as main_cli
    from dcmha import demo

    calls = []
    monkeypatch.setattr(demo, "ensure_keras_backend", lambda: calls.append("pick"))
    monkeypatch.setattr(demo, "run", lambda **kw: calls.append(("run", kw["steps"])))
    assert main_cli.main(["demo", "--steps", "2"]) == 0
    assert calls == ["pick", ("run", 2)]


def _scrubbed_env(home):
    env = {k: v for k, v in os.environ.items()
           if k not in ("KERAS_BACKEND", "KERAS_HOME", "XDG_CACHE_HOME", "DCMHA_CACHE_DIR")}
    env["HOME"] = str(home)
    return env


def test_fresh_machine_none_installed_subprocess(tmp_path):
    # `python -m dcmha demo` itself, with no framework importable: the message and exit 1,
    # before Keras is imported.
    code = ("import importlib.util, runpy, sys\n"
            "real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda n, *a, **k: (None if n in ('jax', 'torch', "
            "'tensorflow') else real(n, *a, **k))\n"
            "sys.argv = ['dcmha', 'demo', '--output', sys.argv[1]]\n"
            "runpy.run_module('dcmha', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")],
                          env=_scrubbed_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert (proc.returncode, proc.stderr) == (1, kb.NONE_INSTALLED + "\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                    reason="the fresh machine picks jax, the first installed: needs jax")
def test_fresh_machine_export_cli_subprocess(tmp_path):
    # HOME is empty and KERAS_BACKEND unset: Keras alone would start on tensorflow.
    proc = subprocess.run([sys.executable, "-m", "dcmha.export", str(tmp_path / "none.keras"),
                           str(tmp_path / "out.onnx")], env=_scrubbed_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == PICKED.format("jax").strip()
    assert lines[-1].startswith(f"error: cannot load {tmp_path / 'none.keras'}: ")
    assert not (tmp_path / "out.onnx").exists()
