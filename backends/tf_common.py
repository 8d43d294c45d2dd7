"""What the TensorFlow paths (``tf_cpu`` and ``xla``) share.

``in_xla_context``: whether the code runs inside a trace for XLA
(``tf.function(jit_compile=True)``), where ``tf_cpu``'s kernel ops cannot be
compiled and ``xla`` traces its core inline. Importing this module does not import
TensorFlow; the first call does.
"""

from __future__ import annotations

__all__ = ["in_xla_context"]


def in_xla_context() -> bool:
    """Whether we are being traced inside a tf.function(jit_compile=True)."""
    import tensorflow as tf  # deferred: `import dcmha` must not import TensorFlow
    if tf.executing_eagerly():
        return False
    try:
        from tensorflow.python.ops import control_flow_util
        return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    except (ImportError, AttributeError):  # private API moved: nesting still works, slower
        return False
