"""The DCMHA layer in a Keras export: its spec Config (``dcmha_config``), the refusal of a
subclass whose attention core the graph cannot see (``attention_core_refusal``) and the
converter of one DCMHA call (``convert_dcmha``: one ``dcmha.DCMHA*`` function node, with
its decode cache inputs and outputs)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
from onnx import TensorProto

from dcmha.export.call_spec import CallSpec, check_call, decode_names
from dcmha.export.keras_context import Context, ExportError, Value
from dcmha.layers import DCMHA
from dcmha.spec import reference as ref

#: DCMHA get_config() keys with no effect on an inference graph.
_IGNORED_OPTIONS = {"name", "trainable", "dtype", "dropout", "implementation", "kernel_initializer",
                    "bias_initializer", "seed", "output_shape", "query_chunk_size",
                    "flash_attention", "kernel_regularizer", "bias_regularizer",
                    "activity_regularizer", "kernel_constraint", "bias_constraint",
                    # How the variables hold the composition weights: the graph takes the
                    # weights themselves (spec_weights()).
                    "composition_lr_scale"}
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


def is_dcmha(op) -> bool:
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


def convert_dcmha(ctx: Context, layer, query, value=None, key=None, attention_mask=None,
                  use_causal_mask=False, return_attention_scores=False, training=None,
                  cache=None, cache_update_index=None, **kwargs):
    """One DCMHA call as a ``dcmha.DCMHA*`` function node: its output Value (and the
    attention scores' with ``return_attention_scores``)."""
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
