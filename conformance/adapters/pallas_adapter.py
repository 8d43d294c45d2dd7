"""Conformance adapter: the fused Pallas kernel (JAX), run on CPU in Pallas interpret mode.

The projections, QK-norm, RoPE, dynamic weights and output projection are plain
jax.numpy in float32 (mirroring ``spec/reference.py``); q, k, v and the dynamic
weights are then rounded to the case's dtype (what a mixed-precision layer stores)
and the attention itself is ``dcmha.backends.pallas.dcmha_attention`` (scores,
composition and softmax in float32), which also returns the attention scores. The
output projection reads O in the compute dtype and its result is rounded to it.
Gradients are ``jax.vjp`` through everything (the kernel's own backward for the
attention). Everything is float32 or narrower, as on a real accelerator (no x64).

Not covered: "decode" (no cache path here) and "intermediates" (the fused kernel
never materialises the raw scores, pre-composed scores or probabilities).
"""

from __future__ import annotations

from typing import Dict, Mapping

import numpy as np

from dcmha.conformance.adapters.base import Adapter, call_inputs
from dcmha.spec import reference


def _einsum(jnp, spec, *xs):
    from jax import lax

    return jnp.einsum(spec, *xs, precision=lax.Precision.HIGHEST)


def _rms_normalize(jnp, x, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(jnp, x, positions, max_wavelength):
    """Rotate-half RoPE of x (B, L, H, d) at positions (L,) (angles in float64 NumPy)."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = max_wavelength ** (-np.arange(half, dtype=np.float64) * 2.0 / d)
    angle = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    cos = jnp.asarray(np.cos(angle), x.dtype)[None, :, None, :]
    sin = jnp.asarray(np.sin(angle), x.dtype)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def project_qkv(jnp, params, cfg, query, key, value):
    """q (B,T,N,d), k (B,S,N_kv,d), v (B,S,N_kv,d_v) after bias, QK-norm and RoPE."""
    q = _einsum(jnp, "btd,dnh->btnh", query, params["query_kernel"])
    k = _einsum(jnp, "bsd,dnh->bsnh", key, params["key_kernel"])
    v = _einsum(jnp, "bsd,dnh->bsnh", value, params["value_kernel"])
    if cfg.use_bias:
        q = q + params["query_bias"]
        k = k + params["key_bias"]
        v = v + params["value_bias"]
    if cfg.qk_norm:
        q = _rms_normalize(jnp, q, reference.QK_NORM_EPS) * params["query_norm_scale"]
        k = _rms_normalize(jnp, k, reference.QK_NORM_EPS) * params["key_norm_scale"]
    if cfg.rope_max_wavelength is not None:
        q = _rope(jnp, q, np.arange(q.shape[1]), cfg.rope_max_wavelength)
        k = _rope(jnp, k, np.arange(k.shape[1]), cfg.rope_max_wavelength)
    return q, k, v


def dynamic_weights(jax, x, dw1, qkw, dd, names, cfg):
    """{slot: {"w1", "w2" (B,L,G,R,M), "dd" (B,L,G,M)}}, as reference.dynamic_weights."""
    jnp = jax.numpy
    out = {s: {} for s in names}
    R = cfg.R
    if dw1 is not None:
        h = jax.nn.gelu(_einsum(jnp, "bld,dgck->blgck", x, dw1), approximate=cfg.gelu_approximate)
        w = _einsum(jnp, "blgck,gckrm->blgcrm", h, qkw)
        w1 = _rms_normalize(jnp, w[..., :R, :], reference.W1_NORM_EPS)
        w2 = w[..., R:, :]
        for c, s in enumerate(names):
            out[s]["w1"] = w1[:, :, :, c]
            out[s]["w2"] = w2[:, :, :, c]
    if dd is not None:
        g = jnp.tanh(_einsum(jnp, "bld,dgn->blgn", x, dd))
        g = g.reshape(g.shape[:3] + (len(names), -1))
        for c, s in enumerate(names):
            out[s]["dd"] = g[:, :, :, c]
    return out


def dynamic_weights_both_sides(jax, params, cfg, query, key):
    """(query-side, key-side) dynamic weights, as reference.dynamic_weights_both_sides."""
    qs, ks = reference.side_slots(cfg, "query"), reference.side_slots(cfg, "key")
    if cfg.cross_attention:
        def side(prefix, x, names):
            return dynamic_weights(jax, x, params.get(prefix + "dw1"), params.get(prefix + "qkw"),
                                   params.get(prefix + "dd"), names, cfg)
        return side("query_", query, qs), side("key_", key, ks)
    all_slots = reference.slots(cfg)

    def select(x, names):
        if not names:   # this side has no slot (query_wise / key_wise off)
            return {}
        idx = np.asarray([all_slots.index(s) for s in names], np.int32)
        dw1, qkw, dd = params.get("dw1"), params.get("qkw"), params.get("dd")
        if dw1 is not None:
            dw1, qkw = dw1[:, :, idx], qkw[:, idx]
        if dd is not None:
            D, G = dd.shape[:2]
            dd = dd.reshape(D, G, len(all_slots), cfg.M)[:, :, idx].reshape(D, G, len(idx) * cfg.M)
        return dynamic_weights(jax, x, dw1, qkw, dd, names, cfg)

    return select(query, qs), select(key, ks)


def stage_terms(cfg, stage: str, qdyn: Mapping, kdyn: Mapping, params: Mapping):
    """The kernel's ``pre`` / ``post`` dict of one stage (None when the stage is off)."""
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


class PallasInterpretAdapter(Adapter):
    name = "pallas-interpret"
    capabilities = frozenset({"forward", "gradients", "float32", "float16", "bfloat16"})

    def __init__(self):
        from dcmha.backends import pallas as backend

        if not backend.is_available():
            raise RuntimeError("The pallas-interpret adapter needs JAX with Pallas.")
        import jax

        self.jax = jax
        self.kernel = backend.dcmha_attention

    def run(self, case) -> Dict[str, np.ndarray]:
        if case.kind not in ("forward", "gradients"):
            raise ValueError(f"pallas-interpret adapter: case kind {case.kind!r} is not supported.")
        jax = self.jax
        jnp = jax.numpy
        cfg = case.cfg
        dt = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}[case.dtype]
        args = call_inputs(case)
        mask = args["attention_mask"]
        mask = None if mask is None else jnp.asarray(np.broadcast_to(
            np.asarray(mask, bool), (case.dims["batch"], case.dims["query_length"],
                                     case.dims["key_length"])))
        causal = args["use_causal_mask"]

        leaves = {"query": args["query"]}
        if args["value"] is not None:
            leaves["value"] = args["value"]
        if args["key"] is not None:
            leaves["key"] = args["key"]
        leaves = {n: jnp.asarray(np.asarray(a, np.float32)) for n, a in leaves.items()}
        params = {n: jnp.asarray(np.asarray(a, np.float32)) for n, a in case.params.items()}

        def layer(inputs, params, with_scores):
            query = inputs["query"]
            value = inputs.get("value", query)
            key = inputs.get("key", value)       # Keras: key defaults to value
            q, k, v = project_qkv(jnp, params, cfg, query, key, value)
            qdyn, kdyn = dynamic_weights_both_sides(jax, params, cfg, query, key)
            rnd = lambda tree: jax.tree.map(lambda x: x.astype(dt), tree)  # noqa: E731
            qdyn, kdyn = rnd(qdyn), rnd(kdyn)
            out = self.kernel(
                q.astype(dt), k.astype(dt), v.astype(dt), num_groups=cfg.G,
                pre=stage_terms(cfg, "pre", qdyn, kdyn, params),
                post=stage_terms(cfg, "post", qdyn, kdyn, params),
                mask=mask, causal=causal, sliding_window=cfg.sliding_window,
                return_attention_scores=with_scores, interpret=True)
            o, scores = out if with_scores else (out, None)
            y = _einsum(jnp, "btnh,nho->bto", o.astype(jnp.float32), params["output_kernel"])
            if cfg.use_bias:
                y = y + params["output_bias"]
            y = y.astype(dt).astype(jnp.float32)
            return (y, scores.astype(jnp.float32)) if with_scores else y

        if case.kind == "forward":
            y, scores = jax.jit(lambda i, p: layer(i, p, True))(leaves, params)
            out = {"output": y, "attention_scores": scores}
        else:
            d_out = jnp.asarray(np.asarray(case.inputs["d_output"], np.float32))

            @jax.jit
            def forward_and_grads(leaves, params):
                y, vjp = jax.vjp(lambda i, p: layer(i, p, False), leaves, params)
                return (y,) + vjp(d_out)

            y, g_in, g_params = forward_and_grads(leaves, params)
            out = {"output": y}
            out.update({"grad/" + n: g for n, g in g_in.items()})
            out.update({"grad/" + n: g for n, g in g_params.items()})
        return {n: np.asarray(out[n], np.float32) for n in case.outputs if n in out}
