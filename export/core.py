"""Framework-free ONNX writer for DCMHA (NumPy + onnx only).

One DCMHA call becomes one node ``dcmha.DCMHA*`` whose op is an ONNX *local
function* in the ``dcmha`` domain: a runtime that knows DCMHA can match the
node and fuse it, any other runtime inlines its plain-op body. The body follows
``spec/reference.py`` step by step:

    q, k, v projections (+bias) -> QK-norm -> RoPE -> dynamic weights ->
    scores -> pre-compose -> masked softmax -> post-compose -> masked entries
    set to 0 (all in float32, whatever the dtype, as in the Keras layer) ->
    P.V -> output projection.

Written for onnxruntime's CPU provider (benchmarks/RESULTS.md, "onnxruntime on the exported graph"): one MatMul
for every projection of a self-attention input; each compose one ``dcmha.Compose*``
node (a local function with a plain-op body, which onnxruntime runs as the compiled
compose kernel when ``dcmha.export.ort_ops`` is registered; ``compose_nodes=False``
writes the composes as plain ops: one batched MatMul per side with its factors made
once per call); masks as an added bias and a 0/1 multiplier. A causal or windowed call without (B, N, T, S) outputs runs its
queries in chunks (an ONNX Loop, SPEC.md "Query chunking"), each on the keys it
can see; a decode step reads only the cache positions written so far. With kernel nodes
(``compose_nodes=True``) the other hot spots are local functions of the same kind too
(``KERNEL_OPS``): a block's compose, biased softmax and compose (``Probs*``), a stage's
per-query matrix (``QueryMatrix*``), RoPE (``Rope*``, ``RopeHeads*``) and a decode step's
cache reads (``CacheHeads*``).

Function signatures (the function's canonical weights come last, in the order
of ``reference.param_shapes``):

    forward, self-attention   (query, [attention_mask], *weights)
    forward, general          (query, value, key, [attention_mask], *weights)
    decode                    (query, cache_update_index, past_key, past_value,
                               past_key_w, past_key_dd, [attention_mask], *weights)
    outputs                   (output, [present_*...], [attention_scores])

``ModelBuilder`` assembles graphs from such calls (plus plain ops added by a
front-end); ``export_layer`` writes the graph of a single call, and
``save_model`` writes atomically after ``onnx.checker`` (full_check) passes and
onnxruntime has loaded the file with every graph optimisation on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import stat
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dcmha.spec import reference as ref
from dcmha.spec import terms as spec_terms

DOMAIN = "dcmha"
FUNCTION_NAME = "DCMHA"
MIN_OPSET = 18
DEFAULT_OPSET = 18
DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
NP_DTYPES = {"float32": np.float32, "float16": np.float16}
#: Added to masked scores before the float32 softmax (``spec.terms.MASKED_SCORE``):
#: finite, so a fully masked row gives a finite (uniform) softmax that the final
#: mask zeroes, and far below any real score, so it absorbs the score.
MASKED_SCORE = float(spec_terms.MASKED_SCORE)
#: The compose terms this translation writes (see ``_Body.factors``).
EXPORTED_TERMS = frozenset({"qw1", "qw2", "kw1", "kw2", "qdd", "kdd", "static"})
#: The compose ops (``compose_function``), by the terms they take: Q (per-query matrix),
#: K (key-side rank-R pair), D (key-side gating).
COMPOSE_OPS = ("ComposeQ", "ComposeK", "ComposeD", "ComposeQK", "ComposeQD", "ComposeKD",
               "ComposeQKD")
#: A decode step's key / value cache range, heads first (``cache_heads_function``), by dtype;
#: and a float16 cache's range as float32.
CACHE_OPS = {"float32": "CacheHeads", "float16": "CacheHeads16"}
CACHE_WIDEN_OP = "CacheHeads16F"
CACHE_HEADS_OPS = tuple(CACHE_OPS.values()) + (CACHE_WIDEN_OP,)
#: The per-query matrix of a Compose node's Q input from the spec's query-side terms
#: (``query_matrix_function``), by the terms it takes: W (qw1, qw2), D (qdd), S (static).
QUERY_OPS = ("QueryMatrixW", "QueryMatrixD", "QueryMatrixWD", "QueryMatrixWS", "QueryMatrixDS",
             "QueryMatrixWDS")
#: The rotate-half RoPE of the query and key heads (``rope_function``), by dtype; and the
#: same read from a projection's output, heads first (``rope_heads_function``).
ROPE_OPS = {"float32": "Rope", "float16": "Rope16"}
ROPE_HEADS_OPS = {"float32": "RopeHeads", "float16": "RopeHeads16"}
#: A causal block's probabilities from its scores, Compose_post(softmax(Compose_pre(x) +
#: bias)), as one op (``probs_function``): ``Probs<pre>_<post>``, each stage the letters of
#: its Compose op or none (not both none).
STAGE_LETTERS = ("",) + tuple(n[len("Compose"):] for n in COMPOSE_OPS)
PROBS_OPS = tuple(f"Probs{a}_{b}" for a in STAGE_LETTERS for b in STAGE_LETTERS if a or b)
#: Every op of the ``dcmha`` domain that ``dcmha.export.ort_ops`` runs as compiled code.
KERNEL_OPS = (COMPOSE_OPS + CACHE_HEADS_OPS + QUERY_OPS
              + tuple(ROPE_OPS.values()) + tuple(ROPE_HEADS_OPS.values()) + PROBS_OPS)
#: Queries per chunk of the chunked attention (``attend_chunks``) unless the
#: configuration sets ``query_chunk_size``: with plain-op composes, and with Compose nodes
#: (the kernel leaves less work per chunk, so fewer, larger chunks pay: benchmarks/RESULTS.md).
CHUNK = 64
KERNEL_CHUNK = 128

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


# ---------------------------------------------------------------------------
# A small node emitter
# ---------------------------------------------------------------------------

class Emitter:
    """Appends nodes with fresh value names; constants are Constant nodes so the
    same code writes function bodies (which cannot hold initializers) and graphs."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix
        self.nodes: List[onnx.NodeProto] = []
        self._count = 0

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}{hint}_{self._count}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs):
        outs = [self.fresh(op_type) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh("n_" + op_type),
                                           domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def const(self, value, dtype) -> str:
        arr = np.asarray(value, dtype=helper.tensor_dtype_to_np_dtype(dtype))
        out = self.fresh("c")
        self.nodes.append(helper.make_node("Constant", [], [out], name=self.fresh("n_Constant"),
                                           value=numpy_helper.from_array(arr, out)))
        return out

    def i64(self, *values) -> str:
        return self.const(np.array(values, np.int64), TensorProto.INT64)

    def cast(self, x: str, src: int, dst: int) -> str:
        return x if src == dst else self.op("Cast", x, to=dst)

    def reshape(self, x: str, *shape) -> str:
        """Reshape to ints; 0 copies the input's dim at the same index."""
        return self.op("Reshape", x, self.i64(*shape))

    def dims(self, x: str, start: int, end: int) -> str:
        """The 1-D int64 tensor Shape(x)[start:end]."""
        return self.op("Shape", x, start=start, end=end)

    def scalar_dim(self, x: str, axis: int) -> str:
        return self.op("Squeeze", self.dims(x, axis, axis + 1), self.i64(0))


# ---------------------------------------------------------------------------
# The DCMHA function body
# ---------------------------------------------------------------------------

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


class _Body:
    def __init__(self, cfg: ref.Config, call: CallSpec, dtype: str, widths: Tuple[int, int, int],
                 weights: Sequence[str], compose_nodes: bool = False):
        self.cfg, self.call = cfg, call
        self.compose_nodes = compose_nodes
        self.ft = DTYPES[dtype]
        self.D_q, self.D_kv, self.D_out = widths
        self.e = Emitter()
        self.w = {n: n for n in weights}
        self.dtype = dtype
        # q (B, N, T, d) and k (B, N_kv, S, d) heads first, instead of (B, T, N, d) and
        # (B, S, N_kv, d): a forward self-attention call's RoPE straight from the fused
        # projection's output (``fused_projections``, ``_rope_heads``)
        self.heads_first = bool(compose_nodes and call.self_attention and not call.decode
                                and not cfg.qk_norm and cfg.rope_max_wavelength is not None)
        # the dynamic weights' type (``dynamic``): float32 where only kernel nodes, which
        # take float32, read them (one Cast per kind, not one per slot), else the dtype
        self.dyn_type = TensorProto.FLOAT if compose_nodes and not call.intermediates else self.ft

    # -- elementwise pieces ------------------------------------------------
    def c(self, value, dtype=None):
        return self.e.const(value, self.ft if dtype is None else dtype)

    def gelu(self, x):
        e = self.e
        if self.cfg.gelu_approximate:
            # 0.5 x (1 + tanh(u)) == x / (1 + exp(-2u)): onnxruntime's Exp is accurate to
            # ~1 ulp while its Tanh is ~4 ulp, which the RMS-normalised w1 amplifies.
            x3 = e.op("Mul", e.op("Mul", x, x), x)
            u2 = e.op("Mul", e.op("Add", x, e.op("Mul", x3, self.c(0.044715))),
                      self.c(-2.0 * math.sqrt(2.0 / math.pi)))
            return e.op("Div", x, e.op("Add", e.op("Exp", u2), self.c(1.0)))
        t = e.op("Erf", e.op("Mul", x, self.c(1.0 / math.sqrt(2.0))))
        return e.op("Mul", e.op("Mul", x, self.c(0.5)), e.op("Add", t, self.c(1.0)))

    def rms(self, x, eps, out_type=None):
        """x / sqrt(mean(x**2, -1) + eps), in float32 (x**2 may overflow float16); the
        result in out_type (default: the dtype)."""
        e, F = self.e, TensorProto.FLOAT
        x32 = e.cast(x, self.ft, F)
        ms = e.op("ReduceMean", e.op("Mul", x32, x32), e.i64(-1), keepdims=1)
        y = e.op("Div", x32, e.op("Sqrt", e.op("Add", ms, self.c(eps, F))))
        return e.cast(y, F, self.ft if out_type is None else out_type)

    def rope(self, x, positions):
        """Rotate-half RoPE of x (B, L, H, d) at int64 positions (L,); angles in float64.
        With kernel nodes (``compose_nodes``) one ``dcmha.Rope`` / ``Rope16`` node
        (``rope_function``), else its plain ops."""
        cfg, inv = self.cfg, self._inv_freq()
        if self.compose_nodes:
            return self.e.op(ROPE_OPS[self.dtype], x, positions, inv, domain=DOMAIN)
        return _rope_ops(self.e, x, positions, inv, self.e.i64(cfg.d // 2), self.e.i64(cfg.d),
                         self.ft)

    def _inv_freq(self):
        """RoPE's inverse frequencies (d/2,), a float64 constant."""
        cfg = self.cfg
        return self.e.const(cfg.rope_max_wavelength ** (-np.arange(cfg.d // 2, dtype=np.float64)
                                                        * 2.0 / cfg.d), TensorProto.DOUBLE)

    def _rope_heads(self, y, positions):
        """(q (B, N, L, d), k (B, N_kv, L, d)): the query and key heads of a projection's
        output y (B, L, W) (its first (N + N_kv) d columns) after RoPE, heads first, as one
        ``dcmha.RopeHeads`` / ``RopeHeads16`` node (``rope_heads_function``)."""
        cfg, e = self.cfg, self.e
        return e.op(ROPE_HEADS_OPS[self.dtype], y, positions, self._inv_freq(),
                    e.i64(cfg.N, cfg.N_kv), domain=DOMAIN, outputs=2)

    # -- projections -------------------------------------------------------
    def project(self, x, kernel, bias, D, H, hd):
        e = self.e
        y = e.op("MatMul", x, e.reshape(kernel, D, H * hd))
        if bias is not None:
            y = e.op("Add", y, e.reshape(bias, H * hd))
        return e.reshape(y, 0, 0, H, hd)                                     # (B, L, H, hd)

    def fused_projections(self, x):
        """Every projection of the single input x (B, L, D) of a self-attention call as one
        MatMul (onnxruntime folds the concatenated kernel at load): q and k as one
        (B, L, N + N_kv, d) tensor after QK-norm and RoPE (one pass for both), v
        (B, L, N_kv, d_v), and x's products with dw1 / dd for ``dynamic``.

        Returns (q, k, v, positions (L,), {"dw1", "dd"}).
        """
        e, cfg, w = self.e, self.cfg, self.w
        N, N_kv, d, d_v, G, M, K = cfg.N, cfg.N_kv, cfg.d, cfg.d_v, cfg.G, cfg.M, cfg.K
        C, D = len(ref.slots(cfg)), self.D_q
        parts = [("qk", [("query", N * d), ("key", N_kv * d)]), ("v", [("value", N_kv * d_v)])]
        if C and cfg.dynamic_projection:
            parts.append(("dw1", [("dw1", G * C * K)]))
        if C and cfg.dynamic_gating:
            parts.append(("dd", [("dd", G * C * M)]))
        kernels, biases, sizes = [], [], []
        for _, members in parts:
            for name, width in members:
                kernels.append(e.reshape(w[name if name in ("dw1", "dd") else name + "_kernel"],
                                         D, width))
                if cfg.use_bias:
                    biases.append(e.reshape(w[name + "_bias"], width) if name + "_bias" in w
                                  else self.c(np.zeros(width)))
            sizes.append(sum(width for _, width in members))
        y = e.op("MatMul", x, e.op("Concat", *kernels, axis=1))
        if biases:
            y = e.op("Add", y, e.op("Concat", *biases, axis=0))
        # with ``heads_first``, RoPE reads q | k straight from y (``_rope_heads``): the other
        # parts are sliced out of y, the q | k part is left in place
        heads = self.heads_first
        if heads:
            ends = np.cumsum(sizes)
            outs = {n: e.op("Slice", y, e.i64(int(end - size)), e.i64(int(end)), e.i64(-1))
                    for (n, _), size, end in zip(parts, sizes, ends) if n != "qk"}
        else:
            outs = dict(zip([n for n, _ in parts], e.op("Split", y, e.i64(*sizes), axis=-1,
                                                       outputs=len(parts))
                            if len(parts) > 1 else [y]))
        qk = None if heads else e.reshape(outs["qk"], 0, 0, N + N_kv, d)
        if cfg.qk_norm:
            scale = e.op("Concat", *[e.op("Expand", e.op("Unsqueeze", w[n], e.i64(0)), e.i64(H, d))
                                     for n, H in (("query_norm_scale", N), ("key_norm_scale", N_kv))],
                         axis=0)                                             # (N + N_kv, d)
            qk = e.op("Mul", self.rms(qk, ref.QK_NORM_EPS), scale)
        T = e.scalar_dim(x, 1)
        one = e.const(1, TensorProto.INT64)
        if self.call.decode:
            positions = e.op("Range", "cache_update_index", e.op("Add", "cache_update_index", T), one)
        else:
            positions = e.op("Range", e.const(0, TensorProto.INT64), T, one)
        if heads:
            q, k = self._rope_heads(y, positions)
        else:
            if cfg.rope_max_wavelength is not None:
                qk = self.rope(qk, positions)
            q, k = e.op("Split", qk, e.i64(N, N_kv), axis=2, outputs=2)
        return q, k, e.reshape(outs["v"], 0, 0, N_kv, d_v), positions, outs

    def unstack(self, x, axis, num):
        """The ``num`` slices of x along ``axis`` (that axis dropped): one Gather each."""
        return [self.e.op("Gather", x, self.e.const(j, TensorProto.INT64), axis=axis)
                for j in range(num)]

    def dynamic(self, x, D, prefix, names, pick=None, pre=None, packed=None):
        """Dynamic weights of slots ``names`` from x (B, L, D): {slot: {"w1","w2","dd"}}.

        ``pick`` selects (by index) a subset of the projection's C slots, for a
        self-attention layer whose query and key inputs are different tensors.
        ``pre`` holds x's products with the dw1 / dd kernels where the caller made
        them (``fused_projections``). ``packed`` (slots of ``names``): their weights
        come stacked as the decode cache holds them (``spec.terms.KEY_CACHE``), made
        from the projection's output in a few nodes instead of one per slot and weight;
        returns (weights of the other slots, {"key_w", "key_dd"}).
        """
        pre = pre or {}
        e, cfg = self.e, self.cfg
        G, M, R, K = cfg.G, cfg.M, cfg.R, cfg.K
        C = len(names) if pick is None else len(ref.slots(cfg))
        out = {s: {} for s in names if s not in (packed or ())}
        entries = {}
        if not names:
            return out if packed is None else (out, entries)
        at = e.i64(*[names.index(s) for s in packed]) if packed else None
        sel = e.i64(*pick) if pick is not None else None
        Cs = len(names)
        if cfg.dynamic_projection:
            dw1, qkw = self.w[prefix + "dw1"], self.w[prefix + "qkw"]
            if sel is not None:
                dw1 = e.op("Gather", dw1, sel, axis=2)
                qkw = e.op("Gather", qkw, sel, axis=1)
            h = pre.get("dw1") or e.op("MatMul", x, e.reshape(dw1, D, G * Cs * K))
            h = self.gelu(h)                                                 # (B, L, G*C*K)
            # the G*C (K, 2RM) maps as one block-diagonal (G*C*K, G*C*2RM) MatMul: one GEMM
            # instead of B*L*G*C tiny ones (onnxruntime folds the block matrix at load)
            # (made in float32: onnxruntime has no float16 Mul kernel to fold it with)
            F = TensorProto.FLOAT
            blocks = e.op("Mul", e.cast(e.reshape(qkw, G, Cs, K, 1, 1, 2 * R * M), self.ft, F),
                          self.c(np.eye(G * Cs).reshape(G, Cs, 1, G, Cs, 1), F))
            w = e.op("MatMul", h, e.cast(e.reshape(blocks, G * Cs * K, G * Cs * 2 * R * M), F, self.ft))
            w = e.reshape(w, 0, 0, G, Cs, 2 * R, M)
            w1 = self.rms(e.op("Slice", w, e.i64(0), e.i64(R), e.i64(4)), ref.W1_NORM_EPS,
                          self.dyn_type)
            w2 = e.cast(e.op("Slice", w, e.i64(R), e.i64(2 * R), e.i64(4)), self.ft, self.dyn_type)
            for c, s in enumerate(names):
                if s in out:
                    out[s]["w1"] = e.op("Gather", w1, e.const(c, TensorProto.INT64), axis=3)
                    out[s]["w2"] = e.op("Gather", w2, e.const(c, TensorProto.INT64), axis=3)
            if at is not None:   # (B, L, G, C, 2R, M) -> (B, L, C_k, 2, G, R, M) -> key_w
                both = e.op("Gather", e.op("Concat", w1, w2, axis=4), at, axis=3)
                both = e.op("Transpose", e.reshape(both, 0, 0, G, len(packed), 2, R, M),
                            perm=[0, 1, 3, 4, 2, 5, 6])
                entries["key_w"] = e.cast(e.reshape(both, 0, 0, 2 * len(packed), G, R, M),
                                          self.dyn_type, self.ft)   # the cache's type
        if cfg.dynamic_gating:
            dd = self.w[prefix + "dd"]
            if sel is not None:
                dd = e.reshape(e.op("Gather", e.reshape(dd, D, G, C, M), sel, axis=2), D, G * Cs * M)
            g = e.op("Tanh", pre.get("dd") or e.op("MatMul", x, e.reshape(dd, D, G * Cs * M)))
            g = e.cast(e.reshape(g, 0, 0, G, Cs, M), self.ft, self.dyn_type)
            for c, s in enumerate(names):
                if s in out:
                    out[s]["dd"] = e.op("Gather", g, e.const(c, TensorProto.INT64), axis=3)
            if at is not None:   # (B, L, G, C_k, M) -> key_dd (B, L, C_k, G, M)
                entries["key_dd"] = e.cast(e.op("Transpose", e.op("Gather", g, at, axis=3),
                                                 perm=[0, 1, 3, 2, 4]), self.dyn_type, self.ft)
        return out if packed is None else (out, entries)

    # -- compose -----------------------------------------------------------
    # Compose works on x in the layout (B, G, T, M, S). Per query position t
    # the query-side terms and the residual form one (M, M) matrix per group,
    #     Wq_t^T = I + static^T + qw2_t^T qw1_t + diag(qdd_t),
    # applied to the (M, S) slices by one batched MatMul; per key position s
    # the key-side terms form Wk_s = kw1_s^T kw2_s + diag(kdd_s), applied to
    # the (T, M) slices of the (B, G, S, T, M) view. This is reference.compose
    # in merged form (every term reads the input). The (T*M, S) <-> (S, T*M)
    # switch is written as a 2-D transpose between reshapes: onnxruntime
    # transposes that fast, and the reshapes stop its transpose optimiser
    # from fusing it with neighbours into a (T, M, S) -> (S, M, T) transpose,
    # which is ~30x slower. (Einsums were ~7x slower than all this.)

    def _merged(self, w1, w2, dd, static, residual, transposed):
        """(B, G, L, M, M) matrices [I] + [static] + w1^T w2 + diag(dd), or their transpose
        (``merged_matrix``), float32.

        w1, w2: (B, L, G, R, M); dd: (B, L, G, M); static: (G, M, M). None if empty.
        """
        e, F = self.e, TensorProto.FLOAT
        cast = lambda t: None if t is None else e.cast(t, self.ft, F)
        return merged_matrix(e, cast(w1), cast(w2), cast(dd), cast(static), residual, transposed,
                             self.c(np.eye(self.cfg.M), F))

    def _query_matrix_node(self, q, static):
        """The per-query matrix Wq (B, G, L, M, M) of ``factors`` as one
        ``dcmha.QueryMatrix<W|D|S>`` node (``query_matrix_function``)."""
        e, F = self.e, TensorProto.FLOAT
        letters = ("W" if "w1" in q else "") + ("D" if "dd" in q else "") + (
            "S" if static is not None else "")
        terms = ([q["w1"], q["w2"]] if "w1" in q else []) + ([q["dd"]] if "dd" in q else []) + (
            [static] if static is not None else [])
        types = [self.dyn_type] * (len(terms) - (static is not None)) + [self.ft]   # static: a weight
        return e.op("QueryMatrix" + letters, *[e.cast(t, ty, F) for t, ty in zip(terms, types)],
                    domain=DOMAIN)

    def _key_side_low_rank(self, x, k):
        """The key-side terms applied to x (B, G, T, M, S) as they are (low rank + diagonal):

            out[t, n, s] = sum_r kw2[s, r, n] sum_m kw1[s, r, m] x[t, m, s] + kdd[s, n] x[t, n, s]

        by broadcasting along s, the last axis. A decode step has few queries, and the
        (S, M, M) matrices of the merged form would cost more than the step's scores.
        """
        e, F = self.e, TensorProto.FLOAT
        out = None
        if "w1" in k:
            def key_major(w):   # (B, S, G, R, M) -> (B, G, 1, R, M, S)
                return e.op("Unsqueeze", e.op("Transpose", e.cast(w, self.ft, F), perm=[0, 2, 3, 4, 1]),
                            e.i64(2))
            h = e.op("ReduceSum", e.op("Mul", e.op("Unsqueeze", x, e.i64(3)), key_major(k["w1"])),
                     e.i64(4), keepdims=1)                                    # (B, G, T, R, 1, S)
            out = e.op("ReduceSum", e.op("Mul", h, key_major(k["w2"])), e.i64(3), keepdims=0)
        if "dd" in k:       # (B, S, G, M) -> (B, G, 1, M, S)
            dd = e.op("Unsqueeze", e.op("Transpose", e.cast(k["dd"], self.ft, F), perm=[0, 2, 3, 1]),
                      e.i64(2))
            diag = e.op("Mul", x, dd)
            out = diag if out is None else e.op("Add", out, diag)
        return out

    def factors(self, qdyn, kdyn):
        """The two factors of each enabled compose stage, made once for every position:
        ({stage: (Wq (B, G, T, M, M), position axis)}, {stage: (Wk, position axis)}).

        Wq = I + static + query terms, transposed for Wq @ x (position axis None when
        only the static term is on: (G, 1, M, M)); Wk = the key terms (B, G, S, M, M), or,
        for a decode step, the key-side weights themselves ({"w1", "w2", "dd"}, axis 1)
        for ``_key_side_low_rank``. The chunks of ``attend_chunks`` slice them.
        """
        cfg = self.cfg
        qf, kf = {}, {}
        for stage in [s for s, on in (("pre", cfg.pre_compose), ("post", cfg.post_compose)) if on]:
            q = qdyn.get(stage + "_query", {})
            k = kdyn.get(stage + "_key", {})
            static = self.w["static_" + stage] if cfg.static_compose else None
            # The terms the spec makes of these weights: a term this translation does not
            # know (one added to spec.terms later) is refused, never silently dropped.
            unknown = sorted(set(spec_terms.stage_terms(stage, qdyn, kdyn, static))
                             - EXPORTED_TERMS)
            if unknown:
                raise NotImplementedError(
                    f"The ONNX exporter does not translate the compose terms {unknown} of "
                    f"the {stage} stage (it translates {sorted(EXPORTED_TERMS)}).")
            if q and self.compose_nodes:
                qf[stage] = (self._query_matrix_node(q, static), 2)
            elif q or static is not None:
                W = self._merged(q.get("w1"), q.get("w2"), q.get("dd"), static, True, True)
                if self.compose_nodes:   # static only: (G, 1, M, M) -> (1, G, 1, M, M)
                    W = self.e.op("Unsqueeze", W, self.e.i64(0))
                qf[stage] = (W, 2 if q else None)
            if k and self.compose_nodes:   # the key-side weights as they are, for Compose*
                kf[stage] = ({n: self.e.cast(x, self.dyn_type, TensorProto.FLOAT)
                              for n, x in k.items()}, 1)
            elif k:
                kf[stage] = (k, 1) if self.call.decode else (
                    self._merged(k.get("w1"), k.get("w2"), k.get("dd"), None, False, False), 2)
        return qf, kf

    def compose(self, x, stage, qf, kf, shapes, plus=None):
        """Compose x (B, G, T, M, S), float32, within each group (see reference.compose),
        with the stage's factors from ``factors``; ``plus`` (broadcastable) is added to
        the result in the same pass.

        shapes: int64 shape tensors "gtms" (B, G, T, M, S), "g_tm_s" (B, G, T*M, S),
        "g_s_tm" (B, G, S, T*M), "gstm" (B, G, S, T, M).
        """
        e = self.e
        if self.compose_nodes:
            return self._compose_node(x, stage, qf, kf, plus)
        terms = [e.op("MatMul", qf[stage][0], x) if stage in qf else x]   # else the residual alone
        Wk = kf[stage][0] if stage in kf else None
        if isinstance(Wk, dict):
            terms.append(self._key_side_low_rank(x, Wk))
        elif Wk is not None:
            xs = e.op("Transpose", e.op("Reshape", x, shapes["g_tm_s"]), perm=[0, 1, 3, 2])
            ks = e.op("MatMul", e.op("Reshape", xs, shapes["gstm"]), Wk)       # (B, G, S, T, M)
            ks = e.op("Transpose", e.op("Reshape", ks, shapes["g_s_tm"]), perm=[0, 1, 3, 2])
            terms.append(e.op("Reshape", ks, shapes["gtms"]))
        if plus is not None:
            terms.append(plus)
        return terms[0] if len(terms) == 1 else e.op("Sum", *terms)

    def _stage_inputs(self, stage, qf, kf):
        """(letters, inputs) of a compose stage's ``Compose<letters>`` node after x: Q the
        per-query matrix, K the key-side pair, D the key-side gating ("": the residual)."""
        Wk = kf[stage][0] if stage in kf else {}
        letters = ("Q" if stage in qf else "") + ("K" if "w1" in Wk else "") + ("D" if "dd" in Wk else "")
        inputs = ([qf[stage][0]] if stage in qf else []) + (
            [Wk["w1"], Wk["w2"]] if "w1" in Wk else []) + ([Wk["dd"]] if "dd" in Wk else [])
        return letters, inputs

    def _compose_node(self, x, stage, qf, kf, plus):
        """compose() as one ``dcmha.Compose<Q|K|D>`` node on x (B, N, T, S) (see
        ``compose_function``); ``plus`` is added after it."""
        letters, inputs = self._stage_inputs(stage, qf, kf)
        out = self.e.op("Compose" + letters, x, *inputs, domain=DOMAIN) if letters else x
        return out if plus is None else self.e.op("Add", out, plus)

    def _keeps_mask(self) -> bool:
        """Whether a masked call multiplies its probabilities by the 0/1 mask (``attend``):
        where a row can have no visible key (with an attention_mask, or a window over a
        separate key input), and for (B, N, T, S) outputs."""
        cfg, call = self.cfg, self.call
        empty_rows = call.attention_mask or (cfg.sliding_window is not None
                                             and not (call.self_attention or call.decode))
        return bool(empty_rows or call.return_attention_scores or call.intermediates)

    def _fuses_probs(self, qf, kf) -> bool:
        """Whether a masked block's probabilities are one ``Probs`` node (``_probs_node``):
        with kernel nodes, a stage with a term, and no 0/1 multiplier (``_keeps_mask``)."""
        return bool(self.compose_nodes and (qf or kf) and not self._keeps_mask())

    def _probs_node(self, x, bias, qf, kf, offsets=None):
        """The probabilities Compose_post(softmax(Compose_pre(x) + bias)) of scores x
        (B, N, T, S) as one ``dcmha.Probs<pre>_<post>`` node (``probs_function``); x is
        the factors' block at ``offsets`` (t0, s0: int64 scalars; None: 0, 0)."""
        e = self.e
        stages = [self._stage_inputs(s, qf, kf) if on else ("", [])
                  for s, on in (("pre", self.cfg.pre_compose), ("post", self.cfg.post_compose))]
        if offsets is None:
            offsets = (e.const(0, TensorProto.INT64), e.const(0, TensorProto.INT64))
        return e.op(f"Probs{stages[0][0]}_{stages[1][0]}", x, bias, *offsets, *stages[0][1],
                    *stages[1][1], domain=DOMAIN)

    # -- the call ----------------------------------------------------------
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

    # -- query chunks ------------------------------------------------------
    def attend_chunks(self, rows, cols, T, S, offset):
        """attend() over chunks of CHUNK queries, each on the keys it can see (B, T, N*d_v).

        An ONNX Loop over ceil(T / CHUNK) chunks (SPEC.md, "Query chunking"): a
        causal or windowed chunk reads only its visible key range (terms.key_range),
        so the big (B, N, t, s) tensors shrink to the visible block (about half the
        work at T = S) and stay in the CPU cache. Keys outside that range are masked
        for every query of the chunk: their probabilities are exactly 0 and compose
        mixes heads at one (t, s) only, so the result is that of the full block.
        A decode step is one block (no Loop: its few new tokens would pay the
        Loop's overhead for nothing) on the keys written so far.
        """
        e, cfg, call = self.e, self.cfg, self.call
        I64 = TensorProto.INT64
        if not (call.use_causal_mask or call.decode) and cfg.sliding_window is None:
            o, _ = self.attend(rows, cols, e.const(0, I64), S)   # every query sees every key
            return o
        if call.decode:
            return self._block(rows, cols, e.const(0, I64), T, S, offset)
        chunk = cfg.query_chunk_size or (KERNEL_CHUNK if self.compose_nodes else CHUNK)
        c = e.const(chunk, I64)
        trips = e.op("Div", e.op("Add", T, e.const(chunk - 1, I64)), c)
        B = e.dims(rows[0], 0, 1)
        acc0 = e.op("ConstantOfShape", e.op("Concat", B, e.i64(0, cfg.N * cfg.d_v), axis=0),
                    value=numpy_helper.from_array(np.zeros(1, helper.tensor_dtype_to_np_dtype(self.ft))))
        outer = self.e
        self.e = body = Emitter(prefix="chunk_")
        i, cond, acc = "chunk_i", "chunk_cond", "chunk_acc"
        t0 = body.op("Mul", i, c)
        o = self._block(rows, cols, t0, body.op("Min", body.op("Add", t0, c), T), S, offset)
        nodes = body.nodes + [
            helper.make_node("Identity", [cond], ["chunk_cond_out"], name="chunk_cond_id"),
            helper.make_node("Concat", [acc, o], ["chunk_acc_out"], name="chunk_acc_cat", axis=1)]
        graph = helper.make_graph(
            nodes, "query_chunk",
            [helper.make_tensor_value_info(i, I64, []),
             helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
             helper.make_tensor_value_info(acc, self.ft, None)],
            [helper.make_tensor_value_info("chunk_cond_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("chunk_acc_out", self.ft, None)])
        self.e = outer
        return outer.op("Loop", trips, "", acc0, body=graph)

    def kv_layouts(self, k, v):
        """(k (B, N_kv, S, d) float32, v (B, N_kv, S, d_v)) from k, v (B, S, N_kv, ...): the
        positions of both on axis 2, where a chunk's key range is a contiguous run per head."""
        e = self.e
        if not self.heads_first:
            k = e.op("Transpose", k, perm=[0, 2, 1, 3])
        return e.cast(k, self.ft, TensorProto.FLOAT), e.op("Transpose", v, perm=[0, 2, 1, 3])

    def _block(self, rows, cols, t0, t1, S, offset):
        """attend() of the queries [t0, t1) to the keys they can see (terms.key_range): the
        queries sit at absolute positions offset + t; S is the number of keys."""
        e, cfg, call = self.e, self.cfg, self.call
        I64 = TensorProto.INT64
        causal, window = call.use_causal_mask or call.decode, cfg.sliding_window
        s0, s1 = e.const(0, I64), S
        if causal:
            s1 = e.op("Min", S, e.op("Add", t1, offset))
        if window is not None:
            w = e.const(window, I64)
            s0 = e.op("Max", s0, e.op("Add", e.op("Sub", e.op("Add", t0, offset), w), e.const(1, I64)))
            if not causal:
                s1 = e.op("Min", S, e.op("Sub", e.op("Add", e.op("Add", t1, offset), w), e.const(1, I64)))
            # queries past the last key + window see none: keep one (masked) key, never
            # an empty block
            s0 = e.op("Min", s0, e.op("Sub", s1, e.const(1, I64)))
        tt = (e.op("Unsqueeze", t0, e.i64(0)), e.op("Unsqueeze", t1, e.i64(0)))
        ss = (e.op("Unsqueeze", s0, e.i64(0)), e.op("Unsqueeze", s1, e.i64(0)))

        def cut(x, lo_hi, axis):
            return e.op("Slice", x, lo_hi[0], lo_hi[1], e.i64(axis))

        def cut_factors(factors, lo_hi):
            out = {}
            for stage, (t, axis) in factors.items():
                if axis is not None:
                    t = ({n: cut(x, lo_hi, axis) for n, x in t.items()} if isinstance(t, dict)
                         else cut(t, lo_hi, axis))
                out[stage] = (t, axis)
            return out

        q, qf, q_pos, mask = rows
        k, v, kf = cols
        # a Probs node reads the block's part of the factors itself: they stay uncut
        fused = self._fuses_probs(qf, kf)
        offsets = (t0, s0) if fused else None
        cut_q = (lambda f: f) if fused else (lambda f: cut_factors(f, tt))
        cut_k = (lambda f: f) if fused else (lambda f: cut_factors(f, ss))
        if call.decode:   # one block of every query: only the keys are cut
            rows = (q, qf, q_pos, None if mask is None else cut(mask, ss, 2))
        else:
            rows = (cut(q, tt, 2 if self.heads_first else 1), cut_q(qf), cut(q_pos, tt, 0),
                    None if mask is None else cut(cut(mask, tt, 1), ss, 2))
        if call.decode and self.compose_nodes:   # the visible range heads first, one copy each
            # in float32 (a float16 cache widened in the same copy): the scores' and P.V's
            # MatMuls run in float32 on onnxruntime's CPU provider either way
            op = CACHE_OPS["float32"] if self.ft == TensorProto.FLOAT else CACHE_WIDEN_OP
            cols = (e.op(op, k, s0, s1, domain=DOMAIN), e.op(op, v, s0, s1, domain=DOMAIN),
                    cut_k(kf), TensorProto.FLOAT)                          # (B, N_kv, S, d)
        elif call.decode:
            cols = self.kv_layouts(cut(k, ss, 1), cut(v, ss, 1)) + (cut_k(kf),)
        else:
            cols = (cut(k, ss, 2), cut(v, ss, 2), cut_k(kf))
        o, _ = self.attend(rows, cols, s0, e.op("Sub", s1, s0), offsets)
        return o

    def attend(self, rows, cols, s0, S, offsets=None):
        """Attention of the queries ``rows`` to the keys ``cols`` at positions s0 + [0, S).
        ``offsets`` (t0, s0): where the block lies in the query and key factors, which
        are then uncut (for ``_probs_node``); None: the factors are the block's.

        rows: (q (B, T, N, d), or (B, N, T, d) with ``heads_first``, the query factors
        (``factors``), absolute query positions
        (T,), attention_mask (B, T, S) or None); cols: (k (B, N_kv, S, d) float32,
        v (B, N_kv, S, d_v), the key factors[, v's type when it is not the dtype]).
        Returns (o (B, T, N*d_v), {"scores", "pre_composed", "probs", "attention_scores"}).
        """
        e, cfg, call, ft = self.e, self.cfg, self.call, self.ft
        F, I64 = TensorProto.FLOAT, TensorProto.INT64
        N, N_kv, d, d_v, G, M = cfg.N, cfg.N_kv, cfg.d, cfg.d_v, cfg.G, cfg.M
        q, qf, q_pos, mask = rows
        k, v, kf = cols[:3]
        outputs: Dict[str, str] = {}

        # mask (T, S) or (B, T, S), True = attend; None when nothing is masked
        causal = call.use_causal_mask or call.decode
        geometric = None
        if causal or cfg.sliding_window is not None:
            t = e.op("Unsqueeze", q_pos, e.i64(1))                                   # (T, 1)
            s = e.op("Unsqueeze", e.op("Range", s0, e.op("Add", s0, S), e.const(1, I64)),
                     e.i64(0))                                                       # (1, S)
            if causal:
                geometric = e.op("LessOrEqual", s, t)
            if cfg.sliding_window is not None:
                band = e.op("Less", e.op("Abs", e.op("Sub", t, s)), e.const(cfg.sliding_window, I64))
                geometric = band if geometric is None else e.op("And", geometric, band)
        if geometric is not None:
            geometric = e.op("Unsqueeze", geometric, e.i64(0))
            mask = geometric if mask is None else e.op("And", mask, geometric)

        # scores in float32. GQA: query head h reads kv head h // rep; the query heads are
        # grouped as (N_kv, rep) so that MatMul broadcasts k and v instead of copying them.
        rep = N // N_kv
        q32 = e.cast(q if self.heads_first else e.op("Transpose", q, perm=[0, 2, 1, 3]), ft, F)
        # (B, N, T, d)
        # k (B, N_kv, S, d) transposed right at the MatMul: onnxruntime folds the transpose
        # into the product (FusedMatMul, transB) instead of copying k
        if rep == 1:
            a = e.op("MatMul", q32, e.op("Transpose", k, perm=[0, 1, 3, 2]))        # (B, N, T, S)
        else:
            a = e.op("MatMul", e.reshape(q32, 0, N_kv, rep, -1, d),
                     e.op("Transpose", e.op("Unsqueeze", k, e.i64(2)), perm=[0, 1, 2, 4, 3]))
            # (B, N_kv, rep, T, S)
            a = e.op("Reshape", a, e.op("Concat", e.dims(a, 0, 1), e.i64(N), e.dims(a, 3, 5), axis=0))
        a = e.op("Mul", a, self.c(1.0 / math.sqrt(d), F))                            # (B, N, T, S)
        outputs["scores"] = a
        bnts = e.op("Shape", a)
        # the plain-op compose works on (B, G, T, M, S); Compose* nodes on (B, N, T, S)
        composing = (cfg.pre_compose or cfg.post_compose) and not self.compose_nodes

        shapes = {}
        if composing:
            B1, TS = e.dims(a, 0, 1), e.dims(a, 2, 4)
            T1, S1 = e.dims(a, 2, 3), e.dims(a, 3, 4)
            TM = e.op("Mul", T1, e.i64(M))
            shapes = {"gmts": e.op("Concat", B1, e.i64(G, M), TS, axis=0),
                      "gtms": e.op("Concat", B1, e.i64(G), T1, e.i64(M), S1, axis=0),
                      "g_tm_s": e.op("Concat", B1, e.i64(G), TM, S1, axis=0),
                      "g_s_tm": e.op("Concat", B1, e.i64(G), S1, TM, axis=0),
                      "gstm": e.op("Concat", B1, e.i64(G), S1, T1, e.i64(M), axis=0)}

        def to_gtms(t):   # (B, N, T, S) -> (B, G, T, M, S)
            return e.op("Transpose", e.op("Reshape", t, shapes["gmts"]), perm=[0, 1, 3, 2, 4])

        def to_bnts(t):   # (B, G, T, M, S) -> (B, N, T, S)
            return e.op("Reshape", e.op("Transpose", t, perm=[0, 1, 3, 2, 4]), bnts) if composing else t

        # The mask enters the big (B, N, T, S) tensors as two float factors made on
        # the small (B|1, T, S) mask: a bias added before the softmax (0 or
        # MASKED_SCORE: a + MASKED_SCORE == MASKED_SCORE for any real score) and a
        # 0/1 multiplier after it. onnxruntime's broadcasting Where is ~10x slower
        # than Add / Mul on these tensors (it was a third of the layer's time).
        # In a row with a visible key, exp(MASKED_SCORE - max) underflows to exactly 0
        # in float32 and compose mixes heads at one (t, s) only, so the multiplier is
        # needed only where a row can have no visible key (its softmax is uniform):
        # with an attention_mask, or a window over a separate key input.
        bias = keep = None
        if mask is not None:   # (B|1, T, S) -> (B|1, 1, T, 1, S) or (B|1, 1, T, S)
            mask = e.op("Unsqueeze", mask, e.i64(1, 3) if composing else e.i64(1))
            bias = e.op("Mul", e.op("Cast", e.op("Not", mask), to=F), self.c(MASKED_SCORE, F))
            if self._keeps_mask():
                keep = e.op("Cast", mask, to=F)
        if composing:
            a = to_gtms(a)
        fused = None
        if bias is not None and self._fuses_probs(qf, kf):   # compose, softmax, compose
            fused = self._probs_node(a, bias, qf, kf, offsets)
        elif offsets is not None:   # uncut factors reach only a Probs node (``_block``)
            raise AssertionError("a block with uncut factors must become a Probs node")
        if fused is not None:
            p = fused
        elif cfg.pre_compose and not call.intermediates:   # the mask bias in compose's last pass
            a = self.compose(a, "pre", qf, kf, shapes, plus=bias)
        else:
            if cfg.pre_compose:
                a = self.compose(a, "pre", qf, kf, shapes)
            if call.intermediates:
                outputs["pre_composed"] = to_bnts(a)
            if bias is not None:
                a = e.op("Add", a, bias)
        if fused is None:
            p = e.op("Softmax", a, axis=-1)
            if call.intermediates:
                outputs["probs"] = to_bnts(p if keep is None else e.op("Mul", p, keep))
            if cfg.post_compose:
                p = self.compose(p, "post", qf, kf, shapes)
        if keep is not None:
            # masked entries (and fully masked rows, whose softmax is uniform) become
            # exactly 0: p is finite, and p * 0 == 0, p * 1 == p
            p = e.op("Mul", p, keep)
        p = to_bnts(p)                                                               # (B, N, T, S)
        outputs["attention_scores"] = p
        # the probabilities leave float32 only for P.V (as in the Keras layer); with v in
        # float32 (``cols``' optional 4th entry: v's type), rounded to the dtype and back
        vh, v_type = v, (cols[3] if len(cols) > 3 else ft)                           # (B, N_kv, S, d_v)
        pc = e.cast(e.cast(p, F, ft), ft, v_type)
        if rep == 1:
            o = e.op("MatMul", pc, vh)                                               # (B, N, T, d_v)
        else:
            p5 = e.op("Reshape", pc, e.op("Concat", e.dims(pc, 0, 1), e.i64(N_kv, rep),
                                          e.dims(pc, 2, 4), axis=0))
            o = e.reshape(e.op("MatMul", p5, e.op("Unsqueeze", vh, e.i64(2))), 0, N, -1, d_v)
        o = e.op("Transpose", e.cast(o, v_type, ft), perm=[0, 2, 1, 3])             # (B, T, N, d_v)
        return e.reshape(o, 0, 0, N * d_v), outputs

def compose_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function ``dcmha.Compose<Q|K|D...>`` (``_Body._compose_node``): compose
    x (B, N, T, S), float32, within each group, in plain ops.

    Inputs, in this order, each only where its letter is in the name: x; Q: wq (B|1, G,
    T|1, M, M), out[n] = sum_m wq[n, m] x[m] (residual and static terms included; without
    Q the residual x); K: kw1, kw2 (B, S, G, R, M); D: kdd (B, S, G, M) (the layout of the
    dynamic weights and the decode cache). onnxruntime runs the compiled kernel instead
    where ``dcmha.export.ort_ops`` is registered.
    """
    if name not in COMPOSE_OPS:
        raise ValueError(f"Not a Compose op name: {name!r} (expected Compose followed by Q, K, "
                         f"D in that order, e.g. 'ComposeQKD').")
    letters = name[len("Compose"):]
    e = Emitter()
    ins = ["x"] + _compose_inputs(letters)
    g_axis = 1 if "Q" in letters else 2          # wq (B, G, ...); kw1, kdd (B, S, G, ...)
    G = e.dims(ins[1], g_axis, g_axis + 1)
    x5 = e.op("Transpose", e.op("Reshape", "x", e.op("Concat", e.dims("x", 0, 1), G, e.i64(-1),
                                                      e.dims("x", 2, 4), axis=0)),
              perm=[0, 1, 3, 2, 4])                                           # (B, G, T, M, S)
    terms = [e.op("MatMul", "wq", x5) if "Q" in letters else x5]

    def key_major(w, perm):   # (B, S, G, ...) -> (B, G, 1, ..., S)
        return e.op("Unsqueeze", e.op("Transpose", w, perm=perm), e.i64(2))
    if "K" in letters:   # sum_r kw2[s, r, n] sum_m kw1[s, r, m] x[t, m, s]
        h = e.op("ReduceSum", e.op("Mul", e.op("Unsqueeze", x5, e.i64(3)),
                                   key_major("kw1", [0, 2, 3, 4, 1])), e.i64(4), keepdims=1)
        terms.append(e.op("ReduceSum", e.op("Mul", h, key_major("kw2", [0, 2, 3, 4, 1])),
                          e.i64(3), keepdims=0))                              # (B, G, T, M, S)
    if "D" in letters:
        terms.append(e.op("Mul", x5, key_major("kdd", [0, 2, 3, 1])))
    out = terms[0] if len(terms) == 1 else e.op("Sum", *terms)
    e.nodes.append(helper.make_node("Reshape", [e.op("Transpose", out, perm=[0, 1, 3, 2, 4]),
                                                e.op("Shape", "x")], ["out"], name="out_reshape"))
    return helper.make_function(DOMAIN, name, ins, ["out"], e.nodes,
                                [helper.make_opsetid("", check_opset(opset))],
                                doc_string=compose_function.__doc__.split("\n\n")[1].strip())


def _compose_inputs(letters: str, prefix: str = "") -> List[str]:
    """The inputs of ``Compose<letters>`` after x, in order (``compose_function``)."""
    return [prefix + n for n, on in (("wq", "Q" in letters), ("kw1", "K" in letters),
                                     ("kw2", "K" in letters), ("kdd", "D" in letters)) if on]


def probs_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function ``dcmha.Probs<pre>_<post>`` (``_Body._probs_node``): attention
    probabilities from scores, Compose_post(softmax(Compose_pre(x) + bias)).

    Inputs: x (B, N, T, S) float32, the block of queries [t0, t0 + T) and keys [s0, s0 + S);
    bias (B|1, 1, T, S), the mask's 0 / MASKED_SCORE; t0, s0: int64 scalars; then each
    stage's Compose inputs after x (``compose_function``), named pre_* / post_*, for every
    query and key: wq (B|1, G, T_q|1, M, M) (T_q >= t0 + T), kw1, kw2 (B, S_k, G, R, M) and
    kdd (B, S_k, G, M) (S_k >= s0 + S). A stage named by no letter is the identity. The body calls the ``Compose*`` functions, so a
    model with this function carries those too; onnxruntime runs the compiled op where
    ``dcmha.export.ort_ops`` is registered (one pass over a few query rows at a time).
    """
    if name not in PROBS_OPS:
        raise ValueError(f"Not a Probs op name: {name!r} (expected Probs<pre>_<post>, each "
                         f"stage one of {list(STAGE_LETTERS)}, not both empty).")
    pre, post = name[len("Probs"):].split("_")
    ins = ["x", "bias", "t0", "s0"] + _compose_inputs(pre, "pre_") + _compose_inputs(post, "post_")
    e = Emitter()
    T, S = e.dims("x", 2, 3), e.dims("x", 3, 4)
    t0, s0 = e.op("Unsqueeze", "t0", e.i64(0)), e.op("Unsqueeze", "s0", e.i64(0))

    def block(term):   # the term's part for x's block: rows [t0, t0 + T), keys [s0, s0 + S)
        if term.endswith("wq"):   # a row axis of 1 (broadcast) stays
            start = e.op("Min", t0, e.op("Sub", e.dims(term, 2, 3), e.i64(1)))
            return e.op("Slice", term, start, e.op("Add", start, T), e.i64(2))
        return e.op("Slice", term, s0, e.op("Add", s0, S), e.i64(1))
    y = "x"
    if pre:
        y = e.op("Compose" + pre, "x", *map(block, _compose_inputs(pre, "pre_")), domain=DOMAIN)
    p = e.op("Softmax", e.op("Add", y, "bias"), axis=-1)
    if post:
        p = e.op("Compose" + post, p, *map(block, _compose_inputs(post, "post_")), domain=DOMAIN)
    rename_value(e.nodes, p, "out")
    return helper.make_function(DOMAIN, name, ins, ["out"], e.nodes,
                                [helper.make_opsetid("", check_opset(opset)),
                                 helper.make_opsetid(DOMAIN, 1)],
                                doc_string=probs_function.__doc__.split("\n\n")[0].split(":", 1)[1].strip())


def cache_heads_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function ``dcmha.CacheHeads`` (float32) / ``CacheHeads16`` (float16) /
    ``CacheHeads16F`` (a float16 cache, float32 out): (cache (B, S_max, H, d), start, stop:
    int64 scalars) -> the cache's positions [start, stop) heads first, (B, H, stop - start,
    d). A decode step's Slice and Transpose (and Cast) of its key / value cache, which the
    compiled op does in one copy."""
    if name not in CACHE_HEADS_OPS:
        raise ValueError(f"Not a CacheHeads op name: {name!r} (expected one of "
                         f"{sorted(CACHE_HEADS_OPS)}).")
    e = Emitter()
    part = e.op("Slice", "cache", e.op("Unsqueeze", "start", e.i64(0)),
                e.op("Unsqueeze", "stop", e.i64(0)), e.i64(1))
    out = e.op("Transpose", part, perm=[0, 2, 1, 3])
    if name == CACHE_WIDEN_OP:
        out = e.op("Cast", out, to=TensorProto.FLOAT)
    rename_value(e.nodes, out, "out")
    return helper.make_function(DOMAIN, name, ["cache", "start", "stop"], ["out"], e.nodes,
                                [helper.make_opsetid("", check_opset(opset))],
                                doc_string=cache_heads_function.__doc__.split(":", 1)[1].strip())


def merged_matrix(e: "Emitter", w1, w2, dd, static, residual: bool, transposed: bool,
                  eye: str) -> Optional[str]:
    """(B, G, L, M, M) matrices [I] + [static] + w1^T w2 + diag(dd), or their transpose,
    in plain ops; None if every term is absent.

    w1, w2: (B, L, G, R, M); dd: (B, L, G, M); static: (G, M, M); each float32 or None.
    eye: the (M, M) float32 identity. Transposed, W[n, m] = [n == m] (1 + dd[n])
    + sum_r w1[r, m] w2[r, n] + static[g, m, n] with the residual: the query factor.
    """
    W = None
    if w1 is not None:
        left, right = (w2, w1) if transposed else (w1, w2)
        W = e.op("MatMul", e.op("Transpose", left, perm=[0, 2, 1, 4, 3]),    # (B, G, L, M, R)
                 e.op("Transpose", right, perm=[0, 2, 1, 3, 4]))             # (B, G, L, R, M)
    dmat = None
    if dd is not None:
        diag = e.op("Transpose", dd, perm=[0, 2, 1, 3])                      # (B, G, L, M)
        if residual:
            diag = e.op("Add", diag, e.const(1.0, TensorProto.FLOAT))
        dmat = e.op("Mul", e.op("Unsqueeze", diag, e.i64(-1)), eye)
    elif residual:
        dmat = eye
    if dmat is not None:
        W = dmat if W is None else e.op("Add", W, dmat)
    if static is not None:   # (G, M, M) -> (G, 1, M, M), shared by every position
        st = e.op("Transpose", static, perm=[0, 2, 1]) if transposed else static
        st = e.op("Unsqueeze", st, e.i64(1))
        W = st if W is None else e.op("Add", W, st)
    return W


def query_matrix_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function ``dcmha.QueryMatrix<W|D|S>`` (``_Body._query_matrix_node``): the
    per-query matrix wq (B, G, T, M, M) of a Compose node's Q input from the spec's
    query-side terms, each input only where its letter is in the name: W: qw1, qw2
    (B, T, G, R, M); D: qdd (B, T, G, M); S: static (G, M, M); all float32.
    wq[n, m] = [n == m] (1 + qdd[n]) + sum_r qw1[r, m] qw2[r, n] + static[g, m, n]."""
    if name not in QUERY_OPS:
        raise ValueError(f"Not a QueryMatrix op name: {name!r} (expected one of {list(QUERY_OPS)}).")
    letters = name[len("QueryMatrix"):]
    ins = (["qw1", "qw2"] if "W" in letters else []) + (["qdd"] if "D" in letters else []) + (
        ["static"] if "S" in letters else [])
    e = Emitter()
    M = e.op("Shape", ins[0], start=-1)
    eye = e.op("EyeLike", e.op("ConstantOfShape", e.op("Concat", M, M, axis=0),
                               value=numpy_helper.from_array(np.zeros(1, np.float32))))
    out = merged_matrix(e, "qw1" if "W" in letters else None, "qw2" if "W" in letters else None,
                        "qdd" if "D" in letters else None, "static" if "S" in letters else None,
                        True, True, eye)
    rename_value(e.nodes, out, "wq")
    return helper.make_function(DOMAIN, name, ins, ["wq"], e.nodes,
                                [helper.make_opsetid("", check_opset(opset))],
                                doc_string=query_matrix_function.__doc__.split(":", 1)[1].strip())


def _rope_ops(e: "Emitter", x: str, positions: str, inv_freq: str, half: str, d: str,
              ft: int) -> str:
    """The rotate-half RoPE of x (B, L, H, d), type ft, at int64 positions (L,), with
    inv_freq (d/2,) float64, in plain ops: angles in float64, their cos and sin in ft.
    half, d: int64 (1,) tensors, d / 2 and d."""
    x1 = e.op("Slice", x, e.i64(0), half, e.i64(-1))
    x2 = e.op("Slice", x, half, d, e.i64(-1))
    pos = e.op("Unsqueeze", e.op("Cast", positions, to=TensorProto.DOUBLE), e.i64(1))
    angle = e.op("Mul", pos, e.op("Unsqueeze", inv_freq, e.i64(0)))               # (L, d/2)
    cos = e.op("Unsqueeze", e.op("Cast", e.op("Cos", angle), to=ft), e.i64(1))    # (L, 1, d/2)
    sin = e.op("Unsqueeze", e.op("Cast", e.op("Sin", angle), to=ft), e.i64(1))
    return e.op("Concat", e.op("Sub", e.op("Mul", x1, cos), e.op("Mul", x2, sin)),
                e.op("Add", e.op("Mul", x2, cos), e.op("Mul", x1, sin)), axis=-1)


def rope_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function ``dcmha.Rope`` (float32) / ``Rope16`` (float16): (x (B, L, H, d),
    positions (L,) int64, inv_freq (d/2,) float64) -> the rotate-half RoPE of x, with the
    angles positions[l] inv_freq[j] in float64 and their cos / sin in x's type. The
    compiled op keeps the cos / sin rows of the positions it has seen."""
    if name not in ROPE_OPS.values():
        raise ValueError(f"Not a Rope op name: {name!r} (expected one of "
                         f"{sorted(ROPE_OPS.values())}).")
    ft = DTYPES[next(k for k, v in ROPE_OPS.items() if v == name)]
    e = Emitter()
    d = e.op("Shape", "x", start=3, end=4)
    out = _rope_ops(e, "x", "positions", "inv_freq", e.op("Div", d, e.i64(2)), d, ft)
    rename_value(e.nodes, out, "out")
    return helper.make_function(DOMAIN, name, ["x", "positions", "inv_freq"], ["out"], e.nodes,
                                [helper.make_opsetid("", check_opset(opset))],
                                doc_string=rope_function.__doc__.split(":", 1)[1].strip())


def rope_heads_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function ``dcmha.RopeHeads`` (float32) / ``RopeHeads16`` (float16): (y
    (B, L, W), positions (L,) int64, inv_freq (d/2,) float64, heads (2,) int64 = (N, N_kv))
    -> (q (B, N, L, d), k (B, N_kv, L, d)): y's first (N + N_kv) d columns as N query then
    N_kv key heads of d, rotated as ``rope_function`` does, heads first."""
    if name not in ROPE_HEADS_OPS.values():
        raise ValueError(f"Not a RopeHeads op name: {name!r} (expected one of "
                         f"{sorted(ROPE_HEADS_OPS.values())}).")
    ft = DTYPES[next(k for k, v in ROPE_HEADS_OPS.items() if v == name)]
    e = Emitter()
    half = e.op("Shape", "inv_freq")
    d = e.op("Mul", half, e.i64(2))
    N, H = e.op("Slice", "heads", e.i64(0), e.i64(1)), e.op("ReduceSum", "heads", keepdims=1)
    qk = e.op("Slice", "y", e.i64(0), e.op("Mul", H, d), e.i64(2))
    qk = e.op("Reshape", qk, e.op("Concat", e.dims("y", 0, 2), H, d, axis=0))    # (B, L, H, d)
    rotated = _rope_ops(e, qk, "positions", "inv_freq", half, d, ft)
    for out, lo, hi in (("q", e.i64(0), N), ("k", N, H)):
        e.nodes.append(helper.make_node(
            "Transpose", [e.op("Slice", rotated, lo, hi, e.i64(2))], [out], name="out_" + out,
            perm=[0, 2, 1, 3]))
    return helper.make_function(DOMAIN, name, ["y", "positions", "inv_freq", "heads"], ["q", "k"],
                                e.nodes, [helper.make_opsetid("", check_opset(opset))],
                                doc_string=rope_heads_function.__doc__.split(":", 1)[1].strip())


def kernel_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function of one of ``KERNEL_OPS``."""
    if name in ROPE_OPS.values():
        return rope_function(name, opset)
    if name in ROPE_HEADS_OPS.values():
        return rope_heads_function(name, opset)
    if name in QUERY_OPS:
        return query_matrix_function(name, opset)
    if name in PROBS_OPS:
        return probs_function(name, opset)
    if name in CACHE_HEADS_OPS:
        return cache_heads_function(name, opset)
    return compose_function(name, opset)


def kernel_ops_used(nodes: Sequence[onnx.NodeProto]) -> List[str]:
    """The ``KERNEL_OPS`` that ``nodes`` (and their subgraphs) call, sorted."""
    found = set()

    def visit(ns):
        for node in ns:
            if node.domain == DOMAIN and node.op_type in KERNEL_OPS:
                found.add(node.op_type)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g.node)
    visit(nodes)
    return sorted(found)


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


# ---------------------------------------------------------------------------
# Graph assembly
# ---------------------------------------------------------------------------

def rename_value(nodes: Sequence[onnx.NodeProto], old: str, new: str) -> bool:
    """Rename the value ``old`` to ``new`` where ``nodes`` produce and read it (in
    subgraphs too). False, changing nothing, when no node of ``nodes`` produces it."""
    producer = next((n for n in nodes if old in n.output), None)
    if producer is None:
        return False
    producer.output[list(producer.output).index(old)] = new

    def visit(ns):
        for node in ns:
            for i, x in enumerate(node.input):
                if x == old:
                    node.input[i] = new
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g.node)
    visit(nodes)
    return True


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


# ---------------------------------------------------------------------------
# Checking, saving and running
# ---------------------------------------------------------------------------

def check_model(model: onnx.ModelProto) -> None:
    """onnx.checker with full_check (strict shape inference through the functions)."""
    onnx.checker.check_model(model, full_check=True)


def session(model_or_path, *, threads: Optional[int] = None, spinning: bool = False,
            compose_kernel: bool = True):
    """An onnxruntime CPU session with every graph optimisation on (ORT_ENABLE_ALL).

    compose_kernel: for a graph with ``dcmha.Compose*`` nodes (exported with
    ``compose_nodes=True``), register the compiled compose kernel (``ort_ops``), built on
    first use; where it is unavailable (no compiler, ``DCMHA_CPU_KERNEL=0``; one
    ``KernelWarning`` says why) or with False, onnxruntime runs the nodes' plain-op bodies.

    threads: intra-op threads. Default: onnxruntime's (one per physical core), but 1
    for a decode graph (one with a ``cache_update_index`` input): a step's ops are
    so small that waking a second thread for each costs more than it saves.
    spinning: let idle intra-op threads spin-wait for work (onnxruntime's default).
    Off by default: spinning threads take the cores from everything else in the
    process and on the machine (a Keras backend, other sessions), which on a small
    machine slows a layer down more than the spin saves (``benchmarks/RESULTS.md, "onnxruntime on the exported graph"``).
    """
    import onnxruntime as ort
    model = model_or_path if isinstance(model_or_path, onnx.ModelProto) else onnx.load(
        str(model_or_path), load_external_data=False)
    if threads is None and any(i.name == "cache_update_index" for i in model.graph.input):
        threads = 1
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if compose_kernel and any(f.domain == DOMAIN and f.name in KERNEL_OPS
                              for f in model.functions):
        from dcmha.export import ort_ops
        ort_ops.register(so)
    src = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def output_target(path: Union[str, os.PathLike]) -> str:
    """The file that writing ``path`` replaces: ``path`` with every symlink resolved.

    A symlink at ``path`` is written through: its target gets the new content
    (and keeps the link), as when a program opens the link for writing. Raises
    ValueError when the target's folder does not exist or the target is a folder.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"`path` must be a str or os.PathLike. Received: {type(path).__name__}")
    path = os.fspath(path)
    target = os.path.realpath(path)
    if os.path.isdir(target):
        raise ValueError(f"`path` must be a file path, not a directory. Received: path={path!r}")
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise ValueError(f"`path` must be in an existing directory; {directory!r} does not exist. "
                         f"Received: path={path!r}")
    return target


def _new_file(directory: str, suffix: str) -> str:
    """A new empty file in ``directory`` with a random name, created with mode 0o666 so that
    the umask (and any default ACL) gives it the mode of any new file: no umask is read or
    changed (os.umask would change it process-wide for a moment, a race with other threads)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        name = os.path.join(directory, f".tmp-{os.urandom(8).hex()}{suffix}")
        try:
            os.close(os.open(name, flags, 0o666))
            return name
        except FileExistsError:
            continue
    raise FileExistsError(f"Could not create a temporary file in {directory!r}.")


@contextlib.contextmanager
def atomic_output(path: Union[str, os.PathLike], suffix: str = ".onnx"):
    """Yield a new temporary file beside ``path``'s target; when the block ends without an
    error, rename it onto the target, else remove it (the target is then untouched).

    The result keeps the mode of the file it replaces; a new file gets the mode
    that the umask gives any new file. A symlink at ``path`` is written through
    (see `output_target`).
    """
    target = output_target(path)
    tmp = _new_file(os.path.dirname(target), suffix)
    try:
        yield tmp
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = None
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def save_model(model: onnx.ModelProto, path: Union[str, os.PathLike], *, check_runtime: bool = True) -> str:
    """Write ``model`` to ``path`` atomically.

    The model goes to a temporary file beside the target; only after
    onnx.checker (full_check) passes and onnxruntime loads it with ORT_ENABLE_ALL
    is it renamed onto the target. On any failure the target is left untouched.
    An existing file keeps its mode; a symlink is written through to its target
    (see `atomic_output`). Returns ``path``.
    """
    with atomic_output(path) as tmp:
        onnx.save_model(model, tmp)
        onnx.checker.check_model(tmp, full_check=True)
        if check_runtime:
            session(tmp)
    return os.fspath(path)
