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
(``blocks._run_blocks``) rather than every op being split across threads.

Modules: this one holds the API, the argument checks, the Function's inputs
and its forward and backward over the blocks; ``blocks`` the block loop
(visibility, workspace buffers, the score GEMM, the threads); ``compose`` a
block's compose and masked softmax, forward and backward (C kernel or
PyTorch ops).

Everything is computed in float32 whatever the input dtype; ``o`` is
returned in q's dtype.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from dcmha.call import block_rows, check_positive_int
from dcmha.spec import terms as spec_terms

from .. import kernel_call, torch_common
from . import is_available  # noqa: F401  (re-exported)
from .blocks import (_Problem, _Workspace, _batched, _blocks, _bn, _bn_rows, _heads, _per_head,
                     _put_rows, _run_blocks, _scores, _workers)
from .compose import (_compose, _compose_backward, _kernel,  # noqa: F401  (_kernel re-exported)
                      _probabilities, _softmax_backward)

__all__ = ["dcmha_attention", "dcmha_attention_reference", "default_block_q", "is_available"]

#: The names a ``pre`` / ``post`` dict may hold (``dcmha.spec.terms``).
TERM_NAMES = spec_terms.TERM_NAMES
# Target size of one (B, t, N, S) float32 block (see ``default_block_q``).
_BLOCK_BYTES = 4 * 2 ** 20


def default_block_q(batch: int, num_heads: int, key_length: int) -> int:
    """Queries per block: a (B, block, N, S) float32 block of about 4 MiB (16 to 256).

    Measured on CPU (B=2, N=8, T=S=1024, one thread): 64 to 128 queries per
    block are the fastest; 16 queries make the per-op overhead dominate (1.4x
    slower training step), and the per-element cost of the elementwise passes
    hardly depends on the block size once it is past a few hundred KiB.
    (``dcmha.call.block_rows``, the rule of ``dcmha.ops.auto_query_chunk_size``,
    capped at 256 queries.)
    """
    return block_rows(batch, num_heads, key_length, _BLOCK_BYTES, largest=256)


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------

def _check(q, k, v, num_groups, pre, post, mask, causal, sliding_window, scale, query_offset,
           block_q):
    """Validate the arguments of ``dcmha_attention``; return (the call, the problem)."""
    call = torch_common.check_call(q, k, v, num_groups=num_groups, pre=pre, post=post, mask=mask,
                                   causal=causal, sliding_window=sliding_window,
                                   query_offset=query_offset)
    check_positive_int("block_q", block_q, allow_none=True)
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
# Forward and backward
# ---------------------------------------------------------------------------

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
        if _batched(t1 - t0, s1 - s0):
            _put_rows(o, t0, t1, torch.bmm(_bn(p2), _bn_rows(v3, s0, s1)))
            return
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
        B, N, t, s = pb.B, pb.N, t1 - t0, s1 - s0
        batched = _batched(t, s)
        rows = (_bn_rows(q3, t0, t1), _bn_rows(k3, s0, s1)) if batched else None
        x = _scores(q3, k3, pb.scale, ws, "bx", t0, t1, s0, s1, rows)  # kept for pre's backward
        y, h_pre = _compose(x, pre, pb, ws, "by", "bh_pre", t0, t1, s0, s1, inplace=False)
        p = _probabilities(y, fills, empty, s0, ws, "bp")           # y may be x (no pre terms)
        p2, h_post = _compose(p, post, pb, ws, "by", "bh_post", t0, t1, s0, s1,
                              inplace=False)
        dp2 = ws.take("bdp2", B, N, t, s)
        if batched:
            do_bn = _bn_rows(do3, t0, t1)
            if needs["v"]:
                _put_rows(dv_acc, s0, s1, torch.bmm(_bn(p2).transpose(1, 2), do_bn),
                          accumulate=True)
            torch.bmm(do_bn, _bn_rows(v3, s0, s1).transpose(1, 2), out=dp2.view(B * N, t, s))
        else:
            if needs["v"]:
                for b, ph in _per_head(p2):
                    _heads(dv_acc, b, s0, s1).baddbmm_(ph.transpose(1, 2),
                                                       _heads(do3, b, t0, t1))
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
        if batched:
            dx_bn = _bn(dx)
            if needs["q"]:
                _put_rows(dq3, t0, t1, torch.bmm(dx_bn, rows[1]).mul_(pb.scale))
            if needs["k"]:
                _put_rows(dk_acc, s0, s1, torch.bmm(dx_bn.transpose(1, 2),
                                                    rows[0]).mul_(pb.scale),
                          accumulate=True)
            return
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
    """The fused attention as one autograd node: ``_forward`` over the blocks, saving only
    q, k, v and the compose terms; ``_backward`` recomputes each block and returns the
    gradients of the inputs that need them."""

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
