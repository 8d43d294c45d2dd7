"""What one DCMHA call of an exported graph is: its ``CallSpec``, the checks of a
configuration, dtype, opset and parameters against it, and the inputs and outputs of its
function (``function_inputs`` / ``function_outputs``)."""

from __future__ import annotations

import dataclasses
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import onnx
from onnx import TensorProto

from dcmha.spec import reference as ref

MIN_OPSET = 18
DEFAULT_OPSET = 18
DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
NP_DTYPES = {"float32": np.float32, "float16": np.float16}

Dim = Union[int, str, None]


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """How one DCMHA call is written (everything that is baked into the graph).

    self_attention: the query input is also key and value (one graph input).
    use_causal_mask: bake the causal mask s <= t (decode is always causal).
    attention_mask: the call takes a boolean (B, T, S) mask input, True = attend.
    return_attention_scores: add the (B, N, T, S) post-composed, masked probabilities.
    decode: a cached step; see ``decode_names``.
    intermediates: add the spec's intermediates (for debugging and conformance):
        scores, pre_composed, probs (B, N, T, S) and dynamic/<slot>/<w1|w2|dd>.
    """

    self_attention: bool = True
    use_causal_mask: bool = False
    attention_mask: bool = False
    return_attention_scores: bool = False
    decode: bool = False
    intermediates: bool = False


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"`dtype` must be one of {sorted(DTYPES)}; onnxruntime has no CPU "
                         f"kernels for other dtypes. Received: dtype={dtype!r}")
    return dtype


def check_opset(opset: Optional[int]) -> int:
    opset = DEFAULT_OPSET if opset is None else opset
    top = onnx.defs.onnx_opset_version()
    if not isinstance(opset, int) or isinstance(opset, bool) or not MIN_OPSET <= opset <= top:
        raise ValueError(f"`opset` must be an integer in [{MIN_OPSET}, {top}]. "
                         f"Received: opset={opset!r}")
    return opset


def check_call(cfg: ref.Config, call: CallSpec) -> None:
    """Raise for a configuration/call combination the exporter cannot write."""
    if call.decode:
        if cfg.cross_attention:
            raise ValueError("decode=True needs a self-attention layer; this layer has "
                             "cross_attention=True (separate query/key dynamic projections).")
        if not call.self_attention:
            raise ValueError("decode=True needs self-attention (self_attention=True).")
    if cfg.cross_attention and call.self_attention:
        raise ValueError("A cross_attention=True layer takes separate query and key/value "
                         "inputs: export it with self_attention=False.")


def decode_names(cfg: ref.Config) -> List[str]:
    """Cache entry names, in ``reference.cache_shapes`` order ("key", "value", "key_w", "key_dd")."""
    return list(ref.cache_shapes(cfg, 1, 1))


def check_params(cfg: ref.Config, params: Mapping[str, np.ndarray]) -> Tuple[int, int, int]:
    """The input widths (D_q, D_kv, D_out) read from the kernels; every name/shape is checked."""
    for name in ("query_kernel", "key_kernel", "output_kernel"):
        if name not in params:
            raise ValueError(f"DCMHA parameters lack `{name}`. Received names: {sorted(params)}")
    D_q = int(np.shape(params["query_kernel"])[0])
    D_kv = int(np.shape(params["key_kernel"])[0])
    D_out = int(np.shape(params["output_kernel"])[-1])
    want = ref.param_shapes(cfg, D_q, D_kv, D_out)
    if set(want) != set(params):
        raise ValueError("DCMHA parameter names do not match the configuration. Missing: "
                         f"{sorted(set(want) - set(params))}; unexpected: "
                         f"{sorted(set(params) - set(want))}")
    for name, shape in want.items():
        if tuple(np.shape(params[name])) != tuple(shape):
            raise ValueError(f"DCMHA parameter `{name}` must have shape {tuple(shape)}. "
                             f"Received: {tuple(np.shape(params[name]))}")
    return D_q, D_kv, D_out


def function_inputs(cfg: ref.Config, call: CallSpec, weight_names: Sequence[str]) -> List[str]:
    ins = ["query"]
    if call.decode:
        ins += ["cache_update_index"] + ["past_" + n for n in decode_names(cfg)]
    elif not call.self_attention:
        ins += ["value", "key"]
    if call.attention_mask:
        ins.append("attention_mask")
    return ins + list(weight_names)


def function_outputs(cfg: ref.Config, call: CallSpec) -> List[str]:
    outs = ["output"]
    if call.decode:
        outs += ["present_" + n for n in decode_names(cfg)]
    if call.return_attention_scores:
        outs.append("attention_scores")
    if call.intermediates:
        outs += intermediate_names(cfg)
    return outs


def intermediate_names(cfg: ref.Config) -> List[str]:
    names = ["scores", "pre_composed", "probs"]
    kinds = (["w1", "w2"] if cfg.dynamic_projection else []) + (["dd"] if cfg.dynamic_gating else [])
    return names + [f"dynamic/{s}/{w}" for s in ref.slots(cfg) for w in kinds]
