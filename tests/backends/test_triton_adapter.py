"""The impl-triton conformance adapter (the layer forced onto "triton", interpreted on CPU) on a
few fixtures, in this process.

The full suite runs with ``python -m dcmha.conformance --backend impl-triton``, whose worker
gets ``TRITON_INTERPRET=1`` from the runner (the implementation's ``cpu_env``); this test runs
in the triton-interpret step of tools/test_all.py, which sets it for the whole process. It
checks the adapter's wiring (gradients, decode, a half dtype, masks) and its capabilities.
"""

import os
import sys

import pytest

if "tensorflow" in sys.modules:  # importing Triton after TensorFlow aborts the process
    pytest.skip("Triton tests must run in a process without TensorFlow", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("KERAS_BACKEND") != "torch":
    pytest.skip("runs with TRITON_INTERPRET=1 KERAS_BACKEND=torch (the triton-interpret step)",
                allow_module_level=True)
pytest.importorskip("torch", reason="the Triton backend needs PyTorch")
pytest.importorskip("triton", reason="the Triton backend needs Triton")

from dcmha.conformance import load_case  # noqa: E402
from dcmha.conformance.adapters.keras_adapter import implementation_adapter  # noqa: E402
from dcmha.conformance.runner import run_case  # noqa: E402


@pytest.fixture(scope="module")
def adapter():
    return implementation_adapter("triton")


@pytest.mark.parametrize("name", ["grad_all_switches", "decode_all_switches",
                                  "fully_masked_rows_bfloat16"])
def test_fixture_passes(adapter, name):
    case = load_case(name)
    result = run_case(adapter.name, adapter, case)
    assert result.status == "PASS", f"{name}: {result.reason}\n{result.details}"
    assert {o["name"] for o in result.outputs} == set(case.outputs)
    assert result.not_covered == [] and result.paths == ["triton"]


@pytest.mark.parametrize("name,reason", [
    ("intermediates_dcmha", "needs intermediates; impl-triton lacks it"),
    ("long_dcmha_causal", "needs long_sequences; impl-triton lacks it"),
])
def test_cases_it_lacks_are_skipped(adapter, name, reason):
    result = run_case(adapter.name, adapter, load_case(name))
    assert (result.status, result.reason) == ("SKIP", reason)
