"""How far one call of a DCMHA layer reaches: a reader follows it in a few files.

``tools/trace_call.py`` traces one eager call (after a warm-up call) with
``sys.setprofile`` and lists the package files whose functions ran. On every Keras
backend, on the plain core and on ``"auto"``, the call runs code in at most
``MAX_FILES`` of them.
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "trace_call.py"
MAX_FILES = 10


def _tool_module():
    spec = importlib.util.spec_from_file_location("trace_call", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("implementation", ["ops", "auto"])
def test_one_call_runs_code_in_at_most_ten_files(implementation):
    from dcmha.layers import DCMHA
    tool = _tool_module()
    x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype("float32")
    layer = DCMHA(num_heads=4, key_dim=4, seed=0, implementation=implementation)
    layer(x, x, use_causal_mask=True)
    files = tool.traced_files(layer, x, use_causal_mask=True)
    assert any(f.endswith("layers/dcmha.py") for f in files), files   # the trace sees it
    assert len(files) <= MAX_FILES, files
