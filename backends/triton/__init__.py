"""Fused DCMHA attention in Triton for PyTorch (forward and backward).

Importing this package does not import Triton or PyTorch: the kernel module
``dcmha_triton`` loads on first use of one of its names, so a process can set
``TRITON_INTERPRET=1`` (run on CPU tensors through Triton's interpreter) first.
"""

import importlib.util
import os

__all__ = ["BlockSizes", "dcmha_attention", "dcmha_attention_reference", "is_available"]


def is_available(interpret=None) -> bool:
    """True when Triton and PyTorch are installed and the kernels can run here.

    ``interpret``: None reads TRITON_INTERPRET. Interpreted runs need only the
    CPU; compiled runs need a CUDA device.
    """
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None:
        return False
    if interpret is None:
        interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    if interpret:
        return True
    import torch
    return torch.cuda.is_available()


def __getattr__(name):
    if name in ("BlockSizes", "dcmha_attention", "dcmha_attention_reference"):
        from . import dcmha_triton
        return getattr(dcmha_triton, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
