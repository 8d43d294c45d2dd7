"""The fused Pallas DCMHA kernel (forward and backward) against its jax.numpy reference and the
NumPy spec, run on CPU in Pallas interpret mode; plus a check that the kernels lower to Triton.

Tolerances are the spec's conformance policy (``dcmha.spec.tolerance``) computed from the
float64 spec result of the same inputs.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the Pallas backend needs JAX")
pytest.importorskip("jax.experimental.pallas", reason="the Pallas backend needs Pallas")

import jax.numpy as jnp  # noqa: E402

from tests import kernel_cases  # noqa: E402
from dcmha.backends import pallas as pb  # noqa: E402
from tests.kernel_cases import TERMS, assert_close  # noqa: E402
DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


def make_problem(seed, *, scores=False, **kwargs):
    """A ``kernel_cases`` problem (B=1, T=11, S=13, N=4, N_kv=2, G=2 unless given); with
    ``scores`` the attention scores are returned and get a cotangent ("ds")."""
    defaults = dict(B=1, T=11, S=13, N=4, N_kv=2, d=8, d_v=4, G=2, R=2)
    return kernel_cases.make_problem(seed, **{**defaults, **kwargs}, scores_grad=scores)


def full_mask(p, mask, causal, window, offset=0):
    return kernel_cases.full_mask(p, mask=mask, causal=causal, sliding_window=window,
                                  query_offset=offset)


def spec_result(p, mask):
    return kernel_cases.spec_result(p, mask, scores=p["ds"] is not None)


def run_jax(fn, p, kw):
    """Forward and gradients of ``fn`` (kernel or reference) in one jit; float32 NumPy out."""
    dt = DTYPES[p["dtype"]]

    def cast(x):
        return None if x is None else jax.tree.map(lambda a: jnp.asarray(a, dt), x)

    args = (cast(p["q"]), cast(p["k"]), cast(p["v"]), cast(p["pre"]), cast(p["post"]))
    with_scores = p["ds"] is not None
    ct = cast(p["do"]) if not with_scores else (cast(p["do"]), cast(p["ds"]))

    @jax.jit
    def go(*args):
        q, k, v, pre, post = args
        out, vjp = jax.vjp(lambda *a: fn(*a[:3], pre=a[3], post=a[4], num_groups=p["G"],
                                        return_attention_scores=with_scores, **kw), *args)
        return out, vjp(ct)

    out, (gq, gk, gv, gpre, gpost) = go(*args)
    res = {"output": out[0] if with_scores else out}
    if with_scores:
        res["attention_scores"] = out[1]
    res.update({"grad/q": gq, "grad/k": gk, "grad/v": gv})
    for stage, g in (("pre", gpre), ("post", gpost)):
        for n, x in (g or {}).items():
            res[f"grad/{stage}/{n}"] = x
    return {n: np.asarray(x.astype(jnp.float32)) for n, x in res.items()}


def check(p, *, mask=None, causal=False, window=None, offset=0, blocks=(4, 8), reference=False):
    """Kernel (and with ``reference`` the jax.numpy reference), forward and gradients, against
    the spec; returns the kernel's. (Both compile slowly on CPU: the reference is checked on
    the richest problems only.)"""
    kw = dict(mask=None if mask is None else jnp.asarray(mask), causal=causal,
              sliding_window=window, query_offset=offset)
    expected, sigma = spec_result(p, full_mask(p, mask, causal, window, offset))
    got = run_jax(lambda *a, **k: pb.dcmha_attention(*a, block_q=blocks[0], block_k=blocks[1],
                                                     interpret=True, **k), p, kw)
    assert_close(got, expected, p["dtype"], sigma, "kernel")
    if reference:
        ref_got = run_jax(pb.dcmha_attention_reference, p, kw)
        assert_close(ref_got, expected, p["dtype"], sigma, "reference")
        assert_close(got, ref_got, p["dtype"], sigma, "kernel vs reference")
    return got


# ---------------------------------------------------------------------------
# Kernel vs reference vs spec
# ---------------------------------------------------------------------------

def test_all_terms_gqa_groups_masks_fully_masked_row():
    """Every term in both stages, G=2, R=2, GQA, causal + window + a general mask with a
    fully masked row; T=11, S=13 in 4x8 tiles (partial tiles both ways), batch 2."""
    p = make_problem(0, B=2)
    rng = np.random.default_rng(1)
    mask = rng.random((2, 11, 13)) < 0.8
    mask[1, 6] = False                               # fully masked row
    got = check(p, mask=mask, causal=True, window=5, reference=True)
    assert np.all(got["output"][1, 6] == 0.0)
    assert np.all(got["grad/q"][1, 6] == 0.0)
    assert all(np.isfinite(g).all() for g in got.values())


def test_one_group_rank_one_bidirectional_window():
    """G=1, R=1, no GQA, a bidirectional sliding window, T=5 < S=9, 4x4 tiles."""
    check(make_problem(2, T=5, S=9, N=2, N_kv=2, G=1, R=1), window=3, blocks=(4, 4))


def test_heads_and_rank_not_powers_of_two():
    """M=3 heads per group and rank R=3 (the kernels pad both to 4 with zero weights), GQA,
    every term in both stages, causal."""
    check(make_problem(7, T=7, S=9, N=6, N_kv=3, G=2, R=3), causal=True)


@pytest.mark.parametrize("unit", [("qw1", "qw2"), ("kw1", "kw2"), ("qdd",), ("kdd",),
                                  ("static",)], ids=lambda u: u[0][:2] if len(u) == 2 else u[0])
def test_each_term_alone(unit):
    """One compose term (a low-rank pair counts as one) in each stage, nothing else."""
    check(make_problem(3, T=6, S=7, pre=unit, post=unit), causal=True)


@pytest.mark.parametrize("pre,post", [(TERMS, None), (None, TERMS), (None, None)],
                         ids=["pre_only", "post_only", "plain_mha"])
def test_one_stage_or_none(pre, post):
    check(make_problem(4, T=6, S=7, pre=pre, post=post), causal=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_dtypes(dtype):
    """Half-precision inputs, float32 compute: within the dtype's conformance tolerance."""
    got = check(make_problem(5, N=2, N_kv=1, G=1, R=1, dtype=dtype), causal=True,
                reference=True)
    assert all(np.isfinite(g).all() for g in got.values())


def test_attention_scores_and_query_offset():
    """Returned scores (and their cotangent) with a causal window at a query offset, as when
    decoding: queries at absolute positions 6..10 over keys 0..12."""
    p = make_problem(6, T=5, S=13, N=2, N_kv=1, G=1, R=1, scores=True)
    got = check(p, causal=True, window=4, offset=6, reference=True)
    allowed = full_mask(p, None, True, 4, 6)
    assert np.all(got["attention_scores"][np.broadcast_to(~allowed[:, None],
                                                          got["attention_scores"].shape)] == 0)


# ---------------------------------------------------------------------------
# API and validation
# ---------------------------------------------------------------------------

def test_import_does_not_import_jax():
    code = ("import sys, dcmha, dcmha.backends.pallas as p; "
            "assert 'jax' not in sys.modules, 'jax imported'; print(p.__all__)")
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert pb.is_available() is True


def test_block_sizes_validation():
    assert pb.BlockSizes(16, 32).backward == (16, 32)
    assert pb.BlockSizes(16, 32, 8, 8).backward == (8, 8)
    with pytest.raises(ValueError, match=r"`block_k` must be a positive power of two\. "
                                         r"Received: block_k=24"):
        pb.BlockSizes(16, 24)


def _qkv(T=4, S=5, N=4, N_kv=2, d=8):
    return jnp.zeros((1, T, N, d)), jnp.zeros((1, S, N_kv, d)), jnp.zeros((1, S, N_kv, d))


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_groups=3), "`num_groups` must divide the number of heads N=4. "
                         "Received: num_groups=3"),
    (dict(num_groups=2, mask=jnp.ones((1, 4, 4), bool)),
     "`mask` must broadcast to (B, T, S) = (1, 4, 5). Received: mask.shape=(1, 4, 4)"),
    (dict(num_groups=2, pre={"qw1": jnp.zeros((1, 4, 2, 2, 2))}),
     "`pre` must have both 'qw1' and 'qw2' or neither. Received: ['qw1']"),
    (dict(num_groups=2, post={"kdd": jnp.zeros((1, 4, 2, 2))}),
     "`post['kdd']` must have shape (B, S, G, M) = (1, 5, 2, 2). "
     "Received: post['kdd'].shape=(1, 4, 2, 2)"),
    (dict(num_groups=2, pre={"gate": jnp.zeros(3)}),
     "`pre` has unknown compose terms ['gate']. Expected a subset of "
     "['kdd', 'kw1', 'kw2', 'qdd', 'qw1', 'qw2', 'static']"),
    (dict(num_groups=2, sliding_window=0),
     "`sliding_window` must be None or a positive integer. Received: sliding_window=0"),
    (dict(num_groups=2, block_q=16, block_sizes=None), None),
])
def test_argument_validation(kwargs, message):
    q, k, v = _qkv()
    if message is None:   # a valid call: shape and dtype of the result
        o = pb.dcmha_attention(q, k, v, interpret=True, **kwargs)
        assert o.shape == (1, 4, 4, 8) and o.dtype == q.dtype
        return
    for fn in (pb.dcmha_attention, pb.dcmha_attention_reference):
        with pytest.raises(ValueError) as info:
            fn(q, k, v, **kwargs)
        assert str(info.value) == message


def test_argument_validation_shapes_and_blocks():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"`q` and `k` must have the same head size d\. "
                                         r"Received: q.shape=\(1, 4, 4, 8\), "
                                         r"k.shape=\(1, 5, 2, 6\)"):
        pb.dcmha_attention(q, jnp.zeros((1, 5, 2, 6)), v, num_groups=1)
    with pytest.raises(ValueError, match=r"The heads of `q` \(N=4\) must be a multiple of the "
                                         r"heads of `k` \(N_kv=3\)\. Received: "):
        pb.dcmha_attention(q, jnp.zeros((1, 5, 3, 8)), jnp.zeros((1, 5, 3, 8)), num_groups=1)
    with pytest.raises(ValueError, match=r"Pass either `block_sizes` or `block_q`/`block_k`"):
        pb.dcmha_attention(q, k, v, num_groups=1, block_q=16, block_sizes=pb.BlockSizes())
    with pytest.raises(ValueError, match=r"GPU tiles must be at least 16\."):
        pb.dcmha_attention(q, k, v, num_groups=1, block_q=8, interpret=False)
    with pytest.raises(TypeError, match=r"`q` must be a floating array\. Received: q.dtype=int32"):
        pb.dcmha_attention(q.astype(jnp.int32), k, v, num_groups=1)


# ---------------------------------------------------------------------------
# GPU validity: the kernels lower to Triton (no GPU needed to lower)
# ---------------------------------------------------------------------------

def _export_for_cuda(N=6, G=2, R=2, N_kv=3, T=40, S=72):
    """Lower forward + backward (half inputs, GQA, non-power-of-two M, N_kv, d, all terms,
    mask, causal window, returned scores) for CUDA; returns the exported module text."""
    from jax import export

    B, d, d_v = 2, 12, 8
    M = N // G
    sd = lambda *s, dt=jnp.float16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
    terms = dict(qw1=sd(B, T, G, R, M), qw2=sd(B, T, G, R, M), kw1=sd(B, S, G, R, M),
                 kw2=sd(B, S, G, R, M), qdd=sd(B, T, G, M), kdd=sd(B, S, G, M),
                 static=sd(G, M, M, dt=jnp.float32))

    def f(q, k, v, pre, post, mask, do, dsc):
        def attn(q, k, v, pre, post):
            return pb.dcmha_attention(q, k, v, num_groups=G, pre=pre, post=post, mask=mask,
                                      causal=True, sliding_window=20,
                                      return_attention_scores=True,
                                      block_sizes=pb.BlockSizes(16, 32, 16, 16),
                                      interpret=False)
        out, vjp = jax.vjp(attn, q, k, v, pre, post)
        return out, vjp((do, dsc))

    exp = export.export(jax.jit(f), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(
                            "__gpu$xla.gpu.triton")])
    return exp(sd(B, T, N, d), sd(B, S, N_kv, d), sd(B, S, N_kv, d_v), terms, terms,
               sd(B, T, S, dt=jnp.bool_), sd(B, T, N, d_v), sd(B, N, T, S)).mlir_module()


def _triton_modules(**sizes):
    """The Triton IR text of the three kernels of ``_export_for_cuda(**sizes)``."""
    from jax._src.pallas.triton import lowering

    modules = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        _export_for_cuda(**sizes)
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    assert len(modules) == 3
    return modules


def test_kernels_lower_to_triton():
    text = _export_for_cuda()
    for name in ("dcmha_forward", "dcmha_backward_rows", "dcmha_backward_cols"):
        assert f'name = "{name}"' in text, name


def test_kernel_code_does_not_grow_with_heads_or_rank():
    """The kernels loop over heads and ranks at run time: 8 heads per group of rank 4 lower
    to the same Triton operations as 2 heads of rank 2 (only tensor sizes and constants
    differ)."""
    def ops(text):   # the operation of each line (tt.dot, arith.addf, scf.for, ...)
        found = map(re.compile(r"\b[a-z_]+\.[a-z_.]+\b").search, text.splitlines())
        return [m.group(0) for m in found if m and m.group(0) != "arith.constant"]

    small = _triton_modules(N=4, G=2, R=2, N_kv=2)
    large = _triton_modules(N=16, G=2, R=4, N_kv=8)
    for a, b in zip(small, large):
        assert ops(a) == ops(b)


def test_one_kernel_serves_the_lengths_of_one_padding():
    """The lengths and the query offset are runtime values: T=37, S=70 and T=40, S=72 (both
    padded to 48 x 96 for these tiles) lower to the same three kernels, character for
    character, and T=60 (padded to 64) to other ones."""
    base = _triton_modules()
    assert _triton_modules(T=37, S=70) == base
    assert _triton_modules(T=60) != base


@pytest.mark.skipif(not os.environ.get("DCMHA_SLOW_TESTS"),
                    reason="compiling to sm_90 cubins takes ~15 s on 2 cores; set DCMHA_SLOW_TESTS=1")
def test_kernels_compile_to_cubin():
    """The Triton IR of every kernel compiles to an sm_90 cubin with the triton package."""
    pytest.importorskip("triton")
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget

    modules = _triton_modules()
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(modules):
            path = os.path.join(tmp, f"kernel{i}.ttir")
            with open(path, "w") as f:
                f.write(text)
            compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=4, num_stages=2))
            assert compiled.asm["cubin"]
