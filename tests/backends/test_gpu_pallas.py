"""The fused Pallas kernels compiled for a GPU (forward and backward) against the NumPy spec.

Skipped unless JAX's default backend is a GPU. ``test_pallas_kernel.py`` runs the same kernels
in Pallas interpret mode on CPU at tiny shapes; this module runs them compiled (through
Triton), on the cases of ``kernel_cases.GPU_CASES`` (several whole and partial tiles, head dims
and head groups that are not powers of two, the GPU's tile sizes), with a cotangent on the
returned scores too. The whole set of GPU checks: ``benchmarks/gpu_check.sh``.

Tolerances are the spec's conformance policy (``dcmha.spec.tolerance``) computed from the
float64 spec result of the same inputs, as in the interpreter tests.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the Pallas backend needs JAX")
pytest.importorskip("jax.experimental.pallas", reason="the Pallas backend needs Pallas")
if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU as JAX's default backend (the compiled Pallas kernels)",
                allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

from tests import kernel_cases  # noqa: E402
from dcmha.backends import pallas as pb  # noqa: E402

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


def run(p, mask, call_args, tiles):
    """Kernel forward and gradients (one jit, on the GPU), as float64 NumPy."""
    dt = DTYPES[p["dtype"]]

    def cast(x):
        return None if x is None else jax.tree.map(lambda a: jnp.asarray(a, dt), x)

    args = (cast(p["q"]), cast(p["k"]), cast(p["v"]), cast(p["pre"]), cast(p["post"]))
    ct = (cast(p["do"]), cast(p["ds"]))
    kw = dict(call_args, mask=None if mask is None else jnp.asarray(mask),
              block_sizes=pb.BlockSizes() if tiles is None else pb.BlockSizes(*tiles))

    @jax.jit
    def go(*args):
        out, vjp = jax.vjp(lambda *a: pb.dcmha_attention(
            *a[:3], pre=a[3], post=a[4], num_groups=p["G"], return_attention_scores=True,
            interpret=False, **kw), *args)
        return out, vjp(ct)

    (o, scores), (gq, gk, gv, gpre, gpost) = go(*args)
    assert o.devices() == {jax.devices("gpu")[0]} and o.dtype == dt
    res = {"output": o, "attention_scores": scores, "grad/q": gq, "grad/k": gk, "grad/v": gv}
    for stage, g in (("pre", gpre), ("post", gpost)):
        res.update({f"grad/{stage}/{n}": x for n, x in (g or {}).items()})
    return {n: np.asarray(x.astype(jnp.float32), np.float64) for n, x in res.items()}


@pytest.mark.parametrize("case", kernel_cases.GPU_CASES, ids=[c[0] for c in kernel_cases.GPU_CASES])
def test_compiled_kernel_matches_spec(case):
    kernel_cases.check_gpu_case(case, run, scores_grad=True)
