"""The forward kernel of the fused Pallas DCMHA attention and its pallas_call.

Grid (B, G, T / block_q); a program loops over the key tiles twice: (1) scores ->
pre-compose -> masked online max / sum: each head's row log-sum-exp ``lse`` of the
pre-composed scores (B, N, T); (2) recompute scores -> pre-compose -> P = exp(a - lse) ->
post-compose -> zero masked entries -> accumulate P.V (and write the scores when asked).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .specs import compiler_params, term_inputs
from .tiles import (MASKED, STAGES, _compose, _dot_nn, _dot_nt, _key_range, _key_tile,
                    _kv_heads, _load_terms, _merge, _probs)


def _forward_kernel(*refs, names, opts, n_k):
    """One (batch, group, query tile): lse pass then output pass over the key tiles."""
    r = dict(zip(names, refs))
    M, (bq, bk) = opts.M, opts.blocks[:2]
    t0 = pl.program_id(2) * bq
    kvh = _kv_heads(opts)
    q = [r["q"][m].astype(jnp.float32) for m in range(M)]
    tq = {st: _load_terms(r, opts, st, "q", slice(None)) for st in STAGES}

    def tile(j):
        return _key_tile(r, opts, kvh, t0, j, bq, bk)

    def lse_step(j, carry):
        mx, sm = carry
        _, tk, k, valid = tile(j)
        s = [_dot_nt(opts, q[m], k[m]) * opts.scale for m in range(M)]
        a = _compose(s, _merge(tq["pre"], tk["pre"])) if opts.pre else s
        new_mx, new_sm = [], []
        for m in range(M):
            mx_m = jnp.maximum(mx[m], jnp.max(jnp.where(valid, a[m], MASKED), axis=1))
            e = jnp.where(valid, jnp.exp(a[m] - mx_m[:, None]), 0.0)
            new_sm.append(sm[m] * jnp.exp(mx[m] - mx_m) + jnp.sum(e, axis=1))
            new_mx.append(mx_m)
        return new_mx, new_sm

    lo, hi = _key_range(opts, t0, bq, bk, n_k)
    init = ([jnp.full((bq,), MASKED, jnp.float32) for _ in range(M)],
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
        return [acc[n] + _dot_nn(opts, pp[n], r["v"][kvh[n], cols, :].astype(jnp.float32))
                for n in range(M)]

    dv_p = r["o"].shape[-1]
    if opts.scores:  # every tile of the returned scores is written, skipped ones as 0
        lo, hi = 0, n_k
    acc = lax.fori_loop(lo, hi, out_step, [jnp.zeros((bq, dv_p), jnp.float32) for _ in range(M)])
    for m in range(M):
        r["o"][m] = acc[m].astype(r["o"].dtype)
        r["lse"][m] = lse[m]


def forward(opts, q, k, v, terms, mask):
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
    tn, ta, ts = term_inputs(opts, terms, True, bq, bk, T_p, S_p)
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
        out_shape=out_shape, interpret=opts.interpret, compiler_params=compiler_params(opts),
        name="dcmha_forward")(*arrays, *ta)
