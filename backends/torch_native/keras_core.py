"""The plain-PyTorch fused core as a fast path of ``dcmha.ops.dcmha_attention``.

Registered in ``dcmha.ops.FAST_PATHS`` as "torch" (Keras torch backend); the
module implements the registry's contract:

* ``unsupported(call)``: None, or why this path cannot run ``call``:
  ``return_intermediates`` (the pre-softmax intermediates are never
  materialised), dropout in training (the blockwise backward would have to
  regenerate ``keras.random.dropout``'s mask; not implemented, so training
  with ``dropout > 0`` takes the "ops" core), a ``query_offset`` that is not a
  concrete integer, inputs that are not torch tensors, or a call traced by
  ``torch.compile``.
* ``preferred(call)``: CPU tensors (on CUDA the Triton path is the fast one),
  and a problem large enough for the blocked core to beat the "ops" core:
  T * S >= ``MIN_PREFERRED_TS`` (8192). Measured on the development CPU (one
  DCMHA layer, B=2, D=512, N=8, causal, 2 threads, medians of 11 alternating
  runs; time with this core / with "ops", training step and forward):
  T=S=16: 1.14, 0.96; T=S=64: 1.03, 0.96; T=S=96: 0.92, 0.93; T=S=128: 0.95,
  0.87; T=S=256: 0.65, 0.70. Below about 64 x 128 both cores take a few
  milliseconds, dominated by per-op overhead, and the training step is as
  fast or faster with "ops", so small problems keep "ops".
* ``attention(**call)``: the contract of ``dcmha.ops._attention_ops``:
  (o (B, T, N, d_v) float32, extras), extras holding "attention_scores"
  (B, N, T, S) when asked for (differentiable). Meta tensors (symbolic shape
  inference) never reach it: ``dcmha.ops.select_implementation`` gives them
  the plain core, which computes the shapes.

``query_chunk_size``, when given, is the block size (it bounds the largest
block as it bounds the "ops" core's largest intermediate); otherwise
``dcmha_torch.default_block_q`` chooses it.
"""

from __future__ import annotations

#: Smallest T * S that ``implementation="auto"`` sends to this path (see the module doc).
MIN_PREFERRED_TS = 64 * 128


def _torch():
    import torch
    return torch


def _offset(query_offset):
    """The query offset as a Python int, or None if it is not concrete."""
    if isinstance(query_offset, bool):
        return None
    if isinstance(query_offset, int):
        return query_offset
    torch = _torch()
    if isinstance(query_offset, torch.Tensor) and query_offset.numel() == 1 \
            and not query_offset.is_floating_point():
        return int(query_offset.reshape(()).item())
    try:
        import numpy as np
        if isinstance(query_offset, np.integer):
            return int(query_offset)
    except ImportError:   # pragma: no cover
        pass
    return None


def unsupported(call):
    """None if this path can run ``call``, else the reason why not."""
    torch = _torch()
    if call.get("return_intermediates"):
        return "return_intermediates is not supported (the intermediates are never materialised)"
    if call.get("training") and call.get("dropout_rate", 0.0) > 0.0:
        return "dropout in training is not supported (use implementation='ops')"
    if not all(isinstance(call[n], torch.Tensor) for n in ("q", "k", "v")):
        return "q, k and v must be torch tensors"
    if hasattr(torch, "compiler") and torch.compiler.is_compiling():
        return "calls traced by torch.compile are not supported (the core is a Python loop)"
    if _offset(call.get("query_offset", 0)) is None:
        return "query_offset must be a concrete integer"
    mask = call.get("attention_mask")
    if mask is not None and not isinstance(mask, torch.Tensor):
        return "attention_mask must be a torch tensor"
    return None


def preferred(call):
    """Whether ``implementation="auto"`` should take this path (see the module doc)."""
    q, k = call["q"], call["k"]
    if q.device.type != "cpu":
        return False
    return int(q.shape[1]) * int(k.shape[1]) >= MIN_PREFERRED_TS


def attention(q, k, v, *, num_groups, pre, post, attention_mask, use_causal_mask,
              sliding_window, query_offset, query_chunk_size, dropout_rate, seed, training,
              return_attention_scores, return_intermediates, auto_chunk):
    """The contract of ``dcmha.ops._attention_ops`` (see the module doc)."""
    from dcmha import ops as dops

    from . import dcmha_torch
    torch = _torch()
    f32 = torch.float32
    q, k, v = q.to(f32), k.to(f32), v.to(f32)
    mask = dops._standardize_mask(attention_mask)
    if mask is not None and mask.device != q.device:
        mask = mask.to(q.device)
    out = dcmha_torch.dcmha_attention(
        q, k, v, num_groups=num_groups, pre=pre or None, post=post or None, mask=mask,
        causal=bool(use_causal_mask), sliding_window=sliding_window,
        query_offset=_offset(query_offset), block_q=query_chunk_size,
        return_attention_scores=bool(return_attention_scores))
    return dops.core_result(out, return_attention_scores)
