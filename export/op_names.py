"""The names of the ``dcmha`` ONNX domain: the DCMHA function and the kernel ops.

Each kernel op is a model-local function with a plain-op body (``kernel_functions``) that
onnxruntime runs as compiled code where ``dcmha.export.ort_ops`` is registered; the
custom-op library must define exactly ``KERNEL_OPS``. This module imports nothing of the
exporter, so the writer and ``ort_ops`` both read the names from here.
"""

#: The ONNX domain of every dcmha function and op.
DOMAIN = "dcmha"
#: The DCMHA call's function (``ModelBuilder.function_for`` numbers the other configurations'
#: functions ``DCMHA_2``, ``DCMHA_3``, ...).
FUNCTION_NAME = "DCMHA"
#: The compose ops (``compose_function``), by the terms they take: Q (per-query matrix),
#: K (key-side rank-R pair), D (key-side gating).
COMPOSE_OPS = ("ComposeQ", "ComposeK", "ComposeD", "ComposeQK", "ComposeQD", "ComposeKD",
               "ComposeQKD")
#: A decode step's key / value cache range, heads first (``cache_heads_function``), by dtype;
#: and a float16 cache's range as float32.
CACHE_OPS = {"float32": "CacheHeads", "float16": "CacheHeads16"}
CACHE_WIDEN_OP = "CacheHeads16F"
CACHE_HEADS_OPS = tuple(CACHE_OPS.values()) + (CACHE_WIDEN_OP,)
#: The per-query matrix of a Compose node's Q input from the spec's query-side terms
#: (``query_matrix_function``), by the terms it takes: W (qw1, qw2), D (qdd), S (static).
QUERY_OPS = ("QueryMatrixW", "QueryMatrixD", "QueryMatrixWD", "QueryMatrixWS", "QueryMatrixDS",
             "QueryMatrixWDS")
#: The rotate-half RoPE of the query and key heads (``rope_function``), by dtype; and the
#: same read from a projection's output, heads first (``rope_heads_function``).
ROPE_OPS = {"float32": "Rope", "float16": "Rope16"}
ROPE_HEADS_OPS = {"float32": "RopeHeads", "float16": "RopeHeads16"}
#: A causal block's probabilities from its scores, Compose_post(softmax(Compose_pre(x) +
#: bias)), as one op (``probs_function``): ``Probs<pre>_<post>``, each stage the letters of
#: its Compose op or none (not both none).
STAGE_LETTERS = ("",) + tuple(n[len("Compose"):] for n in COMPOSE_OPS)
PROBS_OPS = tuple(f"Probs{a}_{b}" for a in STAGE_LETTERS for b in STAGE_LETTERS if a or b)
#: Every op of the ``dcmha`` domain that ``dcmha.export.ort_ops`` runs as compiled code.
KERNEL_OPS = (COMPOSE_OPS + CACHE_HEADS_OPS + QUERY_OPS
              + tuple(ROPE_OPS.values()) + tuple(ROPE_HEADS_OPS.values()) + PROBS_OPS)
