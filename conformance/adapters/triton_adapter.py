"""Conformance adapter: the fused Triton kernel, run on CPU through Triton's interpreter.

The projections, QK-norm, RoPE, dynamic weights and output projection are plain PyTorch
ops (float32, mirroring ``spec/reference.py``); q, k, v and the dynamic weights are then
rounded to the case's dtype and the attention itself is ``dcmha_attention`` (scores,
composition and softmax in float32), which also returns the attention scores. Gradients
are PyTorch autograd through everything (the kernel's own backward for the attention).
Decode cases keep a PyTorch cache (keys after QK-norm/RoPE, values, key-side dynamic
weights) and call the kernel causally at ``query_offset = cache_update_index``.
Not covered: "intermediates" (the fused kernel never materialises the scores,
pre-composed scores or probabilities).

TRITON_INTERPRET=1 is set when this module is imported, before Triton is. The adapter
refuses to run in a process that has imported TensorFlow (importing Triton after it aborts).
"""

from __future__ import annotations

import os
import sys
from typing import Dict, Mapping

import numpy as np

if "tensorflow" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

from dcmha.conformance.adapters.base import Adapter, cache_length, decode_segments  # noqa: E402
from dcmha.spec import reference  # noqa: E402


def _torch_dtype(torch, name: str):
    return {"float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[name]


# ---------------------------------------------------------------------------
# The layer around the kernel, in PyTorch (mirrors spec/reference.py)
# ---------------------------------------------------------------------------

def _rms_normalize(x, eps):
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()


def _rope(torch, x, positions, max_wavelength):
    """Rotate-half RoPE of x (B, L, H, d) at absolute positions (L,) (angles in float64)."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = max_wavelength ** (-np.arange(half, dtype=np.float64) * 2.0 / d)
    angle = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    cos = torch.tensor(np.cos(angle), dtype=x.dtype)[None, :, None, :]
    sin = torch.tensor(np.sin(angle), dtype=x.dtype)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def project_qkv(torch, params, cfg, query, key, value, q_pos, k_pos):
    """q (B,T,N,d), k (B,S,N_kv,d), v (B,S,N_kv,d_v) after bias, QK-norm and RoPE."""
    q = torch.einsum("btd,dnh->btnh", query, params["query_kernel"])
    k = torch.einsum("bsd,dnh->bsnh", key, params["key_kernel"])
    v = torch.einsum("bsd,dnh->bsnh", value, params["value_kernel"])
    if cfg.use_bias:
        q = q + params["query_bias"]
        k = k + params["key_bias"]
        v = v + params["value_bias"]
    if cfg.qk_norm:
        q = _rms_normalize(q, reference.QK_NORM_EPS) * params["query_norm_scale"]
        k = _rms_normalize(k, reference.QK_NORM_EPS) * params["key_norm_scale"]
    if cfg.rope_max_wavelength is not None:
        q = _rope(torch, q, q_pos, cfg.rope_max_wavelength)
        k = _rope(torch, k, k_pos, cfg.rope_max_wavelength)
    return q, k, v


def dynamic_weights(torch, x, dw1, qkw, dd, names, cfg):
    """{slot: {"w1", "w2" (B,L,G,R,M), "dd" (B,L,G,M)}} as reference.dynamic_weights."""
    out = {s: {} for s in names}
    if not names:   # a side with no enabled slot (e.g. key_wise=False) has no weights
        return out
    R = cfg.R
    if dw1 is not None:
        approximate = "tanh" if cfg.gelu_approximate else "none"
        h = torch.nn.functional.gelu(torch.einsum("bld,dgck->blgck", x, dw1),
                                     approximate=approximate)
        w = torch.einsum("blgck,gckrm->blgcrm", h, qkw)
        w1 = _rms_normalize(w[..., :R, :], reference.W1_NORM_EPS)
        w2 = w[..., R:, :]
        for c, s in enumerate(names):
            out[s]["w1"] = w1[:, :, :, c]
            out[s]["w2"] = w2[:, :, :, c]
    if dd is not None:
        g = torch.tanh(torch.einsum("bld,dgn->blgn", x, dd))
        g = g.reshape(g.shape[:3] + (len(names), -1))
        for c, s in enumerate(names):
            out[s]["dd"] = g[:, :, :, c]
    return out


def dynamic_weights_both_sides(torch, params, cfg, query, key):
    """(query-side, key-side) dynamic weights, as reference.dynamic_weights_both_sides."""
    qs, ks = reference.side_slots(cfg, "query"), reference.side_slots(cfg, "key")
    if cfg.cross_attention:
        def side(prefix, x, names):
            return dynamic_weights(torch, x, params.get(prefix + "dw1"),
                                   params.get(prefix + "qkw"), params.get(prefix + "dd"),
                                   names, cfg)
        return side("query_", query, qs), side("key_", key, ks)
    all_slots = reference.slots(cfg)

    def select(x, names):
        idx = [all_slots.index(s) for s in names]
        dw1, qkw, dd = params.get("dw1"), params.get("qkw"), params.get("dd")
        if dw1 is not None:
            dw1, qkw = dw1[:, :, idx], qkw[:, idx]
        if dd is not None:
            D, G = dd.shape[:2]
            dd = dd.reshape(D, G, len(all_slots), cfg.M)[:, :, idx].reshape(D, G, len(idx) * cfg.M)
        return dynamic_weights(torch, x, dw1, qkw, dd, names, cfg)

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


def _to_dtype(tree, dt):
    """Dynamic weights rounded to the compute dtype (what a mixed-precision layer stores)."""
    return {s: {n: w.to(dt) for n, w in ws.items()} for s, ws in tree.items()}


def output_projection(torch, params, cfg, o, dt):
    """(B, T, N, d_v) -> (B, T, D_out) in float32, rounded to the compute dtype."""
    y = torch.einsum("btnh,nho->bto", o.to(torch.float32), params["output_kernel"])
    if cfg.use_bias:
        y = y + params["output_bias"]
    return y.to(dt)


class TritonInterpretAdapter(Adapter):
    name = "triton-interpret"
    capabilities = frozenset({"forward", "gradients", "decode", "float32", "float16",
                              "bfloat16"})

    def __init__(self):
        if "tensorflow" in sys.modules:
            raise RuntimeError("The triton-interpret adapter cannot run in a process that has "
                               "imported TensorFlow (importing Triton after it aborts); run it "
                               "in its own process.")
        import torch

        from dcmha.backends import triton as backend

        if not backend.is_available(interpret=True):
            raise RuntimeError("The triton-interpret adapter needs Triton and PyTorch.")
        self.torch = torch
        self.kernel = backend.dcmha_attention

    # -- forward and gradients ------------------------------------------------
    def run(self, case) -> Dict[str, np.ndarray]:
        if case.kind == "decode":
            return {"output": self._decode(case)}
        if case.kind not in ("forward", "gradients"):
            raise ValueError(f"triton-interpret adapter: case kind {case.kind!r} is not supported.")
        torch = self.torch
        dt = _torch_dtype(torch, case.dtype)
        grads = case.kind == "gradients"
        leaves = {n: torch.tensor(np.asarray(a, np.float32), requires_grad=grads)
                  for n, a in case.params.items()}
        query = torch.tensor(np.asarray(case.inputs["query"], np.float32), requires_grad=grads)
        inputs = {"query": query}
        if case.call["self_attention"]:
            key = value = query
        else:
            value = torch.tensor(np.asarray(case.inputs["value"], np.float32),
                                 requires_grad=grads)
            inputs["value"] = value
            key = value
            if "key" in case.inputs:
                key = torch.tensor(np.asarray(case.inputs["key"], np.float32),
                                   requires_grad=grads)
                inputs["key"] = key
        mask = case.inputs.get("attention_mask")
        with torch.enable_grad() if grads else torch.no_grad():
            y, scores = self._layer(case.cfg, leaves, query, key, value, mask,
                                    bool(case.call["use_causal_mask"]), dt)
            out = {"output": y.detach().to(torch.float32).numpy(),
                   "attention_scores": scores.to(torch.float32).numpy()}
            if grads:
                d_out = torch.tensor(np.asarray(case.inputs["d_output"], np.float32))
                names = list(inputs) + list(leaves)
                tensors = [inputs.get(n, leaves.get(n)) for n in names]
                gs = torch.autograd.grad(y.to(torch.float32), tensors, d_out, allow_unused=True)
                for n, t, g in zip(names, tensors, gs):
                    out["grad/" + n] = (torch.zeros_like(t) if g is None else g).numpy()
        return {n: out[n] for n in case.outputs if n in out}

    def _layer(self, cfg, params, query, key, value, mask, causal, dt):
        torch = self.torch
        B, T, S = query.shape[0], query.shape[1], key.shape[1]
        q, k, v = project_qkv(torch, params, cfg, query, key, value, np.arange(T), np.arange(S))
        qdyn, kdyn = dynamic_weights_both_sides(torch, params, cfg, query, key)
        qdyn, kdyn = _to_dtype(qdyn, dt), _to_dtype(kdyn, dt)
        o, scores = self.kernel(
            q.to(dt), k.to(dt), v.to(dt),
            num_groups=cfg.G, pre=stage_terms(cfg, "pre", qdyn, kdyn, params),
            post=stage_terms(cfg, "post", qdyn, kdyn, params),
            mask=None if mask is None else torch.tensor(np.asarray(mask, bool)),
            causal=causal, sliding_window=cfg.sliding_window, return_attention_scores=True,
            interpret=True)
        return output_projection(torch, params, cfg, o, dt), scores

    # -- decode -------------------------------------------------------------
    def _decode(self, case) -> np.ndarray:
        torch = self.torch
        cfg = case.cfg
        dt = _torch_dtype(torch, case.dtype)
        params = {n: torch.tensor(np.asarray(a, np.float32)) for n, a in case.params.items()}
        query = torch.tensor(np.asarray(case.inputs["query"], np.float32))
        B, T = query.shape[:2]
        S_max = cache_length(case)
        cache = {n: torch.zeros(s, dtype=dt)
                 for n, s in reference.cache_shapes(cfg, B, S_max).items()}
        mask = None
        if case.inputs.get("attention_mask") is not None:
            m = np.broadcast_to(np.asarray(case.inputs["attention_mask"], bool), (B, T, T))
            mask = np.zeros((B, T, S_max), bool)
            mask[:, :, :min(T, S_max)] = m[:, :, :S_max]
        outs = []
        with torch.no_grad():
            for start, stop in decode_segments(case):
                x = query[:, start:stop]
                pos = np.arange(start, stop)
                q, k, v = project_qkv(torch, params, cfg, x, x, x, pos, pos)
                qdyn, kdyn_new = dynamic_weights_both_sides(torch, params, cfg, x, x)
                cache["key"][:, start:stop] = k.to(dt)
                cache["value"][:, start:stop] = v.to(dt)
                for s, ws in kdyn_new.items():
                    for n, w in ws.items():
                        cache[f"{s}_{n}"][:, start:stop] = w.to(dt)
                kdyn = {s: {n: cache[f"{s}_{n}"] for n in ws} for s, ws in kdyn_new.items()}
                qdyn = _to_dtype(qdyn, dt)
                o = self.kernel(
                    q.to(dt), cache["key"], cache["value"], num_groups=cfg.G,
                    pre=stage_terms(cfg, "pre", qdyn, kdyn, params),
                    post=stage_terms(cfg, "post", qdyn, kdyn, params),
                    mask=None if mask is None else torch.tensor(mask[:, start:stop]),
                    causal=True, sliding_window=cfg.sliding_window, query_offset=start,
                    interpret=True)
                outs.append(output_projection(torch, params, cfg, o, dt).to(torch.float32))
        return torch.cat(outs, dim=1).numpy()
