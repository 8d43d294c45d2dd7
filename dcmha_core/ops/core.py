"""The attention core: ``dcmha_attention``, the package's one entry to it, and the plain
``keras.ops`` implementation it falls back on (the "ops" implementation: every backend,
device and capability).

``dcmha_attention`` describes and validates a call (``dcmha.call``), picks the
implementation through the registry (``dcmha.registry``: the plain core here or a
registered fast path) and runs it. The plain core processes queries in blocks whose
(B, N, chunk, S) tensors stay in CPU cache; blocks skip the keys a causal mask or window
hides, and many blocks run as ``ops.map`` loops on the tracing backends. One query (a
decoding step) takes a short path on the (B, G, M, S) view.

The masks are the core's too: a block's boolean mask (causal, sliding window, a caller's
mask: ``block_mask``, the spec's one position rule applied to index tensors), the
caller's mask in its standard form (``standardize_mask``) and the keys a block can see
(``key_range``).
"""

from __future__ import annotations

import dataclasses
import math

import keras
from keras import ops

from dcmha import framework, registry
from dcmha.call import block_rows, describe, shape_of as _shape
from dcmha.framework._common import as_dtype
from dcmha.ops.composition import _compose_qm, compose_matrices, decode_compose
from dcmha.spec import terms as spec_terms


#: The plain core's registration (entry point ``ops`` of ``dcmha.implementations``): every
#: backend, device and capability, and every compose term (its arithmetic is read from the
#: spec).
IMPLEMENTATION = registry.Implementation(
    name="ops", backend="any", module="dcmha.ops", devices=frozenset({"cpu", "gpu", "tpu"}),
    terms=frozenset(spec_terms.TERM_NAMES),
    description="the plain keras.ops core (every backend, every capability)")


def core_result(result, return_attention_scores):
    """A fast path's kernel result as the cores return it: (o, extras).

    ``result`` is o, or (o, scores) with ``return_attention_scores``.
    """
    if return_attention_scores:
        o, scores = result
        return o, {"attention_scores": scores}
    return result, {}


def explain_implementation(q, k, v, **kwargs):
    """[(name, reason)]: why ``implementation="auto"`` passes over each fast path for
    this call (None for the one it takes); arguments as ``dcmha_attention``."""
    return registry.explain(describe(q, k, v, **kwargs))


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
            (``dcmha.registry``; see ``dcmha.registry.select``).

    Returns:
        o (B, T, N, d_v) float32, or (o, extras) when scores or intermediates are
        asked for (a dict with "attention_scores" and/or the intermediates).
    """
    registry.resolve(implementation)
    call = describe(
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
    _, core = registry.select(implementation, call)
    o, extras = core(call)
    if return_attention_scores or return_intermediates:
        return o, extras
    return o


# ---------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------

# A finite "minus infinity" (``dcmha.spec.terms.MASKED_SCORE``): a fully masked
# row stays finite through softmax (it becomes uniform and is zeroed afterwards).
_MASKED = spec_terms.MASKED_SCORE


def block_mask(attention_mask, t0, t1, s0, s1, *, use_causal_mask, sliding_window,
                query_offset):
    """The boolean mask of queries [t0, t1) x keys [s0, s1): (B or 1, t, s), or
    (B or 1, N, t, s) with a per-head ``attention_mask``, or None.

    Query t sits at absolute position ``query_offset + t``, key s at s; which keys a
    query sees is the spec's one position rule (``dcmha.spec.terms.visible``), applied
    here to int32 index tensors.
    """
    mask = None
    if use_causal_mask or sliding_window is not None:
        rows = framework.arange_int32(t0, t1)[:, None]
        cols = framework.arange_int32(s0, s1)[None, :]
        mask = spec_terms.visible(rows, cols, causal=bool(use_causal_mask), window=sliding_window,
                                  offset=ops.cast(query_offset, "int32"))[None]
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


def key_range(t0, t1, S, *, use_causal_mask, sliding_window, query_offset):
    """Keys [s0, s1) that queries [t0, t1) can see, from static knowledge only
    (``dcmha.spec.terms.key_range``; all keys when the offset is a tensor)."""
    if not isinstance(query_offset, int):
        return 0, S
    return spec_terms.key_range(t0, t1, S, causal=bool(use_causal_mask), window=sliding_window,
                                offset=query_offset)


# ---------------------------------------------------------------------------
# The plain core
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
        block_bytes = 4 * 2 ** 20 if framework.device() == "cpu" else 256 * 2 ** 20
    chunk = block_rows(batch, num_heads, key_length, block_bytes)
    return chunk if chunk < query_length else None


def split_blocks(x, bounds, axis=1):
    """Pieces of x along ``axis`` at ``bounds`` [(start, stop), ...] (one op)."""
    if len(bounds) == 1:
        return [x]
    return ops.split(x, [b[0] for b in bounds[1:]], axis=axis)


def join_blocks(parts, axis=1):
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=axis)


#: More query chunks than this are not unrolled on the tracing backends
#: (``dcmha.framework.LOOPED_CHUNKS``): they run as ``_LOOP_SPANS`` spans of equal
#: chunks, each span an ``ops.map`` loop against the keys its queries can see, so the
#: traced graph (and the compile time) stays bounded for long sequences.
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
            and framework.LOOPED_CHUNKS):
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
