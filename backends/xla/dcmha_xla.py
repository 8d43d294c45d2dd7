"""The DCMHA attention core for TensorFlow as one XLA-compiled function.

``dcmha_attention`` runs scores -> pre-compose -> masked softmax -> post-compose
-> zero masked -> P.V inside a single ``tf.function(jit_compile=True)``, one
compiled function per static configuration (which compose terms are present,
masking, window, scale, chunk size; TensorFlow itself retraces per shape and
dtype). Called inside a caller's jitted function (a Keras train step), the core
is traced inline into the caller's XLA computation instead.

Memory: queries are processed in chunks of ``query_chunk_size`` rows, so the
largest intermediate is a (B, N, chunk, S_group) tile instead of (B, N, T, S).
The chunks form at most ``MAX_GROUPS`` contiguous groups. The groups are
unrolled, each against the key range its queries can see (with the causal mask
keys after the group's last query are skipped, with a sliding window keys
before its first window start too); the chunks of one group run in one XLA while
loop (``tf.map_fn``) against the group's key range, so compile time and the
number of live tiles stay bounded for long sequences. A group only starts once
the group ``_LANES`` before it has finished (a data dependency), or XLA's CPU
scheduler would run them all at once and hold every tile.

Gradients come from TensorFlow's autodiff: compiled by XLA with the rest when
the caller's train step is jitted; an eager ``tf.GradientTape`` (or a plain
``tf.function``) around a call works too (with looped groups its backward is a
second compiled function that recomputes the forward).

``dcmha_attention_reference`` has the same signature and computes the same thing
with plain, materialising TensorFlow ops written like ``spec/reference.py``
(``query_chunk_size`` is accepted and ignored there: the result does not depend
on it). Keep the two side by side when changing either.

Shapes (the spec's letters): q (B, T, N, d); k (B, S, N_kv, d); v (B, S, N_kv,
d_v); query head n reads kv head n // (N / N_kv); heads n = g * M + m form G
groups of M = N / G. ``pre`` / ``post`` hold the compose terms of one stage:

    "qw1", "qw2" (B, T, G, R, M)   query-wise low-rank projection (both or neither)
    "kw1", "kw2" (B, S, G, R, M)   key-wise low-rank projection (both or neither)
    "qdd" (B, T, G, M), "kdd" (B, S, G, M)   query-/key-wise gating
    "static" (G, M, M)             static composition

A missing key switches that term off; ``None`` switches the stage off (an empty
dict is a stage with only the identity). ``mask`` is boolean, True = attend,
broadcastable to (B, T, S). Causal is s <= t; ``sliding_window``
W alone is |t - s| < W, with ``causal`` t - W < s <= t. Scores, compose and the
softmax are float32 whatever the input dtype; P.V accumulates in float32; the
output has q's dtype. Fully masked rows give 0 and masked probabilities are
exactly 0.

Importing this module does not import TensorFlow; the first call does.
"""

from __future__ import annotations

import collections
import importlib.util
import math
import os
from typing import Dict, Mapping, Optional

from dcmha.call import block_rows
from dcmha.spec import terms as spec_terms

from .. import kernel_call
from ..tf_common import in_xla_context

__all__ = ["dcmha_attention", "dcmha_attention_reference", "default_query_chunk_size",
           "is_available", "TERM_NAMES"]

#: The compose-term names a ``pre`` / ``post`` dict may hold (``dcmha.spec.terms``).
TERM_NAMES = spec_terms.TERM_NAMES

#: Default budget for one (B, N, chunk, S) float32 tile (bytes). XLA makes several passes
#: over the tile (compose, softmax, compose, matmuls); tiles that stay in the last-level
#: cache make those passes cheap (measured on CPU: 4 MiB tiles train ~1.5x faster than
#: 64 MiB ones), and with the causal mask smaller chunks skip more keys.
CHUNK_BUDGET_BYTES = 4 * 2 ** 20
#: The default chunk is never below this many queries (tiny chunks waste XLA work).
MIN_DEFAULT_CHUNK = 16
#: The chunks are processed in at most this many groups. The groups are unrolled, each
#: against the key range its queries can see (with the causal mask or a window); the
#: chunks of one group run in one XLA while loop against the group's key range (one
#: compiled body, one chunk's intermediates alive). More groups skip more keys (with K
#: groups and the causal mask about (K + 1) / 2K of the scores are computed) but
#: compile longer: every group has its own shapes.
MAX_GROUPS = 16
# The masked-score fill (``dcmha.spec.terms.MASKED_SCORE``).
_MASKED = spec_terms.MASKED_SCORE
#: Group i starts after group i - _LANES has finished, so at most _LANES groups run (and
#: hold their intermediates) at once, while XLA may still overlap two on two cores.
_LANES = 2


def is_available() -> bool:
    """Whether TensorFlow (with XLA) can be imported; does not import it."""
    return importlib.util.find_spec("tensorflow") is not None


def _tf():
    import tensorflow as tf  # deferred: `import dcmha` must not import TensorFlow
    return tf


def _dim(x, i):
    """Static size of axis i when known, else the dynamic one.

    Static sizes matter: a shape computed from an argument inside the compiled
    function and reused by its gradient makes XLA treat the argument as a
    compile-time constant when the call is nested in another jitted function.
    """
    n = x.shape[i]
    return n if n is not None else _tf().shape(x)[i]


# ---------------------------------------------------------------------------
# Argument checks (shared by the fast path and the reference)
# ---------------------------------------------------------------------------

def _arguments(q, k, v, num_groups, pre, post, mask, causal, sliding_window, scale,
               query_chunk_size):
    """The checked arguments (shared by the fast path and the reference).

    Converts them to tensors, checks them (``kernel_call.describe``, then what only
    TensorFlow knows and this core needs) and returns q, k, v, pre, post (None when
    off), the mask as rank 3 (B|1, T|1, S|1) (or None) and the scale (default
    1 / sqrt(d)).
    """
    tf = _tf()
    q, k, v, pre, post, mask = _prepare(q, k, v, pre, post, mask)
    call = kernel_call.describe(q, k, v, num_groups=num_groups, pre=pre, post=post, mask=mask,
                                causal=causal, sliding_window=sliding_window,
                                query_chunk_size=query_chunk_size)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.dtype.is_floating:
            raise TypeError(f"`{name}` must be a floating tensor. Received: dtype={x.dtype.name}")
    if None in (call.N, call.d, call.N_kv, call.d_v):
        raise ValueError("The head counts and head sizes (the last two axes of `q`, `k` and "
                         f"`v`) must be static. Received: q.shape={tuple(q.shape)}, "
                         f"k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale)):
        raise ValueError(f"`scale` must be None or a finite number. Received: scale={scale!r}")
    for stage, terms in call.stages.items():
        for name, x in terms.items():
            if not x.dtype.is_floating:
                raise TypeError(f"`{stage}['{name}']` must be floating. Received: "
                                f"dtype={x.dtype.name}")
    if mask is not None and mask.dtype != tf.bool:
        raise TypeError(f"`mask` must be boolean (True = attend). Received: "
                        f"dtype={mask.dtype.name}")
    scale = 1.0 / math.sqrt(call.d) if scale is None else float(scale)
    return q, k, v, call.pre, call.post, kernel_call.shared_mask(mask), scale


def _prepare(q, k, v, pre, post, mask):
    """The arguments as tensors (a stage that is not a dict is left for the checks)."""
    tf = _tf()
    q, k, v = (tf.convert_to_tensor(x) for x in (q, k, v))
    pre, post = ({n: tf.convert_to_tensor(x) for n, x in terms.items()}
                 if isinstance(terms, Mapping) else terms for terms in (pre, post))
    mask = None if mask is None else tf.convert_to_tensor(mask)
    return q, k, v, pre, post, mask


# ---------------------------------------------------------------------------
# The reference: materialising, written like spec/reference.py
# ---------------------------------------------------------------------------

def _compose_reference(a, G, terms):
    """compose() of the spec on a (B, N, T, S) float32 tensor."""
    tf = _tf()
    f32 = lambda n: tf.cast(terms[n], tf.float32)  # noqa: E731
    B, N, T, S = (_dim(a, i) for i in range(4))
    M = a.shape[1] // G
    x = tf.reshape(a, [B, G, M, T, S])
    out = x
    if "static" in terms:
        out += tf.einsum("bgmts,gmn->bgnts", x, f32("static"))
    if "qw1" in terms:
        hidden = tf.einsum("bgmts,btgrm->bgrts", x, f32("qw1"))
        out += tf.einsum("bgrts,btgrn->bgnts", hidden, f32("qw2"))
    if "kw1" in terms:
        hidden = tf.einsum("bgmts,bsgrm->bgrts", x, f32("kw1"))
        out += tf.einsum("bgrts,bsgrn->bgnts", hidden, f32("kw2"))
    if "qdd" in terms:
        out += x * tf.transpose(f32("qdd"), [0, 2, 3, 1])[..., None]
    if "kdd" in terms:
        out += x * tf.transpose(f32("kdd"), [0, 2, 3, 1])[..., None, :]
    return tf.reshape(out, [B, N, T, S])


def dcmha_attention_reference(q, k, v, *, num_groups, pre=None, post=None, mask=None,
                              causal=False, sliding_window=None, scale=None,
                              query_chunk_size=None, return_attention_scores=False):
    """The DCMHA core in plain TensorFlow ops, materialising (B, N, T, S).

    Same arguments and result as ``dcmha_attention`` (``query_chunk_size`` is
    ignored: the result does not depend on it). Differentiable by autodiff.
    """
    tf = _tf()
    q, k, v, pre, post, mask, scale = _arguments(
        q, k, v, num_groups, pre, post, mask, causal, sliding_window, scale, query_chunk_size)
    B, T, S = _dim(q, 0), _dim(q, 1), _dim(k, 1)
    rep = q.shape[2] // k.shape[2]
    k_h = tf.repeat(tf.cast(k, tf.float32), rep, axis=2)   # query head n reads kv head n // rep
    v_h = tf.repeat(tf.cast(v, tf.float32), rep, axis=2)
    scores = tf.einsum("btnh,bsnh->bnts", tf.cast(q, tf.float32), k_h) * scale
    a = scores if pre is None else _compose_reference(scores, num_groups, pre)
    t = tf.range(T)[:, None]
    s = tf.range(S)[None, :]
    allowed = tf.ones([B, T, S], tf.bool)
    if mask is not None:
        allowed &= tf.broadcast_to(mask, [B, T, S])
    rule = spec_terms.visible(t, s, causal=causal, window=sliding_window)
    if rule is not True:
        allowed &= rule[None]
    m = allowed[:, None]
    amax = tf.reduce_max(tf.where(m, a, -math.inf), axis=-1, keepdims=True)
    amax = tf.stop_gradient(tf.where(tf.math.is_finite(amax), amax, 0.0))
    e = tf.where(m, tf.exp(tf.where(m, a, amax) - amax), 0.0)
    denom = tf.reduce_sum(e, axis=-1, keepdims=True)
    probs = e / tf.where(denom == 0.0, 1.0, denom)
    p = probs if post is None else _compose_reference(probs, num_groups, post)
    p = tf.where(m, p, 0.0)
    o = tf.cast(tf.einsum("bnts,bsnh->btnh", p, v_h), q.dtype)
    return (o, p) if return_attention_scores else o


# ---------------------------------------------------------------------------
# The XLA fast path
# ---------------------------------------------------------------------------

def default_query_chunk_size(batch: Optional[int], num_heads: int, query_length: Optional[int],
                             key_length: Optional[int]) -> Optional[int]:
    """The chunk size used when ``query_chunk_size`` is None (None = one chunk).

    The largest power of two keeping one (B, N, chunk, S) float32 tile within
    ``CHUNK_BUDGET_BYTES``, but at least ``MIN_DEFAULT_CHUNK`` queries (e.g. B=2,
    N=8, T=S=1024: 64; B=1, N=16, T=S=16384: 16). An unknown batch size counts as 1.
    """
    if query_length is None or key_length is None:
        return None
    c = block_rows(batch or 1, num_heads, key_length, CHUNK_BUDGET_BYTES,
                   smallest=MIN_DEFAULT_CHUNK, largest=None)
    return None if c >= query_length else c


def _compose_fast(x, terms, row_scale=None):
    """compose() of (x * row_scale) for x (B, G, M, t, s) float32, pre-laid-out terms.

    terms: "qw1"/"qw2" (B, G, R, M, t, 1); "kw1"/"kw2" (B, G, R, M, 1, s);
    "qdd" (B, G, M, t, 1); "kdd" (B, G, M, 1, s); "static" (1, G, M, M, 1, 1).
    row_scale: None or (B, G, M, t, 1), the softmax's 1/denominator: passing it here
    rather than normalising first lets XLA fuse the normalisation into the compose
    loops instead of writing the normalised tensor out (and it folds into qw1).
    Written as broadcast products reduced over the small head/rank axes (not as
    einsums) so XLA fuses each term into a loop over the (t, s) tile instead of
    transposing the big tensor into a dot.
    """
    tf = _tf()
    xs = x if row_scale is None else x * row_scale
    out = xs
    if "static" in terms:
        out += tf.reduce_sum(xs[:, :, :, None] * terms["static"], axis=2)
    for side in ("q", "k"):
        if side + "w1" in terms:
            w1 = terms[side + "w1"]
            if side == "q" and row_scale is not None:
                hidden = tf.reduce_sum(x[:, :, None] * (w1 * row_scale[:, :, None]), axis=3,
                                       keepdims=True)
            else:
                hidden = tf.reduce_sum(xs[:, :, None] * w1, axis=3, keepdims=True)
            out += tf.reduce_sum(hidden * terms[side + "w2"], axis=2)
    gate = None
    for name in ("qdd", "kdd"):
        if name in terms:
            gate = terms[name] if gate is None else gate + terms[name]
    if gate is not None:
        out += xs * gate
    return out


def _layout_terms(terms):
    """Transpose a stage's terms once into _compose_fast's layout (before slicing)."""
    tf = _tf()
    out = {}
    for name, w in terms.items():
        w = tf.cast(w, tf.float32)
        if name in ("qw1", "qw2"):           # (B,T,G,R,M) -> (B,G,R,M,T,1)
            out[name] = tf.transpose(w, [0, 2, 3, 4, 1])[..., None]
        elif name in ("kw1", "kw2"):         # (B,S,G,R,M) -> (B,G,R,M,1,S)
            out[name] = tf.transpose(w, [0, 2, 3, 4, 1])[..., None, :]
        elif name == "qdd":                  # (B,T,G,M) -> (B,G,M,T,1)
            out[name] = tf.transpose(w, [0, 2, 3, 1])[..., None]
        elif name == "kdd":                  # (B,S,G,M) -> (B,G,M,1,S)
            out[name] = tf.transpose(w, [0, 2, 3, 1])[..., None, :]
        else:                                # (G,M,M) -> (1,G,M,M,1,1)
            out[name] = w[None, :, :, :, None, None]
    return out


def _slice_terms(terms, t0, t1, lo, hi):
    if terms is None:
        return None
    out = {}
    for name, w in terms.items():
        if name[0] == "q":
            out[name] = w[..., t0:t1, :]
        elif name[0] == "k":
            out[name] = w[..., lo:hi]
        else:
            out[name] = w
    return out


def _slice_mask(mask, t0, t1, lo, hi):
    """Rows [t0, t1) and columns [lo, hi) of a (B, T, S) mask; size-1 (broadcast) axes stay."""
    if mask is None:
        return None
    rows = slice(None) if mask.shape[1] == 1 else slice(t0, t1)
    cols = slice(None) if mask.shape[2] == 1 else slice(lo, hi)
    return mask[:, rows, cols]


def _after(x, y):
    """x plus an exact 0 computed from y: makes x's consumers wait for y.

    XLA's CPU scheduler otherwise runs the independent chunks concurrently and keeps
    all their (B, N, chunk, S) intermediates alive at once, i.e. the whole score
    matrix. The 0 is ``0 * float(isnan(y[0]))``, exact whatever y holds, and carries
    no gradient.
    """
    tf = _tf()
    if x is None:
        return None
    zero = tf.stop_gradient(tf.cast(tf.math.is_nan(tf.reshape(y, [-1])[0]), tf.float32) * 0.0)
    if x.dtype == tf.bool:
        return x & tf.equal(zero, 0.0)
    return x + tf.cast(zero, x.dtype)


def _block(q, k, v, pre, post, mask, *, t0, lo, causal, window, G):
    """One query chunk against its key range.

    q: (B, N_kv, rep, t, d) float32, already scaled; k: (B, N_kv, s, d); v: (B, N_kv, s, d_v)
    float32; mask: None or bool broadcasting to (B, t, s). Returns o (B, N_kv, rep, t, d_v)
    and the post-composed masked probabilities (B, G, M, t, s), float32.
    """
    tf = _tf()
    _, N_kv, rep, t, d = q.shape.as_list()
    Bd, t, s = _dim(q, 0), _dim(q, 3), _dim(k, 2)
    M = N_kv * rep // G
    # (B, N_kv, rep*t, d) @ (B, N_kv, d, s): one batched matmul, heads n = kv*rep + r.
    scores = tf.matmul(tf.reshape(q, [Bd, N_kv, -1, d]), k, transpose_b=True)
    a = tf.reshape(scores, [Bd, G, M, t, s])
    if pre is not None:
        a = _compose_fast(a, pre)
    allowed = None
    if causal or window is not None:
        ti = tf.range(t)[:, None] + t0
        si = tf.range(s)[None, :] + lo
        if causal:
            allowed = si <= ti
        if window is not None:
            band = (ti - si < window) if causal else (tf.abs(ti - si) < window)
            allowed = band if allowed is None else allowed & band
    if mask is not None:
        allowed = mask if allowed is None else mask & allowed
    if allowed is not None:
        m = allowed[:, None, None] if allowed.shape.rank == 3 else allowed
        # Masked scores get MASKED_SCORE: a fully masked row has max MASKED_SCORE
        # (finite), and exp(MASKED_SCORE - ...) is exactly 0 at masked entries, with a
        # zero gradient (no NaN).
        amax = tf.stop_gradient(tf.reduce_max(tf.where(m, a, _MASKED), axis=-1, keepdims=True))
        e = tf.exp(tf.where(m, a - amax, _MASKED))
    else:
        e = tf.exp(a - tf.stop_gradient(tf.reduce_max(a, axis=-1, keepdims=True)))
    denom = tf.reduce_sum(e, axis=-1, keepdims=True)
    # denom >= 1 when any key is allowed (the max contributes exp(0) = 1); it is 0 for a
    # fully masked row, whose e is all 0, and max(denom, 1) then leaves that row 0.
    inv = 1.0 / (tf.maximum(denom, 1.0) if allowed is not None else denom)
    if post is not None:
        # Compose is linear per (t, s) and the mask is shared by the heads, so masked
        # entries (0 in every head) stay exactly 0: no second where() is needed.
        p = _compose_fast(e, post, row_scale=inv)
    else:
        p = e * inv
    o = tf.matmul(tf.reshape(p, [Bd, N_kv, -1, s]), v)
    return tf.reshape(o, [Bd, N_kv, rep, t, -1]), p


def _groups(n: int, max_groups: int):
    """Split chunks 0..n-1 into at most max_groups contiguous (first, stop) ranges."""
    K = min(n, max_groups)
    sizes = [n // K + (1 if j < n % K else 0) for j in range(K)]
    starts = [sum(sizes[:j]) for j in range(K)]
    return [(a, a + m) for a, m in zip(starts, sizes)]


def _split(x, axis, n, c):
    """x with its axis ``axis`` (n * c long) split into (n, c) and n moved to the front."""
    tf = _tf()
    shape = [_dim(x, i) for i in range(x.shape.rank)]
    x = tf.reshape(x, shape[:axis] + [n, c] + shape[axis + 1:])
    return tf.transpose(x, [axis] + [i for i in range(x.shape.rank) if i != axis])


def _merge(x, axis):
    """Inverse of _split: (n, ..., c at axis+1 ...) -> (..., n * c at axis, ...)."""
    tf = _tf()
    rank = x.shape.rank
    perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank))
    x = tf.transpose(x, perm)
    shape = [_dim(x, i) for i in range(rank)]
    return tf.reshape(x, shape[:axis] + [-1] + shape[axis + 2:])


def _group(ins, *, t0, n, c, lo, causal, window, G, want_scores):
    """Chunks [t0, t0 + n*c) of the queries against keys [lo, lo + s): o (and p), stacked.

    ins: the group's slices (q (B, N_kv, rep, n*c, d), k, v, pre, post, mask). One chunk
    is a plain _block; several run in one tf.map_fn (an XLA while loop).
    """
    tf = _tf()
    if n == 1:
        return _block(ins["q"], ins["k"], ins["v"], ins["pre"], ins["post"], ins["mask"],
                      t0=t0, lo=lo, causal=causal, window=window, G=G)
    q_axis = {"qw1": 4, "qw2": 4, "qdd": 3}   # the T axis of the laid-out query-side terms
    mask = ins["mask"]
    per_row_mask = mask is not None and mask.shape[1] != 1
    elems = {"q": _split(ins["q"], 3, n, c), "t0": t0 + c * tf.range(n)}
    for stage in ("pre", "post"):
        if ins[stage] is not None:
            elems[stage] = {name: _split(w, q_axis[name], n, c)
                            for name, w in ins[stage].items() if name in q_axis}
    if per_row_mask:
        elems["mask"] = _split(mask, 1, n, c)

    def one_chunk(e):
        stage = lambda st: None if ins[st] is None else {  # noqa: E731
            name: e[st][name] if name in q_axis else w for name, w in ins[st].items()}
        o, p = _block(e["q"], ins["k"], ins["v"], stage("pre"), stage("post"),
                      e["mask"] if per_row_mask else mask, t0=e["t0"], lo=lo, causal=causal,
                      window=window, G=G)
        return (o, p) if want_scores else o

    out = tf.map_fn(one_chunk, elems, fn_output_signature=(
        (tf.float32, tf.float32) if want_scores else tf.float32))
    if want_scores:
        return _merge(out[0], 3), _merge(out[1], 3)
    return _merge(out, 3), None


def _core(q, k, v, pre, post, mask, *, G, causal, window, scale, chunk, want_scores):
    """The traced body of the compiled function (see dcmha_attention)."""
    tf = _tf()
    _, T, N, d = q.shape.as_list()
    S, N_kv = k.shape.as_list()[1:3]
    rep = N // N_kv
    M = N // G
    Bd, Td, Sd = _dim(q, 0), _dim(q, 1), _dim(k, 1)
    # (B, T, N, d) -> (B, N_kv, rep, T, d): the layout of the batched matmuls.
    qh = tf.transpose(tf.reshape(tf.cast(q, tf.float32) * scale, [Bd, Td, N_kv, rep, d]),
                      [0, 2, 3, 1, 4])
    kh = tf.transpose(tf.cast(k, tf.float32), [0, 2, 1, 3])
    vh = tf.transpose(tf.cast(v, tf.float32), [0, 2, 1, 3])
    pre = None if pre is None else _layout_terms(pre)
    post = None if post is None else _layout_terms(post)
    if T is None or chunk is None or chunk >= T:
        c, n = T, 1   # one chunk (with unknown T, masks come from iota alone)
    else:
        c, n = chunk, -(-T // chunk)
        if n * c > T:   # pad the queries to whole chunks; the extra rows are dropped below
            pad = n * c - T
            qh = tf.pad(qh, [[0, 0]] * 3 + [[0, pad], [0, 0]])
            for terms in (pre, post):
                for name in (terms or {}):
                    if name[0] == "q":
                        w = terms[name]
                        terms[name] = tf.pad(w, [[0, 0]] * (w.shape.rank - 2) + [[0, pad], [0, 0]])
            if mask is not None and mask.shape[1] != 1:
                mask = tf.pad(mask, [[0, 0], [0, pad], [0, 0]], constant_values=True)
    outs, probs = [], []
    for first, stop in _groups(n, MAX_GROUPS):
        t0, t1 = first * c if c else 0, None if T is None else min(stop * c, T)
        rows = None if T is None else (stop - first) * c
        lo, hi = 0, None
        if T is not None:   # an unknown S is unbounded: hi None, to the end
            lo, hi = spec_terms.key_range(t0, t1, math.inf if S is None else S,
                                          causal=causal, window=window)
            hi = None if hi == math.inf else hi
        if hi is not None and hi <= lo:   # no key visible from this group
            outs.append(tf.zeros([Bd, N_kv, rep, rows, v.shape[-1]], tf.float32))
            if want_scores:
                probs.append(tf.zeros([Bd, G, M, rows, Sd], tf.float32))
            continue
        t_end = None if T is None else t0 + rows
        ins = dict(q=qh[:, :, :, t0:t_end], k=kh[:, :, lo:hi], v=vh[:, :, lo:hi],
                   pre=_slice_terms(pre, t0, t_end, lo, hi),
                   post=_slice_terms(post, t0, t_end, lo, hi),
                   mask=_slice_mask(mask, t0, t_end, lo, hi))
        if len(outs) >= _LANES:
            # Every slice of this group waits for the group _LANES before: otherwise XLA's
            # scheduler runs all groups (and copies all key slices) at once, holding the
            # whole score matrix in memory.
            ins = tf.nest.map_structure(lambda x, y=outs[-_LANES]: _after(x, y), ins)
        o_g, p_g = _group(ins, t0=t0, n=stop - first, c=c, lo=lo, causal=causal,
                          window=window, G=G, want_scores=want_scores)
        outs.append(o_g)
        if want_scores:
            probs.append(tf.pad(p_g, [[0, 0]] * 4 + [[lo, Sd - (Sd if hi is None else hi)]]))
    o = outs[0] if len(outs) == 1 else tf.concat(outs, axis=3)      # (B, N_kv, rep, T, d_v)
    if T is not None:
        o = o[:, :, :, :T]
    o = tf.reshape(tf.transpose(o, [0, 3, 1, 2, 4]), [Bd, Td, N, -1])
    o = tf.cast(o, q.dtype)
    if not want_scores:
        return o
    p = probs[0] if len(probs) == 1 else tf.concat(probs, axis=3)   # (B, G, M, T, S)
    if T is not None:
        p = p[:, :, :, :T]
    return o, tf.reshape(p, [Bd, N, Td, Sd])


#: Compiled functions by static configuration, least recently used first. Bounded: each
#: holds its traced graphs and XLA executables (one per input shape), so a process that
#: sees many configurations keeps at most ``COMPILE_CACHE_SIZE`` of them
#: (``DCMHA_XLA_CACHE_SIZE``, default 32); an evicted one is traced again when next used.
COMPILE_CACHE_SIZE = max(1, int(os.environ.get("DCMHA_XLA_CACHE_SIZE", "32")))
_COMPILED: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()


def _remember(key, fn):
    _COMPILED[key] = fn
    while len(_COMPILED) > COMPILE_CACHE_SIZE:
        _COMPILED.popitem(last=False)
    return fn


def _compiled(key):
    """The differentiable, XLA-compiled core of one static configuration (cached).

    Returns f(q, k, v, mask, pre_vals, post_vals): one tf.function(jit_compile=True),
    differentiated by TensorFlow. When the chunks run in XLA loops (``looped``) that
    would hand the loops' saved intermediates (TensorLists) across the XLA boundary,
    which XLA does not support; the gradient is then a second compiled function that
    recomputes the forward and differentiates it inside XLA (wired with
    tf.custom_gradient).
    """
    fn = _COMPILED.get(key)
    if fn is not None:
        _COMPILED.move_to_end(key)
        return fn
    tf = _tf()
    G, pre_names, post_names, has_mask, causal, window, scale, chunk, want, looped = key
    n_pre, n_post = len(pre_names or ()), len(post_names or ())

    def run(q, k, v, mask, pre_vals, post_vals):
        pre = None if pre_names is None else dict(zip(pre_names, pre_vals))
        post = None if post_names is None else dict(zip(post_names, post_vals))
        return _core(q, k, v, pre, post, mask, G=G, causal=causal, window=window,
                     scale=scale, chunk=chunk, want_scores=want)

    def backward(q, k, v, mask, pre_vals, post_vals, d_out):
        xs = [q, k, v, pre_vals, post_vals]
        with tf.GradientTape() as tape:
            tape.watch(xs)
            out = run(q, k, v, mask, pre_vals, post_vals)
        return tape.gradient(out, xs, output_gradients=d_out)

    forward_xla = tf.function(run, jit_compile=True, autograph=False)
    if not looped:
        return _remember(key, forward_xla)
    backward_xla = tf.function(backward, jit_compile=True, autograph=False)

    def split(flat):
        q, k, v = flat[:3]
        pre_vals, post_vals = list(flat[3:3 + n_pre]), list(flat[3 + n_pre:3 + n_pre + n_post])
        mask = flat[3 + n_pre + n_post] if has_mask else None
        return q, k, v, mask, pre_vals, post_vals

    @tf.custom_gradient
    def attention(*flat):
        q, k, v, mask, pre_vals, post_vals = split(flat)
        # stop_gradient: the tape must not differentiate the compiled call itself
        out = forward_xla(*tf.nest.map_structure(
            lambda x: None if x is None else tf.stop_gradient(x),
            (q, k, v, mask, pre_vals, post_vals)))

        def grad(*d_out):
            outs = tf.nest.flatten(out)
            d_out = [tf.zeros_like(o) if g is None else g for o, g in zip(outs, d_out)]
            d_out = d_out if want else d_out[0]
            dq, dk, dv, d_pre, d_post = backward_xla(q, k, v, mask, pre_vals, post_vals, d_out)
            return [dq, dk, dv] + list(d_pre) + list(d_post) + ([None] if has_mask else [])

        return out, grad

    def fn(q, k, v, mask, pre_vals, post_vals):
        return attention(q, k, v, *pre_vals, *post_vals, *([mask] if has_mask else []))

    return _remember(key, fn)


def dcmha_attention(q, k, v, *, num_groups, pre=None, post=None, mask=None, causal=False,
                    sliding_window=None, scale=None, query_chunk_size=None,
                    return_attention_scores=False):
    """DCMHA attention core, XLA-compiled and chunked over queries.

    Args:
        q: (B, T, N, d) queries (after projection, QK-norm and RoPE).
        k: (B, S, N_kv, d) keys; v: (B, S, N_kv, d_v) values.
        num_groups: G, the number of composition groups (N % G == 0).
        pre / post: None (stage off) or a dict of compose terms (module docstring).
        mask: None or bool, broadcastable to (B, T, S), True = attend.
        causal: apply the causal mask s <= t.
        sliding_window: None or W (|t - s| < W; with ``causal``, t - W < s <= t).
        scale: score scale, default 1 / sqrt(d).
        query_chunk_size: queries per chunk; None picks ``default_query_chunk_size``.
            Results do not depend on it (up to float32 rounding).
        return_attention_scores: also return the post-composed, masked
            probabilities (B, N, T, S) in float32 (this materialises them).

    Returns:
        o (B, T, N, d_v) in q's dtype, or (o, scores) with ``return_attention_scores``.

    The head axes (N, N_kv, d, d_v) must be static; the batch and the lengths may
    be unknown at trace time (an unknown T means one chunk). Raises ValueError /
    TypeError naming the argument for a bad shape, dtype or option.
    """
    tf = _tf()
    q, k, v, pre, post, mask, scale = _arguments(
        q, k, v, num_groups, pre, post, mask, causal, sliding_window, scale, query_chunk_size)
    B, T, N, _ = q.shape.as_list()
    S = k.shape[1]
    chunk = query_chunk_size
    if chunk is None:
        chunk = default_query_chunk_size(B, N, T, S)
    if chunk is not None and T is not None and chunk >= T:
        chunk = None
    pre_names = None if pre is None else tuple(sorted(pre))
    post_names = None if post is None else tuple(sorted(post))
    looped = chunk is not None and T is not None and -(-T // chunk) > MAX_GROUPS
    key = (num_groups, pre_names, post_names, mask is not None, bool(causal), sliding_window,
           scale, chunk, bool(return_attention_scores), looped)
    if in_xla_context():
        # Already inside an XLA-compiled function (e.g. a jitted train step): trace the core
        # inline. Calling the nested jitted function instead would make its gradient pass
        # shape tensors across the call, and XLA would then fold the caller's arguments
        # into compile-time constants (recompiling, and slowly, for every new value).
        with tf.name_scope("dcmha_attention"):
            return _core(q, k, v, pre, post, mask, G=num_groups, causal=bool(causal),
                         window=sliding_window, scale=scale, chunk=chunk,
                         want_scores=bool(return_attention_scores))
    pre_vals = [] if pre is None else [pre[n] for n in pre_names]
    post_vals = [] if post is None else [post[n] for n in post_names]
    return _compiled(key)(q, k, v, mask, pre_vals, post_vals)
