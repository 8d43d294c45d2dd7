"""Small tensor pieces of the functional core: rotary embedding, stacking, cache writes
and int32 ranges.

The backend-specific forms (a cheaper stack, an eager cache write, a symbolic range)
come from the seam (``dcmha.framework``); these functions name no backend.
"""

from __future__ import annotations

from keras import ops

from dcmha import framework
from dcmha.call import shape_of, shapes_agree
from dcmha.framework._common import as_dtype, dtype_name


def stack(arrays, axis):
    """``ops.stack`` (the backend's own op where that is cheaper: ``dcmha.framework``)."""
    return framework.stack(arrays, axis)


def unstack(x, axis, num):
    """The ``num`` slices of x along ``axis``: ``ops.unstack`` (the backend's own views
    where that is cheaper: ``dcmha.framework``)."""
    return framework.unstack(x, axis, num)


def write_slice(entry, index, update):
    """``entry`` with ``update`` written at [:, index:index + n] (a new tensor; ``entry``
    is unchanged), cast to ``entry``'s dtype: ``ops.slice_update``, or the backend's own
    eager write (``dcmha.framework.eager_slice_write``)."""
    update = as_dtype(update, dtype_name(entry.dtype))
    out = framework.eager_slice_write(entry, index, update)
    if out is not None:
        return out
    start = [0, index] + [0] * (len(entry.shape) - 2)
    return ops.slice_update(entry, start, update)


def cache_writer(index, new_length, batch):
    """A function ``write(entry, update)`` for one step's cache entries: ``entry`` (B,
    S_max, ...) with ``update`` (B, new_length, ...) written at [:, index:index +
    new_length] (a new tensor; ``entry`` is unchanged), cast to ``entry``'s dtype.

    ``index`` must be in [0, S_max - new_length] (the layer checks a known index and
    clamps a traced one). A backend may build the writes once for all of a step's
    entries (``dcmha.framework.cache_writer``); otherwise each write is ``write_slice``.
    """
    writer = framework.cache_writer(index, new_length, batch)
    return writer or (lambda entry, update: write_slice(entry, index, update))


def arange_int32(start, stop):
    """int32 [start, stop), also when ``stop - start`` is an exporter's symbolic size
    (``dcmha.framework.arange_int32``)."""
    return framework.arange_int32(start, stop)


def rope(x, positions, max_wavelength):
    """Rotary embedding, rotate-half layout (pairs (i, i + d/2)).

    x: (B, L, H, d) float32; positions: (L,) absolute positions (int or float
    tensor; may be offset by a traced ``cache_update_index``).
    """
    if len(x.shape) != 4 or (x.shape[-1] is not None and x.shape[-1] % 2):
        raise ValueError("`x` must have rank 4 (B, L, H, d) with an even d. "
                         f"Received: x.shape={shape_of(x)}")
    if len(positions.shape) != 1 or not shapes_agree(shape_of(positions), (x.shape[1],)):
        raise ValueError(f"`positions` must have shape (L,) = ({x.shape[1]},). "
                         f"Received: positions.shape={shape_of(positions)}")
    d = x.shape[-1]
    half = d // 2
    inv_freq = ops.power(float(max_wavelength),
                         -ops.arange(0, half, dtype="float32") * (2.0 / d))
    angle = ops.cast(positions, "float32")[:, None] * inv_freq[None, :]   # (L, d/2)
    cos = ops.cos(angle)[None, :, None, :]
    sin = ops.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return ops.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
