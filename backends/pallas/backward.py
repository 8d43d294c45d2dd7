"""The backward kernels of the fused Pallas DCMHA attention and their pallas_calls.

Both recompute the forward tiles with the math of ``spec/reference_grad.py``:
  rows, grid (B, G, T / block_q), loop over key tiles, twice: (1)
     ``delta[t] = sum_s P[t,s] dP[t,s]`` per head, where dP (the gradient of the softmax
     output) is the post-compose transpose of dO.V^T, a reduction over every key tile
     (it replaces FlashAttention's rowsum(dO * O), which no longer holds); (2)
     dA = P (dP - delta), dScores = pre-compose transpose of dA; accumulate dq, every
     query-side weight gradient and the static-weight gradients (one sum per tile).
  columns, grid (B, G, S / block_k), loop over query tiles: the same recomputation;
     accumulate dk, dv (per query head, summed onto the kv heads afterwards so groups
     never race) and every key-side weight gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .specs import compiler_params, grad_outputs, sizes_spec, term_inputs
from .tiles import (F32, STAGES, Tile, _dot_nn, _dot_tn, _grad_zeros, _heads, _key_range, _put,
                    _query_range, _row_vector, _store_grads, _store_heads, _take)


def _backward_rows_kernel(*refs, names, opts):
    """One (batch, group, query tile): delta pass, then dq and query-side weight gradients."""
    r = dict(zip(names, refs))
    bq, bk = opts.blocks[2:]
    g, t0 = pl.program_id(1), pl.program_id(2) * bq

    def tile(j):
        s0 = pl.multiple_of(j * bk, bk)
        return Tile(opts, r, g, t0, s0, slice(None), pl.ds(s0, bk), bq, bk)

    lse = _row_vector(opts, r, "lse", slice(None), bq)

    def delta_step(j, delta):
        x = tile(j)
        return delta + jnp.sum(x.probs(lse)[1] * x.dp(x.dpp()), axis=2)

    lo, hi = _key_range(opts, r, t0, bq, bk)
    delta = lax.fori_loop(lo, hi, delta_step, jnp.zeros((opts.H, bq), F32))

    def grad_step(j, carry):
        dq, gw = carry
        x = tile(j)
        s, p, dpp, da, ds = x.grads(lse, delta[:, :, None])

        def head(m, dq):
            return _put(dq, m, _dot_nn(opts, _take(ds, m), x.k(m)) * opts.scale, add=True)
        return _heads(opts, head, dq), x.weight_grads(gw, "q", s, p, dpp, da)

    d_p = r["q"].shape[-1]
    init = (jnp.zeros((opts.H, bq, d_p), F32),
            {st: _grad_zeros(opts, st, "q", bq) for st in STAGES})
    dq, gw = lax.fori_loop(lo, hi, grad_step, init)
    _store_heads(opts, ((r["dq"], dq), (r["delta"], delta)))
    _store_grads(r, gw)


def _backward_cols_kernel(*refs, names, opts):
    """One (batch, group, key tile): dk, dv and key-side weight gradients over query tiles."""
    r = dict(zip(names, refs))
    bq, bk = opts.blocks[2:]
    g, s0 = pl.program_id(1), pl.program_id(2) * bk

    def grad_step(i, carry):
        dk, dv, gw = carry
        t0 = pl.multiple_of(i * bq, bq)
        x = Tile(opts, r, g, t0, s0, pl.ds(t0, bq), slice(None), bq, bk)
        rows = pl.ds(t0, bq)
        s, p, dpp, da, ds = x.grads(_row_vector(opts, r, "lse", rows, bq),
                                    _row_vector(opts, r, "delta", rows, bq))
        pp = x.post_probs(p)

        def head(m, carry):
            dk, dv = carry
            dv = _put(dv, m, _dot_tn(opts, _take(pp, m), x.do(m)), add=True)
            dk = _put(dk, m, _dot_tn(opts, _take(ds, m), x.q(m)) * opts.scale, add=True)
            return dk, dv
        dk, dv = _heads(opts, head, (dk, dv))
        return dk, dv, x.weight_grads(gw, "k", s, p, dpp, da)

    lo, hi = _query_range(opts, r, s0, bq, bk)
    d_p, dv_p = r["k"].shape[-1], r["v"].shape[-1]
    init = (jnp.zeros((opts.H, bk, d_p), F32), jnp.zeros((opts.H, bk, dv_p), F32),
            {st: _grad_zeros(opts, st, "k", bk) for st in STAGES})
    dk, dv, gw = lax.fori_loop(lo, hi, grad_step, init)
    _store_heads(opts, ((r["dk"], dk), (r["dv"], dv)))
    _store_grads(r, gw)


def backward(opts, q, k, v, terms, mask, sizes, lse, do, dscores):
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
    names = ["q", "k", "v", "do", "lse", "sizes"]
    arrays = [q, k, v, do, lse, sizes]
    specs = [row(d_p), full_kv(d_p), full_kv(dv_p), row(dv_p), vec, sizes_spec()]
    if opts.has_mask:
        names.append("mask")
        arrays.append(mask)
        specs.append(pl.BlockSpec((None, bq, S_p), lambda b, g, i: (b, i, 0)))
    if opts.scores:
        names.append("dscores")
        arrays.append(dscores)
        specs.append(row(S_p))
    tn, ta, ts = term_inputs(opts, terms, True, bq, bk, T_p, S_p)
    gn, gs, gsp = grad_outputs(opts, "q", B, T_p, bq)
    outs = pl.pallas_call(
        functools.partial(_backward_rows_kernel, names=tuple(names + tn + ["dq", "delta"] + gn),
                          opts=opts),
        grid=(B, G, T_p // bq), in_specs=specs + ts,
        out_specs=[row(d_p), vec] + gsp,
        out_shape=[jax.ShapeDtypeStruct((B, N, T_p, d_p), jnp.float32),
                   jax.ShapeDtypeStruct((B, N, T_p), jnp.float32)] + gs,
        interpret=opts.interpret, compiler_params=compiler_params(opts, True),
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
    names = ["q", "k", "v", "do", "lse", "delta", "sizes"]
    arrays = [q, k, v, do, lse, delta, sizes]
    specs = [full_q(d_p), kv_tile(d_p), kv_tile(dv_p), full_q(dv_p), full_vec, full_vec,
             sizes_spec()]
    if opts.has_mask:
        names.append("mask")
        arrays.append(mask)
        specs.append(pl.BlockSpec((None, T_p, bk), lambda b, g, j: (b, 0, j)))
    if opts.scores:
        names.append("dscores")
        arrays.append(dscores)
        specs.append(pl.BlockSpec((None, M, T_p, bk), lambda b, g, j: (b, g, 0, j)))
    tn, ta, ts = term_inputs(opts, terms, False, bq, bk, T_p, S_p)
    gn, gs, gsp = grad_outputs(opts, "k", B, S_p, bk)
    outs = pl.pallas_call(
        functools.partial(_backward_cols_kernel, names=tuple(names + tn + ["dk", "dv"] + gn),
                          opts=opts),
        grid=(B, G, S_p // bk), in_specs=specs + ts,
        out_specs=[col(d_p), col(dv_p)] + gsp,
        out_shape=[jax.ShapeDtypeStruct((B, N, S_p, d_p), jnp.float32),
                   jax.ShapeDtypeStruct((B, N, S_p, dv_p), jnp.float32)] + gs,
        interpret=opts.interpret, compiler_params=compiler_params(opts, True),
        name="dcmha_backward_cols")(*arrays, *ta)
    dk_h, dv_h = outs[0], outs[1]
    grads.update(zip(gn, outs[2:]))

    # Query head h reads kv head h // rep: sum the rep heads of each kv head.
    dk = dk_h.reshape(B, N_kv, opts.rep, S_p, d_p).sum(2)
    dv = dv_h.reshape(B, N_kv, opts.rep, S_p, dv_p).sum(2)
    dterms = {st: {} for st in STAGES}
    for st in STAGES:
        for n in getattr(opts, st):
            g = grads[f"d{st}_{n}"]
            dterms[st][n] = g.sum(axis=(0, 2)) if n == "static" else g
    return dq, dk, dv, dterms
