"""Conformance adapter "tf-xla": the XLA-compiled TensorFlow attention core.

The projections, QK-norm, RoPE, dynamic weights and output projection are plain
TensorFlow ops in float32 (mirroring ``spec/reference.py``); q, k, v and the
dynamic weights are then rounded to the case's dtype (what a mixed-precision
layer stores) and the attention itself is ``dcmha.backends.xla.dcmha_attention``
(one ``tf.function(jit_compile=True)``; scores, composition and softmax in
float32), which also returns the attention scores. O is kept in the compute dtype,
the output projection accumulates in float32 and its result is rounded to the
compute dtype. Gradients are ``tf.GradientTape`` through everything, around an
eager call of the compiled core.

TensorFlow and Triton abort when loaded into one process, so this adapter refuses
to run where ``triton`` is already imported (the conformance runner gives every
adapter its own process).

Not covered: "decode" (no cache path) and "intermediates" (the chunked core never
materialises the raw scores, pre-composed scores or probabilities).
"""

from __future__ import annotations

import sys
from typing import Dict, Mapping

import numpy as np

from dcmha.conformance.adapters.base import Adapter, call_inputs
from dcmha.spec import reference

_DTYPES = ("float32", "float16", "bfloat16")


def _refuse_triton() -> None:
    if "triton" in sys.modules:
        raise RuntimeError(
            "The tf-xla adapter refuses to run in a process where `triton` is imported: "
            "TensorFlow and Triton abort when loaded together. Run it in its own process "
            "(python -m dcmha.conformance --backend tf-xla).")


def _tf():
    _refuse_triton()
    import tensorflow as tf
    return tf


def _rms_normalize(tf, x, eps):
    return x * tf.math.rsqrt(tf.reduce_mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(tf, x, positions, max_wavelength):
    """Rotate-half RoPE of x (B, L, H, d) at positions (L,) (angles computed in float64)."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = max_wavelength ** (-np.arange(half, dtype=np.float64) * 2.0 / d)
    angle = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    cos = tf.constant(np.cos(angle)[None, :, None, :], x.dtype)
    sin = tf.constant(np.sin(angle)[None, :, None, :], x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return tf.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def project_qkv(tf, params: Mapping, cfg, query, key, value):
    """q (B,T,N,d), k (B,S,N_kv,d), v (B,S,N_kv,d_v) after bias, QK-norm and RoPE (float32)."""
    q = tf.einsum("btd,dnh->btnh", query, params["query_kernel"])
    k = tf.einsum("bsd,dnh->bsnh", key, params["key_kernel"])
    v = tf.einsum("bsd,dnh->bsnh", value, params["value_kernel"])
    if cfg.use_bias:
        q = q + params["query_bias"]
        k = k + params["key_bias"]
        v = v + params["value_bias"]
    if cfg.qk_norm:
        q = _rms_normalize(tf, q, reference.QK_NORM_EPS) * params["query_norm_scale"]
        k = _rms_normalize(tf, k, reference.QK_NORM_EPS) * params["key_norm_scale"]
    if cfg.rope_max_wavelength is not None:
        q = _rope(tf, q, np.arange(q.shape[1]), cfg.rope_max_wavelength)
        k = _rope(tf, k, np.arange(k.shape[1]), cfg.rope_max_wavelength)
    return q, k, v


def dynamic_weights(tf, x, dw1, qkw, dd, names, cfg) -> Dict[str, Dict[str, object]]:
    """{slot: {"w1", "w2" (B,L,G,R,M), "dd" (B,L,G,M)}}, as reference.dynamic_weights."""
    out = {s: {} for s in names}
    if not names:
        return out
    R = cfg.R
    if dw1 is not None:
        h = tf.nn.gelu(tf.einsum("bld,dgck->blgck", x, dw1), approximate=cfg.gelu_approximate)
        w = tf.einsum("blgck,gckrm->blgcrm", h, qkw)
        w1 = _rms_normalize(tf, w[..., :R, :], reference.W1_NORM_EPS)
        w2 = w[..., R:, :]
        for c, s in enumerate(names):
            out[s]["w1"] = w1[:, :, :, c]
            out[s]["w2"] = w2[:, :, :, c]
    if dd is not None:
        g = tf.tanh(tf.einsum("bld,dgn->blgn", x, dd))
        g = tf.reshape(g, [-1, g.shape[1], g.shape[2], len(names), cfg.M])
        for c, s in enumerate(names):
            out[s]["dd"] = g[:, :, :, c]
    return out


def dynamic_weights_both_sides(tf, params: Mapping, cfg, query, key):
    """(query-side, key-side) dynamic weights, as reference.dynamic_weights_both_sides."""
    qs, ks = reference.side_slots(cfg, "query"), reference.side_slots(cfg, "key")
    if cfg.cross_attention:
        def side(prefix, x, names):
            return dynamic_weights(tf, x, params.get(prefix + "dw1"), params.get(prefix + "qkw"),
                                   params.get(prefix + "dd"), names, cfg)
        return side("query_", query, qs), side("key_", key, ks)
    all_slots = reference.slots(cfg)

    def select(x, names):
        if not names:   # this side has no slot (query_wise / key_wise off)
            return {}
        idx = [all_slots.index(s) for s in names]
        dw1, qkw, dd = params.get("dw1"), params.get("qkw"), params.get("dd")
        if dw1 is not None:
            dw1, qkw = tf.gather(dw1, idx, axis=2), tf.gather(qkw, idx, axis=1)
        if dd is not None:
            D, G = dd.shape[:2]
            dd = tf.reshape(tf.gather(tf.reshape(dd, [D, G, len(all_slots), cfg.M]), idx, axis=2),
                            [D, G, len(idx) * cfg.M])
        return dynamic_weights(tf, x, dw1, qkw, dd, names, cfg)

    return select(query, qs), select(key, ks)


def stage_terms(cfg, stage: str, qdyn: Mapping, kdyn: Mapping, params: Mapping):
    """The core's ``pre`` / ``post`` dict of one stage (None when the stage is off)."""
    if not (cfg.pre_compose if stage == "pre" else cfg.post_compose):
        return None
    out = {}
    q = qdyn.get(stage + "_query", {})
    k = kdyn.get(stage + "_key", {})
    if "w1" in q:
        out.update(qw1=q["w1"], qw2=q["w2"])
    if "dd" in q:
        out["qdd"] = q["dd"]
    if "w1" in k:
        out.update(kw1=k["w1"], kw2=k["w2"])
    if "dd" in k:
        out["kdd"] = k["dd"]
    if cfg.static_compose:
        out["static"] = params["static_" + stage]
    return out


def layer_forward(params: Mapping, cfg, query, key=None, value=None, *, attention_mask=None,
                  use_causal_mask: bool = False, dtype: str = "float32",
                  return_attention_scores: bool = False, core=None, query_chunk_size=None):
    """One DCMHA layer in TensorFlow around an attention core (default: the XLA core).

    params: canonical name -> float32 tensor; query (B,T,D_q), key / value (B,S,D_kv)
    float32 (Keras's defaults: value = query, key = value); attention_mask bool (B,T,S).
    Returns y (B,T,D_out) float32 holding values of ``dtype`` (and the attention scores
    (B,N,T,S) float32 with ``return_attention_scores``).
    """
    tf = _tf()
    if core is None:
        from dcmha.backends.xla import dcmha_attention as core
    dt = tf.as_dtype(dtype)
    value = query if value is None else value
    key = value if key is None else key
    q, k, v = project_qkv(tf, params, cfg, query, key, value)
    qdyn, kdyn = dynamic_weights_both_sides(tf, params, cfg, query, key)
    rnd = lambda tree: tf.nest.map_structure(lambda x: tf.cast(x, dt), tree)  # noqa: E731
    qdyn, kdyn = rnd(qdyn), rnd(kdyn)
    static = {n: tf.cast(p, dt) for n, p in params.items() if n.startswith("static_")}
    mask = None if attention_mask is None else tf.convert_to_tensor(attention_mask, tf.bool)
    out = core(tf.cast(q, dt), tf.cast(k, dt), tf.cast(v, dt), num_groups=cfg.G,
               pre=stage_terms(cfg, "pre", qdyn, kdyn, static),
               post=stage_terms(cfg, "post", qdyn, kdyn, static),
               mask=mask, causal=bool(use_causal_mask), sliding_window=cfg.sliding_window,
               query_chunk_size=cfg.query_chunk_size if query_chunk_size is None
               else query_chunk_size,
               return_attention_scores=return_attention_scores)
    o, scores = out if return_attention_scores else (out, None)
    y = tf.einsum("btnh,nho->bto", tf.cast(o, tf.float32), params["output_kernel"])
    if cfg.use_bias:
        y = y + params["output_bias"]
    y = tf.cast(tf.cast(y, dt), tf.float32)
    return (y, tf.cast(scores, tf.float32)) if return_attention_scores else y


class TfXlaAdapter(Adapter):
    name = "tf-xla"
    capabilities = frozenset({"forward", "gradients", "float32", "float16", "bfloat16"})

    def __init__(self):
        _refuse_triton()
        from dcmha.backends import xla as backend

        if not backend.is_available():
            raise RuntimeError("The tf-xla adapter needs TensorFlow.")
        self.tf = _tf()
        self.core = backend.dcmha_attention

    def run(self, case) -> Dict[str, np.ndarray]:
        _refuse_triton()
        if case.kind not in ("forward", "gradients"):
            raise ValueError(f"tf-xla adapter: case kind {case.kind!r} is not supported.")
        if case.dtype not in _DTYPES:
            raise ValueError(f"tf-xla adapter: dtype must be one of {_DTYPES}. "
                             f"Received: dtype={case.dtype!r}")
        tf = self.tf
        cfg = case.cfg
        args = call_inputs(case)
        mask = args["attention_mask"]
        if mask is not None:
            mask = tf.constant(np.broadcast_to(np.asarray(mask, bool), (
                case.dims["batch"], case.dims["query_length"], case.dims["key_length"])))
        inputs = {n: tf.constant(np.asarray(args[n], np.float32))
                  for n in ("query", "key", "value") if args[n] is not None}
        params = {n: tf.constant(np.asarray(a, np.float32)) for n, a in case.params.items()}

        def layer(with_scores):
            return layer_forward(params, cfg, inputs["query"], inputs.get("key"),
                                 inputs.get("value"), attention_mask=mask,
                                 use_causal_mask=args["use_causal_mask"], dtype=case.dtype,
                                 return_attention_scores=with_scores, core=self.core)

        if case.kind == "forward":
            y, scores = layer(True)
            out = {"output": y, "attention_scores": scores}
        else:
            d_out = tf.constant(np.asarray(case.inputs["d_output"], np.float32))
            with tf.GradientTape() as tape:
                tape.watch([inputs, params])
                y = layer(False)
                loss = tf.reduce_sum(y * d_out)
            g_in, g_params = tape.gradient(loss, [inputs, params],
                                           unconnected_gradients=tf.UnconnectedGradients.ZERO)
            out = {"output": y}
            out.update({"grad/" + n: g for n, g in g_in.items()})
            out.update({"grad/" + n: g for n, g in g_params.items()})
        return {n: np.asarray(out[n], np.float32) for n in case.outputs if n in out}
