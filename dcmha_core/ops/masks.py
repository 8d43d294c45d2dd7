"""Attention masks of the functional core: the boolean mask of a block of queries and
keys (causal, sliding window, a caller's mask), its standard form and layouts, and the
key range a block can see.
"""

from __future__ import annotations

from keras import ops

from dcmha import framework
from dcmha.spec import terms as spec_terms

# A finite "minus infinity" (``dcmha.spec.terms.MASKED_SCORE``): a fully masked
# row stays finite through softmax (it becomes uniform and is zeroed afterwards).
_MASKED = spec_terms.MASKED_SCORE


def block_mask(attention_mask, t0, t1, s0, s1, *, use_causal_mask, sliding_window,
                query_offset):
    """The boolean mask of queries [t0, t1) x keys [s0, s1): (B or 1, t, s), or
    (B or 1, N, t, s) with a per-head ``attention_mask``, or None.

    Query t sits at absolute position ``query_offset + t``, key s at s; which keys a
    query sees is the spec's one position rule (``dcmha.spec.terms.visible``), applied
    here to int32 index tensors.
    """
    mask = None
    if use_causal_mask or sliding_window is not None:
        rows = framework.arange_int32(t0, t1)[:, None]
        cols = framework.arange_int32(s0, s1)[None, :]
        mask = spec_terms.visible(rows, cols, causal=bool(use_causal_mask), window=sliding_window,
                                  offset=ops.cast(query_offset, "int32"))[None]
    if attention_mask is not None:
        m = _slice_mask(attention_mask, t0, t1, s0, s1)
        if mask is not None and len(m.shape) == 4:
            mask = mask[:, None]
        mask = m if mask is None else ops.logical_and(mask, m)
    return mask


def _slice_mask(m, t0, t1, s0, s1):
    """m[..., t0:t1, s0:s1] (queries and keys are the last two axes), leaving broadcast
    (size-1) axes whole."""
    if m.shape[-2] != 1:
        m = m[..., t0:t1, :]
    if m.shape[-1] != 1:
        m = m[..., s0:s1]
    return m


def standardize_mask(attention_mask):
    """Boolean rank-3 (B|1, T|1, S|1) mask, rank-4 (B|1, N, T|1, S|1) for a per-head
    mask, or None."""
    if attention_mask is None:
        return None
    m = ops.cast(attention_mask, "bool")             # integer masks: nonzero = attend
    while len(m.shape) < 3:
        m = m[None]
    if len(m.shape) == 4 and m.shape[1] == 1:   # (B, 1, T, S): a broadcast head axis
        m = m[:, 0]
    return m


def _mask5(mask, G):
    """A block mask in the query-major layout (B|1, t, 1|G, 1|M, s) of ``_attend_block``."""
    if len(mask.shape) == 3:                                     # (B|1, t, s)
        return mask[:, :, None, None, :]
    b, N, t, s = mask.shape                                      # (B|1, N, t, s)
    return ops.transpose(ops.reshape(mask, (b, G, N // G, t, s)), (0, 3, 1, 2, 4))


def _visible_rows(mask):
    """(B|1, t, 1|N): 1.0 where a query sees at least one key (per head for a rank-4 mask)."""
    row = ops.cast(ops.any(mask, axis=-1), "float32")
    return row[:, :, None] if len(row.shape) == 2 else ops.transpose(row, (0, 2, 1))

def key_range(t0, t1, S, *, use_causal_mask, sliding_window, query_offset):
    """Keys [s0, s1) that queries [t0, t1) can see, from static knowledge only
    (``dcmha.spec.terms.key_range``; all keys when the offset is a tensor)."""
    if not isinstance(query_offset, int):
        return 0, S
    return spec_terms.key_range(t0, t1, S, causal=bool(use_causal_mask), window=sliding_window,
                                offset=query_offset)
