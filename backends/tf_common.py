"""What the TensorFlow paths (``tf_cpu`` and ``xla``) share.

``in_xla_context``: whether the code runs inside a trace for XLA
(``tf.function(jit_compile=True)``), where ``tf_cpu``'s kernel ops cannot be
compiled and ``xla`` traces its core inline: the seam's rule
(``dcmha.framework.tensorflow.in_xla_context``). Importing this module does not import
TensorFlow; the first call does.
"""

from __future__ import annotations

__all__ = ["in_xla_context"]


def in_xla_context() -> bool:
    """Whether we are being traced inside a tf.function(jit_compile=True)."""
    from dcmha.framework.tensorflow import in_xla_context as rule
    return rule()
