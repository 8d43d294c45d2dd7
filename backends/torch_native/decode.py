"""One decoding step in plain PyTorch: the "torch_decode" implementation.

A cached decoding step is one query against S cached keys (T = 1). Its work is
small (a few (M x S) products per head group). On a CPU the time goes into
dispatching ops, and a ``keras.ops`` call costs about twice the PyTorch op it
wraps, because of its argument conversions. So this module runs the step of
``dcmha.ops``' one-query path (scores, both composes with the key-side terms in
low-rank form through ``dcmha.ops.decode_compose``, the masked softmax, P.V)
with PyTorch's own functions. It computes the same arithmetic and the same
masking rules: masked probabilities are exactly 0, and a query that sees no key
outputs 0. On the CPU, with no gradient to record, both composes and the masked
softmax are one call of the compiled C kernel (``cpu_kernel.decode_probs``, which
reads the key-side weights in the cache's layout); without the kernel
(``DCMHA_CPU_KERNEL=0``, no C compiler) PyTorch's ops compute them. A step's dynamic
weights and query projection are ``dynamic_weights.py``'s (the framework seam takes them).

``"auto"`` takes it for T == 1 calls (its registration declares ``one_query_only``). Any
other call that names it goes to the plain core, ``dcmha.ops.attention``, so a forced
``implementation="torch_decode"`` runs every call.
"""

from __future__ import annotations

import math

from dcmha.spec import terms as spec_terms

from .. import cpu_kernel
from .dynamic_weights import eager_kernel


def _visible(call, S, device):
    """The (B|1, 1, S) bool mask of the one query (user mask, causal, window), or None."""
    import torch

    from dcmha import ops as dops
    vis = None
    if call.use_causal_mask or call.sliding_window is not None:
        offset = call.query_offset
        pos = (offset.reshape(()).to(device=device, dtype=torch.int64) if hasattr(offset, "shape")
               else torch.tensor(int(offset), device=device))
        vis = spec_terms.visible(pos, torch.arange(S, device=device),
                                 causal=bool(call.use_causal_mask), window=call.sliding_window)
        vis = vis.reshape(1, 1, S)
    mask = dops.standardize_mask(call.attention_mask)     # (B|1, T|1, S|1) or None
    if mask is not None:
        mask = torch.as_tensor(mask, device=device).to(torch.bool)[:, :1].expand(-1, 1, S)
        vis = mask if vis is None else vis & mask
    return vis


def attention(call):
    """(o (B, 1, N, d_v) float32, {}) for a one-query call; any other call through the
    plain core (``dcmha.ops.attention``)."""
    from dcmha import ops as dops
    if not call.one_query or call.mask_kind == "per_head":
        return dops.attention(call)
    return _one_query(call), {}


def _kernel(x, pre, post):
    """The compiled kernel for a step with a compose stage whose terms it computes
    (``eager_kernel``'s rules), else None (PyTorch ops run)."""
    from dcmha import ops as dops
    if not dops.kernel_stages(pre, post):
        return None
    return eager_kernel(x, *pre.values(), *post.values())


def _one_query(call):
    """o (B, 1, N, d_v) float32 of a one-query call (see the module doc)."""
    import torch

    from dcmha import ops as dops
    q, k, v = (torch.as_tensor(x).to(torch.float32) for x in (call.q, call.k, call.v))
    B, _, N, d = q.shape
    S, N_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    G, rep = call.num_groups, N // N_kv
    M = N // G
    qh = (q * (1.0 / math.sqrt(d))).reshape(B, N_kv, rep, d)
    x = torch.einsum("bhrd,bshd->bhrs", qh, k).reshape(B, G, M, S)

    def eye(m):
        return torch.eye(m, dtype=torch.float32, device=q.device)

    def compose(a, terms):
        return dops.decode_compose(a, terms, M, einsum=torch.einsum, matmul=torch.matmul,
                                   eye=eye, reduce_sum=torch.sum, transpose=torch.permute)

    pre, post = ({n: torch.as_tensor(w, device=q.device).to(torch.float32)
                  for n, w in (stage or {}).items()} for stage in (call.pre, call.post))
    vis = _visible(call, S, q.device)                                   # (B|1, 1, S) or None
    lib = _kernel(x, pre, post)
    if lib is not None:          # both composes and the masked softmax in one kernel call
        # the key-side terms as the cache's stacked entries hold them (no copies)
        p = cpu_kernel.decode_probs(lib, x.contiguous(),
                                    torch.empty((B, G, M, S), dtype=torch.float32),
                                    None if vis is None else vis.contiguous(),
                                    cpu_kernel.decode_terms(pre), cpu_kernel.decode_terms(post),
                                    spec_terms.MASKED_SCORE)
    else:
        if pre:
            x = compose(x, pre)
        if vis is not None:
            x = x.masked_fill(~vis[:, :, None], spec_terms.MASKED_SCORE)   # (B|1, 1, 1, S)
        p = torch.softmax(x, dim=-1)
        if post:
            p = compose(p, post)
    o = torch.einsum("bhrs,bshv->bhrv", p.reshape(B, N_kv, rep, S), v).reshape(B, 1, N, d_v)
    if vis is not None:                  # a query that sees no key outputs 0
        o = o * vis.any(dim=-1).to(torch.float32)[:, :, None, None]
    return o
