"""The fused Triton DCMHA kernel (forward and backward) against its PyTorch reference and the
NumPy spec, run on CPU through Triton's interpreter.

Tolerances are the spec's conformance policy (``dcmha.spec.tolerance``) computed from the
float64 spec result of the same inputs.
"""

import os
import sys

import pytest

if "tensorflow" in sys.modules:  # importing Triton after TensorFlow aborts the process
    pytest.skip("Triton tests must run in a process without TensorFlow", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"   # before Triton is imported: CPU tensors, interpreter

torch = pytest.importorskip("torch", reason="the Triton backend needs PyTorch")
pytest.importorskip("triton", reason="the Triton backend needs Triton")

import functools  # noqa: E402

import numpy as np  # noqa: E402

from tests import kernel_cases  # noqa: E402
from dcmha.backends import triton as tb  # noqa: E402
from dcmha.backends.triton import dcmha_triton  # noqa: E402
from tests.kernel_cases import TERMS, assert_close, spec_result  # noqa: E402
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BLOCKS = dict(block_q=8, block_k=8)   # T = 11, S = 9: two partial-tile blocks each way


#: The Triton tests' default problem: T = 11, S = 9 (two partial-tile blocks each way).
make_problem = functools.partial(kernel_cases.make_problem, B=1, T=11, S=9, N=4, N_kv=4, d=8,
                                 d_v=8, G=1, R=2)


def torch_inputs(p, dtype):
    dt = TORCH_DTYPES[dtype]

    def t(x):
        return torch.tensor(x, dtype=dt, requires_grad=True)

    leaves = {"q": t(p["q"]), "k": t(p["k"]), "v": t(p["v"])}
    stages = {}
    for st in ("pre", "post"):
        if p[st] is None:
            stages[st] = None
            continue
        stages[st] = {n: t(x) for n, x in p[st].items()}
        leaves.update({f"{st}/{n}": x for n, x in stages[st].items()})
    return leaves, stages


def run(fn, p, dtype, kwargs):
    """fn's output, attention scores and gradients (float64 NumPy), keyed like spec_result."""
    leaves, stages = torch_inputs(p, dtype)
    o, scores = fn(leaves["q"], leaves["k"], leaves["v"], num_groups=p["G"], pre=stages["pre"],
                   post=stages["post"], return_attention_scores=True, **kwargs)
    assert o.dtype == TORCH_DTYPES[dtype] and o.shape == leaves["q"].shape[:3] + (p["v"].shape[3],)
    names = list(leaves)
    grads = torch.autograd.grad(o, [leaves[n] for n in names],
                                torch.tensor(p["do"], dtype=o.dtype))
    res = {"output": o, "attention_scores": scores}
    res.update({"grad/" + n: g for n, g in zip(names, grads)})
    return {n: x.detach().to(torch.float64).numpy() for n, x in res.items()}


def check(p, dtype="float32", *, mask=None, causal=False, sliding_window=None, query_offset=0,
          blocks=BLOCKS, against_torch=True):
    full = kernel_cases.full_mask(p, mask=mask, causal=causal, sliding_window=sliding_window,
                                  query_offset=query_offset)
    expected, sigma = spec_result(p, full)
    kwargs = dict(causal=causal, sliding_window=sliding_window, query_offset=query_offset,
                  mask=None if mask is None else torch.tensor(mask))
    got = run(tb.dcmha_attention, p, dtype, dict(kwargs, **blocks))
    assert_close(got, expected, dtype, sigma, "kernel vs spec")
    if against_torch:
        assert_close(run(tb.dcmha_attention_reference, p, dtype, kwargs), expected, dtype, sigma,
                     "torch reference vs spec")
    return got


# ---------------------------------------------------------------------------
# Compose terms, alone and together
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("stage", ["pre", "post"])
@pytest.mark.parametrize("term", ["qw", "kw", "qdd", "kdd", "static"])
def test_each_term_alone(stage, term):
    names = (term + "1", term + "2") if term in ("qw", "kw") else (term,)
    p = make_problem(1, pre=names if stage == "pre" else None,
                     post=names if stage == "post" else None)
    check(p, against_torch=False)


def test_plain_attention_and_identity_compose():
    p = make_problem(2, pre=None, post=None)
    got = check(p)
    q = make_problem(2, pre=(), post=())      # stages on, every term off: identity compose
    np.testing.assert_allclose(check(q)["output"], got["output"], rtol=0, atol=1e-6)


def test_all_terms_both_stages_two_groups_gqa():
    check(make_problem(3, B=2, N=4, N_kv=2, G=2, R=2))


@pytest.mark.parametrize("G,R,N_kv", [(1, 1, 1), (2, 1, 4), (1, 2, 2)])
def test_groups_rank_gqa(G, R, N_kv):
    check(make_problem(4, G=G, R=R, N_kv=N_kv), causal=True, against_torch=False)


# ---------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal,window", [(True, None), (False, 3), (True, 4)])
def test_causal_and_sliding_window(causal, window):
    check(make_problem(5, N_kv=2), causal=causal, sliding_window=window)


@pytest.mark.parametrize("post", [None, ("kdd",)])
def test_tile_ranges(post):
    """Key / query block ranges of causal and window masks, across tile boundaries."""
    p = make_problem(9, T=11, S=13, N=2, N_kv=1, G=1, d=4, d_v=4, pre=None, post=post)
    for causal, window, offset in [(True, None, 0), (True, None, 3), (False, 1, 0), (False, 2, 2),
                                   (True, 3, 0), (True, 4, 2), (False, 6, 0), (True, 5, 5)]:
        check(p, causal=causal, sliding_window=window, query_offset=offset,
              blocks=dict(block_q=4, block_k=2), against_torch=False)


def test_general_mask_with_fully_masked_row():
    p = make_problem(6, B=2, N_kv=2, G=2, d_v=4)
    mask = np.random.default_rng(6).random((2, 11, 9)) > 0.4
    mask[0, 3] = False
    mask[1, 9] = False
    got = check(p, mask=mask, causal=True)
    assert np.all(got["output"][0, 3] == 0.0) and np.all(got["output"][1, 9] == 0.0)
    assert np.all(got["grad/q"][0, 3] == 0.0)
    assert np.all(got["attention_scores"][np.broadcast_to(~mask[:, None], (2, 4, 11, 9))] == 0.0)


def test_broadcast_mask_and_single_tile_defaults():
    p = make_problem(7, T=5, S=7, N_kv=2)
    mask = np.random.default_rng(7).random((1, 1, 7)) > 0.3
    check(p, mask=mask, blocks={}, against_torch=False)   # BlockSizes(): one 16 x 16 tile


# ---------------------------------------------------------------------------
# Dtypes
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_dtypes(dtype):
    p = make_problem(8, N_kv=2, G=2, dtype=dtype)
    check(p, dtype, causal=True)


# ---------------------------------------------------------------------------
# API
# ---------------------------------------------------------------------------

def test_fitted_tiles_and_warps():
    """Tiles shrink to TILE_ELEMENTS per (heads, rows, columns) tile, warps follow the
    largest tile at ELEMENTS_PER_WARP each, between the requested count and 8."""
    small = dcmha_triton.fitted(tb.BlockSizes(16, 16), M=1, d=8, d_v=8)
    assert (small.block_q, small.block_k, small.num_warps) == (16, 16, 4)
    # 4 heads x 32 x 32: 8 warps' worth of elements
    heads, rows = 4, 32
    assert heads * rows * rows == 8 * dcmha_triton.ELEMENTS_PER_WARP
    mid = dcmha_triton.fitted(tb.BlockSizes(rows, rows), M=heads, d=8, d_v=8)
    assert (mid.block_q, mid.block_k, mid.num_warps) == (rows, rows, 8)
    big = dcmha_triton.fitted(tb.BlockSizes(128, 128), M=16, d=128, d_v=128)
    assert big.num_warps == 8
    # halved down to the floor of 16 (16 heads x 16 x 128 is still over the bound)
    assert (big.block_q, big.block_k) == (16, 16)
    assert 16 * 16 * 128 > dcmha_triton.TILE_ELEMENTS
    wide = dcmha_triton.fitted(tb.BlockSizes(128, 64), M=4, d=64, d_v=64)
    assert 4 * max(wide.block_q, wide.block_k) * 64 <= dcmha_triton.TILE_ELEMENTS
    assert 4 * 2 * max(wide.block_q, wide.block_k) * 64 > dcmha_triton.TILE_ELEMENTS
    assert wide.block_q >= wide.block_k and wide.num_warps == 8


def test_block_sizes_and_argument_errors():
    assert tb.is_available(interpret=True)
    assert tb.BlockSizes() == tb.BlockSizes(block_q=16, block_k=16, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match=r"`block_q` must be a positive power of two\. "
                                         r"Received: block_q=12"):
        tb.BlockSizes(block_q=12)
    q, k, v = torch.zeros(1, 3, 4, 8), torch.zeros(1, 5, 2, 8), torch.zeros(1, 5, 2, 8)
    with pytest.raises(ValueError, match=r"`num_groups` must divide the number of heads N=4\. "
                                         r"Received: num_groups=3"):
        tb.dcmha_attention(q, k, v, num_groups=3)
    with pytest.raises(ValueError, match=r"`pre\['qdd'\]` must have shape \(B, T, G, M\) = "
                                         r"\(1, 3, 2, 2\)\. Received: pre\['qdd'\]\.shape="
                                         r"\(1, 3, 2\)"):
        tb.dcmha_attention(q, k, v, num_groups=2, pre={"qdd": torch.zeros(1, 3, 2)})
    with pytest.raises(ValueError, match=r"`post` must have both 'kw1' and 'kw2' or neither"):
        tb.dcmha_attention(q, k, v, num_groups=1, post={"kw1": torch.zeros(1, 5, 1, 2, 4)})
    with pytest.raises(ValueError, match=r"`pre` has unknown compose terms \['w1'\]"):
        tb.dcmha_attention(q, k, v, num_groups=1, pre={"w1": None})
    with pytest.raises(TypeError, match=r"`mask` must be boolean \(True = attend\) or integer"):
        tb.dcmha_attention(q, k, v, num_groups=1, mask=torch.ones(1, 3, 5))
    with pytest.raises(ValueError, match=r"`mask` must broadcast to \(B, T, S\) = \(1, 3, 5\)\. "
                                         r"Received: mask\.shape=\(1, 3, 4\)"):
        tb.dcmha_attention(q, k, v, num_groups=1, mask=torch.ones(1, 3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"`q`, `k` and `v` must share one dtype"):
        tb.dcmha_attention(q.half(), k, v, num_groups=1)
    with pytest.raises(TypeError, match=r"`q` must be float32, float16 or bfloat16\. "
                                        r"Received: q\.dtype=torch\.float64"):
        tb.dcmha_attention(q.double(), k.double(), v.double(), num_groups=1)
    with pytest.raises(ValueError, match=r"`interpret=False` does not match this process"):
        tb.dcmha_attention(q, k, v, num_groups=1, interpret=False)


@pytest.mark.parametrize("B,T,S", [(1, 0, 3), (1, 3, 0), (0, 3, 3)])
def test_empty_sizes(B, T, S):
    """No query, key or batch: zeros of the right shapes, as the reference gives."""
    q = torch.randn(B, T, 4, 4, requires_grad=True)
    k = torch.randn(B, S, 2, 4, requires_grad=True)
    v = torch.randn(B, S, 2, 4, requires_grad=True)
    post = {"static": torch.randn(2, 2, 2, requires_grad=True),
            "kdd": torch.randn(B, S, 2, 2, requires_grad=True)}
    leaves = [q, k, v, post["static"], post["kdd"]]
    results = []
    for fn in (tb.dcmha_attention, tb.dcmha_attention_reference):
        o = fn(q, k, v, num_groups=2, post=post, causal=True)
        results.append([o] + list(torch.autograd.grad(o.sum(), leaves)))
    for got, want in zip(*results):
        assert got.shape == want.shape and torch.equal(got, want)
