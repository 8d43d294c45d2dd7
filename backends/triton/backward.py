"""The backward kernels of the fused Triton DCMHA attention (see ``dcmha_triton``).

Both recompute the forward's tiles with the math of ``spec/reference_grad.py``. With
dP = Compose^T(mask * dO v^T; post) the softmax backward needs
delta[n, t] = sum_s P[n, t, s] dP[n, t, s], a reduction over every key block: the
query-block kernel computes it in a first pass (without a post stage the caller gives
delta = rowsum(dO * o), as in FlashAttention), then accumulates dq and the query-side
and static weight gradients; the key-block kernel then accumulates dk, dv and the
key-side weight gradients.
"""

import triton
import triton.language as tl

from .tiles import (DOT_PRECISION, NEG, RUNTIME_SIZES, _compose, _key_range, _low_rank_grads,
                    _pre_composed, _query_range, _static_grads, _valid)


@triton.jit
def _tile_backward(q, do, lse, delta, k_ptr, v_ptr, b, g, hkv, offs_t, offs_s, offs_d, offs_dv,
                   offs_m, m_ok, T, S, NKV, D, DV, OFFSET, WINDOW, scale, mask_ptr, smb, smt, sms,
                   pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
                   post_qw, post_kw, post_qdd, post_kdd, post_st,
                   qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok,
                   M, R, PRE: tl.constexpr, POST: tl.constexpr,
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
    p = tl.exp(tl.where(valid, A - lse[:, :, None], NEG))
    ss = offs_s[None, None, :]
    vt = tl.load(v_ptr + ((b * S + ss) * NKV + hkv[:, None, None]) * DV + offs_dv[None, :, None],
                 mask=k_ok & (offs_dv[None, :, None] < DV), other=0.0).to(tl.float32)
    dp2 = tl.where(valid, tl.dot(do, vt, input_precision=DOT_PRECISION), 0.0)
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


@triton.jit(do_not_specialize=RUNTIME_SIZES + ("NUM_TB",))
def _bwd_query_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                      mask_ptr, smb, smt, sms,
                      pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
                      post_qw, post_kw, post_qdd, post_kdd, post_st,
                      d_pre_qw, d_pre_qdd, d_pre_st, d_post_qw, d_post_qdd, d_post_st,
                      T, S, N, NKV, G, REP, D, DV, OFFSET, WINDOW, scale, NUM_TB,
                      M, R, PRE: tl.constexpr, POST: tl.constexpr,
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
        dq += tl.dot(da, k.to(tl.float32), input_precision=DOT_PRECISION)
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


@triton.jit(do_not_specialize=RUNTIME_SIZES)
def _bwd_key_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                    mask_ptr, smb, smt, sms,
                    pre_qw, pre_kw, pre_qdd, pre_kdd, pre_st,
                    post_qw, post_kw, post_qdd, post_kdd, post_st,
                    d_pre_kw, d_pre_kdd, d_post_kw, d_post_kdd,
                    T, S, N, NKV, G, REP, D, DV, OFFSET, WINDOW, scale,
                    M, R, PRE: tl.constexpr, POST: tl.constexpr,
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
        dv += tl.dot(p2.permute(0, 2, 1), do, input_precision=DOT_PRECISION)
        dk += tl.dot(da.permute(0, 2, 1), q, input_precision=DOT_PRECISION)
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
