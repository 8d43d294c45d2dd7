"""Fused DCMHA attention in Triton (PyTorch): the host side, with its plain reference.

``dcmha_attention`` computes the attention step of ``spec/SPEC.md`` (sections 6-7,
written out in ``dcmha.backends.torch_native.dcmha_torch``'s docstring: scores,
pre-composition, masked float32 softmax, post-composition zeroed where masked, P v)
without materialising any (B, N, T, S) array. A program owns one (b, g, query block)
and holds the tile of all M heads of its group, (M, BLOCK_T, BLOCK_S): composition
mixes heads at a fixed (t, s), query-wise terms are local to the query block and
key-wise terms to the key block, so each tile has everything it needs. The kernels:
``forward`` (two passes over the key blocks with a post stage, one without),
``backward`` (a query-block and a key-block kernel), their shared tile helpers in
``tiles``.

Compiling: loops over heads and ranks are runtime loops, and the lengths, offset, window,
head count and rank are runtime integers, so one compiled kernel serves every call with
the same tiles, padded head count (BLOCK_M) and rank (BLOCK_R), dtype, terms and masking
switches (``tests/test_triton_compile.py``); tiles are fitted (``fitted``) so that a
program's tiles stay in registers; dots are three TF32 tensor-core products
(``tiles.DOT_PRECISION``). ``benchmarks/compile_time.py`` measures the compiles on a CPU
(``offline.compile_only``).

``dcmha_attention`` validates its arguments once and runs ``dcmha_attention_call`` on the
validated ``dcmha.call.AttentionCall``; the registry's path (``core``) calls the
latter directly. Scores, composition, softmax and accumulation are float32 whatever the
input dtype. The kernels run compiled on CUDA tensors, or on CPU tensors through Triton's
interpreter when ``TRITON_INTERPRET=1`` is set before Triton is first imported.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Mapping, Optional

import torch
import triton

from dcmha.spec import terms as spec_terms

from .. import kernel_call, torch_common
from . import is_available  # noqa: F401  (re-exported)
from .backward import _bwd_key_kernel, _bwd_query_kernel
from .forward import _fwd_kernel
from .tiles import KDD as _KDD
from .tiles import KW as _KW
from .tiles import QDD as _QDD
from .tiles import QW as _QW
from .tiles import STATIC as _STATIC

__all__ = ["BlockSizes", "dcmha_attention", "dcmha_attention_call", "dcmha_attention_reference",
           "is_available", "over_shared_memory", "shared_memory"]

#: The names a ``pre`` / ``post`` dict may hold, in the order the kernels take them
#: (``dcmha.spec.terms``).
TERM_NAMES = spec_terms.TERM_NAMES
#: The most elements of one (heads, rows, columns) tile of a program (``fitted``):
#: 16384 float32 are 128 registers per thread at 4 warps.
TILE_ELEMENTS = 16384
#: Warps of a compiled launch (``fitted``): one per this many elements of the largest tile,
#: 4 to 8. The backward keeps several such tiles live; with fewer warps they spill to local
#: memory and ptxas takes over 10 s (the float16 case's query backward: 11.2 s at 4 warps,
#: 4.9 s at 8).
ELEMENTS_PER_WARP = 512
# Input dtypes of the kernels (no float64: tl.dot has none).
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the kernels.

    block_q: queries per tile (BLOCK_T); block_k: keys per tile (BLOCK_S).
    Both are powers of two; compiled (GPU) runs need at least 16 (``tl.dot``). They are
    upper bounds: a program holds the tiles of all M heads of a group, and the kernels
    halve a tile (not below 16) until each of its (heads, rows, columns) tiles has at
    most ``TILE_ELEMENTS`` elements (``fitted``).
    num_warps / num_stages are passed to compiled launches only.
    """

    block_q: int = 16
    block_k: int = 16
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        for name in ("block_q", "block_k", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v & (v - 1):
                raise ValueError(
                    f"`{name}` must be a positive power of two. Received: {name}={v!r}")
        if not isinstance(self.num_stages, int) or self.num_stages <= 0:
            raise ValueError(f"`num_stages` must be a positive integer. Received: "
                             f"num_stages={self.num_stages!r}")


# ---------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------

def _interpreting() -> bool:
    """Whether this module's kernels were built for Triton's interpreter.

    Triton fixes that when a kernel is decorated (TRITON_INTERPRET at import).
    """
    return type(_fwd_kernel).__name__ == "InterpretedFunction"


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << max(0, int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class _Problem(torch_common.Problem):
    """Sizes and switches of one call (everything the kernels take besides arrays)."""

    pre_terms: int
    post_terms: int
    blocks: BlockSizes


#: The kernels' TERMS bit of each term a stage may hold (both terms of a pair share one).
_TERM_BITS = (("qw1", _QW), ("qw2", _QW), ("kw1", _KW), ("kw2", _KW), ("qdd", _QDD),
              ("kdd", _KDD), ("static", _STATIC))


def _terms(stage: Optional[Mapping]) -> int:
    if not stage:
        return 0
    bits = 0
    for name, bit in _TERM_BITS:
        if stage.get(name) is not None:
            bits |= bit
    return bits


def fitted(blocks: BlockSizes, M: int, d: int, d_v: int) -> BlockSizes:
    """``blocks`` fitted to the problem: block_q / block_k halved (the larger first, not
    below 16) until every tile a program holds, (BLOCK_M, rows, BLOCK_D | BLOCK_DV |
    columns), has at most ``TILE_ELEMENTS`` elements, and num_warps raised to one warp per
    ``ELEMENTS_PER_WARP`` elements of the largest (at most 8). Larger tiles per thread live
    in local memory instead of registers: slower on the GPU, and ptxas then takes minutes."""
    heads, width = _pow2(M), max(_pow2(d, 16), _pow2(d_v, 16))
    bq, bk = blocks.block_q, blocks.block_k

    def largest():
        return heads * max(bq, bk) * max(width, min(bq, bk))

    while largest() > TILE_ELEMENTS and max(bq, bk) > 16:
        if bq >= bk:
            bq //= 2
        else:
            bk //= 2
    warps = max(blocks.num_warps, min(8, _pow2(-(-largest() // ELEMENTS_PER_WARP))))
    return dataclasses.replace(blocks, block_q=bq, block_k=bk, num_warps=warps)


def _problem(call, scale, blocks: Optional[BlockSizes]) -> _Problem:
    """The sizes and switches of a validated call (``scale`` None: 1 / sqrt(d))."""
    fields = torch_common.Problem.fields(call, scale)
    blocks = fitted(blocks or BlockSizes(), fields["M"], fields["d"], fields["d_v"])
    return _Problem(**fields, pre_terms=_terms(call.pre), post_terms=_terms(call.post),
                    blocks=blocks)


def _packed(stage: Optional[Mapping], pb: _Problem, device):
    """The float32 contiguous arrays the kernels read for one stage.

    qw (B, T, G, 2R, M) = [w1; w2] along R, kw (B, S, G, 2R, M), qdd, kdd, static;
    a one-element placeholder for an absent term.
    """
    stage = stage or {}
    dummy = torch.zeros(1, dtype=torch.float32, device=device)

    def f32(x):
        return x.detach().to(torch.float32).contiguous()

    out = []
    for w1, w2 in (("qw1", "qw2"), ("kw1", "kw2")):
        out.append(torch.cat([f32(stage[w1]), f32(stage[w2])], dim=3)
                   if stage.get(w1) is not None else dummy)
    for name in ("qdd", "kdd", "static"):
        out.append(f32(stage[name]) if stage.get(name) is not None else dummy)
    return out


def _mask_args(mask, pb: _Problem, device):
    """(uint8 view of the mask broadcast to (B, T, S), its three strides) or a placeholder."""
    if mask is None:
        return torch.zeros(1, dtype=torch.uint8, device=device), 0, 0, 0
    m = kernel_call.shared_mask(mask).expand(pb.B, pb.T, pb.S)
    m = m.view(torch.uint8)
    return (m,) + tuple(m.stride())


def _launch(kernel, grid, *args, **meta):
    """Launch (compiling on first use) one kernel: every launch of this module goes here.

    A kernel that asks for more shared memory than the GPU gives a block raises a
    ValueError (``over_shared_memory`` tells before a call)."""
    try:
        kernel[grid](*args, **meta)
    except triton.runtime.errors.OutOfResources as e:
        raise ValueError(
            f"The Triton kernel {kernel.__name__} cannot launch on this GPU: it asks for "
            f"{e.required} bytes of {e.name} per block, and the GPU gives a block "
            f"{e.limit}. Its programs hold the tiles of all heads of a composition group: "
            "use more groups (fewer heads per group), smaller head dims, or the 'torch' "
            "implementation.") from None


def _launch_args(pb: _Problem):
    bl = pb.blocks
    meta = dict(M=pb.M, R=pb.R, PRE=pb.pre_terms, POST=pb.post_terms, CAUSAL=pb.causal,
                HAS_WINDOW=pb.window is not None, HAS_MASK=None,
                BLOCK_M=_pow2(pb.M), BLOCK_T=bl.block_q, BLOCK_S=bl.block_k,
                BLOCK_D=_pow2(pb.d, 16), BLOCK_DV=_pow2(pb.d_v, 16))
    sizes = (pb.T, pb.S, pb.N, pb.N_kv, pb.G, pb.N // pb.N_kv, pb.d, pb.d_v, pb.offset,
             pb.window or 0, pb.scale)
    if not _interpreting():
        meta.update(num_warps=bl.num_warps, num_stages=bl.num_stages)
    return sizes, meta


def _forward(q, k, v, mask, pre_arrays, post_arrays, pb: _Problem, store_p: bool,
             launch=None):
    """Launch the forward kernel (``launch``: None, this module's ``_launch``)."""
    device = q.device
    o = torch.empty(pb.B, pb.T, pb.N, pb.d_v, dtype=torch.float32, device=device)
    lse = torch.empty(pb.B, pb.N, pb.T, dtype=torch.float32, device=device)
    # Tiles outside the causal / window band are never visited: their scores stay 0.
    p = (torch.zeros(pb.B, pb.N, pb.T, pb.S, dtype=torch.float32, device=device) if store_p
         else torch.zeros(1, dtype=torch.float32, device=device))
    mask_t, smb, smt, sms = _mask_args(mask, pb, device)
    sizes, meta = _launch_args(pb)
    meta.update(HAS_MASK=mask is not None, STORE_P=store_p,
                TWO_PASS=bool(store_p or pb.post_terms))
    grid = (triton.cdiv(pb.T, pb.blocks.block_q), pb.B * pb.G)
    if 0 in grid:   # nothing to compute (B or T is 0)
        return o, lse, (p if store_p else None)
    (launch or _launch)(_fwd_kernel, grid, q, k, v, o, lse, p, mask_t, smb, smt, sms,
                        *pre_arrays, *post_arrays, *sizes, **meta)
    return o, lse, (p if store_p else None)


def _backward(q, k, v, do, o, lse, mask, pre_arrays, post_arrays, pb: _Problem, launch=None):
    """Launch the two backward kernels (``launch`` as ``_forward``'s)."""
    launch = launch or _launch
    device = q.device
    f32 = dict(dtype=torch.float32, device=device)
    mask_t, smb, smt, sms = _mask_args(mask, pb, device)
    sizes, meta = _launch_args(pb)
    meta.update(HAS_MASK=mask is not None, BLOCK_R=_pow2(2 * pb.R))
    num_tb = triton.cdiv(pb.T, pb.blocks.block_q)
    if pb.post_terms:
        delta = torch.empty(pb.B, pb.N, pb.T, **f32)   # the query kernel's pre-pass fills it
    else:
        # Without post-composition sum_s P dP = dO . o (FlashAttention's identity).
        delta = (do.to(torch.float32) * o).sum(-1).transpose(1, 2).contiguous()

    dummy = torch.zeros(1, **f32)
    B, T, S, G, M = pb.B, pb.T, pb.S, pb.G, pb.M

    def grads_for(terms, arrays):
        # Each kernel writes every element of a present term's gradient.
        out = [torch.empty_like(x) if terms & bit else dummy
               for x, bit in zip(arrays[:4], (_QW, _KW, _QDD, _KDD))]
        out.append(torch.empty(B, num_tb, G, M, M, **f32) if terms & _STATIC else dummy)
        return out

    d_pre = grads_for(pb.pre_terms, pre_arrays)
    d_post = grads_for(pb.post_terms, post_arrays)
    d_pre_st, d_post_st = d_pre[4], d_post[4]
    dq = torch.zeros(pb.B, pb.T, pb.N, pb.d, **f32)
    dk_h = torch.zeros(pb.B, pb.S, pb.N, pb.d, **f32)
    dv_h = torch.zeros(pb.B, pb.S, pb.N, pb.d_v, **f32)
    if pb.B * pb.T * pb.S == 0:   # nothing to compute: every gradient is 0
        d_pre = [None if x is dummy else x.zero_() for x in d_pre]
        d_post = [None if x is dummy else x.zero_() for x in d_post]
        d_pre[4] = None if d_pre[4] is None else d_pre[4].sum((0, 1))
        d_post[4] = None if d_post[4] is None else d_post[4].sum((0, 1))
        return dq, dk_h[:, :, ::pb.N // pb.N_kv], dv_h[:, :, ::pb.N // pb.N_kv], d_pre, d_post

    launch(
        _bwd_query_kernel, (num_tb, pb.B * pb.G), q, k, v, do, lse, delta, dq, mask_t, smb, smt, sms, *pre_arrays, *post_arrays,
        d_pre[0], d_pre[2], d_pre_st, d_post[0], d_post[2], d_post_st,
        *sizes, num_tb, **meta)
    launch(
        _bwd_key_kernel, (triton.cdiv(pb.S, pb.blocks.block_k), pb.B * pb.G), q, k, v, do, lse, delta, dk_h, dv_h, mask_t, smb, smt, sms, *pre_arrays, *post_arrays,
        d_pre[1], d_pre[3], d_post[1], d_post[3], *sizes, **meta)
    rep = pb.N // pb.N_kv
    # dk, dv were written per query head; query heads h of one kv head are adjacent.
    dk = dk_h.view(pb.B, pb.S, pb.N_kv, rep, pb.d).sum(3)
    dv = dv_h.view(pb.B, pb.S, pb.N_kv, rep, pb.d_v).sum(3)
    d_pre[4] = d_pre_st.sum((0, 1)) if pb.pre_terms & _STATIC else None
    d_post[4] = d_post_st.sum((0, 1)) if pb.post_terms & _STATIC else None
    return dq, dk, dv, d_pre, d_post


def _zero_stage(bits: int, pb: _Problem):
    """A stage of zeros holding the terms ``bits`` names, at one batch row, query and key."""
    sizes = dict(B=1, T=1, S=1, G=pb.G, R=pb.R, M=pb.M)
    return {name: torch.zeros(spec_terms.term_shape(name, sizes))
            for name, bit in _TERM_BITS if bits & bit}


@functools.lru_cache(maxsize=None)
def _shared_memory(pb: _Problem, dtype, mask: bool, store_p: bool, backward: bool):
    """``shared_memory`` for a problem of one batch row, query and key (the compiled
    kernels do not depend on the lengths, offset or window size)."""
    needs = {}

    def compile_only(kernel, grid, *args, **meta):
        needs[kernel.__name__] = kernel.warmup(*args, grid=grid, **meta).metadata.shared

    # Warmup takes CPU tensors: it reads dtypes and alignment, launches nothing.
    q = torch.zeros(1, 1, pb.N, pb.d, dtype=dtype)
    k = torch.zeros(1, 1, pb.N_kv, pb.d, dtype=dtype)
    v = torch.zeros(1, 1, pb.N_kv, pb.d_v, dtype=dtype)
    m = torch.ones(1, 1, 1, dtype=torch.bool) if mask else None
    pre, post = (_packed(_zero_stage(bits, pb), pb, q.device)
                 for bits in (pb.pre_terms, pb.post_terms))
    o, lse, _ = _forward(q, k, v, m, pre, post, pb, store_p, launch=compile_only)
    if backward:
        _backward(q, k, v, torch.zeros(o.shape, dtype=dtype), o, lse, m, pre, post, pb,
                  launch=compile_only)
    return tuple(needs.items())


def shared_memory(call, *, backward: bool, dtype=None) -> Dict[str, int]:
    """{kernel name: bytes of shared memory per block} of the kernels ``call`` launches
    (``call`` as ``dcmha_attention_call`` takes it; q's dtype unless ``dtype`` is given):
    the forward, and with ``backward`` the two backward kernels. They are compiled for the
    active Triton target (a first launch then finds them in Triton's cache), not launched;
    compiled Triton only (not ``TRITON_INTERPRET``)."""
    pb = _problem(call, None, None)
    pb = dataclasses.replace(pb, B=1, T=1, S=1, offset=0, scale=1.0,
                             window=None if pb.window is None else 1)
    return dict(_shared_memory(pb, dtype or call.q.dtype, call.attention_mask is not None,
                               bool(call.return_attention_scores), bool(backward)))


def over_shared_memory(call, limit: int, *, backward: bool, dtype=None) -> Optional[str]:
    """Why the kernels of ``call`` (``shared_memory``'s arguments) cannot launch on a GPU
    that gives a block ``limit`` bytes of shared memory (a str), or None when they can."""
    over = {name: n for name, n in shared_memory(call, backward=backward, dtype=dtype).items()
            if n > limit}
    if not over:
        return None
    asks = ", ".join(f"{name} {n}" for name, n in over.items())
    return (f"its kernels ask for more shared memory per block (bytes: {asks}) than the GPU "
            f"gives one ({limit}): a program holds the tiles of all M = {call.M} heads of a "
            f"composition group at head dims {call.d} / {call.d_v}")


def _unpack_grads(d_arrays, dtypes, R):
    """Gradients of the 7 stage inputs (None where absent) from the packed float32 grads."""
    d_qw, d_kw, d_qdd, d_kdd, d_st = d_arrays
    grads = dict(qw1=lambda: d_qw[..., :R, :], qw2=lambda: d_qw[..., R:, :],
                 kw1=lambda: d_kw[..., :R, :], kw2=lambda: d_kw[..., R:, :],
                 qdd=lambda: d_qdd, kdd=lambda: d_kdd, static=lambda: d_st)
    return [None if dt is None else grads[n]().to(dt) for n, dt in zip(TERM_NAMES, dtypes)]


class _DCMHAFunction(torch.autograd.Function):
    """The kernels as one autograd node: forward kernel, then both backward kernels.

    Saves q, k, v, o, lse and the packed stage arrays; the returned scores (with
    ``store_p``) are not differentiable.
    """

    @staticmethod
    def forward(ctx, pb, store_p, q, k, v, mask, *stage_inputs):
        pre_in, post_in = stage_inputs[:7], stage_inputs[7:]
        pre = dict(zip(TERM_NAMES, pre_in))
        post = dict(zip(TERM_NAMES, post_in))
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        pre_arrays = _packed(pre, pb, q.device)
        post_arrays = _packed(post, pb, q.device)
        o, lse, p = _forward(q, k, v, mask, pre_arrays, post_arrays, pb, store_p)
        ctx.pb = pb
        ctx.mask = mask
        ctx.dtypes = [None if x is None else x.dtype for x in stage_inputs]
        ctx.save_for_backward(q, k, v, o, lse, *pre_arrays, *post_arrays)
        if p is None:
            return o.to(q.dtype)
        p = p.to(q.dtype)
        ctx.mark_non_differentiable(p)
        return o.to(q.dtype), p

    @staticmethod
    def backward(ctx, do, *unused):
        pb = ctx.pb
        q, k, v, o, lse, *arrays = ctx.saved_tensors
        dq, dk, dv, d_pre, d_post = _backward(q, k, v, do.contiguous(), o, lse, ctx.mask,
                                              arrays[:5], arrays[5:], pb)
        grads = (_unpack_grads(d_pre, ctx.dtypes[:7], pb.R)
                 + _unpack_grads(d_post, ctx.dtypes[7:], pb.R))
        return (None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, *grads)


def dcmha_attention_call(call, *, scale=None, block_sizes: Optional[BlockSizes] = None):
    """The fused kernels on a validated ``dcmha.call.AttentionCall``, which is not checked
    again (the registry's ``attention(call)`` and ``dcmha_attention`` call this).

    The call's q, k, v are torch tensors of one dtype in ``_DTYPES`` on a CUDA device (CPU
    with ``TRITON_INTERPRET=1``), its mask None or bool (B|1, T|1, S|1) on that device, one
    rank R across the stages; ``call.return_attention_scores`` as in ``dcmha_attention``.
    """
    pb = _problem(call, scale, block_sizes)
    flat = [None if stage is None else stage.get(n) for stage in (call.pre, call.post)
            for n in TERM_NAMES]
    return _DCMHAFunction.apply(pb, bool(call.return_attention_scores), call.q, call.k, call.v,
                                call.attention_mask, *flat)


def dcmha_attention(q, k, v, *, num_groups, pre=None, post=None, mask=None, causal=False,
                    sliding_window=None, scale=None, query_offset=0, block_q=None, block_k=None,
                    interpret=None, return_attention_scores=False):
    """Fused DCMHA attention (Triton), differentiable w.r.t. q, k, v and every pre/post array.

    Args: as ``dcmha.backends.torch_native.dcmha_attention`` (q, k, v, num_groups,
      pre, post, mask, causal, sliding_window, scale, query_offset; dtypes float32 /
      float16 / bfloat16, no float64), and:
      block_q, block_k: tile sizes (powers of two), default ``BlockSizes()``.
      interpret: None, or a bool that must match how Triton was loaded
        (``TRITON_INTERPRET``); interpreted runs take CPU tensors, compiled runs CUDA.
      return_attention_scores: also return the masked post-composed probabilities
        (B, N, T, S) in q's dtype (materialised: for tests and inspection; not
        differentiable).

    Returns:
      o: (B, T, N, d_v) in q's dtype; scores, composition and softmax in float32.
      Fully masked query rows give zeros. With ``return_attention_scores``, (o, scores).

    The arguments are validated here, once (``torch_common.check_call``); the kernels then
    run on the validated call (``dcmha_attention_call``).
    """
    call = torch_common.check_call(q, k, v, dtypes=_DTYPES, num_groups=num_groups, pre=pre,
                                   post=post, mask=mask, causal=causal,
                                   sliding_window=sliding_window, query_offset=query_offset,
                                   return_attention_scores=return_attention_scores)
    blocks = BlockSizes(block_q=16 if block_q is None else block_q,
                        block_k=16 if block_k is None else block_k)
    mode = _interpreting()
    if interpret is not None and bool(interpret) != mode:
        raise ValueError(f"`interpret={interpret}` does not match this process: Triton was "
                         f"loaded with TRITON_INTERPRET={'1' if mode else '0'}; set it before "
                         "Triton is first imported.")
    if not mode:
        if q.device.type != "cuda":
            raise ValueError(f"Compiled Triton needs CUDA tensors. Received: q on {q.device}; "
                             "set TRITON_INTERPRET=1 before importing Triton to run on CPU.")
        if min(blocks.block_q, blocks.block_k) < 16:
            raise ValueError("Compiled Triton needs block_q and block_k >= 16 (tl.dot). "
                             f"Received: block_q={blocks.block_q}, block_k={blocks.block_k}")
    return dcmha_attention_call(call, scale=scale, block_sizes=blocks)


# ---------------------------------------------------------------------------
# The plain reference (materialises (B, N, T, S); for tests and reading)
# ---------------------------------------------------------------------------

def dcmha_attention_reference(q, k, v, *, num_groups, pre=None, post=None, mask=None,
                              causal=False, sliding_window=None, scale=None, query_offset=0,
                              block_q=None, block_k=None, interpret=None,
                              return_attention_scores=False):
    """``dcmha_attention`` in plain PyTorch ops (float32), differentiable by autograd
    (``torch_common.attention_reference``, shared with the torch-native kernel).

    Same arguments and result; ``block_q``, ``block_k`` and ``interpret`` are ignored.
    Materialises (B, N, T, S): for tests and small problems.
    """
    out = torch_common.attention_reference(
        q, k, v, num_groups=num_groups, pre=pre, post=post, mask=mask, causal=causal,
        sliding_window=sliding_window, scale=scale, query_offset=query_offset,
        return_attention_scores=return_attention_scores, dtypes=_DTYPES)
    # The kernel's scores are not differentiable: neither are the reference's.
    return (out[0], out[1].detach()) if return_attention_scores else out
