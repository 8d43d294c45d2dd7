"""Tile math of the fused Pallas kernels (``forward``, ``backward``): (H, rows, columns) tiles.

Inside a kernel a group's M heads are one float32 array of shape (H, block_q, block_k), H =
M rounded up to a power of two (Triton tensors have power-of-two sizes); the heads past M are
zero and masked. Pallas lowers only 2-D dots without batch dimensions to Triton, so the
per-head dots (Q.K^T, P.V and those of the backward) run in runtime loops over the heads
(``lax.fori_loop``, one dot per iteration) that read and write one head of the 3-D arrays
by one-hot selects and reductions (``_take``, ``_put``). The compose is elementwise work
on the 3-D tile: the static term a runtime loop over its M input heads, the low-rank terms
runtime loops over the rank, the gates broadcasts. So the size of the lowered code, and
the Triton / ptxas compile time, do not grow with M or R.

Compose terms are read from their refs where they are used, padded on the host to H heads
(and the ranks to powers of two): query-side vectors broadcast as (H, rows, 1), key-side
ones as (H, 1, cols), static as (H, H). ``opts`` is the static description of a call
(``dcmha_pallas._Opts``).
"""

from __future__ import annotations

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
F32 = jnp.float32


def _precision(opts):
    """Float32 dots: compiled, three TF32 tensor-core products of the operands' high and low
    TF32 parts (about float32's accuracy; IEEE float32 dots compile to unrolled scalar FMAs,
    slow on the GPU and minutes of ptxas at d = 128); interpreted, full float32."""
    return (lax.Precision.HIGHEST if opts.interpret
            else lax.DotAlgorithmPreset.TF32_TF32_F32_X3)


def _dot(opts, a, b, contract):
    return lax.dot_general(a, b, (contract, ((), ())), precision=_precision(opts),
                           preferred_element_type=F32)


def _dot_nt(opts, a, b):
    """a (X, h) . b (Y, h)^T -> (X, Y) in float32."""
    return _dot(opts, a, b, ((1,), (1,)))


def _dot_tn(opts, a, b):
    """a (X, Y)^T . b (X, h) -> (Y, h) in float32."""
    return _dot(opts, a, b, ((0,), (0,)))


def _dot_nn(opts, a, b):
    """a (X, Y) . b (Y, h) -> (X, h) in float32."""
    return _dot(opts, a, b, ((1,), (0,)))


# ---------------------------------------------------------------------------
# One head of a (H, ...) array
# ---------------------------------------------------------------------------

def _onehot(x, m):
    """(H, 1, ...) bool, broadcastable to the (H, ...) array ``x``: True at head ``m``."""
    return lax.broadcasted_iota(jnp.int32, (x.shape[0],) + (1,) * (x.ndim - 1), 0) == m


def _take(x, m):
    """x[m] of a (H, ...) array, ``m`` traced (a one-hot reduction)."""
    return jnp.sum(jnp.where(_onehot(x, m), x, 0.0), axis=0)


def _put(x, m, y, add=False):
    """x with x[m] replaced by ``y`` (or increased by it with ``add``)."""
    return jnp.where(_onehot(x, m), (x + y[None]) if add else y[None], x)


def _heads(opts, body, init):
    """``lax.fori_loop`` over the M heads of the group."""
    return lax.fori_loop(0, opts.M, body, init)


def _head_ok(opts):
    """(H, 1, 1) bool: the real heads (the padding heads past M are masked)."""
    return lax.broadcasted_iota(jnp.int32, (opts.H, 1, 1), 0) < opts.M


def _kv_head(opts, g, m):
    """kv head read by head ``m`` of group ``g`` (query head h -> h // rep)."""
    return lax.div(g * opts.M + m, opts.rep)


# ---------------------------------------------------------------------------
# Compose terms
# ---------------------------------------------------------------------------

def _terms(refs, opts, stage, rows, cols):
    """{name: (ref, slice)} of one stage's compose terms: query-side ones sliced by ``rows``,
    key-side ones by ``cols`` along the sequence, static with no slice; "_stage": the stage."""
    out = {"_stage": stage}
    for n in getattr(opts, stage):
        out[n] = (refs[f"{stage}_{n}"], None if n == "static" else rows if n[0] == "q" else cols)
    return out


def _vec(ref, sl, side, *lead):
    """Load ``ref[*lead, :, sl]`` (H heads) as float32, (H, rows, 1) for the query side,
    (H, 1, cols) for the key side."""
    v = ref[(*lead, slice(None), sl)].astype(F32)
    return v[:, :, None] if side == "q" else v[:, None, :]


def _compose(opts, x, t, transpose=False):
    """compose (or its transpose) of the (H, rows, cols) tile ``x`` with the terms ``t``.

    out[n] = x[n] + sum_m x[m] W[m, n] (W = static + low rank + diagonal gates); the
    transpose (the compose backward w.r.t. its input) applies W^T: static transposed,
    w1 and w2 swapped.
    """
    out = x
    if "static" in t:
        ref = t["static"][0]

        def static_step(m, out):
            w = (ref[:, m] if transpose else ref[m, :]).astype(F32)
            return out + w[:, None, None] * _take(x, m)[None]
        out = lax.fori_loop(0, opts.M, static_step, out)
    for side in "qk":
        if side + "w1" not in t:
            continue
        (w_in, sl), (w_out, _) = t[side + "w1"], t[side + "w2"]
        if transpose:
            w_in, w_out = w_out, w_in

        def rank_step(r, out, w_in=w_in, w_out=w_out, sl=sl, side=side):
            hidden = jnp.sum(x * _vec(w_in, sl, side, r), axis=0)
            return out + hidden[None] * _vec(w_out, sl, side, r)
        out = lax.fori_loop(0, opts.rank(t["_stage"], side), rank_step, out)
    gates = [_vec(t[n][0], t[n][1], n[0]) for n in ("qdd", "kdd") if n in t]
    if gates:
        out = out + x * (gates[0] + gates[1] if len(gates) == 2 else gates[0])
    return out


def _grad_zeros(opts, stage, side, length):
    """Zero accumulators of one side's weight gradients of ``stage``: {name: array};
    (R_pad, H, length) for w1 / w2, (H, length) for dd, (H, H) for static (query side)."""
    out = {}
    for n in getattr(opts, stage):
        if n == "static":
            if side == "q":
                out[n] = jnp.zeros((opts.H, opts.H), F32)
        elif n[0] == side:
            shape = ((opts.rank_pad(stage, side),) if n[1] == "w" else ()) + (opts.H, length)
            out[n] = jnp.zeros(shape, F32)
    return out


def _compose_grads(opts, acc, x, gy, t, side):
    """``acc`` plus the gradients of one side's compose weights for one tile.

    x: the compose input tile; gy: the gradient of its output. Side "q" reduces over keys
    (one value per query row), side "k" over queries; static (side "q") over both.
    """
    axis = 2 if side == "q" else 1
    out = dict(acc)
    if side + "w1" in acc:
        (w1, sl), (w2, _) = t[side + "w1"], t[side + "w2"]

        def rank_step(r, carry):
            g1, g2 = carry
            g_hidden = jnp.sum(gy * _vec(w2, sl, side, r), axis=0)
            hidden = jnp.sum(x * _vec(w1, sl, side, r), axis=0)
            g1 = _put(g1, r, jnp.sum(x * g_hidden[None], axis=axis), add=True)
            g2 = _put(g2, r, jnp.sum(gy * hidden[None], axis=axis), add=True)
            return g1, g2
        out[side + "w1"], out[side + "w2"] = lax.fori_loop(
            0, opts.rank(t["_stage"], side), rank_step, (acc[side + "w1"], acc[side + "w2"]))
    if side + "dd" in acc:
        out[side + "dd"] = acc[side + "dd"] + jnp.sum(x * gy, axis=axis)
    if "static" in acc:
        def static_step(m, g):
            row = jnp.sum(_take(x, m)[None] * gy, axis=(1, 2))
            return _put(g, m, row, add=True)
        out["static"] = lax.fori_loop(0, opts.M, static_step, acc["static"])
    return out


def _store_grads(r, gw):
    """Write the accumulated weight gradients (``_grad_zeros`` layout) of both stages."""
    for st in STAGES:
        for name, val in gw[st].items():
            r[f"d{st}_{name}"][...] = val


# ---------------------------------------------------------------------------
# Masks and tile ranges
# ---------------------------------------------------------------------------

def _lengths(refs):
    """(T, S, offset): the true lengths and the query offset, runtime values of the "sizes"
    input (the kernels' text does not depend on them: every length that pads to the same
    T_p, S_p lowers to the same kernels)."""
    sizes = refs["sizes"]
    return sizes[0], sizes[1], sizes[2]


def _valid(opts, refs, t0, s0, bq, bk, mask_rows, mask_cols):
    """(H, bq, bk) bool: the entries of the tile that attend (padding, padding heads masked)."""
    T, S, offset = _lengths(refs)
    t = t0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    s = s0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    ok = (t < T) & (s < S)
    t = t + offset   # absolute query position
    if opts.causal:
        ok &= s <= t
    if opts.window is not None:
        ok &= (t - s < opts.window) & (s - t < opts.window)
    if opts.has_mask:
        ok &= refs["mask"][mask_rows, mask_cols] != 0
    return ok[None] & _head_ok(opts)


def _key_range(opts, refs, t0, bq, bk):
    """[lo, hi) of the key tiles that can hold an allowed entry for rows [t0, t0 + bq).

    ``dcmha.spec.terms.key_range`` in tiles, written with lax ops because t0 is
    traced (the kernel's program id); empty for padding rows.
    """
    T, S, offset = _lengths(refs)
    lo, hi = 0, lax.div(S + bk - 1, bk)
    first = t0 + offset                # absolute positions of the first and last row
    last = first + bq - 1
    if opts.causal:
        hi = jnp.minimum(hi, lax.div(last, bk) + 1)
    if opts.window is not None:
        lo = lax.div(jnp.maximum(first - opts.window + 1, 0), bk)
        hi = jnp.minimum(hi, lax.div(last + opts.window - 1, bk) + 1)
    return lo, jnp.where(t0 < T, hi, 0)


def _query_range(opts, refs, s0, bq, bk):
    """[lo, hi) of the query tiles that can hold an allowed entry for keys [s0, s0 + bk).

    The converse of ``dcmha.spec.terms.key_range`` (same causal / window rule), in tiles;
    empty for padding keys.
    """
    T, S, offset = _lengths(refs)
    lo, hi = 0, lax.div(T + bq - 1, bq)
    rel = s0 - offset                  # key positions relative to query row 0
    if opts.causal:                    # rows t >= rel
        lo = lax.div(jnp.maximum(rel, 0), bq)
    if opts.window is not None:        # rows rel - W < t < rel + bk - 1 + W
        lo = jnp.maximum(lo, lax.div(jnp.maximum(rel - opts.window + 1, 0), bq))
        hi = jnp.minimum(hi, lax.div(jnp.maximum(rel + bk + opts.window - 2, 0), bq) + 1)
    return lo, jnp.where(s0 < S, hi, 0)


# ---------------------------------------------------------------------------
# Recomputing a tile
# ---------------------------------------------------------------------------

class Tile:
    """One (query tile, key tile) pair of group ``g`` (the program id, read outside loops: the
    interpreter has no program id inside them), at rows t0 and columns s0: how to read its
    per-head operands and recompute it.

    ``rows`` / ``cols`` index the tile in the refs' blocks (a ``pl.ds`` along the looped
    axis, ``slice(None)`` along the program's own). ``q(m)``, ``k(m)``, ``v(m)``, ``do(m)``,
    ``dscores(m)`` load head m's 2-D operand in float32; ``valid`` is the (H, bq, bk) mask;
    ``pre`` / ``post`` the terms of each stage.
    """

    def __init__(self, opts, r, g, t0, s0, rows, cols, bq, bk):
        self.opts, self.r, self.g, self.rows, self.cols = opts, r, g, rows, cols
        self.valid = _valid(opts, r, t0, s0, bq, bk, rows, cols)
        self.pre = _terms(r, opts, "pre", rows, cols)
        self.post = _terms(r, opts, "post", rows, cols)
        self.shape = (opts.H, bq, bk)

    def _load(self, name, m, lo_rows, kv):
        ref = self.r[name]
        head = _kv_head(self.opts, self.g, m) if kv else m
        return ref[head, lo_rows, :].astype(F32)

    def q(self, m):
        return self._load("q", m, self.rows, False)

    def do(self, m):
        return self._load("do", m, self.rows, False)

    def k(self, m):
        return self._load("k", m, self.cols, True)

    def v(self, m):
        return self._load("v", m, self.cols, True)

    def dscores(self, m):
        return self.r["dscores"][m, self.rows, self.cols].astype(F32)

    def scores(self):
        """Raw scores (H, bq, bk): one Q.K^T per head."""
        opts = self.opts

        def step(m, s):
            return _put(s, m, _dot_nt(opts, self.q(m), self.k(m)) * opts.scale)
        return _heads(opts, step, jnp.zeros(self.shape, F32))

    def probs(self, lse):
        """(s, p): raw scores and the masked softmax of the pre-composed ones given ``lse``
        (H, bq, 1)."""
        s = self.scores()
        return s, jnp.where(self.valid, jnp.exp(self.pre_composed(s) - lse), 0.0)

    def pre_composed(self, s):
        """The pre-composed scores (``s`` when the stage is off)."""
        return _compose(self.opts, s, self.pre) if self.opts.pre else s

    def post_probs(self, p):
        """The post-composed, masked probabilities."""
        pp = _compose(self.opts, p, self.post) if self.opts.post else p
        return jnp.where(self.valid, pp, 0.0)

    def dpp(self):
        """Gradient of the post-composed P: dO.V^T (+ the scores' cotangent), 0 where masked."""
        opts = self.opts

        def step(m, g):
            gm = _dot_nt(opts, self.do(m), self.v(m))
            if opts.scores:
                gm = gm + self.dscores(m)
            return _put(g, m, gm)
        return jnp.where(self.valid, _heads(opts, step, jnp.zeros(self.shape, F32)), 0.0)

    def dp(self, dpp):
        """Gradient of the softmax output P (the post-compose transpose of ``dpp``)."""
        return _compose(self.opts, dpp, self.post, transpose=True) if self.opts.post else dpp

    def grads(self, lse, delta):
        """Backpropagate dO to the softmax input and the scores: (s, p, dpp, da, ds).

        s: raw scores, p: softmax, dpp: gradient of the post-composed masked P, da: of the
        pre-composed scores, ds: of the raw scores; each (H, bq, bk).
        """
        s, p = self.probs(lse)
        dpp = self.dpp()
        da = p * (self.dp(dpp) - delta)   # masked softmax backward
        ds = _compose(self.opts, da, self.pre, transpose=True) if self.opts.pre else da
        return s, p, dpp, da, ds

    def weight_grads(self, gw, side, s, p, dpp, da):
        """``gw`` ({stage: accumulators}) plus this tile's gradients of ``side``'s weights."""
        opts = self.opts
        new = dict(gw)
        if opts.pre:
            new["pre"] = _compose_grads(opts, gw["pre"], s, da, self.pre, side)
        if opts.post:
            new["post"] = _compose_grads(opts, gw["post"], p, dpp, self.post, side)
        return new


def _row_vector(opts, r, name, rows, bq):
    """(H, bq, 1) float32: the per-row vector ``name`` (lse, delta) of the M heads at ``rows``."""
    def step(m, x):
        return _put(x, m, r[name][m, rows].astype(F32))
    return _heads(opts, step, jnp.zeros((opts.H, bq), F32))[:, :, None]


def _store_heads(opts, pairs):
    """Write head m of each (H, ...) value to ``ref[m]`` for the M heads: pairs of (ref, value)."""
    def step(m, carry):
        for ref, val in pairs:
            ref[m] = _take(val, m).astype(ref.dtype)
        return carry
    lax.fori_loop(0, opts.M, step, 0)
