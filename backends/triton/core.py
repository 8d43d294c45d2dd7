"""The "triton" fast path of ``dcmha.ops.dcmha_attention`` (Keras torch backend).

Registered as ``IMPLEMENTATION`` in ``dcmha.backends.triton`` (entry point
``triton``), imported by ``dcmha.registry`` on first use. ``attention(call)`` runs
the fused kernel ``dcmha.backends.triton.dcmha_attention`` on a validated
``dcmha.call.AttentionCall`` and returns (o (B, T, N, d_v) float32, extras) with
extras["attention_scores"] (B, N, T, S) when asked for, {} otherwise.

Importing this module imports neither Triton nor the kernel module: Triton
fixes interpret or compiled mode when it is first imported (``TRITON_INTERPRET``),
and importing Triton in a process that already imported TensorFlow aborts it.
``preferred`` therefore looks at the device of q before anything imports Triton,
and ``unsupported`` refuses to import Triton after TensorFlow.

Rules:

* Declared (the registration): no intermediates, no dropout in training, no
  per-head masks; CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1``.
* ``unsupported(call)`` (a reason, or None): Triton is not installed; q is not a
  CUDA tensor and Triton is not in interpret mode (``TRITON_INTERPRET=1`` set
  before Triton is imported); q is a CUDA tensor but Triton runs interpreted; the
  process imported TensorFlow before Triton; attention scores while autograd
  records (the kernel's scores are not differentiable); pre and post stages with
  different ranks R (the kernel takes one R); on a GPU, kernels that ask for more
  shared memory per block than it gives (``dcmha_triton.over_shared_memory``: a program
  holds all heads of a group, so with 16 heads per group none fits an H100 at head dim
  128, nor the backward ones at 64), so that "auto" passes over Triton there (the "ops"
  core runs).
* ``preferred(call)``: q is a CUDA tensor and Triton is installed (so
  ``implementation="auto"`` never imports Triton for CPU tensors).

Meta tensors (Keras' shape inference of a symbolic call) never reach this
module: ``dcmha.registry.select`` gives them the plain core, which
computes the output shapes.

Conventions checked against ``_attention_ops`` and ``spec/SPEC.md``: the kernel
scales the scores itself (``scale`` = 1 / sqrt(d), the default), so q is passed
unscaled; causal is s <= query_offset + t and the window |query_offset + t - s| < W
(with causal: the W keys ending at the query), as in the spec; the mask is a
boolean (B|1, T|1, S|1) tensor (``_standardize_mask``) that the kernel broadcasts;
fully masked rows give zeros.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_INTERPRET_VALUES = ("1", "true", "on", "yes")
_NOT_ON_CUDA = ("needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported, "
                "to run on CPU")


def _triton_installed() -> bool:
    return (importlib.util.find_spec("triton") is not None
            or "triton" in sys.modules)


def _interpreting() -> bool:
    """Whether the kernels run (or will run) in Triton's interpreter.

    Once the kernel module is loaded its kernels know; before that Triton will be
    loaded with the mode ``TRITON_INTERPRET`` says now.
    """
    kernels = sys.modules.get("dcmha.backends.triton.dcmha_triton")
    if kernels is not None:
        return kernels._interpreting()
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _INTERPRET_VALUES


def _device_type(x) -> str:
    device = getattr(x, "device", None)
    return getattr(device, "type", str(device))


def unsupported(call):
    """Why the Triton kernel cannot run ``call`` (a str), or None when it can.

    The registration declares the device rule (CUDA tensors; CPU tensors with
    TRITON_INTERPRET=1) and the capabilities; this checks what needs the tensors."""
    q = call.q
    device = _device_type(q)
    if len(call.ranks) > 1:
        return ("takes one rank R for every dynamic projection. Received: ranks "
                f"{list(call.ranks)}")
    if not _triton_installed():
        return "needs Triton, which is not installed (pip install triton)"
    interpret = _interpreting()
    if device != "cuda" and not interpret:
        return f"{_NOT_ON_CUDA}. Received: q on {q.device}"
    if device == "cuda" and interpret:
        return ("runs interpreted (TRITON_INTERPRET=1), which takes CPU tensors. Received: "
                f"q on {q.device}")
    if "tensorflow" in sys.modules and "triton" not in sys.modules:
        return ("cannot import Triton in this process: TensorFlow is imported, and importing "
                "Triton after TensorFlow aborts the process")
    if call.return_attention_scores and _recording(call):
        return ("returns attention scores that are not differentiable, and autograd is "
                "recording; call under torch.no_grad() or use implementation='ops'")
    if device == "cuda":
        return _shared_memory_problem(call)
    return None


def _shared_memory_problem(call):
    """Why the kernels ``call`` will launch ask for more shared memory per block than q's
    GPU gives (``dcmha_triton.over_shared_memory``), or None."""
    import torch

    from . import dcmha_triton
    # ``attention`` hands the kernels float32 q, k, v.
    return dcmha_triton.over_shared_memory(call, _shared_memory_limit(call.q.device),
                                           backward=_recording(call), dtype=torch.float32)


def _recording(call) -> bool:
    """Whether autograd records the call (the backward kernels will run)."""
    import torch
    return torch.is_grad_enabled() and any(
        getattr(x, "requires_grad", False) for x in _tensors(call))


def _shared_memory_limit(device) -> int:
    """Bytes of shared memory the GPU ``device`` gives one block (what Triton checks at
    launch)."""
    from triton.compiler.compiler import max_shared_mem
    index = getattr(device, "index", None)
    return max_shared_mem(0 if index is None else index)


def preferred(call) -> bool:
    """Whether ``implementation="auto"`` takes Triton: q on CUDA and Triton installed.

    The device is checked first, so CPU tensors never lead to importing Triton.
    """
    return bool(getattr(call.q, "is_cuda", False)) and _triton_installed()


def _tensors(call):
    yield from (call.q, call.k, call.v)
    for terms in call.stages.values():
        yield from terms.values()


def attention(call):
    """(o, extras) of the fused Triton kernel for a validated ``AttentionCall``.

    Returns (o (B, T, N, d_v) float32, extras), extras {"attention_scores":
    (B, N, T, S) float32} with ``return_attention_scores``, else {}.
    ``query_chunk_size`` is ignored: the kernel tiles queries and keys itself and
    never materialises (B, N, T, S) unless the scores are asked for.
    """
    import dataclasses

    from keras import ops

    from dcmha import ops as dops
    from dcmha.backends import triton as tb

    q, k, v = (ops.cast(x, "float32") for x in (call.q, call.k, call.v))
    mask = dops.standardize_mask(call.attention_mask)
    if mask is not None:
        mask = mask.to(q.device)
    offset = call.query_offset
    if hasattr(offset, "shape"):
        offset = int(offset)                 # a device sync when it lives on the GPU
    # The registry validated the call: the kernels take it as it is (cast, mask standardised).
    kernel_call = dataclasses.replace(call, q=q, k=k, v=v, attention_mask=mask,
                                      query_offset=int(offset), static_offset=int(offset))
    result = tb.dcmha_attention_call(kernel_call)
    return dops.core_result(result, call.return_attention_scores)
