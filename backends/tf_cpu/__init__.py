"""DCMHA attention for TensorFlow on CPU, its composes run by the compiled C kernel.

Importing this package does not import TensorFlow: the module ``dcmha_tf_cpu`` loads
on first use of one of its names. See ``dcmha_tf_cpu`` for the API and ``keras_core``
for the Keras fast path (``DCMHA(implementation="tf_cpu")``).
"""

from dcmha.backends import (CPU_KERNEL_LACKS, CPU_MIN_LENGTH_PRODUCT, installed,
                            lazy_attributes)
from dcmha.registry import Implementation

__all__ = ["IMPLEMENTATION", "dcmha_attention", "dcmha_attention_reference", "is_available"]


def is_available() -> bool:
    """True when TensorFlow is installed (whether the kernel builds: ``dcmha_tf_cpu.load()``)."""
    return installed("tensorflow")


__getattr__ = lazy_attributes(__name__, "dcmha_tf_cpu",
                              ("dcmha_attention", "dcmha_attention_reference"))

IMPLEMENTATION = Implementation(
    name="tf_cpu", backend="tensorflow", module="dcmha.backends.tf_cpu.keras_core",
    devices=frozenset({"cpu"}), auto_devices=frozenset({"cpu"}), lacks=CPU_KERNEL_LACKS,
    priority=20, min_length_product=CPU_MIN_LENGTH_PRODUCT,
    description="TensorFlow blocks whose composes run in the compiled C kernel (custom ops)")
