"""Head composition: mixing the heads of a (B, N, T, S) tensor within each of G
groups with the static and dynamic terms of one stage ("pre" or "post").

``compose_matrices`` folds every term (and the residual) into two small factors, one
per side; ``compose`` applies them to a full tensor; ``decode_compose`` is the same
arithmetic for one query, with the key-side terms in low-rank form.
"""

from __future__ import annotations

from keras import ops

from dcmha.call import _check_groups, check_terms, shape_of as _shape
from dcmha.spec import terms as spec_terms

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
