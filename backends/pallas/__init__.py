"""Fused DCMHA attention as Pallas kernels (JAX): forward and backward.

``import dcmha.backends.pallas`` does not import JAX; the kernel module
(``dcmha_pallas``) is loaded on first use of ``dcmha_attention``,
``dcmha_attention_reference`` or ``BlockSizes``. On a machine without a GPU
the kernels run in Pallas interpret mode.
"""

from __future__ import annotations

import importlib
import importlib.util

__all__ = ["BlockSizes", "dcmha_attention", "dcmha_attention_reference", "is_available"]


def is_available() -> bool:
    """Whether JAX with Pallas can be imported (interpret mode then works on any machine).

    Imports JAX when it is installed (only when called).
    """
    if importlib.util.find_spec("jax") is None:
        return False
    try:
        importlib.import_module("jax.experimental.pallas")
    except ImportError:
        return False
    return True


def __getattr__(name):
    if name in ("BlockSizes", "dcmha_attention", "dcmha_attention_reference"):
        module = importlib.import_module(__name__ + ".dcmha_pallas")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
