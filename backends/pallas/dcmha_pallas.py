"""Fused DCMHA attention in Pallas: forward and backward kernels, custom VJP, reference.

The kernels never materialise a (B, N, T, S) array (unless the attention scores
are asked for: then the forward writes them tile by tile, and the backward reads
their cotangent the same way). Post-composition mixes the
*normalised* probabilities of the M heads of a group, so one online-softmax
pass is not enough; every kernel therefore holds all M heads of one group for
a (query tile, key tile) pair and works in passes over tiles:

forward, grid (B, G, T / block_q), loop over key tiles, twice:
  1. scores -> pre-compose -> masked online max / sum: each head's row
     log-sum-exp ``lse`` of the pre-composed scores (B, N, T).
  2. recompute scores -> pre-compose -> P = exp(a - lse) -> post-compose ->
     zero masked entries -> accumulate P.V.
backward, two kernels that recompute the forward tiles:
  rows, grid (B, G, T / block_q), loop over key tiles, twice:
     1. ``delta[t] = sum_s P[t,s] dP[t,s]`` per head, where dP (the gradient of
        the softmax output) is the post-compose transpose of dO.V^T; it is a
        reduction over every key tile, hence its own pass (it replaces
        FlashAttention's rowsum(dO * O), which no longer holds).
     2. dA = P (dP - delta), dScores = pre-compose transpose of dA; accumulate
        dq and every query-side weight gradient (reductions over S), and the
        static-weight gradients as per-row partial sums.
  columns, grid (B, G, S / block_k), loop over query tiles: the same
     recomputation; accumulate dk, dv (per query head, summed onto the kv heads
     afterwards so groups never race) and every key-side weight gradient
     (reductions over T).

Inside a kernel a group's heads are Python lists of 2-D (block_q, block_k)
tiles and the compose is unrolled over M and R: Triton lowers only 2-D dots
and power-of-two tensors, and compose is elementwise work on those tiles
(query-wise terms broadcast a (block_q, 1) column, key-wise terms a
(1, block_k) row). Inputs are padded to whole tiles (and head dims to powers of
two) in the wrapper; padded rows and keys are masked like any masked entry.
Scores, compose, softmax and accumulation are float32 whatever the input dtype,
and dots run at full float32 precision (IEEE, not TF32, on a GPU).

GPU: the same kernels compile for Triton (interpret=False): every tile is a power
of two and at least 16 (tl.dot's minimum), loops over tiles have bounds that skip
tiles a causal or windowed mask hides entirely. ``tests/test_pallas_kernel.py``
lowers all three kernels to Triton IR without a GPU.

The math of the backward is ``spec/reference_grad.py`` (compose_backward,
masked_softmax_backward). ``dcmha_attention_reference`` below is the same
function in plain jax.numpy, materialising everything; its ``jax.grad`` is the
slow truth the kernels are tested against.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dcmha.spec import terms as spec_terms

from .. import kernel_call

__all__ = ["BlockSizes", "dcmha_attention", "dcmha_attention_reference", "TERMS"]

#: Names of the compose terms a ``pre`` / ``post`` dict may hold (``dcmha.spec.terms``).
TERMS = spec_terms.TERM_NAMES
_STAGES = ("pre", "post")
# The masked-score fill of the row maximum, also the running max's start
# (``dcmha.spec.terms.MASKED_SCORE``): finite, so a row that is masked so far
# gives exp(0) * 0 corrections instead of inf - inf. Masked probabilities are
# zeroed by where(), not by exp() of the fill.
_MASKED = spec_terms.MASKED_SCORE
# tl.dot needs every dimension >= 16 on a GPU.
_MIN_GPU_DIM = 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the kernels (powers of two; >= 16 when compiled for a GPU).

    Attributes:
      block_q: query rows per tile of the forward kernel.
      block_k: key columns per tile of the forward kernel.
      block_q_bwd: query rows per tile of both backward kernels (default block_q).
      block_k_bwd: key columns per tile of both backward kernels (default block_k).

    A tile larger than the (power-of-two rounded) sequence shrinks to it.
    """

    block_q: int = 64
    block_k: int = 64
    block_q_bwd: Optional[int] = None
    block_k_bwd: Optional[int] = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and f.name.endswith("_bwd"):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v & (v - 1):
                raise ValueError(f"`{f.name}` must be a positive power of two. "
                                 f"Received: {f.name}={v!r}")

    @property
    def backward(self) -> tuple:
        return (self.block_q_bwd or self.block_q, self.block_k_bwd or self.block_k)


@dataclasses.dataclass(frozen=True)
class _Opts:
    """Static description of one call (hashable: the custom_vjp's nondiff argument)."""

    T: int
    S: int
    G: int
    M: int
    rep: int             # query heads per kv head
    scale: float
    causal: bool
    window: Optional[int]
    offset: int          # absolute position of query row 0 (keys start at 0)
    has_mask: bool
    pre: tuple           # term names present in the pre stage, in TERMS order
    post: tuple
    ranks: tuple         # ((stage, side, R), ...) for every low-rank pair
    blocks: tuple        # (block_q, block_k, block_q_bwd, block_k_bwd)
    scores: bool         # also return the post-composed probabilities (B, N, T, S)
    interpret: bool

    def rank(self, stage, side):
        return dict(((st, sd), r) for st, sd, r in self.ranks)[stage, side]


# ---------------------------------------------------------------------------
# Tile math shared by the kernels (lists of M float32 tiles, unrolled)
# ---------------------------------------------------------------------------

def _dot_nt(a, b):
    """a (X, h) . b (Y, h)^T -> (X, Y) in float32 (IEEE on a GPU, never TF32)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                           precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _dot_tn(a, b):
    """a (X, Y)^T . b (X, h) -> (Y, h) in float32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                           precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _dot_nn(a, b):
    """a (X, Y) . b (Y, h) -> (X, h) in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                           precision=lax.Precision.HIGHEST,
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
    s = [_dot_nt(q[m], k[m]) * opts.scale for m in range(opts.M)]
    a = _compose(s, terms_pre) if opts.pre else s
    p = [jnp.where(valid, jnp.exp(a[m] - lse[m]), 0.0) for m in range(opts.M)]
    return s, p


def _dpp(opts, do, v, dscores, valid):
    """Gradient of the post-composed P: dO.V^T (+ the scores' cotangent), 0 where masked."""
    g = [_dot_nt(do[m], v[m]) for m in range(opts.M)]
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


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------

def _kv_heads(opts):
    """kv head read by each query head of the current group (query head h -> h // rep)."""
    g = pl.program_id(1)
    return [lax.div(g * opts.M + m, opts.rep) for m in range(opts.M)]


def _forward_kernel(*refs, names, opts, n_k):
    """One (batch, group, query tile): lse pass then output pass over the key tiles."""
    r = dict(zip(names, refs))
    M, (bq, bk) = opts.M, opts.blocks[:2]
    t0 = pl.program_id(2) * bq
    kvh = _kv_heads(opts)
    q = [r["q"][m].astype(jnp.float32) for m in range(M)]
    tq = {st: _load_terms(r, opts, st, "q", slice(None)) for st in _STAGES}

    def tile(j):
        s0 = pl.multiple_of(j * bk, bk)
        cols = pl.ds(s0, bk)
        tk = {st: _load_terms(r, opts, st, "k", cols) for st in _STAGES}
        k = [r["k"][kvh[m], cols, :].astype(jnp.float32) for m in range(M)]
        valid = _valid(opts, r, t0, s0, bq, bk, slice(None), cols)
        return cols, tk, k, valid

    def lse_step(j, carry):
        mx, sm = carry
        _, tk, k, valid = tile(j)
        s = [_dot_nt(q[m], k[m]) * opts.scale for m in range(M)]
        a = _compose(s, _merge(tq["pre"], tk["pre"])) if opts.pre else s
        new_mx, new_sm = [], []
        for m in range(M):
            mx_m = jnp.maximum(mx[m], jnp.max(jnp.where(valid, a[m], _MASKED), axis=1))
            e = jnp.where(valid, jnp.exp(a[m] - mx_m[:, None]), 0.0)
            new_sm.append(sm[m] * jnp.exp(mx[m] - mx_m) + jnp.sum(e, axis=1))
            new_mx.append(mx_m)
        return new_mx, new_sm

    lo, hi = _key_range(opts, t0, bq, bk, n_k)
    init = ([jnp.full((bq,), _MASKED, jnp.float32) for _ in range(M)],
            [jnp.zeros((bq,), jnp.float32) for _ in range(M)])
    mx, sm = lax.fori_loop(lo, hi, lse_step, init)
    # A fully masked row has sum 0: any finite lse works, P is zeroed by the mask.
    lse = [jnp.where(sm[m] > 0, mx[m] + jnp.log(jnp.where(sm[m] > 0, sm[m], 1.0)), 0.0)
           for m in range(M)]

    def out_step(j, acc):
        cols, tk, k, valid = tile(j)
        _, p = _probs(opts, q, k, _merge(tq["pre"], tk["pre"]), valid,
                      [x[:, None] for x in lse])
        pp = _compose(p, _merge(tq["post"], tk["post"])) if opts.post else p
        pp = [jnp.where(valid, x, 0.0) for x in pp]
        if opts.scores:
            for n in range(M):
                r["scores"][n, :, cols] = pp[n].astype(r["scores"].dtype)
        return [acc[n] + _dot_nn(pp[n], r["v"][kvh[n], cols, :].astype(jnp.float32))
                for n in range(M)]

    dv_p = r["o"].shape[-1]
    if opts.scores:  # every tile of the returned scores is written, skipped ones as 0
        lo, hi = 0, n_k
    acc = lax.fori_loop(lo, hi, out_step, [jnp.zeros((bq, dv_p), jnp.float32) for _ in range(M)])
    for m in range(M):
        r["o"][m] = acc[m].astype(r["o"].dtype)
        r["lse"][m] = lse[m]


def _backward_rows_kernel(*refs, names, opts, n_k):
    """One (batch, group, query tile): delta pass, then dq and query-side weight gradients."""
    r = dict(zip(names, refs))
    M, (bq, bk) = opts.M, opts.blocks[2:]
    t0 = pl.program_id(2) * bq
    kvh = _kv_heads(opts)
    q = [r["q"][m].astype(jnp.float32) for m in range(M)]
    do = [r["do"][m].astype(jnp.float32) for m in range(M)]
    lse = [r["lse"][m][:, None] for m in range(M)]
    tq = {st: _load_terms(r, opts, st, "q", slice(None)) for st in _STAGES}

    def tile(j):
        s0 = pl.multiple_of(j * bk, bk)
        cols = pl.ds(s0, bk)
        tk = {st: _load_terms(r, opts, st, "k", cols) for st in _STAGES}
        k = [r["k"][kvh[m], cols, :].astype(jnp.float32) for m in range(M)]
        v = [r["v"][kvh[m], cols, :].astype(jnp.float32) for m in range(M)]
        valid = _valid(opts, r, t0, s0, bq, bk, slice(None), cols)
        dsc = ([r["dscores"][m, :, cols].astype(jnp.float32) for m in range(M)]
               if opts.scores else None)
        return dsc, k, v, valid, _merge(tq["pre"], tk["pre"]), _merge(tq["post"], tk["post"])

    def delta_step(j, delta):
        dsc, k, v, valid, tp, tpost = tile(j)
        _, p = _probs(opts, q, k, tp, valid, lse)
        dpp = _dpp(opts, do, v, dsc, valid)
        dp = _compose(dpp, tpost, transpose=True) if opts.post else dpp
        return [delta[m] + jnp.sum(p[m] * dp[m], axis=1) for m in range(M)]

    lo, hi = _key_range(opts, t0, bq, bk, n_k)
    zeros = lambda: jnp.zeros((bq,), jnp.float32)  # noqa: E731
    delta = lax.fori_loop(lo, hi, delta_step, [zeros() for _ in range(M)])
    delta_col = [x[:, None] for x in delta]

    # Gradient accumulators: dq per head and the query-side weight gradients.
    def grad_zeros(stage):
        return {n: jax.tree.map(lambda _: zeros(), v) for n, v in tq[stage].items()}

    def grad_step(j, carry):
        dq, gw = carry
        dsc, k, v, valid, tp, tpost = tile(j)
        s, p, dpp, da, ds = _grads_of_tile(opts, q, k, v, do, dsc, lse, delta_col, tp, tpost,
                                              valid)
        dq = [dq[m] + _dot_nn(ds[m], k[m]) * opts.scale for m in range(M)]
        new = {"pre": _compose_grads(s, da, tq["pre"], "q", 1) if opts.pre else {},
               "post": _compose_grads(p, dpp, tq["post"], "q", 1) if opts.post else {}}
        gw = {st: jax.tree.map(jnp.add, gw[st], new[st]) for st in _STAGES}
        return dq, gw

    d_p = r["q"].shape[-1]
    init = ([jnp.zeros((bq, d_p), jnp.float32) for _ in range(M)],
            {st: grad_zeros(st) for st in _STAGES})
    dq, gw = lax.fori_loop(lo, hi, grad_step, init)
    for m in range(M):
        r["dq"][m] = dq[m]
        r["delta"][m] = delta[m]
    _store_weight_grads(r, opts, gw)


def _backward_cols_kernel(*refs, names, opts, n_q):
    """One (batch, group, key tile): dk, dv and key-side weight gradients over query tiles."""
    r = dict(zip(names, refs))
    M, (bq, bk) = opts.M, opts.blocks[2:]
    s0 = pl.program_id(2) * bk
    kvh = _kv_heads(opts)
    k = [r["k"][kvh[m]].astype(jnp.float32) for m in range(M)]
    v = [r["v"][kvh[m]].astype(jnp.float32) for m in range(M)]
    tk = {st: _load_terms(r, opts, st, "k", slice(None)) for st in _STAGES}
    zeros = lambda: jnp.zeros((bk,), jnp.float32)  # noqa: E731

    def grad_step(i, carry):
        dk, dv, gw = carry
        t0 = pl.multiple_of(i * bq, bq)
        rows = pl.ds(t0, bq)
        tq = {st: _load_terms(r, opts, st, "q", rows) for st in _STAGES}
        q = [r["q"][m, rows, :].astype(jnp.float32) for m in range(M)]
        do = [r["do"][m, rows, :].astype(jnp.float32) for m in range(M)]
        lse = [r["lse"][m, rows][:, None] for m in range(M)]
        delta = [r["delta"][m, rows][:, None] for m in range(M)]
        valid = _valid(opts, r, t0, s0, bq, bk, rows, slice(None))
        dsc = ([r["dscores"][m, rows, :].astype(jnp.float32) for m in range(M)]
               if opts.scores else None)
        s, p, dpp, da, ds = _grads_of_tile(opts, q, k, v, do, dsc, lse, delta,
                                              _merge(tq["pre"], tk["pre"]),
                                              _merge(tq["post"], tk["post"]), valid)
        pp = _compose(p, _merge(tq["post"], tk["post"])) if opts.post else p
        dv = [dv[m] + _dot_tn(jnp.where(valid, pp[m], 0.0), do[m]) for m in range(M)]
        dk = [dk[m] + _dot_tn(ds[m], q[m]) * opts.scale for m in range(M)]
        new = {"pre": _compose_grads(s, da, tk["pre"], "k", 0) if opts.pre else {},
               "post": _compose_grads(p, dpp, tk["post"], "k", 0) if opts.post else {}}
        gw = {st: jax.tree.map(jnp.add, gw[st], new[st]) for st in _STAGES}
        return dk, dv, gw

    lo, hi = _query_range(opts, s0, bq, bk, n_q)
    d_p, dv_p = r["k"].shape[-1], r["v"].shape[-1]
    init = ([jnp.zeros((bk, d_p), jnp.float32) for _ in range(M)],
            [jnp.zeros((bk, dv_p), jnp.float32) for _ in range(M)],
            {st: {n: jax.tree.map(lambda _: zeros(), x) for n, x in tk[st].items()}
             for st in _STAGES})
    dk, dv, gw = lax.fori_loop(lo, hi, grad_step, init)
    for m in range(M):
        r["dk"][m] = dk[m]
        r["dv"][m] = dv[m]
    _store_weight_grads(r, opts, gw)


def _store_weight_grads(r, opts, gw):
    """Write the accumulated weight-gradient vectors of this kernel's side (and static rows)."""
    for st in _STAGES:
        for name, val in gw[st].items():
            ref = r[f"d{st}_{name}"]
            if name == "static":
                for m in range(opts.M):
                    for n in range(opts.M):
                        ref[m, n] = val[m][n]
            elif name.endswith("dd"):
                for m in range(opts.M):
                    ref[m] = val[m]
            else:
                for i, row in enumerate(val):
                    for m in range(opts.M):
                        ref[i, m] = row[m]


# ---------------------------------------------------------------------------
# pallas_call plumbing: kernel layouts and block specs
# ---------------------------------------------------------------------------
# Kernel layouts (made by the wrapper): q (B,N,T_p,d_p), k (B,N_kv,S_p,d_p),
# v (B,N_kv,S_p,dv_p), do (B,N,T_p,dv_p), lse/delta (B,N,T_p) float32,
# mask (B,T_p,S_p) int8, qw1/qw2 (B,G,R,M,T_p), kw1/kw2 (B,G,R,M,S_p),
# qdd (B,G,M,T_p), kdd (B,G,M,S_p), static (G,M,M).

def _term_spec(stage, n, opts, L, blk, tiled):
    """BlockSpec of compose term ``n`` of ``stage``; ``tiled``: block the sequence by ``blk``."""
    M = opts.M
    if n == "static":
        return pl.BlockSpec((None, M, M), lambda b, g, i: (g, 0, 0))
    if n.endswith("dd"):
        shape = (None, None, M, blk if tiled else L)
        return pl.BlockSpec(shape, (lambda b, g, i: (b, g, 0, i)) if tiled
                            else (lambda b, g, i: (b, g, 0, 0)))
    shape = (None, None, opts.rank(stage, n[0]), M, blk if tiled else L)
    return pl.BlockSpec(shape, (lambda b, g, i: (b, g, 0, 0, i)) if tiled
                        else (lambda b, g, i: (b, g, 0, 0, 0)))


def _term_inputs(opts, terms, rows_tiled, bq, bk, T_p, S_p):
    """(names, arrays, specs) of the compose terms; query side tiled iff ``rows_tiled``."""
    names, arrays, specs = [], [], []
    for st in _STAGES:
        for n in getattr(opts, st):
            name = f"{st}_{n}"
            if n == "static":
                tiled, blk, L = False, 0, 0
            elif n[0] == "q":
                tiled, blk, L = rows_tiled, bq, T_p
            else:
                tiled, blk, L = not rows_tiled, bk, S_p
            names.append(name)
            arrays.append(terms[st][n])
            specs.append(_term_spec(st, n, opts, L, blk, tiled))
    return names, arrays, specs


def _grad_outputs(opts, side, B, L, blk):
    """(names, shapes, specs) of the weight-gradient outputs of one side, tiled by ``blk``."""
    names, shapes, specs = [], [], []
    G, M = opts.G, opts.M
    for st in _STAGES:
        for n in getattr(opts, st):
            if n == "static":
                if side != "q":
                    continue
                names.append(f"d{st}_static")
                shapes.append(jax.ShapeDtypeStruct((B, G, M, M, L), jnp.float32))
                specs.append(pl.BlockSpec((None, None, M, M, blk),
                                          lambda b, g, i: (b, g, 0, 0, i)))
                continue
            if n[0] != side:
                continue
            names.append(f"d{st}_{n}")
            if n.endswith("dd"):
                shapes.append(jax.ShapeDtypeStruct((B, G, M, L), jnp.float32))
                specs.append(pl.BlockSpec((None, None, M, blk), lambda b, g, i: (b, g, 0, i)))
            else:
                R = opts.rank(st, side)
                shapes.append(jax.ShapeDtypeStruct((B, G, R, M, L), jnp.float32))
                specs.append(pl.BlockSpec((None, None, R, M, blk),
                                          lambda b, g, i: (b, g, 0, 0, i)))
    return names, shapes, specs


def _compiler_params(opts):
    if opts.interpret:
        return None
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=4, num_stages=2)


def _forward(opts, q, k, v, terms, mask):
    """Run the forward kernel on kernel-layout arrays -> (o, lse[, scores])."""
    B, N, T_p, d_p = q.shape
    N_kv, S_p = k.shape[1], k.shape[2]
    dv_p = v.shape[-1]
    bq, bk = opts.blocks[:2]

    def full_kv(dim):
        return pl.BlockSpec((None, N_kv, S_p, dim), lambda b, g, i: (b, 0, 0, 0))

    names = ["q", "k", "v"]
    arrays = [q, k, v]
    specs = [pl.BlockSpec((None, opts.M, bq, d_p), lambda b, g, i: (b, g, i, 0)),
             full_kv(d_p), full_kv(dv_p)]
    if opts.has_mask:
        names.append("mask")
        arrays.append(mask)
        specs.append(pl.BlockSpec((None, bq, S_p), lambda b, g, i: (b, i, 0)))
    tn, ta, ts = _term_inputs(opts, terms, True, bq, bk, T_p, S_p)
    out_shape = [jax.ShapeDtypeStruct((B, N, T_p, dv_p), q.dtype),
                 jax.ShapeDtypeStruct((B, N, T_p), jnp.float32)]
    out_specs = [pl.BlockSpec((None, opts.M, bq, dv_p), lambda b, g, i: (b, g, i, 0)),
                 pl.BlockSpec((None, opts.M, bq), lambda b, g, i: (b, g, i))]
    out_names = ["o", "lse"]
    if opts.scores:
        out_names.append("scores")
        out_shape.append(jax.ShapeDtypeStruct((B, N, T_p, S_p), q.dtype))
        out_specs.append(pl.BlockSpec((None, opts.M, bq, S_p), lambda b, g, i: (b, g, i, 0)))
    kernel = functools.partial(_forward_kernel, names=tuple(names + tn + out_names),
                               opts=opts, n_k=S_p // bk)
    return pl.pallas_call(
        kernel, grid=(B, opts.G, T_p // bq), in_specs=specs + ts, out_specs=out_specs,
        out_shape=out_shape, interpret=opts.interpret, compiler_params=_compiler_params(opts),
        name="dcmha_forward")(*arrays, *ta)


def _backward(opts, q, k, v, terms, mask, lse, do, dscores):
    """Run both backward kernels -> (dq, dk, dv, dterms) in kernel layouts (float32).

    dscores: the cotangent of the returned scores (B, N, T_p, S_p), or None.
    """
    B, N, T_p, d_p = q.shape
    N_kv, S_p = k.shape[1], k.shape[2]
    dv_p = v.shape[-1]
    bq, bk = opts.blocks[2:]
    M, G = opts.M, opts.G

    # Rows: delta, dq and the query-side (and static) weight gradients.
    def row(dim):
        return pl.BlockSpec((None, M, bq, dim), lambda b, g, i: (b, g, i, 0))

    def full_kv(dim):
        return pl.BlockSpec((None, N_kv, S_p, dim), lambda b, g, i: (b, 0, 0, 0))

    vec = pl.BlockSpec((None, M, bq), lambda b, g, i: (b, g, i))
    names = ["q", "k", "v", "do", "lse"]
    arrays = [q, k, v, do, lse]
    specs = [row(d_p), full_kv(d_p), full_kv(dv_p), row(dv_p), vec]
    if opts.has_mask:
        names.append("mask")
        arrays.append(mask)
        specs.append(pl.BlockSpec((None, bq, S_p), lambda b, g, i: (b, i, 0)))
    if opts.scores:
        names.append("dscores")
        arrays.append(dscores)
        specs.append(row(S_p))
    tn, ta, ts = _term_inputs(opts, terms, True, bq, bk, T_p, S_p)
    gn, gs, gsp = _grad_outputs(opts, "q", B, T_p, bq)
    outs = pl.pallas_call(
        functools.partial(_backward_rows_kernel, names=tuple(names + tn + ["dq", "delta"] + gn),
                          opts=opts, n_k=S_p // bk),
        grid=(B, G, T_p // bq), in_specs=specs + ts,
        out_specs=[row(d_p), vec] + gsp,
        out_shape=[jax.ShapeDtypeStruct((B, N, T_p, d_p), jnp.float32),
                   jax.ShapeDtypeStruct((B, N, T_p), jnp.float32)] + gs,
        interpret=opts.interpret, compiler_params=_compiler_params(opts),
        name="dcmha_backward_rows")(*arrays, *ta)
    dq, delta, grads = outs[0], outs[1], dict(zip(gn, outs[2:]))

    # Columns: dk, dv per query head and the key-side weight gradients.
    def col(dim):
        return pl.BlockSpec((None, M, bk, dim), lambda b, g, j: (b, g, j, 0))

    def full_q(dim):
        return pl.BlockSpec((None, M, T_p, dim), lambda b, g, j: (b, g, 0, 0))

    def kv_tile(dim):
        return pl.BlockSpec((None, N_kv, bk, dim), lambda b, g, j: (b, 0, j, 0))

    full_vec = pl.BlockSpec((None, M, T_p), lambda b, g, j: (b, g, 0))
    names = ["q", "k", "v", "do", "lse", "delta"]
    arrays = [q, k, v, do, lse, delta]
    specs = [full_q(d_p), kv_tile(d_p), kv_tile(dv_p), full_q(dv_p), full_vec, full_vec]
    if opts.has_mask:
        names.append("mask")
        arrays.append(mask)
        specs.append(pl.BlockSpec((None, T_p, bk), lambda b, g, j: (b, 0, j)))
    if opts.scores:
        names.append("dscores")
        arrays.append(dscores)
        specs.append(pl.BlockSpec((None, M, T_p, bk), lambda b, g, j: (b, g, 0, j)))
    tn, ta, ts = _term_inputs(opts, terms, False, bq, bk, T_p, S_p)
    gn, gs, gsp = _grad_outputs(opts, "k", B, S_p, bk)
    outs = pl.pallas_call(
        functools.partial(_backward_cols_kernel, names=tuple(names + tn + ["dk", "dv"] + gn),
                          opts=opts, n_q=T_p // bq),
        grid=(B, G, S_p // bk), in_specs=specs + ts,
        out_specs=[col(d_p), col(dv_p)] + gsp,
        out_shape=[jax.ShapeDtypeStruct((B, N, S_p, d_p), jnp.float32),
                   jax.ShapeDtypeStruct((B, N, S_p, dv_p), jnp.float32)] + gs,
        interpret=opts.interpret, compiler_params=_compiler_params(opts),
        name="dcmha_backward_cols")(*arrays, *ta)
    dk_h, dv_h = outs[0], outs[1]
    grads.update(zip(gn, outs[2:]))

    # Query head h reads kv head h // rep: sum the rep heads of each kv head.
    dk = dk_h.reshape(B, N_kv, opts.rep, S_p, d_p).sum(2)
    dv = dv_h.reshape(B, N_kv, opts.rep, S_p, dv_p).sum(2)
    dterms = {st: {} for st in _STAGES}
    for st in _STAGES:
        for n in getattr(opts, st):
            g = grads[f"d{st}_{n}"]
            dterms[st][n] = g.sum(axis=(0, 4)) if n == "static" else g
    return dq, dk, dv, dterms


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(opts, q, k, v, terms, mask):
    """o, or (o, scores) with opts.scores, all in kernel layouts."""
    out = _forward(opts, q, k, v, terms, mask)
    return (out[0], out[2]) if opts.scores else out[0]


def _fused_fwd(opts, q, k, v, terms, mask):
    out = _forward(opts, q, k, v, terms, mask)
    primal = (out[0], out[2]) if opts.scores else out[0]
    return primal, (q, k, v, terms, mask, out[1])


def _fused_bwd(opts, res, ct):
    q, k, v, terms, mask, lse = res
    do, dscores = ct if opts.scores else (ct, None)
    dq, dk, dv, dterms = _backward(opts, q, k, v, terms, mask, lse, do, dscores)
    dterms = jax.tree.map(lambda g, x: g.astype(x.dtype), dterms, terms)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dterms, None


_fused.defvjp(_fused_fwd, _fused_bwd)


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------

def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _check_inputs(q, k, v, num_groups, pre, post, mask, causal, sliding_window, scale,
                  query_offset):
    """Validate the arguments (``kernel_call.describe`` and JAX dtypes); returns the
    ``dcmha.call.AttentionCall`` and the stages {"pre": terms, "post": terms} in TERMS order."""
    call = kernel_call.describe(q, k, v, num_groups=num_groups, pre=pre, post=post, mask=mask,
                                causal=causal, sliding_window=sliding_window,
                                query_offset=query_offset)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"`{name}` must be a floating array. Received: {name}.dtype={x.dtype}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"`scale` must be None or a Python number. Received: scale={scale!r}")
    stages = {st: {n: terms[n] for n in TERMS if n in terms}
              for st, terms in (("pre", call.pre or {}), ("post", call.post or {}))}
    return call, stages


def _default_interpret() -> bool:
    return jax.default_backend() != "gpu"


def dcmha_attention(q, k, v, *, num_groups: int, pre: Optional[Mapping[str, Any]] = None,
                    post: Optional[Mapping[str, Any]] = None, mask=None, causal: bool = False,
                    sliding_window: Optional[int] = None, scale: Optional[float] = None,
                    query_offset: int = 0, return_attention_scores: bool = False,
                    block_q: Optional[int] = None, block_k: Optional[int] = None,
                    block_sizes: Optional[BlockSizes] = None, interpret: Optional[bool] = None):
    """Fused DCMHA attention (forward and backward Pallas kernels).

    Args:
      q: (B, T, N, d) queries, already projected, normed and rotated.
      k: (B, S, N_kv, d) keys; query head h reads kv head h // (N / N_kv).
      v: (B, S, N_kv, d_v) values.
      num_groups: G, composition groups; each mixes M = N / G heads.
      pre, post: None (stage off) or a dict with any of "qw1", "qw2" (B, T, G, R, M),
        "kw1", "kw2" (B, S, G, R, M), "qdd" (B, T, G, M), "kdd" (B, S, G, M),
        "static" (G, M, M); an absent key is a term switched off.
      mask: None or bool, broadcastable to (B, T, S), True = attend (shared by the heads).
      causal: attend to s <= t + query_offset. sliding_window: W, attend to
        |t + query_offset - s| < W.
      scale: score scale, default 1 / sqrt(d).
      query_offset: absolute position of query row 0 (keys sit at 0..S-1), e.g. the
        cache index when decoding; a static Python int.
      return_attention_scores: also return the post-composed, masked probabilities
        (B, N, T, S) (this materialises them; gradients flow through both results).
      block_q, block_k: tile sizes (shorthand for ``BlockSizes(block_q, block_k)``).
      block_sizes: full tile sizes, forward and backward; not with block_q/block_k.
      interpret: run Pallas in interpret mode; default: unless the default backend is a GPU.

    Returns:
      o (B, T, N, d_v) in q's dtype, or (o, scores) with return_attention_scores.
      Scores, compose, softmax and accumulation are float32. Masked probabilities
      are exactly 0; a fully masked row gives 0. Differentiable w.r.t. q, k, v and
      every pre/post array.
    """
    call, stages = _check_inputs(q, k, v, num_groups, pre, post, mask, causal, sliding_window,
                                 scale, query_offset)
    B, T, S, N, N_kv, d, d_v, G, M = (call.B, call.T, call.S, call.N, call.N_kv, call.d, call.d_v,
                                      call.G, call.M)
    if block_sizes is not None and (block_q is not None or block_k is not None):
        raise ValueError("Pass either `block_sizes` or `block_q`/`block_k`, not both. Received: "
                         f"block_sizes={block_sizes!r}, block_q={block_q!r}, block_k={block_k!r}")
    if block_sizes is None:
        defaults = BlockSizes()
        block_sizes = BlockSizes(block_q or defaults.block_q, block_k or defaults.block_k)
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"`block_sizes` must be a BlockSizes. Received: {block_sizes!r}")
    interpret = _default_interpret() if interpret is None else bool(interpret)
    floor = 1 if interpret else _MIN_GPU_DIM
    fit = lambda blk, L: min(blk, max(floor, _next_pow2(L)))  # noqa: E731
    bq_b, bk_b = block_sizes.backward
    blocks = (fit(block_sizes.block_q, T), fit(block_sizes.block_k, S), fit(bq_b, T), fit(bk_b, S))
    if not interpret and min(blocks) < _MIN_GPU_DIM:
        raise ValueError(f"GPU tiles must be at least {_MIN_GPU_DIM}. Received: {block_sizes!r}")
    # Both tilings must cover the padded lengths: pad to the largest tile.
    T_p = -(-T // max(blocks[0], blocks[2])) * max(blocks[0], blocks[2])
    S_p = -(-S // max(blocks[1], blocks[3])) * max(blocks[1], blocks[3])
    d_p, dv_p = max(floor, _next_pow2(d)), max(floor, _next_pow2(d_v))

    ranks = tuple((st, side, int(terms[side + "w1"].shape[3]))
                  for st, terms in stages.items() for side in "qk" if side + "w1" in terms)
    opts = _Opts(T=T, S=S, G=G, M=M, rep=N // N_kv,
                 scale=float(1.0 / math.sqrt(d) if scale is None else scale),
                 causal=call.use_causal_mask, window=sliding_window, offset=call.static_offset,
                 has_mask=mask is not None, pre=tuple(stages["pre"]),
                 post=tuple(stages["post"]), ranks=ranks, blocks=blocks,
                 scores=bool(return_attention_scores), interpret=interpret)

    def heads_major(x, L_p, h_p):  # (B, L, H, h) -> (B, H, L_p, h_p)
        x = jnp.swapaxes(x, 1, 2)
        return jnp.pad(x, ((0, 0), (0, 0), (0, L_p - x.shape[2]), (0, h_p - x.shape[3])))

    def term_layout(n, x):
        if n == "static":
            return x
        L_p = T_p if n[0] == "q" else S_p
        if n.endswith("dd"):   # (B, L, G, M) -> (B, G, M, L_p)
            x = jnp.transpose(x, (0, 2, 3, 1))
        else:                  # (B, L, G, R, M) -> (B, G, R, M, L_p)
            x = jnp.transpose(x, (0, 2, 3, 4, 1))
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, L_p - x.shape[-1])])

    terms = {st: {n: term_layout(n, x) for n, x in ts.items()} for st, ts in stages.items()}
    mask_k = None
    if mask is not None:
        mask_k = jnp.broadcast_to(kernel_call.shared_mask(jnp.asarray(mask)), (B, T, S))
        mask_k = jnp.pad(mask_k.astype(jnp.int8), ((0, 0), (0, T_p - T), (0, S_p - S)))
    out = _fused(opts, heads_major(q, T_p, d_p), heads_major(k, S_p, d_p),
                 heads_major(v, S_p, dv_p), terms, mask_k)
    o = out[0] if opts.scores else out
    o = jnp.swapaxes(o[:, :, :T, :d_v], 1, 2)
    return (o, out[1][:, :, :T, :S]) if opts.scores else o


# ---------------------------------------------------------------------------
# Plain reference (materialises (B, N, T, S); the slow truth for the tests)
# ---------------------------------------------------------------------------

def _compose_reference(a, G, *, qw1=None, qw2=None, kw1=None, kw2=None, qdd=None, kdd=None,
                       static=None):
    """compose of spec/reference.py on a (B, N, T, S) float32 array."""
    B, N, T, S = a.shape
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    x = a.reshape(B, G, N // G, T, S)
    out = x
    if static is not None:
        out = out + jnp.einsum("bgmts,gmn->bgnts", x, f32(static))
    if qw1 is not None:
        hidden = jnp.einsum("bgmts,btgrm->bgrts", x, f32(qw1))
        out = out + jnp.einsum("bgrts,btgrn->bgnts", hidden, f32(qw2))
    if kw1 is not None:
        hidden = jnp.einsum("bgmts,bsgrm->bgrts", x, f32(kw1))
        out = out + jnp.einsum("bgrts,bsgrn->bgnts", hidden, f32(kw2))
    if qdd is not None:
        out = out + x * jnp.transpose(f32(qdd), (0, 2, 3, 1))[..., :, None]
    if kdd is not None:
        out = out + x * jnp.transpose(f32(kdd), (0, 2, 3, 1))[..., None, :]
    return out.reshape(B, N, T, S)


def dcmha_attention_reference(q, k, v, *, num_groups: int, pre=None, post=None, mask=None,
                              causal: bool = False, sliding_window: Optional[int] = None,
                              scale: Optional[float] = None, query_offset: int = 0,
                              return_attention_scores: bool = False, **unused_tiling):
    """``dcmha_attention`` in plain jax.numpy (float32, materialising (B, N, T, S)).

    Same arguments and result as ``dcmha_attention``; tiling arguments
    (block_q, block_k, block_sizes, interpret) are accepted and ignored.
    """
    unknown = set(unused_tiling) - {"block_q", "block_k", "block_sizes", "interpret"}
    if unknown:
        raise TypeError(f"Unexpected arguments: {sorted(unknown)}")
    call, stages = _check_inputs(q, k, v, num_groups, pre, post, mask, causal, sliding_window,
                                 scale, query_offset)
    B, T, S, N, N_kv, d, G = call.B, call.T, call.S, call.N, call.N_kv, call.d, call.G
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rep = N // N_kv
    k_h = jnp.repeat(k.astype(jnp.float32), rep, axis=2)
    v_h = jnp.repeat(v.astype(jnp.float32), rep, axis=2)
    a = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k_h,
                   precision=lax.Precision.HIGHEST) * scale
    if stages["pre"]:
        a = _compose_reference(a, G, **stages["pre"])
    t = call.static_offset + jnp.arange(T)[:, None]
    s = jnp.arange(S)[None, :]
    allowed = jnp.ones((B, T, S), bool)
    if mask is not None:
        allowed &= jnp.asarray(mask, bool)
    rule = spec_terms.visible(t, s, causal=causal, window=sliding_window)
    if rule is not True:
        allowed &= rule
    m = allowed[:, None]
    # Masked entries never reach exp (their scores may be anything): no inf/NaN
    # in the values or the gradients; a fully masked row divides 0 by 1.
    a_safe = jnp.where(m, a, 0.0)
    amax = lax.stop_gradient(jnp.max(jnp.where(m, a_safe, -jnp.inf), axis=-1, keepdims=True))
    amax = jnp.where(jnp.isfinite(amax), amax, 0.0)
    e = jnp.where(m, jnp.exp(a_safe - amax), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    p = e / jnp.where(denom == 0.0, 1.0, denom)
    if stages["post"]:
        p = _compose_reference(p, G, **stages["post"])
    p = jnp.where(m, p, 0.0)
    o = jnp.einsum("bnts,bsnh->btnh", p, v_h, precision=lax.Precision.HIGHEST).astype(q.dtype)
    return (o, p.astype(q.dtype)) if return_attention_scores else o
