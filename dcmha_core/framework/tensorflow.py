"""The seam's module for Keras's TensorFlow backend (``dcmha.framework``).

The compiled kernel's op for a decoding step's dynamic weights lives in
``dcmha.backends.tf_cpu``, which provides it to the seam (``provide``).
"""

import numpy as np

from dcmha.framework._common import *  # noqa: F401,F403
from dcmha.framework._common import __all__  # noqa: F401
from dcmha.framework._common import _last_logits
from dcmha.framework._common import provided_once
from dcmha.framework._common import readable_value as _readable
from dcmha.spec.reference import W1_NORM_EPS


def readable_value(x):
    """None for a symbolic tensor or inside a ``tf.function``, else the NumPy value."""
    import tensorflow as tf
    if tf.is_tensor(x) and (tf.is_symbolic_tensor(x) or not tf.executing_eagerly()):
        return None
    return _readable(x)


def cache_writer(index, new_length, batch):
    """``tensor_scatter_nd_update`` on indices built once for all of a step's entries:
    TensorFlow runs ``slice_update`` (``XlaDynamicUpdateSlice``) through XLA's op-by-op
    path, which copies the entry and costs about 20 us more per write in a graph, and a
    DCMHA decoding step writes up to eight entries per layer."""
    import tensorflow as tf

    index = tf.cast(index, tf.int32)
    if isinstance(batch, int) and isinstance(new_length, int):
        # (b, t) for every row as a constant, shifted by (0, index): two graph ops.
        grid = np.stack(np.meshgrid(np.arange(batch), np.arange(new_length), indexing="ij"),
                        axis=-1).astype(np.int32)
        positions = grid + tf.stack([0, index])                            # (B, T, 2)
    else:
        rows = tf.range(new_length, dtype=tf.int32) + index                # (T,)
        grid = tf.meshgrid(tf.range(batch, dtype=tf.int32), rows, indexing="ij")
        positions = tf.stack(grid, axis=-1)                                # (B, T, 2)

    def write(entry, update):
        if not tf.is_tensor(update) or update.dtype != entry.dtype:
            update = tf.cast(update, entry.dtype)
        return tf.tensor_scatter_nd_update(entry, positions, update)
    return write


def step_dynamic_weights(x, dw1, qkw, dd, *, C, rank, gelu_approximate, weight_scale=1.0):
    """The provided "step_dynamic_weights" ("tf_cpu"'s kernel op) when it takes x (B, L,
    D) (sizes known, few rows, not in an XLA trace): it writes each slot's array, so a
    graph has no reshape or unstack op after it, and it applies ``weight_scale`` itself
    (the graph has no op that scales a weight)."""
    fast = provided_once("tensorflow", "step_dynamic_weights")
    if fast is None or None in tuple(x.shape):
        return None
    return fast(x, dw1, qkw, dd, C=C, rank=rank, gelu_approximate=gelu_approximate,
                eps=W1_NORM_EPS, weight_scale=weight_scale)


def device(x=None):
    """"gpu" for a tensor placed on a GPU, and for an unplaced one (x None included) when
    TensorFlow sees a GPU; else "cpu"."""
    import tensorflow as tf
    name = str(getattr(x, "device", "") or "")
    if "GPU" in name.upper():
        return "gpu"
    return "gpu" if not name and tf.config.list_logical_devices("GPU") else "cpu"


def building_graph():
    """Whether TensorFlow is tracing a graph (``tf.function``), not executing eagerly."""
    import tensorflow as tf
    return not tf.executing_eagerly()


def in_xla_context():
    """Whether TensorFlow is tracing for XLA (``tf.function(jit_compile=True)``)."""
    import tensorflow as tf
    if tf.executing_eagerly():
        return False
    try:
        from tensorflow.python.ops import control_flow_util
        return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    except (ImportError, AttributeError):  # private API moved: nesting still works, slower
        return False


def compiles_ops():
    """Only inside a trace for XLA: ``tf.function`` graphs without it, and eager calls,
    run their ops one by one."""
    return in_xla_context()


LOOPED_CHUNKS = True


def decode_step(model):
    """Two ``tf.function``s kept on the model, one for the prompt and one for the
    one-token steps: relaxed to a free length, a shared trace would lose T = 1, which the
    attention core's one-query path needs to know statically."""
    if getattr(model, "_tf_decode_step", None) is None:
        import tensorflow as tf

        def tf_step(tokens, cache, index):
            logits, cache = model.call_with_cache(tokens, cache, index)
            return _last_logits(logits), cache

        model._tf_decode_step = tuple(
            flat_calls(tf.function(tf_step, reduce_retracing=True, autograph=False))
            for _ in range(2))
    prefill, one = model._tf_decode_step
    return lambda tokens, cache, index: (one if tokens.shape[1] == 1 else prefill)(
        tokens, cache, index)


def flat_calls(function):
    """``function`` (a ``tf.function`` of tensors and nests of them) called through the
    concrete function of each input signature, with the flat list of its tensors.

    ``tf.function``'s own call binds the nested arguments and matches their trace types
    every time, which costs more than running a decoding step's graph does for a cache
    entry: a 4-layer ``DCFormerLM`` step (D 256) took 3.2 ms through it and 2.5 ms this
    way, with or without DCMHA (benchmarks/RESULTS.md, "Cached decoding"). Arguments that
    are not all tensors, and a TensorFlow whose concrete functions lack the flat call,
    take ``function`` itself (the returned call's ``__wrapped__``)."""
    import tensorflow as tf

    concrete = {}

    def call(*args):
        flat = tf.nest.flatten(args)
        if not all(isinstance(t, tf.Tensor) for t in flat):
            return function(*args)
        key = tuple((t.dtype, tuple(t.shape)) for t in flat)
        fn = concrete.get(key)
        if fn is None:
            fn = concrete[key] = function.get_concrete_function(*args)
        run = getattr(fn, "_call_flat", None)
        if run is None:
            return function(*args)
        return run(flat, fn.captured_inputs)     # the structured outputs (TensorFlow >= 2.18)

    call.__wrapped__ = function
    return call


#: XLA does not make the demo's small steps faster on CPU with TensorFlow, but costs
#: tens of seconds of compilation.
DEMO_JIT_COMPILE = False
