"""Fused DCMHA attention in Triton for PyTorch (forward and backward).

Importing this package does not import Triton or PyTorch: the kernel module
``dcmha_triton`` loads on first use of one of its names, so a process can set
``TRITON_INTERPRET=1`` (run on CPU tensors through Triton's interpreter) first.
"""

import importlib.util
import os

from dcmha.backends import lazy_attributes
from dcmha.registry import Implementation

__all__ = ["IMPLEMENTATION", "BlockSizes", "dcmha_attention", "dcmha_attention_call",
           "dcmha_attention_reference", "is_available"]


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


__getattr__ = lazy_attributes(__name__, "dcmha_triton",
                              ("BlockSizes", "dcmha_attention", "dcmha_attention_call",
                               "dcmha_attention_reference"))

IMPLEMENTATION = Implementation(
    name="triton", backend="torch", module="dcmha.backends.triton.core",
    devices=frozenset({"gpu"}), auto_devices=frozenset({"gpu"}),
    lacks=frozenset({"intermediates", "dropout", "head_masks", "symbolic_shapes"}),
    priority=20, cpu_env={"TRITON_INTERPRET": "1"},
    description="fused Triton kernels, forward and backward (CUDA; interpreted on CPU)")
