"""Fused DCMHA attention in plain PyTorch (forward and hand-written backward), for CPU.

Importing this package does not import PyTorch: the module ``dcmha_torch``
loads on first use of one of its names. See ``dcmha_torch`` for the API (the
same shape of API as the Triton, Pallas and XLA backends) and ``keras_core``
for the Keras fast path (``DCMHA(implementation="torch")``).
"""

import importlib.util

from dcmha.backends import CPU_MIN_LENGTH_PRODUCT, lazy_attributes
from dcmha.registry import Implementation

__all__ = ["IMPLEMENTATION", "DECODE_IMPLEMENTATION", "dcmha_attention", "dcmha_attention_reference", "default_block_q", "is_available"]


def is_available() -> bool:
    """True when PyTorch is installed (the path runs on any PyTorch device)."""
    return importlib.util.find_spec("torch") is not None


__getattr__ = lazy_attributes(__name__, "dcmha_torch",
                              ("dcmha_attention", "dcmha_attention_reference", "default_block_q"))

IMPLEMENTATION = Implementation(
    name="torch", backend="torch", module="dcmha.backends.torch_native.keras_core",
    devices=frozenset({"cpu", "gpu"}), auto_devices=frozenset({"cpu"}),
    lacks=frozenset({"intermediates", "dropout", "head_masks", "symbolic_shapes"}),
    priority=10, min_length_product=CPU_MIN_LENGTH_PRODUCT,
    description="blocked PyTorch autograd function with a recomputing backward; composes "
                "in the compiled C kernel on CPU")

#: One decoding step (T = 1) in plain PyTorch ops, without Keras's per-op conversions
#: (``decode``): "auto" takes it for one-query calls on CPU; other calls go to "ops".
DECODE_IMPLEMENTATION = Implementation(
    name="torch_decode", backend="torch", module="dcmha.backends.torch_native.decode",
    devices=frozenset({"cpu", "gpu"}), auto_devices=frozenset({"cpu"}),
    lacks=frozenset({"intermediates", "dropout", "symbolic_shapes"}), one_query_only=True,
    priority=15,
    description="one decoding step (T = 1) in plain PyTorch ops; other calls run the "
                "plain core")

