"""The standard Keras layers of a Keras export as plain ONNX ops: Dense and the activations,
ReLU, Softmax, LayerNormalization, RMSNormalization, Embedding, the merge layers,
Concatenate, Reshape, Identity and Dropout-like layers, and the keras.ops add / subtract /
multiply / divide. ``install_default_converters`` registers them."""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

import keras

from dcmha.export.keras_context import _CONVERTERS, Context, Value

def _activation(ctx: Context, fn, x: Value) -> Value:
    """A keras.activations function as ONNX ops."""
    if fn is None:
        return x
    name = getattr(fn, "__name__", None) or str(fn)
    e, c = ctx.e, ctx.const
    n = x.name
    if name == "linear":
        return x
    if name in ("relu", "sigmoid", "tanh", "softplus", "elu"):
        out = e.op({"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "softplus": "Softplus",
                    "elu": "Elu"}[name], n)
    elif name in ("silu", "swish"):
        out = e.op("Mul", n, e.op("Sigmoid", n))
    elif name == "gelu":   # keras.activations.gelu defaults to the exact (erf) form
        # x (1 + erf(x / sqrt 2)) / 2 in the op order that onnxruntime fuses into one Gelu
        out = e.op("Mul", e.op("Mul", n, e.op("Add", e.op("Erf", e.op("Div", n, c(math.sqrt(2)))),
                                              c(1.0))), c(0.5))
    elif name == "softmax":
        out = e.op("Softmax", n, axis=-1)
    elif name == "relu6":
        out = e.op("Clip", n, c(0.0), c(6.0))
    elif name == "leaky_relu":
        out = e.op("LeakyRelu", n, alpha=0.2)
    else:
        raise ctx.fail(f"Activation {name!r} is not supported by the ONNX exporter")
    return Value(out, x.elem_type, x.rank)


def _dense(ctx: Context, layer, x: Value, training=None, **kw):
    if getattr(layer, "quantization_mode", None) or getattr(layer, "lora_enabled", False):
        raise ctx.fail(f"Dense layer {layer.name!r} is quantized or uses LoRA; not supported")
    y = ctx.e.op("MatMul", x.name, ctx.weight(layer, "kernel", layer.kernel))
    if layer.use_bias:
        y = ctx.e.op("Add", y, ctx.weight(layer, "bias", layer.bias))
    return _activation(ctx, layer.activation, Value(y, ctx.ft, x.rank))


def _activation_layer(ctx: Context, layer, x: Value, **kw):
    return _activation(ctx, layer.activation, x)


def _relu(ctx: Context, layer, x: Value, **kw):
    if (layer.max_value is not None or float(layer.negative_slope) != 0.0
            or float(layer.threshold) != 0.0):
        raise ctx.fail(f"ReLU layer {layer.name!r}: only max_value=None, negative_slope=0, "
                       "threshold=0 are supported")
    return Value(ctx.e.op("Relu", x.name), x.elem_type, x.rank)


def _softmax(ctx: Context, layer, x: Value, mask=None, **kw):
    if mask is not None:
        raise ctx.fail(f"Softmax layer {layer.name!r} called with a mask is not supported")
    axis = layer.axis
    if not isinstance(axis, int):
        raise ctx.fail(f"Softmax layer {layer.name!r}: only a single integer axis is supported")
    return Value(ctx.e.op("Softmax", x.name, axis=axis), x.elem_type, x.rank)


def _last_axis(ctx: Context, layer, axis, rank) -> None:
    axes = [axis] if isinstance(axis, int) else list(axis)
    if axes not in ([-1],) and not (rank is not None and axes == [rank - 1]):
        raise ctx.fail(f"{type(layer).__name__} layer {layer.name!r}: only axis=-1 is supported. "
                       f"Received: axis={axis}")


def _float32_island(ctx: Context, x: Value):
    """x as float32 (normalisations run in at least float32, as in Keras) and the way back."""
    e, F = ctx.e, TensorProto.FLOAT
    return e.cast(x.name, ctx.ft, F), (lambda y: Value(e.cast(y, F, ctx.ft), ctx.ft, x.rank))


def _layer_norm(ctx: Context, layer, x: Value, **kw):
    _last_axis(ctx, layer, layer.axis, x.rank)
    if getattr(layer, "rms_scaling", False):
        raise ctx.fail(f"LayerNormalization layer {layer.name!r}: rms_scaling=True is not supported")
    e, F = ctx.e, TensorProto.FLOAT
    x32, back = _float32_island(ctx, x)
    mean = e.op("ReduceMean", x32, e.i64(-1), keepdims=1)
    xc = e.op("Sub", x32, mean)
    var = e.op("ReduceMean", e.op("Mul", xc, xc), e.i64(-1), keepdims=1)
    y = e.op("Div", xc, e.op("Sqrt", e.op("Add", var, e.const(layer.epsilon, F))))
    if layer.scale:
        y = e.op("Mul", y, ctx.b.add_initializer(f"{ctx.where()}/gamma",
                                                  keras.ops.convert_to_numpy(layer.gamma), np.float32))
    if layer.center:
        y = e.op("Add", y, ctx.b.add_initializer(f"{ctx.where()}/beta",
                                                  keras.ops.convert_to_numpy(layer.beta), np.float32))
    return back(y)


def _rms_norm(ctx: Context, layer, x: Value, **kw):
    _last_axis(ctx, layer, layer.axis, x.rank)
    e, F = ctx.e, TensorProto.FLOAT
    x32, back = _float32_island(ctx, x)
    eps = layer.epsilon if layer.epsilon is not None else keras.backend.epsilon()
    # Pow (not Mul(x, x)): the pattern onnxruntime fuses into one SimplifiedLayerNormalization
    ms = e.op("ReduceMean", e.op("Pow", x32, e.const(2.0, F)), e.i64(-1), keepdims=1)
    y = e.op("Div", x32, e.op("Sqrt", e.op("Add", ms, e.const(eps, F))))
    scale = ctx.b.add_initializer(f"{ctx.where()}/scale",
                                  keras.ops.convert_to_numpy(layer.scale), np.float32)
    return back(e.op("Mul", y, scale))


def _embedding(ctx: Context, layer, ids: Value, **kw):
    if getattr(layer, "mask_zero", False):
        raise ctx.fail(f"Embedding layer {layer.name!r}: mask_zero=True (Keras implicit masks) "
                       "is not supported")
    if getattr(layer, "quantization_mode", None) or getattr(layer, "lora_enabled", False):
        raise ctx.fail(f"Embedding layer {layer.name!r} is quantized or uses LoRA; not supported")
    table = ctx.weight(layer, "embeddings", layer.embeddings)
    idx = ids.name if ids.elem_type in (TensorProto.INT32, TensorProto.INT64) else \
        ctx.e.op("Cast", ids.name, to=TensorProto.INT64)
    rank = None if ids.rank is None else ids.rank + 1
    return Value(ctx.e.op("Gather", table, idx, axis=0), ctx.ft, rank)


def _merge(op_type: str):
    def convert(ctx: Context, layer, inputs, **kw):
        names = [v.name for v in inputs]
        out = names[0]
        for n in names[1:]:
            out = ctx.e.op(op_type, out, n)
        return Value(out, inputs[0].elem_type, inputs[0].rank)
    return convert


def _average(ctx: Context, layer, inputs, **kw):
    total = _merge("Add")(ctx, layer, inputs)
    return Value(ctx.e.op("Mul", total.name, ctx.const(1.0 / len(inputs))), total.elem_type, total.rank)


def _concatenate(ctx: Context, layer, inputs, **kw):
    return Value(ctx.e.op("Concat", *[v.name for v in inputs], axis=layer.axis),
                 inputs[0].elem_type, inputs[0].rank)


def _reshape(ctx: Context, layer, x: Value, **kw):
    target = [int(d) for d in layer.target_shape]
    return Value(ctx.e.op("Reshape", x.name, ctx.e.i64(0, *target)), x.elem_type, len(target) + 1)


def _identity(ctx: Context, layer, x, *args, **kw):
    return x


def _binary(op_type: str):
    def convert(ctx: Context, op, x1, x2, *args, **kw):
        def name(v):
            return v.name if isinstance(v, Value) else ctx.const(v)
        ref_v = x1 if isinstance(x1, Value) else x2
        return Value(ctx.e.op(op_type, name(x1), name(x2)), ref_v.elem_type, ref_v.rank)
    return convert


def install_default_converters() -> None:
    L = keras.layers
    table = {
        L.Dense: _dense, L.Activation: _activation_layer, L.ReLU: _relu, L.Softmax: _softmax,
        L.LayerNormalization: _layer_norm, L.Embedding: _embedding,
        L.Add: _merge("Add"), L.Subtract: _merge("Sub"), L.Multiply: _merge("Mul"),
        L.Maximum: _merge("Max"), L.Minimum: _merge("Min"), L.Average: _average,
        L.Concatenate: _concatenate, L.Reshape: _reshape, L.Identity: _identity,
    }
    if hasattr(L, "RMSNormalization"):
        table[L.RMSNormalization] = _rms_norm
    for name in ("Dropout", "SpatialDropout1D", "GaussianNoise", "GaussianDropout", "AlphaDropout",
                 "ActivityRegularization"):
        if hasattr(L, name):
            table[getattr(L, name)] = _identity
    from keras.src.ops import numpy as knp
    for name, op_type in (("Add", "Add"), ("Subtract", "Sub"), ("Multiply", "Mul"),
                          ("Divide", "Div"), ("TrueDivide", "Div")):
        if hasattr(knp, name):
            table[getattr(knp, name)] = _binary(op_type)
    for cls, fn in table.items():
        _CONVERTERS.setdefault(cls, fn)
