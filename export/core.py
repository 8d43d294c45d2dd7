"""Framework-free ONNX writer for DCMHA (NumPy + onnx only).

One DCMHA call becomes one node ``dcmha.DCMHA*`` whose op is an ONNX *local
function* in the ``dcmha`` domain: a runtime that knows DCMHA can match the
node and fuse it, any other runtime inlines its plain-op body. The body follows
``spec/reference.py`` step by step:

    q, k, v projections (+bias) -> QK-norm -> RoPE -> dynamic weights ->
    scores -> pre-compose -> masked softmax -> post-compose -> masked entries
    set to 0 (all in float32, whatever the dtype, as in the Keras layer) ->
    P.V -> output projection.

Written for onnxruntime's CPU provider (benchmarks/RESULTS.md, "ONNX export in
onnxruntime"): one MatMul for every projection of a self-attention input; each compose
one ``dcmha.Compose*`` node (a local function with a plain-op body, which onnxruntime runs
as the compiled compose kernel when ``dcmha.export.ort_ops`` is registered;
``compose_nodes=False`` writes the composes as plain ops: one batched MatMul per side with
its factors made once per call); masks as an added bias and a 0/1 multiplier. A causal or
windowed call without (B, N, T, S) outputs runs its queries in chunks (an ONNX Loop,
SPEC.md "Query chunking"), each on the keys it can see; a decode step reads only the cache
positions written so far. With kernel nodes
(``compose_nodes=True``) the other hot spots are local functions of the same kind too
(``KERNEL_OPS``): a block's compose, biased softmax and compose (``Probs*``), a stage's
per-query matrix (``QueryMatrix*``), RoPE (``Rope*``, ``RopeHeads*``) and a decode step's
cache reads (``CacheHeads*``).

Function signatures (the function's canonical weights come last, in the order
of ``reference.param_shapes``):

    forward, self-attention   (query, [attention_mask], *weights)
    forward, general          (query, value, key, [attention_mask], *weights)
    decode                    (query, cache_update_index, past_key, past_value,
                               past_key_w, past_key_dd, [attention_mask], *weights)
    outputs                   (output, [present_*...], [attention_scores])

``ModelBuilder`` assembles graphs from such calls (plus plain ops added by a
front-end); ``export_layer`` writes the graph of a single call, and
``save_model`` writes atomically after ``onnx.checker`` (full_check) passes and
onnxruntime has loaded the file with every graph optimisation on.

This module gathers the writer's public names from the modules that hold them, one
concept each:

    op_names           the ``dcmha`` domain's function and kernel op names
    call_spec          CallSpec, the checks of a call, its function's inputs and outputs
    emitter            the node emitter, rename_value
    kernel_functions   the kernel ops' local functions (Compose*, Probs*, Rope*, ...)
    body_state, body_projections, body_compose, body_attention
                       the parts of the DCMHA function's body
    dcmha_function     the body (``_Body``) and make_function
    builder            ModelBuilder, export_layer
    runtime            check_model, session, save_model, atomic_output
"""

from __future__ import annotations

from dcmha.export.body_attention import CHUNK, KERNEL_CHUNK, MASKED_SCORE
from dcmha.export.body_compose import EXPORTED_TERMS
from dcmha.export.builder import ModelBuilder, export_layer, layer_dims
from dcmha.export.call_spec import (DEFAULT_OPSET, DTYPES, MIN_OPSET, NP_DTYPES, CallSpec, Dim,
                                    check_call, check_dtype, check_opset, check_params,
                                    decode_names, function_inputs, function_outputs,
                                    intermediate_names)
from dcmha.export.dcmha_function import _Body, make_function
from dcmha.export.emitter import Emitter, rename_value
from dcmha.export.kernel_functions import (_compose_inputs, _rope_ops, cache_heads_function,
                                           compose_function, kernel_function, kernel_ops_used,
                                           merged_matrix, probs_function, query_matrix_function,
                                           rope_function, rope_heads_function)
from dcmha.export.op_names import (CACHE_HEADS_OPS, CACHE_OPS, CACHE_WIDEN_OP, COMPOSE_OPS,
                                   DOMAIN, FUNCTION_NAME, KERNEL_OPS, PROBS_OPS, QUERY_OPS,
                                   ROPE_HEADS_OPS, ROPE_OPS, STAGE_LETTERS)
from dcmha.export.runtime import (_new_file, atomic_output, check_model, output_target,
                                  save_model, session)

__all__ = [
    "CACHE_HEADS_OPS", "CACHE_OPS", "CACHE_WIDEN_OP", "CHUNK", "COMPOSE_OPS", "CallSpec",
    "DEFAULT_OPSET", "DOMAIN", "DTYPES", "Dim", "EXPORTED_TERMS", "Emitter", "FUNCTION_NAME",
    "KERNEL_CHUNK", "KERNEL_OPS", "MASKED_SCORE", "MIN_OPSET", "ModelBuilder", "NP_DTYPES",
    "PROBS_OPS", "QUERY_OPS", "ROPE_HEADS_OPS", "ROPE_OPS", "STAGE_LETTERS", "atomic_output",
    "cache_heads_function", "check_call", "check_dtype", "check_model", "check_opset",
    "check_params", "compose_function", "decode_names", "export_layer", "function_inputs",
    "function_outputs", "intermediate_names", "kernel_function", "kernel_ops_used",
    "layer_dims", "make_function", "merged_matrix", "output_target", "probs_function",
    "query_matrix_function", "rename_value", "rope_function", "rope_heads_function",
    "save_model", "session",
]
