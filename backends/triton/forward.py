"""The forward kernel of the fused Triton DCMHA attention (see ``dcmha_triton``).

A program owns one (query block, b * G + g). Without a post stage (and without the
scores asked for) one online-softmax pass over the key blocks computes the output, as
FlashAttention does. Otherwise the first pass finds each head's row log-sum-exp of the
pre-composed scores and the second recomputes the scores, normalises them, post-composes
(the composition mixes *normalised* probabilities across heads) and accumulates P' v.
"""

import triton
import triton.language as tl

from .tiles import (DOT_PRECISION, NEG, RUNTIME_SIZES, _compose, _key_range, _pre_composed,
                    _valid)


@triton.jit(do_not_specialize=RUNTIME_SIZES)
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, p_ptr, mask_ptr, smb, smt, sms,
                pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
                post_qw, post_kw, post_qdd, post_kdd, post_st,
                T, S, N, NKV, G, REP, D, DV, OFFSET, WINDOW, scale,
                M, R, PRE: tl.constexpr, POST: tl.constexpr,
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
    m_i = tl.full((BLOCK_M, BLOCK_T), NEG, tl.float32)
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
        m_new = tl.maximum(m_i, tl.max(tl.where(valid, A, NEG), axis=2))
        p = tl.exp(tl.where(valid, A - m_new[:, :, None], NEG))
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=2)
        m_i = m_new
        if not TWO_PASS:
            v = tl.load(v_ptr + ((b * S + ss.permute(0, 2, 1)) * NKV + hkv[:, None, None]) * DV
                        + offs_dv[None, None, :],
                        mask=k_ok.permute(0, 2, 1) & (offs_dv[None, None, :] < DV),
                        other=0.0).to(tl.float32)
            acc = acc * alpha[:, :, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
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
            p = tl.exp(tl.where(valid, A - lse[:, :, None], NEG))
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
            acc += tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
    o_off = ((b * T + tt) * N + h[:, None, None]) * DV + offs_dv[None, None, :]
    tl.store(o_ptr + o_off, acc, mask=q_ok & (offs_dv[None, None, :] < DV))
    tl.store(lse_ptr + (b * N + h[:, None]) * T + offs_t[None, :], lse,
             mask=m_ok[:, None] & (offs_t[None, :] < T))
