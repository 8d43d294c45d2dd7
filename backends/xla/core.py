"""The "xla" implementation's module (Keras TensorFlow backend): ``attention(call)`` runs
``dcmha.backends.xla.dcmha_attention`` (one ``tf.function(jit_compile=True)`` per static
configuration, traced inline inside a caller's XLA computation) on a validated
``dcmha.call.AttentionCall`` and returns (o (B, T, N, d_v) float32, extras) with
extras["attention_scores"] (B, N, T, S) when asked for, {} otherwise.

What the path lacks and where ``"auto"`` may take it are declared in its registration
(``dcmha.backends.xla.IMPLEMENTATION``: calls traced into a graph only, since an eager
call's per-shape XLA compile costs more than one call saves; figures in
benchmarks/RESULTS.md, "Dispatch thresholds"); ``unsupported`` below adds the checks that
need the call's tensors. ``dcmha.ops.explain_implementation`` tells, for a
call, why each path is taken or passed over.

Conventions checked against the "ops" core and ``spec/SPEC.md``: the core scales the
scores itself (1 / sqrt(d)), so q is passed unscaled; causal is s <= t and the window
|t - s| < W (with causal: the W keys ending at t), as in the spec at query_offset 0; the
mask is a boolean (B|1, T|1, S|1) tensor (``dcmha.ops.standardize_mask``) that the core
broadcasts; fully masked rows give zeros. ``query_chunk_size`` is passed on (None: the
core's own default, ``default_query_chunk_size``).
"""

from __future__ import annotations


def unsupported(call):
    """Why the XLA core cannot run ``call`` (a str), or None when it can."""
    static = (call.N, call.N_kv, call.d, call.d_v)
    if None in static:
        return ("needs static head counts and head sizes (the last two axes of q, k and v). "
                f"Received: q.shape={tuple(call.q.shape)}, k.shape={tuple(call.k.shape)}, "
                f"v.shape={tuple(call.v.shape)}")
    return None


def attention(call):
    """(o, extras) of the XLA-compiled core for a validated ``AttentionCall``.

    Returns (o (B, T, N, d_v) float32, extras), extras {"attention_scores":
    (B, N, T, S) float32} with ``return_attention_scores``, else {}. With
    ``query_chunk_size`` None the core picks its own chunk size.
    """
    from keras import ops

    from dcmha import ops as dops
    from dcmha.backends import xla

    q, k, v = (ops.cast(x, "float32") for x in (call.q, call.k, call.v))
    result = xla.dcmha_attention(
        q, k, v, num_groups=call.num_groups, pre=call.pre, post=call.post,
        mask=dops.standardize_mask(call.attention_mask), causal=call.use_causal_mask,
        sliding_window=call.sliding_window, query_chunk_size=call.query_chunk_size,
        return_attention_scores=call.return_attention_scores)
    return dops.core_result(result, call.return_attention_scores)
