"""DCMHA attention for TensorFlow as one XLA-compiled function (query-chunked).

``import dcmha.backends.xla`` does not import TensorFlow; the first call of
``dcmha_attention`` or ``dcmha_attention_reference`` does. See ``dcmha_xla`` for
the API (the same shape of API as the Triton and Pallas kernels).
"""

from dcmha.backends import decode_implementation
from dcmha.registry import Implementation

from .dcmha_xla import (dcmha_attention, dcmha_attention_reference,
                        default_query_chunk_size, is_available)

__all__ = ["IMPLEMENTATION", "DECODE_IMPLEMENTATION", "dcmha_attention", "dcmha_attention_reference", "default_query_chunk_size",
           "is_available"]

IMPLEMENTATION = Implementation(
    name="xla", backend="tensorflow", module="dcmha.backends.xla.core",
    devices=frozenset({"cpu", "gpu"}), auto_devices=frozenset({"cpu", "gpu"}),
    lacks=frozenset({"intermediates", "dropout", "head_masks", "traced_offset",
                     "query_offset"}),
    priority=10, graph_only=True,
    description="one query-chunked jit_compile=True TensorFlow function")

#: One decoding step (T = 1) as one XLA-compiled function of the plain core's
#: one-query path (``decode``): "auto" takes it for one-query calls traced into a
#: TensorFlow graph on CPU; other calls go to "ops".
DECODE_IMPLEMENTATION = decode_implementation(
    "tf_decode", "tensorflow", "dcmha.backends.xla.decode", devices={"cpu", "gpu"},
    priority=25, graph_only=True,
    description="one decoding step (T = 1): the plain core's one-query path, XLA-compiled; "
                "other calls run the plain core")
