"""The JAX CPU core as a fast path of ``dcmha.ops.dcmha_attention``.

Registered in ``dcmha.ops.FAST_PATHS`` as "jax_cpu" (Keras jax backend); the
module implements the registry's contract (``dcmha.backends.cpu_blocks`` holds
the rules it shares with "tf_cpu"):

* ``unsupported(call)``: None, or why this path cannot run ``call``: JAX
  computes on an accelerator; ``return_attention_scores`` or
  ``return_intermediates`` (never materialised); dropout in training; a
  ``query_offset`` that is not a Python int; unknown shapes; the compiled
  kernel is unavailable (no C / C++ compiler, ``DCMHA_CPU_KERNEL=0``); more than
  ``cpu_blocks.MAX_BLOCKS`` query blocks (each is unrolled into the traced
  program; longer sequences take the "ops" core's loops).
* ``preferred(call)``: T * S >= ``cpu_blocks.MIN_PREFERRED_TS`` (8192).
* ``attention(**call)``: the contract of ``dcmha.ops._attention_ops``.

``query_chunk_size``, when given, is the block size; otherwise
``dcmha.ops.auto_query_chunk_size`` chooses it (64 queries at B=2, N=8, S=1024).
"""

from __future__ import annotations

from .. import cpu_blocks

preferred = cpu_blocks.preferred


def unsupported(call):
    """None if this path can run ``call``, else the reason why not."""
    import jax

    from . import dcmha_jax_cpu
    if jax.default_backend() != "cpu":
        return "JAX computes on an accelerator (this path is for CPU; see 'pallas')"
    return cpu_blocks.unsupported(call, dcmha_jax_cpu)


def attention(q, k, v, **call):
    """The contract of ``dcmha.ops._attention_ops`` (see the module doc)."""
    from . import dcmha_jax_cpu
    return cpu_blocks.keras_attention(dcmha_jax_cpu, q, k, v, **call)
