"""Fused DCMHA attention in plain PyTorch (CPU-first), with its plain reference.

``dcmha_attention`` computes, per batch b and composition group g,

    a  = q k^T * scale                          (M, T, S) for the M heads of g
    A  = Compose(a; pre)                        pre-composition, before masking
    P  = masked_softmax(A)                      float32; fully masked row -> 0
    P' = mask * Compose(P; post)                post-composition, masked -> exactly 0
    o  = P' v

(``spec/SPEC.md`` sections 6-7) as one ``torch.autograd.Function`` whose
forward and backward run over blocks of ``block_q`` queries. A block reads
only the keys a causal mask or sliding window leaves visible to it and holds
whole rows, so the softmax needs no running statistics. Nothing of size
(B, N, T, S) is kept for the backward: it saves q, k, v and the compose terms
and recomputes each block's scores, compositions and probabilities (the
forward's own ops, so bit for bit the forward's values), then applies the
backward of ``spec/reference_grad.py``: compose backward, masked-softmax
backward ``P * (dP - sum(P dP))``.

Layout. q, k, v, o and their gradients stay (B, L, N, e) (no transposing
copy); a block is a (B, t, N, s) view whose storage is head-major
(B, N, t, s) as the score GEMM writes it, or row-major (B, t, N, s) after a
query-side compose:

* q k^T, P' v, dO v^T, dS k and dS^T q are one batched GEMM over the N heads
  per batch element, reading strided views (the scale is the GEMMs' alpha);
* the residual, the static term and the query-side terms fold into one
  block-diagonal (N, N) matrix per query, built once outside the Function
  with autograd ops, applied as one batched GEMM over the block's rows; its
  gradient is one GEMM too (dW[n, m] = sum_s g[n, s] x[m, s]);
* key-side terms (rank R, gating; per key s) are broadcast multiply-adds
  along s, their gradients reductions over the block's queries;
* the softmax and its backward run along the contiguous last axis.

On CPU the two preceding items (the whole compose of a block and its
backward) run as one compiled C pass over the block instead
(``cpu_kernel``, built on first use when a C compiler is present). At B=2,
T=1024, N=8, causal, the composes then cost 8 instead of 17 ms of the forward
and 42 instead of 85 ms of forward + backward
(``benchmarks/torch_compose_kernel.py``). The separate PyTorch ops stay as
the fallback (no compiler, other devices, ``DCMHA_CPU_KERNEL=0``).

Masked entries get ``dcmha.spec.terms.MASKED_SCORE`` (-1e30) added before
the softmax (only in the key columns a block's mask can hide: the diagonal
band for causal attention), so their probabilities are exactly 0, and so
are their composed values (compose mixes heads at a fixed (t, s)); rows
without a visible key are zeroed after the softmax, so they output 0 and
pass no gradient.

CPU specifics: the block temporaries live in per-thread workspace buffers
reused across blocks and calls (fresh ones cost a page fault per 4 KiB), and
blocks run on ``torch.get_num_threads()`` threads with single-threaded ops
(``_run_blocks``) rather than every op being split across threads.

Everything is computed in float32 whatever the input dtype; ``o`` is
returned in q's dtype.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import os
import threading
from typing import Mapping, Optional

import torch

from dcmha import call as dcall
from dcmha.spec import terms as spec_terms

from .. import cpu_kernel, kernel_call, torch_common
from . import is_available  # noqa: F401  (re-exported)

__all__ = ["dcmha_attention", "dcmha_attention_reference", "default_block_q", "is_available"]

#: The names a ``pre`` / ``post`` dict may hold (``dcmha.spec.terms``).
TERM_NAMES = spec_terms.TERM_NAMES
# The masked-score fill: exp() of it is exactly 0, and no inf - inf appears.
_NEG = spec_terms.MASKED_SCORE
# Target size of one (B, t, N, S) float32 block (see ``default_block_q``).
_BLOCK_BYTES = 4 * 2 ** 20
# Most threads the block loop uses (see ``_run_blocks``).
_MAX_WORKERS = int(os.environ.get("DCMHA_TORCH_WORKERS", "64"))


@dataclasses.dataclass(frozen=True)
class _Problem(torch_common.Problem):
    """Sizes and switches of one call (everything besides the arrays), and the block size."""

    block_q: int


def default_block_q(batch: int, num_heads: int, key_length: int) -> int:
    """Queries per block: a (B, block, N, S) float32 block of about 4 MiB (16 to 256).

    Measured on CPU (B=2, N=8, T=S=1024, one thread): 64 to 128 queries per
    block are the fastest; 16 queries make the per-op overhead dominate (1.4x
    slower training step), and the per-element cost of the elementwise passes
    hardly depends on the block size once it is past a few hundred KiB.
    (``dcmha.call.block_rows``, the rule of ``dcmha.ops.auto_query_chunk_size``,
    capped at 256 queries.)
    """
    return dcall.block_rows(batch, num_heads, key_length, _BLOCK_BYTES, largest=256)


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------

def _check(q, k, v, num_groups, pre, post, mask, causal, sliding_window, scale, query_offset,
           block_q):
    """Validate the arguments of ``dcmha_attention``; return (the call, the problem)."""
    call = torch_common.check_call(q, k, v, num_groups=num_groups, pre=pre, post=post, mask=mask,
                                   causal=causal, sliding_window=sliding_window,
                                   query_offset=query_offset)
    dcall.check_positive_int("block_q", block_q, allow_none=True)
    bq = default_block_q(call.B, call.N, call.S) if block_q is None else block_q
    return call, _Problem(**torch_common.Problem.fields(call, scale),
                          block_q=max(1, min(bq, max(call.T, 1))))


# ---------------------------------------------------------------------------
# Inputs of the Function (autograd ops on small tensors)
# ---------------------------------------------------------------------------

def _prepare_qkv(q, k, v, pb: _Problem):
    """Float32 (B, T, N, d) queries and (B, S, N, e) keys / values (the scale is applied
    by the score GEMMs).

    The layouts stay the callers' (no transposing copy): a block's GEMMs read
    the heads of one batch element as strided matrices. With GQA the key /
    value heads are repeated to N heads (query head h reads kv head h // rep).
    """
    rep = pb.N // pb.N_kv
    f32 = torch.float32
    q3 = q.to(f32).contiguous()

    def heads(x):
        x = x.to(f32)
        return (x if rep == 1 else x.repeat_interleave(rep, dim=2)).contiguous()

    return q3, heads(k), heads(v)


def _prepare_stage(stage: Optional[Mapping], pb: _Problem):
    """The Function's float32 inputs for one stage: (wq, kw1, kw2, kdd), None where absent.

    wq (B, T, N, N) folds the residual, the static term and the query-side
    terms: the query-side part of Compose is out[n] = sum_m wq[n, m] x[m]
    (``dcmha.ops.compose_matrices``), block-diagonal over the G groups (a
    dense N x N matrix per query keeps it one GEMM per block). Without
    query-side and static terms it is None and the residual is implicit.
    kw1, kw2 (B, G, R, M, S) and kdd (B, G, M, S) are the key-side terms with
    the key axis last.
    """
    if not stage:
        return (None,) * 4
    f = {n: None if stage.get(n) is None else stage[n].to(torch.float32) for n in TERM_NAMES}
    B, T, G, M = pb.B, pb.T, pb.G, pb.M
    wq = None
    if f["qw1"] is not None or f["qdd"] is not None or f["static"] is not None:
        device = next(x for x in f.values() if x is not None).device
        wq = torch.eye(M, dtype=torch.float32, device=device).expand(B, T, G, M, M)
        if f["static"] is not None:
            wq = wq + f["static"].transpose(-1, -2)
        if f["qw1"] is not None:
            wq = wq + torch.einsum("btgrm,btgrn->btgnm", f["qw1"], f["qw2"])
        if f["qdd"] is not None:
            wq = wq + torch.diag_embed(f["qdd"])
        if G == 1:
            wq = wq.reshape(B, T, M, M).contiguous()
        else:
            # (B, T, G, M, M) -> block-diagonal (B, T, N, N): one GEMM per query row.
            eye_g = torch.eye(G, dtype=torch.float32, device=device)
            wq = torch.einsum("btgnm,gh->btgnhm", wq.expand(B, T, G, M, M), eye_g)
            wq = wq.reshape(B, T, G * M, G * M).contiguous()
    kw1 = kw2 = kdd = None
    if f["kw1"] is not None:
        kw1 = f["kw1"].permute(0, 2, 3, 4, 1).contiguous()
        kw2 = f["kw2"].permute(0, 2, 3, 4, 1).contiguous()
    if f["kdd"] is not None:
        kdd = f["kdd"].permute(0, 2, 3, 1).contiguous()
    return wq, kw1, kw2, kdd


# ---------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------

def _visibility(pb: _Problem, mask, t0, t1, s0, s1, device):
    """What a block must mask: (fills, empty).

    fills: [(a, bias)] with bias (B|1, t, 1, n) float32, -1e30 where key a + j
    is hidden from the query and 0 elsewhere (added to the scores: faster than
    a masked fill); empty: None, or (B|1, t) bool, True for the queries that
    see no key at all.
    """
    off = pb.offset
    if mask is None and pb.window is None:
        if not pb.causal:
            return [], None
        a = max(s0, t0 + off + 1)        # keys before a are visible to every query here
        if a >= s1:
            return [], None
        t = torch.arange(t0 + off, t1 + off, device=device)[:, None]
        s = torch.arange(a, s1, device=device)[None, :]
        # s0 == 0 here and query t sees key 0 (offset >= 0): no empty row.
        return [(a, _bias(s > t)[None, :, None, :])], None
    t = torch.arange(t0 + off, t1 + off, device=device)[:, None]
    s = torch.arange(s0, s1, device=device)[None, :]
    vis = spec_terms.visible(t, s, causal=pb.causal, window=pb.window)
    vis = None if vis is True else vis[:, None, :]                    # (t, 1, s)
    if mask is not None:
        m = mask
        if m.shape[1] != 1:
            m = m[:, t0:t1]
        if m.shape[2] != 1:
            m = m[:, :, s0:s1]
        m = m.transpose(0, 1)                                         # (t|1, B|1, s|1)
        vis = m if vis is None else vis & m
    vis = vis.expand(t1 - t0, vis.shape[1], s1 - s0)
    if bool(vis.all()):
        return [], None
    seen = vis.any(-1)
    empty = None if bool(seen.all()) else ~seen.transpose(0, 1)
    return [(s0, _bias(~vis).transpose(0, 1)[:, :, None, :])], empty


def _bias(hidden):
    """-1e30 where ``hidden``, else 0 (float32)."""
    return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device).masked_fill_(
        hidden, _NEG)


def _blocks(pb: _Problem, mask, device):
    """(t0, t1, s0, s1, fills, empty) per query block; s1 <= s0 when it sees no key."""
    for t0 in range(0, pb.T, pb.block_q):
        t1 = min(pb.T, t0 + pb.block_q)
        s0, s1 = spec_terms.key_range(t0, t1, pb.S, causal=pb.causal, window=pb.window,
                                      offset=pb.offset)
        if s1 <= s0 or pb.B == 0:
            yield t0, t1, s0, s0, None, None          # nothing to compute
            continue
        fills, empty = _visibility(pb, mask, t0, t1, s0, s1, device)
        yield t0, t1, s0, s1, fills, empty


class _Workspace:
    """Reusable float32 buffers for the block loop, kept per thread and device.

    Every block needs the same few temporaries; allocating them afresh costs a
    page fault per 4 KiB on CPU (tens of thousands per call) and cold caches.
    ``take`` returns a contiguous view of a cached flat buffer (grown on
    demand); a name is reused only once its previous view is dead.

    The buffers are normal tensors whatever the grad mode of the call that
    allocates them: one allocated under ``torch.inference_mode`` would be an
    inference tensor, which a later call outside inference mode (on whichever
    thread runs its blocks) could not update in place.
    """

    _local = threading.local()
    # float32 elements kept per thread (64 MiB; the default 4 MiB blocks need
    # about 40 MiB); beyond that, buffers are allocated per use.
    _MAX_CACHED = 16 * 2 ** 20

    def __init__(self, device):
        self.device = device
        cache = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = {}
        self.cache = cache

    def take(self, name, *shape):
        n = math.prod(shape)
        key = (self.device, name)
        buf = self.cache.get(key)
        if buf is None or buf.numel() < n:
            old = 0 if buf is None else buf.numel()
            with torch.inference_mode(False):     # a normal tensor (see the class doc)
                buf = torch.empty(max(n, 1), dtype=torch.float32, device=self.device)
            kept = sum(b.numel() for b in self.cache.values()) - old
            if kept + n <= self._MAX_CACHED:
                self.cache[key] = buf
            elif old:
                del self.cache[key]
        return buf[:n].view(shape)

    def free(self, held, *names):
        """The first of ``names`` whose buffer does not hold the tensor ``held``."""
        ptr = held.untyped_storage().data_ptr()
        for name in names:
            buf = self.cache.get((self.device, name))
            if buf is None or buf.untyped_storage().data_ptr() != ptr:
                return name
        raise AssertionError("no free workspace buffer")   # pragma: no cover


def _rows(x):
    """The storage of a block view x (B, t, N, s): ("rm", x) or ("hm", (B, N, t, s) view)."""
    if x.is_contiguous():
        return "rm", x
    xt = x.transpose(1, 2)
    if xt.is_contiguous():
        return "hm", xt
    return "rm", x.contiguous()      # pragma: no cover - every block view is one of the two


def _per_head(x):
    """[(b, (N, t, s) matrices of batch b of the block view x)], one GEMM call each."""
    return [(b, x[b].transpose(0, 1)) for b in range(x.shape[0])]


def _heads(y, b, l0, l1):
    """Rows l0:l1 of batch b of a (B, L, N, e) tensor as (N, l, e) strided matrices."""
    return y[b, l0:l1].transpose(0, 1)


def _scores(q3, k3, scale, ws, name, t0, t1, s0, s1):
    """scale * q k^T of a block as a (B, t, N, s) view of a head-major (B, N, t, s) buffer."""
    B, N = q3.shape[0], q3.shape[2]
    x = ws.take(name, B, N, t1 - t0, s1 - s0)
    for b in range(B):
        x[b].baddbmm_(_heads(q3, b, t0, t1), _heads(k3, b, s0, s1).transpose(1, 2),
                      beta=0, alpha=scale)
    return x.transpose(1, 2)


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
        cpu_kernel.compose_forward(lib, x, out, _block_terms(st, t0, t1, s0, s1), G, pb.R)
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
                                           _block_terms(dst, t0, t1, s0, s1), G, pb.R)
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


# ---------------------------------------------------------------------------
# Forward and backward
# ---------------------------------------------------------------------------

_POOL = None               # (pid, ThreadPoolExecutor): a forked child makes its own
_POOL_LOCK = threading.Lock()


def _workers(device, n_blocks):
    """How many threads run the blocks (see ``_run_blocks``): 1 off CPU."""
    if n_blocks <= 1 or device.type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), n_blocks, _MAX_WORKERS))


def _pool(size):
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid() or _POOL[1]._max_workers < size:
            _POOL = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
                size, thread_name_prefix="dcmha-torch"))
        return _POOL[1]


def _run_blocks(blocks, work, workers):
    """Run ``work(block, slot)`` for every block on ``workers`` threads.

    Block-level parallelism instead of intra-op parallelism: each thread runs
    single-threaded ops and takes the next block from a shared queue (largest
    first). An intra-op parallel op waits for its slowest thread at each of
    the hundreds of mostly memory-bound ops of a call. Measured on the shared
    2-core development machine (one DCMHA layer, B=2, T=1024, D=512, N=8):
    training step 1.7x and forward 1.8x faster than intra-op threads while the
    machine was otherwise quiet; about the same (forward 1.17x) while other
    jobs kept both cores busy.
    ``slot`` (0 .. workers-1) names the thread, for per-thread accumulators.
    The calling thread is one of the workers; the caller's intra-op thread
    count is restored afterwards (other threads of the process see 1 while the
    blocks run).
    """
    if workers <= 1:
        for blk in blocks:
            work(blk, 0)
        return
    pool = _pool(workers - 1)
    queue = collections.deque(sorted(blocks, key=lambda b: -(b[1] - b[0]) * (b[3] - b[2])))
    previous = torch.get_num_threads()
    inference = torch.is_inference_mode_enabled()   # grad and inference modes are per thread
    failed = []

    def run(slot):
        torch.set_num_threads(1)
        with torch.inference_mode() if inference else torch.no_grad():
            while not failed:
                try:
                    blk = queue.popleft()
                except IndexError:
                    return
                try:
                    work(blk, slot)
                except BaseException:
                    failed.append(True)     # the others stop at their next block
                    raise

    futures = [pool.submit(run, slot) for slot in range(1, workers)]
    try:
        run(0)
    finally:
        concurrent.futures.wait(futures)
        torch.set_num_threads(previous)
    for f in futures:
        f.result()


def _forward(pb: _Problem, mask, q3, k3, v3, pre, post, want_scores):
    B, N, T, S, d_v = pb.B, pb.N, pb.T, pb.S, pb.d_v
    device = q3.device
    o = torch.empty(B, T, N, d_v, dtype=torch.float32, device=device)
    scores = (torch.zeros(B, N, T, S, dtype=torch.float32, device=device) if want_scores
              else None)

    def work(blk, slot):
        t0, t1, s0, s1, fills, empty = blk
        ws = _Workspace(device)
        x = _scores(q3, k3, pb.scale, ws, "x", t0, t1, s0, s1)
        y, _ = _compose(x, pre, pb, ws, "y", "h", t0, t1, s0, s1, inplace=True)
        p = _probabilities(y, fills, empty, s0, ws, ws.free(y, "x", "y"))
        p2, _ = _compose(p, post, pb, ws, ws.free(p, "y", "x"), "h", t0, t1, s0, s1,
                         inplace=True)
        if scores is not None:
            scores[:, :, t0:t1, s0:s1] = p2.transpose(1, 2)
        for b, ph in _per_head(p2):       # in place on the strided view: no copy
            _heads(o, b, t0, t1).baddbmm_(ph, _heads(v3, b, s0, s1), beta=0)

    blocks = []
    for blk in _blocks(pb, mask, device):
        if blk[3] > blk[2]:
            blocks.append(blk)
        else:                                       # no visible key: the rows are 0
            o[:, blk[0]:blk[1]] = 0.0
    _run_blocks(blocks, work, _workers(device, len(blocks)))
    return o, scores


def _backward(pb: _Problem, mask, q3, k3, v3, pre, post, do3, dscores, needs):
    dq3 = torch.empty_like(q3)
    dk3, dv3 = torch.zeros_like(k3), torch.zeros_like(v3)
    d_pre = [None if x is None else torch.zeros_like(x) for x in pre]
    d_post = [None if x is None else torch.zeros_like(x) for x in post]
    device = q3.device
    blocks = []
    for blk in _blocks(pb, mask, device):
        if blk[3] > blk[2]:
            blocks.append(blk)
        else:
            dq3[:, blk[0]:blk[1]] = 0.0
    workers = _workers(device, len(blocks))
    # Gradients indexed by key (dk, dv, key-side terms) get one accumulator per
    # thread; those indexed by query (dq, wq) are written by one block each.
    shared = [dk3, dv3] + d_pre[1:] + d_post[1:]
    accumulators = [shared] + [None] * (workers - 1)

    def work(blk, slot):
        t0, t1, s0, s1, fills, empty = blk
        if accumulators[slot] is None:
            accumulators[slot] = [None if g is None else torch.zeros_like(g) for g in shared]
        acc = accumulators[slot]
        dk_acc, dv_acc = acc[0], acc[1]
        dpre = [d_pre[0]] + acc[2:5]
        dpost = [d_post[0]] + acc[5:8]
        ws = _Workspace(device)
        x = _scores(q3, k3, pb.scale, ws, "bx", t0, t1, s0, s1)     # kept for pre's backward
        y, h_pre = _compose(x, pre, pb, ws, "by", "bh_pre", t0, t1, s0, s1, inplace=False)
        p = _probabilities(y, fills, empty, s0, ws, "bp")           # y may be x (no pre terms)
        p2, h_post = _compose(p, post, pb, ws, "by", "bh_post", t0, t1, s0, s1,
                              inplace=False)
        if needs["v"]:
            for b, ph in _per_head(p2):
                _heads(dv_acc, b, s0, s1).baddbmm_(ph.transpose(1, 2), _heads(do3, b, t0, t1))
        B, N, t, s = pb.B, pb.N, t1 - t0, s1 - s0
        dp2 = ws.take("bdp2", B, N, t, s)
        for b in range(B):
            torch.bmm(_heads(do3, b, t0, t1), _heads(v3, b, s0, s1).transpose(1, 2),
                      out=dp2[b])
        if dscores is not None:
            # scores = mask * P'; hidden entries of dP' do not matter (P is 0 there).
            dp2 += dscores[:, :, t0:t1, s0:s1]
        dp2 = dp2.transpose(1, 2)
        dp = _compose_backward(p, dp2, h_post, post, dpost, pb, ws, "by", t0, t1, s0, s1)
        da = _softmax_backward(dp, p, ws, "bda")
        dx = _compose_backward(x, da, h_pre, pre, dpre, pb, ws, "by", t0, t1, s0, s1)
        for b, dh in _per_head(dx):
            if needs["q"]:
                _heads(dq3, b, t0, t1).baddbmm_(dh, _heads(k3, b, s0, s1), beta=0,
                                                alpha=pb.scale)
            if needs["k"]:
                _heads(dk_acc, b, s0, s1).baddbmm_(dh.transpose(1, 2), _heads(q3, b, t0, t1),
                                                   alpha=pb.scale)

    _run_blocks(blocks, work, workers)
    for acc in accumulators[1:]:
        if acc is not None:
            for total, part in zip(shared, acc):
                if total is not None:
                    total += part
    return dq3, dk3, dv3, d_pre, d_post


class _DCMHAFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, pb, want_scores, mask, q3, k3, v3, *stages):
        pre, post = stages[:4], stages[4:]
        o, scores = _forward(pb, mask, q3, k3, v3, pre, post, want_scores)
        ctx.pb, ctx.mask = pb, mask
        ctx.save_for_backward(q3, k3, v3, *stages)
        return (o, scores) if want_scores else o

    @staticmethod
    def backward(ctx, do, dscores=None):
        q3, k3, v3, *stages = ctx.saved_tensors
        needs = dict(q=ctx.needs_input_grad[3], k=ctx.needs_input_grad[4],
                     v=ctx.needs_input_grad[5])
        dq3, dk3, dv3, d_pre, d_post = _backward(
            ctx.pb, ctx.mask, q3, k3, v3, stages[:4], stages[4:], do.contiguous(),
            None if dscores is None else dscores.contiguous(), needs)
        grads = [None if not need else g
                 for g, need in zip(d_pre + d_post, ctx.needs_input_grad[6:])]
        return (None, None, None, dq3 if needs["q"] else None, dk3 if needs["k"] else None,
                dv3 if needs["v"] else None, *grads)


def dcmha_attention(q, k, v, *, num_groups, pre=None, post=None, mask=None, causal=False,
                    sliding_window=None, scale=None, query_offset=0, block_q=None,
                    return_attention_scores=False):
    """Fused DCMHA attention (plain PyTorch), differentiable w.r.t. q, k, v and every term.

    Args:
      q: (B, T, N, d); k: (B, S, N_kv, d); v: (B, S, N_kv, d_v), already projected,
        normalised and rotated; one dtype among float32 / float16 / bfloat16 / float64
        (computed in float32). Query head h reads key/value head h // (N / N_kv).
      num_groups: G, the composition groups; each mixes M = N / G heads.
      pre, post: None (stage off) or a dict with any of "qw1", "qw2" (B, T, G, R, M),
        "kw1", "kw2" (B, S, G, R, M), "qdd" (B, T, G, M), "kdd" (B, S, G, M),
        "static" (G, M, M); an absent key switches that term off.
      mask: None or bool, broadcastable to (B, T, S), True = attend.
      causal: attend to keys s <= t + query_offset.
      sliding_window: None or W: attend to keys with |t + query_offset - s| < W.
      scale: score scale, default 1 / sqrt(d).
      query_offset: absolute position of query 0 (decoding).
      block_q: queries per block (default ``default_block_q``); results do not
        depend on it beyond rounding.
      return_attention_scores: also return the masked post-composed probabilities
        (B, N, T, S) in q's dtype (materialised; differentiable).

    Returns:
      o: (B, T, N, d_v) in q's dtype. Fully masked query rows give zeros. With
      ``return_attention_scores``, (o, scores).
    """
    call, pb = _check(q, k, v, num_groups, pre, post, mask, causal, sliding_window, scale,
                      query_offset, block_q)
    q3, k3, v3 = _prepare_qkv(q, k, v, pb)
    stages = _prepare_stage(call.pre, pb) + _prepare_stage(call.post, pb)
    out = _DCMHAFunction.apply(pb, bool(return_attention_scores), kernel_call.shared_mask(mask),
                               q3, k3, v3, *stages)
    o, p = out if return_attention_scores else (out, None)
    o = o.to(q.dtype)
    return (o, p.to(q.dtype)) if return_attention_scores else o


# ---------------------------------------------------------------------------
# The plain reference (materialises (B, N, T, S); for tests and reading)
# ---------------------------------------------------------------------------

def dcmha_attention_reference(q, k, v, *, num_groups, pre=None, post=None, mask=None,
                              causal=False, sliding_window=None, scale=None, query_offset=0,
                              block_q=None, return_attention_scores=False):
    """``dcmha_attention`` in plain PyTorch ops (float32), differentiable by autograd
    (``torch_common.attention_reference``, shared with the Triton kernel).

    Same arguments and result; ``block_q`` is ignored. Materialises
    (B, N, T, S): for tests and small problems.
    """
    return torch_common.attention_reference(
        q, k, v, num_groups=num_groups, pre=pre, post=post, mask=mask, causal=causal,
        sliding_window=sliding_window, scale=scale, query_offset=query_offset,
        return_attention_scores=return_attention_scores)
