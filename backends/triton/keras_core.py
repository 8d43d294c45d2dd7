"""The "triton" fast path of ``dcmha.ops.dcmha_attention`` (Keras torch backend).

``dcmha.ops`` imports this module on first use (see ``dcmha.ops.FAST_PATHS``). It
wraps the fused kernel ``dcmha.backends.triton.dcmha_attention`` in the contract of
the plain core ``dcmha.ops._attention_ops``: ``attention(**call)`` takes the
projected heads q (B, T, N, d), k (B, S, N_kv, d), v (B, S, N_kv, d_v) and the
compose terms, and returns (o (B, T, N, d_v) float32, extras) with
extras["attention_scores"] (B, N, T, S) when asked for, {} otherwise.

Importing this module imports neither Triton nor the kernel module: Triton
fixes interpret or compiled mode when it is first imported (``TRITON_INTERPRET``),
and importing Triton in a process that already imported TensorFlow aborts it.
``preferred`` therefore looks at the device of q before anything imports Triton,
and ``unsupported`` refuses to import Triton after TensorFlow.

Rules:

* ``unsupported(call)`` (a reason, or None): Triton is not installed; q is not a
  CUDA tensor and Triton is not in interpret mode (``TRITON_INTERPRET=1`` set
  before Triton is imported); q is a CUDA tensor but Triton runs interpreted; the
  process imported TensorFlow before Triton; dropout in training; intermediates
  (``return_intermediates``); attention scores while autograd records (the
  kernel's scores are not differentiable); a query_offset that is not an integer
  (or an integer scalar tensor); pre and post stages with different ranks R (the
  kernel takes one R).
* ``preferred(call)``: q is a CUDA tensor and Triton is installed (so
  ``implementation="auto"`` never imports Triton for CPU tensors).

Meta tensors (Keras' shape inference of a symbolic call) never reach this
module: ``dcmha.ops.select_implementation`` gives them the plain core, which
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


def _ranks(call):
    """The ranks R of every low-rank pair in the call's pre / post stages."""
    return {tuple(terms[side + "w1"].shape)[3]
            for terms in (call.get("pre"), call.get("post")) if terms
            for side in "qk" if side + "w1" in terms}


def _offset_problem(offset):
    """Why ``query_offset`` cannot be passed to the kernel (None: it can)."""
    if not hasattr(offset, "shape"):
        return None                          # a Python / NumPy int (checked by dcmha.ops)
    import torch

    if not isinstance(offset, torch.Tensor) or tuple(offset.shape) != () \
            or offset.dtype.is_floating_point or offset.dtype == torch.bool:
        return ("takes `query_offset` as an integer or an integer scalar tensor. Received: "
                f"query_offset={offset!r}")
    return None


def unsupported(call):
    """Why the Triton kernel cannot run ``call`` (a str), or None when it can."""
    q = call["q"]
    device = _device_type(q)
    if call.get("return_intermediates"):
        return ("does not return intermediates (`return_intermediates=True`); use "
                "implementation='ops'")
    if call.get("training") and call.get("dropout_rate", 0.0) > 0.0:
        return ("has no attention dropout: dropout_rate="
                f"{call['dropout_rate']} with training=True; use implementation='ops'")
    problem = _offset_problem(call.get("query_offset", 0))
    if problem is not None:
        return problem
    ranks = _ranks(call)
    if len(ranks) > 1:
        return ("takes one rank R for every dynamic projection. Received: ranks "
                f"{sorted(ranks)}")
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
    if call.get("return_attention_scores"):
        import torch

        if torch.is_grad_enabled() and any(
                getattr(x, "requires_grad", False) for x in _tensors(call)):
            return ("returns attention scores that are not differentiable, and autograd is "
                    "recording; call under torch.no_grad() or use implementation='ops'")
    return None


def preferred(call) -> bool:
    """Whether ``implementation="auto"`` takes Triton: q on CUDA and Triton installed.

    The device is checked first, so CPU tensors never lead to importing Triton.
    """
    q = call["q"]
    return bool(getattr(q, "is_cuda", False)) and _triton_installed()


def _tensors(call):
    yield from (call["q"], call["k"], call["v"])
    for terms in (call.get("pre"), call.get("post")):
        yield from (terms or {}).values()


def attention(q, k, v, *, num_groups, pre, post, attention_mask, use_causal_mask,
              sliding_window, query_offset, query_chunk_size, dropout_rate, seed, training,
              return_attention_scores, return_intermediates, auto_chunk):
    """``_attention_ops`` on the fused Triton kernel (see the module docstring).

    q: (B, T, N, d), k: (B, S, N_kv, d), v: (B, S, N_kv, d_v); pre / post: dicts
    of compose terms or None. Returns (o (B, T, N, d_v) float32, extras), extras
    {"attention_scores": (B, N, T, S) float32} with ``return_attention_scores``,
    else {}. ``query_chunk_size`` and ``auto_chunk`` are ignored: the kernel
    tiles queries and keys itself and never materialises (B, N, T, S) unless
    the scores are asked for.
    """
    from keras import ops

    from dcmha import ops as dops
    from dcmha.backends import triton as tb

    q, k, v = (ops.cast(x, "float32") for x in (q, k, v))
    stages = [None if not terms else {n: ops.cast(w, "float32") for n, w in terms.items()}
              for terms in (pre, post)]
    mask = dops._standardize_mask(attention_mask)
    if mask is not None:
        mask = mask.to(q.device)
    offset = query_offset
    if hasattr(offset, "shape"):
        offset = int(offset)                 # a device sync when it lives on the GPU
    result = tb.dcmha_attention(
        q, k, v, num_groups=num_groups, pre=stages[0], post=stages[1], mask=mask,
        causal=bool(use_causal_mask), sliding_window=sliding_window,
        query_offset=int(offset), return_attention_scores=bool(return_attention_scores))
    return dops.core_result(result, return_attention_scores)
