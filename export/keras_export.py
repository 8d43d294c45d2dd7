"""Keras front-end of the ONNX exporter: a DCMHA layer, or a Keras model containing them.

A functional or Sequential model is walked node by node (Keras's own graph
runner, with graph-value stand-ins in place of tensors). Every DCMHA call
becomes one ``dcmha.DCMHA*`` function node (``keras_dcmha``; see
``dcmha.export.core``); the standard layers below are written as plain ONNX ops
(``keras_layers``). Anything else raises a ValueError naming the layer class and
where it sits in the model. ``keras_context`` holds the walk's state and the
converter registry; this module walks models and builds the graph (``build``).

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

import json
from typing import Any, Dict, Optional

import numpy as np
import onnx
from onnx import TensorProto

import keras

from dcmha.export.builder import ModelBuilder
from dcmha.export.call_spec import check_params
from dcmha.export.keras_context import (Context, Converter, ExportError, Value, converter_for,
                                        onnx_type, register_converter)
from dcmha.export.keras_dcmha import (attention_core_refusal, convert_dcmha, dcmha_config,
                                      is_dcmha)
from dcmha.export.keras_layers import install_default_converters

install_default_converters()

__all__ = ["build", "register_converter", "Value", "Context", "Converter", "ExportError",
           "dcmha_config", "attention_core_refusal"]


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
        fn = converter_for(op)      # a registered converter first: it may take a DCMHA subclass
        if fn is not None:
            return fn(ctx, op, *args, **kwargs)
        if is_dcmha(op):
            return convert_dcmha(ctx, op, *args, **kwargs)
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
    if is_dcmha(obj):
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
    out = convert_dcmha(ctx, layer, query, value if value is not None else query,
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
        et = onnx_type(t.dtype, ctx.ft)
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
