"""DCMHA attention for TensorFlow on CPU, its composes run by the compiled C kernel.

Importing this package does not import TensorFlow: the module ``dcmha_tf_cpu`` loads
on first use of one of its names. See ``dcmha_tf_cpu`` for the API and ``keras_core``
for the Keras fast path (``DCMHA(implementation="tf_cpu")``).
"""

import importlib.util

__all__ = ["dcmha_attention", "dcmha_attention_reference", "is_available"]


def is_available() -> bool:
    """True when TensorFlow is installed (whether the ops build: ``dcmha_tf_cpu.load()``)."""
    return importlib.util.find_spec("tensorflow") is not None


def __getattr__(name):
    if name in ("dcmha_attention", "dcmha_attention_reference"):
        from . import dcmha_tf_cpu
        return getattr(dcmha_tf_cpu, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
