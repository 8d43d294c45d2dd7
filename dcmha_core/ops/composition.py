"""Head composition: mixing the heads of a (B, N, T, S) tensor within each of G
groups with the static and dynamic terms of one stage ("pre" or "post"), and the
dynamic terms themselves.

``dynamic_weights`` computes the input-dependent ``w1``, ``w2`` and ``dd`` of each
compose slot from a side's input x (B, L, D) (``plain_dynamic_weights`` with
``keras.ops``, or ``slot_dynamic_weights`` where ops run one by one; the seam,
``dcmha.framework``, may supply a backend's own step: ``step_dynamic_weights``,
``fused_query_projection``). ``compose_matrices`` folds every
term (and the residual) into two small factors, one per side; ``compose`` applies them
to a full tensor; ``decode_compose`` is the same arithmetic for one query, with the
key-side terms in low-rank form.
"""

from __future__ import annotations

import keras
from keras import ops

from dcmha import framework
from dcmha.call import (_check_groups, check_positive_int, check_terms, shape_of as _shape,
                        shapes_agree)
from dcmha.framework._common import as_dtype
from dcmha.spec import terms as spec_terms
from dcmha.spec.reference import ALL_SLOTS, W1_NORM_EPS

#: The ``compose`` keyword arguments of one stage (``dcmha.spec.terms.stage_terms``).
stage_terms = spec_terms.stage_terms


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
    _check_groups(num_groups, a.shape[1])
    G = num_groups
    check_terms("", terms, a.shape[0], a.shape[2], a.shape[3], G,
                 None if a.shape[1] is None else a.shape[1] // G)
    terms = {n: ops.cast(v, "float32") for n, v in terms.items()}
    a = ops.cast(a, "float32")
    if not terms:
        return a
    B, N, T, S = ops.shape(a)
    x = ops.transpose(ops.reshape(a, (B, G, N // G, T, S)), (0, 3, 1, 2, 4))
    out = _compose_qm(x, *compose_matrices(terms, N // G))
    return ops.reshape(ops.transpose(out, (0, 2, 3, 1, 4)), (B, N, T, S))

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


# ---------------------------------------------------------------------------
# The dynamic terms: input-dependent weights of each slot
# ---------------------------------------------------------------------------

def rms_normalize(x, eps, scale=None):
    """x / sqrt(mean(x**2, -1) + eps), times ``scale`` if given."""
    y = x * ops.rsqrt(ops.mean(ops.square(x), axis=-1, keepdims=True) + eps)
    return y if scale is None else y * scale


def dynamic_weights(x, dw1=None, qkw=None, dd=None, *, slots, rank, gelu_approximate=True,
                    check=True, weight_scale=1.0):
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
        weight_scale: the weights are dw1, qkw and dd times this
            (``DynamicWeightProjection``'s variables under ``composition_lr_scale``).
            The stacked form (``plain_dynamic_weights``: compiled programs, numpy)
            scales the products, which XLA fuses into the gelu, the normalisation and the
            tanh that read them; scaling the weights would be a pass over each weight per
            call (per decoding step). The backends' own routes and the slot form (ops
            run one by one) take the weights scaled (``framework.scaled_weights``), made
            only by the route that runs.

    Returns:
        ``{slot: {"w1": (B, L, G, R, M), "w2": (B, L, G, R, M), "dd": (B, L, G, M)}}``;
        "w1"/"w2" only with a projection, "dd" only with gating.
    """
    if check:
        _check_dynamic_args(x, dw1, qkw, dd, slots, rank)
    weights = [w.value if isinstance(w, keras.Variable) else w for w in (dw1, qkw, dd)]
    C = len(slots)
    split = framework.step_dynamic_weights(x, *weights, C=C, rank=rank,
                                           gelu_approximate=gelu_approximate,
                                           weight_scale=weight_scale)
    if split is None and not framework.compiles_ops():
        split = slot_dynamic_weights(x, *framework.scaled_weights(weights, weight_scale),
                                     C=C, rank=rank, gelu_approximate=gelu_approximate)
    if split is None:
        stacked = plain_dynamic_weights(x, *weights, C=C, rank=rank,
                                        gelu_approximate=gelu_approximate,
                                        weight_scale=weight_scale)
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
    (``dcmha.framework.fused_query_projection``), else None.

    kernel (D, N, d), bias (N, d) or None: the query projection (``EinsumDense``'s
    weights). Returns (x . kernel + bias as (B, L, N, d) float32, ``dynamic_weights``'
    dict)."""
    weights = [w.value if isinstance(w, keras.Variable) else w
               for w in (kernel, bias, dw1, qkw, dd)]
    out = framework.fused_query_projection(x, *weights, C=len(slots), rank=rank,
                                           gelu_approximate=gelu_approximate)
    if out is None:
        return None
    q, stacked = out
    return q, _by_slot({n: framework.unstack(a, 3, len(slots)) for n, a in stacked.items()}, slots)


def plain_dynamic_weights(x, dw1, qkw, dd, *, C, rank, gelu_approximate, weight_scale=1.0):
    """``dynamic_weights`` before the split into slots, with ``keras.ops``:
    {"w1", "w2": (B, L, G, C, R, M), "dd": (B, L, G, C, M)} (those present); the
    weights times ``weight_scale``, applied to their products."""
    x = as_dtype(x, "float32")

    def scaled(y):
        return y if weight_scale == 1.0 else y * weight_scale

    out = {}
    if dw1 is not None:
        h = ops.gelu(scaled(ops.einsum("bld,dgck->blgck", x, as_dtype(dw1, "float32"))),
                     approximate=gelu_approximate)
        # qkw first: with h first, XLA (jax) copies qkw into a transposed layout at every
        # call (for a decoding step, a copy of the weight per step).
        w = scaled(ops.einsum("gckrm,blgck->blgcrm", as_dtype(qkw, "float32"), h))
        out["w1"] = rms_normalize(w[..., :rank, :], W1_NORM_EPS)
        out["w2"] = w[..., rank:, :]
    if dd is not None:
        D, G, CM = dd.shape
        dd4 = ops.reshape(as_dtype(dd, "float32"), (D, G, C, CM // C))
        out["dd"] = ops.tanh(scaled(ops.einsum("bld,dgcm->blgcm", x, dd4)))
    return out


def slot_dynamic_weights(x, dw1, qkw, dd, *, C, rank, gelu_approximate):
    """``plain_dynamic_weights``' arithmetic split into the C slots: {"w1", "w2": [C
    arrays (B, L, G, R, M)], "dd": [C arrays (B, L, G, M)]} (those present).

    The form for a framework that runs ops one by one (``dcmha.framework.compiles_ops()``
    False: TensorFlow's graph executor): x . dw1 and x . dd are one matrix product each
    whose columns are ordered slot-major, split on their last axis, and each slot's w1
    and w2 are one product of its hidden vector with its part of qkw, split on its last
    axis, so no activation is sliced or transposed. There the einsums' transposes and the
    slices' gradients of the stacked form cost more than its arithmetic; XLA fuses them
    away and runs the stacked form faster (``benchmarks/RESULTS.md``, "A model's training
    step")."""
    x = as_dtype(x, "float32")
    D = x.shape[-1]

    def slot_major(w, G, C, n):
        """w (D, G, C, n) as (D, C * G * n), columns ordered (C, G, n)."""
        return ops.reshape(ops.transpose(as_dtype(w, "float32"), (0, 2, 1, 3)), (D, C * G * n))

    def per_slot(y, G, n):
        """y (B, L, C * G * n) -> C arrays (B, L, G, n) ((B, L, n) where G is None)."""
        parts = ops.split(y, C, axis=-1)
        return parts if G is None else [ops.reshape(p, (*ops.shape(p)[:2], G, n))
                                        for p in parts]

    out = {}
    if dw1 is not None:
        _, G, _, K = dw1.shape
        M = qkw.shape[-1]
        RM = rank * M
        h = ops.gelu(ops.matmul(x, slot_major(dw1, G, C, K)), approximate=gelu_approximate)
        w1s, w2s = [], []
        # Each slot's hidden vector times its (G, K, 2R M) part of qkw, one product, whose
        # columns split into w1 (its first R M) and w2; with G = 1 the products are 2-D.
        for hc, qc in zip(per_slot(h, None if G == 1 else G, K),
                          ops.unstack(as_dtype(qkw, "float32"), C, axis=1)):
            flat = ops.reshape(qc, (K, 2 * RM) if G == 1 else (G, K, 2 * RM))
            w = (ops.matmul(hc, flat) if G == 1 else ops.einsum("blgk,gkn->blgn", hc, flat))
            # The lead shape from hc, not from ops.shape of the (B, L, K) . (K, n) product:
            # Keras's tensorflow ONNX export (tf2onnx) gives that as (B L, n) when L is free.
            lead = (*ops.shape(hc)[:2], G)
            for half, dst in zip(ops.split(w, 2, axis=-1), (w1s, w2s)):
                dst.append(ops.reshape(half, (*lead, rank, M)))
        out["w1"] = [rms_normalize(w, W1_NORM_EPS) for w in w1s]
        out["w2"] = w2s
    if dd is not None:
        _, G, CM = dd.shape
        M = CM // C
        dd4 = ops.reshape(dd, (D, G, C, M))
        out["dd"] = per_slot(ops.tanh(ops.matmul(x, slot_major(dd4, G, C, M))), G, M)
    return out


def _check_dynamic_args(x, dw1, qkw, dd, slots, rank):
    if len(x.shape) != 3:
        raise ValueError(f"`x` must have rank 3 (B, L, D). Received: x.shape={_shape(x)}")
    if (isinstance(slots, str) or not isinstance(slots, (tuple, list)) or not slots
            or any(sl not in ALL_SLOTS for sl in slots)):
        raise ValueError(f"`slots` must be a sequence of slot names from {ALL_SLOTS}. "
                         f"Received: slots={slots!r}")
    check_positive_int("rank", rank)
    if (dw1 is None) != (qkw is None):
        got = lambda n, w: f"{n}=None" if w is None else f"{n}.shape={_shape(w)}"
        raise ValueError("`dw1` and `qkw` must be given together. "
                         f"Received: {got('dw1', dw1)}, {got('qkw', qkw)}")
    D, C = x.shape[-1], len(slots)
    if dw1 is not None:
        if not shapes_agree(_shape(dw1), (D, None, C, None)):
            raise ValueError(f"`dw1` must have shape (D, G, C, K) = ({D}, G, {C}, K) (D: the "
                             "width of `x`, C: the number of slots). "
                             f"Received: dw1.shape={_shape(dw1)}")
        G, K = dw1.shape[1], dw1.shape[3]
        if not shapes_agree(_shape(qkw), (G, C, K, 2 * rank, None)):
            raise ValueError(f"`qkw` must have shape (G, C, K, 2R, M) = ({G}, {C}, {K}, "
                             f"{2 * rank}, M). Received: qkw.shape={_shape(qkw)}")
    if dd is not None:
        G = "G" if dw1 is None else dw1.shape[1]
        shape = _shape(dd)
        if (len(shape) != 3 or not shapes_agree(shape[:1], (D,))
                or (dw1 is not None and not shapes_agree(shape[1:2], (G,)))
                or (shape[2] is not None and shape[2] % C)):
            raise ValueError(f"`dd` must have shape (D, G, C*M) = ({D}, {G}, {C}*M). "
                             f"Received: dd.shape={shape}")
