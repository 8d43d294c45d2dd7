"""``dcmha_attention``, the one attention core of the package, and its dispatch through
the registry (``dcmha.registry``): the plain core or a registered fast path.
"""

from __future__ import annotations

import dataclasses

from dcmha import call as dcall
from dcmha import registry
from dcmha.ops.tensors import as_dtype
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
            (``dcmha.registry``; see ``dcmha.registry.select``).

    Returns:
        o (B, T, N, d_v) float32, or (o, extras) when scores or intermediates are
        asked for (a dict with "attention_scores" and/or the intermediates).
    """
    registry.resolve(implementation)
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
    _, core = registry.select(implementation, call)
    o, extras = core(call)
    if return_attention_scores or return_intermediates:
        return o, extras
    return o
