"""Fused DCMHA attention as Pallas kernels (JAX): forward and backward.

``import dcmha.backends.pallas`` does not import JAX; the kernel module
(``dcmha_pallas``) is loaded on first use of ``dcmha_attention``,
``dcmha_attention_reference`` or ``BlockSizes``. On a machine without a GPU
the kernels run in Pallas interpret mode.
"""

from __future__ import annotations

import importlib
import importlib.util

from dcmha.backends import lazy_attributes
from dcmha.registry import Implementation

__all__ = ["IMPLEMENTATION", "BlockSizes", "dcmha_attention", "dcmha_attention_call",
           "dcmha_attention_reference", "is_available"]


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


__getattr__ = lazy_attributes(__name__, "dcmha_pallas",
                              ("BlockSizes", "dcmha_attention", "dcmha_attention_call",
                               "dcmha_attention_reference"))

IMPLEMENTATION = Implementation(
    name="pallas", backend="jax", module="dcmha.backends.pallas.core",
    devices=frozenset({"cpu", "gpu", "tpu"}), auto_devices=frozenset({"gpu"}),
    lacks=frozenset({"intermediates", "dropout", "head_masks", "traced_offset",
                     "symbolic_shapes"}),
    priority=20,
    description="fused Pallas kernels with a custom_vjp (GPU; interpreted elsewhere)")
