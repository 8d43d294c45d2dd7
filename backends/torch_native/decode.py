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
(``DCMHA_CPU_KERNEL=0``, no C compiler) PyTorch's ops compute them. The framework seam
(``dcmha.framework.torch``, through ``dynamic_weights.py`` here) also takes this module's
``dynamic_weights`` (a step's dynamic weights by the kernel) and ``fused_projection`` (the
query projection and the dynamic projection as one product).

``"auto"`` takes it for T == 1 calls (its registration declares ``one_query_only``). Any
other call that names it goes to the plain core, ``dcmha.ops.attention``, so a forced
``implementation="torch_decode"`` runs every call.
"""

from __future__ import annotations

import math
import os
import weakref

from dcmha.spec import terms as spec_terms

from .. import cpu_kernel


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


def _kernel_for(*arrays):
    """The compiled kernel (``cpu_kernel``) when PyTorch runs these arrays eagerly on the
    CPU and records no gradient for them, else None. A call through ctypes is invisible to
    a trace (``torch.jit.trace``, ``torch.compile``, an exporter): a traced graph would keep
    the empty output buffer and not the kernel that fills it."""
    import torch
    if (torch.jit.is_tracing() or torch.compiler.is_compiling()
            or any(a.device.type != "cpu" for a in arrays)
            or (torch.is_grad_enabled() and any(a.requires_grad for a in arrays))):
        return None
    return cpu_kernel.load()


def _kernel(x, pre, post):
    """The compiled kernel for a step with a compose stage whose terms it computes
    (``_kernel_for``'s rules), else None (PyTorch ops run)."""
    from dcmha import ops as dops
    if not dops.kernel_stages(pre, post):
        return None
    return _kernel_for(x, *pre.values(), *post.values())


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


def dynamic_weights(x2, dw1, qkw, dd, *, C, rank, gelu_approximate, eps):
    """``dcmha.ops``' stacked dynamic weights for x2 (BL, D) by the compiled kernel
    (``cpu_kernel.dynamic_weights``): {"w1", "w2": (BL, G, C, R, M), "dd": (BL, G, C, M)}
    (those present), or None when the kernel cannot run it (more than ``cpu_kernel.DYNAMIC_ROWS`` rows,
    not on the CPU, a gradient to record, or no kernel). ``dcmha.ops`` calls it for eager
    PyTorch: a small matrix-vector product enters an OpenMP parallel region, which costs
    more than the kernel's whole computation for a decoding step."""
    import torch

    lib = None if x2.shape[0] > cpu_kernel.DYNAMIC_ROWS else _kernel_for(
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
        import torch
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
    float32, ``dynamic_weights``' conditions, or the first call with these weights."""
    import torch

    arrays = [w for w in (x2, kernel, bias, dw1, qkw, dd) if w is not None]
    if (not FUSED_PROJECTION or x2.shape[0] > cpu_kernel.DYNAMIC_ROWS
            or any(a.dtype != torch.float32 for a in arrays)):
        return None
    lib = _kernel_for(*arrays)
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
