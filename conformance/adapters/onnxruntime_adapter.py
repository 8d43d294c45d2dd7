"""Conformance adapter: the ONNX graph of ``dcmha.export`` run in onnxruntime (CPU).

Each case is exported from ``case.cfg`` + ``case.params`` through the
framework-free core (``dcmha.export.core``, no Keras), checked with
onnx.checker (full_check) and run with every graph optimisation on.
Forward cases return "output" and "attention_scores" (and, for cases that
require "intermediates", the spec's scores, pre_composed, probs and dynamic
weights as extra graph outputs); decode cases run the
single-step graph once per ``decode_steps`` entry, carrying the presents into
the next step's pasts. "output" always comes from the graph users deploy, the
one without (B, N, T, S) outputs (queries in chunks, each on its visible keys);
the attention scores and intermediates from a second graph that returns them.
float16 cases run the float16 graph (float32 scores and softmax).

Two adapters: "onnxruntime" runs the graph as exported by default, each compose a
``dcmha.Compose*`` node that the session runs as the compiled compose kernel
(``dcmha.export.ort_ops``; its plain-op body where the kernel cannot be built);
"onnxruntime-plain" the graph exported with ``compose_nodes=False`` (composes as
plain ops). Not covered:
gradients (an inference graph), and bfloat16 (the exporter writes
float32/float16 only; onnxruntime's CPU provider has no bfloat16 MatMul/Softmax
kernels).
"""

from __future__ import annotations

import dataclasses
from typing import Dict

import numpy as np

from dcmha.conformance.adapters.base import Adapter, cache_length, decode_segments
from dcmha.export import core
from dcmha.spec import reference


class OnnxRuntimeAdapter(Adapter):
    """The ONNX graphs of ``dcmha.export`` run by onnxruntime (forward and decoding
    segments, float32 and float16)."""

    name = "onnxruntime"
    capabilities = frozenset({"forward", "decode", "float32", "float16", "intermediates",
                              "attention_scores", "long_sequences"})

    compose_nodes = True

    def __init__(self, opset=None):
        self.opset = opset

    def _session(self, case, call: core.CallSpec):
        model = core.export_layer(case.cfg, case.params, call, dtype=case.dtype, opset=self.opset,
                                  compose_nodes=self.compose_nodes)
        core.check_model(model)
        return core.session(model)

    def run(self, case) -> Dict[str, np.ndarray]:
        if case.dtype not in core.DTYPES:
            raise ValueError(f"onnxruntime adapter: dtype {case.dtype!r} is not exported "
                             f"(supported: {sorted(core.DTYPES)}).")
        np_dtype = core.NP_DTYPES[case.dtype]
        inputs = {n: (a.astype(np_dtype) if a.dtype.kind == "f" else a) for n, a in case.inputs.items()}
        if case.kind == "forward":
            return self._forward(case, inputs)
        if case.kind == "decode":
            return self._decode(case, inputs, np_dtype)
        raise ValueError(f"onnxruntime adapter: case kind {case.kind!r} is not supported.")

    def _forward(self, case, inputs) -> Dict[str, np.ndarray]:
        self_attention = bool(case.call.get("self_attention", True))
        has_mask = bool(case.call.get("has_attention_mask", False))
        call = core.CallSpec(self_attention=self_attention,
                             use_causal_mask=bool(case.call.get("use_causal_mask", False)),
                             attention_mask=has_mask, return_attention_scores=True,
                             intermediates="intermediates" in case.requires)
        sess = self._session(case, call)
        plain = self._session(case, dataclasses.replace(call, return_attention_scores=False,
                                                        intermediates=False))
        feeds = {"query": inputs["query"]}
        if not self_attention:
            feeds["value"] = inputs["value"]
            feeds["key"] = inputs.get("key", inputs["value"])
        if has_mask:
            B, T, S = (case.dims["batch"], case.dims["query_length"],
                       case.dims["query_length"] if self_attention else case.dims["key_length"])
            feeds["attention_mask"] = np.broadcast_to(inputs["attention_mask"].astype(bool), (B, T, S))
        names = [o.name for o in sess.get_outputs()]
        out = dict(zip(names, sess.run(None, feeds)))
        out["output"] = plain.run(["output"], feeds)[0]
        return {n: np.asarray(a, np.float32) for n, a in out.items()}

    def _decode(self, case, inputs, np_dtype) -> Dict[str, np.ndarray]:
        query = inputs["query"]
        B, T = query.shape[:2]
        S_max = cache_length(case)
        has_mask = bool(case.call.get("has_attention_mask", False))
        call = core.CallSpec(decode=True, attention_mask=has_mask, return_attention_scores=True)
        sess = self._session(case, call)
        plain = self._session(case, dataclasses.replace(call, return_attention_scores=False))
        names = core.decode_names(case.cfg)
        cache = {n: np.zeros(s, np_dtype)
                 for n, s in reference.cache_shapes(case.cfg, B, S_max).items()}
        mask = None
        if has_mask:   # (B, T, S) -> (B, T, S_max); keys past T are never attended (causal)
            m = np.broadcast_to(inputs["attention_mask"].astype(bool), (B, T, T))
            mask = np.zeros((B, T, S_max), bool)
            mask[:, :, :min(T, S_max)] = m[:, :, :S_max]
        outs, scores = [], []
        out_names = [o.name for o in plain.get_outputs()]
        for i, j in decode_segments(case):
            feeds = {"query": query[:, i:j], "cache_update_index": np.array(i, np.int64)}
            feeds.update({"past_" + c: cache[c] for c in names})
            if has_mask:
                feeds["attention_mask"] = mask[:, i:j]
            scores.append(sess.run(["attention_scores"], feeds)[0])
            res = dict(zip(out_names, plain.run(None, feeds)))
            cache = {c: res["present_" + c] for c in names}
            outs.append(res["output"])
        result = {"output": np.concatenate(outs, axis=1).astype(np.float32)}
        if S_max == T:   # step scores (B, N, n, S_max) tile the full (B, N, T, S) scores
            result["attention_scores"] = np.concatenate(scores, axis=2).astype(np.float32)
        return result


class OnnxRuntimePlainAdapter(OnnxRuntimeAdapter):
    """The graph exported with ``compose_nodes=False``: every compose as plain ONNX ops."""
    name = "onnxruntime-plain"
    compose_nodes = False
