"""A step's dynamic weights and query projection in eager PyTorch, provided to the
framework seam (``dcmha.framework.torch``) by this package's ``__init__``.

``dynamic_weights`` is ``dcmha.ops.plain_dynamic_weights`` in PyTorch's own ops (a
``keras.ops.einsum`` costs about five times a small ``torch.matmul`` here, and a step is
dispatch-bound); for a step's few rows without gradients the compiled kernel computes it
(``cpu_kernel.dynamic_weights``). ``fused_query_projection`` adds the query projection
to the same matrix product (``fused_projection``). ``eager_kernel`` is the rule for when
the compiled kernel may run at all (``decode`` applies it too).
"""

from __future__ import annotations

import os
import weakref

import torch

from .. import cpu_kernel

#: Elements of a broadcast product below which it replaces a small bmm (PyTorch's
#: grain size for parallel elementwise work is 32768).
SMALL_PRODUCT = 1 << 16


def eager_kernel(*arrays):
    """The compiled kernel (``cpu_kernel``) when PyTorch runs these arrays eagerly on the
    CPU and records no gradient for them, else None. A call through ctypes is invisible to
    a trace (``torch.jit.trace``, ``torch.compile``, an exporter): a traced graph would keep
    the empty output buffer and not the kernel that fills it."""
    if (torch.jit.is_tracing() or torch.compiler.is_compiling()
            or any(a.device.type != "cpu" for a in arrays)
            or (torch.is_grad_enabled() and any(a.requires_grad for a in arrays))):
        return None
    return cpu_kernel.load()


def dynamic_weights(x, dw1, qkw, dd, *, C, rank, gelu_approximate, eps, weight_scale=1.0):
    """``plain_dynamic_weights``' arrays {"w1", "w2": (B, L, G, C, R, M), "dd": (B, L, G,
    C, M)} (those present) for x (B, L, D) and the weights times ``weight_scale`` (their
    products, kept while the weights are unchanged: ``dcmha.framework.scaled_weights``):
    the kernel's when it takes the call, else the
    same arithmetic as two matmuls with x and, for qkw, a broadcast product when it is
    small (a decoding step) or a bmm (a small ``torch.bmm`` enters an OpenMP parallel
    region whatever its size: 80 us with ``OMP_WAIT_POLICY=PASSIVE``; the product's
    (B L, G C, K, 2 R M) temporary is only worth it while small)."""
    from dcmha import framework
    dw1, qkw, dd = framework.scaled_weights((dw1, qkw, dd), weight_scale)
    B, L, D = x.shape
    x2 = x.to(torch.float32).reshape(B * L, D)
    out = _kernel_dynamic_weights(x2, dw1, qkw, dd, C=C, rank=rank,
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
    (``fused_projection``), or None where it does not run."""
    B, L, D = x.shape
    out = fused_projection(x.reshape(B * L, D), kernel, bias, dw1, qkw, dd, C=C,
                                  rank=rank, gelu_approximate=gelu_approximate, eps=eps)
    if out is None:
        return None
    q, stacked = out
    return (q.reshape(B, L, *kernel.shape[1:]),
            {n: a.reshape(B, L, *a.shape[1:]) for n, a in stacked.items()})


def _kernel_dynamic_weights(x2, dw1, qkw, dd, *, C, rank, gelu_approximate, eps):
    """``dcmha.ops``' stacked dynamic weights for x2 (BL, D) by the compiled kernel
    (``cpu_kernel.dynamic_weights``): {"w1", "w2": (BL, G, C, R, M), "dd": (BL, G, C, M)}
    (those present), or None when the kernel cannot run it (more than
    ``cpu_kernel.DYNAMIC_ROWS`` rows, not on the CPU, a gradient to record, or no kernel).
    A small matrix-vector product enters an OpenMP parallel region, which costs more than
    the kernel's whole computation for a decoding step."""
    lib = None if x2.shape[0] > cpu_kernel.DYNAMIC_ROWS else eager_kernel(
        *(w for w in (x2, dw1, qkw, dd) if w is not None))
    if lib is None:
        return None
    BL, D = x2.shape
    f32 = lambda w: None if w is None else w.to(torch.float32).contiguous()   # noqa: E731
    G, K, M = cpu_kernel.dynamic_sizes(dw1, qkw, dd, C)
    out = _outputs(BL, G, C, rank, M, dw1 is not None, dd is not None)
    cpu_kernel.dynamic_weights(lib, f32(x2), f32(dw1), f32(qkw), f32(dd), out.get("w1"),
                               out.get("w2"), out.get("dd"), GC=G * C, K=K, M=M, rank=rank,
                               gelu_approximate=gelu_approximate, eps=eps)
    return out


def _outputs(BL, G, C, rank, M, projection, gating):
    """The empty float32 outputs of ``dynamic_weights``: "w1", "w2" (BL, G, C, R, M) with a
    projection, "dd" (BL, G, C, M) with gating."""
    import torch
    out = {}
    if projection:
        out["w1"] = torch.empty((BL, G, C, rank, M), dtype=torch.float32)
        out["w2"] = torch.empty((BL, G, C, rank, M), dtype=torch.float32)
    if gating:
        out["dd"] = torch.empty((BL, G, C, M), dtype=torch.float32)
    return out


#: Whether ``fused_projection`` runs (``DCMHA_FUSED_PROJECTION=0`` turns it off; it keeps a
#: copy of each layer's query kernel, see there).
FUSED_PROJECTION = os.environ.get("DCMHA_FUSED_PROJECTION", "1") != "0"
#: id(query kernel) -> (its parts' (weak reference, version) pairs, their concatenation or
#: None); an entry goes when its kernel does (a tensor's == is elementwise, so not a
#: WeakKeyDictionary).
_CONCATENATED: dict = {}


def _concatenated(kernel, bias, dw1, dd):
    """The (D, n) matrix [kernel | dw1 | dd] (kernel (D, ...) and the dynamic-weight arrays
    flattened after D) and its (n,) bias (the query bias, then zeros), or None.

    Kept per query kernel while every part is the same tensor at the same version (an
    in-place update, such as ``Variable.assign``'s ``copy_``, bumps it). It is built on the
    second call that sees a set of parts unchanged, so weights that change every call
    (a training loop's evaluation steps, a stateless call's values) are never copied."""
    parts = [w for w in (kernel, bias, dw1, dd) if w is not None]
    entry = _CONCATENATED.get(id(kernel))
    same = entry is not None and len(entry[0]) == len(parts) and all(
        r() is w and v == w._version for (r, v), w in zip(entry[0], parts))
    if not same:
        refs = [weakref.ref(w) for w in parts]
        refs[0] = weakref.ref(kernel, lambda _, i=id(kernel): _CONCATENATED.pop(i, None))
        _CONCATENATED[id(kernel)] = (tuple((r, w._version) for r, w in zip(refs, parts)), None)
        return None
    if entry[1] is None:
        D = kernel.shape[0]
        mats = [w.reshape(D, -1) for w in (kernel, dw1, dd) if w is not None]
        n = sum(m.shape[1] for m in mats)
        b = None
        if bias is not None:
            b = torch.zeros((n,), dtype=torch.float32)
            b[:bias.numel()] = bias.reshape(-1)
        entry = _CONCATENATED[id(kernel)] = (entry[0], (torch.cat(mats, 1).contiguous(), b))
    return entry[1]


def fused_projection(x2, kernel, bias, dw1, qkw, dd, *, C, rank, gelu_approximate, eps):
    """A decoding step's query projection and dynamic weights from one product, or None.

    x2 (BL, D); kernel (D, ...) and bias (...) or None: the query projection; dw1, qkw, dd
    as ``dcmha.ops.dynamic_weights`` takes them. Returns (x2 . kernel + bias as (BL, n_q),
    {"w1", "w2": (BL, G, C, R, M), "dd": (BL, G, C, M)} (those present)), float32.

    One matrix product with [kernel | dw1 | dd] reads the three weights at the threaded
    product's bandwidth, where the kernel's matrix-vector product (``dynamic_weights``)
    reads dw1 and dd on one thread; the compiled kernel computes the rest
    (``cpu_kernel.dynamic_finish``). The cost: a copy of the concatenation per layer
    (``_concatenated``), D x (n_q + G C (K + M)) floats. None where it does not run:
    ``FUSED_PROJECTION`` off, more than ``cpu_kernel.DYNAMIC_ROWS`` rows, an array not
    float32, ``eager_kernel``'s conditions, or the first call with these weights."""
    arrays = [w for w in (x2, kernel, bias, dw1, qkw, dd) if w is not None]
    if (not FUSED_PROJECTION or x2.shape[0] > cpu_kernel.DYNAMIC_ROWS
            or any(a.dtype != torch.float32 for a in arrays)):
        return None
    lib = eager_kernel(*arrays)
    if lib is None:
        return None
    fused = _concatenated(kernel, bias, dw1, dd)
    if fused is None:
        return None
    w, b = fused
    y = torch.mm(x2, w) if b is None else torch.addmm(b, x2, w)
    BL, n_q = x2.shape[0], kernel[0].numel()
    G, K, M = cpu_kernel.dynamic_sizes(dw1, qkw, dd, C)
    out = _outputs(BL, G, C, rank, M, dw1 is not None, dd is not None)
    g_col = n_q + (G * C * K if dw1 is not None else 0)      # x dw1 starts at n_q
    cpu_kernel.dynamic_finish(lib, y, n_q, g_col, None if qkw is None else qkw.contiguous(),
                              out.get("w1"), out.get("w2"), out.get("dd"), GC=G * C, K=K,
                              M=M, rank=rank, gelu_approximate=gelu_approximate, eps=eps)
    return y[:, :n_q], out
