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

from .specs import compiler_params, sizes_spec, term_inputs
from .tiles import (F32, MASKED, Tile, _dot_nn, _heads, _key_range, _put, _store_heads,
                    _take)


def _forward_kernel(*refs, names, opts, n_k):
    """One (batch, group, query tile): lse pass then output pass over the key tiles."""
    r = dict(zip(names, refs))
    bq, bk = opts.blocks[:2]
    g, t0 = pl.program_id(1), pl.program_id(2) * bq

    def tile(j):
        s0 = pl.multiple_of(j * bk, bk)
        return Tile(opts, r, g, t0, s0, slice(None), pl.ds(s0, bk), bq, bk)

    def lse_step(j, carry):
        mx, sm = carry
        x = tile(j)
        s = x.scores()
        a = jnp.where(x.valid, x.pre_composed(s), MASKED)
        new_mx = jnp.maximum(mx, jnp.max(a, axis=2))
        e = jnp.where(x.valid, jnp.exp(a - new_mx[:, :, None]), 0.0)
        return new_mx, sm * jnp.exp(mx - new_mx) + jnp.sum(e, axis=2)

    lo, hi = _key_range(opts, r, t0, bq, bk)
    init = (jnp.full((opts.H, bq), MASKED, F32), jnp.zeros((opts.H, bq), F32))
    mx, sm = lax.fori_loop(lo, hi, lse_step, init)
    # A fully masked row has sum 0: any finite lse works, P is zeroed by the mask.
    lse = jnp.where(sm > 0, mx + jnp.log(jnp.where(sm > 0, sm, 1.0)), 0.0)

    def out_step(j, acc):
        x = tile(j)
        pp = x.post_probs(x.probs(lse[:, :, None])[1])

        def head(m, acc):
            pm = _take(pp, m)
            if opts.scores:
                r["scores"][m, :, x.cols] = pm.astype(r["scores"].dtype)
            return _put(acc, m, _dot_nn(opts, pm, x.v(m)), add=True)
        return _heads(opts, head, acc)

    dv_p = r["o"].shape[-1]
    if opts.scores:  # every tile of the returned scores is written, skipped ones as 0
        lo, hi = 0, n_k
    acc = lax.fori_loop(lo, hi, out_step, jnp.zeros((opts.H, bq, dv_p), F32))
    _store_heads(opts, ((r["o"], acc), (r["lse"], lse)))


def forward(opts, q, k, v, terms, mask, sizes):
    """Run the forward kernel on kernel-layout arrays -> (o, lse[, scores])."""
    B, N, T_p, d_p = q.shape
    N_kv, S_p = k.shape[1], k.shape[2]
    dv_p = v.shape[-1]
    bq, bk = opts.blocks[:2]

    def full_kv(dim):
        return pl.BlockSpec((None, N_kv, S_p, dim), lambda b, g, i: (b, 0, 0, 0))

    names = ["q", "k", "v", "sizes"]
    arrays = [q, k, v, sizes]
    specs = [pl.BlockSpec((None, opts.M, bq, d_p), lambda b, g, i: (b, g, i, 0)),
             full_kv(d_p), full_kv(dv_p), sizes_spec()]
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
        out_shape=out_shape, interpret=opts.interpret,
        compiler_params=compiler_params(opts, False),
        name="dcmha_forward")(*arrays, *ta)
