"""Fused DCMHA attention in plain PyTorch (forward and hand-written backward), for CPU.

Importing this package does not import PyTorch: the module ``dcmha_torch``
loads on first use of one of its names. See ``dcmha_torch`` for the API (the
same shape of API as the Triton, Pallas and XLA backends) and ``core``
for the Keras fast path (``DCMHA(implementation="torch")``).

Importing it also hands the framework seam (``dcmha.framework``) eager PyTorch's kernels
for a decoding step (``dynamic_weights``: the step's dynamic weights and the fused query
projection) and the ONNX exporter's ``rms_norm`` (``onnx_symbolic``), each imported on
its first use. The registry imports this package (its entry point) before the seam's
first lookup.
"""

import importlib.util

from dcmha import framework
from dcmha.backends import decode_implementation, lazy_attributes
from dcmha.registry import Implementation

__all__ = ["IMPLEMENTATION", "DECODE_IMPLEMENTATION", "dcmha_attention", "dcmha_attention_reference", "default_block_q", "is_available"]


def is_available() -> bool:
    """True when PyTorch is installed (the path runs on any PyTorch device)."""
    return importlib.util.find_spec("torch") is not None


__getattr__ = lazy_attributes(__name__, "dcmha_torch",
                              ("dcmha_attention", "dcmha_attention_reference", "default_block_q"))

#: T * S from which "auto" takes this path on a CPU: one layer's training step is faster
#: than the plain core's from T = S = 16 (0.86-0.90x; at T = S = 8 they are even); RESULTS.md,
#: "Dispatch thresholds".
MIN_LENGTH_PRODUCT = 16 * 16

IMPLEMENTATION = Implementation(
    name="torch", backend="torch", module="dcmha.backends.torch_native.core",
    devices=frozenset({"cpu", "gpu"}), auto_devices=frozenset({"cpu"}),
    lacks=frozenset({"intermediates", "dropout", "head_masks", "symbolic_shapes"}),
    priority=10, min_length_product=MIN_LENGTH_PRODUCT,
    description="blocked PyTorch autograd function with a recomputing backward; composes "
                "in the compiled C kernel on CPU")

#: One decoding step (T = 1) in plain PyTorch ops, without Keras's per-op conversions
#: (``decode``): "auto" takes it for one-query calls on CPU; other calls go to "ops".
DECODE_IMPLEMENTATION = decode_implementation(
    "torch_decode", "torch", "dcmha.backends.torch_native.decode", devices={"cpu", "gpu"},
    priority=15,
    description="one decoding step (T = 1) in plain PyTorch ops; other calls run the plain core")


def _step_dynamic_weights():
    from .dynamic_weights import dynamic_weights
    return dynamic_weights


def _fused_query_projection():
    from .dynamic_weights import fused_query_projection
    return fused_query_projection


def _prepare_onnx_export():
    from .onnx_symbolic import register_rms_norm
    return register_rms_norm


framework.provide("torch", "step_dynamic_weights", _step_dynamic_weights)
framework.provide("torch", "fused_query_projection", _fused_query_projection)
framework.provide("torch", "prepare_onnx_export", _prepare_onnx_export)
