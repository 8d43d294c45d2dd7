"""The blocked attention core shared by the compiled-kernel CPU paths (jax_cpu, tf_cpu).

``attention`` computes, per batch b and composition group g (``spec/SPEC.md``
sections 6-7),

    a  = q k^T * scale                          (M, T, S) for the M heads of g
    A  = Compose(a; pre)                        pre-composition, before masking
    P  = masked_softmax(A)                      float32; fully masked row -> 0
    P' = mask * Compose(P; post)                post-composition, masked -> exactly 0
    o  = P' v

in ``keras.ops`` over blocks of ``block_q`` queries, each against the keys a
causal mask or sliding window leaves visible to it, in the head-major layout
(B, G, M, t, s) that the score matmul writes (no transposes of the score
blocks). A block's compose, mask, softmax and compose are one call of the
framework's primitive ``probs`` that runs the C kernel of
``dcmha.backends.cpu_kernel`` and carries its own gradient (a
``jax.custom_vjp`` over ``jax.ffi``; a TensorFlow op with a registered
gradient), as is each stage's query factor (``query_matrix``); a framework
without them composes with one ``compose(x, wq, kw1, kw2, kdd, flags)`` call per
stage and runs the mask and softmax itself. The matmuls are the framework's,
differentiated by it. Framework ops alone read and write a score block several
times per compose term (and the "ops" core transposes it for its key-side
matmul); the kernel reads it once.

Masked entries get -1e30 before the softmax, so their probabilities are
exactly 0, and so are their post-composed values (compose mixes heads at a
fixed (t, s)); rows without a visible key are zeroed on the output. Under a
causal mask the kernel is told the block's offset (``cpu_kernel.causal_flags``),
and it skips the keys the mask hides (a causal mask alone needs no mask array).
Everything is float32.

``reference`` is the same function without blocks or the kernel
(materialising (B, N, T, S)), composing with the "ops" core's ``dcmha.ops.compose``.
Masks, key ranges and the split / join of the blocks are the "ops" core's helpers too.
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Mapping, Optional

from keras import ops

from dcmha import ops as dops
from dcmha.spec.terms import MASKED_SCORE

from . import cpu_kernel

__all__ = ["KernelPath", "attention", "reference", "stage_arrays", "flags_of", "block_attrs"]

_NEG = MASKED_SCORE


class KernelPath:
    """The compiled kernel of one framework path, built on first use.

    ``build()`` returns (handle, None) or (None, reason); ``primitives(handle)`` returns
    the framework's kernel primitives as ``attention``'s keyword arguments: ``compose``
    (``compose(x, wq, kw1, kw2, kdd, flags)``), and optionally ``probs`` and
    ``query_matrix``.
    ``DCMHA_CPU_KERNEL=0`` makes the path unavailable (checked on every call).
    """

    def __init__(self, build: Callable, primitives: Callable):
        self._build, self._primitives = build, primitives
        self._lock = threading.Lock()
        self._state: dict = {}

    def load(self) -> bool:
        """Build (or load from the cache) the kernel; False if unavailable."""
        if cpu_kernel.disabled():
            return False
        with self._lock:
            if "handle" not in self._state:
                self._state["handle"], self._state["reason"] = self._build()
            return self._state["handle"] is not None

    def handle(self):
        """What ``build()`` made (e.g. the loaded op module), or None when unavailable."""
        return self._state.get("handle") if self.load() else None

    def unavailable_reason(self) -> Optional[str]:
        """Why ``load()`` is False (None when the kernel is ready)."""
        if cpu_kernel.disabled():
            return "disabled by DCMHA_CPU_KERNEL"
        self.load()
        return self._state["reason"]

    def attention(self, q, k, v, **kwargs):
        """``attention(q, k, v, **kwargs)`` with this kernel's compose; differentiable.

        q: (B, T, N, d), k: (B, S, N_kv, d), v: (B, S, N_kv, d_v); keyword arguments
        (num_groups, pre, post, mask, causal, sliding_window, scale, query_offset,
        block_q) and the result (o (B, T, N, d_v) float32) as ``attention``. Raises
        RuntimeError when the kernel is unavailable.
        """
        if not self.load():
            raise RuntimeError(f"the dcmha CPU kernel is unavailable: "
                               f"{self.unavailable_reason()}")
        return attention(q, k, v, **self._primitives(self._state["handle"]), **kwargs)


#: The query-side terms in the order the kernel's query-factor primitive takes them.
QUERY_TERMS = ("qw1", "qw2", "qdd", "static")


def _query_factor(f, M, query_matrix):
    """A stage's query factor wq from its float32 terms f: the framework's kernel primitive
    ``query_matrix(qw1, qw2, qdd, static, flags, shape)`` (1-element dummies for absent
    terms; ``shape`` wq's (B, T, G, M, M)) where a dynamic query-side term is present and
    the shape is known (XLA and TensorFlow run the terms' products as batched matrix
    products of a few rows each, slow in the backward); otherwise
    ``dcmha.ops.query_compose_matrix``."""
    dynamic = f.get("qw1", f.get("qdd"))
    if query_matrix is None or dynamic is None or any(n is None for n in dynamic.shape[:3]):
        return dops.query_compose_matrix(f, M)
    dummy = ops.zeros((1,), "float32")
    return query_matrix(*(f.get(n, dummy) for n in QUERY_TERMS),
                        cpu_kernel.cached_flags([n for n in QUERY_TERMS if n in f]),
                        (*dynamic.shape[:3], M, M))


def stage_arrays(terms: Optional[Mapping], B, T, G, M, query_matrix=None):
    """A stage's kernel arrays (wq, kw1, kw2, kdd), None where absent, or None (no stage).

    wq (B, T, G, M, M) folds the residual, static and query-side terms (out[n] =
    sum_m wq[n, m] x[m], ``_query_factor``); kw1, kw2 (B, G, R, M, S) and kdd (B, G, M,
    S) are the key-side terms with the key axis last.
    """
    if not terms:
        return None
    f = {n: ops.cast(v, "float32") for n, v in terms.items() if v is not None}
    wq = _query_factor(f, M, query_matrix)
    if wq is not None:
        wq = ops.broadcast_to(wq, (B, T, G, M, M))
    kw1 = kw2 = kdd = None
    if "kw1" in f:
        kw1 = ops.transpose(f["kw1"], (0, 2, 3, 4, 1))
        kw2 = ops.transpose(f["kw2"], (0, 2, 3, 4, 1))
    if "kdd" in f:
        kdd = ops.transpose(f["kdd"], (0, 2, 3, 1))
    return wq, kw1, kw2, kdd


def flags_of(stage):
    """The kernel's ``flags`` for a stage: 1 wq, 2 kw1 / kw2, 4 kdd."""
    wq, kw1, _, kdd = stage
    return (1 if wq is not None else 0) | (2 if kw1 is not None else 0) | (
        4 if kdd is not None else 0)


#: The attributes of a block's probabilities as one kernel call (``probs``: jax_cpu's FFI
#: handlers, tf_cpu's ops), as ``block_attrs`` gives them.
BLOCK_ATTRS = ("pre_flags", "post_flags", "has_vis", "masked")
#: vis's shape in that call for a block without one: a 1-element dummy (has_vis 0), which
#: the kernel does not read.
NO_VIS_SHAPE = (1, 1, 1)


def block_attrs(vis, pre_flags, post_flags, integer=int, real=float):
    """``BLOCK_ATTRS`` for ``probs``'s kernel call on a block with mask vis (None: none),
    made by ``integer`` / ``real``: jax.ffi takes numpy's int64 / float32, TensorFlow's
    eager fast path Python's int / float (numpy scalars make it fall back)."""
    return dict(pre_flags=integer(pre_flags), post_flags=integer(post_flags),
                has_vis=integer(vis is not None), masked=real(MASKED_SCORE))


def _split_stage(stage, q_bounds, k_bounds):
    """A stage's arrays as per-block pieces: wq by query block, the key-side terms by key
    block (split once: the gradient of a split is one concatenation, where slicing each
    block out of the full arrays would make autodiff build a full-size gradient per block)."""
    if stage is None:
        return None
    wq, kw1, kw2, kdd = stage
    return (None if wq is None else dops.split_blocks(wq, q_bounds, axis=1),
            *(None if a is None else dops.split_blocks(a, k_bounds, axis=a.ndim - 1)
              for a in (kw1, kw2, kdd)))


def _block_terms(parts, i, j0, j1):
    """A stage's kernel arrays for query block i and key blocks [j0, j1): (wq, kw1, kw2,
    kdd), a 1-element dummy where a term is absent; all dummies without the stage."""
    dummy = ops.zeros((1,), "float32")
    if parts is None:
        return (dummy,) * 4
    wq, kw1, kw2, kdd = parts
    keys = lambda a: dummy if a is None else dops.join_blocks(a[j0:j1], axis=a[0].ndim - 1)  # noqa: E731
    return dummy if wq is None else wq[i], keys(kw1), keys(kw2), keys(kdd)


def _compose_block(compose, x, parts, flags, i, j0, j1):
    """Compose of block x with query block i's wq and key blocks [j0, j1) of the terms."""
    if parts is None:
        return x
    return compose(x, *_block_terms(parts, i, j0, j1), flags)


def _heads(q, k, v, scale):
    """q (B, N, T, d) scaled, k (B, N, d, S), v (B, N, S, d_v), float32 (kv heads repeated)."""
    rep = q.shape[2] // k.shape[2]
    f32 = "float32"
    kh, vh = ops.cast(k, f32), ops.cast(v, f32)
    if rep > 1:
        kh, vh = ops.repeat(kh, rep, axis=2), ops.repeat(vh, rep, axis=2)
    return (ops.transpose(ops.cast(q, f32) * scale, (0, 2, 1, 3)),
            ops.transpose(kh, (0, 2, 3, 1)), ops.transpose(vh, (0, 2, 1, 3)))


def attention(q, k, v, *, compose, num_groups, pre=None, post=None, mask=None, causal=False,
              sliding_window=None, scale=None, query_offset=0, block_q=64, probs=None,
              query_matrix=None):
    """Blocked DCMHA attention whose composes run ``compose`` (see the module doc).

    Args:
        q: (B, T, N, d) queries; k: (B, S, N_kv, d) keys, v: (B, S, N_kv, d_v) values
            (N % N_kv == 0; query head h reads kv head h // (N / N_kv)); static shapes.
        compose: the framework's kernel primitive.
        probs: the framework's primitive for a block's probabilities in one kernel call,
            ``probs(x, pre_terms, post_terms, vis, pre_flags, post_flags)`` -> the block's
            post-composed probabilities (each stage's terms a tuple (wq, kw1, kw2, kdd) as
            ``compose`` takes them, dummies for an absent stage, whose flags are 0; vis
            (B|1, t, s) bool or None), or None: the composes run one call each and the
            mask and softmax are the framework's.
        query_matrix: the framework's primitive for a stage's query factor
            (``_query_factor``), or None: ``dcmha.ops.query_compose_matrix``.
        num_groups: G, composition groups (N % G == 0).
        pre, post: dicts of compose terms in the spec's layout (qw1, qw2 (B, T, G, R, M);
            kw1, kw2 (B, S, G, R, M); qdd (B, T, G, M); kdd (B, S, G, M); static
            (G, M, M)), any subset, or None.
        mask: None or a rank-3 bool broadcasting to (B, T, S) (True = attend).
        causal, sliding_window, query_offset: as in ``dcmha.ops.dcmha_attention``;
            query_offset must be a Python int.
        scale: score scale (default 1 / sqrt(d)).
        block_q: queries per block.

    Returns:
        o: (B, T, N, d_v) float32.
    """
    B, T, N, d = q.shape
    S = k.shape[1]
    G = num_groups
    M = N // G
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qh, kh, vh = _heads(q, k, v, scale)
    d_v = vh.shape[-1]
    # Blocks of block_q queries against whole blocks of block_q keys.
    q_bounds = [(t0, min(T, t0 + block_q)) for t0 in range(0, T, block_q)]
    k_bounds = [(s0, min(S, s0 + block_q)) for s0 in range(0, S, block_q)]
    q_parts = dops.split_blocks(qh, q_bounds, axis=2)
    k_parts, v_parts = dops.split_blocks(kh, k_bounds, axis=3), dops.split_blocks(vh, k_bounds, axis=2)
    stages = []
    for terms in (pre, post):
        st = stage_arrays(terms, B, T, G, M, query_matrix)
        stages.append(None if st is None else (_split_stage(st, q_bounds, k_bounds),
                                               flags_of(st)))
    outs = []
    for i, (t0, t1) in enumerate(q_bounds):
        s0, s1 = dops.key_range(t0, t1, S, use_causal_mask=causal,
                                 sliding_window=sliding_window, query_offset=query_offset)
        if s1 <= s0:
            outs.append(ops.zeros((B, N, t1 - t0, d_v), "float32"))
            continue
        j0, j1 = s0 // block_q, -(-s1 // block_q)
        s0, s1 = k_bounds[j0][0], k_bounds[j1 - 1][1]
        t, s = t1 - t0, s1 - s0
        x = ops.reshape(ops.matmul(q_parts[i], dops.join_blocks(k_parts[j0:j1], axis=3)),
                        (B, G, M, t, s))
        causal_bits = cpu_kernel.causal_flags(
            cpu_kernel.block_causal_off(causal, t0, s0, s, query_offset))
        vis = dops.block_mask(mask, t0, t1, s0, s1, use_causal_mask=causal,
                               sliding_window=sliding_window, query_offset=query_offset)
        if probs is not None and (stages[0] or stages[1]):
            # a causal mask alone is the kernel's causal bits: no mask array to read
            extra = vis is not None and (mask is not None or sliding_window is not None)
            p = probs(x, *(_block_terms(st and st[0], i, j0, j1) for st in stages),
                      ops.broadcast_to(vis, (vis.shape[0], t, s)) if extra else None,
                      *((st[1] | causal_bits) if st else 0 for st in stages))
        else:
            p = _probs_block(compose, x, stages, vis, causal_bits, i, j0, j1)
        o = ops.matmul(ops.reshape(p, (B, N, t, s)), dops.join_blocks(v_parts[j0:j1], axis=2))
        if vis is not None:                      # rows without a visible key -> 0
            o = o * ops.cast(ops.any(vis, axis=-1), "float32")[:, None, :, None]
        outs.append(o)
    o = dops.join_blocks(outs, axis=2)
    return ops.transpose(o, (0, 2, 1, 3))


def _probs_block(compose, x, stages, vis, causal_bits, i, j0, j1):
    """A block's probabilities from its scores x (B, G, M, t, s) by one compose per stage
    and the framework's mask and softmax."""
    s = x.shape[-1]
    if stages[0] is not None:
        x = _compose_block(compose, x, stages[0][0], stages[0][1] | causal_bits, i, j0, j1)
    if vis is not None:
        # Added, not selected: the gradient of an addition passes straight through,
        # where a select costs a pass over the block in the backward (it cannot fuse
        # with the kernel's compose). x + _NEG is _NEG exactly for |x| < 3e22 (half
        # the spacing of float32 near 1e30), so the forward is the select's.
        x = x + ops.where(vis, 0.0, _NEG)[:, None, None]
    # one visible key: softmax is 1 (a masked one belongs to a fully masked row)
    p = ops.ones_like(x) if s == 1 else ops.softmax(x, axis=-1)
    if stages[1] is not None:
        p = _compose_block(compose, p, stages[1][0], stages[1][1] | causal_bits, i, j0, j1)
    return p


def reference(q, k, v, *, num_groups, pre=None, post=None, mask=None, causal=False,
              sliding_window=None, scale=None, query_offset=0):
    """``attention`` without blocks or the kernel, materialising (B, N, T, S)."""
    B, T, N, d = q.shape
    S = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qh, kh, vh = _heads(q, k, v, scale)
    a = dops.compose(ops.matmul(qh, kh), num_groups, **(pre or {}))
    vis = dops.block_mask(mask, 0, T, 0, S, use_causal_mask=causal,
                           sliding_window=sliding_window, query_offset=query_offset)
    if vis is None:
        vis = ops.ones((1, T, S), "bool")
    m = vis[:, None]
    p = ops.where(m, ops.softmax(ops.where(m, a, _NEG), axis=-1), 0.0)
    p = ops.where(m, dops.compose(p, num_groups, **(post or {})), 0.0)
    return ops.transpose(ops.matmul(p, vh), (0, 2, 1, 3))


# ---------------------------------------------------------------------------
# The registry contract of the Keras fast paths built on this core
# ---------------------------------------------------------------------------

#: Most query blocks a call may have (each is unrolled into the traced program; longer
#: sequences take the "ops" core's loops).
MAX_BLOCKS = 64


def block_size(call):
    """Queries per block: ``query_chunk_size``, else ``dcmha.ops.auto_query_chunk_size``."""
    chunk = call.query_chunk_size or dops.auto_query_chunk_size(call.B, call.N, call.S, call.T)
    return call.T if chunk is None else max(1, min(int(chunk), call.T))


def unsupported(call, core):
    """The rules every kernel path shares beyond its declared capabilities: None, or why
    ``call`` cannot run on ``core`` (the path's module with ``load`` /
    ``unavailable_reason``). Evaluated after ``preferred``, since it builds the kernel."""
    if call.B is None:
        return "the batch size must be known"
    blocks = -(-call.T // block_size(call)) if call.T else 0
    if blocks > MAX_BLOCKS:
        return f"more than {MAX_BLOCKS} query blocks ({blocks}); the 'ops' core loops over them"
    if not core.load():
        return f"the compiled CPU kernel is unavailable: {core.unavailable_reason()}"
    return None


def keras_attention(core, call):
    """(o, {}) of ``core.dcmha_attention`` for a validated ``dcmha.call.AttentionCall``."""
    o = core.dcmha_attention(
        call.q, call.k, call.v, num_groups=call.num_groups, pre=call.pre, post=call.post,
        mask=dops.standardize_mask(call.attention_mask), causal=call.use_causal_mask,
        sliding_window=call.sliding_window, query_offset=call.static_offset,
        block_q=block_size(call))
    return o, {}
