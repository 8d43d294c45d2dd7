"""BlockSpecs of the fused Pallas kernels' compose terms and weight gradients.

Kernel layouts (made by ``dcmha_pallas``): sizes (4,) int32, q (B,N,T_p,d_p), k (B,N_kv,S_p,d_p),
v (B,N_kv,S_p,dv_p), do (B,N,T_p,dv_p), lse/delta (B,N,T_p) float32, mask (B,T_p,S_p)
int8; the compose terms with the M heads of a group zero-padded to H (a power of two) and
the ranks R to R_p: qw1/qw2 (B,G,R_p,H,T_p), kw1/kw2 (B,G,R_p,H,S_p), qdd (B,G,H,T_p),
kdd (B,G,H,S_p), static (G,H,H). Their gradients have the same layouts, except static's:
(B,G,T_p / block_q,H,H), one sum per query tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .tiles import STAGES


def _term_spec(stage, n, opts, L, blk, tiled):
    """BlockSpec of compose term ``n`` of ``stage``; ``tiled``: block the sequence by ``blk``."""
    M = opts.H
    if n == "static":
        return pl.BlockSpec((None, M, M), lambda b, g, i: (g, 0, 0))
    if n.endswith("dd"):
        shape = (None, None, M, blk if tiled else L)
        return pl.BlockSpec(shape, (lambda b, g, i: (b, g, 0, i)) if tiled
                            else (lambda b, g, i: (b, g, 0, 0)))
    shape = (None, None, opts.rank_pad(stage, n[0]), M, blk if tiled else L)
    return pl.BlockSpec(shape, (lambda b, g, i: (b, g, 0, 0, i)) if tiled
                        else (lambda b, g, i: (b, g, 0, 0, 0)))


def term_inputs(opts, terms, rows_tiled, bq, bk, T_p, S_p):
    """(names, arrays, specs) of the compose terms; query side tiled iff ``rows_tiled``."""
    names, arrays, specs = [], [], []
    for st in STAGES:
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


def grad_outputs(opts, side, B, L, blk):
    """(names, shapes, specs) of the weight-gradient outputs of one side, tiled by ``blk``."""
    names, shapes, specs = [], [], []
    G, M = opts.G, opts.H
    for st in STAGES:
        for n in getattr(opts, st):
            if n == "static":
                if side != "q":
                    continue
                names.append(f"d{st}_static")
                shapes.append(jax.ShapeDtypeStruct((B, G, L // blk, M, M), jnp.float32))
                specs.append(pl.BlockSpec((None, None, None, M, M),
                                          lambda b, g, i: (b, g, i, 0, 0)))
                continue
            if n[0] != side:
                continue
            names.append(f"d{st}_{n}")
            if n.endswith("dd"):
                shapes.append(jax.ShapeDtypeStruct((B, G, M, L), jnp.float32))
                specs.append(pl.BlockSpec((None, None, M, blk), lambda b, g, i: (b, g, 0, i)))
            else:
                R = opts.rank_pad(st, side)
                shapes.append(jax.ShapeDtypeStruct((B, G, R, M, L), jnp.float32))
                specs.append(pl.BlockSpec((None, None, R, M, blk),
                                          lambda b, g, i: (b, g, 0, 0, i)))
    return names, shapes, specs


def sizes_spec():
    """BlockSpec of the kernels' (4,) int32 "sizes" input: T, S, query offset, 0."""
    return pl.BlockSpec((4,), lambda b, g, i: (0,))


def compiler_params(opts, backward):
    """Triton parameters of the forward (or the ``backward``) kernels; None interpreted."""
    if opts.interpret:
        return None
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=opts.warps[int(backward)], num_stages=2)


