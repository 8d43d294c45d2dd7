"""The "torch" implementation's module (Keras torch backend): ``attention(call)`` runs the
blocked PyTorch autograd function ``dcmha_torch.dcmha_attention`` on a validated
``dcmha.call.AttentionCall`` and returns (o (B, T, N, d_v) float32, extras), extras
holding "attention_scores" (B, N, T, S) when asked for (differentiable).

What the path lacks and where ``"auto"`` may take it (devices, the T * S threshold) are
declared in its registration (``dcmha.backends.torch_native.IMPLEMENTATION``);
``unsupported`` adds the checks that need the tensors (torch tensors, not inside
``torch.compile``: the core is a Python loop). An eager integer tensor ``query_offset`` is
read as an int. ``dcmha.ops.explain_implementation`` tells, for a call, why each path is
taken or passed over.

``query_chunk_size``, when given, is the block size (it bounds the largest block as it
bounds the "ops" core's largest intermediate); otherwise ``dcmha_torch.default_block_q``
chooses it.
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
