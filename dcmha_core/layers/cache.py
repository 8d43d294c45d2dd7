"""DCMHA's decoding cache: its layout (``init_cache``) and the checks of a call's cache
and ``cache_update_index``, as functions of what they read (the spec config, the
cache, the index)."""

from __future__ import annotations

import numpy as np

import keras
from keras import ops

from dcmha import framework
from dcmha.spec import reference as spec


def init_cache(config, batch, max_length, dtype):
    """An all-zero decoding cache of ``dtype`` for the spec config ``config``
    (``reference.cache_shapes`` layout; see ``DCMHA.init_cache``)."""
    return {n: ops.zeros(s, dtype=dtype)
            for n, s in spec.cache_shapes(config, batch, max_length).items()}


def check_cache(config, cache, batch):
    """Raise a ValueError unless ``cache`` has the entries and shapes ``init_cache`` gives
    for ``config``, with batch size ``batch`` (None: unknown) and one length S_max."""
    expected = spec.cache_shapes(config, 1, 1)
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


def check_index(index, new_length, cache_length):
    """cache_update_index: None, an int >= 0, or an integer scalar tensor.

    A tensor is range-checked when its value can be read (eager calls).
    Returns (traced, index): traced is True for a tensor whose value is
    unknown here, whose range the caller must guard in the graph (see
    ``guard_index``); index is then that tensor, else the index as a Python
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
        value = framework.readable_value(index)
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


def guard_index(index, new_length, cache_length):
    """A traced index's (clamped index, out-of-range flag).

    The call runs with the index clamped to [0, S_max - T_new] (what XLA's
    dynamic_update_slice does, now on every backend) and the flag turns
    its output NaN, so that a bad index shows instead of being silent.
    """
    index = ops.cast(index, "int32")
    clamped = ops.clip(index, 0, ops.cast(cache_length - new_length, "int32"))
    return clamped, ops.not_equal(clamped, index)
