"""Random fused-kernel problems and their float64 truth by the NumPy spec (framework-free).

Shared by the kernel tests (torch core, JAX CPU core, Triton, Pallas): a problem is q, k, v,
the pre / post compose terms, the output cotangent dO and optionally the attention scores'
cotangent dScores, all exactly representable in the tested dtype; ``spec_result`` gives the
forward and every gradient of sum(o * dO) (+ sum(scores * dScores)) by ``spec/reference.py``
and the hand-written backward of ``spec/reference_grad.py``; ``assert_close`` applies the
conformance tolerance policy (``dcmha.spec.tolerance``) computed from that result.
"""

import importlib
import math

import numpy as np

from dcmha.spec import reference as ref
from dcmha.spec import reference_grad as ref_grad
from dcmha.spec import terms as spec_terms
from dcmha.spec import tolerance as tol

#: The kernel CPU path of each Keras backend that has one.
CPU_PATHS = {"jax": "jax_cpu", "tensorflow": "tf_cpu"}


def cpu_path_or_skip():
    """(Keras backend, path name, the path's kernel module) for the jax_cpu / tf_cpu tests;
    skips the calling test module on the other Keras backends."""
    import pytest

    keras = pytest.importorskip("keras")
    backend = keras.backend.backend()
    if backend not in CPU_PATHS:
        pytest.skip("the kernel CPU paths run on the Keras jax and tensorflow backends",
                    allow_module_level=True)
    path = CPU_PATHS[backend]
    return backend, path, importlib.import_module(f"dcmha.backends.{path}.dcmha_{path}")

TERMS = spec_terms.TERM_NAMES


def make_problem(seed, *, B=2, T=11, S=9, N=4, N_kv=2, d=8, d_v=6, G=1, R=2, pre=TERMS,
                 post=TERMS, dtype="float32", scores_grad=False):
    """Random q, k, v, stage dicts, dO (and dScores as "ds") as float64 arrays in dtype."""
    rng = np.random.default_rng(seed)
    M = N // G

    def arr(*shape, scale=1.0):
        return tol.round_to_dtype(rng.normal(0.0, scale, size=shape), dtype)

    sizes = dict(B=B, T=T, S=S, G=G, R=R, M=M)

    def stage(names):
        return None if names is None else {
            n: arr(*spec_terms.term_shape(n, sizes), scale=0.5) for n in names}

    return dict(q=arr(B, T, N, d), k=arr(B, S, N_kv, d), v=arr(B, S, N_kv, d_v), G=G,
                pre=stage(pre), post=stage(post), do=arr(B, T, N, d_v),
                ds=arr(B, N, T, S) if scores_grad else None, dtype=dtype)


def full_mask(p, *, mask=None, causal=False, sliding_window=None, query_offset=0):
    """The (B, T, S) mask of a call on problem p (``mask`` broadcasting to it, or None)."""
    B, T, S = p["q"].shape[0], p["q"].shape[1], p["k"].shape[1]
    return ref.make_mask(B, T, S, attention_mask=None if mask is None else np.broadcast_to(
        mask, (B, T, S)), use_causal_mask=causal, sliding_window=sliding_window,
        query_offset=query_offset)


def spec_result(p, mask, *, scores=True):
    """Forward and gradients by the NumPy spec (float64); mask: the full (B, T, S) mask.

    Keys: "output", "attention_scores" (with ``scores``), "grad/q", "grad/k", "grad/v",
    "grad/pre/<term>", "grad/post/<term>". Returns ({name: array}, sigma).
    """
    f64 = {n: np.asarray(p[n], np.float64) for n in ("q", "k", "v", "do")}
    pre = {n: np.asarray(x, np.float64) for n, x in (p["pre"] or {}).items()}
    post = {n: np.asarray(x, np.float64) for n, x in (p["post"] or {}).items()}
    q, k, v, do = f64["q"], f64["k"], f64["v"], f64["do"]
    G, rep, scale = p["G"], q.shape[2] // k.shape[2], 1.0 / math.sqrt(q.shape[3])
    kh, vh = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    a = np.einsum("btnh,bsnh->bnts", q, kh) * scale
    A = ref.compose(a, G, **pre) if p["pre"] is not None else a
    P = ref.masked_softmax(A, mask)
    P2 = ref.compose(P, G, **post) if p["post"] is not None else P
    P3 = np.where(mask[:, None], P2, 0.0)
    out = {"output": np.einsum("bnts,bsnh->btnh", P3, vh)}
    if scores:
        out["attention_scores"] = P3
    dP3 = np.einsum("btnh,bsnh->bnts", do, vh)
    if p.get("ds") is not None:
        dP3 = dP3 + p["ds"]
    dP2 = np.where(mask[:, None], dP3, 0.0)
    dP, g_post = (ref_grad.compose_backward(P, dP2, G, **post) if p["post"] is not None
                  else (dP2, {}))
    dA = ref_grad.masked_softmax_backward(P, dP, mask)
    da, g_pre = (ref_grad.compose_backward(a, dA, G, **pre) if p["pre"] is not None
                 else (dA, {}))
    B, S, N_kv = k.shape[:3]
    out["grad/q"] = np.einsum("bnts,bsnh->btnh", da, kh) * scale
    out["grad/k"] = (np.einsum("bnts,btnh->bsnh", da, q) * scale).reshape(
        B, S, N_kv, rep, -1).sum(3)
    out["grad/v"] = np.einsum("bnts,btnh->bsnh", P3, do).reshape(B, S, N_kv, rep, -1).sum(3)
    out.update({f"grad/pre/{n}": g for n, g in g_pre.items()})
    out.update({f"grad/post/{n}": g for n, g in g_post.items()})
    return out, tol.score_scale(A, mask)


def assert_close(got, expected, dtype, sigma, what):
    """Every array of ``got`` within the policy's tolerance of the float64 ``expected``."""
    assert set(got) == set(expected), (what, sorted(got), sorted(expected))
    tolerances = tol.case_tolerances(expected, sorted(expected), dtype, sigma)
    for name in sorted(expected):
        t = tolerances[name]
        g, e = got[name], expected[name]
        assert g.shape == e.shape, (what, name, g.shape, e.shape)
        assert np.all(np.isfinite(g)), (what, name)
        err = np.abs(g - e) - (t["atol"] + t["rtol"] * np.abs(e))
        assert np.all(err <= 0), (f"{what} {name}: max |err| {np.abs(g - e).max():.3g} "
                                  f"exceeds tolerance {t} by {err.max():.3g}")


# ---------------------------------------------------------------------------
# Compiled-kernel (GPU) cases, shared by test_gpu_triton.py and test_gpu_pallas.py
# ---------------------------------------------------------------------------

#: B=2, T=70, S=90 (whole and partial tiles at 16, 32 and 64), N=6, N_kv=3 (GQA), d=24,
#: d_v=40 (padded inside the kernels), G=2 (M=3: not a power of two), R=2.
GPU_SIZES = dict(B=2, T=70, S=90, N=6, N_kv=3, d=24, d_v=40, G=2, R=2)


def _general_mask(seed, shape, masked_row=None):
    mask = np.random.default_rng(seed).random(shape) < 0.8
    if masked_row is not None:
        mask[masked_row] = False
    return mask


#: (id, make_problem arguments, mask or None, call arguments, tiles (block_q, block_k[,
#: block_q_bwd, block_k_bwd]) or None for the kernel's default); ``dtype`` in the problem.
GPU_CASES = [
    # every term in both stages, causal + window + a general mask with a fully masked row
    (f"all_terms_mask_window_{name}", dict(seed=0), _general_mask(1, (2, 70, 90), (1, 33)),
     dict(causal=True, sliding_window=41), tiles)
    for name, tiles in (("default_tiles", None), ("16x16", (16, 16)),
                        ("32x64_bwd16x32", (32, 64, 16, 32)))
] + [
    ("pre_only", dict(seed=2, post=None), None, dict(causal=True), (32, 32)),
    ("post_only", dict(seed=2, pre=None), None, dict(causal=True), (32, 32)),
    ("plain", dict(seed=2, pre=None, post=None), None, dict(causal=True), (32, 32)),
    ("mixed_terms", dict(seed=2, pre=("qw1", "qw2", "kdd"), post=("kw1", "kw2", "static")),
     None, dict(causal=True), (64, 16)),
    ("chunk_offset_padding_mask", dict(seed=3, T=37, S=130, N=4, N_kv=2, G=1, R=1),
     _general_mask(3, (2, 1, 130)), dict(causal=True, query_offset=93), (16, 32)),
    ("float16", dict(seed=4, dtype="float16"), None, dict(causal=True), (32, 32)),
    ("bfloat16", dict(seed=4, dtype="bfloat16"), None, dict(causal=True), (32, 32)),
    ("d128_T300_bfloat16", dict(seed=5, B=1, T=300, S=300, N=8, N_kv=8, d=128, d_v=128, G=1,
                                dtype="bfloat16"), None, dict(causal=True), (64, 64)),
]


def check_gpu_case(case, run, *, scores_grad):
    """Run one ``GPU_CASES`` case through ``run(problem, mask, call_args, tiles)`` (the kernel's
    output, "attention_scores" and gradients as float64 NumPy, named like ``spec_result``)
    and check it against the spec (with ``scores_grad`` the scores get a cotangent too):
    every array within the policy's tolerance, and masked probabilities, fully masked rows'
    outputs and their query gradients exactly zero."""
    _, problem_args, mask, call_args, tiles = case
    problem_args = dict(problem_args)
    p = make_problem(problem_args.pop("seed"), **{**GPU_SIZES, **problem_args},
                     scores_grad=scores_grad)
    full = full_mask(p, mask=mask, **call_args)
    expected, sigma = spec_result(p, full)
    got = run(p, mask, call_args, tiles)
    assert_close(got, expected, p["dtype"], sigma, f"compiled kernel, tiles {tiles}")
    allowed = np.broadcast_to(full[:, None], got["attention_scores"].shape)
    assert np.all(got["attention_scores"][~allowed] == 0.0)
    empty = ~full.any(axis=-1)                                     # (B, T)
    assert np.all(got["output"][empty] == 0.0) and np.all(got["grad/q"][empty] == 0.0)
