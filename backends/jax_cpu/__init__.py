"""Blocked DCMHA attention for JAX on CPU, its composes run by the compiled C kernel.

Importing this package does not import JAX: the module ``dcmha_jax_cpu`` loads
on first use of one of its names. See ``dcmha_jax_cpu`` for the API and
``keras_core`` for the Keras fast path (``DCMHA(implementation="jax_cpu")``).
"""

from dcmha.backends import (CPU_KERNEL_LACKS, CPU_MIN_LENGTH_PRODUCT, installed,
                            lazy_attributes)
from dcmha.registry import Implementation

__all__ = ["IMPLEMENTATION", "dcmha_attention", "dcmha_attention_reference", "is_available"]


def is_available() -> bool:
    """True when JAX is installed (whether the kernel builds: ``dcmha_jax_cpu.load()``)."""
    return installed("jax")


__getattr__ = lazy_attributes(__name__, "dcmha_jax_cpu",
                              ("dcmha_attention", "dcmha_attention_reference"))

IMPLEMENTATION = Implementation(
    name="jax_cpu", backend="jax", module="dcmha.backends.jax_cpu.keras_core",
    devices=frozenset({"cpu"}), auto_devices=frozenset({"cpu"}), lacks=CPU_KERNEL_LACKS,
    priority=10, min_length_product=CPU_MIN_LENGTH_PRODUCT,
    description="XLA blocks whose composes run in the compiled C kernel (jax.ffi)")
