"""The "tf_cpu" implementation's module (Keras TensorFlow backend): ``attention(call)``
runs the TensorFlow blocks whose composes are the compiled C kernel's ops
(``dcmha_tf_cpu``) on a validated ``dcmha.call.AttentionCall``.

What the path lacks and where ``"auto"`` may take it are declared in its registration
(``dcmha.backends.tf_cpu.IMPLEMENTATION``); ``unsupported`` adds the checks that need
the call: a trace for XLA (``tf.function(jit_compile=True)``, e.g. ``Model.fit`` with its
default ``jit_compile="auto"``), where the kernel's ops cannot be compiled, and the rules
of ``dcmha.backends.cpu_blocks`` (checked last since it builds the ops).
``dcmha.ops.explain_implementation`` tells, for a call, why each path is taken or passed
over.
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


def attention(call):
    """(o, {}) for a validated ``dcmha.call.AttentionCall`` (see the module doc)."""
    from . import dcmha_tf_cpu
    return cpu_blocks.keras_attention(dcmha_tf_cpu, call)
