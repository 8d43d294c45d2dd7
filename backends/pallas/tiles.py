"""Tile math of the fused Pallas kernels (``forward``, ``backward``): lists of M float32 tiles.

Inside a kernel a group's heads are Python lists of 2-D (block_q, block_k) tiles and the
compose is unrolled over M and R: Pallas lowers only 2-D dots and power-of-two tensors to
Triton, and compose is elementwise work on those tiles (query-wise terms broadcast a
(block_q, 1) column, key-wise terms a (1, block_k) row). ``opts`` is the static
description of a call (``dcmha_pallas._Opts``).
"""

from __future__ import annotations

import functools
import operator

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dcmha.spec import terms as spec_terms

STAGES = ("pre", "post")
# The masked-score fill of the row maximum, also the running max's start
# (``dcmha.spec.terms.MASKED_SCORE``): finite, so a row that is masked so far
# gives exp(0) * 0 corrections instead of inf - inf. Masked probabilities are
# zeroed by where(), not by exp() of the fill.
MASKED = spec_terms.MASKED_SCORE


def _precision(opts):
    """Float32 dots: compiled, three TF32 tensor-core products of the operands' high and low
    TF32 parts (about float32's accuracy; IEEE float32 dots compile to unrolled scalar FMAs,
    slow on the GPU and minutes of ptxas at d = 128); interpreted, full float32."""
    return (lax.Precision.HIGHEST if opts.interpret
            else lax.DotAlgorithmPreset.TF32_TF32_F32_X3)


def _dot_nt(opts, a, b):
    """a (X, h) . b (Y, h)^T -> (X, Y) in float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(opts),
                           preferred_element_type=jnp.float32)


def _dot_tn(opts, a, b):
    """a (X, Y)^T . b (X, h) -> (Y, h) in float32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_precision(opts),
                           preferred_element_type=jnp.float32)


def _dot_nn(opts, a, b):
    """a (X, Y) . b (Y, h) -> (X, h) in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_precision(opts),
                           preferred_element_type=jnp.float32)


def _sum(xs):
    """Sum of a non-empty sequence of arrays (no leading 0 + ...)."""
    return functools.reduce(operator.add, xs)


def _low_rank(x, w1, w2):
    """sum_r (sum_m x[m] w1[r][m]) w2[r][n] for every head n of the tiles ``x``."""
    hidden = [_sum([x[m] * w1[r][m] for m in range(len(x))]) for r in range(len(w1))]
    return [_sum([h * w2[r][n] for r, h in enumerate(hidden)]) for n in range(len(x))]


def _compose(x, t, transpose=False):
    """compose (or its transpose) of the M head tiles ``x`` with the loaded terms ``t``.

    ``t`` maps term names to: qw*/kw* -> [r][m] broadcastable vectors, qdd/kdd -> [m],
    static -> [m][n] scalars. The transpose (the compose backward w.r.t. its input)
    swaps w1 and w2 and transposes the static matrix.
    """
    M = len(x)
    out = list(x)
    if "static" in t:
        w = t["static"]
        out = [out[n] + _sum([x[m] * (w[n][m] if transpose else w[m][n]) for m in range(M)])
               for n in range(M)]
    for side in "qk":
        if side + "w1" in t:
            w1, w2 = t[side + "w1"], t[side + "w2"]
            mixed = _low_rank(x, w2, w1) if transpose else _low_rank(x, w1, w2)
            out = [o + y for o, y in zip(out, mixed)]
    gates = [t[k] for k in ("qdd", "kdd") if k in t]
    if gates:
        out = [o + x[n] * _sum([gv[n] for gv in gates]) for n, o in enumerate(out)]
    return out


def _compose_grads(x, gy, t, side, axis):
    """Gradients of one side's compose weights, reduced over ``axis`` of the tiles.

    x: the compose input tiles; gy: the gradient of its output. side "q" reduces
    over keys (axis 1: one value per query row), side "k" over queries (axis 0).
    Returns {name: [r][m] or [m] vectors}, plus "static" [m][n] row partials for "q".
    """
    M = len(x)
    red = functools.partial(jnp.sum, axis=axis)
    out = {}
    if side + "w1" in t:
        w1, w2 = t[side + "w1"], t[side + "w2"]
        R = len(w1)
        g_hidden = [_sum([gy[n] * w2[r][n] for n in range(M)]) for r in range(R)]
        hidden = [_sum([x[m] * w1[r][m] for m in range(M)]) for r in range(R)]
        out[side + "w1"] = [[red(x[m] * g_hidden[r]) for m in range(M)] for r in range(R)]
        out[side + "w2"] = [[red(hidden[r] * gy[n]) for n in range(M)] for r in range(R)]
    if side + "dd" in t:
        out[side + "dd"] = [red(x[n] * gy[n]) for n in range(M)]
    if side == "q" and "static" in t:
        out["static"] = [[red(x[m] * gy[n]) for n in range(M)] for m in range(M)]
    return out


def _load_terms(refs, opts, stage, side, sl):
    """Load one side's compose vectors of one stage, sliced along the sequence by ``sl``.

    Query-side vectors become (rows, 1) columns, key-side ones (1, cols) rows.
    """
    names = getattr(opts, stage)
    out = {}
    expand = (lambda v: v[:, None]) if side == "q" else (lambda v: v[None, :])
    if side + "w1" in names:
        R = opts.rank(stage, side)
        for n in ("w1", "w2"):
            ref = refs[f"{stage}_{side}{n}"]
            out[side + n] = [[expand(ref[r, m, sl].astype(jnp.float32)) for m in range(opts.M)]
                             for r in range(R)]
    if side + "dd" in names:
        ref = refs[f"{stage}_{side}dd"]
        out[side + "dd"] = [expand(ref[m, sl].astype(jnp.float32)) for m in range(opts.M)]
    if side == "q" and "static" in names:
        ref = refs[f"{stage}_static"]
        out["static"] = [[ref[m, n].astype(jnp.float32) for n in range(opts.M)]
                         for m in range(opts.M)]
    return out


def _valid(opts, refs, t0, s0, bq, bk, mask_rows, mask_cols):
    """(bq, bk) bool: the entries of the tile that attend (padding is masked)."""
    t = t0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    s = s0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    ok = (t < opts.T) & (s < opts.S)
    t = t + opts.offset   # absolute query position
    if opts.causal:
        ok &= s <= t
    if opts.window is not None:
        ok &= (t - s < opts.window) & (s - t < opts.window)
    if opts.has_mask:
        ok &= refs["mask"][mask_rows, mask_cols] != 0
    return ok


def _key_range(opts, t0, bq, bk, n_k):
    """[lo, hi) of the key tiles that can hold an allowed entry for rows [t0, t0 + bq).

    ``dcmha.spec.terms.key_range`` in tiles, written with lax ops because t0 is
    traced (the kernel's program id).
    """
    lo, hi = 0, n_k
    first = t0 + opts.offset           # absolute positions of the first and last row
    last = first + bq - 1
    if opts.causal:
        hi = jnp.minimum(hi, lax.div(last, bk) + 1)
    if opts.window is not None:
        lo = lax.div(jnp.maximum(first - opts.window + 1, 0), bk)
        hi = jnp.minimum(hi, lax.div(last + opts.window - 1, bk) + 1)
    return lo, hi


def _query_range(opts, s0, bq, bk, n_q):
    """[lo, hi) of the query tiles that can hold an allowed entry for keys [s0, s0 + bk).

    The converse of ``dcmha.spec.terms.key_range`` (same causal / window rule), in tiles.
    """
    lo, hi = 0, n_q
    s0 = s0 - opts.offset              # key positions relative to query row 0
    if opts.causal:                    # rows t >= s0
        lo = lax.div(jnp.maximum(s0, 0), bq)
    if opts.window is not None:        # rows s0 - W < t < s0 + bk - 1 + W
        lo = jnp.maximum(lo, lax.div(jnp.maximum(s0 - opts.window + 1, 0), bq))
        hi = jnp.minimum(hi, lax.div(jnp.maximum(s0 + bk + opts.window - 2, 0), bq) + 1)
    return lo, hi


def _merge(*dicts):
    out = {}
    for d in dicts:
        out.update(d)
    return out


def _probs(opts, q, k, terms_pre, valid, lse):
    """Raw scores (M tiles) and the masked softmax P of the pre-composed ones, given ``lse``."""
    s = [_dot_nt(opts, q[m], k[m]) * opts.scale for m in range(opts.M)]
    a = _compose(s, terms_pre) if opts.pre else s
    p = [jnp.where(valid, jnp.exp(a[m] - lse[m]), 0.0) for m in range(opts.M)]
    return s, p


def _dpp(opts, do, v, dscores, valid):
    """Gradient of the post-composed P: dO.V^T (+ the scores' cotangent), 0 where masked."""
    g = [_dot_nt(opts, do[m], v[m]) for m in range(opts.M)]
    if dscores is not None:
        g = [g[m] + dscores[m] for m in range(opts.M)]
    return [jnp.where(valid, x, 0.0) for x in g]


def _grads_of_tile(opts, q, k, v, do, dscores, lse, delta, tp, tq, valid):
    """Recompute one tile and backpropagate dO to the softmax input and the scores.

    tp / tq: the loaded pre / post terms. Returns s (raw scores), p (softmax), dpp
    (gradient of the post-composed, masked P), da (of the pre-composed scores) and
    ds (of the raw scores), each M tiles.
    """
    M = opts.M
    s, p = _probs(opts, q, k, tp, valid, lse)
    dpp = _dpp(opts, do, v, dscores, valid)
    dp = _compose(dpp, tq, transpose=True) if opts.post else dpp
    da = [p[m] * (dp[m] - delta[m]) for m in range(M)]   # masked softmax backward
    ds = _compose(da, tp, transpose=True) if opts.pre else da
    return s, p, dpp, da, ds


def _kv_heads(opts):
    """kv head read by each query head of the current group (query head h -> h // rep)."""
    g = pl.program_id(1)
    return [lax.div(g * opts.M + m, opts.rep) for m in range(opts.M)]


def _key_tile(r, opts, kvh, t0, j, bq, bk):
    """Key tile ``j`` of a query tile at ``t0``: (its columns, the key-side compose terms of
    each stage, the keys of the M heads in float32, the valid-position mask)."""
    s0 = pl.multiple_of(j * bk, bk)
    cols = pl.ds(s0, bk)
    tk = {st: _load_terms(r, opts, st, "k", cols) for st in STAGES}
    k = [r["k"][kvh[m], cols, :].astype(jnp.float32) for m in range(opts.M)]
    return cols, tk, k, _valid(opts, r, t0, s0, bq, bk, slice(None), cols)

