"""The functional DCMHA core on ``keras.ops`` (usable without the layer).

Shapes use the spec's letters (see ``dcmha.spec.reference``): B batch, T query
length, S key length, N query heads, N_kv key/value heads, G groups, M = N / G,
d head dim, d_v value head dim, R rank, K dynamic hidden width, C slots.

Everything that touches attention weights runs in float32 whatever the input
dtype: the scores, both compositions, the softmax and P.V. Inputs of another
dtype are cast up; the caller casts the result back.

Composition weights of one stage ("pre" or "post") are passed as a dict of
``reference.compose`` keyword arguments (any subset of ``qw1, qw2, qdd`` on the
query side, ``kw1, kw2, kdd`` on the key side and ``static``); an empty dict or
``None`` means the stage is the identity and is skipped.

``dcmha_attention`` is the one attention core; it dispatches on
``implementation`` through ``IMPLEMENTATIONS`` so that fast paths can be
registered next to the plain ``keras.ops`` one.

Performance notes (the plain path, measured with benchmarks/layer_step.py):
compose runs in the query-major layout (B, T, G, M, S) as two batched matmuls
with small (M x M) matrices that fold every term, the residual included;
queries are processed in blocks whose (B, N, chunk, S) tensors stay in CPU
cache, and blocks skip the keys a causal mask or window hides.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import keras
from keras import ops

from dcmha import backend as seam
from dcmha import call as dcall
from dcmha import registry
from dcmha.call import _fits  # shape matches; None (unknown / free) matches anything
from dcmha.call import check_positive_int as _check_positive_int
from dcmha.call import shape_of as _shape
from dcmha.spec import terms as spec_terms

W1_NORM_EPS = 1e-6
QK_NORM_EPS = 1e-6
# A finite "minus infinity" (``dcmha.spec.terms.MASKED_SCORE``): a fully masked
# row stays finite through softmax (it becomes uniform and is zeroed afterwards).
_MASKED = spec_terms.MASKED_SCORE


_ALL_SLOTS = ("pre_query", "pre_key", "post_query", "post_key")


# ---------------------------------------------------------------------------
# Small pieces
# ---------------------------------------------------------------------------

def rms_normalize(x, eps, scale=None):
    """x / sqrt(mean(x**2, -1) + eps), times ``scale`` if given."""
    y = x * ops.rsqrt(ops.mean(ops.square(x), axis=-1, keepdims=True) + eps)
    return y if scale is None else y * scale


#: dtype object -> Keras's name for it (``keras.backend.standardize_dtype`` costs more
#: than the cast it would save on a hot path; the dtype objects of a process are few).
_DTYPE_NAMES = {}


def dtype_name(dtype):
    """Keras's name of a dtype object (cached)."""
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):            # TypeError: an unhashable dtype object
        name = keras.backend.standardize_dtype(dtype)
        try:
            _DTYPE_NAMES[dtype] = name
        except TypeError:
            pass
        return name


def as_dtype(x, dtype):
    """``ops.cast(x, dtype)``, skipped when ``x`` already has ``dtype`` (even a cast that
    changes nothing costs a Keras op per call in eager PyTorch: a decoding step has
    dozens of them). Anything but a backend tensor (a ``keras.Variable``, a NumPy array)
    is always cast: callees get a backend tensor."""
    if keras.ops.is_tensor(x) and dtype_name(x.dtype) == dtype:
        return x
    return ops.cast(x, dtype)


def stack(arrays, axis):
    """``ops.stack`` (the backend's own op where that is cheaper: ``dcmha.backend``)."""
    return seam.stack(arrays, axis)


def unstack(x, axis, num):
    """The ``num`` slices of x along ``axis``: ``ops.unstack`` (the backend's own views
    where that is cheaper: ``dcmha.backend``)."""
    return seam.unstack(x, axis, num)


def write_slice(entry, index, update):
    """``entry`` with ``update`` written at [:, index:index + n] (a new tensor; ``entry``
    is unchanged), cast to ``entry``'s dtype: ``ops.slice_update``, or the backend's own
    eager write (``dcmha.backend.eager_slice_write``)."""
    update = as_dtype(update, dtype_name(entry.dtype))
    out = seam.eager_slice_write(entry, index, update)
    if out is not None:
        return out
    start = [0, index] + [0] * (len(entry.shape) - 2)
    return ops.slice_update(entry, start, update)


def cache_writer(index, new_length, batch):
    """A function ``write(entry, update)`` for one step's cache entries: ``entry`` (B,
    S_max, ...) with ``update`` (B, new_length, ...) written at [:, index:index +
    new_length] (a new tensor; ``entry`` is unchanged), cast to ``entry``'s dtype.

    ``index`` must be in [0, S_max - new_length] (the layer checks a known index and
    clamps a traced one). A backend may build the writes once for all of a step's
    entries (``dcmha.backend.cache_writer``); otherwise each write is ``write_slice``.
    """
    writer = seam.cache_writer(index, new_length, batch)
    return writer or (lambda entry, update: write_slice(entry, index, update))


def arange_int32(start, stop):
    """int32 [start, stop), also when ``stop - start`` is an exporter's symbolic size
    (``dcmha.backend.arange_int32``)."""
    return seam.arange_int32(start, stop)


def rope(x, positions, max_wavelength):
    """Rotary embedding, rotate-half layout (pairs (i, i + d/2)).

    x: (B, L, H, d) float32; positions: (L,) absolute positions (int or float
    tensor; may be offset by a traced ``cache_update_index``).
    """
    if len(x.shape) != 4 or (x.shape[-1] is not None and x.shape[-1] % 2):
        raise ValueError("`x` must have rank 4 (B, L, H, d) with an even d. "
                         f"Received: x.shape={_shape(x)}")
    if len(positions.shape) != 1 or not _fits(_shape(positions), (x.shape[1],)):
        raise ValueError(f"`positions` must have shape (L,) = ({x.shape[1]},). "
                         f"Received: positions.shape={_shape(positions)}")
    d = x.shape[-1]
    half = d // 2
    inv_freq = ops.power(float(max_wavelength),
                         -ops.arange(0, half, dtype="float32") * (2.0 / d))
    angle = ops.cast(positions, "float32")[:, None] * inv_freq[None, :]   # (L, d/2)
    cos = ops.cos(angle)[None, :, None, :]
    sin = ops.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return ops.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ---------------------------------------------------------------------------
# Dynamic weights
# ---------------------------------------------------------------------------

def dynamic_weights(x, dw1=None, qkw=None, dd=None, *, slots, rank, gelu_approximate=True,
                    check=True):
    """Input-dependent composition weights, in float32.

    Args:
        x: (B, L, D) input of the side (query or key).
        dw1: (D, G, C, K) or None; qkw: (G, C, K, 2R, M) or None (projection).
        dd: (D, G, C*M) or None (gating). C = len(slots).
        slots: slot names, in the order of the C axis.
        rank: R.
        check: validate the arguments' shapes (``DynamicWeightProjection``, which
            created the weights, passes False: the checks cost a decoding step
            more than the arithmetic).

    Returns:
        ``{slot: {"w1": (B, L, G, R, M), "w2": (B, L, G, R, M), "dd": (B, L, G, M)}}``;
        "w1"/"w2" only with a projection, "dd" only with gating.
    """
    if check:
        _check_dynamic_args(x, dw1, qkw, dd, slots, rank)
    weights = [w.value if isinstance(w, keras.Variable) else w for w in (dw1, qkw, dd)]
    C = len(slots)
    split = seam.step_dynamic_weights(x, *weights, C=C, rank=rank,
                                      gelu_approximate=gelu_approximate)
    if split is None:
        stacked = plain_dynamic_weights(x, dw1, qkw, dd, C=C, rank=rank,
                                        gelu_approximate=gelu_approximate)
        split = {n: ops.unstack(a, C, axis=3) for n, a in stacked.items()}
    return _by_slot(split, slots)


def _by_slot(split, slots):
    """{slot: {name: array}} from {name: [one array per slot, in ``slots``' order]}."""
    out = {s: {} for s in slots}
    for name, arrays in split.items():       # the C axis (3) split: one array per slot
        for s, a_s in zip(slots, arrays):
            out[s][name] = a_s
    return out


def fused_query_projection(x, kernel, bias, dw1, qkw, dd, *, slots, rank,
                           gelu_approximate=True):
    """A decoding step's query projection and ``dynamic_weights`` from one matrix product
    of x (B, L, D) with [kernel | dw1 | dd], where the backend has it
    (``dcmha.backend.fused_query_projection``), else None.

    kernel (D, N, d), bias (N, d) or None: the query projection (``EinsumDense``'s
    weights). Returns (x . kernel + bias as (B, L, N, d) float32, ``dynamic_weights``'
    dict)."""
    weights = [w.value if isinstance(w, keras.Variable) else w
               for w in (kernel, bias, dw1, qkw, dd)]
    out = seam.fused_query_projection(x, *weights, C=len(slots), rank=rank,
                                      gelu_approximate=gelu_approximate)
    if out is None:
        return None
    q, stacked = out
    return q, _by_slot({n: seam.unstack(a, 3, len(slots)) for n, a in stacked.items()}, slots)


def plain_dynamic_weights(x, dw1, qkw, dd, *, C, rank, gelu_approximate):
    """``dynamic_weights`` before the split into slots, with ``keras.ops``:
    {"w1", "w2": (B, L, G, C, R, M), "dd": (B, L, G, C, M)} (those present)."""
    x = as_dtype(x, "float32")
    out = {}
    if dw1 is not None:
        h = ops.gelu(ops.einsum("bld,dgck->blgck", x, as_dtype(dw1, "float32")),
                     approximate=gelu_approximate)
        # qkw first: with h first, XLA (jax) copies qkw into a transposed layout at every
        # call (for a decoding step, a copy of the weight per step).
        w = ops.einsum("gckrm,blgck->blgcrm", as_dtype(qkw, "float32"), h)
        out["w1"] = rms_normalize(w[..., :rank, :], W1_NORM_EPS)
        out["w2"] = w[..., rank:, :]
    if dd is not None:
        D, G, CM = dd.shape
        dd4 = ops.reshape(as_dtype(dd, "float32"), (D, G, C, CM // C))
        out["dd"] = ops.tanh(ops.einsum("bld,dgcm->blgcm", x, dd4))
    return out


def _check_dynamic_args(x, dw1, qkw, dd, slots, rank):
    if len(x.shape) != 3:
        raise ValueError(f"`x` must have rank 3 (B, L, D). Received: x.shape={_shape(x)}")
    if (isinstance(slots, str) or not isinstance(slots, (tuple, list)) or not slots
            or any(sl not in _ALL_SLOTS for sl in slots)):
        raise ValueError(f"`slots` must be a sequence of slot names from {_ALL_SLOTS}. "
                         f"Received: slots={slots!r}")
    _check_positive_int("rank", rank)
    if (dw1 is None) != (qkw is None):
        got = lambda n, w: f"{n}=None" if w is None else f"{n}.shape={_shape(w)}"
        raise ValueError("`dw1` and `qkw` must be given together. "
                         f"Received: {got('dw1', dw1)}, {got('qkw', qkw)}")
    D, C = x.shape[-1], len(slots)
    if dw1 is not None:
        if not _fits(_shape(dw1), (D, None, C, None)):
            raise ValueError(f"`dw1` must have shape (D, G, C, K) = ({D}, G, {C}, K) (D: the "
                             "width of `x`, C: the number of slots). "
                             f"Received: dw1.shape={_shape(dw1)}")
        G, K = dw1.shape[1], dw1.shape[3]
        if not _fits(_shape(qkw), (G, C, K, 2 * rank, None)):
            raise ValueError(f"`qkw` must have shape (G, C, K, 2R, M) = ({G}, {C}, {K}, "
                             f"{2 * rank}, M). Received: qkw.shape={_shape(qkw)}")
    if dd is not None:
        G = "G" if dw1 is None else dw1.shape[1]
        shape = _shape(dd)
        if (len(shape) != 3 or not _fits(shape[:1], (D,))
                or (dw1 is not None and not _fits(shape[1:2], (G,)))
                or (shape[2] is not None and shape[2] % C)):
            raise ValueError(f"`dd` must have shape (D, G, C*M) = ({D}, {G}, {C}*M). "
                             f"Received: dd.shape={shape}")


#: The ``compose`` keyword arguments of one stage (``dcmha.spec.terms.stage_terms``).
stage_terms = spec_terms.stage_terms


# ---------------------------------------------------------------------------
# Compose
# ---------------------------------------------------------------------------

def _eye32(m):
    return ops.eye(m, dtype="float32")


def query_compose_matrix(terms, num_heads_per_group):
    """The query-side factor of compose alone (``compose_matrices``' wq): float32,
    (B, T, G, M, M) (or (G, M, M) with static terms only), or None without
    query-factor terms."""
    return spec_terms.compose_factors(terms, num_heads_per_group, einsum=ops.einsum,
                                      eye=_eye32, factors=("query",))[0]


def compose_matrices(terms, num_heads_per_group):
    """The two small factors of compose, in float32 (M = ``num_heads_per_group``).

    Returns (wq, wk), each transposed, [.., n, m]: wq = I + the query-factor terms
    (static, qw1 qw2, diag(qdd)), (B, T, G, M, M), or (G, M, M) with static terms
    only, or None without them (the residual is then added as is); wk = the
    key-factor terms (kw1 kw2, diag(kdd)), (B, S, G, M, M), or None. The
    arithmetic of each term is its einsum in ``dcmha.spec.terms.COMPOSE_TERMS``
    (``compose_factors``), so a new term needs no change here. Neither factor has
    an S (resp. T) axis, so folding every term and the residual into them costs
    nothing and leaves one contraction with the big tensor per side.
    """
    return spec_terms.compose_factors(terms, num_heads_per_group, einsum=ops.einsum,
                                      eye=_eye32)


def _compose_qm(x, wq, wk):
    """Compose on the query-major view x: (B, T, G, M, S) -> same (float32).

    The query side is one batched (M x M) @ (M x S) matmul per (b, t, g); the
    key side the same on the transposed view (B, S, G, M, T). A matmul per
    side beats low-rank broadcasts on every backend (measured: CPU training
    step, benchmarks/layer_step.py), and reads the big tensor once per side.
    """
    out = x if wq is None else ops.matmul(wq, x)
    if wk is not None:
        xk = ops.transpose(x, (0, 4, 2, 3, 1))                          # (B, S, G, M, T)
        out = out + ops.transpose(ops.matmul(wk, xk), (0, 4, 2, 3, 1))
    return out


def compose(a, num_groups, *, qw1=None, qw2=None, kw1=None, kw2=None, qdd=None, kdd=None,
            static=None):
    """Mix the heads of ``a`` (B, N, T, S) within each of G groups (float32).

    qw1, qw2: (B, T, G, R, M); kw1, kw2: (B, S, G, R, M); qdd: (B, T, G, M);
    kdd: (B, S, G, M); static: (G, M, M). Any term may be None. Every term reads
    ``a`` (see ``dcmha.spec.reference.compose``).
    """
    terms = {n: v for n, v in dict(qw1=qw1, qw2=qw2, kw1=kw1, kw2=kw2, qdd=qdd, kdd=kdd,
                                    static=static).items() if v is not None}
    if len(a.shape) != 4:
        raise ValueError(f"`a` must have rank 4 (B, N, T, S). Received: a.shape={_shape(a)}")
    dcall._check_groups(num_groups, a.shape[1])
    G = num_groups
    dcall.check_terms("", terms, a.shape[0], a.shape[2], a.shape[3], G,
                 None if a.shape[1] is None else a.shape[1] // G)
    terms = {n: ops.cast(v, "float32") for n, v in terms.items()}
    a = ops.cast(a, "float32")
    if not terms:
        return a
    B, N, T, S = ops.shape(a)
    x = ops.transpose(ops.reshape(a, (B, G, N // G, T, S)), (0, 3, 1, 2, 4))
    out = _compose_qm(x, *compose_matrices(terms, N // G))
    return ops.reshape(ops.transpose(out, (0, 2, 3, 1, 4)), (B, N, T, S))


# ---------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------

def block_mask(attention_mask, t0, t1, s0, s1, *, use_causal_mask, sliding_window,
                query_offset):
    """The boolean mask of queries [t0, t1) x keys [s0, s1): (B or 1, t, s), or
    (B or 1, N, t, s) with a per-head ``attention_mask``, or None.

    Query t sits at absolute position ``query_offset + t``, key s at s.
    """
    mask = None
    if use_causal_mask or sliding_window is not None:
        t = arange_int32(t0, t1)[:, None] + ops.cast(query_offset, "int32")
        s = arange_int32(s0, s1)[None, :]
        if use_causal_mask:
            mask = ops.less_equal(s, t)
        if sliding_window is not None:
            band = ops.less(ops.abs(t - s), sliding_window)
            mask = band if mask is None else ops.logical_and(mask, band)
        mask = mask[None]
    if attention_mask is not None:
        m = _slice_mask(attention_mask, t0, t1, s0, s1)
        if mask is not None and len(m.shape) == 4:
            mask = mask[:, None]
        mask = m if mask is None else ops.logical_and(mask, m)
    return mask


def _slice_mask(m, t0, t1, s0, s1):
    """m[..., t0:t1, s0:s1] (queries and keys are the last two axes), leaving broadcast
    (size-1) axes whole."""
    if m.shape[-2] != 1:
        m = m[..., t0:t1, :]
    if m.shape[-1] != 1:
        m = m[..., s0:s1]
    return m


def standardize_mask(attention_mask):
    """Boolean rank-3 (B|1, T|1, S|1) mask, rank-4 (B|1, N, T|1, S|1) for a per-head
    mask, or None."""
    if attention_mask is None:
        return None
    m = ops.cast(attention_mask, "bool")             # integer masks: nonzero = attend
    while len(m.shape) < 3:
        m = m[None]
    if len(m.shape) == 4 and m.shape[1] == 1:   # (B, 1, T, S): a broadcast head axis
        m = m[:, 0]
    return m


def _mask5(mask, G):
    """A block mask in the query-major layout (B|1, t, 1|G, 1|M, s) of ``_attend_block``."""
    if len(mask.shape) == 3:                                     # (B|1, t, s)
        return mask[:, :, None, None, :]
    b, N, t, s = mask.shape                                      # (B|1, N, t, s)
    return ops.transpose(ops.reshape(mask, (b, G, N // G, t, s)), (0, 3, 1, 2, 4))


def _visible_rows(mask):
    """(B|1, t, 1|N): 1.0 where a query sees at least one key (per head for a rank-4 mask)."""
    row = ops.cast(ops.any(mask, axis=-1), "float32")
    return row[:, :, None] if len(row.shape) == 2 else ops.transpose(row, (0, 2, 1))


# ---------------------------------------------------------------------------
# The attention core
# ---------------------------------------------------------------------------

def _attend_block(qh, kt, vt, pre, post, mask, *, num_groups, dropout_rate, seed, training,
                  want_scores, want_intermediates, rows_may_be_empty=True):
    """One query block, composed in the query-major layout (B, t, G, M, s).

    qh: (B, N_kv, t, rep, d) pre-scaled queries (head n = kv * rep + r reads kv
    head n // rep, so GQA never repeats k or v); kt: (B, N_kv, d, s);
    vt: (B, N_kv, s, d_v); pre / post: (wq, wk) from ``compose_matrices``
    sliced to the block, or None; mask: (B|1, t, s), (B|1, N, t, s) per head, or None.
    Returns (o (B, t, N, d_v), extras) with extras["attention_scores"] etc. in
    (B, G, M, t, s) when asked for.
    """
    B, N_kv, t, rep, d = ops.shape(qh)
    s = ops.shape(kt)[3]
    N, G = N_kv * rep, num_groups
    M = N // G
    scores = ops.matmul(ops.reshape(qh, (B, N_kv, t * rep, d)), kt)
    x = ops.reshape(ops.transpose(ops.reshape(scores, (B, N_kv, t, rep, s)), (0, 2, 1, 3, 4)),
                    (B, t, G, M, s))
    extras = {}
    to5 = lambda a: ops.transpose(a, (0, 2, 3, 1, 4))                 # -> (B, G, M, t, s)
    if want_intermediates:
        extras["scores"] = to5(x)
    if pre:
        x = _compose_qm(x, *pre)
    if want_intermediates:
        extras["pre_composed"] = to5(x)
    m5 = None if mask is None else _mask5(mask, G)                     # (B|1, t, ., ., s)
    if m5 is not None:
        x = ops.where(m5, x, _MASKED)
    # A single visible key (e.g. the first causal chunk of size 1): softmax is 1.
    # (_shape: a traced size is unknown, so an exporter's trace at S=1 keeps the softmax.)
    p = ops.ones_like(x) if _shape(x)[-1] == 1 else ops.softmax(x, axis=-1)
    if want_intermediates:
        extras["probs"] = to5(p if m5 is None else ops.where(m5, p, 0.0))
    if post:
        p = _compose_qm(p, *post)
    # Partially masked rows are already exactly 0 where masked (softmax of
    # -1e30, then a per-(t, s) head mix of zeros); only fully masked rows
    # (uniform after softmax) need zeroing, which is done on the small output.
    if want_scores:
        extras["attention_scores"] = to5(p if m5 is None else ops.where(m5, p, 0.0))
    if training and dropout_rate > 0.0:
        p = keras.random.dropout(p, dropout_rate, seed=seed)
    pv = ops.reshape(ops.transpose(ops.reshape(p, (B, t, N_kv, rep, s)), (0, 2, 1, 3, 4)),
                     (B, N_kv, t * rep, s))
    d_v = vt.shape[-1]
    o = ops.reshape(ops.matmul(pv, vt), (B, N_kv, t, rep, d_v))
    o = ops.reshape(ops.transpose(o, (0, 2, 1, 3, 4)), (B, t, N, d_v))
    if mask is not None and rows_may_be_empty:
        o = o * _visible_rows(mask)[..., None]                       # (B|1, t, 1|N, 1)
    return o, extras


def key_range(t0, t1, S, *, use_causal_mask, sliding_window, query_offset):
    """Keys [s0, s1) that queries [t0, t1) can see, from static knowledge only
    (``dcmha.spec.terms.key_range``; all keys when the offset is a tensor)."""
    if not isinstance(query_offset, int):
        return 0, S
    return spec_terms.key_range(t0, t1, S, causal=bool(use_causal_mask), window=sliding_window,
                                offset=query_offset)


#: The terms ``decode_compose`` applies in low-rank form (as products in its broadcast
#: form); any other term of the spec goes through its factor (``compose_factors``).
LOW_RANK_TERMS = frozenset({"qw1", "qw2", "qdd", "kw1", "kw2", "kdd", "static"})
_LOW_RANK_KEY_TERMS = ("kw1", "kw2", "kdd")


def decode_compose(x, terms, M, *, einsum=None, matmul=None, eye=None, reduce_sum=None,
                   transpose=None):
    """Compose for one query: x (B, G, M, S) -> same (float32).

    The arithmetic of ``spec.terms`` (the residual included) for T = 1. The key-side
    terms are applied in their low-rank form, read in place from the cached
    (B, S, G, R, M) weights: sum_r kw2[s, r, n] (sum_m kw1[s, r, m] x[m, s]) +
    kdd[s, n] x[n, s], 2 R M + M multiply-adds per key instead of the M M of the
    (S, G, M, M) key factor, which is never built. A key-factor term of the spec
    other than kw1 / kw2 / kdd goes through its factor
    (``dcmha.spec.terms.compose_factors``).

    Two forms of the same arithmetic, for two kinds of executor:

    * einsum / matmul / eye (default ``keras.ops``'s): the query factor (one (M x M)
      matrix per query, ``query_compose_matrix``) is one small matmul and the key
      side einsums. For compiled steps (XLA: a dot is one efficient kernel, where
      its broadcast product and sum ran 2.5x slower at M = 16).
    * reduce_sum(a, axis) and transpose(a, axes) given (the torch path passes
      PyTorch's own): every low-rank pair as broadcast products and sums, the key
      side in the cache's own (B, S, G, ...) layout, out = x + qw2^T (qw1 x) + qdd
      * x + static^T x + the key side. For eager dispatch: an einsum or a small
      matmul costs several times a product there (a small torch ``bmm`` enters an
      OpenMP parallel region whatever its size). With a term of the spec outside
      ``LOW_RANK_TERMS`` the call takes the einsum form.
    """
    einsum, matmul, eye = einsum or ops.einsum, matmul or ops.matmul, eye or _eye32
    if reduce_sum is not None and terms.keys() <= LOW_RANK_TERMS:
        return _decode_compose_products(x, terms, reduce_sum, transpose)
    wq = spec_terms.compose_factors(terms, M, einsum=einsum, eye=eye, factors=("query",))[0]
    if wq is not None and len(wq.shape) == 5:               # (B, 1, G, M, M) per query
        wq = wq[:, 0]
    out = x if wq is None else matmul(wq, x)
    if "kw1" in terms:
        y = einsum("bsgrm,bgms->bgrs", terms["kw1"], x)
        out = out + einsum("bsgrn,bgrs->bgns", terms["kw2"], y)
    if "kdd" in terms:
        out = out + einsum("bsgn,bgns->bgns", terms["kdd"], x)
    other = {n: w for n, w in terms.items() if n not in _LOW_RANK_KEY_TERMS
             and spec_terms.TERMS[n].factor == "key"}
    if other:
        wk = spec_terms.compose_factors(other, M, einsum=einsum, eye=eye, factors=("key",))[1]
        out = out + einsum("bsgnm,bgms->bgns", wk, x)
    return out


def kernel_stages(pre, post) -> bool:
    """Whether a one-query call's stages are what the compiled decode kernel computes
    (``dcmha_decode_probs``): at least one stage, every term in ``LOW_RANK_TERMS``."""
    return bool(pre or post) and all(not s or s.keys() <= LOW_RANK_TERMS for s in (pre, post))


def _decode_compose_products(x, terms, reduce_sum, transpose):
    """``decode_compose``'s broadcast form (see there), for the terms of ``LOW_RANK_TERMS``."""
    out = x
    if "qw1" in terms:                                   # (B, 1, G, R, M) -> (B, G, R, M, 1)
        qw1, qw2 = terms["qw1"][:, 0, ..., None], terms["qw2"][:, 0, ..., None]
        h = reduce_sum(qw1 * x[:, :, None], 3)                                # (B, G, R, S)
        out = out + reduce_sum(qw2 * h[:, :, :, None], 2)
    if "qdd" in terms:                                   # (B, 1, G, M) -> (B, G, M, 1)
        out = out + terms["qdd"][:, 0, :, :, None] * x
    if "static" in terms:                                # (G, M, M): static[g, m, n]
        out = out + reduce_sum(terms["static"][..., None] * x[:, :, :, None], 2)
    xs = transpose(x, (0, 3, 1, 2))                                           # (B, S, G, M)
    key = None
    if "kw1" in terms:                                   # (B, S, G, R, M)
        y = reduce_sum(terms["kw1"] * xs[:, :, :, None], -1)                  # (B, S, G, R)
        key = reduce_sum(terms["kw2"] * y[..., None], 3)                      # (B, S, G, M)
    if "kdd" in terms:                                   # (B, S, G, M)
        part = terms["kdd"] * xs
        key = part if key is None else key + part
    if key is not None:
        out = out + transpose(key, (0, 2, 3, 1))
    return out


def one_query_probs(x, mask, pre, post, M, *, compose=None):
    """One query's probabilities p (B, G, M, S) float32 from its scores x (B, G, M, S):
    the pre compose, the mask (``_attention_one_query``'s: (B|1, 1, S|1) or per head
    (B|1, N, 1, S|1), True = attend), the softmax and the post compose.
    ``compose(x, terms, M)`` computes each compose (default ``decode_compose``)."""
    compose = compose or decode_compose
    if pre:
        x = compose(x, pre, M)
    if mask is not None:
        # (B|1, 1, S|1) -> (B|1, 1, 1, S|1); per head (B|1, N, 1, S|1) -> (B|1, G, M, S|1)
        m = mask if len(mask.shape) == 4 else mask[:, None]
        if m.shape[1] != 1:
            m = ops.reshape(m, (ops.shape(m)[0], x.shape[1], M, ops.shape(m)[-1]))
        x = ops.where(m, x, _MASKED)
    # (_shape: a traced size is unknown, so an exporter's trace at S=1 keeps the softmax.)
    p = ops.ones_like(x) if _shape(x)[-1] == 1 else ops.softmax(x, axis=-1)
    if post:
        p = compose(p, post, M)
    return p


def _attention_one_query(q, k, v, mask, pre, post, *, num_groups, rows_may_be_empty,
                         probs=None):
    """The core for one query (T = 1: a decoding step), without (B, N, T, S) extras.

    q: (B, 1, N, d) pre-scaled, k: (B, S, N_kv, d), v: (B, S, N_kv, d_v) float32;
    mask: the block mask of the one query, (B|1, 1, S) or (B|1, N, 1, S), or None.
    Returns o (B, 1, N, d_v). The same math as ``_attend_block`` with a few,
    layout-free ops: the scores, composes and P.V are einsums on the (B, G, M, S)
    view (no explicit transposed copies of the cache; no (S, G, M, M) key factor).
    ``probs``: the function from scores to probabilities (``one_query_probs``'s
    signature and default; a backend passes its kernel).
    """
    B, _, N, d = ops.shape(q)
    S, N_kv, d_v = ops.shape(k)[1], k.shape[2], v.shape[-1]
    G, rep = num_groups, N // N_kv
    M = N // G
    qh = ops.reshape(q, (B, N_kv, rep, d))
    x = ops.reshape(ops.einsum("bhrd,bshd->bhrs", qh, k), (B, G, M, S))
    p = (probs or one_query_probs)(x, mask, pre, post, M)
    o = ops.einsum("bhrs,bshv->bhrv", ops.reshape(p, (B, N_kv, rep, S)), v)
    o = ops.reshape(o, (B, 1, N, d_v))
    if mask is not None and rows_may_be_empty:
        o = o * _visible_rows(mask)[..., None]                       # (B|1, 1, 1|N, 1)
    return o


def auto_query_chunk_size(batch, num_heads, key_length, query_length, block_bytes=None):
    """A query chunk size for ``implementation="auto"`` (None = no chunking).

    On CPU the (B, N, chunk, S) float32 blocks of the attention step stay in
    cache at a few MiB, which makes every elementwise pass several times
    faster (measured: 64 queries at B=2, N=8, S=1024 is the fastest training
    step); chunking also skips the key blocks a causal mask hides. On an
    accelerator the blocks are larger (fewer, bigger kernels).
    """
    if not all(isinstance(v, int) for v in (batch, num_heads, key_length, query_length)):
        return None
    if block_bytes is None:
        block_bytes = 4 * 2 ** 20 if seam.on_cpu() else 256 * 2 ** 20
    chunk = dcall.block_rows(batch, num_heads, key_length, block_bytes)
    return chunk if chunk < query_length else None


def split_blocks(x, bounds, axis=1):
    """Pieces of x along ``axis`` at ``bounds`` [(start, stop), ...] (one op)."""
    if len(bounds) == 1:
        return [x]
    return ops.split(x, [b[0] for b in bounds[1:]], axis=axis)


def join_blocks(parts, axis=1):
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=axis)


#: More query chunks than this are not unrolled on the tracing backends
#: (``dcmha.backend.LOOPED_CHUNKS``): they run as ``_LOOP_SPANS`` spans of equal chunks, each span an
#: ``ops.map`` loop against the keys its queries can see, so the traced graph
#: (and the compile time) stays bounded for long sequences.
MAX_UNROLLED_CHUNKS = 64
_LOOP_SPANS = 16


def _attention_looped(q, k, v, mask, pre, post, *, num_groups, chunk, use_causal_mask,
                      sliding_window, query_offset, rows_may_be_empty):
    """``_attention_ops`` for many chunks: spans of chunks looped with ``ops.map``.

    q: (B, T, N, d) pre-scaled, k: (B, S, N_kv, d), v: (B, S, N_kv, d_v) float32;
    mask: standardized (``standardize_mask``) or None. Returns o (B, T, N, d_v). No
    dropout and no (B, N, T, S) extras (the caller checks).
    """
    B, T, N, d = ops.shape(q)
    S, N_kv, d_v = ops.shape(k)[1], k.shape[2], v.shape[-1]
    G, rep = num_groups, N // k.shape[2]
    M = N // G
    qh = ops.transpose(ops.reshape(q, (B, T, N_kv, rep, d)), (0, 2, 1, 3, 4))  # (B,N_kv,T,rep,d)
    kt = ops.transpose(k, (0, 2, 3, 1))                                         # (B,N_kv,d,S)
    vt = ops.transpose(v, (0, 2, 1, 3))                                         # (B,N_kv,S,d_v)
    stages = {name: compose_matrices(terms, M)
              for name, terms in (("pre", pre), ("post", post)) if terms}
    n_full = T // chunk
    per_span = -(-n_full // _LOOP_SPANS)
    spans = [(i * chunk, min(n_full, i + per_span) * chunk) for i in range(0, n_full, per_span)]
    if T % chunk:
        spans.append((n_full * chunk, T))                   # the short tail: one block

    def cut(x, a, b, axis):
        """x[..., a:b, ...] along ``axis`` (static bounds)."""
        if (a, b) == (0, x.shape[axis]):
            return x
        shape = list(ops.shape(x))
        shape[axis] = b - a
        return ops.slice(x, [0] * axis + [a] + [0] * (len(shape) - axis - 1), shape)

    def chunked(x, t0, t1, n, axis):
        """x[..., t0:t1, ...] along ``axis`` as (n, ..., chunk, ...): the loop axis first."""
        x = cut(x, t0, t1, axis)
        shape = list(ops.shape(x))
        x = ops.reshape(x, shape[:axis] + [n, (t1 - t0) // n] + shape[axis + 1:])
        return ops.moveaxis(x, axis, 0)

    outs = []
    for t0, t1 in spans:
        s0, s1 = key_range(t0, t1, S, use_causal_mask=use_causal_mask,
                            sliding_window=sliding_window, query_offset=query_offset)
        if s1 <= s0:
            outs.append(ops.zeros((B, t1 - t0, N, d_v), "float32"))
            continue
        n = (t1 - t0) // chunk if (t1 - t0) % chunk == 0 else 1
        blk_mask = block_mask(mask, t0, t1, s0, s1, use_causal_mask=use_causal_mask,
                               sliding_window=sliding_window, query_offset=query_offset)
        k_blk, v_blk = cut(kt, s0, s1, 3), cut(vt, s0, s1, 2)
        xs, shared = {"q": chunked(qh, t0, t1, n, 2)}, {"mask": None}
        if blk_mask is not None and blk_mask.shape[-2] != 1:
            xs["mask"] = chunked(blk_mask, 0, t1 - t0, n, len(blk_mask.shape) - 2)
        else:
            shared["mask"] = blk_mask
        for name, (wq, wk) in stages.items():
            if wq is not None and len(wq.shape) == 5:          # per query: (B, T, G, M, M)
                xs[name] = chunked(wq, t0, t1, n, 1)
            else:
                shared[name + "_q"] = wq
            shared[name + "_k"] = None if wk is None else cut(wk, s0, s1, 1)

        def body(x):
            terms = {name: (x[name] if name in x else shared[name + "_q"], shared[name + "_k"])
                     for name in stages}
            o, _ = _attend_block(x["q"], k_blk, v_blk, terms.get("pre"), terms.get("post"),
                                 x.get("mask", shared["mask"]), num_groups=G, dropout_rate=0.0,
                                 seed=None, training=False, want_scores=False,
                                 want_intermediates=False, rows_may_be_empty=rows_may_be_empty)
            return o                                           # (B, chunk, N, d_v)

        if n == 1:
            outs.append(body({name: x[0] for name, x in xs.items()}))
        else:
            o = ops.map(body, xs)                              # (n, B, chunk, N, d_v)
            outs.append(ops.reshape(ops.moveaxis(o, 0, 1), (B, t1 - t0, N, d_v)))
    return join_blocks(outs)


def _attention_ops(q, k, v, *, num_groups, pre, post, attention_mask, use_causal_mask,
                   sliding_window, query_offset, query_chunk_size, dropout_rate, seed,
                   training, return_attention_scores, return_intermediates, auto_chunk,
                   decode_probs=None):
    """The plain ``keras.ops`` attention core (see ``dcmha_attention``).

    Chunked queries read only the key blocks a causal mask or window leaves
    visible. Every per-position tensor is split once into blocks and a chunk
    concatenates the blocks it reads: slicing the full tensor per chunk would
    make autodiff (torch, TF) build a zero gradient of the full size per chunk.
    """
    q = ops.cast(q, "float32") * (1.0 / math.sqrt(q.shape[-1]))
    k = ops.cast(k, "float32")
    v = ops.cast(v, "float32")
    B, T, N, _ = ops.shape(q)
    S = ops.shape(k)[1]
    G, M, d_v = num_groups, N // num_groups, v.shape[-1]
    mask = standardize_mask(attention_mask)
    static_T = isinstance(T, int) and isinstance(S, int)
    chunk = query_chunk_size
    if chunk is None and auto_chunk and static_T and not return_intermediates:
        chunk = auto_query_chunk_size(B, N, S, T)
    if not static_T or chunk is None or chunk >= T:
        q_bounds, k_bounds = [(0, T)], [(0, S)]
    else:
        q_bounds = [(t0, min(T, t0 + chunk)) for t0 in range(0, T, chunk)]
        k_bounds = [(s0, min(S, s0 + chunk)) for s0 in range(0, S, chunk)]
    wanted = (["attention_scores"] if return_attention_scores else []) + (
        ["scores", "pre_composed", "probs"] if return_intermediates else [])
    # Causal attention with a static offset >= 0 always sees key 0: no empty row.
    rows_may_be_empty = not (mask is None and sliding_window is None and use_causal_mask
                             and isinstance(query_offset, int) and query_offset >= 0)
    if isinstance(T, int) and T == 1 and not wanted and not (training and dropout_rate > 0.0):
        # One query (a decoding step): a short path without the block machinery.
        one_mask = block_mask(mask, 0, 1, 0, S, use_causal_mask=use_causal_mask,
                              sliding_window=sliding_window, query_offset=query_offset)
        return _attention_one_query(q, k, v, one_mask, pre, post, num_groups=G,
                                    rows_may_be_empty=rows_may_be_empty,
                                    probs=decode_probs), {}
    if (len(q_bounds) > MAX_UNROLLED_CHUNKS and not wanted
            and not (training and dropout_rate > 0.0)
            and seam.LOOPED_CHUNKS):
        return _attention_looped(q, k, v, mask, pre, post, num_groups=G, chunk=chunk,
                                 use_causal_mask=use_causal_mask, sliding_window=sliding_window,
                                 query_offset=query_offset,
                                 rows_may_be_empty=rows_may_be_empty), {}

    # Head-major copies, made once: each block is then two plain batched matmuls.
    N_kv = k.shape[2]
    q_parts = split_blocks(ops.transpose(ops.reshape(q, (B, T, N_kv, N // N_kv, q.shape[-1])),
                                   (0, 2, 1, 3, 4)), q_bounds, axis=2)
    k_parts = split_blocks(ops.transpose(k, (0, 2, 3, 1)), k_bounds, axis=3)   # (B, N_kv, d, S)
    v_parts = split_blocks(ops.transpose(v, (0, 2, 1, 3)), k_bounds, axis=2)   # (B, N_kv, S, d_v)
    full_mask = None
    if len(q_bounds) > 1 and T * S <= 2 ** 24:      # one mask, sliced per block
        full_mask = block_mask(mask, 0, T, 0, S, use_causal_mask=use_causal_mask,
                                sliding_window=sliding_window, query_offset=query_offset)
    # The composition matrices are built once for all positions and split
    # like q and k, so the chunk loop holds only the big per-block work.
    stages = {}
    for name, terms in (("pre", pre), ("post", post)):
        if terms:
            wq, wk = compose_matrices(terms, M)
            per_query = wq is not None and len(wq.shape) == 5
            stages[name] = (split_blocks(wq, q_bounds) if per_query else [wq] * len(q_bounds),
                            None if wk is None else split_blocks(wk, k_bounds))

    outs, extras = [], []
    for i, (t0, t1) in enumerate(q_bounds):
        j0, j1 = 0, len(k_bounds)
        if len(k_bounds) > 1:
            s0, s1 = key_range(t0, t1, S, use_causal_mask=use_causal_mask,
                                sliding_window=sliding_window, query_offset=query_offset)
            j0, j1 = s0 // chunk, -(-s1 // chunk)
        if j1 <= j0:                                # every key of the chunk is masked
            outs.append(ops.zeros((B, t1 - t0, N, d_v), "float32"))
            extras.append({n: ops.zeros((B, G, M, t1 - t0, S), "float32") for n in wanted})
            continue
        s0, s1 = k_bounds[j0][0], k_bounds[j1 - 1][1]
        if full_mask is not None:
            blk_mask = _slice_mask(full_mask, t0, t1, s0, s1)
        else:
            blk_mask = block_mask(mask, t0, t1, s0, s1, use_causal_mask=use_causal_mask,
                                   sliding_window=sliding_window, query_offset=query_offset)
        blk = {name: (wq[i], None if wk is None else join_blocks(wk[j0:j1]))
               for name, (wq, wk) in stages.items()}
        o, ex = _attend_block(
            q_parts[i], join_blocks(k_parts[j0:j1], 3), join_blocks(v_parts[j0:j1], 2), blk.get("pre"),
            blk.get("post"), blk_mask, num_groups=G, dropout_rate=dropout_rate, seed=seed,
            training=training, want_scores=return_attention_scores,
            want_intermediates=return_intermediates, rows_may_be_empty=rows_may_be_empty)
        if len(k_bounds) > 1 and (s0, s1) != (0, S):    # back to the full key axis
            pad = [(0, 0)] * 4 + [(s0, S - s1)]
            ex = {n: ops.pad(a, pad) for n, a in ex.items()}
        outs.append(o)
        extras.append(ex)
    o = join_blocks(outs)
    result = {}
    for name in wanted:
        a = extras[0][name] if len(extras) == 1 else ops.concatenate(
            [e[name] for e in extras], axis=3)
        result[name] = ops.reshape(a, (B, N, T, S))
    return o, result


def attention(call, *, decode_probs=None):
    """The "ops" implementation: the plain core on a validated ``AttentionCall``.
    ``decode_probs`` replaces ``one_query_probs`` in the one-query path (a backend's
    compiled composes and softmax: "jax_decode")."""
    return _attention_ops(**call.arguments(), decode_probs=decode_probs)


#: The plain core's registration (entry point ``ops`` of ``dcmha.implementations``).
IMPLEMENTATION = registry.OPS


def resolve_implementation(implementation):
    """Validate an ``implementation`` name ("auto" or a registered one)."""
    return registry.resolve(implementation)


def core_result(result, return_attention_scores):
    """A fast path's kernel result as the cores return it: (o, extras).

    ``result`` is o, or (o, scores) with ``return_attention_scores``.
    """
    if return_attention_scores:
        o, scores = result
        return o, {"attention_scores": scores}
    return result, {}


def select_implementation(implementation, call):
    """(name, attention function) for ``call`` (see ``dcmha.registry.select``)."""
    return registry.select(implementation, call)


def explain_implementation(q, k, v, **kwargs):
    """[(name, reason)]: why ``implementation="auto"`` passes over each fast path for
    this call (None for the one it takes); arguments as ``dcmha_attention``."""
    return registry.explain(dcall.describe(q, k, v, **kwargs))


def dcmha_attention(q, k, v, *, num_groups=1, pre=None, post=None, attention_mask=None,
                    use_causal_mask=False, sliding_window=None, query_offset=0,
                    query_chunk_size=None, dropout_rate=0.0, seed=None, training=False,
                    return_attention_scores=False, return_intermediates=False,
                    implementation="auto"):
    """DCMHA on projected heads: scores -> pre-compose -> mask -> softmax ->
    post-compose -> zero masked -> dropout -> P.V.

    Args:
        q: (B, T, N, d); k: (B, S, N_kv, d); v: (B, S, N_kv, d_v) (after bias,
            QK-norm and RoPE). Query head n reads kv head n // (N / N_kv).
        num_groups: G.
        pre, post: compose terms of each stage (see the module docstring), with
            query-side terms over T and key-side terms over S. None or {} skips
            the stage.
        attention_mask: boolean (True = attend) or integer (non-zero = attend),
            broadcastable to (B, T, S), or (B, N, T, S) for one mask per head.
        use_causal_mask: keys s <= query_offset + t only.
        sliding_window: keys with |query_offset + t - s| < sliding_window only.
        query_offset: absolute position of query 0 (int or scalar tensor).
        query_chunk_size: process queries in chunks of this size (the largest
            intermediate is then (B, N, chunk, S)); key blocks a causal mask or
            window hides are skipped.
        dropout_rate, seed, training: dropout on the composed probabilities
            (seed: a ``keras.random.SeedGenerator``, int or None).
        return_attention_scores: also return the post-composed masked
            probabilities (B, N, T, S).
        return_intermediates: also return "scores", "pre_composed", "probs"
            (B, N, T, S) (for tests and conformance).
        implementation: "auto" or a registered implementation's name
            (``dcmha.registry``; see ``select_implementation``).

    Returns:
        o (B, T, N, d_v) float32, or (o, extras) when scores or intermediates are
        asked for (a dict with "attention_scores" and/or the intermediates).
    """
    resolve_implementation(implementation)
    call = dcall.describe(
        q, k, v, num_groups=num_groups, pre=pre, post=post, attention_mask=attention_mask,
        use_causal_mask=use_causal_mask, sliding_window=sliding_window,
        query_offset=query_offset, query_chunk_size=query_chunk_size,
        dropout_rate=dropout_rate, seed=seed, training=training,
        return_attention_scores=return_attention_scores,
        return_intermediates=return_intermediates, auto_chunk=implementation == "auto")
    # Every implementation computes the composition in float32.
    call = dataclasses.replace(call, **{
        name: {n: as_dtype(w, "float32") for n, w in terms.items()}
        for name, terms in call.stages.items()})
    _, core = select_implementation(implementation, call)
    o, extras = core(call)
    if return_attention_scores or return_intermediates:
        return o, extras
    return o
