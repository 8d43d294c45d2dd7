"""The JAX CPU core as the "jax_cpu" implementation (Keras jax backend).

Registered as ``IMPLEMENTATION`` in ``dcmha.backends.jax_cpu`` (entry point
``jax_cpu``), which declares the device (CPU), the size threshold of ``"auto"``
and what it lacks (attention scores and intermediates, never materialised;
dropout in training; per-head masks; a traced query offset; unknown shapes).
``dcmha.backends.cpu_blocks`` holds the rules it shares with "tf_cpu":
``unsupported(call)`` refuses more than ``cpu_blocks.MAX_BLOCKS`` query blocks
(each is unrolled into the traced program; longer sequences take the "ops"
core's loops) and an unavailable kernel (no C / C++ compiler,
``DCMHA_CPU_KERNEL=0``), checked last since it builds the kernel.

Under a ``keras.distribution`` mesh the call runs once per shard
(``dcmha.partition.partitioned``: ``jax.shard_map``): the batch over the batch axis,
whole composition groups over the model axis, so the kernel's custom call needs no
collective. A layout it cannot serve that way (a group straddling devices) is refused
by ``unsupported`` with the reason (``dcmha.partition.partition_problem``), and
``"auto"`` takes the "ops" core.

``query_chunk_size``, when given, is the block size; otherwise
``dcmha.ops.auto_query_chunk_size`` chooses it (64 queries at B=2, N=8, S=1024).
"""

from __future__ import annotations

from .. import cpu_blocks


def unsupported(call):
    """None if this path can run ``call``, else the reason why not."""
    from dcmha import partition
    from . import dcmha_jax_cpu
    return partition.partition_problem(call) or cpu_blocks.unsupported(call, dcmha_jax_cpu)


def attention(call):
    """(o, {}) for a validated ``dcmha.call.AttentionCall`` (see the module doc)."""
    from dcmha import partition
    from . import dcmha_jax_cpu
    return partition.partitioned(
        call, lambda shard: cpu_blocks.keras_attention(dcmha_jax_cpu, shard))
