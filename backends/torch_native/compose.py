"""A block's compose and masked softmax for ``dcmha_torch``, forward and backward.

On CPU, with float32 arrays whose last axis is contiguous, a block's whole compose (and its
backward) is one call of the compiled C kernel (``cpu_kernel``, built on first use when a C
compiler is present); otherwise it runs as PyTorch ops: the residual, static and query-side
terms as one block-diagonal GEMM per query row, the key-side terms as broadcast
multiply-adds along the key axis. The softmax and its backward run along the contiguous
last axis, in the block's storage order.
"""

from __future__ import annotations

import torch

from .. import cpu_kernel
from .blocks import _Problem, _rows


def _kernel(*arrays):
    """The compiled compose kernel (``cpu_kernel``) for a CPU block, else None.

    The kernel reads raw float32 memory with a unit stride along the key axis: every
    array of the block (the None of absent terms aside) must be a CPU float32 tensor
    whose last axis is contiguous (the block loop's buffers and the prepared terms
    always are; anything else takes the PyTorch ops).
    """
    for a in arrays:
        if a is not None and (a.device.type != "cpu" or a.dtype != torch.float32
                              or (a.shape[-1] > 1 and a.stride(-1) != 1)):
            return None
    return cpu_kernel.load()


def _block_terms(st, t0, t1, s0, s1):
    """(wq, kw1, kw2, kdd) (or their gradients) restricted to a block's rows / key columns."""
    wq, kw1, kw2, kdd = st
    return (None if wq is None else wq[:, t0:t1], None if kw1 is None else kw1[..., s0:s1],
            None if kw2 is None else kw2[..., s0:s1], None if kdd is None else kdd[..., s0:s1])


def _causal_off(pb: _Problem, t0, s0, s):
    """``cpu_kernel.block_causal_off`` of a block of this call."""
    return cpu_kernel.block_causal_off(pb.causal, t0, s0, s, pb.offset)


def _hidden(x5, w, out):
    """out[b, t, g, r, s] = sum_m x5[b, t, g, m, s] * w[b, g, r, m, s]."""
    w = w[:, None]                                                # (B, 1, G, R, M, s)
    torch.mul(x5[:, :, :, None, 0], w[..., 0, :], out=out)
    for m in range(1, x5.shape[3]):
        out.addcmul_(x5[:, :, :, None, m], w[..., m, :])
    return out


def _compose(x, st, pb: _Problem, ws, out_name, h_name, t0, t1, s0, s1, inplace):
    """Compose of a block x (a (B, t, N, s) view); returns (out, key-side hidden or None).

    With query-side or static terms the result is the row-major buffer
    ``out_name``; otherwise x itself when ``inplace``, else a copy in ``out_name``
    (same storage order as x).
    """
    wq, kw1, kw2, kdd = st
    if wq is None and kw1 is None and kdd is None:
        return x, None
    B, t, N, s = x.shape
    G, M = pb.G, pb.M
    lib = _kernel(x, *st)
    if lib is not None:
        out = x if inplace else ws.take(out_name, B, t, N, s)
        cpu_kernel.compose_forward(lib, x, out, _block_terms(st, t0, t1, s0, s1), G, pb.R,
                                   _causal_off(pb, t0, s0, s))
        return out, None
    x5 = x.unflatten(2, (G, M))
    h = None
    if kw1 is not None:
        h = _hidden(x5, kw1[..., s0:s1], ws.take(h_name, B, t, G, pb.R, s))
    kddb = None if kdd is None else kdd[:, None, ..., s0:s1]       # (B, 1, G, M, s)
    if wq is not None:
        out = ws.take(out_name, B, t, N, s)
        for b in range(B):       # residual, static and query-side terms: one GEMM per row
            torch.bmm(wq[b, t0:t1], x[b], out=out[b])
        out5 = out.view(B, t, G, M, s)
        if kddb is not None:
            out5.addcmul_(x5, kddb)
    else:
        if inplace:
            out5 = x5
        else:
            kind, phys = _rows(x)
            buf = ws.take(out_name, *phys.shape).copy_(phys)
            out5 = (buf if kind == "rm" else buf.transpose(1, 2)).unflatten(2, (G, M))
        if kddb is not None:
            out5.mul_(kddb + 1.0)
    if h is not None:
        kw2b = kw2[:, None, ..., s0:s1]                            # (B, 1, G, R, M, s)
        for r in range(h.shape[3]):
            out5.addcmul_(h[:, :, :, r, None], kw2b[:, :, :, r])
    return out5.flatten(2, 3), h


def _compose_backward(x, g, h, st, dst, pb: _Problem, ws, out_name, t0, t1, s0, s1):
    """dL/dx of Compose for a block (g = dL/d out, may be overwritten); accumulates term grads.

    x, g: (B, t, N, s) views; h: the key-side hidden of the forward (from x);
    dst: gradients of (wq, kw1, kw2, kdd): rows t0:t1 of wq are written, key
    columns s0:s1 of the key-side terms accumulated.
    """
    wq, kw1, kw2, kdd = st
    if wq is None and kw1 is None and kdd is None:
        return g
    d_wq, d_kw1, d_kw2, d_kdd = dst
    B, t, N, s = x.shape
    G, M = pb.G, pb.M
    lib = _kernel(x, g, *st, *dst)
    if lib is not None:          # dx in place of g
        return cpu_kernel.compose_backward(lib, x, g, g, _block_terms(st, t0, t1, s0, s1),
                                           _block_terms(dst, t0, t1, s0, s1), G, pb.R,
                                           _causal_off(pb, t0, s0, s))
    x5, g5 = x.unflatten(2, (G, M)), g.unflatten(2, (G, M))
    tmp = ws.take("tmp", B, t, G, M, s)
    gk = None
    if kw1 is not None:
        kw1b, kw2b = kw1[:, None, ..., s0:s1], kw2[:, None, ..., s0:s1]
        gk = _hidden(g5, kw2[..., s0:s1], ws.take("gk", B, t, G, pb.R, s))   # sum_n kw2 g
        for r in range(gk.shape[3]):
            d_kw1[:, :, r, :, s0:s1] += torch.mul(gk[:, :, :, r, None], x5, out=tmp).sum(1)
            d_kw2[:, :, r, :, s0:s1] += torch.mul(h[:, :, :, r, None], g5, out=tmp).sum(1)
    kddb = None
    if kdd is not None:
        kddb = kdd[:, None, ..., s0:s1]
        d_kdd[..., s0:s1] += torch.mul(g5, x5, out=tmp).sum(1)
    if wq is not None:
        dx = ws.take(out_name, B, t, N, s)
        for b in range(B):
            torch.bmm(g[b], x[b].transpose(1, 2), out=d_wq[b, t0:t1])
            torch.bmm(wq[b, t0:t1].transpose(1, 2), g[b], out=dx[b])
        dx5 = dx.view(B, t, G, M, s)
        if kddb is not None:
            dx5.addcmul_(g5, kddb)
    else:                                   # residual; g is not read any more
        dx5 = g5 if kddb is None else g5.mul_(kddb + 1.0)
    if gk is not None:
        for r in range(gk.shape[3]):
            dx5.addcmul_(gk[:, :, :, r, None], kw1b[:, :, :, r])
    return dx5.flatten(2, 3)


def _softmax(y, ws, name):
    """softmax along s of a block view y, in its storage order, into buffer ``name``."""
    kind, phys = _rows(y)
    p = torch._softmax(phys, -1, False, out=ws.take(name, *phys.shape))
    return p if kind == "rm" else p.transpose(1, 2)


def _softmax_backward(dp, p, ws, name):
    """p * (dp - sum(p * dp)) along s, in p's storage order, into buffer ``name``."""
    kind, phys = _rows(p)
    dphys = dp if kind == "rm" else dp.transpose(1, 2)
    out = torch._softmax_backward_data(dphys, phys, -1, torch.float32,
                                       grad_input=ws.take(name, *phys.shape))
    return out if kind == "rm" else out.transpose(1, 2)


def _probabilities(y, fills, empty, s0, ws, name):
    """Masked softmax of a pre-composed block y (overwritten) into buffer ``name``."""
    for a, bias in fills:                                         # bias: (B|1, t, 1, n)
        y[..., a - s0:a - s0 + bias.shape[-1]].add_(bias)
    p = _softmax(y, ws, name)
    if empty is not None:
        p.masked_fill_(empty[:, :, None, None], 0.0)
    return p
