"""The seam's module for Keras's JAX backend (``dcmha.framework``)."""

import numpy as np

from dcmha.framework._common import *  # noqa: F401,F403
from dcmha.framework._common import __all__  # noqa: F401
from dcmha.framework._common import _last_logits
from dcmha.framework._common import readable_value as _readable
from dcmha.framework._common import whole_values as _whole_values


def readable_value(x):
    """None inside ``jax.jit`` (a tracer), else the NumPy value."""
    import jax
    return None if isinstance(x, jax.core.Tracer) else _readable(x)


def arange_int32(start, stop):
    """int32 [start, stop). Under Keras's ONNX export (jax2onnx), ``arange`` of a symbolic
    length gives an array whose size broadcasts with nothing (and a one-argument
    ``arange`` fails outright); a cumulative sum of ones has the same values and a proper
    symbolic size."""
    from keras import ops
    length = stop - start
    if not isinstance(length, (int, np.integer)) and not hasattr(length, "dtype"):
        return ops.cumsum(ops.ones((length,), dtype="int32")) - 1 + start
    return ops.arange(start, stop, dtype="int32")


def device(x=None):
    """JAX's default platform ("cpu", "gpu" or "tpu"; another platform counts as "gpu"),
    whatever ``x``."""
    import jax
    platform = jax.default_backend()
    return platform if platform in ("cpu", "gpu", "tpu") else "gpu"


LOOPED_CHUNKS = True


def decode_step(model):
    """One XLA program per shape, the cache argument donated (XLA writes the new
    position in place instead of copying every entry). The jitted step is kept on the
    model (``_jax_decode_step``); the variable values are read at every call of
    ``generate``, as training may change them."""
    if getattr(model, "_jax_decode_step", None) is None:
        import jax

        def jax_step(trainable, non_trainable, tokens, cache, index):
            (logits, cache), _ = model.stateless_call(
                trainable, non_trainable, tokens, cache=cache, cache_update_index=index)
            return _last_logits(logits), cache

        model._jax_decode_step = jax.jit(jax_step, donate_argnums=(3,))
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    return lambda tokens, cache, index: model._jax_decode_step(tv, ntv, tokens, cache, index)


SHARD_MAP = True


def whole_values(values):
    """Whole NumPy arrays on every process. Arrays sharded over a mesh that spans
    processes are all-gathered in one compiled call, a collective that every process must
    make (as ``process_allgather``, which compiles one call per array); other values are
    converted as they are."""
    if all(getattr(x, "is_fully_addressable", True) for x in values):
        return _whole_values(values)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = next(x.sharding.mesh for x in values if isinstance(x.sharding, NamedSharding))
    whole = jax.jit(lambda xs: xs, out_shardings=NamedSharding(mesh, PartitionSpec()))(values)
    return [np.asarray(x.addressable_data(0)) for x in whole]
