"""The backward kernels of the fused Pallas DCMHA attention and their pallas_calls.

Both recompute the forward tiles with the math of ``spec/reference_grad.py``:
  rows, grid (B, G, T / block_q), loop over key tiles, twice: (1)
     ``delta[t] = sum_s P[t,s] dP[t,s]`` per head, where dP (the gradient of the softmax
     output) is the post-compose transpose of dO.V^T, a reduction over every key tile
     (it replaces FlashAttention's rowsum(dO * O), which no longer holds); (2)
     dA = P (dP - delta), dScores = pre-compose transpose of dA; accumulate dq, every
     query-side weight gradient and the static-weight gradients as per-row partial sums.
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

from .specs import compiler_params, grad_outputs, term_inputs
from .tiles import (STAGES, _compose, _compose_grads, _dot_nn, _dot_tn, _dpp, _grads_of_tile,
                    _key_range, _key_tile, _kv_heads, _load_terms, _merge, _probs,
                    _query_range, _valid)


def _backward_rows_kernel(*refs, names, opts, n_k):
    """One (batch, group, query tile): delta pass, then dq and query-side weight gradients."""
    r = dict(zip(names, refs))
    M, (bq, bk) = opts.M, opts.blocks[2:]
    t0 = pl.program_id(2) * bq
    kvh = _kv_heads(opts)
    q = [r["q"][m].astype(jnp.float32) for m in range(M)]
    do = [r["do"][m].astype(jnp.float32) for m in range(M)]
    lse = [r["lse"][m][:, None] for m in range(M)]
    tq = {st: _load_terms(r, opts, st, "q", slice(None)) for st in STAGES}

    def tile(j):
        cols, tk, k, valid = _key_tile(r, opts, kvh, t0, j, bq, bk)
        v = [r["v"][kvh[m], cols, :].astype(jnp.float32) for m in range(M)]
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
        dq = [dq[m] + _dot_nn(opts, ds[m], k[m]) * opts.scale for m in range(M)]
        new = {"pre": _compose_grads(s, da, tq["pre"], "q", 1) if opts.pre else {},
               "post": _compose_grads(p, dpp, tq["post"], "q", 1) if opts.post else {}}
        gw = {st: jax.tree.map(jnp.add, gw[st], new[st]) for st in STAGES}
        return dq, gw

    d_p = r["q"].shape[-1]
    init = ([jnp.zeros((bq, d_p), jnp.float32) for _ in range(M)],
            {st: grad_zeros(st) for st in STAGES})
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
    tk = {st: _load_terms(r, opts, st, "k", slice(None)) for st in STAGES}
    zeros = lambda: jnp.zeros((bk,), jnp.float32)  # noqa: E731

    def grad_step(i, carry):
        dk, dv, gw = carry
        t0 = pl.multiple_of(i * bq, bq)
        rows = pl.ds(t0, bq)
        tq = {st: _load_terms(r, opts, st, "q", rows) for st in STAGES}
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
        dv = [dv[m] + _dot_tn(opts, jnp.where(valid, pp[m], 0.0), do[m]) for m in range(M)]
        dk = [dk[m] + _dot_tn(opts, ds[m], q[m]) * opts.scale for m in range(M)]
        new = {"pre": _compose_grads(s, da, tk["pre"], "k", 0) if opts.pre else {},
               "post": _compose_grads(p, dpp, tk["post"], "k", 0) if opts.post else {}}
        gw = {st: jax.tree.map(jnp.add, gw[st], new[st]) for st in STAGES}
        return dk, dv, gw

    lo, hi = _query_range(opts, s0, bq, bk, n_q)
    d_p, dv_p = r["k"].shape[-1], r["v"].shape[-1]
    init = ([jnp.zeros((bk, d_p), jnp.float32) for _ in range(M)],
            [jnp.zeros((bk, dv_p), jnp.float32) for _ in range(M)],
            {st: {n: jax.tree.map(lambda _: zeros(), x) for n, x in tk[st].items()}
             for st in STAGES})
    dk, dv, gw = lax.fori_loop(lo, hi, grad_step, init)
    for m in range(M):
        r["dk"][m] = dk[m]
        r["dv"][m] = dv[m]
    _store_weight_grads(r, opts, gw)


def _store_weight_grads(r, opts, gw):
    """Write the accumulated weight-gradient vectors of this kernel's side (and static rows)."""
    for st in STAGES:
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


def backward(opts, q, k, v, terms, mask, lse, do, dscores):
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
    tn, ta, ts = term_inputs(opts, terms, True, bq, bk, T_p, S_p)
    gn, gs, gsp = grad_outputs(opts, "q", B, T_p, bq)
    outs = pl.pallas_call(
        functools.partial(_backward_rows_kernel, names=tuple(names + tn + ["dq", "delta"] + gn),
                          opts=opts, n_k=S_p // bk),
        grid=(B, G, T_p // bq), in_specs=specs + ts,
        out_specs=[row(d_p), vec] + gsp,
        out_shape=[jax.ShapeDtypeStruct((B, N, T_p, d_p), jnp.float32),
                   jax.ShapeDtypeStruct((B, N, T_p), jnp.float32)] + gs,
        interpret=opts.interpret, compiler_params=compiler_params(opts),
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
    tn, ta, ts = term_inputs(opts, terms, False, bq, bk, T_p, S_p)
    gn, gs, gsp = grad_outputs(opts, "k", B, S_p, bk)
    outs = pl.pallas_call(
        functools.partial(_backward_cols_kernel, names=tuple(names + tn + ["dk", "dv"] + gn),
                          opts=opts, n_q=T_p // bq),
        grid=(B, G, S_p // bk), in_specs=specs + ts,
        out_specs=[col(d_p), col(dv_p)] + gsp,
        out_shape=[jax.ShapeDtypeStruct((B, N, S_p, d_p), jnp.float32),
                   jax.ShapeDtypeStruct((B, N, S_p, dv_p), jnp.float32)] + gs,
        interpret=opts.interpret, compiler_params=compiler_params(opts),
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
            dterms[st][n] = g.sum(axis=(0, 4)) if n == "static" else g
    return dq, dk, dv, dterms
