"""Graph assembly: ``ModelBuilder`` collects inputs, initializers, plain-op nodes and DCMHA
calls (each a node of its configuration's shared function, plus the kernel ops' functions
it calls) into a ModelProto; ``export_layer`` writes the graph of a single call."""

from __future__ import annotations

import dataclasses
import json
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dcmha.export.call_spec import (DTYPES, NP_DTYPES, CallSpec, Dim, check_call, check_dtype,
                                    check_opset, check_params, decode_names, function_outputs,
                                    intermediate_names)
from dcmha.export.dcmha_function import make_function
from dcmha.export.emitter import Emitter, rename_value
from dcmha.export.kernel_functions import kernel_function, kernel_ops_used
from dcmha.export.op_names import DOMAIN, FUNCTION_NAME
from dcmha.spec import reference as ref


class ModelBuilder:
    """Collects graph inputs, initializers, nodes and DCMHA functions into a ModelProto."""

    def __init__(self, *, dtype: str = "float32", opset: Optional[int] = None, name: str = "dcmha",
                 compose_nodes: bool = True):
        if not isinstance(compose_nodes, bool):
            raise TypeError(f"compose_nodes must be True or False; received {compose_nodes!r}")
        self.compose_nodes = compose_nodes
        self.dtype = check_dtype(dtype)
        self.ft = DTYPES[dtype]
        self.np_dtype = NP_DTYPES[dtype]
        self.opset = check_opset(opset)
        self.name = name
        self.e = Emitter()
        self.inputs: List[onnx.ValueInfoProto] = []
        self.outputs: List[onnx.ValueInfoProto] = []
        self.initializers: List[onnx.TensorProto] = []
        self.functions: Dict[str, onnx.FunctionProto] = {}
        self._function_keys: Dict[str, str] = {}
        self.metadata: Dict[str, str] = {}
        self._names: set = set()
        self._renamed: Dict[str, str] = {}

    def _claim(self, name: str) -> str:
        if name in self._names:
            raise ValueError(f"Duplicate ONNX value name {name!r}.")
        self._names.add(name)
        return name

    def add_input(self, name: str, elem_type: int, shape: Sequence[Dim]) -> str:
        self.inputs.append(helper.make_tensor_value_info(self._claim(name), elem_type, list(shape)))
        return name

    def add_output(self, value: str, name: str, elem_type: int, shape: Optional[Sequence[Dim]]) -> str:
        value = self._renamed.get(value, value)
        if value != name:
            self._claim(name)
            # the producer writes the output itself where it can: an Identity into a graph
            # output is a copy in onnxruntime (a whole decode cache per step)
            if value in {o.name for o in self.outputs} or not rename_value(self.e.nodes, value, name):
                self.e.nodes.append(helper.make_node("Identity", [value], [name],
                                                     name=self.e.fresh("n_out")))
            else:
                self._renamed[value] = name
        self.outputs.append(helper.make_tensor_value_info(
            name, elem_type, None if shape is None else list(shape)))
        return name

    def add_initializer(self, name: str, array: np.ndarray, dtype=None) -> str:
        arr = np.asarray(array, dtype=self.np_dtype if dtype is None else dtype)
        self.initializers.append(numpy_helper.from_array(arr, self._claim(name)))
        return name

    def function_for(self, cfg: ref.Config, widths, call: CallSpec) -> str:
        """The (shared) function name for this configuration and call."""
        key = json.dumps([cfg.to_dict(), list(widths), dataclasses.asdict(call)], sort_keys=True)
        if key not in self._function_keys:
            n = len(self._function_keys)
            fname = FUNCTION_NAME if n == 0 else f"{FUNCTION_NAME}_{n + 1}"
            self.functions[fname] = make_function(cfg, widths, call, dtype=self.dtype,
                                                  opset=self.opset, name=fname,
                                                  compose_nodes=self.compose_nodes)
            todo = kernel_ops_used(self.functions[fname].node)
            while todo:   # each kernel op's function, and those its body calls
                op = todo.pop(0)
                if op not in self.functions:
                    self.functions[op] = kernel_function(op, self.opset)
                    todo += kernel_ops_used(self.functions[op].node)
            self._function_keys[key] = fname
        return self._function_keys[key]

    def add_dcmha(self, cfg: ref.Config, params: Mapping[str, np.ndarray], call: CallSpec, *,
                  query: str, value: Optional[str] = None, key: Optional[str] = None,
                  attention_mask: Optional[str] = None, cache_update_index: Optional[str] = None,
                  past: Optional[Mapping[str, str]] = None, prefix: str = "",
                  name: str = "dcmha") -> Dict[str, str]:
        """Add one DCMHA call; returns {"output", "attention_scores"?, "present_<entry>"...}.

        Weights become initializers named ``prefix + canonical name``. ``past``
        maps cache entry names (``decode_names``) to graph values.
        """
        cfg = cfg.validate()
        widths = check_params(cfg, params)
        check_call(cfg, call)
        fname = self.function_for(cfg, widths, call)
        self.metadata[f"dcmha.layer.{name}"] = json.dumps(
            {"function": fname, "config": cfg.to_dict(), "widths": list(widths),
             "call": dataclasses.asdict(call), "weight_prefix": prefix}, sort_keys=True)
        weights = [self.add_initializer(prefix + n, params[n]) for n in ref.param_shapes(cfg, *widths)]
        args = [query]
        if call.decode:
            past = past or {}
            missing = [n for n in decode_names(cfg) if n not in past]
            if missing or cache_update_index is None:
                raise ValueError(f"A decode call needs cache_update_index and past entries "
                                 f"{decode_names(cfg)}; missing: {missing}")
            args += [cache_update_index] + [past[n] for n in decode_names(cfg)]
        elif not call.self_attention:
            if value is None:
                raise ValueError("A call with self_attention=False needs a `value` input.")
            args += [value, key if key is not None else value]
        if call.attention_mask:
            if attention_mask is None:
                raise ValueError("CallSpec.attention_mask=True needs an `attention_mask` input.")
            args.append(attention_mask)
        args += weights
        outs = function_outputs(cfg, call)
        out_names = [self.e.fresh(f"{prefix}{o}") for o in outs]
        self.e.nodes.append(helper.make_node(fname, args, out_names, name=name, domain=DOMAIN))
        return dict(zip(outs, out_names))

    def build(self, doc: str = "") -> onnx.ModelProto:
        opsets = [helper.make_opsetid("", self.opset), helper.make_opsetid(DOMAIN, 1)]
        graph = helper.make_graph(self.e.nodes, self.name, self.inputs, self.outputs,
                                  initializer=self.initializers)
        model = helper.make_model(graph, opset_imports=opsets, functions=list(self.functions.values()),
                                  producer_name="dcmha.export", doc_string=doc)
        # the smallest IR version that has this opset (local functions need IR >= 8)
        model.ir_version = max(8, helper.find_min_ir_version_for(opsets[:1], ignore_unknown=True))
        meta = dict(self.metadata)
        meta["dcmha.dtype"] = self.dtype
        meta["dcmha.spec_version"] = ref.SPEC_VERSION
        helper.set_model_props(model, meta)
        return model


def layer_dims(dynamic: bool, dims: Optional[Mapping[str, int]] = None) -> Dict[str, Dim]:
    """Symbolic (dynamic=True) or concrete axis sizes of a single-call graph."""
    names = ("batch", "query_length", "key_length", "cache_length")
    if dynamic:
        return {n: n for n in names}
    dims = dict(dims or {})
    return {n: dims.get(n) for n in names}


def export_layer(cfg: ref.Config, params: Mapping[str, np.ndarray], call: CallSpec = CallSpec(), *,
                 dtype: str = "float32", opset: Optional[int] = None, dynamic: bool = True,
                 dims: Optional[Mapping[str, int]] = None,
                 compose_nodes: bool = True) -> onnx.ModelProto:
    """The ONNX graph of one DCMHA call from the spec's Config and canonical params.

    Graph inputs:  query (B, T, D_q); value, key (B, S, D_kv) unless self-attention;
                   decode: cache_update_index (int64 scalar), past_key (B, S_max, N_kv, d),
                   past_value (B, S_max, N_kv, d_v), past_key_w (B, S_max, 2 C_k, G, R, M),
                   past_key_dd (B, S_max, C_k, G, M) (``reference.cache_shapes``);
                   attention_mask (B, T, S) bool if requested.
    Graph outputs: output (B, T, D_out); decode: present_* (same shapes as past_*);
                   attention_scores (B, N, T, S), float32, if requested.
    Every float input/output but attention_scores has the compute ``dtype``.
    With dynamic=False, ``dims`` gives batch, query_length, key_length / cache_length.
    compose_nodes: write each compose as one ``dcmha.Compose*`` node, a local function
    with a plain-op body that onnxruntime runs as the compiled kernel in sessions that
    register ``dcmha.export.ort_ops`` (``session`` does); False: plain ops inline (the
    faster graph for a runtime without the kernel).
    """
    cfg = cfg.validate()
    D_q, D_kv, D_out = check_params(cfg, params)
    check_call(cfg, call)
    b = ModelBuilder(dtype=dtype, opset=opset, compose_nodes=compose_nodes)
    dm = layer_dims(dynamic, dims)
    B, T = dm["batch"], dm["query_length"]
    S = dm["cache_length"] if call.decode else (T if call.self_attention else dm["key_length"])
    if not dynamic:
        need = {"batch": B, "query_length": T}
        if call.decode or not call.self_attention:
            need["cache_length" if call.decode else "key_length"] = S
        missing = [k for k, v in need.items() if v is None]
        if missing:
            raise ValueError(f"dynamic=False needs concrete sizes for {missing}. Received: dims={dims}")
    ft = b.ft
    q = b.add_input("query", ft, [B, T, D_q])
    value = key = None
    past = None
    index = None
    if call.decode:
        index = b.add_input("cache_update_index", TensorProto.INT64, [])
        shapes = ref.cache_shapes(cfg, 1, 1)
        past = {n: b.add_input("past_" + n, ft, [B, S] + list(shapes[n][2:])) for n in decode_names(cfg)}
    elif not call.self_attention:
        value = b.add_input("value", ft, [B, S, D_kv])
        key = b.add_input("key", ft, [B, S, D_kv])
    mask = b.add_input("attention_mask", TensorProto.BOOL, [B, T, S]) if call.attention_mask else None
    outs = b.add_dcmha(cfg, params, call, query=q, value=value, key=key, attention_mask=mask,
                       cache_update_index=index, past=past, prefix="dcmha/", name="dcmha")
    b.add_output(outs["output"], "output", ft, [B, T, D_out])
    if call.decode:
        shapes = ref.cache_shapes(cfg, 1, 1)
        for n in decode_names(cfg):
            b.add_output(outs["present_" + n], "present_" + n, ft, [B, S] + list(shapes[n][2:]))
    if call.return_attention_scores:
        b.add_output(outs["attention_scores"], "attention_scores", TensorProto.FLOAT,
                     [B, cfg.N, T, S])
    if call.intermediates:
        for n in intermediate_names(cfg):
            dt = ft if n.startswith("dynamic/") else TensorProto.FLOAT
            b.add_output(outs[n], n, dt, [None] * (4 if not n.startswith("dynamic/") else
                                                   (4 if n.endswith("dd") else 5)))
    return b.build(doc="One DCMHA call (dcmha.export).")
