"""The seam's defaults (``dcmha.framework``): plain ``keras.ops``, no backend-specific
behaviour. Each backend module imports them and replaces what its backend does
differently; a Keras backend without a module gets these.

Also the casts every backend shares (``dtype_name``, ``as_dtype``: they exist because a
cast costs a framework op per call; ``dcmha.ops`` exports them).
"""

import keras
import numpy as np

__all__ = ["readable_value", "to_layer_device", "arange_int32", "stack", "unstack",
           "eager_slice_write", "cache_writer", "step_dynamic_weights", "fused_query",
           "fused_query_projection", "call_sublayer", "device", "building_graph", "compiles_ops",
           "LOOPED_CHUNKS", "decode_step", "step_index", "prepare_export", "DEMO_JIT_COMPILE",
           "TORCH_MODULES", "SHARD_MAP", "whole_values", "scaled_weight", "scaled_weights"]


def provided_once(keras_backend, name):
    """``dcmha.framework.provided(keras_backend, name)``, looked up once: a step's seam
    function then does not go back to the registry (``provide`` and ``set_finder``
    forget the copy)."""
    from dcmha import framework
    key = (keras_backend, name)
    try:
        return framework._once[key]
    except KeyError:
        fn = framework._once[key] = framework.provided(keras_backend, name)
        return fn


def readable_value(x):
    """``x`` as a NumPy array when its value can be read now, else None (a traced or
    symbolic tensor, whose reading would bake the value or break the graph)."""
    from keras import ops
    return np.asarray(ops.convert_to_numpy(x))


def to_layer_device(values):
    """``values`` (a tuple; dicts of tensors inside) on the device of the layer's weights,
    where the backend does not place arrays itself (the first value gives the device)."""
    return values


def arange_int32(start, stop):
    """int32 [start, stop), also when ``stop - start`` is an exporter's symbolic size."""
    from keras import ops
    return ops.arange(start, stop, dtype="int32")


def stack(arrays, axis):
    """``ops.stack``."""
    from keras import ops
    return ops.stack(arrays, axis=axis)


def unstack(x, axis, num):
    """The ``num`` slices of x along ``axis``: ``ops.unstack``."""
    from keras import ops
    return ops.unstack(x, num=num, axis=axis)


def eager_slice_write(entry, index, update):
    """``entry`` with ``update`` (already in entry's dtype) written at [:, index:index + n]
    by the backend's own eager ops, or None where ``ops.slice_update`` is the way."""
    return None


def cache_writer(index, new_length, batch):
    """A ``write(entry, update)`` for all of one step's cache entries that the backend
    builds once per step, or None (then each entry is ``dcmha.ops.write_slice``)."""
    return None


def step_dynamic_weights(x, dw1, qkw, dd, *, C, rank, gelu_approximate, weight_scale=1.0):
    """``dcmha.ops.plain_dynamic_weights``' arrays split into their C slots ({name: [C
    arrays (B, L, G, ...)]}) by the backend's own route (a compiled kernel for a decoding
    step's few rows, eager framework ops), or None: then the plain ``keras.ops`` form.
    The weights are dw1, qkw and dd times ``weight_scale``, which a route applies only
    once it knows it runs (``scaled_weights``, or its kernel's own scaling)."""
    return None


def fused_query(query_dense, projection, query):
    """(the query projection (B, L, N, d) float32, the dynamic weights {slot: {...}}) of a
    self-attention call from one matrix product, where the backend has it, else None.
    ``query_dense``: the layer's "query" EinsumDense; ``projection``: its
    ``DynamicWeightProjection``."""
    return None


def fused_query_projection(x, kernel, bias, dw1, qkw, dd, *, C, rank, gelu_approximate):
    """(x . kernel + bias (B, L, N, d) float32, ``plain_dynamic_weights``' arrays) of x (B,
    L, D) from one matrix product with [kernel | dw1 | dd] (backend tensors, not
    variables), where the backend has it, else None."""
    return None


def scaled_weight(variable, scale):
    """``scale`` x ``variable`` (a Keras variable) in its dtype: a weight its variable
    holds divided by ``scale`` (``DynamicWeightProjection``'s composition weights). A
    backend may keep the product while the variable is unchanged."""
    from keras import ops
    return ops.multiply(variable, ops.cast(scale, variable.dtype))


def scaled_weights(weights, scale):
    """Each of ``weights`` (None stays None) times ``scale`` by the backend's
    ``scaled_weight``; the weights themselves at a scale of 1."""
    if scale == 1.0:
        return list(weights)
    from dcmha import framework
    return [None if w is None else framework.scaled_weight(w, scale) for w in weights]


def call_sublayer(layer, x, **kwargs):
    """``layer(x, **kwargs)``: a sublayer's call (a backend may skip Keras's per-call
    machinery where it has nothing to do)."""
    return layer(x, **kwargs)


def device(x=None):
    """Where ``x`` is computed on: "cpu", "gpu" or "tpu"; x None: where the backend puts a
    new array (its default device). The seam's one device probe (read by the plain core and
    ``dcmha.registry.current_device``)."""
    return "cpu"


def building_graph():
    """Whether the code runs while a graph is being built from it (TensorFlow's
    ``tf.function``): the registry's rule for paths declared ``graph_only``. Backends that
    compile traces of eager code (``jax.jit``) build no such graph: False."""
    return False


def compiles_ops():
    """Whether the ops being traced are compiled into one program (XLA: ``jax.jit``,
    TensorFlow's ``jit_compile``), which fuses an einsum's transposes and a slice's
    gradient away, rather than run one by one (TensorFlow's graph executor): the choice
    between ``dcmha.ops.dynamic_weights``' two forms."""
    return True


#: Whether many query chunks run as ``ops.map`` loops (a traced program stays bounded)
#: rather than unrolled.
LOOPED_CHUNKS = False


def _last_logits(logits):
    from keras import ops
    return ops.cast(logits[:, -1, :], "float32")


def decode_step(model):
    """``model``'s decoding step (tokens, cache, index) -> (last logits (B, V) float32,
    cache), compiled where the backend pays for it."""
    def step(tokens, cache, index):
        logits, cache = model.call_with_cache(tokens, cache, index)
        return _last_logits(logits), cache
    return step


def step_index(i):
    """A decoding step's cache index as the step takes it (a tensor keeps compiled steps'
    shapes fixed)."""
    from keras import ops
    return ops.convert_to_tensor(np.int32(i))


def prepare_export(format):
    """Whatever the backend's exporter needs before Keras's ``Model.export``."""
    return None


#: ``jit_compile`` of the demo's ``Model.compile``.
DEMO_JIT_COMPILE = "auto"


#: Whether a built Keras model can be wrapped as a ``torch.nn.Module``
#: (``dcmha.engines.torch_module``).
TORCH_MODULES = False

#: Whether ``dcmha.partition.partitioned`` can run a fast path per shard of a device
#: mesh (``shard_map``); elsewhere the active distribution is left to the backend.
SHARD_MAP = False


def whole_values(values):
    """``values`` (arrays, possibly sharded over devices) as whole NumPy arrays on every
    process."""
    from keras import ops
    return [np.asarray(ops.convert_to_numpy(x)) for x in values]


#: dtype object -> Keras's name for it (``keras.backend.standardize_dtype`` costs more
#: than the cast it would save on a hot path; the dtype objects of a process are few).
_DTYPE_NAMES = {}


def dtype_name(dtype):
    """Keras's name of a dtype object (cached)."""
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):            # TypeError: an unhashable dtype object
        name = keras.backend.standardize_dtype(dtype)
        try:
            _DTYPE_NAMES[dtype] = name
        except TypeError:
            pass
        return name


def as_dtype(x, dtype):
    """``ops.cast(x, dtype)``, skipped when ``x`` already has ``dtype`` (even a cast that
    changes nothing costs a Keras op per call in eager PyTorch: a decoding step has
    dozens of them). Anything but a backend tensor (a ``keras.Variable``, a NumPy array)
    is always cast: callees get a backend tensor."""
    if keras.ops.is_tensor(x) and dtype_name(x.dtype) == dtype:
        return x
    return keras.ops.cast(x, dtype)
