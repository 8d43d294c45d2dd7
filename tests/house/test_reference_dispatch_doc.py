"""docs/fast-paths.md's dispatch table is the one the registry renders.

``tools/dispatch_table.py`` renders the table from ``dcmha.registry``; it runs in a
subprocess on the numpy Keras backend, so this process imports no framework.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "dispatch_table.py"
PAGE = ROOT / "docs" / "fast-paths.md"


def _tool_module():
    spec = importlib.util.spec_from_file_location("dispatch_table", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)       # the module imports only the standard library
    return module


def test_the_page_shows_the_registrys_table():
    env = dict(os.environ, KERAS_BACKEND="numpy")
    rendered = subprocess.run([sys.executable, str(TOOL)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
    assert rendered.returncode == 0, rendered.stderr
    table = rendered.stdout.rstrip("\n")
    assert len([line for line in table.splitlines() if line.startswith("| `")]) >= 2, table
    page = _tool_module().page_table(PAGE.read_text(encoding="utf-8"), str(PAGE))
    assert page == table, ("docs/fast-paths.md's dispatch table differs from the registry's: "
                           "run python tools/dispatch_table.py --write docs/fast-paths.md")


def test_a_page_without_the_markers_is_refused():
    with pytest.raises(ValueError, match=r"notes\.md must hold the dispatch table between the "
                                         r"lines .*Received: a page without them"):
        _tool_module().page_table("# notes\n\n| a | b |\n", "notes.md")
