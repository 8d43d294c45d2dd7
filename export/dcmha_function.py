"""The ONNX local function ``dcmha.DCMHA*`` of one DCMHA configuration and call
(``make_function``), whose plain-op body follows ``spec/reference.py`` step by step.

The body is written by ``_Body``, assembled from its parts: ``Projections``
(``body_projections``: q, k, v, QK-norm, RoPE, dynamic weights), ``Composition``
(``body_compose``: the compose stages) and ``Attention`` (``body_attention``: scores, masks,
softmax, P.V over query chunks), which share one ``BodyState`` (``body_state``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Dict, Optional, Tuple

import onnx
from onnx import TensorProto, helper

from dcmha.export.body_attention import Attention
from dcmha.export.body_projections import Projections
from dcmha.export.call_spec import (CallSpec, check_call, check_dtype, check_opset,
                                    function_inputs, function_outputs)
from dcmha.export.emitter import rename_value
from dcmha.export.kernel_functions import kernel_ops_used
from dcmha.export.op_names import DOMAIN, FUNCTION_NAME
from dcmha.spec import reference as ref
from dcmha.spec import terms as spec_terms


class _Body(Projections, Attention):
    """The body of one DCMHA call's function: ``build`` writes the whole call (projections,
    dynamic weights, the decode step's cache writes, attention, output projection) into
    ``self.e`` and returns every value the function may output, by name."""

    def build(self) -> Dict[str, str]:
        """Every value the function may output, by name (see function_outputs)."""
        e, cfg, call, ft = self.e, self.cfg, self.call, self.ft
        N, N_kv, d, d_v = cfg.N, cfg.N_kv, cfg.d, cfg.d_v
        w = self.w
        query = "query"
        key = value = query
        if not call.self_attention and not call.decode:
            key, value = "key", "value"
        T = e.scalar_dim(query, 1)
        one = e.const(1, TensorProto.INT64)
        zero = e.const(0, TensorProto.INT64)
        pre = None
        if key == query:
            q, k, v, q_pos, pre = self.fused_projections(query)
        else:
            q = self.project(query, w["query_kernel"], w.get("query_bias"), self.D_q, N, d)
            k = self.project(key, w["key_kernel"], w.get("key_bias"), self.D_kv, N_kv, d)
            v = self.project(value, w["value_kernel"], w.get("value_bias"), self.D_kv, N_kv, d_v)
            if cfg.qk_norm:
                q = e.op("Mul", self.rms(q, ref.QK_NORM_EPS), w["query_norm_scale"])
                k = e.op("Mul", self.rms(k, ref.QK_NORM_EPS), w["key_norm_scale"])
            q_pos = e.op("Range", zero, T, one)
            if cfg.rope_max_wavelength is not None:
                q = self.rope(q, q_pos)
                k = self.rope(k, e.op("Range", zero, e.scalar_dim(key, 1), one))

        # dynamic composition weights
        qs, ks, all_slots = ref.side_slots(cfg, "query"), ref.side_slots(cfg, "key"), ref.slots(cfg)
        if cfg.cross_attention:
            qdyn = self.dynamic(query, self.D_q, "query_", qs)
            kdyn = self.dynamic(key, self.D_kv, "key_", ks)
        elif key == query and call.decode:     # the key side as the cache stacks it
            qdyn, entries = self.dynamic(query, self.D_q, "", all_slots, pre=pre, packed=ks)
        elif key == query:
            both = self.dynamic(query, self.D_q, "", all_slots, pre=pre)
            qdyn = {s: both[s] for s in qs}
            kdyn = {s: both[s] for s in ks}
        else:
            qdyn = self.dynamic(query, self.D_q, "", qs, [all_slots.index(s) for s in qs])
            kdyn = self.dynamic(key, self.D_kv, "", ks, [all_slots.index(s) for s in ks])

        outputs: Dict[str, str] = {}
        if call.decode:
            # write the new positions i..i+T-1 into each cache: one ScatterND per entry at
            # the (B, T, 2) indices [b, i + t]
            BT = e.op("Concat", e.dims(query, 0, 1), e.op("Unsqueeze", T, e.i64(0)), axis=0)
            rows_b = e.op("Range", zero, e.scalar_dim(query, 0), one)
            at = e.op("Concat", e.op("Unsqueeze", e.op("Expand", e.op("Unsqueeze", rows_b, e.i64(1)), BT),
                                     e.i64(2)),
                      e.op("Unsqueeze", e.op("Expand", e.op("Unsqueeze", q_pos, e.i64(0)), BT), e.i64(2)),
                      axis=2)

            def write(name, new):
                outputs["present_" + name] = e.op("ScatterND", "past_" + name, at, new)
                return outputs["present_" + name]

            k = write("key", k)
            v = write("value", v)
            # the key-side weights as the cache stacks them (spec.terms.KEY_CACHE), made by
            # ``dynamic`` (a decode step is self-attention: ``check_call``)
            kdyn = spec_terms.unpack_key_weights(
                {n: e.cast(write(n, t), ft, self.dyn_type) for n, t in entries.items()}, ks,
                unstack=self.unstack)

        qf, kf = self.factors(qdyn, kdyn)
        rows = (q, qf, q_pos, "attention_mask" if call.attention_mask else None)
        # the MatMul layouts of k and v: made once for every chunk, but in a decode step
        # only for the keys written so far (``_block``)
        S = e.scalar_dim(k, 2 if self.heads_first else 1)                   # keys
        cols = (k, v, kf) if call.decode else self.kv_layouts(k, v) + (kf,)
        if call.return_attention_scores or call.intermediates:
            # the (B, N, T, S) outputs cover every key: one block, nothing skipped
            if call.decode:
                cols = self.kv_layouts(k, v) + (kf,)
            o, full = self.attend(rows, cols, zero, S)
            outputs.update(full)
        else:
            o = self.attend_chunks(rows, cols, T, S,
                                   "cache_update_index" if call.decode else zero)
        y = e.op("MatMul", o, e.reshape(w["output_kernel"], N * d_v, self.D_out))
        if cfg.use_bias:
            y = e.op("Add", y, w["output_bias"])
        outputs["output"] = y
        for side in (qdyn, kdyn):
            for slot, ws in side.items():
                outputs.update({f"dynamic/{slot}/{n}": t for n, t in ws.items()})
        return outputs


def make_function(cfg: ref.Config, widths: Tuple[int, int, int], call: CallSpec, *,
                  dtype: str = "float32", opset: Optional[int] = None,
                  name: str = FUNCTION_NAME, compose_nodes: bool = True) -> onnx.FunctionProto:
    """The ONNX local function ``dcmha.<name>`` for one DCMHA configuration and call.

    widths: (D_q, D_kv, D_out). Inputs/outputs: see ``function_inputs`` /
    ``function_outputs``; the configuration is stored as JSON in doc_string.
    compose_nodes: write each compose as one ``dcmha.Compose*`` node (``compose_function``:
    the model must carry those functions too; ``ModelBuilder`` adds them).
    """
    cfg = cfg.validate()
    check_call(cfg, call)
    dtype, opset = check_dtype(dtype), check_opset(opset)
    weights = list(ref.param_shapes(cfg, *widths))
    body = _Body(cfg, call, dtype, widths, weights, compose_nodes=compose_nodes)
    produced = body.build()
    outs = function_outputs(cfg, call)
    nodes = list(body.e.nodes)
    fixed = set(function_inputs(cfg, call, weights))   # names that cannot be renamed
    for o in outs:   # bind the internal names to the declared output names
        value = produced[o]
        if value in fixed or not rename_value(nodes, value, o):
            nodes.append(helper.make_node("Identity", [value], [o], name="out_" + o))
        else:        # renamed in place: no Identity, which is a copy into an output
            produced = {k: (o if v == value else v) for k, v in produced.items()}
        fixed.add(o)
    doc = json.dumps({"config": cfg.to_dict(), "widths": list(widths), "dtype": dtype,
                      "call": dataclasses.asdict(call), "compose_nodes": compose_nodes},
                     sort_keys=True)
    opsets = [helper.make_opsetid("", opset)]
    if kernel_ops_used(nodes):
        opsets.append(helper.make_opsetid(DOMAIN, 1))
    return helper.make_function(DOMAIN, name, function_inputs(cfg, call, weights), outs, nodes,
                                opsets, doc_string=doc)
