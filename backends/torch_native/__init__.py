"""Fused DCMHA attention in plain PyTorch (forward and hand-written backward), for CPU.

Importing this package does not import PyTorch: the module ``dcmha_torch``
loads on first use of one of its names. See ``dcmha_torch`` for the API (the
same shape of API as the Triton, Pallas and XLA backends) and ``keras_core``
for the Keras fast path (``DCMHA(implementation="torch")``).
"""

import importlib.util

__all__ = ["dcmha_attention", "dcmha_attention_reference", "default_block_q", "is_available"]


def is_available() -> bool:
    """True when PyTorch is installed (the path runs on any PyTorch device)."""
    return importlib.util.find_spec("torch") is not None


def __getattr__(name):
    if name in ("dcmha_attention", "dcmha_attention_reference", "default_block_q"):
        from . import dcmha_torch
        return getattr(dcmha_torch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
