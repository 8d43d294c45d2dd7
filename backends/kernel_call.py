"""The call contract of the fused kernels' own APIs (framework-free).

The kernels (``torch_native``, ``triton``, ``pallas``, ``xla``) can be called
directly, with their arguments ``mask`` and ``causal``; ``describe`` checks
such a call with ``dcmha.call.describe`` (the one contract of every attention
call) and adds the two limits the kernels share: one mask for all heads,
broadcastable to (B, T, S), and a static ``query_offset``. What is specific to a
framework (tensor types, dtypes, devices) and to a kernel (tile sizes, scale)
stays with that kernel.
"""

from __future__ import annotations

import dcmha.call
from dcmha.call import AttentionCall, shape_of

__all__ = ["describe", "shared_mask"]


def describe(q, k, v, *, num_groups, pre=None, post=None, mask=None, causal=False,
             sliding_window=None, query_offset=0, query_chunk_size=None,
             return_attention_scores=False) -> AttentionCall:
    """``dcmha.call.describe`` of a kernel call (mask: None or (B|1, T|1, S|1), True = attend).

    Raises describe's ValueError / TypeError, naming the kernel's argument ``mask``;
    also refuses a rank-4 (per-head) mask and a ``query_offset`` that is not a
    Python / NumPy int (the kernels take it as a static value).
    """
    try:
        call = dcmha.call.describe(q, k, v, num_groups=num_groups, pre=pre, post=post,
                                   attention_mask=mask, use_causal_mask=causal,
                                   sliding_window=sliding_window, query_offset=query_offset,
                                   query_chunk_size=query_chunk_size,
                                   return_attention_scores=bool(return_attention_scores))
    except (TypeError, ValueError) as err:
        if "attention_mask" not in str(err):
            raise
        raise type(err)(str(err).replace("attention_mask", "mask")) from None
    if mask is not None and len(mask.shape) == 4:
        raise ValueError(f"`mask` must broadcast to (B, T, S) = {(call.B, call.T, call.S)}: the "
                         "fused kernels take one mask shared by all heads (per-head masks run "
                         f"on dcmha.ops). Received: mask.shape={shape_of(mask)}")
    if call.static_offset is None:
        raise ValueError("`query_offset` must be a non-negative Python integer (the kernels take "
                         f"it as a static value). Received: query_offset={query_offset!r}")
    return call


def shared_mask(mask):
    """A mask of rank <= 3 as rank 3 (B|1, T|1, S|1), or None (any array type)."""
    if mask is None or len(mask.shape) == 3:
        return mask
    return mask[(None,) * (3 - len(mask.shape))]
