"""Hand-written backward of the DCMHA specification (NumPy, float64).

One backward per forward primitive of ``spec/reference.py``, each named after
it, and ``attention_grads`` for the whole layer. The fused kernels implement
exactly the math below; shapes use the letters of ``reference.py``.

Compose backward
----------------
Compose is linear in its input: for every (b, t, s) it maps the head vector
``a[:, t, s]`` through the block-diagonal matrix ``W_ts`` (``out = W_ts^T a``,
see ``reference.compose_matrices``). Per group, with ``g = dL/d out``:

    dL/da[m]      = g[m] + sum_n W_static[m,n] g[n]
                  + sum_r gq[r] qw1[t,r,m]  + sum_r gk[r] kw1[s,r,m]
                  + g[m] (qdd[t,m] + kdd[s,m])
    where gq[r]   = sum_n g[n] qw2[t,r,n],  gk[r] = sum_n g[n] kw2[s,r,n]
    dL/dqw1[t,r,m] = sum_s gq[r] a[m]        dL/dqw2[t,r,n] = sum_s hq[r] g[n]
    dL/dkw1[s,r,m] = sum_t gk[r] a[m]        dL/dkw2[s,r,n] = sum_t hk[r] g[n]
    where hq[r]   = sum_m a[m] qw1[t,r,m],  hk[r] = sum_m a[m] kw1[s,r,m]
    dL/dqdd[t,n]  = sum_s g[n] a[n]          dL/dkdd[s,n]  = sum_t g[n] a[n]
    dL/dW_static[m,n] = sum_{b,t,s} a[m] g[n]

i.e. query-side weight gradients reduce over S, key-side ones over T. Every
term reads the compose input ``a``, so there is no chain between terms.

Masked softmax backward
-----------------------
With P the masked-softmax output (0 on masked entries and on fully masked
rows) and gP = dL/dP, the gradient of the scores is

    dL/da[s] = P[s] * (gP[s] - sum_s' P[s'] gP[s'])

which is exactly 0 wherever P is 0: masked entries, and every entry of a
fully masked row (no NaN, nothing to special-case).

Attention backward
------------------
Forward: scores = q.k/sqrt(d) -> pre-compose -> masked softmax -> post-compose
-> masked entries set to 0 -> O = P.V -> output projection. Backward runs it in
reverse: the final zeroing multiplies dL/dP by the mask; post-compose and
pre-compose use the compose backward; GQA sums the gradients of the repeated
query heads back onto their kv head; RoPE is a rotation, so its backward is the
rotation by the negative angle; QK-norm is an RMS norm times a learned scale.
The gradient does not depend on ``query_chunk_size`` (query rows are
independent), so the backward ignores chunking.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional

import numpy as np

from .terms import TERMS

from .reference import (QK_NORM_EPS, W1_NORM_EPS, Config, compose, compose_terms,
                        dynamic_weights_both_sides, gelu, make_mask, masked_softmax,
                        rms_normalize, rope, side_slots, slots)

__all__ = [
    "gelu_backward", "rms_normalize_backward", "rope_backward", "dynamic_weights_backward",
    "compose_backward", "masked_softmax_backward", "attention_grads",
]


# ---------------------------------------------------------------------------
# Elementwise pieces
# ---------------------------------------------------------------------------

def gelu_backward(x: np.ndarray, g: np.ndarray, approximate: bool = True) -> np.ndarray:
    """dL/dx of ``gelu(x, approximate)`` given g = dL/d gelu(x)."""
    if approximate:
        c = math.sqrt(2.0 / math.pi)
        th = np.tanh(c * (x + 0.044715 * x ** 3))
        dy = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * c * (1.0 + 3 * 0.044715 * x * x)
    else:
        from math import erf
        cdf = 0.5 * (1.0 + np.vectorize(erf, otypes=[np.float64])(x / math.sqrt(2.0)))
        pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        dy = cdf + x * pdf                              # d/dx [x Phi(x)]
    return g * dy


def rms_normalize_backward(x: np.ndarray, g: np.ndarray, eps: float, axis: int = -1) -> np.ndarray:
    """dL/dx of ``rms_normalize(x, eps, axis)`` given g = dL/dy.

    With y = x / r, r = sqrt(mean(x^2) + eps): dL/dx = (g - y * mean(g * y)) / r.
    """
    r = np.sqrt(np.mean(x * x, axis=axis, keepdims=True) + eps)
    y = x / r
    return (g - y * np.mean(g * y, axis=axis, keepdims=True)) / r


def rope_backward(g: np.ndarray, positions: np.ndarray, max_wavelength: float) -> np.ndarray:
    """dL/dx of ``rope(x, positions, max_wavelength)`` given g = dL/dy.

    Each (i, i + d/2) pair is rotated by an angle; a rotation is orthogonal, so
    the backward is the transpose rotation, i.e. the rotation by minus the angle.
    """
    return rope(g, -np.asarray(positions, np.float64), max_wavelength)


# ---------------------------------------------------------------------------
# Dynamic weight projection
# ---------------------------------------------------------------------------

def dynamic_weights_backward(x: np.ndarray, dw1: Optional[np.ndarray], qkw: Optional[np.ndarray],
                             dd: Optional[np.ndarray], slot_names: tuple, rank: int,
                             gelu_approximate: bool, grads: Mapping):
    """Backward of ``reference.dynamic_weights``.

    grads: ``{slot: {"w1"/"w2": (B,L,G,R,M), "dd": (B,L,G,M)}}``; a missing slot
    or entry is a zero gradient. Returns (g_x (B,L,D), g_dw1, g_qkw, g_dd), with
    None for a parameter that is None.
    """
    g_x = np.zeros_like(x)
    g_dw1 = g_qkw = g_dd = None
    B, L, _ = x.shape
    C = len(slot_names)
    if dw1 is not None:
        pre = np.einsum("bld,dgck->blgck", x, dw1)
        h = gelu(pre, gelu_approximate)                                   # (B,L,G,C,K)
        w = np.einsum("blgck,gckrm->blgcrm", h, qkw)                      # (B,L,G,C,2R,M)
        g_w = np.zeros_like(w)
        for c, s in enumerate(slot_names):
            gs = grads.get(s, {})
            if "w1" in gs:
                g_w[:, :, :, c, :rank] = rms_normalize_backward(
                    w[:, :, :, c, :rank], gs["w1"], W1_NORM_EPS, axis=-1)
            if "w2" in gs:
                g_w[:, :, :, c, rank:] = gs["w2"]
        g_qkw = np.einsum("blgck,blgcrm->gckrm", h, g_w)
        g_pre = gelu_backward(pre, np.einsum("blgcrm,gckrm->blgck", g_w, qkw), gelu_approximate)
        g_dw1 = np.einsum("bld,blgck->dgck", x, g_pre)
        g_x += np.einsum("blgck,dgck->bld", g_pre, dw1)
    if dd is not None:
        G = dd.shape[1]
        M = dd.shape[2] // C
        th = np.tanh(np.einsum("bld,dgn->blgn", x, dd))                   # (B,L,G,C*M)
        g_th = np.zeros((B, L, G, C, M))
        for c, s in enumerate(slot_names):
            if "dd" in grads.get(s, {}):
                g_th[:, :, :, c] = grads[s]["dd"]
        g_z = g_th.reshape(B, L, G, C * M) * (1.0 - th * th)
        g_dd = np.einsum("bld,blgn->dgn", x, g_z)
        g_x += np.einsum("blgn,dgn->bld", g_z, dd)
    return g_x, g_dw1, g_qkw, g_dd


# ---------------------------------------------------------------------------
# Compose and softmax
# ---------------------------------------------------------------------------

def compose_backward(a: np.ndarray, g_out: np.ndarray, num_groups: int, *, qw1=None, qw2=None,
                     kw1=None, kw2=None, qdd=None, kdd=None, static=None):
    """Backward of ``reference.compose`` (math in the module docstring).

    a, g_out: (B, N, T, S). Returns (g_a (B, N, T, S), {name: gradient}) with
    one entry per given term among "qw1", "qw2", "kw1", "kw2", "qdd", "kdd",
    "static", each of the term's shape.
    """
    B, N, T, S = a.shape
    G = num_groups
    M = N // G
    x = a.reshape(B, G, M, T, S)
    g = g_out.reshape(B, G, M, T, S)
    g_x = g.copy()                                                        # residual
    terms = {}
    if static is not None:
        g_x += np.einsum("bgnts,gmn->bgmts", g, static)
        terms["static"] = np.einsum("bgmts,bgnts->gmn", x, g)
    if qw1 is not None:
        hidden = np.einsum("bgmts,btgrm->bgrts", x, qw1)
        g_hidden = np.einsum("bgnts,btgrn->bgrts", g, qw2)
        terms["qw1"] = np.einsum("bgrts,bgmts->btgrm", g_hidden, x)
        terms["qw2"] = np.einsum("bgrts,bgnts->btgrn", hidden, g)
        g_x += np.einsum("bgrts,btgrm->bgmts", g_hidden, qw1)
    if kw1 is not None:
        hidden = np.einsum("bgmts,bsgrm->bgrts", x, kw1)
        g_hidden = np.einsum("bgnts,bsgrn->bgrts", g, kw2)
        terms["kw1"] = np.einsum("bgrts,bgmts->bsgrm", g_hidden, x)
        terms["kw2"] = np.einsum("bgrts,bgnts->bsgrn", hidden, g)
        g_x += np.einsum("bgrts,bsgrm->bgmts", g_hidden, kw1)
    if qdd is not None:
        g_x += g * qdd.transpose(0, 2, 3, 1)[..., :, None]
        terms["qdd"] = np.einsum("bgnts,bgnts->btgn", g, x)
    if kdd is not None:
        g_x += g * kdd.transpose(0, 2, 3, 1)[..., None, :]
        terms["kdd"] = np.einsum("bgnts,bgnts->bsgn", g, x)
    return g_x.reshape(B, N, T, S), terms


def masked_softmax_backward(p: np.ndarray, g_p: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """dL/da of ``masked_softmax(a, mask)`` given its output p (B, N, T, S) and g_p.

    Masked entries and fully masked rows get exactly 0 (p is 0 there).
    """
    g_a = p * (g_p - np.sum(p * g_p, axis=-1, keepdims=True))
    return np.where(mask[:, None], g_a, 0.0)


# ---------------------------------------------------------------------------
# The whole layer
# ---------------------------------------------------------------------------

def _sum_repeated_heads(g_h: np.ndarray, rep: int) -> np.ndarray:
    """(B,S,N,e) -> (B,S,N_kv,e): query head h read kv head h // rep (np.repeat)."""
    B, S, N, e = g_h.shape
    return g_h.reshape(B, S, N // rep, rep, e).sum(axis=3)


def _qk_forward(params, cfg, x, name, positions):
    """The q (or k) chain; returns (pre-norm projection, normalized, output)."""
    lin = np.einsum("bld,dnh->blnh", x, params[name + "_kernel"])
    if cfg.use_bias:
        lin = lin + params[name + "_bias"]
    normed = rms_normalize(lin, QK_NORM_EPS) if cfg.qk_norm else lin
    out = normed * params[name + "_norm_scale"] if cfg.qk_norm else normed
    if cfg.rope_max_wavelength is not None:
        out = rope(out, positions, cfg.rope_max_wavelength)
    return lin, normed, out


def _qk_backward(params, cfg, x, name, positions, lin, normed, g_out, grads):
    """Backward of ``_qk_forward``; writes parameter gradients, returns dL/dx."""
    g = g_out
    if cfg.rope_max_wavelength is not None:
        g = rope_backward(g, positions, cfg.rope_max_wavelength)
    if cfg.qk_norm:
        grads[name + "_norm_scale"] = np.einsum("blnh,blnh->h", g, normed)
        g = rms_normalize_backward(lin, g * params[name + "_norm_scale"], QK_NORM_EPS)
    return _linear_backward(params, cfg, x, name, g, grads)


def _linear_backward(params, cfg, x, name, g, grads):
    """Backward of x (B,L,D) @ kernel (D,H,e) [+ bias]; returns dL/dx."""
    grads[name + "_kernel"] = np.einsum("bld,blnh->dnh", x, g)
    if cfg.use_bias:
        grads[name + "_bias"] = g.sum(axis=(0, 1))
    return np.einsum("blnh,dnh->bld", g, params[name + "_kernel"])


def _self_attention_slices(cfg: Config, names: tuple):
    """Indices of one side's slots among all slots (the selection of
    ``reference.dynamic_weights_both_sides``)."""
    all_slots = slots(cfg)
    return [all_slots.index(s) for s in names]


def attention_grads(params: Mapping, cfg: Config, query: np.ndarray,
                    key: Optional[np.ndarray] = None, value: Optional[np.ndarray] = None, *,
                    attention_mask: Optional[np.ndarray] = None, use_causal_mask: bool = False,
                    d_output: np.ndarray) -> Dict[str, np.ndarray]:
    """Gradients of ``sum(reference.attention(...) * d_output)``.

    Same arguments as ``reference.attention``; d_output: (B, T, D_out).
    Returns a dict with "query" always, "value" if ``value`` was passed, "key"
    if ``key`` was passed, and one entry per name in ``params`` (same shape).
    Keras's rule (key defaults to value, value to query) decides where the
    gradient of a defaulted input goes: with key=None the key path adds to
    "value" (or to "query" when value is None as well).
    """
    cfg = cfg.validate()
    query = np.asarray(query, np.float64)
    value_in = query if value is None else np.asarray(value, np.float64)
    key_in = value_in if key is None else np.asarray(key, np.float64)
    params = {n: np.asarray(p, np.float64) for n, p in params.items()}
    g_y = np.asarray(d_output, np.float64)
    B, T, _ = query.shape
    S = key_in.shape[1]
    G, R, rep = cfg.G, cfg.R, cfg.N // cfg.N_kv
    inv_sqrt_d = 1.0 / math.sqrt(cfg.d)
    mask = make_mask(B, T, S, attention_mask=attention_mask, use_causal_mask=use_causal_mask,
                     sliding_window=cfg.sliding_window)
    q_pos, k_pos = np.arange(T), np.arange(S)

    # ---- forward, keeping what the backward reads ----------------------------
    q_lin, q_normed, q = _qk_forward(params, cfg, query, "query", q_pos)
    k_lin, k_normed, k = _qk_forward(params, cfg, key_in, "key", k_pos)
    v = np.einsum("bsd,dnh->bsnh", value_in, params["value_kernel"])
    if cfg.use_bias:
        v = v + params["value_bias"]
    qdyn, kdyn = dynamic_weights_both_sides(params, cfg, query, key_in)
    k_h, v_h = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k_h) * inv_sqrt_d
    pre_kw = compose_terms(cfg, "pre", qdyn, kdyn, params) if cfg.pre_compose else None
    a = compose(scores, G, **pre_kw) if cfg.pre_compose else scores
    probs = masked_softmax(a, mask)
    post_kw = compose_terms(cfg, "post", qdyn, kdyn, params) if cfg.post_compose else None
    p = compose(probs, G, **post_kw) if cfg.post_compose else probs
    p = np.where(mask[:, None], p, 0.0)
    o = np.einsum("bnts,bsnh->btnh", p, v_h)

    # ---- backward ---------------------------------------------------------------
    grads: Dict[str, np.ndarray] = {}
    grads["output_kernel"] = np.einsum("btnh,bto->nho", o, g_y)
    if cfg.use_bias:
        grads["output_bias"] = g_y.sum(axis=(0, 1))
    g_o = np.einsum("bto,nho->btnh", g_y, params["output_kernel"])
    # masked entries of P were overwritten with 0, so they pass no gradient
    g_p = np.where(mask[:, None], np.einsum("btnh,bsnh->bnts", g_o, v_h), 0.0)
    g_v = _sum_repeated_heads(np.einsum("bnts,btnh->bsnh", p, g_o), rep)

    g_dyn = {"query": {}, "key": {}}                    # side -> slot -> entry -> gradient

    def scatter_terms(stage, terms):
        for term, g_term in terms.items():
            source = TERMS[term]                    # where the term is read from (spec.terms)
            if source.dynamic is None:
                grads["static_" + stage] = g_term
            else:
                # Accumulate: two terms may read the same dynamic weight.
                slot = g_dyn[source.side].setdefault(f"{stage}_{source.side}", {})
                slot[source.dynamic] = slot.get(source.dynamic, 0.0) + g_term

    g_probs = g_p
    if cfg.post_compose:
        g_probs, terms = compose_backward(probs, g_p, G, **post_kw)
        scatter_terms("post", terms)
    g_scores = masked_softmax_backward(probs, g_probs, mask)
    if cfg.pre_compose:
        g_scores, terms = compose_backward(scores, g_scores, G, **pre_kw)
        scatter_terms("pre", terms)
    g_scores = g_scores * inv_sqrt_d
    g_q = np.einsum("bnts,bsnh->btnh", g_scores, k_h)
    g_k = _sum_repeated_heads(np.einsum("bnts,btnh->bsnh", g_scores, q), rep)

    g_query = _qk_backward(params, cfg, query, "query", q_pos, q_lin, q_normed, g_q, grads)
    g_key = _qk_backward(params, cfg, key_in, "key", k_pos, k_lin, k_normed, g_k, grads)
    g_value = _linear_backward(params, cfg, value_in, "value", g_v, grads)

    # ---- dynamic weights -----------------------------------------------------------
    def side_backward(x, names, dw1, qkw, dd, g_side):
        return dynamic_weights_backward(x, dw1, qkw, dd, names, R, cfg.gelu_approximate, g_side)

    qs, ks = side_slots(cfg, "query"), side_slots(cfg, "key")
    if cfg.cross_attention:
        for prefix, x, names, side in (("query_", query, qs, "query"), ("key_", key_in, ks, "key")):
            if not names:
                continue
            g_x, g_dw1, g_qkw, g_dd = side_backward(
                x, names, params.get(prefix + "dw1"), params.get(prefix + "qkw"),
                params.get(prefix + "dd"), g_dyn[side])
            for n, gp in (("dw1", g_dw1), ("qkw", g_qkw), ("dd", g_dd)):
                if gp is not None:
                    grads[prefix + n] = gp
            if side == "query":
                g_query = g_query + g_x
            else:
                g_key = g_key + g_x
    elif slots(cfg):
        # One shared projection: each side reads its own slots of dw1/qkw/dd;
        # gradients of the two sides land on disjoint slots and add up.
        C, M = len(slots(cfg)), cfg.M
        dw1, qkw, dd = params.get("dw1"), params.get("qkw"), params.get("dd")
        g_dw1 = None if dw1 is None else np.zeros_like(dw1)
        g_qkw = None if qkw is None else np.zeros_like(qkw)
        g_dd4 = None if dd is None else np.zeros((dd.shape[0], G, C, M))
        for x, names, side in ((query, qs, "query"), (key_in, ks, "key")):
            if not names:
                continue
            idx = _self_attention_slices(cfg, names)
            sub_dd = None if dd is None else dd.reshape(-1, G, C, M)[:, :, idx].reshape(
                dd.shape[0], G, len(idx) * M)
            g_x, gs_dw1, gs_qkw, gs_dd = side_backward(
                x, names, None if dw1 is None else dw1[:, :, idx],
                None if qkw is None else qkw[:, idx], sub_dd, g_dyn[side])
            if dw1 is not None:
                g_dw1[:, :, idx] += gs_dw1
                g_qkw[:, idx] += gs_qkw
            if dd is not None:
                g_dd4[:, :, idx] += gs_dd.reshape(-1, G, len(idx), M)
            if side == "query":
                g_query = g_query + g_x
            else:
                g_key = g_key + g_x
        if dw1 is not None:
            grads["dw1"], grads["qkw"] = g_dw1, g_qkw
        if dd is not None:
            grads["dd"] = g_dd4.reshape(dd.shape)

    # ---- route the input gradients (Keras's defaults) -----------------------
    out: Dict[str, np.ndarray] = {}
    if key is None:                 # key is the value tensor
        g_value = g_value + g_key
    if value is None:               # value is the query tensor
        g_query = g_query + g_value
    out["query"] = g_query
    if value is not None:
        out["value"] = g_value
    if key is not None:
        out["key"] = g_key
    # A parameter the forward never reads has a zero gradient.
    for name, prm in params.items():
        out[name] = grads.get(name, np.zeros_like(prm))
    return out
