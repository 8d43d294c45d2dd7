"""Fused DCMHA attention in Triton (PyTorch), with its plain PyTorch reference.

``dcmha_attention`` computes the attention step of ``spec/SPEC.md`` (sections 6-7,
written out in ``dcmha.backends.torch_native.dcmha_torch``'s docstring: scores,
pre-composition, masked float32 softmax, post-composition zeroed where masked, P v)
without materialising any (B, N, T, S) array. A program owns one
(b, g, query block) and holds the tile of all M heads of its group,
(M, BLOCK_T, BLOCK_S): composition mixes heads at a fixed (t, s), query-wise
terms are local to the query block and key-wise terms to the key block, so
each tile has everything it needs.

Because post-composition mixes *normalised* probabilities across heads, the
forward makes two passes over the key blocks: the first finds each head's
row log-sum-exp of the pre-composed scores, the second recomputes the scores,
normalises them with it, post-composes and accumulates P' v. Without a post
stage one online-softmax pass suffices (FlashAttention's).

The backward recomputes in the same tiling with the math of
``spec/reference_grad.py``. With dP = Compose^T(mask * dO v^T; post) the
softmax backward needs delta[n, t] = sum_s P[n, t, s] dP[n, t, s], a reduction
over all key blocks: the query-block kernel computes it in a first pass, then
accumulates dq and the query-side and static weight gradients; a key-block
kernel then accumulates dk, dv and the key-side weight gradients. Without a
post stage delta = rowsum(dO * o), as in FlashAttention.

Every dot product runs in float32 (``input_precision="ieee"``), whatever the
input dtype: composed probabilities are not rounded to 16 bits before P' v.

The kernels run compiled on CUDA tensors, or on CPU tensors through Triton's
interpreter when ``TRITON_INTERPRET=1`` is set before Triton is first imported.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch
import triton
import triton.language as tl

from dcmha.spec import terms as spec_terms

from .. import kernel_call, torch_common
from . import is_available  # noqa: F401  (re-exported)

__all__ = ["BlockSizes", "dcmha_attention", "dcmha_attention_reference", "is_available"]

#: The names a ``pre`` / ``post`` dict may hold, in the order the kernels take them
#: (``dcmha.spec.terms``).
TERM_NAMES = spec_terms.TERM_NAMES
# Bits of the per-stage TERMS constant of the kernels.
_QW, _KW, _QDD, _KDD, _STATIC = 1, 2, 4, 8, 16
# The masked-score fill (``dcmha.spec.terms.MASKED_SCORE``), also the running max's
# start: finite, so exp() and subtraction stay free of inf - inf.
_NEG = tl.constexpr(spec_terms.MASKED_SCORE)
# Input dtypes of the kernels (no float64: tl.dot has none).
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the kernels.

    block_q: queries per tile (BLOCK_T); block_k: keys per tile (BLOCK_S).
    Both are powers of two; compiled (GPU) runs need at least 16 (``tl.dot``).
    num_warps / num_stages are passed to compiled launches only.
    """

    block_q: int = 16
    block_k: int = 16
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        for name in ("block_q", "block_k", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v & (v - 1):
                raise ValueError(
                    f"`{name}` must be a positive power of two. Received: {name}={v!r}")
        if not isinstance(self.num_stages, int) or self.num_stages <= 0:
            raise ValueError(f"`num_stages` must be a positive integer. Received: "
                             f"num_stages={self.num_stages!r}")


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------

@triton.jit
def _key_range(t0, S, OFFSET, WINDOW,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """[lo, hi) of the key positions query block t0 can see (lo block-aligned).

    ``dcmha.spec.terms.key_range`` for queries [t0, t0 + BLOCK_T), written again
    because it runs inside the jitted kernels.
    """
    lo = 0
    hi = S
    if CAUSAL:
        hi = tl.minimum(hi, t0 + BLOCK_T + OFFSET)
    if HAS_WINDOW:
        lo = tl.maximum(lo, t0 + OFFSET - WINDOW + 1)
        hi = tl.minimum(hi, t0 + BLOCK_T - 1 + OFFSET + WINDOW)
    lo = (lo // BLOCK_S) * BLOCK_S
    return lo, hi


@triton.jit
def _query_range(s0, T, OFFSET, WINDOW,
                 CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """[lo, hi) of the query positions that can see key block s0 (lo block-aligned).

    The converse of ``dcmha.spec.terms.key_range`` (same causal / window rule).
    """
    lo = 0
    hi = T
    if CAUSAL:
        lo = tl.maximum(lo, s0 - OFFSET)
    if HAS_WINDOW:
        lo = tl.maximum(lo, s0 - OFFSET - WINDOW + 1)
        hi = tl.minimum(hi, s0 + BLOCK_S - 1 - OFFSET + WINDOW)
    lo = (lo // BLOCK_T) * BLOCK_T
    return lo, hi


@triton.jit
def _valid(b, offs_t, offs_s, T, S, OFFSET, WINDOW, mask_ptr, smb, smt, sms,
           CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr):
    """(1, BLOCK_T, BLOCK_S) True where query t may attend key s."""
    t = offs_t[:, None]
    s = offs_s[None, :]
    inside = (t < T) & (s < S)
    ok = inside
    pos = t + OFFSET
    if CAUSAL:
        ok = ok & (s <= pos)
    if HAS_WINDOW:
        ok = ok & (pos - s < WINDOW) & (s - pos < WINDOW)
    if HAS_MASK:
        user = tl.load(mask_ptr + b * smb + t * smt + s * sms, mask=inside, other=0)
        ok = ok & (user != 0)
    return ok[None, :, :]


@triton.jit
def _compose(x, qw_ptr, kw_ptr, qdd_ptr, kdd_ptr, st_ptr,
             qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok, g, offs_m, m_ok,
             TERMS: tl.constexpr, TRANSPOSE: tl.constexpr, R: tl.constexpr, M: tl.constexpr):
    """Compose (or its transpose) of a (BLOCK_M, BLOCK_T, BLOCK_S) tile over heads.

    out[n] = x[n] + sum_m x[m] W[m, n] (W = I + static + low rank + diag);
    TRANSPOSE applies W^T instead (the backward): static^T, w1 and w2 swapped.
    qw rows r < R hold w1 and R <= r < 2R hold w2; every term reads x.
    """
    out = x
    if TERMS & 16:
        for m in tl.static_range(M):
            xm = tl.sum(tl.where(offs_m[:, None, None] == m, x, 0.0), axis=0)
            if TRANSPOSE:
                w = tl.load(st_ptr + g * M * M + offs_m * M + m, mask=m_ok, other=0.0)
            else:
                w = tl.load(st_ptr + g * M * M + m * M + offs_m, mask=m_ok, other=0.0)
            out += w[:, None, None] * xm[None, :, :]
    if TERMS & 1:
        for r in tl.static_range(R):
            if TRANSPOSE:
                w_in = tl.load(qw_ptr + qw_off + (R + r) * M, mask=q_ok, other=0.0)
                w_out = tl.load(qw_ptr + qw_off + r * M, mask=q_ok, other=0.0)
            else:
                w_in = tl.load(qw_ptr + qw_off + r * M, mask=q_ok, other=0.0)
                w_out = tl.load(qw_ptr + qw_off + (R + r) * M, mask=q_ok, other=0.0)
            out += tl.sum(x * w_in, axis=0)[None, :, :] * w_out
    if TERMS & 2:
        for r in tl.static_range(R):
            if TRANSPOSE:
                w_in = tl.load(kw_ptr + kw_off + (R + r) * M, mask=k_ok, other=0.0)
                w_out = tl.load(kw_ptr + kw_off + r * M, mask=k_ok, other=0.0)
            else:
                w_in = tl.load(kw_ptr + kw_off + r * M, mask=k_ok, other=0.0)
                w_out = tl.load(kw_ptr + kw_off + (R + r) * M, mask=k_ok, other=0.0)
            out += tl.sum(x * w_in, axis=0)[None, :, :] * w_out
    if TERMS & 4:
        out += x * tl.load(qdd_ptr + qdd_off, mask=q_ok, other=0.0)
    if TERMS & 8:
        out += x * tl.load(kdd_ptr + kdd_off, mask=k_ok, other=0.0)
    return out


@triton.jit
def _low_rank_grads(x, y, w_ptr, w_off, w_ok, acc, offs_r, AXIS: tl.constexpr,
                    R: tl.constexpr, M: tl.constexpr):
    """Add this tile's gradients of one side's (w1, w2) to acc (BLOCK_M, L, BLOCK_R).

    x: compose input, y: gradient of compose output, both (BLOCK_M, BLOCK_T, BLOCK_S).
    AXIS = 2 sums over keys (query-side weights), AXIS = 1 over queries.
    dw1[r, m] = sum x[m] (sum_n y[n] w2[r, n]); dw2[r, n] = sum y[n] (sum_m x[m] w1[r, m]).
    """
    for r in tl.static_range(R):
        w1 = tl.load(w_ptr + w_off + r * M, mask=w_ok, other=0.0)
        w2 = tl.load(w_ptr + w_off + (R + r) * M, mask=w_ok, other=0.0)
        hx = tl.sum(x * w1, axis=0)[None, :, :]
        hy = tl.sum(y * w2, axis=0)[None, :, :]
        g1 = tl.sum(x * hy, axis=AXIS)
        g2 = tl.sum(y * hx, axis=AXIS)
        acc += tl.where(offs_r[None, None, :] == r, g1[:, :, None], 0.0)
        acc += tl.where(offs_r[None, None, :] == R + r, g2[:, :, None], 0.0)
    return acc


@triton.jit
def _static_grads(x, y, acc, offs_m, M: tl.constexpr):
    """acc (BLOCK_M, BLOCK_M) += sum_{t,s} x[m] y[n] (the static weights' gradient)."""
    for m in tl.static_range(M):
        xm = tl.sum(tl.where(offs_m[:, None, None] == m, x, 0.0), axis=0)
        row = tl.sum(tl.sum(xm[None, :, :] * y, axis=2), axis=1)
        acc += tl.where(offs_m[:, None] == m, row[None, :], 0.0)
    return acc


@triton.jit
def _pre_composed(q, k_ptr, b, hkv, offs_s, offs_d, m_ok, S, NKV, D, scale,
                  qw, kw, qdd, kdd, st, qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok, g, offs_m,
                  PRE: tl.constexpr, R: tl.constexpr, M: tl.constexpr):
    """Scores a and pre-composed scores A of one tile, both (BLOCK_M, BLOCK_T, BLOCK_S)."""
    kt_ptr = (k_ptr + ((b * S + offs_s[None, None, :]) * NKV + hkv[:, None, None]) * D
              + offs_d[None, :, None])
    kt_ok = m_ok[:, None, None] & (offs_d[None, :, None] < D) & (offs_s[None, None, :] < S)
    kt = tl.load(kt_ptr, mask=kt_ok, other=0.0).to(tl.float32)
    a = tl.dot(q, kt, input_precision="ieee") * scale
    A = a
    if PRE != 0:
        A = _compose(a, qw, kw, qdd, kdd, st, qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok,
                     g, offs_m, m_ok, PRE, False, R, M)
    return a, A


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, p_ptr, mask_ptr, smb, smt, sms,
                pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
                post_qw, post_kw, post_qdd, post_kdd, post_st,
                T, S, N, NKV, G, REP, D, DV, OFFSET, WINDOW, scale,
                M: tl.constexpr, R: tl.constexpr, PRE: tl.constexpr, POST: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                TWO_PASS: tl.constexpr, STORE_P: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One (query block, b * G + g): o (B, T, N, d_v) float32 and lse (B, N, T).

    TWO_PASS must be set with a post stage or STORE_P; STORE_P also writes the
    masked post-composed probabilities to p (B, N, T, S) (attention scores).
    """
    pid_t = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // G
    g = pid_bg % G
    t0 = pid_t * BLOCK_T
    offs_m = tl.arange(0, BLOCK_M)
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < M
    h = g * M + offs_m
    hkv = h // REP
    mm = offs_m[:, None, None]
    tt = offs_t[None, :, None]
    q_ok = m_ok[:, None, None] & (tt < T)                                   # (BM, BT, 1)
    q = tl.load(q_ptr + ((b * T + tt) * N + h[:, None, None]) * D + offs_d[None, None, :],
                mask=q_ok & (offs_d[None, None, :] < D), other=0.0).to(tl.float32)
    qw_off = ((b * T + tt) * G + g) * (2 * R * M) + mm
    qdd_off = ((b * T + tt) * G + g) * M + mm

    lo, hi = _key_range(t0, S, OFFSET, WINDOW, CAUSAL, HAS_WINDOW, BLOCK_T, BLOCK_S)
    m_i = tl.full((BLOCK_M, BLOCK_T), _NEG, tl.float32)
    l_i = tl.zeros((BLOCK_M, BLOCK_T), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_T, BLOCK_DV), tl.float32)
    # Pass 1: row statistics of the pre-composed scores (and, without a post
    # stage, the output itself by online softmax).
    for s0 in range(lo, hi, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        ss = offs_s[None, None, :]
        k_ok = m_ok[:, None, None] & (ss < S)
        kw_off = ((b * S + ss) * G + g) * (2 * R * M) + mm
        kdd_off = ((b * S + ss) * G + g) * M + mm
        a, A = _pre_composed(q, k_ptr, b, hkv, offs_s, offs_d, m_ok, S, NKV, D, scale,
                             pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
                             qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok, g, offs_m, PRE, R, M)
        valid = _valid(b, offs_t, offs_s, T, S, OFFSET, WINDOW, mask_ptr, smb, smt, sms,
                       CAUSAL, HAS_WINDOW, HAS_MASK)
        m_new = tl.maximum(m_i, tl.max(tl.where(valid, A, _NEG), axis=2))
        p = tl.exp(tl.where(valid, A - m_new[:, :, None], _NEG))
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=2)
        m_i = m_new
        if not TWO_PASS:
            v = tl.load(v_ptr + ((b * S + ss.permute(0, 2, 1)) * NKV + hkv[:, None, None]) * DV
                        + offs_dv[None, None, :],
                        mask=k_ok.permute(0, 2, 1) & (offs_dv[None, None, :] < DV),
                        other=0.0).to(tl.float32)
            acc = acc * alpha[:, :, None] + tl.dot(p, v, input_precision="ieee")
    has_row = l_i > 0.0
    lse = tl.where(has_row, m_i + tl.log(tl.where(has_row, l_i, 1.0)), 0.0)
    if not TWO_PASS:
        acc = acc / tl.where(has_row, l_i, 1.0)[:, :, None]
    else:
        # Pass 2: normalise, post-compose, zero masked entries, accumulate P' v.
        for s0 in range(lo, hi, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            ss = offs_s[None, None, :]
            k_ok = m_ok[:, None, None] & (ss < S)
            kw_off = ((b * S + ss) * G + g) * (2 * R * M) + mm
            kdd_off = ((b * S + ss) * G + g) * M + mm
            a, A = _pre_composed(q, k_ptr, b, hkv, offs_s, offs_d, m_ok, S, NKV, D, scale,
                                 pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
                                 qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok, g, offs_m,
                                 PRE, R, M)
            valid = _valid(b, offs_t, offs_s, T, S, OFFSET, WINDOW, mask_ptr, smb, smt, sms,
                           CAUSAL, HAS_WINDOW, HAS_MASK)
            p = tl.exp(tl.where(valid, A - lse[:, :, None], _NEG))
            if POST != 0:
                p = _compose(p, post_qw, post_kw, post_qdd, post_kdd, post_st,
                             qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok, g, offs_m, m_ok,
                             POST, False, R, M)
                p = tl.where(valid, p, 0.0)
            if STORE_P:
                tl.store(p_ptr + ((b * N + h[:, None, None]) * T + tt) * S + ss, p,
                         mask=q_ok & (ss < S))
            v = tl.load(v_ptr + ((b * S + ss.permute(0, 2, 1)) * NKV + hkv[:, None, None]) * DV
                        + offs_dv[None, None, :],
                        mask=k_ok.permute(0, 2, 1) & (offs_dv[None, None, :] < DV), other=0.0)
            acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
    o_off = ((b * T + tt) * N + h[:, None, None]) * DV + offs_dv[None, None, :]
    tl.store(o_ptr + o_off, acc, mask=q_ok & (offs_dv[None, None, :] < DV))
    tl.store(lse_ptr + (b * N + h[:, None]) * T + offs_t[None, :], lse,
             mask=m_ok[:, None] & (offs_t[None, :] < T))


@triton.jit
def _tile_backward(q, do, lse, delta, k_ptr, v_ptr, b, g, hkv, offs_t, offs_s, offs_d, offs_dv,
                   offs_m, m_ok, T, S, NKV, D, DV, OFFSET, WINDOW, scale, mask_ptr, smb, smt, sms,
                   pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
                   post_qw, post_kw, post_qdd, post_kdd, post_st,
                   qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok,
                   M: tl.constexpr, R: tl.constexpr, PRE: tl.constexpr, POST: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                   NEED_P2: tl.constexpr, GRADS: tl.constexpr):
    """Recompute one tile and back-propagate dO through it.

    Returns (a, P, P', dP, dP', dA, da), all (BLOCK_M, BLOCK_T, BLOCK_S): the
    scores, the probabilities, the masked post-composed probabilities (only
    with NEED_P2, else P), the gradients w.r.t. the probabilities and the
    post-compose output, and (only with GRADS, else dP) the gradients w.r.t.
    the pre-composed scores and the scores.
    """
    a, A = _pre_composed(q, k_ptr, b, hkv, offs_s, offs_d, m_ok, S, NKV, D, scale,
                         pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
                         qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok, g, offs_m, PRE, R, M)
    valid = _valid(b, offs_t, offs_s, T, S, OFFSET, WINDOW, mask_ptr, smb, smt, sms,
                   CAUSAL, HAS_WINDOW, HAS_MASK)
    p = tl.exp(tl.where(valid, A - lse[:, :, None], _NEG))
    ss = offs_s[None, None, :]
    vt = tl.load(v_ptr + ((b * S + ss) * NKV + hkv[:, None, None]) * DV + offs_dv[None, :, None],
                 mask=k_ok & (offs_dv[None, :, None] < DV), other=0.0).to(tl.float32)
    dp2 = tl.where(valid, tl.dot(do, vt, input_precision="ieee"), 0.0)
    p2 = p
    dp = dp2
    if POST != 0:
        if NEED_P2:
            p2 = _compose(p, post_qw, post_kw, post_qdd, post_kdd, post_st,
                          qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok, g, offs_m, m_ok,
                          POST, False, R, M)
            p2 = tl.where(valid, p2, 0.0)
        dp = _compose(dp2, post_qw, post_kw, post_qdd, post_kdd, post_st,
                      qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok, g, offs_m, m_ok,
                      POST, True, R, M)
    dA = dp
    da = dp
    if GRADS:
        dA = p * (dp - delta[:, :, None])
        da = dA
        if PRE != 0:
            da = _compose(dA, pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
                          qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok, g, offs_m, m_ok,
                          PRE, True, R, M)
    return a, p, p2, dp, dp2, dA, da


@triton.jit
def _bwd_query_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                      mask_ptr, smb, smt, sms,
                      pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
                      post_qw, post_kw, post_qdd, post_kdd, post_st,
                      d_pre_qw, d_pre_qdd, d_pre_st, d_post_qw, d_post_qdd, d_post_st,
                      T, S, N, NKV, G, REP, D, DV, OFFSET, WINDOW, scale, NUM_TB,
                      M: tl.constexpr, R: tl.constexpr, PRE: tl.constexpr, POST: tl.constexpr,
                      CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr):
    """One (query block, b * G + g): delta (pre-pass), dq, query-side and static grads.

    The static gradients are written per query block, (B, NUM_TB, G, M, M), and
    summed by the caller.
    """
    pid_t = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // G
    g = pid_bg % G
    t0 = pid_t * BLOCK_T
    offs_m = tl.arange(0, BLOCK_M)
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_R)
    m_ok = offs_m < M
    h = g * M + offs_m
    hkv = h // REP
    mm = offs_m[:, None, None]
    tt = offs_t[None, :, None]
    q_ok = m_ok[:, None, None] & (tt < T)
    row = ((b * T + tt) * N + h[:, None, None])
    q = tl.load(q_ptr + row * D + offs_d[None, None, :],
                mask=q_ok & (offs_d[None, None, :] < D), other=0.0).to(tl.float32)
    do = tl.load(do_ptr + row * DV + offs_dv[None, None, :],
                 mask=q_ok & (offs_dv[None, None, :] < DV), other=0.0).to(tl.float32)
    stat_off = (b * N + h[:, None]) * T + offs_t[None, :]
    stat_ok = m_ok[:, None] & (offs_t[None, :] < T)
    lse = tl.load(lse_ptr + stat_off, mask=stat_ok, other=0.0)
    qw_off = ((b * T + tt) * G + g) * (2 * R * M) + mm
    qdd_off = ((b * T + tt) * G + g) * M + mm
    lo, hi = _key_range(t0, S, OFFSET, WINDOW, CAUSAL, HAS_WINDOW, BLOCK_T, BLOCK_S)

    if POST != 0:
        # Pre-pass: delta[n, t] = sum_s P[n, t, s] dP[n, t, s] over every key block.
        delta = tl.zeros((BLOCK_M, BLOCK_T), tl.float32)
        for s0 in range(lo, hi, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            ss = offs_s[None, None, :]
            k_ok = m_ok[:, None, None] & (ss < S)
            kw_off = ((b * S + ss) * G + g) * (2 * R * M) + mm
            kdd_off = ((b * S + ss) * G + g) * M + mm
            a, p, p2, dp, dp2, dA, da = _tile_backward(
                q, do, lse, delta, k_ptr, v_ptr, b, g, hkv, offs_t, offs_s, offs_d, offs_dv,
                offs_m, m_ok, T, S, NKV, D, DV, OFFSET, WINDOW, scale, mask_ptr, smb, smt, sms,
                pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
                post_qw, post_kw, post_qdd, post_kdd, post_st,
                qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok,
                M, R, PRE, POST, CAUSAL, HAS_WINDOW, HAS_MASK, False, False)
            delta += tl.sum(p * dp, axis=2)
        tl.store(delta_ptr + stat_off, delta, mask=stat_ok)
    else:
        delta = tl.load(delta_ptr + stat_off, mask=stat_ok, other=0.0)

    dq = tl.zeros((BLOCK_M, BLOCK_T, BLOCK_D), tl.float32)
    acc_pre_qw = tl.zeros((BLOCK_M, BLOCK_T, BLOCK_R), tl.float32)
    acc_post_qw = tl.zeros((BLOCK_M, BLOCK_T, BLOCK_R), tl.float32)
    acc_pre_qdd = tl.zeros((BLOCK_M, BLOCK_T), tl.float32)
    acc_post_qdd = tl.zeros((BLOCK_M, BLOCK_T), tl.float32)
    acc_pre_st = tl.zeros((BLOCK_M, BLOCK_M), tl.float32)
    acc_post_st = tl.zeros((BLOCK_M, BLOCK_M), tl.float32)
    for s0 in range(lo, hi, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        ss = offs_s[None, None, :]
        k_ok = m_ok[:, None, None] & (ss < S)
        kw_off = ((b * S + ss) * G + g) * (2 * R * M) + mm
        kdd_off = ((b * S + ss) * G + g) * M + mm
        a, p, p2, dp, dp2, dA, da = _tile_backward(
            q, do, lse, delta, k_ptr, v_ptr, b, g, hkv, offs_t, offs_s, offs_d, offs_dv,
            offs_m, m_ok, T, S, NKV, D, DV, OFFSET, WINDOW, scale, mask_ptr, smb, smt, sms,
            pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
            post_qw, post_kw, post_qdd, post_kdd, post_st,
            qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok,
            M, R, PRE, POST, CAUSAL, HAS_WINDOW, HAS_MASK, False, True)
        k = tl.load(k_ptr + ((b * S + ss.permute(0, 2, 1)) * NKV + hkv[:, None, None]) * D
                    + offs_d[None, None, :],
                    mask=k_ok.permute(0, 2, 1) & (offs_d[None, None, :] < D), other=0.0)
        dq += tl.dot(da, k.to(tl.float32), input_precision="ieee")
        if POST & 1:
            acc_post_qw = _low_rank_grads(p, dp2, post_qw, qw_off, q_ok, acc_post_qw, offs_r,
                                          2, R, M)
        if POST & 4:
            acc_post_qdd += tl.sum(p * dp2, axis=2)
        if POST & 16:
            acc_post_st = _static_grads(p, dp2, acc_post_st, offs_m, M)
        if PRE & 1:
            acc_pre_qw = _low_rank_grads(a, dA, pre_qw, qw_off, q_ok, acc_pre_qw, offs_r, 2, R, M)
        if PRE & 4:
            acc_pre_qdd += tl.sum(a * dA, axis=2)
        if PRE & 16:
            acc_pre_st = _static_grads(a, dA, acc_pre_st, offs_m, M)

    tl.store(dq_ptr + row * D + offs_d[None, None, :], dq * scale,
             mask=q_ok & (offs_d[None, None, :] < D))
    qw_store = qw_off + offs_r[None, None, :] * M
    qw_store_ok = q_ok & (offs_r[None, None, :] < 2 * R)
    if PRE & 1:
        tl.store(d_pre_qw + qw_store, acc_pre_qw, mask=qw_store_ok)
    if POST & 1:
        tl.store(d_post_qw + qw_store, acc_post_qw, mask=qw_store_ok)
    qdd_store = ((b * T + offs_t[None, :]) * G + g) * M + offs_m[:, None]
    if PRE & 4:
        tl.store(d_pre_qdd + qdd_store, acc_pre_qdd, mask=stat_ok)
    if POST & 4:
        tl.store(d_post_qdd + qdd_store, acc_post_qdd, mask=stat_ok)
    st_store = ((b * NUM_TB + pid_t) * G + g) * M * M + offs_m[:, None] * M + offs_m[None, :]
    st_ok = m_ok[:, None] & m_ok[None, :]
    if PRE & 16:
        tl.store(d_pre_st + st_store, acc_pre_st, mask=st_ok)
    if POST & 16:
        tl.store(d_post_st + st_store, acc_post_st, mask=st_ok)


@triton.jit
def _bwd_key_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                    mask_ptr, smb, smt, sms,
                    pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
                    post_qw, post_kw, post_qdd, post_kdd, post_st,
                    d_pre_kw, d_pre_kdd, d_post_kw, d_post_kdd,
                    T, S, N, NKV, G, REP, D, DV, OFFSET, WINDOW, scale,
                    M: tl.constexpr, R: tl.constexpr, PRE: tl.constexpr, POST: tl.constexpr,
                    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr):
    """One (key block, b * G + g): per-query-head dk, dv (B, S, N, .) and key-side grads."""
    pid_s = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // G
    g = pid_bg % G
    s0 = pid_s * BLOCK_S
    offs_m = tl.arange(0, BLOCK_M)
    offs_s = s0 + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_R)
    m_ok = offs_m < M
    h = g * M + offs_m
    hkv = h // REP
    mm = offs_m[:, None, None]
    ss = offs_s[None, None, :]
    k_ok = m_ok[:, None, None] & (ss < S)
    kw_off = ((b * S + ss) * G + g) * (2 * R * M) + mm
    kdd_off = ((b * S + ss) * G + g) * M + mm
    lo, hi = _query_range(s0, T, OFFSET, WINDOW, CAUSAL, HAS_WINDOW, BLOCK_T, BLOCK_S)

    dk = tl.zeros((BLOCK_M, BLOCK_S, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_M, BLOCK_S, BLOCK_DV), tl.float32)
    acc_pre_kw = tl.zeros((BLOCK_M, BLOCK_S, BLOCK_R), tl.float32)
    acc_post_kw = tl.zeros((BLOCK_M, BLOCK_S, BLOCK_R), tl.float32)
    acc_pre_kdd = tl.zeros((BLOCK_M, BLOCK_S), tl.float32)
    acc_post_kdd = tl.zeros((BLOCK_M, BLOCK_S), tl.float32)
    for t0 in range(lo, hi, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        tt = offs_t[None, :, None]
        q_ok = m_ok[:, None, None] & (tt < T)
        row = ((b * T + tt) * N + h[:, None, None])
        q = tl.load(q_ptr + row * D + offs_d[None, None, :],
                    mask=q_ok & (offs_d[None, None, :] < D), other=0.0).to(tl.float32)
        do = tl.load(do_ptr + row * DV + offs_dv[None, None, :],
                     mask=q_ok & (offs_dv[None, None, :] < DV), other=0.0).to(tl.float32)
        stat_off = (b * N + h[:, None]) * T + offs_t[None, :]
        stat_ok = m_ok[:, None] & (offs_t[None, :] < T)
        lse = tl.load(lse_ptr + stat_off, mask=stat_ok, other=0.0)
        delta = tl.load(delta_ptr + stat_off, mask=stat_ok, other=0.0)
        qw_off = ((b * T + tt) * G + g) * (2 * R * M) + mm
        qdd_off = ((b * T + tt) * G + g) * M + mm
        a, p, p2, dp, dp2, dA, da = _tile_backward(
            q, do, lse, delta, k_ptr, v_ptr, b, g, hkv, offs_t, offs_s, offs_d, offs_dv,
            offs_m, m_ok, T, S, NKV, D, DV, OFFSET, WINDOW, scale, mask_ptr, smb, smt, sms,
            pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
            post_qw, post_kw, post_qdd, post_kdd, post_st,
            qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok,
            M, R, PRE, POST, CAUSAL, HAS_WINDOW, HAS_MASK, True, True)
        dv += tl.dot(p2.permute(0, 2, 1), do, input_precision="ieee")
        dk += tl.dot(da.permute(0, 2, 1), q, input_precision="ieee")
        if POST & 2:
            acc_post_kw = _low_rank_grads(p, dp2, post_kw, kw_off, k_ok, acc_post_kw, offs_r,
                                          1, R, M)
        if POST & 8:
            acc_post_kdd += tl.sum(p * dp2, axis=1)
        if PRE & 2:
            acc_pre_kw = _low_rank_grads(a, dA, pre_kw, kw_off, k_ok, acc_pre_kw, offs_r, 1, R, M)
        if PRE & 8:
            acc_pre_kdd += tl.sum(a * dA, axis=1)

    s_col = offs_s[None, :, None]
    s_ok = m_ok[:, None, None] & (s_col < S)
    head_row = (b * S + s_col) * N + h[:, None, None]
    tl.store(dk_ptr + head_row * D + offs_d[None, None, :], dk * scale,
             mask=s_ok & (offs_d[None, None, :] < D))
    tl.store(dv_ptr + head_row * DV + offs_dv[None, None, :], dv,
             mask=s_ok & (offs_dv[None, None, :] < DV))
    kw_store = ((b * S + s_col) * G + g) * (2 * R * M) + mm + offs_r[None, None, :] * M
    kw_store_ok = s_ok & (offs_r[None, None, :] < 2 * R)
    if PRE & 2:
        tl.store(d_pre_kw + kw_store, acc_pre_kw, mask=kw_store_ok)
    if POST & 2:
        tl.store(d_post_kw + kw_store, acc_post_kw, mask=kw_store_ok)
    kdd_store = ((b * S + offs_s[None, :]) * G + g) * M + offs_m[:, None]
    kdd_ok = m_ok[:, None] & (offs_s[None, :] < S)
    if PRE & 8:
        tl.store(d_pre_kdd + kdd_store, acc_pre_kdd, mask=kdd_ok)
    if POST & 8:
        tl.store(d_post_kdd + kdd_store, acc_post_kdd, mask=kdd_ok)


# ---------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------

def _interpreting() -> bool:
    """Whether this module's kernels were built for Triton's interpreter.

    Triton fixes that when a kernel is decorated (TRITON_INTERPRET at import).
    """
    return type(_fwd_kernel).__name__ == "InterpretedFunction"


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << max(0, int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class _Problem(torch_common.Problem):
    """Sizes and switches of one call (everything the kernels take besides arrays)."""

    pre_terms: int
    post_terms: int
    blocks: BlockSizes


def _terms(stage: Optional[Mapping]) -> int:
    if not stage:
        return 0
    bits = 0
    for name, bit in (("qw1", _QW), ("kw1", _KW), ("qdd", _QDD), ("kdd", _KDD),
                      ("static", _STATIC)):
        if stage.get(name) is not None:
            bits |= bit
    return bits


def _check(q, k, v, num_groups, pre, post, mask, causal, sliding_window, scale, query_offset,
           block_q, block_k) -> _Problem:
    """Validate the arguments of ``dcmha_attention``; return the problem sizes."""
    call = torch_common.check_call(q, k, v, dtypes=_DTYPES, num_groups=num_groups, pre=pre,
                                   post=post, mask=mask, causal=causal,
                                   sliding_window=sliding_window, query_offset=query_offset)
    blocks = BlockSizes(block_q=16 if block_q is None else block_q,
                        block_k=16 if block_k is None else block_k)
    return _Problem(**torch_common.Problem.fields(call, scale), pre_terms=_terms(call.pre),
                    post_terms=_terms(call.post), blocks=blocks)


def _packed(stage: Optional[Mapping], pb: _Problem, device):
    """The float32 contiguous arrays the kernels read for one stage.

    qw (B, T, G, 2R, M) = [w1; w2] along R, kw (B, S, G, 2R, M), qdd, kdd, static;
    a one-element placeholder for an absent term.
    """
    stage = stage or {}
    dummy = torch.zeros(1, dtype=torch.float32, device=device)

    def f32(x):
        return x.detach().to(torch.float32).contiguous()

    out = []
    for w1, w2 in (("qw1", "qw2"), ("kw1", "kw2")):
        out.append(torch.cat([f32(stage[w1]), f32(stage[w2])], dim=3)
                   if stage.get(w1) is not None else dummy)
    for name in ("qdd", "kdd", "static"):
        out.append(f32(stage[name]) if stage.get(name) is not None else dummy)
    return out


def _mask_args(mask, pb: _Problem, device):
    """(uint8 view of the mask broadcast to (B, T, S), its three strides) or a placeholder."""
    if mask is None:
        return torch.zeros(1, dtype=torch.uint8, device=device), 0, 0, 0
    m = kernel_call.shared_mask(mask).expand(pb.B, pb.T, pb.S)
    m = m.view(torch.uint8)
    return (m,) + tuple(m.stride())


def _launch_args(pb: _Problem):
    bl = pb.blocks
    meta = dict(M=pb.M, R=pb.R, PRE=pb.pre_terms, POST=pb.post_terms, CAUSAL=pb.causal,
                HAS_WINDOW=pb.window is not None, HAS_MASK=None,
                BLOCK_M=_pow2(pb.M), BLOCK_T=bl.block_q, BLOCK_S=bl.block_k,
                BLOCK_D=_pow2(pb.d, 16), BLOCK_DV=_pow2(pb.d_v, 16))
    sizes = (pb.T, pb.S, pb.N, pb.N_kv, pb.G, pb.N // pb.N_kv, pb.d, pb.d_v, pb.offset,
             pb.window or 0, pb.scale)
    if not _interpreting():
        meta.update(num_warps=bl.num_warps, num_stages=bl.num_stages)
    return sizes, meta


def _forward(q, k, v, mask, pre_arrays, post_arrays, pb: _Problem, store_p: bool):
    device = q.device
    o = torch.empty(pb.B, pb.T, pb.N, pb.d_v, dtype=torch.float32, device=device)
    lse = torch.empty(pb.B, pb.N, pb.T, dtype=torch.float32, device=device)
    # Tiles outside the causal / window band are never visited: their scores stay 0.
    p = (torch.zeros(pb.B, pb.N, pb.T, pb.S, dtype=torch.float32, device=device) if store_p
         else torch.zeros(1, dtype=torch.float32, device=device))
    mask_t, smb, smt, sms = _mask_args(mask, pb, device)
    sizes, meta = _launch_args(pb)
    meta.update(HAS_MASK=mask is not None, STORE_P=store_p,
                TWO_PASS=bool(store_p or pb.post_terms))
    grid = (triton.cdiv(pb.T, pb.blocks.block_q), pb.B * pb.G)
    if 0 in grid:   # nothing to compute (B or T is 0)
        return o, lse, (p if store_p else None)
    _fwd_kernel[grid](q, k, v, o, lse, p, mask_t, smb, smt, sms, *pre_arrays, *post_arrays,
                      *sizes, **meta)
    return o, lse, (p if store_p else None)


def _backward(q, k, v, do, o, lse, mask, pre_arrays, post_arrays, pb: _Problem):
    device = q.device
    f32 = dict(dtype=torch.float32, device=device)
    mask_t, smb, smt, sms = _mask_args(mask, pb, device)
    sizes, meta = _launch_args(pb)
    meta.update(HAS_MASK=mask is not None, BLOCK_R=_pow2(2 * pb.R))
    num_tb = triton.cdiv(pb.T, pb.blocks.block_q)
    if pb.post_terms:
        delta = torch.empty(pb.B, pb.N, pb.T, **f32)   # the query kernel's pre-pass fills it
    else:
        # Without post-composition sum_s P dP = dO . o (FlashAttention's identity).
        delta = (do.to(torch.float32) * o).sum(-1).transpose(1, 2).contiguous()

    dummy = torch.zeros(1, **f32)
    B, T, S, G, M = pb.B, pb.T, pb.S, pb.G, pb.M

    def grads_for(terms, arrays):
        # Each kernel writes every element of a present term's gradient.
        out = [torch.empty_like(x) if terms & bit else dummy
               for x, bit in zip(arrays[:4], (_QW, _KW, _QDD, _KDD))]
        out.append(torch.empty(B, num_tb, G, M, M, **f32) if terms & _STATIC else dummy)
        return out

    d_pre = grads_for(pb.pre_terms, pre_arrays)
    d_post = grads_for(pb.post_terms, post_arrays)
    d_pre_st, d_post_st = d_pre[4], d_post[4]
    dq = torch.zeros(pb.B, pb.T, pb.N, pb.d, **f32)
    dk_h = torch.zeros(pb.B, pb.S, pb.N, pb.d, **f32)
    dv_h = torch.zeros(pb.B, pb.S, pb.N, pb.d_v, **f32)
    if pb.B * pb.T * pb.S == 0:   # nothing to compute: every gradient is 0
        d_pre = [None if x is dummy else x.zero_() for x in d_pre]
        d_post = [None if x is dummy else x.zero_() for x in d_post]
        d_pre[4] = None if d_pre[4] is None else d_pre[4].sum((0, 1))
        d_post[4] = None if d_post[4] is None else d_post[4].sum((0, 1))
        return dq, dk_h[:, :, ::pb.N // pb.N_kv], dv_h[:, :, ::pb.N // pb.N_kv], d_pre, d_post

    _bwd_query_kernel[(num_tb, pb.B * pb.G)](
        q, k, v, do, lse, delta, dq, mask_t, smb, smt, sms, *pre_arrays, *post_arrays,
        d_pre[0], d_pre[2], d_pre_st, d_post[0], d_post[2], d_post_st,
        *sizes, num_tb, **meta)
    _bwd_key_kernel[(triton.cdiv(pb.S, pb.blocks.block_k), pb.B * pb.G)](
        q, k, v, do, lse, delta, dk_h, dv_h, mask_t, smb, smt, sms, *pre_arrays, *post_arrays,
        d_pre[1], d_pre[3], d_post[1], d_post[3], *sizes, **meta)
    rep = pb.N // pb.N_kv
    # dk, dv were written per query head; query heads h of one kv head are adjacent.
    dk = dk_h.view(pb.B, pb.S, pb.N_kv, rep, pb.d).sum(3)
    dv = dv_h.view(pb.B, pb.S, pb.N_kv, rep, pb.d_v).sum(3)
    d_pre[4] = d_pre_st.sum((0, 1)) if pb.pre_terms & _STATIC else None
    d_post[4] = d_post_st.sum((0, 1)) if pb.post_terms & _STATIC else None
    return dq, dk, dv, d_pre, d_post


def _unpack_grads(d_arrays, dtypes, R):
    """Gradients of the 7 stage inputs (None where absent) from the packed float32 grads."""
    d_qw, d_kw, d_qdd, d_kdd, d_st = d_arrays
    grads = dict(qw1=lambda: d_qw[..., :R, :], qw2=lambda: d_qw[..., R:, :],
                 kw1=lambda: d_kw[..., :R, :], kw2=lambda: d_kw[..., R:, :],
                 qdd=lambda: d_qdd, kdd=lambda: d_kdd, static=lambda: d_st)
    return [None if dt is None else grads[n]().to(dt) for n, dt in zip(TERM_NAMES, dtypes)]


class _DCMHAFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, pb, store_p, q, k, v, mask, *stage_inputs):
        pre_in, post_in = stage_inputs[:7], stage_inputs[7:]
        pre = dict(zip(TERM_NAMES, pre_in))
        post = dict(zip(TERM_NAMES, post_in))
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        pre_arrays = _packed(pre, pb, q.device)
        post_arrays = _packed(post, pb, q.device)
        o, lse, p = _forward(q, k, v, mask, pre_arrays, post_arrays, pb, store_p)
        ctx.pb = pb
        ctx.mask = mask
        ctx.dtypes = [None if x is None else x.dtype for x in stage_inputs]
        ctx.save_for_backward(q, k, v, o, lse, *pre_arrays, *post_arrays)
        if p is None:
            return o.to(q.dtype)
        p = p.to(q.dtype)
        ctx.mark_non_differentiable(p)
        return o.to(q.dtype), p

    @staticmethod
    def backward(ctx, do, *unused):
        pb = ctx.pb
        q, k, v, o, lse, *arrays = ctx.saved_tensors
        dq, dk, dv, d_pre, d_post = _backward(q, k, v, do.contiguous(), o, lse, ctx.mask,
                                              arrays[:5], arrays[5:], pb)
        grads = (_unpack_grads(d_pre, ctx.dtypes[:7], pb.R)
                 + _unpack_grads(d_post, ctx.dtypes[7:], pb.R))
        return (None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, *grads)


def dcmha_attention(q, k, v, *, num_groups, pre=None, post=None, mask=None, causal=False,
                    sliding_window=None, scale=None, query_offset=0, block_q=None, block_k=None,
                    interpret=None, return_attention_scores=False):
    """Fused DCMHA attention (Triton), differentiable w.r.t. q, k, v and every pre/post array.

    Args: as ``dcmha.backends.torch_native.dcmha_attention`` (q, k, v, num_groups,
      pre, post, mask, causal, sliding_window, scale, query_offset; dtypes float32 /
      float16 / bfloat16, no float64), and:
      block_q, block_k: tile sizes (powers of two), default ``BlockSizes()``.
      interpret: None, or a bool that must match how Triton was loaded
        (``TRITON_INTERPRET``); interpreted runs take CPU tensors, compiled runs CUDA.
      return_attention_scores: also return the masked post-composed probabilities
        (B, N, T, S) in q's dtype (materialised: for tests and inspection; not
        differentiable).

    Returns:
      o: (B, T, N, d_v) in q's dtype; scores, composition and softmax in float32.
      Fully masked query rows give zeros. With ``return_attention_scores``, (o, scores).
    """
    pb = _check(q, k, v, num_groups, pre, post, mask, causal, sliding_window, scale, query_offset,
                block_q, block_k)
    mode = _interpreting()
    if interpret is not None and bool(interpret) != mode:
        raise ValueError(f"`interpret={interpret}` does not match this process: Triton was "
                         f"loaded with TRITON_INTERPRET={'1' if mode else '0'}; set it before "
                         "Triton is first imported.")
    if not mode:
        if q.device.type != "cuda":
            raise ValueError(f"Compiled Triton needs CUDA tensors. Received: q on {q.device}; "
                             "set TRITON_INTERPRET=1 before importing Triton to run on CPU.")
        if min(pb.blocks.block_q, pb.blocks.block_k) < 16:
            raise ValueError("Compiled Triton needs block_q and block_k >= 16 (tl.dot). "
                             f"Received: block_q={pb.blocks.block_q}, block_k={pb.blocks.block_k}")
    flat = [None if stage is None else stage.get(n) for stage in (pre, post) for n in TERM_NAMES]
    return _DCMHAFunction.apply(pb, bool(return_attention_scores), q, k, v, mask, *flat)


# ---------------------------------------------------------------------------
# The plain reference (materialises (B, N, T, S); for tests and reading)
# ---------------------------------------------------------------------------

def dcmha_attention_reference(q, k, v, *, num_groups, pre=None, post=None, mask=None,
                              causal=False, sliding_window=None, scale=None, query_offset=0,
                              block_q=None, block_k=None, interpret=None,
                              return_attention_scores=False):
    """``dcmha_attention`` in plain PyTorch ops (float32), differentiable by autograd
    (``torch_common.attention_reference``, shared with the torch-native kernel).

    Same arguments and result; ``block_q``, ``block_k`` and ``interpret`` are ignored.
    Materialises (B, N, T, S): for tests and small problems.
    """
    out = torch_common.attention_reference(
        q, k, v, num_groups=num_groups, pre=pre, post=post, mask=mask, causal=causal,
        sliding_window=sliding_window, scale=scale, query_offset=query_offset,
        return_attention_scores=return_attention_scores, dtypes=_DTYPES)
    # The kernel's scores are not differentiable: neither are the reference's.
    return (out[0], out[1].detach()) if return_attention_scores else out
