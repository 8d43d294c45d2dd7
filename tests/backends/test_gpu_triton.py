"""The fused Triton kernels compiled for a CUDA GPU (forward and backward) against the NumPy spec.

Skipped without a CUDA device. ``test_triton_kernel.py`` runs the same kernels through Triton's
interpreter on CPU at tiny shapes; this module runs them compiled, on the cases of
``kernel_cases.GPU_CASES`` (several whole and partial tiles, head dims and head groups that are
not powers of two, the GPU's tile sizes). Run it in a process of its own
(``python -m pytest tests/backends/test_gpu_triton.py``): Triton fixes interpreted or compiled
when it is first imported. The whole set of GPU checks: ``benchmarks/gpu_check.sh``.

Tolerances are the spec's conformance policy (``dcmha.spec.tolerance``) computed from the
float64 spec result of the same inputs, as in the interpreter tests.
"""

import importlib
import os
import sys

import pytest

if "tensorflow" in sys.modules:  # importing Triton after TensorFlow aborts the process
    pytest.skip("Triton tests must run in a process without TensorFlow", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
    pytest.skip("TRITON_INTERPRET is set: these tests run the compiled kernels",
                allow_module_level=True)
torch = pytest.importorskip("torch", reason="the Triton backend needs PyTorch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the compiled Triton kernels)", allow_module_level=True)
pytest.importorskip("triton", reason="the Triton backend needs Triton")

from tests import kernel_cases  # noqa: E402

kernel = importlib.import_module("dcmha.backends.triton.dcmha_triton")
if kernel._interpreting():
    pytest.skip("Triton was loaded for its interpreter in this process",
                allow_module_level=True)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def run(p, mask, call_args, tiles):
    """Kernel output, attention scores and gradients on the GPU, as float64 NumPy."""
    dt = TORCH_DTYPES[p["dtype"]]

    def t(x):
        return torch.tensor(x, dtype=dt, device="cuda", requires_grad=True)

    leaves = {"q": t(p["q"]), "k": t(p["k"]), "v": t(p["v"])}
    stages = {}
    for st in ("pre", "post"):
        stages[st] = None if p[st] is None else {n: t(x) for n, x in p[st].items()}
        leaves.update({f"{st}/{n}": x for n, x in (stages[st] or {}).items()})
    kwargs = dict(call_args, mask=None if mask is None else torch.tensor(mask, device="cuda"))
    if tiles is not None:
        kwargs.update(block_q=tiles[0], block_k=tiles[1])
    o, scores = kernel.dcmha_attention(leaves["q"], leaves["k"], leaves["v"], num_groups=p["G"],
                                       pre=stages["pre"], post=stages["post"],
                                       return_attention_scores=True, **kwargs)
    assert o.is_cuda and o.dtype == dt
    names = list(leaves)
    grads = torch.autograd.grad(o, [leaves[n] for n in names],
                                torch.tensor(p["do"], dtype=dt, device="cuda"))
    res = {"output": o, "attention_scores": scores}
    res.update({"grad/" + n: g for n, g in zip(names, grads)})
    return {n: x.detach().to(torch.float64).cpu().numpy() for n, x in res.items()}


@pytest.mark.parametrize("case", kernel_cases.GPU_CASES, ids=[c[0] for c in kernel_cases.GPU_CASES])
def test_compiled_kernel_matches_spec(case):
    kernel_cases.check_gpu_case(case, run, scores_grad=False)   # the scores are not differentiable
