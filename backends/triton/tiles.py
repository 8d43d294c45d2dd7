"""Tile helpers of the fused Triton kernels (``forward``, ``backward``), run inside them.

A program holds the tile of all heads of one composition group, (BLOCK_M, BLOCK_T,
BLOCK_S) (heads padded to the power of two BLOCK_M, masked by ``offs_m < M``). Loops
over heads (M) and ranks (R) are runtime loops, not unrolled: the size of the compiled
code, and its compile time, do not grow with M or R, and M, R, the lengths, the offset
and the window are runtime integers (``RUNTIME_SIZES``), so one compiled kernel serves
every call that shares a tile configuration (BLOCK_M = M padded, BLOCK_R = 2R padded, the
tiles), dtype, terms and masking switches.
"""

import triton
import triton.language as tl

from dcmha.spec import terms as spec_terms

# Bits of the per-stage TERMS constant of the kernels.
QW, KW, QDD, KDD, STATIC = 1, 2, 4, 8, 16
# The masked-score fill (``dcmha.spec.terms.MASKED_SCORE``), also the running max's
# start: finite, so exp() and subtraction stay free of inf - inf.
NEG = tl.constexpr(spec_terms.MASKED_SCORE)
# Every dot product: float32 operands (16-bit inputs are widened exactly), multiplied as
# three TF32 tensor-core products of their high and low TF32 parts, accumulated in float32
# (about float32's accuracy). Compiled "ieee" float32 dots are unrolled scalar FMAs
# instead: far slower on the GPU, and code that grows with heads x rows x columns x head
# dim until ptxas takes minutes (the d=128 kernels).
DOT_PRECISION = tl.constexpr("tf32x3")
# Arguments the kernels take as plain runtime integers, never specialised on (Triton
# would otherwise compile a variant per value 1 or divisibility by 16): one compiled
# kernel serves every length, offset, window size, head count and rank of a tile configuration.
RUNTIME_SIZES = ("smb", "smt", "T", "S", "N", "NKV", "G", "OFFSET", "WINDOW", "M", "R")


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
             TERMS: tl.constexpr, TRANSPOSE: tl.constexpr, R, M):
    """Compose (or its transpose) of a (BLOCK_M, BLOCK_T, BLOCK_S) tile over heads.

    out[n] = x[n] + sum_m x[m] W[m, n] (W = I + static + low rank + diag);
    TRANSPOSE applies W^T instead (the backward): static^T, w1 and w2 swapped.
    qw rows r < R hold w1 and R <= r < 2R hold w2; every term reads x.
    """
    out = x
    if TERMS & 16:
        for m in range(0, M):
            xm = tl.sum(tl.where(offs_m[:, None, None] == m, x, 0.0), axis=0)
            if TRANSPOSE:
                w = tl.load(st_ptr + g * M * M + offs_m * M + m, mask=m_ok, other=0.0)
            else:
                w = tl.load(st_ptr + g * M * M + m * M + offs_m, mask=m_ok, other=0.0)
            out += w[:, None, None] * xm[None, :, :]
    if TERMS & 1:
        for r in range(0, R):
            if TRANSPOSE:
                w_in = tl.load(qw_ptr + qw_off + (R + r) * M, mask=q_ok, other=0.0)
                w_out = tl.load(qw_ptr + qw_off + r * M, mask=q_ok, other=0.0)
            else:
                w_in = tl.load(qw_ptr + qw_off + r * M, mask=q_ok, other=0.0)
                w_out = tl.load(qw_ptr + qw_off + (R + r) * M, mask=q_ok, other=0.0)
            out += tl.sum(x * w_in, axis=0)[None, :, :] * w_out
    if TERMS & 2:
        for r in range(0, R):
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
def _low_rank_grads(x, y, w_ptr, w_off, w_ok, acc, offs_r, AXIS: tl.constexpr, R, M):
    """Add this tile's gradients of one side's (w1, w2) to acc (BLOCK_M, L, BLOCK_R).

    x: compose input, y: gradient of compose output, both (BLOCK_M, BLOCK_T, BLOCK_S).
    AXIS = 2 sums over keys (query-side weights), AXIS = 1 over queries.
    dw1[r, m] = sum x[m] (sum_n y[n] w2[r, n]); dw2[r, n] = sum y[n] (sum_m x[m] w1[r, m]).
    """
    for r in range(0, R):
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
def _static_grads(x, y, acc, offs_m, M):
    """acc (BLOCK_M, BLOCK_M) += sum_{t,s} x[m] y[n] (the static weights' gradient)."""
    for m in range(0, M):
        xm = tl.sum(tl.where(offs_m[:, None, None] == m, x, 0.0), axis=0)
        row = tl.sum(tl.sum(xm[None, :, :] * y, axis=2), axis=1)
        acc += tl.where(offs_m[:, None] == m, row[None, :], 0.0)
    return acc


@triton.jit
def _pre_composed(q, k_ptr, b, hkv, offs_s, offs_d, m_ok, S, NKV, D, scale,
                  qw, kw, qdd, kdd, st, qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok, g, offs_m,
                  PRE: tl.constexpr, R, M):
    """Scores a and pre-composed scores A of one tile, both (BLOCK_M, BLOCK_T, BLOCK_S)."""
    kt_ptr = (k_ptr + ((b * S + offs_s[None, None, :]) * NKV + hkv[:, None, None]) * D
              + offs_d[None, :, None])
    kt_ok = m_ok[:, None, None] & (offs_d[None, :, None] < D) & (offs_s[None, None, :] < S)
    kt = tl.load(kt_ptr, mask=kt_ok, other=0.0).to(tl.float32)
    a = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale
    A = a
    if PRE != 0:
        A = _compose(a, qw, kw, qdd, kdd, st, qw_off, kw_off, qdd_off, kdd_off, q_ok, k_ok,
                     g, offs_m, m_ok, PRE, False, R, M)
    return a, A
