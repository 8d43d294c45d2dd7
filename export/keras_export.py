"""Keras front-end of the ONNX exporter: a DCMHA layer, or a Keras model containing them.

A functional or Sequential model is walked node by node (Keras's own graph
runner, with graph-value stand-ins in place of tensors). Every DCMHA call
becomes one ``dcmha.DCMHA*`` function node (see ``dcmha.export.core``); the
standard layers below are written as plain ONNX ops. Anything else raises a
ValueError naming the layer class and where it sits in the model.

A DCMHA layer is recognised by ``isinstance``, so a subclass exports as DCMHA does,
unless it overrides ``_compute_attention``: the graph writes DCMHA's own attention core
and cannot see the override, so such a layer is refused (``attention_core_refusal``)
unless, in a model, a converter is registered for its class.

Supported Keras layers: InputLayer, Dense (linear, relu, gelu, silu/swish,
sigmoid, tanh, softmax, relu6, softplus, elu, leaky_relu activations),
Activation, ReLU, Softmax, LayerNormalization, RMSNormalization, Embedding,
Add, Subtract, Multiply, Average, Maximum, Minimum, Concatenate, Reshape,
Identity, Dropout-like layers (identity at inference), nested functional /
Sequential models, and the keras.ops add / subtract / multiply / divide.
``register_converter`` adds more. A subclassed model with ``as_functional()``
(``dcmha.models.DCFormerLM``) is exported through that functional twin.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import onnx
from onnx import TensorProto

import keras

from dcmha.export.builder import ModelBuilder
from dcmha.export.call_spec import CallSpec, check_call, check_params, decode_names
from dcmha.layers import DCMHA
from dcmha.spec import reference as ref

# ---------------------------------------------------------------------------
# Graph values and the export context
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Value:
    """A graph value standing in for a KerasTensor during the walk."""

    name: str
    elem_type: int
    rank: Optional[int] = None


class ExportError(ValueError):
    """A layer, option or call the exporter cannot write (a ValueError)."""


class Context:
    """State of one export: the ModelBuilder, the decode cache plumbing, the layer path."""

    def __init__(self, builder: ModelBuilder, decode: bool, dynamic: bool = True,
                 batch_size: int = 1, cache_length: Optional[int] = None):
        self.b = builder
        self.dynamic, self.batch_size, self.cache_length = dynamic, batch_size, cache_length
        self.e = builder.e
        self.ft = builder.ft
        self.decode = decode
        self.path: List[str] = []
        self.cache_index: Optional[str] = None
        self.caches: List[dict] = []          # per DCMHA call: layer id, entry -> (past, present)
        self.single_layer = False

    def where(self) -> str:
        return "/".join(self.path)

    def weight(self, layer, name: str, array) -> str:
        """An initializer for ``array`` named after the layer path, in the compute dtype."""
        arr = np.asarray(keras.ops.convert_to_numpy(array))
        full = f"{self.where()}/{name}" if self.path else name
        if arr.dtype.kind == "f":
            return self.b.add_initializer(full, arr)
        return self.b.add_initializer(full, arr, dtype=arr.dtype)

    def const(self, value) -> str:
        return self.e.const(value, self.ft)

    def fail(self, what: str) -> "ExportError":
        return ExportError(f"{what} (at {self.where() or '<top>'})")


Converter = Callable[..., Any]
_CONVERTERS: Dict[type, Converter] = {}


def register_converter(cls: type):
    """Decorator: ``fn(ctx, layer, *args, **kwargs) -> Value | structure`` converts ``cls``.

    ``args``/``kwargs`` are the layer's call arguments with ``Value`` in place of tensors.
    """
    def deco(fn):
        _CONVERTERS[cls] = fn
        return fn
    return deco


def _converter(op) -> Optional[Converter]:
    for cls in type(op).__mro__:
        if cls in _CONVERTERS:
            return _CONVERTERS[cls]
    return None


def _onnx_type(dtype: str, ft: int) -> int:
    dtype = keras.backend.standardize_dtype(dtype)
    if dtype.startswith("float") or dtype == "bfloat16":
        return ft
    table = {"bool": TensorProto.BOOL, "int32": TensorProto.INT32, "int64": TensorProto.INT64,
             "int16": TensorProto.INT16, "int8": TensorProto.INT8, "uint8": TensorProto.UINT8}
    if dtype not in table:
        raise ExportError(f"Inputs of dtype {dtype} are not supported by the ONNX exporter.")
    return table[dtype]


# ---------------------------------------------------------------------------
# DCMHA
# ---------------------------------------------------------------------------

#: DCMHA get_config() keys with no effect on an inference graph.
_IGNORED_OPTIONS = {"name", "trainable", "dtype", "dropout", "implementation", "kernel_initializer",
                    "bias_initializer", "seed", "output_shape", "query_chunk_size",
                    "flash_attention", "kernel_regularizer", "bias_regularizer",
                    "activity_regularizer", "kernel_constraint", "bias_constraint"}
#: DCMHA options the graph can only take at these (MultiHeadAttention's default) values.
_DEFAULT_ONLY = {"attention_axes": None, "use_gate": False}


def dcmha_config(layer) -> ref.Config:
    """The spec Config of a DCMHA layer (its ``config`` property, else its get_config())."""
    cfg = getattr(layer, "config", None)
    if isinstance(cfg, ref.Config):
        return cfg
    conf = {k: v for k, v in layer.get_config().items()
            if k not in _DEFAULT_ONLY or v != _DEFAULT_ONLY[k]}
    fields = {f.name for f in dataclasses.fields(ref.Config)}
    unknown = sorted(set(conf) - fields - _IGNORED_OPTIONS)
    if unknown:
        raise ExportError(f"DCMHA layer {layer.name!r} has options the ONNX exporter cannot "
                          f"write: {unknown}")
    return ref.Config(**{k: v for k, v in conf.items() if k in fields}).validate()


def _is_dcmha(op) -> bool:
    return isinstance(op, DCMHA)


def attention_core_refusal(layer) -> Optional[str]:
    """Why a DCMHA layer cannot be exported, or None: its class overrides
    ``_compute_attention``. The exported function is DCMHA's own attention core
    (``spec/reference.py``); an override replaces that core in Keras, and the graph cannot
    see what it computes. (Inside a model, a converter registered for the class is used
    instead and this check is not reached.)"""
    cls = type(layer)
    if getattr(cls, "_compute_attention", None) is getattr(DCMHA, "_compute_attention", None):
        return None
    return (f"DCMHA layer {layer.name!r} of class {cls.__module__}.{cls.__qualname__} overrides "
            "`_compute_attention`: the ONNX exporter writes DCMHA's own attention core and "
            "cannot see the override's")


def _dcmha(ctx: Context, layer, query, value=None, key=None, attention_mask=None,
           use_causal_mask=False, return_attention_scores=False, training=None, cache=None,
           cache_update_index=None, **kwargs):
    if kwargs:
        raise ctx.fail(f"DCMHA call arguments {sorted(kwargs)} are not supported by the exporter")
    if cache is not None or cache_update_index is not None:
        raise ctx.fail("A DCMHA call with an explicit `cache` cannot be exported; export the "
                       "model without it and use decode=True")
    refusal = attention_core_refusal(layer)
    if refusal:
        raise ctx.fail(refusal)
    for n, v in (("use_causal_mask", use_causal_mask),
                 ("return_attention_scores", return_attention_scores)):
        if not isinstance(v, (bool, np.bool_)):
            raise ctx.fail(f"DCMHA `{n}` must be a Python bool to be baked into the graph. "
                           f"Received: {n}={v!r}")
    cfg = dcmha_config(layer)
    if not layer.built:
        raise ctx.fail(f"DCMHA layer {layer.name!r} is not built")
    value = query if value is None else value
    key = value if key is None else key
    self_attention = value is query and key is query
    call = CallSpec(self_attention=self_attention, use_causal_mask=bool(use_causal_mask),
                         attention_mask=attention_mask is not None,
                         return_attention_scores=bool(return_attention_scores),
                         decode=ctx.decode)
    if ctx.decode and not (self_attention and use_causal_mask):
        raise ctx.fail(f"decode=True needs every DCMHA call to be causal self-attention "
                       f"(layer(x, x, use_causal_mask=True)); layer {layer.name!r} is called with "
                       f"self_attention={self_attention}, use_causal_mask={bool(use_causal_mask)}")
    try:
        check_call(cfg, call)
    except ValueError as err:
        raise ctx.fail(f"DCMHA layer {layer.name!r}: {err}") from None
    params = {n: np.asarray(w, np.float32) for n, w in layer.spec_weights().items()}
    layer_id = ctx.where()
    past = None
    if ctx.decode:
        if ctx.cache_index is None:
            ctx.cache_index = ctx.b.add_input("cache_update_index", TensorProto.INT64, [])
        shapes = ref.cache_shapes(cfg, 1, 1)
        suffix = "" if ctx.single_layer else "." + layer_id
        past = {}
        entry = {"layer": layer_id, "past": {}, "present": {}, "shapes": {}}
        if not ctx.dynamic and ctx.cache_length is None:
            raise ctx.fail("decode=True with dynamic=False needs `cache_length`")
        lead = ["batch", "cache_length"] if ctx.dynamic else [ctx.batch_size, ctx.cache_length]
        for n in decode_names(cfg):
            dims = lead + list(shapes[n][2:])
            past[n] = ctx.b.add_input(f"past_{n}{suffix}", ctx.ft, dims)
            entry["past"][n], entry["present"][n] = past[n], f"present_{n}{suffix}"
            entry["shapes"][n] = dims
        ctx.caches.append(entry)
    if attention_mask is not None and attention_mask.elem_type != TensorProto.BOOL:
        attention_mask = Value(ctx.e.op("Cast", attention_mask.name, to=TensorProto.BOOL),
                               TensorProto.BOOL, 3)
    prefix = f"{layer_id}/" if layer_id else "dcmha/"
    outs = ctx.b.add_dcmha(cfg, params, call, query=query.name,
                           value=None if self_attention else value.name,
                           key=None if self_attention else key.name,
                           attention_mask=None if attention_mask is None else attention_mask.name,
                           cache_update_index=ctx.cache_index, past=past, prefix=prefix,
                           name=layer_id or "dcmha")
    if ctx.decode:
        entry = ctx.caches[-1]
        entry["values"] = {n: outs["present_" + n] for n in decode_names(cfg)}
    y = Value(outs["output"], ctx.ft, 3)
    if return_attention_scores:
        return y, Value(outs["attention_scores"], TensorProto.FLOAT, 4)
    return y


# ---------------------------------------------------------------------------
# Standard Keras layers
# ---------------------------------------------------------------------------

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


def _install_default_converters() -> None:
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


_install_default_converters()


# ---------------------------------------------------------------------------
# Walking models
# ---------------------------------------------------------------------------

def _functional(model):
    """The Functional graph of a functional or Sequential model, or None for subclassed ones."""
    if isinstance(model, keras.Sequential):
        if getattr(model, "_functional", None) is None:
            raise ExportError(f"Sequential model {model.name!r} has no input shape yet: build it "
                              "(e.g. start it with keras.Input) before exporting.")
        return model._functional
    if hasattr(model, "_run_through_graph") and hasattr(model, "_nodes_by_depth"):
        return model
    return None


def _convert_op(ctx: Context, op, args, kwargs):
    ctx.path.append(op.name)
    try:
        fn = _converter(op)      # a registered converter first: it may take a DCMHA subclass
        if fn is not None:
            return fn(ctx, op, *args, **kwargs)
        if _is_dcmha(op):
            return _dcmha(ctx, op, *args, **kwargs)
        if isinstance(op, keras.Model) and _functional(op) is not None:
            return _walk(ctx, _functional(op), args, kwargs)
        raise ctx.fail(f"The ONNX exporter cannot write layer {op.name!r} of class "
                       f"{type(op).__module__}.{type(op).__name__}: no converter "
                       "(see dcmha.export.keras_export.register_converter)")
    finally:
        ctx.path.pop()


def _walk(ctx: Context, graph, args, kwargs):
    if kwargs and set(kwargs) - {"training", "mask"}:
        raise ctx.fail(f"Nested model call arguments {sorted(kwargs)} are not supported")
    inputs = args[0] if len(args) == 1 else list(args)

    def operation_fn(op):
        return lambda *a, **k: _convert_op(ctx, op, a, k)

    return graph._run_through_graph(inputs, operation_fn=operation_fn)


def _input_name(t, i: int) -> str:
    hist = getattr(t, "_keras_history", None)
    op = getattr(hist, "operation", None) if hist is not None else None
    return getattr(op, "name", None) or f"input_{i}"


# ---------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------

def build(obj, *, opset: Optional[int] = None, dynamic: bool = True, dtype: str = "float32",
          decode: bool = False, self_attention: Optional[bool] = None,
          use_causal_mask: bool = False, attention_mask: bool = False,
          return_attention_scores: bool = False, input_shapes: Optional[dict] = None,
          batch_size: int = 1, cache_length: Optional[int] = None,
          compose_nodes: bool = True) -> onnx.ModelProto:
    """The ONNX ModelProto of a DCMHA layer or a Keras model (see ``to_onnx``)."""
    b = ModelBuilder(dtype=dtype, opset=opset, name=getattr(obj, "name", "dcmha"),
                          compose_nodes=compose_nodes)
    ctx = Context(b, decode, dynamic, batch_size, cache_length)
    meta: Dict[str, Any] = {"decode": bool(decode), "dtype": dtype}
    if _is_dcmha(obj):
        meta.update(_build_layer(ctx, obj, dynamic, self_attention, use_causal_mask,
                                 attention_mask, return_attention_scores, input_shapes, batch_size))
    elif isinstance(obj, keras.Model):
        if _functional(obj) is None and callable(getattr(obj, "as_functional", None)):
            obj = obj.as_functional()   # e.g. dcmha.models.DCFormerLM: the same layers, walkable
        if self_attention is not None or use_causal_mask or attention_mask or return_attention_scores:
            raise ExportError("self_attention, use_causal_mask, attention_mask and "
                              "return_attention_scores apply to a single DCMHA layer; a model's "
                              "DCMHA calls are exported as the model makes them.")
        meta.update(_build_model(ctx, obj, dynamic, input_shapes, batch_size))
    else:
        raise ExportError(f"to_onnx exports a dcmha.DCMHA layer or a Keras model (functional or "
                          f"Sequential). Received: {type(obj).__module__}.{type(obj).__name__}")
    if decode:
        meta["caches"] = [{k: v for k, v in c.items() if k != "values"} for c in ctx.caches]
        meta["cache_index"] = ctx.cache_index
        if not ctx.caches:
            raise ExportError("decode=True but the model has no DCMHA layer.")
    b.metadata["dcmha.export"] = json.dumps(meta, sort_keys=True)
    return b.build(doc="Exported by dcmha.export.to_onnx")


def _check_input_names(input_shapes, names):
    unknown = sorted(set(input_shapes or {}) - set(names))
    if unknown:
        raise ExportError(f"`input_shapes` names unknown inputs {unknown}. "
                          f"The inputs are {list(names)}.")


def _check_cache_length(ctx, shape):
    """A static decode graph's cache must hold the new tokens (axis 1 of ``shape``)."""
    T = shape[1] if len(shape) > 1 else None
    if ctx.decode and ctx.cache_length is not None and isinstance(T, int) \
            and T > ctx.cache_length:
        raise ExportError(f"`cache_length` must be at least the query length {T}. "
                          f"Received: cache_length={ctx.cache_length}")


def _static_shape(name, shape, dynamic, input_shapes, batch_size, symbols):
    shape = list(shape)
    if input_shapes and name in input_shapes:
        given = list(input_shapes[name])
        if len(given) != len(shape):
            raise ExportError(f"input_shapes[{name!r}] must have rank {len(shape)}. "
                              f"Received: {tuple(given)}")
        if any(g is not None and (isinstance(g, bool) or not isinstance(g, (int, np.integer))
                                  or g <= 0) for g in given):
            raise ExportError(f"`input_shapes[{name!r}]` must hold positive integers or None. "
                              f"Received: {tuple(given)}")
        if any(g is not None and s is not None and g != s for g, s in zip(given, shape)):
            raise ExportError(f"`input_shapes[{name!r}]` must agree with the known shape "
                              f"{tuple(shape)}. Received: {tuple(given)}")
        shape = [g if g is not None else s for g, s in zip(given, shape)]
    if dynamic:
        return [s if s is not None else symbols[i] if i < len(symbols) else f"{name}_dim{i}"
                for i, s in enumerate(shape)]
    if shape and shape[0] is None:
        shape[0] = batch_size
    if any(s is None for s in shape):
        raise ExportError(f"dynamic=False needs a fully known shape for input {name!r}; "
                          f"got {tuple(shape)}. Pass input_shapes={{{name!r}: (...)}}.")
    return shape


def _build_layer(ctx, layer, dynamic, self_attention, use_causal_mask, attention_mask,
                 return_attention_scores, input_shapes, batch_size) -> dict:
    refusal = attention_core_refusal(layer)
    if refusal:
        raise ExportError(refusal)
    if not layer.built:
        raise ExportError(f"DCMHA layer {layer.name!r} is not built yet: call it on inputs first.")
    cfg = dcmha_config(layer)
    if self_attention is None:
        self_attention = not cfg.cross_attention
    params = {n: np.asarray(w, np.float32) for n, w in layer.spec_weights().items()}
    D_q, D_kv, D_out = check_params(cfg, params)
    _check_input_names(input_shapes, ["query"] + (
        ["value", "key"] if not self_attention and not ctx.decode else []) + (
        ["attention_mask"] if attention_mask else []))
    ctx.single_layer = True
    ft = ctx.ft
    S_sym = "cache_length" if ctx.decode else ("query_length" if self_attention else "key_length")
    q_shape = _static_shape("query", [None, None, D_q], dynamic, input_shapes, batch_size,
                            ["batch", "query_length"])
    _check_cache_length(ctx, q_shape)
    query = Value(ctx.b.add_input("query", ft, q_shape), ft, 3)
    value = key = None
    if not self_attention and not ctx.decode:
        kv = _static_shape("value", [None, None, D_kv], dynamic, input_shapes, batch_size,
                           ["batch", "key_length"])
        value = Value(ctx.b.add_input("value", ft, kv), ft, 3)
        key = Value(ctx.b.add_input("key", ft, kv), ft, 3)
    mask = None
    if attention_mask:
        m_shape = _static_shape("attention_mask", [None, None, None], dynamic, input_shapes,
                                batch_size, ["batch", "query_length", S_sym])
        mask = Value(ctx.b.add_input("attention_mask", TensorProto.BOOL, m_shape), TensorProto.BOOL, 3)
    if ctx.decode:
        use_causal_mask = True
    out = _dcmha(ctx, layer, query, value if value is not None else query,
                 key if key is not None else (value if value is not None else query),
                 attention_mask=mask, use_causal_mask=use_causal_mask,
                 return_attention_scores=return_attention_scores)
    y, scores = (out if return_attention_scores else (out, None))
    ctx.b.add_output(y.name, "output", ft, q_shape[:2] + [D_out])
    if ctx.decode:
        _add_presents(ctx, dynamic)
    if scores is not None:
        S = S_sym if dynamic else (ctx.cache_length if ctx.decode else
                                   q_shape[1] if self_attention else kv[1])
        ctx.b.add_output(scores.name, "attention_scores", TensorProto.FLOAT,
                         [q_shape[0], cfg.N, q_shape[1], S])
    return {"kind": "layer", "layer": layer.name, "self_attention": self_attention,
            "use_causal_mask": bool(use_causal_mask), "attention_mask": bool(attention_mask),
            "return_attention_scores": bool(return_attention_scores),
            "inputs": [i.name for i in ctx.b.inputs],
            "outputs": ["output"] + (["attention_scores"] if return_attention_scores else [])}


def _add_presents(ctx, dynamic):
    for entry in ctx.caches:
        for n, present in entry["present"].items():
            ctx.b.add_output(entry["values"][n], present, ctx.ft, entry["shapes"][n])


def _build_model(ctx, model, dynamic, input_shapes, batch_size) -> dict:
    graph = _functional(model)
    if graph is None:
        raise ExportError(f"Model {model.name!r} of class {type(model).__name__} is a subclassed "
                          "model; to_onnx walks functional and Sequential models (or register a "
                          "converter for the class).")
    ctx.path = []
    _check_input_names(input_shapes, [_input_name(t, i) for i, t in enumerate(graph.inputs)])
    names = []
    values = []
    for i, t in enumerate(graph.inputs):
        name = _input_name(t, i)
        names.append(name)
        et = _onnx_type(t.dtype, ctx.ft)
        symbols = ["batch", "sequence_length" if len(t.shape) > 1 else None]
        shape = _static_shape(name, t.shape, dynamic, input_shapes, batch_size,
                              [s for s in symbols if s])
        _check_cache_length(ctx, shape)
        if len(t.shape) > 2:   # other unknown axes get their own names
            shape = [s if i < 2 or s is not None else f"{name}_dim{i}" for i, s in enumerate(shape)]
        values.append(Value(ctx.b.add_input(name, et, shape), et, len(t.shape)))
    outputs = _walk(ctx, graph, (values,), {})
    flat = keras.tree.flatten(outputs)
    out_names = ["output"] if len(flat) == 1 else [f"output_{i}" for i in range(len(flat))]
    for v, n, t in zip(flat, out_names, graph.outputs):
        if not isinstance(v, Value):
            raise ExportError(f"Model output {n} is not computed from the inputs.")
        shape = [s if s is not None else ("batch" if i == 0 and dynamic else None)
                 for i, s in enumerate(t.shape)]
        ctx.b.add_output(v.name, n, v.elem_type, shape)
    if ctx.decode:
        _add_presents(ctx, dynamic)
    return {"kind": "model", "model": model.name, "inputs": names, "outputs": out_names}
