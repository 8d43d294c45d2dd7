"""The TensorFlow CPU core as the "tf_cpu" implementation (Keras tensorflow backend).

Registered as ``IMPLEMENTATION`` in ``dcmha.backends.tf_cpu`` (entry point
``tf_cpu``), tried before "xla" by ``implementation="auto"``; the registration
declares the device (CPU), the size threshold of ``"auto"`` and what it lacks
(as "jax_cpu"). ``unsupported(call)`` adds: the call is traced inside an XLA
cluster (``tf.function(jit_compile=True)``, e.g. ``Model.fit`` with its default
``jit_compile="auto"``), where the kernel's ops cannot be compiled (the "xla"
path runs there); and the rules of ``dcmha.backends.cpu_blocks`` (block count,
kernel availability, checked last since it builds the ops).
"""

from __future__ import annotations

from .. import cpu_blocks


def unsupported(call):
    """None if this path can run ``call``, else the reason why not."""
    from ..tf_common import in_xla_context
    from . import dcmha_tf_cpu
    if in_xla_context():
        return ("the call is traced for XLA (jit_compile=True), which cannot compile the "
                "kernel's ops; the 'xla' path runs there")
    return cpu_blocks.unsupported(call, dcmha_tf_cpu)


def dynamic_weights(x, dw1, qkw, dd, **kwargs):
    """A decoding step's dynamic weights by the kernel op (``dcmha_tf_cpu.dynamic_weights``;
    ``dcmha.ops`` finds it here through the registry), or None."""
    from . import dcmha_tf_cpu
    return dcmha_tf_cpu.dynamic_weights(x, dw1, qkw, dd, **kwargs)


def attention(call):
    """(o, {}) for a validated ``dcmha.call.AttentionCall`` (see the module doc)."""
    from . import dcmha_tf_cpu
    return cpu_blocks.keras_attention(dcmha_tf_cpu, call)
