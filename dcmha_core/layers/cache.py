"""DCMHA's decoding cache: its layout, and the checks of a cache and of
``cache_update_index``."""

from __future__ import annotations

import numpy as np

import keras
from keras import ops

from dcmha.layers._checks import readable_value
from dcmha.spec import reference as spec


class _CacheMixin:
    """The decoding cache of ``DCMHA``: ``init_cache`` and the checks of a call's cache
    and ``cache_update_index``.

    A mixin of ``DCMHA``: it reads the layer's spec config ``_cfg`` and its
    ``compute_dtype``.
    """

    def init_cache(self, batch, max_length, dtype=None):
        """An all-zero decoding cache (``reference.cache_shapes`` layout).

        "key" (B, S_max, N_kv, d) after QK-norm and RoPE, "value"
        (B, S_max, N_kv, d_v) and, with C_k enabled key slots, "key_w"
        (B, S_max, 2 C_k, G, R, M) (w1 then w2 of each slot, pre_key first) and
        "key_dd" (B, S_max, C_k, G, M). dtype defaults to the compute dtype (the
        dtype Keras casts float call arguments to).
        """
        dtype = dtype or self.compute_dtype
        return {n: ops.zeros(s, dtype=dtype)
                for n, s in spec.cache_shapes(self._cfg, batch, max_length).items()}

    def _check_cache(self, cache, batch):
        expected = spec.cache_shapes(self._cfg, 1, 1)
        if not isinstance(cache, dict) or set(cache) != set(expected):
            got = sorted(cache) if isinstance(cache, dict) else type(cache).__name__
            raise ValueError(f"`cache` must be a dict with keys {sorted(expected)} (see "
                             f"`init_cache`). Received: {got}")
        for n, s in expected.items():
            if tuple(cache[n].shape[2:]) != s[2:] or len(cache[n].shape) != len(s):
                raise ValueError(f"`cache[{n!r}]` must have shape (B, S_max) + {s[2:]}. "
                                 f"Received: shape={tuple(cache[n].shape)}")
        names = ["key"] + sorted(n for n in cache if n != "key")
        for n in names:
            if None not in (batch, cache[n].shape[0]) and cache[n].shape[0] != batch:
                raise ValueError(f"`cache` must have the batch size of `query`, {batch}. "
                                 f"Received: cache[{n!r}].shape={tuple(cache[n].shape)}")
        length = cache["key"].shape[1]
        for n in names:
            if None not in (length, cache[n].shape[1]) and cache[n].shape[1] != length:
                raise ValueError("Every `cache` entry must have the length S_max of "
                                 f"cache['key'], {length}. "
                                 f"Received: cache[{n!r}].shape={tuple(cache[n].shape)}")

    @staticmethod
    def _check_index(index, new_length, cache_length):
        """cache_update_index: None, an int >= 0, or an integer scalar tensor.

        A tensor is range-checked when its value can be read (eager calls).
        Returns (traced, index): traced is True for a tensor whose value is
        unknown here, whose range the caller must guard in the graph (see
        ``_guard_index``); index is then that tensor, else the index as a Python
        int (or None). A known index is used as an int: eager cache writes then
        take the backends' static-slice path (on torch 1 op instead of ~10).
        """
        if index is None:
            return False, None
        message = "`cache_update_index` must be None, an integer or an integer scalar tensor."
        if hasattr(index, "shape") and hasattr(index, "dtype"):
            dtype = keras.backend.standardize_dtype(index.dtype)
            if not dtype.startswith(("int", "uint")):
                raise TypeError(f"{message} Received: cache_update_index of dtype {dtype}")
            if tuple(index.shape) != ():
                raise TypeError(f"{message} Received: cache_update_index of shape "
                                f"{tuple(index.shape)}")
            value = readable_value(index)
            if value is None:
                return True, index
            index = int(value)
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"{message} Received: cache_update_index={index!r}")
        if index < 0:
            raise ValueError("`cache_update_index` must be a non-negative integer. "
                             f"Received: cache_update_index={index}")
        if None not in (new_length, cache_length) and index + new_length > cache_length:
            raise ValueError("`cache_update_index` + the new length must be at most the cache "
                             f"length {cache_length}. Received: cache_update_index={index}, "
                             f"new length {new_length}")
        return False, int(index)

    @staticmethod
    def _guard_index(index, new_length, cache_length):
        """A traced index's (clamped index, out-of-range flag).

        The call runs with the index clamped to [0, S_max - T_new] (what XLA's
        dynamic_update_slice does, now on every backend) and the flag turns
        its output NaN, so that a bad index shows instead of being silent.
        """
        index = ops.cast(index, "int32")
        clamped = ops.clip(index, 0, ops.cast(cache_length - new_length, "int32"))
        return clamped, ops.not_equal(clamped, index)
