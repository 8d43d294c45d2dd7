"""One decoding step for TensorFlow, XLA-compiled: the "tf_decode" implementation.

A cached decoding step is one query against S cached keys (T = 1): a few small
products per head group. In a TensorFlow graph each op costs about 10 us to
dispatch whatever its size (an ``Einsum`` node about 25 us), and the two
composes of a step are some 25 ops, so on a CPU they cost more than the scores
and P.V together. This implementation runs the plain core's one-query path
(``dcmha.ops``: scores, both composes with the key-side terms in low-rank form,
the masked softmax, P.V) as one ``tf.function(jit_compile=True)``: XLA fuses it
into a few kernels. The composes take ``decode_compose``'s broadcast-product
form, which XLA fuses on the cache's own (B, S, G, ...) layout; the key-side terms that
the layer unstacked from the cache's stacked entries reach it as those entries, sliced
inside XLA (``_stacked_entries``: the graph then runs no op to unstack them). The arithmetic
and the masking rules are the plain core's (it is that code, compiled): masked
probabilities are exactly 0, and a query that sees no key outputs 0.

Only the core is compiled. The projections around it (the q, k, v and output
matmuls, the dynamic weights) stay in the caller's graph: XLA's CPU
matrix-vector products are slower than TensorFlow's (a whole step compiled with
``jit_compile=True`` ran 5x slower at D=1024: benchmarks/RESULTS.md).

``"auto"`` takes it for one-query calls made while TensorFlow traces a graph (a
``tf.function``, e.g. ``DCFormerLM.generate``'s step or Keras ``predict``; its
registration declares ``one_query_only`` and ``graph_only``).
Eager calls keep the plain core: each new shape or configuration compiles an
XLA program, which costs more than one eager call saves. Any other call that
names it (more than one query, dropout in training, returned scores or
intermediates) runs the plain core, ``dcmha.ops.attention``.
"""

from __future__ import annotations

_STEP = []       # the compiled step, made on first use (importing TensorFlow then)


def _products_compose(x, terms, M):
    """``dcmha.ops.decode_compose`` in its broadcast-product form: under XLA each
    compose then fuses into a few loop kernels on the cache's own layout, where the
    einsum form's small dots and layout copies were some 15 more thunks per step
    (lm256: 1.24x -> 1.19x of composition off, benchmarks/RESULTS.md)."""
    from keras import ops

    from dcmha import ops as dops
    return dops.decode_compose(x, terms, M, reduce_sum=ops.sum, transpose=ops.transpose)


def _one_query_probs(x, mask, pre, post, M):
    from dcmha import ops as dops
    return dops.one_query_probs(x, mask, pre, post, M, compose=_products_compose)


#: The key-side terms that a decoding cache stacks (``spec.terms.KEY_CACHE``), each group
#: in its entry's order: kw1 and kw2 of the pre stage then the post stage; kdd likewise.
_STACKED = (("kw1", "kw2"), ("kdd",))


def _unstacked_source(tensors):
    """The tensor that one ``Unpack`` op of the graph split into exactly ``tensors``, in
    order (a decoding cache's stacked entry, ``spec.terms.unpack_key_weights``), or None."""
    op = getattr(tensors[0], "op", None)
    if op is None or op.type != "Unpack" or len(op.outputs) != len(tensors):
        return None
    if any(t is not o for t, o in zip(tensors, op.outputs)) or op.get_attr("axis") != 2:
        return None
    return op.inputs[0]


def _stacked_entries(pre, post):
    """(pre, post, entries): each group of ``_STACKED`` whose terms the graph unstacked
    from one cache entry goes to the compiled step as (that entry, the stages that had the
    group) (its slices are taken inside XLA, where they fuse into the composes), and its
    terms leave the stages; a group left in the stages is None. Otherwise the ``Unpack``
    op stays in the caller's graph, one op per entry and step."""
    stages, entries = (dict(pre), dict(post)), []
    for names in _STACKED:
        terms = [st[n] for st in stages for n in names if n in st]
        source = _unstacked_source(terms) if terms else None
        if source is None:
            entries.append(None)
            continue
        entries.append((source, tuple(i for i, st in enumerate(stages) if names[0] in st)))
        for st in stages:
            for n in names:
                st.pop(n, None)
    return stages[0], stages[1], tuple(entries)


def _restored(pre, post, entries):
    """The stages with the terms of each stacked entry back (``_stacked_entries`` undone
    inside the compiled step)."""
    import tensorflow as tf
    stages = (dict(pre), dict(post))
    for names, entry in zip(_STACKED, entries):
        if entry is None:
            continue
        source, which = entry
        parts = iter(tf.unstack(source, axis=2))
        for i in which:
            for n in names:
                stages[i][n] = next(parts)
    return stages


def _compiled_step():
    if not _STEP:
        import tensorflow as tf

        from dcmha.call import describe
        from dcmha import ops as dops

        def step(q, k, v, pre, post, mask, offset, num_groups, causal, window, entries):
            pre, post = _restored(pre, post, entries)
            call = describe(
                q, k, v, num_groups=num_groups, pre=pre or None, post=post or None,
                attention_mask=mask, use_causal_mask=causal, sliding_window=window,
                query_offset=offset, auto_chunk=False)
            return dops.attention(call, decode_probs=_one_query_probs)[0]

        _STEP.append(tf.function(step, jit_compile=True, autograph=False))
    return _STEP[0]


def attention(call):
    """(o (B, 1, N, d_v) float32, {}) for a one-query call; any other call through the
    plain core (``dcmha.ops.attention``)."""
    from dcmha import ops as dops
    if not call.one_query:
        return dops.attention(call)
    return _one_query(call), {}


def _one_query(call):
    """o (B, 1, N, d_v) float32 of a one-query call, through the compiled step."""
    import tensorflow as tf
    # The offset as a tensor: a new Python int must not compile a new program.
    offset = tf.cast(call.query_offset, tf.int32)
    pre, post, entries = _stacked_entries(call.pre or {}, call.post or {})
    return _compiled_step()(call.q, call.k, call.v, pre, post, call.attention_mask, offset,
                            call.num_groups, bool(call.use_causal_mask), call.sliding_window,
                            entries)
