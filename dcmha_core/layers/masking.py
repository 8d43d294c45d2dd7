"""DCMHA's masks: the ``attention_mask`` argument, the inputs' Keras masks and the causal
mask combined into the one boolean mask the attention core reads."""

from __future__ import annotations

import numpy as np

import keras
from keras import ops

from dcmha.call import shape_of as _shape
from dcmha.layers._checks import _check_fits, _same_sizes, arange_int32


def _mask_tensor(mask):
    """``attention_mask`` as a boolean tensor, True (non-zero) = attend; lists are converted."""
    if mask is None:
        return None
    if isinstance(mask, (list, tuple)):
        try:
            array = np.asarray(mask)
        except ValueError:                      # ragged nesting
            array = None
        if array is None or array.dtype.kind not in "biuf":
            raise TypeError("`attention_mask` must be a tensor, an array or a nested list of "
                            "booleans or numbers of one shape. Received: a "
                            f"{type(mask).__name__} NumPy cannot read as such"
                            f"{'' if array is None else f' (dtype {array.dtype})'}")
        mask = ops.convert_to_tensor(array)
    elif not (hasattr(mask, "shape") and hasattr(mask, "dtype")):
        raise TypeError("`attention_mask` must be a tensor, an array or a nested list (True / "
                        f"non-zero = attend). Received: {type(mask).__name__}")
    dtype = keras.backend.standardize_dtype(mask.dtype)
    if dtype != "bool" and not dtype.startswith(("int", "uint", "float", "bfloat")):
        raise TypeError("`attention_mask` must be boolean, integer or float (non-zero = attend). "
                        f"Received: attention_mask.dtype={dtype}")
    # MultiHeadAttention's conversion: every non-zero value attends.
    return mask if dtype == "bool" else ops.cast(mask, "bool")


class _MaskMixin:
    """DCMHA's mask combination (``_attention_mask``), for the layer's forward pass.

    A mixin of ``DCMHA``: it reads the layer's ``_layout`` (an ``_AxesLayout``) and
    ``num_heads``.
    """

    def _attention_mask(self, query, value, key, attention_mask, query_mask, value_mask,
                        key_mask, causal, T, S, offset, has_cache):
        """The boolean mask for the core, and the causal flag left for the core to apply.

        MultiHeadAttention's combination by logical AND: ``attention_mask``, the
        query mask as (B, T, 1), the value and key masks as (B, 1, S), the causal
        mask; in the flattened layout (``_AxesLayout``). A traced causal flag is
        applied here as a mask.
        """
        layout = self._layout
        mask = _mask_tensor(attention_mask)
        parts = []
        if mask is not None:
            parts.append(mask if layout.identity
                         else layout.flatten_mask(mask, query, key, self.num_heads))
        for name, m, x, axis in (("query_mask", query_mask, query, -1),
                                 ("value_mask", value_mask, value, -2),
                                 ("key_mask", key_mask, key, -2)):
            if m is None:
                continue
            if axis == -2 and has_cache:
                raise ValueError(f"`{name}` cannot be combined with a `cache`: the keys are the "
                                 "cache's S_max positions; pass an `attention_mask` over them.")
            if not hasattr(m, "shape") or not _same_sizes(_shape(m), _shape(x)[:-1]):
                got = f"{name}.shape={tuple(m.shape)}" if hasattr(m, "shape") else type(m).__name__
                name_x = name.split("_")[0]
                raise ValueError(f"`{name}` must have the shape of `{name_x}` without its last "
                                 f"axis, {tuple(x.shape)[:-1]}. Received: {got}")
            m = ops.cast(m, "bool")
            parts.append(ops.expand_dims(layout.flatten(m, features=False), axis))
        if not isinstance(causal, bool):
            t = arange_int32(0, T)[:, None] + ops.cast(offset, "int32")
            s = arange_int32(0, S)[None, :]
            parts.append(ops.logical_or(ops.less_equal(s, t), ops.logical_not(causal))[None])
            causal = False
        if len(parts) > 1 and mask is not None and layout.identity:
            # Combined below: check the explicit mask here, as the core would.
            B, N = _shape(query)[0], self.num_heads
            T_, S_ = _shape(query)[1], (S if isinstance(S, int) else None)
            four = len(mask.shape) == 4
            _check_fits(_shape(mask), (B, N, T_, S_) if four else (B, T_, S_),
                        f"`attention_mask` must broadcast to (B, T, S) = {(B, T_, S_)}"
                        f"{f' or (B, N, T, S) = {(B, N, T_, S_)}' if four else ''}. "
                        f"Received: attention_mask.shape={tuple(mask.shape)}")
        if len(parts) <= 1:
            return (parts[0] if parts else None), causal
        rank = 4 if any(len(p.shape) == 4 for p in parts) else 3
        combined = None
        for p in parts:
            while len(p.shape) < 3:
                p = p[None]
            if rank == 4 and len(p.shape) == 3:
                p = p[:, None]
            combined = p if combined is None else ops.logical_and(combined, p)
        return combined, causal
