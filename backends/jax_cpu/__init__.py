"""Blocked DCMHA attention for JAX on CPU, its composes run by the compiled C kernel.

Importing this package does not import JAX: the module ``dcmha_jax_cpu`` loads
on first use of one of its names. See ``dcmha_jax_cpu`` for the API and
``core`` for the Keras fast path (``DCMHA(implementation="jax_cpu")``).
"""

from dcmha.backends import cpu_kernel_package, decode_implementation

__all__ = ["IMPLEMENTATION", "DECODE_IMPLEMENTATION", "dcmha_attention",
           "dcmha_attention_reference", "is_available"]

#: T * S from which "auto" takes this path: one layer's training step under XLA is faster
#: than the plain core's from T = S = 16 (RESULTS.md, "Dispatch thresholds").
MIN_LENGTH_PRODUCT = 16 * 16

IMPLEMENTATION, is_available, __getattr__ = cpu_kernel_package(
    __name__, "jax_cpu", "jax", "dcmha_jax_cpu", priority=10,
    min_length_product=MIN_LENGTH_PRODUCT,
    description="XLA blocks whose composes run in the compiled C kernel (jax.ffi)")

#: One decoding step (T = 1): the plain core's one-query path with both composes run by the
#: compiled kernel (``decode``): "auto" takes it for one-query calls on CPU; other calls go
#: to "ops".
DECODE_IMPLEMENTATION = decode_implementation(
    "jax_decode", "jax", "dcmha.backends.jax_cpu.decode", devices={"cpu"}, priority=15,
    description="one decoding step (T = 1): the plain one-query path with its composes in "
                "the compiled C kernel (jax.ffi); other calls run the plain core")
