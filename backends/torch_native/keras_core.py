"""The plain-PyTorch fused core as the "torch" implementation (Keras torch backend).

Registered as ``IMPLEMENTATION`` in ``dcmha.backends.torch_native`` (entry point
``torch`` of ``dcmha.implementations``), which declares what it lacks: the
intermediates (never materialised), dropout in training (the blockwise backward
would have to regenerate ``keras.random.dropout``'s mask), per-head masks, unknown shapes. This module adds:

* ``unsupported(call)``: inputs that are not torch tensors, a call traced by
  ``torch.compile`` (the core is a Python loop). An eager integer tensor
  ``query_offset`` is read as an int.
* ``preferred(call)``: for ``"auto"`` on CPU from T * S >= ``MIN_PREFERRED_TS``
  (8192, declared in the registration): below it both cores take a few
  milliseconds, dominated by per-op overhead, and the training step is as fast
  or faster with "ops" (figures: benchmarks/RESULTS.md, "Dispatch thresholds").
  On CUDA the Triton path is the fast one, so ``"auto"`` takes this one on CPU only.
* ``attention(call)``: (o (B, T, N, d_v) float32, extras), extras holding
  "attention_scores" (B, N, T, S) when asked for (differentiable).

``query_chunk_size``, when given, is the block size (it bounds the largest
block as it bounds the "ops" core's largest intermediate); otherwise
``dcmha_torch.default_block_q`` chooses it.
"""

from __future__ import annotations



def unsupported(call):
    """None if this path can run ``call``, else the reason why not."""
    import torch
    if not all(isinstance(x, torch.Tensor) for x in (call.q, call.k, call.v)):
        return "q, k and v must be torch tensors"
    if hasattr(torch, "compiler") and torch.compiler.is_compiling():
        return "calls traced by torch.compile are not supported (the core is a Python loop)"
    return None


def _offset(query_offset):
    """The query offset as a Python int (an eager integer scalar tensor is read; ``describe``
    has refused anything else)."""
    if hasattr(query_offset, "shape"):
        return int(query_offset.reshape(()).item())
    return int(query_offset)


def attention(call):
    """(o, extras) for a validated ``dcmha.call.AttentionCall`` (see the module doc)."""
    import torch

    from dcmha import ops as dops

    from . import dcmha_torch
    q, k, v = (x.to(torch.float32) for x in (call.q, call.k, call.v))
    mask = dops.standardize_mask(call.attention_mask)
    if mask is not None and mask.device != q.device:
        mask = mask.to(q.device)
    out = dcmha_torch.dcmha_attention(
        q, k, v, num_groups=call.num_groups, pre=call.pre, post=call.post, mask=mask,
        causal=call.use_causal_mask, sliding_window=call.sliding_window,
        query_offset=_offset(call.query_offset), block_q=call.query_chunk_size,
        return_attention_scores=call.return_attention_scores)
    return dops.core_result(out, call.return_attention_scores)
