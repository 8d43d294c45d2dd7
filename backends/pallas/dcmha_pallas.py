"""Fused DCMHA attention in Pallas: the public API, custom VJP and plain reference.

The kernels (``forward``: one kernel; ``backward``: rows and columns kernels; their tile
math in ``tiles``, their BlockSpecs in ``specs``) never materialise a (B, N, T, S) array
(unless the attention scores are asked for: then the forward writes them tile by tile,
and the backward reads their cotangent the same way). Post-composition mixes the
*normalised* probabilities of the M heads of a group, so one online-softmax pass is not
enough: every kernel holds all M heads of one group for a (query tile, key tile) pair
and works in passes over tiles (see ``forward`` and ``backward``).

Inputs are padded here: lengths to whole tiles and to steps of 1/16 of their power of two
(``_padded``), head dims to powers of two; padded rows and keys are masked like any masked
entry. The true lengths and the query offset reach the kernels as runtime values, so the
lengths that pad alike lower to the same kernels (the same Triton IR). Scores, compose,
softmax and accumulation are float32 whatever the input dtype. Interpreted, dots are full
float32; compiled, they are three TF32 tensor-core products of the operands' high and low
parts (about float32's accuracy; IEEE float32 dots compile to unrolled scalar FMAs: slow on
the GPU, and minutes of compiling at d = 128).

GPU: the same kernels compile for Triton (interpret=False): every tile is a power of two
and at least 16 (tl.dot's minimum), and tiles are halved until each (heads, rows,
columns) tile of a program fits ``TILE_ELEMENTS`` (with 4 to 8 warps by the largest); the
kernels' code does not grow with the heads or the rank (``tiles``); loops over tiles skip
the tiles a causal or windowed mask hides entirely. ``tests/test_pallas_kernel.py`` lowers
all three kernels to Triton IR without a GPU; ``benchmarks/compile_time.py`` compiles
them to sm_90 cubins. ``MOSAIC.md`` weighs moving them to Mosaic GPU.

``dcmha_attention`` validates its arguments once and runs ``dcmha_attention_call`` on the
validated ``dcmha.call.AttentionCall``; the registry's path calls the latter directly.
The math of the backward is ``spec/reference_grad.py`` (compose_backward,
masked_softmax_backward). ``dcmha_attention_reference`` below is the same function in
plain jax.numpy, materialising everything; its ``jax.grad`` is the slow truth the kernels
are tested against.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from jax import lax

from dcmha.spec import terms as spec_terms

from .. import kernel_call
from . import backward, forward

__all__ = ["BlockSizes", "dcmha_attention", "dcmha_attention_call", "dcmha_attention_reference",
           "TERMS"]

#: Names of the compose terms a ``pre`` / ``post`` dict may hold (``dcmha.spec.terms``).
TERMS = spec_terms.TERM_NAMES
# tl.dot needs every dimension >= 16 on a GPU.
_MIN_GPU_DIM = 16
#: The most elements of one (heads, rows, columns) tile of a compiled program (``_fitted``).
#: A backward program holds five such tiles (scores, probabilities and three gradients) and
#: its accumulators: 8192 float32 are 32 registers per thread at 8 warps.
TILE_ELEMENTS = 8192
#: Padded lengths step by 1/16 of the length's power of two (``_padded``).
_LENGTH_STEPS = 16
#: Elements of the largest tile per warp of a compiled program (4 to 8 warps, ``_fitted``).
_WARP_ELEMENTS = 1024


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
    """Static description of one call (hashable: the custom_vjp's nondiff argument). The
    lengths and the query offset are runtime values (the kernels' "sizes" input)."""

    G: int
    M: int
    rep: int             # query heads per kv head
    scale: float
    causal: bool
    window: Optional[int]
    has_mask: bool
    pre: tuple           # term names present in the pre stage, in TERMS order
    post: tuple
    ranks: tuple         # ((stage, side, R), ...) for every low-rank pair
    blocks: tuple        # (block_q, block_k, block_q_bwd, block_k_bwd)
    warps: tuple         # num_warps of the compiled (forward, backward) programs
    scores: bool         # also return the post-composed probabilities (B, N, T, S)
    interpret: bool

    def rank(self, stage, side):
        return dict(((st, sd), r) for st, sd, r in self.ranks)[stage, side]

    def rank_pad(self, stage, side):
        """The rank rounded up to a power of two (the kernels' layout of the w1 / w2 terms)."""
        return _next_pow2(self.rank(stage, side))

    @property
    def H(self):
        """M rounded up to a power of two: the head axis of the kernels' tiles and terms."""
        return _next_pow2(self.M)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(opts, q, k, v, terms, mask, sizes):
    """o, or (o, scores) with opts.scores, all in kernel layouts; sizes: (T, S, offset, 0)."""
    out = forward.forward(opts, q, k, v, terms, mask, sizes)
    return (out[0], out[2]) if opts.scores else out[0]


def _fused_fwd(opts, q, k, v, terms, mask, sizes):
    out = forward.forward(opts, q, k, v, terms, mask, sizes)
    primal = (out[0], out[2]) if opts.scores else out[0]
    return primal, (q, k, v, terms, mask, sizes, out[1])


def _fused_bwd(opts, res, ct):
    q, k, v, terms, mask, sizes, lse = res
    do, dscores = ct if opts.scores else (ct, None)
    dq, dk, dv, dterms = backward.backward(opts, q, k, v, terms, mask, sizes, lse, do, dscores)
    dterms = jax.tree.map(lambda g, x: g.astype(x.dtype), dterms, terms)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dterms, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------

def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _check_inputs(q, k, v, num_groups, pre, post, mask, causal, sliding_window, scale,
                  query_offset, return_attention_scores=False):
    """Validate the arguments (``kernel_call.describe`` and JAX dtypes), once; returns the
    ``dcmha.call.AttentionCall``."""
    call = kernel_call.describe(q, k, v, num_groups=num_groups, pre=pre, post=post, mask=mask,
                                causal=causal, sliding_window=sliding_window,
                                query_offset=query_offset,
                                return_attention_scores=return_attention_scores)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"`{name}` must be a floating array. Received: {name}.dtype={x.dtype}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"`scale` must be None or a Python number. Received: scale={scale!r}")
    return call


def _stages(call):
    """{"pre": terms, "post": terms} of a call, each in TERMS order ({} for a stage off)."""
    return {st: {n: terms[n] for n in TERMS if n in terms}
            for st, terms in (("pre", call.pre or {}), ("post", call.post or {}))}


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
    call = _check_inputs(q, k, v, num_groups, pre, post, mask, causal, sliding_window, scale,
                         query_offset, return_attention_scores)
    if block_sizes is not None and (block_q is not None or block_k is not None):
        raise ValueError("Pass either `block_sizes` or `block_q`/`block_k`, not both. Received: "
                         f"block_sizes={block_sizes!r}, block_q={block_q!r}, block_k={block_k!r}")
    if block_sizes is None:
        defaults = BlockSizes()
        block_sizes = BlockSizes(block_q or defaults.block_q, block_k or defaults.block_k)
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"`block_sizes` must be a BlockSizes. Received: {block_sizes!r}")
    interpret = _default_interpret() if interpret is None else bool(interpret)
    if not interpret and min(block_sizes.block_q, block_sizes.block_k,
                             *block_sizes.backward) < _MIN_GPU_DIM:
        raise ValueError(f"GPU tiles must be at least {_MIN_GPU_DIM}. Received: {block_sizes!r}")
    return dcmha_attention_call(call, scale=scale, block_sizes=block_sizes, interpret=interpret)


def _fitted(blocks, M, d_p, dv_p, interpret):
    """(tiles, warps): tiles halved (the larger first, not below 16) until every (heads, rows,
    columns | head dim) tile a program holds has at most ``TILE_ELEMENTS`` elements, and the
    warps of the forward and of the backward programs, one per ``_WARP_ELEMENTS`` elements of
    their largest tile (4 to 8). Compiled only; larger tiles per thread live in local memory
    instead of registers: slower on the GPU, and ptxas then takes minutes."""
    if interpret:
        return blocks, (4, 4)
    heads, width = _next_pow2(M), max(d_p, dv_p)
    out, warps = [], []
    for bq, bk in (blocks[:2], blocks[2:]):
        def largest():
            return heads * max(bq, bk) * max(width, min(bq, bk))
        while largest() > TILE_ELEMENTS and max(bq, bk) > _MIN_GPU_DIM:
            if bq >= bk:
                bq //= 2
            else:
                bk //= 2
        out += [bq, bk]
        warps.append(max(4, min(8, _next_pow2(-(-largest() // _WARP_ELEMENTS)))))
    return tuple(out), tuple(warps)


def _padded(L, tiles):
    """A length padded for the kernels: to a multiple of its tiles and of 1/16 of its power of
    two (at most 1/8 more), so that the lengths padding to the same value share one compiled
    kernel (the true length is a runtime value)."""
    unit = max(*tiles, _next_pow2(L) // _LENGTH_STEPS)
    return -(-L // unit) * unit


def dcmha_attention_call(call, *, scale=None, block_sizes: Optional[BlockSizes] = None,
                         interpret: Optional[bool] = None):
    """The fused kernels on a validated ``dcmha.call.AttentionCall``, not checked again (the
    registry's ``attention(call)`` and ``dcmha_attention`` call this).

    The call's q, k, v are JAX arrays, its mask None or bool broadcastable to (B, T, S), its
    ``static_offset`` an int; ``scale``, ``block_sizes``, ``interpret`` as in
    ``dcmha_attention``. Returns o, or (o, scores) with ``call.return_attention_scores``.
    """
    q, k, v, mask = call.q, call.k, call.v, call.attention_mask
    stages = _stages(call)
    B, T, S, N, N_kv, d, d_v, G, M = (call.B, call.T, call.S, call.N, call.N_kv, call.d, call.d_v,
                                      call.G, call.M)
    block_sizes = block_sizes or BlockSizes()
    interpret = _default_interpret() if interpret is None else bool(interpret)
    floor = 1 if interpret else _MIN_GPU_DIM
    fit = lambda blk, L: min(blk, max(floor, _next_pow2(L)))  # noqa: E731
    bq_b, bk_b = block_sizes.backward
    d_p, dv_p = max(floor, _next_pow2(d)), max(floor, _next_pow2(d_v))
    blocks, warps = _fitted((fit(block_sizes.block_q, T), fit(block_sizes.block_k, S),
                             fit(bq_b, T), fit(bk_b, S)), M, d_p, dv_p, interpret)
    T_p, S_p = _padded(T, blocks[0::2]), _padded(S, blocks[1::2])

    ranks = tuple((st, side, int(terms[side + "w1"].shape[3]))
                  for st, terms in stages.items() for side in "qk" if side + "w1" in terms)
    opts = _Opts(G=G, M=M, rep=N // N_kv,
                 scale=float(1.0 / math.sqrt(d) if scale is None else scale),
                 causal=call.use_causal_mask, window=call.sliding_window,
                 has_mask=mask is not None, pre=tuple(stages["pre"]),
                 post=tuple(stages["post"]), ranks=ranks, blocks=blocks,
                 warps=warps, scores=bool(call.return_attention_scores), interpret=interpret)

    def heads_major(x, L_p, h_p):  # (B, L, H, h) -> (B, H, L_p, h_p)
        x = jnp.swapaxes(x, 1, 2)
        return jnp.pad(x, ((0, 0), (0, 0), (0, L_p - x.shape[2]), (0, h_p - x.shape[3])))

    H = opts.H

    def term_layout(st, n, x):
        """Heads padded to H, ranks to R_p, the sequence (last) to its padded length."""
        if n == "static":      # (G, M, M) -> (G, H, H)
            return jnp.pad(x, ((0, 0), (0, H - M), (0, H - M)))
        L_p = T_p if n[0] == "q" else S_p
        if n.endswith("dd"):   # (B, L, G, M) -> (B, G, H, L_p)
            x, lead = jnp.transpose(x, (0, 2, 3, 1)), []
        else:                  # (B, L, G, R, M) -> (B, G, R_p, H, L_p)
            x = jnp.transpose(x, (0, 2, 3, 4, 1))
            lead = [(0, opts.rank_pad(st, n[0]) - x.shape[2])]
        return jnp.pad(x, [(0, 0)] * 2 + lead + [(0, H - M), (0, L_p - x.shape[-1])])

    terms = {st: {n: term_layout(st, n, x) for n, x in ts.items()} for st, ts in stages.items()}
    mask_k = None
    if mask is not None:
        mask_k = jnp.broadcast_to(kernel_call.shared_mask(jnp.asarray(mask)), (B, T, S))
        mask_k = jnp.pad(mask_k.astype(jnp.int8), ((0, 0), (0, T_p - T), (0, S_p - S)))
    out = _fused(opts, heads_major(q, T_p, d_p), heads_major(k, S_p, d_p),
                 heads_major(v, S_p, dv_p), terms, mask_k,
                 jnp.array([T, S, call.static_offset, 0], jnp.int32))
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
    call = _check_inputs(q, k, v, num_groups, pre, post, mask, causal, sliding_window, scale,
                         query_offset)
    stages = _stages(call)
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
