"""The executable DCMHA specification: a readable NumPy reference in float64.

Everything here follows ``spec/SPEC.md``; where the two disagree, SPEC.md is
wrong and must be fixed together with this file. Nothing in this module imports
a deep-learning framework. Shapes use the spec's letters:

    B batch, T query length, S key length, N query heads, N_kv key/value heads,
    G composition groups, M = N / G heads per group, d key (head) dim,
    d_v value head dim, D_q / D_kv query / key-value input width,
    D_out output width, R rank, K dynamic hidden width, C weight slots.

The forward functions are written for reading, not speed. The backward lives
in ``spec/reference_grad.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Mapping, Optional

import numpy as np

from . import terms
from .terms import stage_terms

SPEC_VERSION = "1.0.0"

#: The four dynamic-weight slots in the official order (C = 4 when all are on).
ALL_SLOTS = ("pre_query", "pre_key", "post_query", "post_key")
#: RMS-norm epsilon of the dynamic w1 weights (over the head axis M).
W1_NORM_EPS = 1e-6
#: RMS-norm epsilon of QK-norm (over the head dim d).
QK_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters of one DCMHA layer (the spec's switches).

    Argument names follow ``keras.layers.MultiHeadAttention`` where the meaning
    is the same; ``key_dim`` is the per-head query/key size ``d``.
    """

    num_heads: int
    key_dim: int
    value_dim: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    num_groups: int = 1
    rank: int = 2
    dynamic_hidden_dim: Optional[int] = None
    pre_compose: bool = True
    post_compose: bool = True
    query_wise: bool = True
    key_wise: bool = True
    dynamic_projection: bool = True
    dynamic_gating: bool = True
    static_compose: bool = False
    gelu_approximate: bool = True
    qk_norm: bool = False
    rope_max_wavelength: Optional[float] = None
    sliding_window: Optional[int] = None
    query_chunk_size: Optional[int] = None
    use_bias: bool = False
    cross_attention: bool = False

    # ---- derived sizes -------------------------------------------------
    @property
    def N(self) -> int:
        return self.num_heads

    @property
    def N_kv(self) -> int:
        return self.num_key_value_heads or self.num_heads

    @property
    def G(self) -> int:
        return self.num_groups

    @property
    def M(self) -> int:
        return self.num_heads // self.num_groups

    @property
    def R(self) -> int:
        return self.rank

    @property
    def d(self) -> int:
        return self.key_dim

    @property
    def d_v(self) -> int:
        return self.value_dim or self.key_dim

    @property
    def K(self) -> int:
        return self.dynamic_hidden_dim or 2 * self.rank * self.M

    def validate(self) -> "Config":
        for name in ("num_heads", "key_dim", "num_groups", "rank"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"`{name}` must be a positive integer. Received: {name}={v!r}")
        for name in ("value_dim", "num_key_value_heads", "dynamic_hidden_dim",
                     "sliding_window", "query_chunk_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0):
                raise ValueError(
                    f"`{name}` must be None or a positive integer. Received: {name}={v!r}")
        if self.num_heads % self.num_groups:
            raise ValueError(
                "`num_heads` must be divisible by `num_groups`. Received: "
                f"num_heads={self.num_heads}, num_groups={self.num_groups}")
        if self.num_heads % self.N_kv:
            raise ValueError(
                "`num_heads` must be divisible by `num_key_value_heads`. Received: "
                f"num_heads={self.num_heads}, num_key_value_heads={self.num_key_value_heads}")
        if self.rope_max_wavelength is not None:
            if self.rope_max_wavelength <= 0:
                raise ValueError("`rope_max_wavelength` must be None or positive. Received: "
                                 f"rope_max_wavelength={self.rope_max_wavelength!r}")
            if self.key_dim % 2:
                raise ValueError("RoPE needs an even `key_dim`. Received: "
                                 f"key_dim={self.key_dim}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Config":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"Unknown DCMHA config keys: {unknown}")
        return cls(**dict(d)).validate()


# ---------------------------------------------------------------------------
# Dynamic-weight slots and canonical parameters
# ---------------------------------------------------------------------------

def slots(cfg: Config) -> tuple:
    """Enabled slots, in the official order (a subset of ``ALL_SLOTS``).

    A slot ``<stage>_<side>`` exists when its stage (pre/post) is composed, its
    side is on (query_wise/key_wise) and at least one dynamic term (projection
    or gating) is on. With everything on this is the official C = 4 layout.
    """
    if not (cfg.dynamic_projection or cfg.dynamic_gating):
        return ()
    out = []
    for slot in ALL_SLOTS:
        stage, side = slot.split("_")
        stage_on = cfg.pre_compose if stage == "pre" else cfg.post_compose
        side_on = cfg.query_wise if side == "query" else cfg.key_wise
        if stage_on and side_on:
            out.append(slot)
    return tuple(out)


def side_slots(cfg: Config, side: str) -> tuple:
    """Enabled slots of one side ("query" or "key"), in order [pre, post]."""
    return tuple(s for s in slots(cfg) if s.endswith("_" + side))


def param_shapes(cfg: Config, query_input_dim: int, key_input_dim: int,
                 output_dim: Optional[int] = None) -> Dict[str, tuple]:
    """Canonical parameter names and shapes (the table of SPEC.md section 3)."""
    D_q, D_kv = query_input_dim, key_input_dim
    D_out = output_dim or D_q
    N, N_kv, G, M, R, K, d, d_v = cfg.N, cfg.N_kv, cfg.G, cfg.M, cfg.R, cfg.K, cfg.d, cfg.d_v
    shapes = {
        "query_kernel": (D_q, N, d),
        "key_kernel": (D_kv, N_kv, d),
        "value_kernel": (D_kv, N_kv, d_v),
        "output_kernel": (N, d_v, D_out),
    }
    if cfg.use_bias:
        shapes.update(query_bias=(N, d), key_bias=(N_kv, d), value_bias=(N_kv, d_v),
                      output_bias=(D_out,))

    def dyn(prefix: str, width: int, C: int):
        if C == 0:
            return
        if cfg.dynamic_projection:
            shapes[prefix + "dw1"] = (width, G, C, K)
            shapes[prefix + "qkw"] = (G, C, K, 2 * R, M)
        if cfg.dynamic_gating:
            shapes[prefix + "dd"] = (width, G, C * M)

    if cfg.cross_attention:
        dyn("query_", D_q, len(side_slots(cfg, "query")))
        dyn("key_", D_kv, len(side_slots(cfg, "key")))
    else:
        if slots(cfg) and D_q != D_kv:
            raise ValueError(
                "Self-attention dynamic weights share one projection, so the query and "
                f"key inputs must have the same width. Received: {D_q} and {D_kv}; "
                "use cross_attention=True for separate projections.")
        dyn("", D_q, len(slots(cfg)))
    if cfg.static_compose:
        if cfg.pre_compose:
            shapes["static_pre"] = (G, M, M)
        if cfg.post_compose:
            shapes["static_post"] = (G, M, M)
    if cfg.qk_norm:
        shapes["query_norm_scale"] = (d,)
        shapes["key_norm_scale"] = (d,)
    return shapes


def init_params(cfg: Config, query_input_dim: int, key_input_dim: int,
                output_dim: Optional[int] = None, rng: Optional[np.random.Generator] = None,
                scale: float = 1.0) -> Dict[str, np.ndarray]:
    """Parameters with the spec's initialisation (SPEC.md section 9).

    ``scale`` multiplies the standard deviation of the composition weights
    (dw1, qkw, dd, static). The fixtures use ``scale`` > 1 so that composition
    is far from the identity and a wrong compose is caught.
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    shapes = param_shapes(cfg, query_input_dim, key_input_dim, output_dim)
    M, R, K = cfg.M, cfg.R, cfg.K
    out = {}
    for name, shape in shapes.items():
        base = next((b for b in ("dw1", "qkw", "dd") if name == b or name.endswith("_" + b)), name)
        if name.endswith("kernel"):
            fan_in = shape[0] if name != "output_kernel" else shape[0] * shape[1]
            fan_out = int(np.prod(shape)) // fan_in
            limit = math.sqrt(6.0 / (fan_in + fan_out))  # Glorot uniform
            out[name] = rng.uniform(-limit, limit, size=shape)
        elif name.endswith("bias"):
            out[name] = np.zeros(shape)
        elif base == "dw1":
            out[name] = rng.normal(0.0, math.sqrt(2.0 / (shape[0] + K)) * scale, size=shape)
        elif base == "qkw":
            out[name] = rng.normal(0.0, math.sqrt(1.0 / K) * 2.0 / (M + R) * 0.01 * scale, size=shape)
        elif base == "dd":
            out[name] = rng.normal(0.0, math.sqrt(2.0 / (shape[0] + M)) * 0.005 * scale, size=shape)
        elif name.startswith("static_"):
            out[name] = rng.normal(0.0, math.sqrt(1.0 / M) * 0.1 * scale, size=shape)
        elif name.endswith("norm_scale"):
            out[name] = np.ones(shape)
        else:  # pragma: no cover - every canonical name is handled above
            raise AssertionError(name)
    return out


# ---------------------------------------------------------------------------
# Elementwise pieces
# ---------------------------------------------------------------------------

def gelu(x: np.ndarray, approximate: bool = True) -> np.ndarray:
    """GELU: tanh approximation (JAX training code) or exact erf (PyTorch code)."""
    if approximate:
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + np.tanh(c * (x + 0.044715 * x ** 3)))
    from math import erf
    return 0.5 * x * (1.0 + np.vectorize(erf, otypes=[np.float64])(x / math.sqrt(2.0)))


def rms_normalize(x: np.ndarray, eps: float, axis: int = -1) -> np.ndarray:
    """x / sqrt(mean(x**2, axis) + eps), without a learned scale."""
    return x / np.sqrt(np.mean(x * x, axis=axis, keepdims=True) + eps)


def rope(x: np.ndarray, positions: np.ndarray, max_wavelength: float) -> np.ndarray:
    """Rotary embedding, rotate-half layout: pairs (i, i + d/2).

    x: (B, L, H, d); positions: (L,) absolute positions.
    """
    d = x.shape[-1]
    half = d // 2
    inv_freq = max_wavelength ** (-np.arange(half, dtype=np.float64) * 2.0 / d)  # (d/2,)
    angle = positions.astype(np.float64)[:, None] * inv_freq[None, :]           # (L, d/2)
    cos = np.cos(angle)[None, :, None, :]
    sin = np.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ---------------------------------------------------------------------------
# Dynamic weight projection
# ---------------------------------------------------------------------------

def dynamic_weights(x: np.ndarray, dw1: Optional[np.ndarray], qkw: Optional[np.ndarray],
                    dd: Optional[np.ndarray], slot_names: tuple, rank: int,
                    gelu_approximate: bool = True) -> Dict[str, Dict[str, np.ndarray]]:
    """Input-dependent composition weights for the given slots.

    x: (B, L, D); dw1: (D, G, C, K); qkw: (G, C, K, 2R, M); dd: (D, G, C*M), with
    C = len(slot_names). Returns ``{slot: {"w1": (B,L,G,R,M), "w2": (B,L,G,R,M),
    "dd": (B,L,G,M)}}``; "w1"/"w2" only with a projection, "dd" only with gating.
    """
    out: Dict[str, Dict[str, np.ndarray]] = {s: {} for s in slot_names}
    C = len(slot_names)
    if C == 0:  # a side with no enabled slot (e.g. key_wise=False) has no weights
        return out
    if dw1 is not None:
        h = gelu(np.einsum("bld,dgck->blgck", x, dw1), gelu_approximate)     # (B,L,G,C,K)
        w = np.einsum("blgck,gckrm->blgcrm", h, qkw)                          # (B,L,G,C,2R,M)
        w1 = rms_normalize(w[..., :rank, :], W1_NORM_EPS, axis=-1)
        w2 = w[..., rank:, :]
        for c, s in enumerate(slot_names):
            out[s]["w1"] = w1[:, :, :, c]
            out[s]["w2"] = w2[:, :, :, c]
    if dd is not None:
        G = dd.shape[1]
        g = np.tanh(np.einsum("bld,dgn->blgn", x, dd))                        # (B,L,G,C*M)
        g = g.reshape(g.shape[:3] + (C, -1))                                  # (B,L,G,C,M)
        for c, s in enumerate(slot_names):
            out[s]["dd"] = g[:, :, :, c]
    return out


# ---------------------------------------------------------------------------
# Compose
# ---------------------------------------------------------------------------

def compose(a: np.ndarray, num_groups: int, *, qw1=None, qw2=None, kw1=None, kw2=None,
            qdd=None, kdd=None, static=None) -> np.ndarray:
    """Mix the heads of ``a`` (B, N, T, S) within each of G groups.

    qw1, qw2: (B, T, G, R, M); kw1, kw2: (B, S, G, R, M); qdd: (B, T, G, M);
    kdd: (B, S, G, M); static: (G, M, M). Any term may be None (switched off).
    Every term reads the input ``a``, never a partial sum:

        out[n] = a[n] + sum_m a[m] W[g,m,n]
               + sum_r (sum_m a[m] qw1[t,r,m]) qw2[t,r,n]
               + sum_r (sum_m a[m] kw1[s,r,m]) kw2[s,r,n]
               + a[n] qdd[t,n] + a[n] kdd[s,n]
    """
    B, N, T, S = a.shape
    G = num_groups
    M = N // G
    x = a.reshape(B, G, M, T, S)
    out = x.copy()
    if static is not None:
        out = out + np.einsum("bgmts,gmn->bgnts", x, static)
    if qw1 is not None:
        hidden = np.einsum("bgmts,btgrm->bgrts", x, qw1)
        out = out + np.einsum("bgrts,btgrn->bgnts", hidden, qw2)
    if kw1 is not None:
        hidden = np.einsum("bgmts,bsgrm->bgrts", x, kw1)
        out = out + np.einsum("bgrts,bsgrn->bgnts", hidden, kw2)
    if qdd is not None:
        out = out + x * qdd.transpose(0, 2, 3, 1)[..., :, None]     # (B,G,M,T,1)
    if kdd is not None:
        out = out + x * kdd.transpose(0, 2, 3, 1)[..., None, :]     # (B,G,M,1,S)
    return out.reshape(B, N, T, S)


def compose_matrices(num_groups: int, T: int, S: int, B: int, N: int, *, qw1=None, qw2=None,
                     kw1=None, kw2=None, qdd=None, kdd=None, static=None) -> np.ndarray:
    """The per-(b,t,s) N x N block-diagonal matrix W_ts of compose (for tests).

    Returns W: (B, T, S, N, N) such that compose(a)[b,:,t,s] = W[b,t,s].T @ a[b,:,t,s].
    """
    G = num_groups
    M = N // G
    W = np.zeros((B, T, S, N, N))
    for g in range(G):
        blk = np.broadcast_to(np.eye(M), (B, T, S, M, M)).copy()
        if static is not None:
            blk += static[g]
        if qw1 is not None:
            blk += np.einsum("btrm,btrn->btmn", qw1[:, :, g], qw2[:, :, g])[:, :, None]
        if kw1 is not None:
            blk += np.einsum("bsrm,bsrn->bsmn", kw1[:, :, g], kw2[:, :, g])[:, None]
        diag = np.zeros((B, T, S, M))
        if qdd is not None:
            diag += qdd[:, :, None, g]
        if kdd is not None:
            diag += kdd[:, None, :, g]
        blk += diag[..., :, None] * np.eye(M)
        W[..., g * M:(g + 1) * M, g * M:(g + 1) * M] = blk
    return W


def compose_terms(cfg: Config, stage: str, qdyn: Mapping, kdyn: Mapping,
                  params: Mapping) -> dict:
    """Keyword arguments of ``compose`` for one stage ("pre" or "post").

    qdyn / kdyn: the dynamic weights of the query / key side, keyed by slot.
    """
    return stage_terms(stage, qdyn, kdyn,
                       params["static_" + stage] if cfg.static_compose else None)


def make_mask(B: int, T: int, S: int, *, attention_mask: Optional[np.ndarray] = None,
              use_causal_mask: bool = False, sliding_window: Optional[int] = None,
              query_offset: int = 0) -> np.ndarray:
    """The boolean (B, T, S) mask, True = attend.

    Query t sits at absolute position pos(t) = ``query_offset + t``; key s at
    position s. ``attention_mask`` broadcasts to (B, T, S). Causal: s <= pos(t).
    Sliding window W alone is the band |pos(t) - s| < W (Keras's convention);
    with the causal mask that is pos(t) - W < s <= pos(t), the W keys ending at
    pos(t), itself included.
    """
    mask = np.ones((B, T, S), dtype=bool)
    t = query_offset + np.arange(T)[:, None]
    s = np.arange(S)[None, :]
    if attention_mask is not None:
        mask &= np.broadcast_to(np.asarray(attention_mask, dtype=bool), (B, T, S))
    rule = terms.visible(t, s, causal=bool(use_causal_mask), window=sliding_window)
    if rule is not True:
        mask &= rule[None]
    return mask


def masked_softmax(a: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Softmax over S of the allowed entries; masked entries and fully masked rows are 0.

    a: (B, N, T, S); mask: (B, T, S) (shared by all heads).
    """
    m = mask[:, None]
    amax = np.max(np.where(m, a, -np.inf), axis=-1, keepdims=True)
    amax = np.where(np.isfinite(amax), amax, 0.0)
    e = np.where(m, np.exp(np.where(m, a, amax) - amax), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    return e / np.where(denom == 0.0, 1.0, denom)


# ---------------------------------------------------------------------------
# Projections
# ---------------------------------------------------------------------------

def project_qkv(params: Mapping, cfg: Config, query: np.ndarray, key: np.ndarray,
                value: np.ndarray, query_positions: np.ndarray, key_positions: np.ndarray):
    """q (B,T,N,d), k (B,S,N_kv,d), v (B,S,N_kv,d_v) after bias, QK-norm and RoPE."""
    q = np.einsum("btd,dnh->btnh", query, params["query_kernel"])
    k = np.einsum("bsd,dnh->bsnh", key, params["key_kernel"])
    v = np.einsum("bsd,dnh->bsnh", value, params["value_kernel"])
    if cfg.use_bias:
        q = q + params["query_bias"]
        k = k + params["key_bias"]
        v = v + params["value_bias"]
    if cfg.qk_norm:
        q = rms_normalize(q, QK_NORM_EPS) * params["query_norm_scale"]
        k = rms_normalize(k, QK_NORM_EPS) * params["key_norm_scale"]
    if cfg.rope_max_wavelength is not None:
        q = rope(q, query_positions, cfg.rope_max_wavelength)
        k = rope(k, key_positions, cfg.rope_max_wavelength)
    return q, k, v


def dynamic_weights_both_sides(params: Mapping, cfg: Config, query: np.ndarray,
                               key: np.ndarray):
    """(query-side, key-side) dynamic weights, each ``{slot: {...}}``.

    Self-attention: one projection (dw1, qkw, dd with C = len(slots)); its query
    slots read the query input and its key slots the key input (the same tensor
    in self-attention). Cross-attention: query_* on the query input, key_* on
    the key input.
    """
    qs, ks = side_slots(cfg, "query"), side_slots(cfg, "key")
    if cfg.cross_attention:
        def side(prefix, x, names):
            return dynamic_weights(x, params.get(prefix + "dw1"), params.get(prefix + "qkw"),
                                   params.get(prefix + "dd"), names, cfg.R, cfg.gelu_approximate)
        return side("query_", query, qs), side("key_", key, ks)
    all_slots = slots(cfg)

    def select(x, names):
        idx = [all_slots.index(s) for s in names]
        dw1 = params.get("dw1")
        qkw = params.get("qkw")
        dd = params.get("dd")
        if dw1 is not None:
            dw1, qkw = dw1[:, :, idx], qkw[:, idx]
        if dd is not None:
            G = dd.shape[1]
            dd = dd.reshape(dd.shape[0], G, len(all_slots), cfg.M)[:, :, idx].reshape(
                dd.shape[0], G, len(idx) * cfg.M)
        return dynamic_weights(x, dw1, qkw, dd, names, cfg.R, cfg.gelu_approximate)

    return select(query, qs), select(key, ks)


# ---------------------------------------------------------------------------
# The attention step
# ---------------------------------------------------------------------------

def attend(cfg: Config, params: Mapping, q, k, v, qdyn, kdyn, mask):
    """Scores -> pre-compose -> mask -> softmax -> post-compose -> zero masked -> P.V.

    q: (B,T,N,d); k: (B,S,N_kv,d); v: (B,S,N_kv,d_v); mask: (B,T,S).
    Returns (o (B,T,N,d_v), intermediates).
    """
    rep = cfg.N // cfg.N_kv
    k_h = np.repeat(k, rep, axis=2)          # query head h reads kv head h // rep
    v_h = np.repeat(v, rep, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k_h) / math.sqrt(cfg.d)
    a = scores
    if cfg.pre_compose:
        a = compose(a, cfg.G, **compose_terms(cfg, "pre", qdyn, kdyn, params))
    probs = masked_softmax(a, mask)
    p = probs
    if cfg.post_compose:
        p = compose(p, cfg.G, **compose_terms(cfg, "post", qdyn, kdyn, params))
    p = np.where(mask[:, None], p, 0.0)
    o = np.einsum("bnts,bsnh->btnh", p, v_h)
    return o, {"scores": scores, "pre_composed": a, "probs": probs, "post_composed": p}


def attention(params: Mapping, cfg: Config, query: np.ndarray, key: Optional[np.ndarray] = None,
              value: Optional[np.ndarray] = None, *, attention_mask: Optional[np.ndarray] = None,
              use_causal_mask: bool = False, return_intermediates: bool = False):
    """The full DCMHA layer: (B,T,D_q) x (B,S,D_kv) -> (B,T,D_out), in float64.

    ``key`` defaults to ``value`` and ``value`` to ``query`` (Keras's rule).
    With ``cfg.query_chunk_size`` the queries are processed in chunks; the
    result does not depend on the chunk size.
    """
    cfg = cfg.validate()
    query = np.asarray(query, np.float64)
    value = query if value is None else np.asarray(value, np.float64)
    key = value if key is None else np.asarray(key, np.float64)
    params = {n: np.asarray(p, np.float64) for n, p in params.items()}
    B, T, _ = query.shape
    S = key.shape[1]
    mask = make_mask(B, T, S, attention_mask=attention_mask, use_causal_mask=use_causal_mask,
                     sliding_window=cfg.sliding_window)
    q, k, v = project_qkv(params, cfg, query, key, value, np.arange(T), np.arange(S))
    qdyn, kdyn = dynamic_weights_both_sides(params, cfg, query, key)
    chunk = cfg.query_chunk_size or T
    outs, inters = [], []
    for t0 in range(0, T, chunk):
        sl = slice(t0, t0 + chunk)
        qdyn_c = {s: {n: w[:, sl] for n, w in ws.items()} for s, ws in qdyn.items()}
        o_c, inter_c = attend(cfg, params, q[:, sl], k, v, qdyn_c, kdyn, mask[:, sl])
        outs.append(o_c)
        inters.append(inter_c)
    o = np.concatenate(outs, axis=1)
    y = np.einsum("btnh,nho->bto", o, params["output_kernel"])
    if cfg.use_bias:
        y = y + params["output_bias"]
    if not return_intermediates:
        return y
    inter = {n: np.concatenate([ic[n] for ic in inters], axis=2) for n in inters[0]}
    inter.update(mask=mask, q=q, k=k, v=v, o=o, query_dynamic=qdyn, key_dynamic=kdyn)
    return y, inter


# ---------------------------------------------------------------------------
# Decoding with a cache
# ---------------------------------------------------------------------------

def cache_shapes(cfg: Config, batch: int, max_length: int) -> Dict[str, tuple]:
    """Shapes of the decoding cache: keys, values and the key-side dynamic weights.

    Keys are stored after QK-norm and RoPE (at their absolute positions). With
    C_k enabled key slots (``pre_key``, ``post_key``, in that order) the cache
    holds ``key_w`` (B, S_max, 2 C_k, G, R, M) with a projection ([w1, w2] of
    each slot along axis 2) and ``key_dd`` (B, S_max, C_k, G, M) with gating
    (``terms.KEY_CACHE``; ``pack_key_weights`` / ``unpack_key_weights``).
    """
    B, L = batch, max_length
    shapes = {"key": (B, L, cfg.N_kv, cfg.d), "value": (B, L, cfg.N_kv, cfg.d_v)}
    C_k = len(side_slots(cfg, "key"))
    if C_k and cfg.dynamic_projection:
        shapes["key_w"] = (B, L, 2 * C_k, cfg.G, cfg.R, cfg.M)
    if C_k and cfg.dynamic_gating:
        shapes["key_dd"] = (B, L, C_k, cfg.G, cfg.M)
    return shapes


def _unstack(a: np.ndarray, axis: int, num: int):
    return [np.take(a, j, axis) for j in range(num)]


def init_cache(cfg: Config, batch: int, max_length: int) -> Dict[str, np.ndarray]:
    """An all-zero cache for ``max_length`` key positions."""
    return {n: np.zeros(s) for n, s in cache_shapes(cfg, batch, max_length).items()}


def decode_step(params: Mapping, cfg: Config, query: np.ndarray, cache: Mapping,
                cache_update_index: int, *, attention_mask: Optional[np.ndarray] = None):
    """Self-attention on new tokens ``query`` (B, T_new, D) at positions
    ``cache_update_index + arange(T_new)``, reading and updating ``cache``.

    The new keys, values and key-side dynamic weights are written at those
    positions; queries attend causally (and within the sliding window) to the
    cache, so positions past the last written one are never read.
    ``attention_mask`` (B, T_new, S_max), if given, is combined with that.
    Returns (output (B, T_new, D_out), new cache); the input cache is not changed.
    """
    cfg = cfg.validate()
    if cfg.cross_attention:
        raise ValueError("decode_step is defined for self-attention (cross_attention=False).")
    query = np.asarray(query, np.float64)
    params = {n: np.asarray(p, np.float64) for n, p in params.items()}
    B, T, _ = query.shape
    S = cache["key"].shape[1]
    i = int(cache_update_index)
    if i < 0 or i + T > S:
        raise ValueError(f"cache_update_index + new length must fit the cache length {S}. "
                         f"Received: cache_update_index={i}, new length={T}")
    pos = i + np.arange(T)
    q, k, v = project_qkv(params, cfg, query, query, query, pos, pos)
    qdyn, kdyn_new = dynamic_weights_both_sides(params, cfg, query, query)
    new = {n: np.array(c, np.float64, copy=True) for n, c in cache.items()}
    new["key"][:, i:i + T] = k
    new["value"][:, i:i + T] = v
    slots_k = side_slots(cfg, "key")
    for n, w in terms.pack_key_weights(kdyn_new, slots_k, stack=np.stack).items():
        new[n][:, i:i + T] = w
    kdyn = terms.unpack_key_weights(new, slots_k, unstack=_unstack)
    mask = make_mask(B, T, S, attention_mask=attention_mask, use_causal_mask=True,
                     sliding_window=cfg.sliding_window, query_offset=i)
    o, _ = attend(cfg, params, q, new["key"], new["value"], qdyn, kdyn, mask)
    y = np.einsum("btnh,nho->bto", o, params["output_kernel"])
    if cfg.use_bias:
        y = y + params["output_bias"]
    return y, new
