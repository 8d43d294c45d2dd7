"""What the TensorFlow paths (``tf_cpu`` and ``xla``) share.

``in_xla_context``: whether the code runs inside a trace for XLA
(``tf.function(jit_compile=True)``), where ``tf_cpu``'s kernel ops cannot be
compiled and ``xla`` traces its core inline: the seam's rule, which also picks the form
of the dynamic weights (``dcmha.framework.compiles_ops``). Importing this module does not
import TensorFlow; the first call does.
"""

from __future__ import annotations

from dcmha.framework.tensorflow import in_xla_context

__all__ = ["in_xla_context"]
