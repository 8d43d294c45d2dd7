"""The seam's module for Keras's torch backend (``dcmha.framework``).

Eager PyTorch (outside ``torch.compile``) takes PyTorch's own ops on the hot paths of a
decoding step: a ``keras.ops`` call costs about twice the PyTorch op it wraps (argument
conversions), and a step is dispatch-bound. The plain-PyTorch kernels (the dynamic
weights of a step, the fused query projection, the ONNX exporter's ``rms_norm``) live in
``dcmha.backends.torch_native``, which provides them to the seam (``provide``).
"""

import weakref

import numpy as np
import torch

from dcmha.framework._common import *  # noqa: F401,F403
from dcmha.framework._common import __all__  # noqa: F401
from dcmha.framework._common import _last_logits  # noqa: F401
from dcmha.framework._common import provided_once
from dcmha.framework._common import readable_value as _readable
from dcmha.framework._common import stack as _stack
from dcmha.framework._common import unstack as _unstack
from dcmha.spec.reference import W1_NORM_EPS


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


def step_dynamic_weights(x, dw1, qkw, dd, *, C, rank, gelu_approximate, weight_scale=1.0):
    """Eager PyTorch: the provided "step_dynamic_weights" (``torch_native``'s kernel for a
    step's rows), split into the C slots."""
    if not _eager(x, *(w for w in (dw1, qkw, dd) if w is not None)):
        return None
    native = provided_once("torch", "step_dynamic_weights")
    if native is None:
        return None
    stacked = native(x, dw1, qkw, dd, C=C, rank=rank, gelu_approximate=gelu_approximate,
                     eps=W1_NORM_EPS, weight_scale=weight_scale)
    return {n: a.unbind(3) for n, a in stacked.items()}


def fused_query(query_dense, projection, query):
    """Eager PyTorch, a decoding step: ``fused_query_projection`` of the layer's weights,
    the dynamic weights split into the projection's slots. Only a built, plain float32
    query projection takes it (no LoRA, not quantised, linear)."""
    import keras
    if (not projection.built or query_dense.lora_enabled
            or query_dense.quantization_mode is not None
            or query_dense.compute_dtype != "float32"
            or query_dense.activation not in (None, keras.activations.linear)):
        return None
    slots = projection.slots
    weights = [None if w is None else getattr(w, "value", w) for w in (
        query_dense.kernel, query_dense.bias,
        *(projection.weight(n) for n in ("dw1", "qkw", "dd")))]
    out = fused_query_projection(query, *weights, C=len(slots), rank=projection.rank,
                                 gelu_approximate=projection.gelu_approximate)
    if out is None:
        return None
    q, stacked = out
    split = {s: {} for s in slots}
    for name, a in stacked.items():          # the C axis (3): one array per slot
        for s, a_s in zip(slots, a.unbind(3)):
            split[s][name] = a_s
    return q, split


def fused_query_projection(x, kernel, bias, dw1, qkw, dd, *, C, rank, gelu_approximate):
    """Eager PyTorch: the provided "fused_query_projection"
    (``torch_native.dynamic_weights.fused_query_projection``)."""
    if not _eager(x, *(w for w in (kernel, bias, dw1, qkw, dd) if w is not None)):
        return None
    native = provided_once("torch", "fused_query_projection")
    if native is None:
        return None
    return native(x, kernel, bias, dw1, qkw, dd, C=C, rank=rank,
                  gelu_approximate=gelu_approximate, eps=W1_NORM_EPS)


#: id(a variable's tensor) -> (weak reference to it, its version, the scale, the product)
#: (``scaled_weight``); an entry goes with its tensor.
_SCALED = {}


def scaled_weight(variable, scale):
    """``scale`` x the variable's tensor. Eager without a gradient to record (a decoding
    step, ``predict``), the product is kept while the tensor is unchanged (its version:
    ``Variable.assign`` copies in place), so that successive calls get the same tensor,
    which the fused query projection's concatenation is kept by; else a new product."""
    t = getattr(variable, "value", variable)
    if not _eager(t) or torch.jit.is_tracing() or (torch.is_grad_enabled()
                                                   and t.requires_grad):
        return t * scale
    key = id(t)
    entry = _SCALED.get(key)
    if (entry is not None and entry[0]() is t and entry[1] == t._version
            and entry[2] == scale):
        return entry[3]
    with torch.no_grad():
        out = t * scale
    _SCALED[key] = (weakref.ref(t, lambda _, k=key: _SCALED.pop(k, None)), t._version, scale,
                    out)
    return out


def call_sublayer(layer, x, **kwargs):
    """A built sublayer's ``call`` with the input cast ``__call__`` would make (its compute
    dtype): Keras's per-call machinery costs about 0.1 ms per decoding step in eager
    PyTorch, and the sublayers called this way (``DynamicWeightProjection``: float32
    weights, no mask) have nothing else for it to do."""
    if not layer.built:
        return layer(x, **kwargs)
    dtype = layer.compute_dtype
    if not (isinstance(x, torch.Tensor) and x.dtype == getattr(torch, dtype, None)):
        from keras import ops
        x = ops.cast(x, dtype)
    return layer.call(x, **kwargs)


def device(x=None):
    """"cpu" for CPU and "meta" tensors (and non-tensors), "gpu" for any other torch
    device; x None: "gpu" when CUDA is available (where Keras puts new tensors)."""
    if x is None:
        return "gpu" if torch.cuda.is_available() else "cpu"
    kind = getattr(getattr(x, "device", None), "type", "cpu")
    return "cpu" if kind in ("cpu", "meta") else "gpu"


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
    """ONNX: the provided "prepare_onnx_export" (``torch_native`` teaches the TorchScript
    exporter ``aten::rms_norm``, Keras's RMSNorm)."""
    if format == "onnx":
        prepare = provided_once("torch", "prepare_onnx_export")
        if prepare is not None:
            prepare()


TORCH_MODULES = True
