"""Argument checks and small value helpers shared by the modules of ``dcmha.layers``."""

from __future__ import annotations

import numpy as np

import keras
from keras import ops

from dcmha import backend as seam
from dcmha import ops as dops


def _seeded(initializer, seed):
    """A fresh copy of ``initializer``, seeded with ``seed`` if it has no seed.

    Keras initializers are stateless once seeded, so each variable gets its own
    copy (and its own seed) to avoid identical values.
    """
    config = initializer.get_config()
    if seed is not None and "seed" in config and config["seed"] is None:
        config["seed"] = seed
    return initializer.__class__.from_config(config)


def readable_value(x):
    """``x`` as a NumPy array when its value can be read now, else None.

    None inside ``jax.jit`` (a tracer), a ``tf.function`` (a symbolic tensor),
    ``torch.compile`` / ``torch.export`` / a TorchScript trace (where reading
    would bake the value or break the graph) and for torch "meta" tensors
    (``dcmha.backend.readable_value``).
    """
    return seam.readable_value(x)


#: int32 [start, stop), also for an exporter's symbolic length (``dcmha.ops.arange_int32``).
arange_int32 = dops.arange_int32


def _same_sizes(a, b):
    """Two shapes agree where both sizes are known (None: unknown)."""
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))


def _int_tuple(value, ok):
    """An int or a non-empty iterable of ints, each passing ``ok``, as a tuple; else None."""
    items = (value,) if isinstance(value, (int, np.integer)) else value
    try:
        items = tuple(items)
    except TypeError:
        return None
    if not items or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not ok(n)
                        for n in items):
        return None
    return tuple(int(n) for n in items)


def _product(sizes):
    out = 1
    for n in sizes:
        out = out * n
    return out


def _flash_implementation(flash_attention, implementation, dropout):
    """``implementation`` once MultiHeadAttention's ``flash_attention`` switch is applied.

    None keeps it; True needs a fused core ("auto", which takes one wherever
    the call allows it, or a fast path's name) and, as in MultiHeadAttention,
    no dropout; False is the plain "ops" core.
    """
    dops.resolve_implementation(implementation)
    if flash_attention is None:
        return implementation
    if flash_attention:
        if implementation == "ops":
            raise ValueError("`flash_attention=True` asks for a fused attention core, which "
                             "`implementation='ops'` rules out. Received: flash_attention=True, "
                             "implementation='ops'")
        if dropout:
            raise ValueError("`flash_attention=True` cannot be combined with attention dropout: "
                             f"no fused core applies it. Received: dropout={dropout!r}")
        return implementation
    if implementation not in ("auto", "ops"):
        raise ValueError("`flash_attention=False` asks for the plain 'ops' core, which "
                         f"`implementation={implementation!r}` contradicts. Received: "
                         f"flash_attention=False, implementation={implementation!r}")
    return "ops"


def _call_flag(name, value, traced_ok=False):
    """A call flag as a Python bool (bools, ints: non-zero is True, scalar tensors).

    A scalar tensor whose value cannot be read here (traced) is returned as a
    boolean tensor when ``traced_ok``, else refused.
    """
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        return bool(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        dtype = keras.backend.standardize_dtype(value.dtype)
        if tuple(value.shape) == () and (dtype == "bool" or dtype.startswith(("int", "uint"))):
            read = readable_value(value)
            if read is not None:
                return bool(read)
            if traced_ok:
                return ops.cast(value, "bool")
            raise ValueError(f"`{name}` decides the structure of the outputs, so its value must "
                             "be known when the layer is called: a Python bool or a concrete "
                             f"scalar tensor. Received: a traced tensor of dtype {dtype}")
        raise ValueError(f"`{name}` must be a boolean or a boolean scalar tensor. Received: "
                         f"{name} of shape {tuple(value.shape)} and dtype {dtype}")
    raise ValueError(f"`{name}` must be a boolean. Received: {name}={value!r}")


def _check_fits(shape, expected, message):
    """Raise ValueError(message) unless ``shape`` broadcasts to ``expected`` (static sizes)."""
    if len(shape) > len(expected) or not all(
            a in (1, None) or b is None or a == b for a, b in zip(shape[::-1], expected[::-1])):
        raise ValueError(message)
