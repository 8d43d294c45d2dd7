"""Blocked DCMHA attention for JAX on CPU, its composes run by the compiled C kernel.

Importing this package does not import JAX: the module ``dcmha_jax_cpu`` loads
on first use of one of its names. See ``dcmha_jax_cpu`` for the API and
``keras_core`` for the Keras fast path (``DCMHA(implementation="jax_cpu")``).
"""

from dcmha.backends import cpu_kernel_package

__all__ = ["IMPLEMENTATION", "dcmha_attention", "dcmha_attention_reference", "is_available"]

IMPLEMENTATION, is_available, __getattr__ = cpu_kernel_package(
    __name__, "jax_cpu", "jax", "dcmha_jax_cpu", priority=10,
    description="XLA blocks whose composes run in the compiled C kernel (jax.ffi)")
