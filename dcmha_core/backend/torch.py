"""The seam's module for Keras's torch backend (``dcmha.backend``).

Eager PyTorch (outside ``torch.compile``) takes PyTorch's own ops on the hot paths of a
decoding step: a ``keras.ops`` call costs about twice the PyTorch op it wraps (argument
conversions), and a step is dispatch-bound. The plain-PyTorch code lives in
``dcmha.backends.torch_native``.
"""

import numpy as np
import torch

from dcmha.backend._common import *  # noqa: F401,F403
from dcmha.backend._common import __all__  # noqa: F401
from dcmha.backend._common import _last_logits  # noqa: F401
from dcmha.backend._common import readable_value as _readable
from dcmha.backend._common import stack as _stack
from dcmha.backend._common import unstack as _unstack


def _eager(*arrays):
    """Whether every array is an eager torch tensor (outside ``torch.compile``)."""
    return not torch.compiler.is_compiling() and all(isinstance(a, torch.Tensor)
                                                     for a in arrays)


def readable_value(x):
    """None under ``torch.compile`` / ``torch.export`` / a TorchScript trace (reading would
    bake the value or break the graph) and for "meta" tensors, else the NumPy value."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or (isinstance(x, torch.Tensor) and x.device.type == "meta")):
        return None
    return _readable(x)


def to_layer_device(values):
    """Every torch tensor among ``values`` (and in a cache dict) on Keras's device: Keras's
    own layers accept a CPU tensor when the weights live on the GPU (``convert_to_tensor``
    moves it). The first value is converted, which gives the device; the others move only
    when they are elsewhere. A value given twice (self-attention's query and key) stays
    one object."""
    from keras import ops
    first = values[0]
    if not isinstance(first, torch.Tensor):
        return values
    converted = ops.convert_to_tensor(first)
    device = converted.device

    def one(x):
        if x is first:
            return converted
        if isinstance(x, dict):
            return {k: one(v) for k, v in x.items()}
        if isinstance(x, torch.Tensor) and x.device != device:
            return ops.convert_to_tensor(x)
        return x

    return tuple(one(x) for x in values)


def stack(arrays, axis):
    return torch.stack(list(arrays), axis) if _eager(*arrays) else _stack(arrays, axis)


def unstack(x, axis, num):
    """``unbind``'s views in eager PyTorch."""
    return x.unbind(axis) if _eager(x) else _unstack(x, axis, num)


def eager_slice_write(entry, index, update):
    """With a Python int index: the clone and assignment of Keras's own ``slice_update``,
    without its per-op conversions (a decoding step writes eight cache entries per
    layer)."""
    if not isinstance(index, (int, np.integer)) or not _eager(entry, update):
        return None
    out = entry.clone()
    out[:, int(index):int(index) + update.shape[1]] = update
    return out


def step_dynamic_weights(x, dw1, qkw, dd, *, C, rank, gelu_approximate):
    """Eager PyTorch: ``torch_native.dynamic_weights`` (the kernel for a step's rows)."""
    if not _eager(x, *(w for w in (dw1, qkw, dd) if w is not None)):
        return None
    from dcmha.backends.torch_native import dynamic_weights as native
    from dcmha.ops import W1_NORM_EPS
    stacked = native.dynamic_weights(x, dw1, qkw, dd, C=C, rank=rank,
                                     gelu_approximate=gelu_approximate, eps=W1_NORM_EPS)
    return {n: a.unbind(3) for n, a in stacked.items()}


def fused_query(query_dense, projection, query):
    """Eager PyTorch on the CPU, a decoding step: ``dcmha.ops.fused_query_projection``.
    Only a built, plain float32 query projection takes it (no LoRA, not quantised,
    linear)."""
    import keras
    if (not projection.built or query_dense.lora_enabled
            or query_dense.quantization_mode is not None
            or query_dense.compute_dtype != "float32"
            or query_dense.activation not in (None, keras.activations.linear)):
        return None
    from dcmha import ops as dops
    return dops.fused_query_projection(
        query, query_dense.kernel, query_dense.bias, projection.dw1, projection.qkw,
        projection.dd, slots=projection.slots, rank=projection.rank,
        gelu_approximate=projection.gelu_approximate)


def fused_query_projection(x, kernel, bias, dw1, qkw, dd, *, C, rank, gelu_approximate):
    """Eager PyTorch: ``torch_native.dynamic_weights.fused_query_projection``."""
    if not _eager(x, *(w for w in (kernel, bias, dw1, qkw, dd) if w is not None)):
        return None
    from dcmha.backends.torch_native import dynamic_weights as native
    from dcmha.ops import W1_NORM_EPS
    return native.fused_query_projection(x, kernel, bias, dw1, qkw, dd, C=C, rank=rank,
                                         gelu_approximate=gelu_approximate, eps=W1_NORM_EPS)


def call_sublayer(layer, x, **kwargs):
    """A built sublayer's ``call`` with the input cast ``__call__`` would make (its compute
    dtype): Keras's per-call machinery costs about 0.1 ms per decoding step in eager
    PyTorch, and the sublayers called this way (``DynamicWeightProjection``: float32
    weights, no mask) have nothing else for it to do."""
    if not layer.built:
        return layer(x, **kwargs)
    from dcmha.ops import as_dtype
    return layer.call(as_dtype(x, layer.compute_dtype), **kwargs)


def on_cpu():
    return not torch.cuda.is_available()


def decode_step(model):
    """The step runs eagerly under ``torch.no_grad()``: generation records no gradient
    (without it every eager op of a step would build autograd state, and the compiled
    kernels, which record none, would be passed over)."""
    def no_grad_step(tokens, cache, index):
        with torch.no_grad():
            logits, cache = model.call_with_cache(tokens, cache, index)
            return _last_logits(logits), cache
    return no_grad_step


def step_index(i):
    """The int as is (the layer would read a tensor back to one)."""
    return i


def prepare_export(format):
    """ONNX: teach the TorchScript exporter ``aten::rms_norm`` (Keras's RMSNorm)."""
    if format == "onnx":
        from dcmha.backends.torch_native import onnx_symbolic
        onnx_symbolic.register_rms_norm()


TORCH_MODULES = True
