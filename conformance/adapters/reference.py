"""The reference adapter: every case computed by the NumPy spec itself (float64).

It supports every capability: forward, intermediates, decode (``reference.decode_step`` over
the case's steps) and gradients (``reference_grad.attention_grads``), in every dtype (the
stored inputs are exact, so it computes the float64 reference of those values). It runs in
the runner's process.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from dcmha.conformance.adapters.base import (CAPABILITIES, Adapter, cache_length, call_inputs,
                                             decode_segments)
from dcmha.spec import reference


class ReferenceAdapter(Adapter):
    """The NumPy reference (``dcmha.spec.reference``): the numbers every other adapter
    is compared with; every capability."""

    name = "reference"
    capabilities = CAPABILITIES

    def run(self, case) -> Dict[str, np.ndarray]:
        args = call_inputs(case)
        params = case.params
        kw = dict(attention_mask=args["attention_mask"], use_causal_mask=args["use_causal_mask"])
        if case.kind == "decode":
            return {"output": self._decode(case)}
        y, inter = reference.attention(params, case.cfg, args["query"], args["key"], args["value"],
                                       return_intermediates=True, **kw)
        out = {"output": y, "attention_scores": inter["post_composed"], "scores": inter["scores"],
               "pre_composed": inter["pre_composed"], "probs": inter["probs"]}
        for side in ("query_dynamic", "key_dynamic"):
            for slot, ws in inter[side].items():
                for w, a in ws.items():
                    out[f"dynamic/{slot}/{w}"] = a
        if case.kind == "gradients":
            from dcmha.spec.reference_grad import attention_grads

            grads = attention_grads(params, case.cfg, args["query"], args["key"], args["value"],
                                    d_output=case.inputs["d_output"], **kw)
            out.update({f"grad/{n}": g for n, g in grads.items()})
        return {n: out[n] for n in case.outputs if n in out}

    @staticmethod
    def _decode(case) -> np.ndarray:
        query = case.inputs["query"]
        cache = reference.init_cache(case.cfg, query.shape[0], cache_length(case))
        outs = []
        for start, stop in decode_segments(case):
            y, cache = reference.decode_step(case.params, case.cfg, query[:, start:stop], cache,
                                             start)
            outs.append(y)
        return np.concatenate(outs, axis=1)
