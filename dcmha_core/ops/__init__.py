"""The functional DCMHA core on ``keras.ops`` (usable without the layer).

    core          ``dcmha_attention`` (the one attention core) and its dispatch through
                  the registry, ``explain_implementation``; the plain ``keras.ops`` core
                  it falls back on, the "ops" implementation (``attention``): query
                  blocks, looped chunks, the one-query path; its masks (block masks,
                  their standard form, the keys a block can see)
    composition   head composition: ``compose``, its small factors, ``decode_compose``,
                  and the dynamic terms (``dynamic_weights``, ``rms_normalize``)
    tensors       small pieces: rotary embedding, stacking, cache writes (the casts
                  ``as_dtype`` and ``dtype_name`` are the seam's)

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
``implementation`` through the registry (``dcmha.registry``) so that fast paths
can be registered next to the plain ``keras.ops`` one.

Performance notes (the plain path, measured with benchmarks/layer_step.py):
compose runs in the query-major layout (B, T, G, M, S) as two batched matmuls
with small (M x M) matrices that fold every term, the residual included;
queries are processed in blocks whose (B, N, chunk, S) tensors stay in CPU
cache, and blocks skip the keys a causal mask or window hides.

A module-level setting or function is read by the submodule that defines it: to
change ``MAX_UNROLLED_CHUNKS`` or replace ``_attention_one_query``, set it on
``dcmha.ops.core``. ``dcmha_attention`` picks its implementation with
``dcmha.registry.select`` (read from the registry at every call).
"""

from dcmha.framework._common import as_dtype, dtype_name
from dcmha.ops.composition import (LOW_RANK_TERMS, compose, compose_matrices, decode_compose,
                                   dynamic_weights, fused_query_projection, kernel_stages,
                                   plain_dynamic_weights, query_compose_matrix, rms_normalize,
                                   slot_dynamic_weights,
                                   stage_terms)
from dcmha.ops.core import (IMPLEMENTATION, MAX_UNROLLED_CHUNKS, attention,
                            auto_query_chunk_size, block_mask, core_result, dcmha_attention,
                            explain_implementation, join_blocks, key_range, one_query_probs,
                            split_blocks, standardize_mask)
from dcmha.ops.tensors import arange_int32, cache_writer, rope, stack, unstack, write_slice
# The spec's epsilons, under the names the seam and the layer read from here.
from dcmha.spec.reference import QK_NORM_EPS, W1_NORM_EPS

__all__ = ["dcmha_attention", "explain_implementation", "core_result", "IMPLEMENTATION",
           "attention", "compose", "compose_matrices", "query_compose_matrix", "decode_compose",
           "kernel_stages", "stage_terms", "LOW_RANK_TERMS", "block_mask", "standardize_mask",
           "key_range", "dynamic_weights", "fused_query_projection", "plain_dynamic_weights",
           "slot_dynamic_weights",
           "one_query_probs", "auto_query_chunk_size", "split_blocks", "join_blocks",
           "MAX_UNROLLED_CHUNKS", "rms_normalize", "rope", "dtype_name", "as_dtype", "stack",
           "unstack", "write_slice", "cache_writer", "arange_int32", "QK_NORM_EPS",
           "W1_NORM_EPS"]
