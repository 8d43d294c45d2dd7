"""DCMHA attention for TensorFlow on CPU, its composes run by the compiled C kernel.

Importing this package does not import TensorFlow: the module ``dcmha_tf_cpu`` loads
on first use of one of its names. See ``dcmha_tf_cpu`` for the API and ``core``
for the Keras fast path (``DCMHA(implementation="tf_cpu")``).

Importing it also hands the framework seam (``dcmha.framework``) the kernel's op for a
decoding step's dynamic weights (``dcmha_tf_cpu.dynamic_weights``), imported on its
first use. The registry imports this package (its entry point) before the seam's first lookup.
"""

from dcmha import framework
from dcmha.backends import cpu_kernel_package

__all__ = ["IMPLEMENTATION", "dcmha_attention", "dcmha_attention_reference", "is_available"]

#: T * S from which "auto" takes this path: one layer's training step is faster than the
#: plain core's from T = S = 64; below it they are even (RESULTS.md, "Dispatch thresholds").
MIN_LENGTH_PRODUCT = 64 * 64

IMPLEMENTATION, is_available, __getattr__ = cpu_kernel_package(
    __name__, "tf_cpu", "tensorflow", "dcmha_tf_cpu", priority=20,
    min_length_product=MIN_LENGTH_PRODUCT,
    description="TensorFlow blocks whose composes run in the compiled C kernel (custom ops)")


def _step_dynamic_weights():
    from .dcmha_tf_cpu import dynamic_weights
    return dynamic_weights


framework.provide("tensorflow", "step_dynamic_weights", _step_dynamic_weights)
