"""The triton-interpret conformance adapter on a few fixtures, in this process.

The full suite runs with ``python -m dcmha.conformance --backend triton-interpret``; this
checks the adapter's wiring (gradients, decode, a half dtype, masks) on three cases.
"""

import os
import sys

import pytest

if "tensorflow" in sys.modules:  # importing Triton after TensorFlow aborts the process
    pytest.skip("Triton tests must run in a process without TensorFlow", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"   # before Triton is imported: CPU tensors, interpreter

pytest.importorskip("torch", reason="the Triton backend needs PyTorch")
pytest.importorskip("triton", reason="the Triton backend needs Triton")

from dcmha.conformance import load_case  # noqa: E402
from dcmha.conformance.runner import run_case  # noqa: E402
from dcmha.conformance.adapters.triton_adapter import TritonInterpretAdapter  # noqa: E402


@pytest.fixture(scope="module")
def adapter():
    return TritonInterpretAdapter()


@pytest.mark.parametrize("name", ["grad_all_switches", "decode_all_switches",
                                  "fully_masked_rows_bfloat16"])
def test_fixture_passes(adapter, name):
    case = load_case(name)
    result = run_case(adapter.name, adapter, case)
    assert result.status == "PASS", f"{name}: {result.reason}\n{result.details}"
    assert {o["name"] for o in result.outputs} == set(case.outputs)


def test_intermediates_are_skipped(adapter):
    result = run_case(adapter.name, adapter, load_case("intermediates_dcmha"))
    assert (result.status, result.reason) == (
        "SKIP", "needs intermediates; triton-interpret lacks it")


def test_refuses_a_process_with_tensorflow(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", object())
    with pytest.raises(RuntimeError, match="cannot run in a process that has imported "
                                           "TensorFlow"):
        TritonInterpretAdapter()
