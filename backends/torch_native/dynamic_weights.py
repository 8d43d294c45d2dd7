"""A decoding step's dynamic weights and query projection in eager PyTorch, provided to
the framework seam (``dcmha.framework.torch``) by this package's ``__init__``.

``dynamic_weights`` is ``dcmha.ops.plain_dynamic_weights`` in PyTorch's own ops (a
``keras.ops.einsum`` costs about five times a small ``torch.matmul`` here, and a step is
dispatch-bound); for a step's few rows without gradients the compiled kernel computes it
(``decode.dynamic_weights``). ``fused_query_projection`` adds the query projection to
the same matrix product (``decode.fused_projection``).
"""

from __future__ import annotations

import torch

from . import decode

#: Elements of a broadcast product below which it replaces a small bmm (PyTorch's
#: grain size for parallel elementwise work is 32768).
SMALL_PRODUCT = 1 << 16


def dynamic_weights(x, dw1, qkw, dd, *, C, rank, gelu_approximate, eps):
    """``plain_dynamic_weights``' arrays {"w1", "w2": (B, L, G, C, R, M), "dd": (B, L, G,
    C, M)} (those present) for x (B, L, D): the kernel's when it takes the call, else the
    same arithmetic as two matmuls with x and, for qkw, a broadcast product when it is
    small (a decoding step) or a bmm (a small ``torch.bmm`` enters an OpenMP parallel
    region whatever its size: 80 us with ``OMP_WAIT_POLICY=PASSIVE``; the product's
    (B L, G C, K, 2 R M) temporary is only worth it while small)."""
    B, L, D = x.shape
    x2 = x.to(torch.float32).reshape(B * L, D)
    out = decode.dynamic_weights(x2, dw1, qkw, dd, C=C, rank=rank,
                                 gelu_approximate=gelu_approximate, eps=eps)
    if out is not None:                      # (B L, G, C, ...) -> (B, L, G, C, ...)
        return {n: a.reshape(B, L, *a.shape[1:]) for n, a in out.items()}
    out = {}
    if dw1 is not None:
        G, K = dw1.shape[1], dw1.shape[3]
        h = torch.nn.functional.gelu(x2 @ dw1.to(torch.float32).reshape(D, G * C * K),
                                     approximate="tanh" if gelu_approximate else "none")
        M = qkw.shape[-1]
        q2 = qkw.to(torch.float32).reshape(G * C, K, 2 * rank * M)
        h = h.reshape(B * L, G * C, K)
        if B * L * G * C * K * 2 * rank * M <= SMALL_PRODUCT:
            w = (h[..., None] * q2).sum(2)                                 # sum over K
        else:
            w = torch.bmm(h.transpose(0, 1), q2).transpose(0, 1)          # (BL, GC, 2RM)
        w = w.reshape(B, L, G, C, 2 * rank, M)
        w1 = w[..., :rank, :]
        out["w1"] = w1 * torch.rsqrt(w1.square().mean(-1, keepdim=True) + eps)
        out["w2"] = w[..., rank:, :]
    if dd is not None:
        G, CM = dd.shape[1], dd.shape[2]
        g = torch.tanh(x2 @ dd.to(torch.float32).reshape(D, G * CM))
        out["dd"] = g.reshape(B, L, G, C, CM // C)
    return out


def fused_query_projection(x, kernel, bias, dw1, qkw, dd, *, C, rank, gelu_approximate, eps):
    """(x . kernel + bias as (B, L, N, d) float32, ``dynamic_weights``' arrays (B, L, G, C,
    ...)) from one matrix product of x (B, L, D) with [kernel | dw1 | dd]
    (``decode.fused_projection``), or None where it does not run."""
    B, L, D = x.shape
    out = decode.fused_projection(x.reshape(B * L, D), kernel, bias, dw1, qkw, dd, C=C,
                                  rank=rank, gelu_approximate=gelu_approximate, eps=eps)
    if out is None:
        return None
    q, stacked = out
    return (q.reshape(B, L, *kernel.shape[1:]),
            {n: a.reshape(B, L, *a.shape[1:]) for n, a in stacked.items()})
