"""One decoding step for JAX on CPU: the "jax_decode" implementation.

A cached decoding step is one query against S cached keys (T = 1). Compiled by XLA,
the plain core's one-query path (``dcmha.ops``) spends most of its DCMHA-only time on
op count, not arithmetic: XLA's CPU runtime dispatches each fusion, dot or copy of a
program for about 2-3 us, and the two composes were a few dozen of them, plus copies
of the cached key-side weights into the layout its einsums read. This implementation
runs that same path with the pre compose, the mask, the softmax and the post compose
(``dcmha.ops.one_query_probs``) as one XLA FFI custom call of the compiled C kernel
(``dcmha_jax_cpu.decode_probs``), which reads the key-side weights in place from the
cache's stacked entries (``spec.terms.KEY_CACHE``: no slice of them is copied out); the
scores and P.V stay XLA dots. Same arithmetic, same
masking rules: masked probabilities are exactly 0, and a query that sees no key
outputs 0. Its gradient is the plain form's.

``"auto"`` takes it for one-query calls on CPU when the kernel builds (C and C++
compilers; ``DCMHA_CPU_KERNEL=0`` switches it off). A call without composition, or
with compose terms the kernel does not compute, runs the plain form. Any other call
that names it goes to the plain core, ``dcmha.ops.attention``, so a forced
``implementation="jax_decode"`` runs every call.
"""

from __future__ import annotations


def unsupported(call):
    """None, or why this path cannot run ``call`` (the kernel does not build)."""
    from . import dcmha_jax_cpu
    if not dcmha_jax_cpu.load():
        return f"the compiled CPU kernel is unavailable: {dcmha_jax_cpu.unavailable_reason()}"
    return None


def attention(call):
    """(o (B, 1, N, d_v) float32, {}) for a one-query call; any other call through the
    plain core (``dcmha.ops.attention``)."""
    from dcmha import ops as dops
    if not call.one_query:
        return dops.attention(call)
    from . import dcmha_jax_cpu
    return dops.attention(call, decode_probs=dcmha_jax_cpu.decode_probs)
