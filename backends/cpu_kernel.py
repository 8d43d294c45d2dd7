"""A compiled C kernel for the compose of one score block (CPU, float32).

The CPU cores (``torch_native`` and ``jax_cpu``) spend most of a call in the
two composes: done with framework ops they are a handful of arithmetic
operations per score entry spread over a dozen elementwise passes (and, for
the query side, a batched 8x8 GEMM per query). This kernel fuses a block's
compose, and its backward, into one pass over the block: per (batch, query
row, group) it loads the M heads' values at 16 keys at a time (one AVX-512
register each), applies every term (residual, static and query-side terms as
the per-query M x M matrix ``wq``; key-side rank-R terms; key-side gating) in
registers, and writes the result once. The backward recomputes the key-side
hidden values and accumulates every term gradient in the same pass. The
(M, R) pairs M in 1, 2, 4, 8, 16 and R in 1, 2, 4 are compiled with M and R
fixed; any other size, and the last ``s % 16`` keys, run generic loops.

The source is compiled on first use (``build_library``) with the system C
compiler (``$CC``, else ``cc`` / ``gcc`` / ``clang``; ``-O3 -march=native``)
into a per-user cache directory (``$DCMHA_CACHE_DIR``, else
``$XDG_CACHE_HOME/dcmha``, else ``~/.cache/dcmha``), keyed by the sources,
the flags, the compilers and the CPU. Two libraries are built from it:

* ``load()``: the kernel alone, called through ``ctypes`` by ``dcmha_torch``
  (calls release the GIL, so its block threads run them in parallel);
* ``build_ffi_library(include_dir)``: the kernel with XLA FFI handlers (C++,
  ``_FFI_SOURCE``), registered by ``jax_cpu`` as ``jax.ffi`` targets.

Without a compiler, or with ``DCMHA_CPU_KERNEL=0``, neither is built and the
cores fall back (torch: its PyTorch ops; jax: ``implementation="auto"``
takes the "ops" core). Kernel and fallback agree within float32 rounding
(the tests run both).

Array conventions (all float32, last axis contiguous, strides in elements,
passed in ``Args``): a block is x (B, t, N, s) with head n = g * M + m at
stride ``x_n``; ``wq`` (B, t, [G,] M, M) holds out[n] = sum_m wq[n, m] x[m]
for group g's block at offset ``wq_g`` (torch: the diagonal blocks of a dense
(N, N) matrix); kw1 / kw2 (B, G, R, M, s) and kdd (B, G, M, s) are the
key-side terms of the block's key columns.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading

__all__ = ["load", "unavailable_reason", "compose_forward", "compose_backward", "disabled",
           "build_library", "build_ffi_library", "build_tf_library", "CHUNK"]

#: Keys per chunk of the inner loops (the chunk of M rows stays in L1).
CHUNK = 64

_HEADER = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CH @CHUNK@

typedef struct {
    int64_t B, t, G, M, R, s;
    const float *x; int64_t x_b, x_i, x_n;          /* (B, t, N, s) input block */
    float *out; int64_t o_b, o_i, o_n;              /* forward: result; backward: dx */
    const float *g; int64_t g_b, g_i, g_n;          /* backward: dL/d out */
    const float *wq; int64_t wq_b, wq_i, wq_g, wq_n, wq_m;    /* (B, t, [G,] M, M) per query */
    float *dwq; int64_t dwq_b, dwq_i, dwq_g, dwq_n, dwq_m;
    const float *kw1; const float *kw2; int64_t kw_b, kw_g, kw_r, kw_m;
    float *dkw1; float *dkw2; int64_t dkw_b, dkw_g, dkw_r, dkw_m;
    const float *kdd; int64_t kd_b, kd_g, kd_m;
    float *dkdd; int64_t dkd_b, dkd_g, dkd_m;
} Args;

""".replace("@CHUNK@", str(CHUNK))

_SOURCE = _HEADER + r"""
/* The key-side terms (and their gradients) of batch b, group gi; NULL where absent. */
#define KEY_SIDE(b, gi)                                                                  \
    const float *k1 = a->kw1 ? a->kw1 + (b) * a->kw_b + (gi) * a->kw_g : 0;               \
    const float *k2 = a->kw2 ? a->kw2 + (b) * a->kw_b + (gi) * a->kw_g : 0;               \
    const float *kd = a->kdd ? a->kdd + (b) * a->kd_b + (gi) * a->kd_g : 0;
#define KEY_SIDE_GRADS(b, gi)                                                            \
    float *dk1 = a->kw1 ? a->dkw1 + (b) * a->dkw_b + (gi) * a->dkw_g : 0;                 \
    float *dk2 = a->kw1 ? a->dkw2 + (b) * a->dkw_b + (gi) * a->dkw_g : 0;                 \
    float *dkd = a->kdd ? a->dkdd + (b) * a->dkd_b + (gi) * a->dkd_g : 0;

/* h[r, j] = sum_m x[m, j] kw1[r, m, j] for one row (j < nj). */
static void hidden(const Args *a, const float *xr, int64_t xs, const float *k1,
                   int64_t j0, int64_t nj, float *h) {
    for (int64_t r = 0; r < a->R; r++) {
        float *hr = h + r * CH;
        const float *kr = k1 + r * a->kw_r + j0;
        const float *x0 = xr + j0;
        for (int64_t j = 0; j < nj; j++) hr[j] = x0[j] * kr[j];
        for (int64_t m = 1; m < a->M; m++) {
            const float *xm = xr + m * xs + j0, *km = kr + m * a->kw_m;
            for (int64_t j = 0; j < nj; j++) hr[j] += xm[j] * km[j];
        }
    }
}

static int forward_generic(const Args *a, int64_t js) {
    const int64_t M = a->M, R = a->R, s = a->s;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(M + R) * CH);
    if (!buf) return 1;
    float *acc = buf, *h = buf + M * CH;
    for (int64_t b = 0; b < a->B; b++)
    for (int64_t i = 0; i < a->t; i++)
    for (int64_t gi = 0; gi < a->G; gi++) {
        const float *xr = a->x + b * a->x_b + i * a->x_i + gi * M * a->x_n;
        float *orow = a->out + b * a->o_b + i * a->o_i + gi * M * a->o_n;
        const float *wq = a->wq ? a->wq + b * a->wq_b + i * a->wq_i
                                        + gi * a->wq_g : 0;
        KEY_SIDE(b, gi)
        for (int64_t j0 = js; j0 < s; j0 += CH) {
            const int64_t nj = s - j0 < CH ? s - j0 : CH;
            for (int64_t n = 0; n < M; n++) {
                float *an = acc + n * CH;
                if (wq) {
                    const float *wn = wq + n * a->wq_n;
                    const float w0 = wn[0], *x0 = xr + j0;
                    for (int64_t j = 0; j < nj; j++) an[j] = w0 * x0[j];
                    for (int64_t m = 1; m < M; m++) {
                        const float w = wn[m * a->wq_m], *xm = xr + m * a->x_n + j0;
                        for (int64_t j = 0; j < nj; j++) an[j] += w * xm[j];
                    }
                } else {
                    memcpy(an, xr + n * a->x_n + j0, sizeof(float) * (size_t)nj);
                }
                if (kd) {
                    const float *kn = kd + n * a->kd_m + j0, *xn = xr + n * a->x_n + j0;
                    for (int64_t j = 0; j < nj; j++) an[j] += xn[j] * kn[j];
                }
            }
            if (k1) {
                hidden(a, xr, a->x_n, k1, j0, nj, h);
                for (int64_t n = 0; n < M; n++) {
                    float *an = acc + n * CH;
                    for (int64_t r = 0; r < R; r++) {
                        const float *hr = h + r * CH;
                        const float *k2n = k2 + r * a->kw_r + n * a->kw_m + j0;
                        for (int64_t j = 0; j < nj; j++) an[j] += hr[j] * k2n[j];
                    }
                }
            }
            for (int64_t n = 0; n < M; n++)
                memcpy(orow + n * a->o_n + j0, acc + n * CH, sizeof(float) * (size_t)nj);
        }
    }
    free(buf);
    return 0;
}

/* dx = dL/dx into out (out may alias g); term gradients accumulated (+=). */
static int backward_generic(const Args *a, int64_t js) {
    const int64_t M = a->M, R = a->R, s = a->s;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(M + 2 * R) * CH);
    if (!buf) return 1;
    float *acc = buf, *h = buf + M * CH, *gk = buf + (M + R) * CH;
    for (int64_t b = 0; b < a->B; b++)
    for (int64_t gi = 0; gi < a->G; gi++) {
        KEY_SIDE(b, gi)
        KEY_SIDE_GRADS(b, gi)
        for (int64_t j0 = js; j0 < s; j0 += CH) {
            const int64_t nj = s - j0 < CH ? s - j0 : CH;
            for (int64_t i = 0; i < a->t; i++) {
                const float *xr = a->x + b * a->x_b + i * a->x_i + gi * M * a->x_n;
                const float *gr = a->g + b * a->g_b + i * a->g_i + gi * M * a->g_n;
                float *orow = a->out + b * a->o_b + i * a->o_i + gi * M * a->o_n;
                /* query side: dwq[n, m] += sum_j g[n, j] x[m, j]; dx[m] = sum_n wq[n, m] g[n] */
                if (a->wq) {
                    const float *wq = a->wq + b * a->wq_b + i * a->wq_i
                                      + gi * a->wq_g;
                    float *dwq = a->dwq + b * a->dwq_b + i * a->dwq_i
                                 + gi * a->dwq_g;
                    for (int64_t n = 0; n < M; n++) {
                        const float *gn = gr + n * a->g_n + j0;
                        for (int64_t m = 0; m < M; m++) {
                            const float *xm = xr + m * a->x_n + j0;
                            float sum = 0.0f;
                            #pragma omp simd reduction(+:sum)
                            for (int64_t j = 0; j < nj; j++) sum += gn[j] * xm[j];
                            dwq[n * a->dwq_n + m * a->dwq_m] += sum;
                        }
                    }
                    for (int64_t m = 0; m < M; m++) {
                        float *am = acc + m * CH;
                        const float w0 = wq[m * a->wq_m], *g0 = gr + j0;
                        for (int64_t j = 0; j < nj; j++) am[j] = w0 * g0[j];
                        for (int64_t n = 1; n < M; n++) {
                            const float w = wq[n * a->wq_n + m * a->wq_m];
                            const float *gn = gr + n * a->g_n + j0;
                            for (int64_t j = 0; j < nj; j++) am[j] += w * gn[j];
                        }
                    }
                } else {
                    for (int64_t m = 0; m < M; m++)
                        memcpy(acc + m * CH, gr + m * a->g_n + j0, sizeof(float) * (size_t)nj);
                }
                if (kd) {      /* gating: dkdd[n] += g[n] x[n]; dx[n] += g[n] kdd[n] */
                    for (int64_t n = 0; n < M; n++) {
                        const float *gn = gr + n * a->g_n + j0, *xn = xr + n * a->x_n + j0;
                        const float *kn = kd + n * a->kd_m + j0;
                        float *dn = dkd + n * a->dkd_m + j0, *an = acc + n * CH;
                        for (int64_t j = 0; j < nj; j++) {
                            dn[j] += gn[j] * xn[j];
                            an[j] += gn[j] * kn[j];
                        }
                    }
                }
                if (k1) {
                    /* h = x . kw1 and gk = g . kw2 over the heads; then the outer products */
                    hidden(a, xr, a->x_n, k1, j0, nj, h);
                    for (int64_t r = 0; r < R; r++) {
                        float *gkr = gk + r * CH;
                        const float *k2r = k2 + r * a->kw_r + j0, *g0 = gr + j0;
                        for (int64_t j = 0; j < nj; j++) gkr[j] = g0[j] * k2r[j];
                        for (int64_t n = 1; n < M; n++) {
                            const float *gn = gr + n * a->g_n + j0, *kn = k2r + n * a->kw_m;
                            for (int64_t j = 0; j < nj; j++) gkr[j] += gn[j] * kn[j];
                        }
                    }
                    for (int64_t r = 0; r < R; r++) {
                        const float *hr = h + r * CH, *gkr = gk + r * CH;
                        for (int64_t m = 0; m < M; m++) {
                            const float *xm = xr + m * a->x_n + j0, *gm = gr + m * a->g_n + j0;
                            const float *k1m = k1 + r * a->kw_r + m * a->kw_m + j0;
                            float *d1 = dk1 + r * a->dkw_r + m * a->dkw_m + j0;
                            float *d2 = dk2 + r * a->dkw_r + m * a->dkw_m + j0;
                            float *am = acc + m * CH;
                            for (int64_t j = 0; j < nj; j++) {
                                d1[j] += gkr[j] * xm[j];
                                d2[j] += hr[j] * gm[j];
                                am[j] += gkr[j] * k1m[j];
                            }
                        }
                    }
                }
                for (int64_t m = 0; m < M; m++)
                    memcpy(orow + m * a->o_n + j0, acc + m * CH, sizeof(float) * (size_t)nj);
            }
        }
    }
    free(buf);
    return 0;
}

/* ---- vectorised path: M (heads per group) and R are compile-time constants ----
   (M in 1, 2, 4, 8, 16 and R in 1, 2, 4; other sizes, and the last s % VL keys, take the
   generic loops above) */

#define VL 16                       /* floats per vector (one AVX-512 register) */
#define VCH 128                     /* keys per chunk (the chunk's key-side terms stay in L1) */
typedef float vf __attribute__((vector_size(4 * VL), aligned(4)));
#define LD(p) (*(const vf *)(p))
#define ST(p, v) (*(vf *)(p) = (v))
#define INLINE static inline __attribute__((always_inline))

INLINE float hsum(vf v) {
    float t = 0.0f;
    for (int l = 0; l < VL; l++) t += v[l];
    return t;
}

INLINE void forward_rows(const Args *a, int64_t b, int64_t gi, int64_t jv, const int M,
                         const int R) {
    KEY_SIDE(b, gi)
    for (int64_t j0 = 0; j0 < jv; j0 += VCH) {
        const int64_t j1 = j0 + VCH < jv ? j0 + VCH : jv;
        for (int64_t i = 0; i < a->t; i++) {
            const float *xr = a->x + b * a->x_b + i * a->x_i + gi * M * a->x_n;
            float *orow = a->out + b * a->o_b + i * a->o_i + gi * M * a->o_n;
            const float *wq = a->wq ? a->wq + b * a->wq_b + i * a->wq_i
                                            + gi * a->wq_g : 0;
            for (int64_t j = j0; j < j1; j += VL) {
                vf X[16], O[16], H[4];
                _Pragma("GCC unroll 16") for (int m = 0; m < M; m++) X[m] = LD(xr + m * a->x_n + j);
                if (wq) {
                    _Pragma("GCC unroll 16") for (int n = 0; n < M; n++) {
                        const float *wn = wq + n * a->wq_n;
                        vf o = X[0] * wn[0];
                        _Pragma("GCC unroll 16") for (int m = 1; m < M; m++) o += X[m] * wn[m * a->wq_m];
                        O[n] = o;
                    }
                } else {
                    _Pragma("GCC unroll 16") for (int n = 0; n < M; n++) O[n] = X[n];
                }
                if (kd) {
                    _Pragma("GCC unroll 16") for (int n = 0; n < M; n++) O[n] += X[n] * LD(kd + n * a->kd_m + j);
                }
                if (k1) {
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
                        const float *kr = k1 + r * a->kw_r + j;
                        vf hr = X[0] * LD(kr);
                        _Pragma("GCC unroll 16") for (int m = 1; m < M; m++) hr += X[m] * LD(kr + m * a->kw_m);
                        H[r] = hr;
                    }
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
                        const float *kr = k2 + r * a->kw_r + j;
                        _Pragma("GCC unroll 16") for (int n = 0; n < M; n++) O[n] += H[r] * LD(kr + n * a->kw_m);
                    }
                }
                _Pragma("GCC unroll 16") for (int n = 0; n < M; n++) ST(orow + n * a->o_n + j, O[n]);
            }
        }
    }
}

/* dwq[n, m] += sum_j g[n, j] x[m, j] over j < jv for one row, two n at a time. */
INLINE void backward_wq_row(const Args *a, int64_t b, int64_t gi, int64_t i, int64_t jv,
                            const int M) {
    {
        const float *xr = a->x + b * a->x_b + i * a->x_i + gi * M * a->x_n;
        const float *gr = a->g + b * a->g_b + i * a->g_i + gi * M * a->g_n;
        float *dwq = a->dwq + b * a->dwq_b + i * a->dwq_i + gi * a->dwq_g;
        for (int n0 = 0; n0 < M; n0 += 2) {
            const int two = n0 + 1 < M;
            vf A0[16], A1[16];
            _Pragma("GCC unroll 16") for (int m = 0; m < M; m++) { A0[m] = (vf){0}; A1[m] = (vf){0}; }
            const float *g0 = gr + n0 * a->g_n, *g1 = gr + (n0 + two) * a->g_n;
            for (int64_t j = 0; j < jv; j += VL) {
                const vf G0 = LD(g0 + j), G1 = LD(g1 + j);
                _Pragma("GCC unroll 16") for (int m = 0; m < M; m++) {
                    const vf Xm = LD(xr + m * a->x_n + j);
                    A0[m] += G0 * Xm;
                    A1[m] += G1 * Xm;
                }
            }
            _Pragma("GCC unroll 16") for (int m = 0; m < M; m++) {
                dwq[n0 * a->dwq_n + m * a->dwq_m] += hsum(A0[m]);
                if (two) dwq[(n0 + 1) * a->dwq_n + m * a->dwq_m] += hsum(A1[m]);
            }
        }
    }
}

INLINE void backward_rows(const Args *a, int64_t b, int64_t gi, int64_t jv, const int M,
                          const int R) {
    KEY_SIDE(b, gi)
    KEY_SIDE_GRADS(b, gi)
    /* Row by row: the wq pass brings the row's x and g into cache for the main pass, and
       the key-side accumulators (5 M s floats) stay in L2. */
    for (int64_t i = 0; i < a->t; i++) {
        if (a->wq) backward_wq_row(a, b, gi, i, jv, M);   /* reads g before dx overwrites it */
        {
            const int64_t j0 = 0, j1 = jv;
            const float *xr = a->x + b * a->x_b + i * a->x_i + gi * M * a->x_n;
            const float *gr = a->g + b * a->g_b + i * a->g_i + gi * M * a->g_n;
            float *orow = a->out + b * a->o_b + i * a->o_i + gi * M * a->o_n;
            const float *wq = a->wq ? a->wq + b * a->wq_b + i * a->wq_i
                                            + gi * a->wq_g : 0;
            for (int64_t j = j0; j < j1; j += VL) {
                vf X[16], G[16], D[16], H[4], GK[4];
                _Pragma("GCC unroll 16") for (int m = 0; m < M; m++) {
                    X[m] = LD(xr + m * a->x_n + j);
                    G[m] = LD(gr + m * a->g_n + j);
                }
                if (wq) {
                    _Pragma("GCC unroll 16") for (int m = 0; m < M; m++) {
                        vf d = G[0] * wq[m * a->wq_m];
                        _Pragma("GCC unroll 16") for (int n = 1; n < M; n++) d += G[n] * wq[n * a->wq_n + m * a->wq_m];
                        D[m] = d;
                    }
                } else {
                    _Pragma("GCC unroll 16") for (int m = 0; m < M; m++) D[m] = G[m];
                }
                if (kd) {
                    _Pragma("GCC unroll 16") for (int n = 0; n < M; n++) {
                        D[n] += G[n] * LD(kd + n * a->kd_m + j);
                        float *dn = dkd + n * a->dkd_m + j;
                        ST(dn, LD(dn) + G[n] * X[n]);
                    }
                }
                if (k1) {
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
                        const float *k1r = k1 + r * a->kw_r + j, *k2r = k2 + r * a->kw_r + j;
                        vf hr = X[0] * LD(k1r), gkr = G[0] * LD(k2r);
                        _Pragma("GCC unroll 16") for (int m = 1; m < M; m++) {
                            hr += X[m] * LD(k1r + m * a->kw_m);
                            gkr += G[m] * LD(k2r + m * a->kw_m);
                        }
                        H[r] = hr;
                        GK[r] = gkr;
                    }
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
                        const float *k1r = k1 + r * a->kw_r + j;
                        float *d1 = dk1 + r * a->dkw_r + j, *d2 = dk2 + r * a->dkw_r + j;
                        _Pragma("GCC unroll 16") for (int m = 0; m < M; m++) {
                            D[m] += GK[r] * LD(k1r + m * a->kw_m);
                            ST(d1 + m * a->dkw_m, LD(d1 + m * a->dkw_m) + GK[r] * X[m]);
                            ST(d2 + m * a->dkw_m, LD(d2 + m * a->dkw_m) + H[r] * G[m]);
                        }
                    }
                }
                _Pragma("GCC unroll 16") for (int m = 0; m < M; m++) ST(orow + m * a->o_n + j, D[m]);
            }
        }
    }
}

#define DISPATCH(CALL)                                                               \
    switch (a->M <= 16 && (!a->kw1 || a->R <= 4) ? a->M * 8 + (a->kw1 ? a->R : 1) : 0) { \
    case 1 * 8 + 1: CALL(1, 1); break;  case 1 * 8 + 2: CALL(1, 2); break;           \
    case 2 * 8 + 1: CALL(2, 1); break;  case 2 * 8 + 2: CALL(2, 2); break;           \
    case 4 * 8 + 1: CALL(4, 1); break;  case 4 * 8 + 2: CALL(4, 2); break;           \
    case 4 * 8 + 4: CALL(4, 4); break;  case 8 * 8 + 1: CALL(8, 1); break;           \
    case 8 * 8 + 2: CALL(8, 2); break;  case 8 * 8 + 4: CALL(8, 4); break;           \
    case 16 * 8 + 1: CALL(16, 1); break; case 16 * 8 + 2: CALL(16, 2); break;        \
    case 16 * 8 + 4: CALL(16, 4); break;                                             \
    default: jv = 0;                                                                 \
    }

/* The exported entry points: the vectorised rows where (M, R) has them, then the generic
   loops for the remaining key columns [jv, s). */
#define ENTRY(NAME, ROWS, GENERIC)                                                   \
    int NAME(const Args *a) {                                                        \
        int64_t jv = a->s - a->s % VL;                                               \
        for (int64_t b = 0; b < a->B; b++)                                           \
            for (int64_t gi = 0; gi < a->G; gi++) {                                  \
                DISPATCH(ROWS)                                                       \
            }                                                                        \
        return jv < a->s ? GENERIC(a, jv) : 0;                                       \
    }
#define FWD(MM, RR) forward_rows(a, b, gi, jv, MM, RR)
#define BWD(MM, RR) backward_rows(a, b, gi, jv, MM, RR)
ENTRY(dcmha_compose_forward, FWD, forward_generic)
ENTRY(dcmha_compose_backward, BWD, backward_generic)
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c11", "-shared", "-fPIC"]

_FIELDS = (
    [(n, ctypes.c_int64) for n in ("B", "t", "G", "M", "R", "s")]
    + [("x", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("x_b", "x_i", "x_n")]
    + [("out", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("o_b", "o_i", "o_n")]
    + [("g", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("g_b", "g_i", "g_n")]
    + [("wq", ctypes.c_void_p)]
    + [(n, ctypes.c_int64) for n in ("wq_b", "wq_i", "wq_g", "wq_n", "wq_m")]
    + [("dwq", ctypes.c_void_p)]
    + [(n, ctypes.c_int64) for n in ("dwq_b", "dwq_i", "dwq_g", "dwq_n", "dwq_m")]
    + [("kw1", ctypes.c_void_p), ("kw2", ctypes.c_void_p)]
    + [(n, ctypes.c_int64) for n in ("kw_b", "kw_g", "kw_r", "kw_m")]
    + [("dkw1", ctypes.c_void_p), ("dkw2", ctypes.c_void_p)]
    + [(n, ctypes.c_int64) for n in ("dkw_b", "dkw_g", "dkw_r", "dkw_m")]
    + [("kdd", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("kd_b", "kd_g", "kd_m")]
    + [("dkdd", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("dkd_b", "dkd_g", "dkd_m")]
)


class _Args(ctypes.Structure):
    _fields_ = _FIELDS


_LOCK = threading.Lock()
_STATE: dict = {}          # "lib": the loaded library or None; "reason": why it is None


def _cpu_signature() -> str:
    """The CPU model and feature flags (``-march=native`` binaries are per CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler(env, names):
    for name in (os.environ.get(env),) + names:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir() -> str:
    d = os.environ.get("DCMHA_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "dcmha")
    return d


def disabled() -> bool:
    """Whether ``DCMHA_CPU_KERNEL`` (0 / false / no / off) switches the compiled kernels off."""
    return os.environ.get("DCMHA_CPU_KERNEL", "1").strip().lower() in ("0", "false", "no", "off")


def build_library(tag, steps, key_parts=(), load=True):
    """Compile (cached) and load a shared library; (ctypes.CDLL, None) or (None, reason).

    steps: [(compiler, flags, source text, suffix[, flags after the source])] run in
    order in a scratch directory; ``{obj}`` in a step's flags names the previous
    step's output, and the last step's output is the library. The cache key covers
    every source, flag and compiler, ``key_parts`` and the CPU (``-march=native``).
    With ``load=False`` the library's path is returned instead of a CDLL (for loaders
    such as ``tf.load_op_library`` that must be the first to open it).
    """
    if disabled():
        return None, "disabled by DCMHA_CPU_KERNEL"
    if sys.platform == "win32":
        return None, "the C kernels are built on POSIX systems only"
    for compiler, *_ in steps:
        if compiler is None:
            return None, "no C / C++ compiler found ($CC / $CXX, cc, gcc, clang, c++, g++)"
    parts = [_cpu_signature(), *key_parts]
    for compiler, flags, text, *rest in steps:
        parts += [compiler, " ".join(flags), text, " ".join(rest[1] if len(rest) > 1 else ())]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    name = f"dcmha_{tag}_{key}.so"
    last_error = None
    for directory in (_cache_dir(), None):
        try:
            if directory is None:
                directory = tempfile.mkdtemp(prefix="dcmha-kernel-")
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                os.makedirs(directory, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=directory) as scratch:
                    prev = None
                    for i, (compiler, flags, text, suffix, *after) in enumerate(steps):
                        src = os.path.join(scratch, f"step{i}{suffix}")
                        out = os.path.join(scratch, f"step{i}.out")
                        with open(src, "w") as f:
                            f.write(text)
                        cmd = [compiler, *[fl.replace("{obj}", prev or "") for fl in flags],
                               src, *(after[0] if after else ()), "-o", out]
                        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                        if res.returncode != 0:
                            errors = [ln for ln in res.stderr.splitlines() if "error" in ln]
                            detail = "\n".join(errors[:5]) or res.stderr.strip()[-800:]
                            return None, f"compiling the {tag} kernel failed: {detail}"
                        prev = out
                    os.replace(prev, path)        # atomic: concurrent builders agree
            return (ctypes.CDLL(path) if load else path), None
        except (OSError, subprocess.SubprocessError) as e:
            last_error = e
    return None, f"building the {tag} kernel failed: {last_error}"


def _build():
    cc = _compiler("CC", ("cc", "gcc", "clang"))
    lib, reason = build_library("compose", [(cc, _FLAGS, _SOURCE, ".c")])
    if lib is not None:
        for fn in (lib.dcmha_compose_forward, lib.dcmha_compose_backward):
            fn.argtypes = [ctypes.POINTER(_Args)]
            fn.restype = ctypes.c_int
    return lib, reason


def load():
    """The compiled kernel library, or None (see ``unavailable_reason``)."""
    with _LOCK:
        if "lib" not in _STATE:
            _STATE["lib"], _STATE["reason"] = _build()
        return _STATE["lib"]


def unavailable_reason():
    """Why ``load()`` returns None (None when the kernel is loaded)."""
    load()
    return _STATE["reason"]


def _reset():
    """Forget the loaded state (tests switch the kernel on and off)."""
    with _LOCK:
        _STATE.clear()


#: C++ declarations shared by the framework wrappers: the kernel's entry points and
#: ``dcmha_fill``, which sets ``Args`` for contiguous arrays: x, out, g (B, G, M, t, s);
#: wq, dwq (B, t, G, M, M) ([n, m]: out[n] = sum_m wq[n, m] x[m]); kw1, kw2 and their
#: gradients (B, G, R, M, s); kdd, dkdd (B, G, M, s). ``flags`` says which terms are present
#: (1: wq, 2: kw1 / kw2, 4: kdd); absent ones are passed as 1-element dummies.
_CXX_COMMON = "extern \"C\" {\n" + _HEADER + r"""
int dcmha_compose_forward(const Args *a);
int dcmha_compose_backward(const Args *a);
}
#include <cstring>

static void dcmha_fill(Args &a, const int64_t *d, int64_t R, const float *x, const float *wq,
                       const float *kw1, const float *kw2, const float *kdd, int64_t flags) {
    std::memset(&a, 0, sizeof a);
    a.B = d[0]; a.G = d[1]; a.M = d[2]; a.t = d[3]; a.s = d[4];     /* x: (B, G, M, t, s) */
    const int64_t ts = a.t * a.s, M = a.M;
    a.x = x; a.x_b = a.G * M * ts; a.x_i = a.s; a.x_n = ts;
    a.o_b = a.x_b; a.o_i = a.x_i; a.o_n = a.x_n;
    a.g_b = a.x_b; a.g_i = a.x_i; a.g_n = a.x_n;
    if (flags & 1) {
        a.wq = wq;
        a.wq_b = a.t * a.G * M * M; a.wq_i = a.G * M * M; a.wq_g = M * M; a.wq_n = M; a.wq_m = 1;
        a.dwq_b = a.wq_b; a.dwq_i = a.wq_i; a.dwq_g = a.wq_g; a.dwq_n = M; a.dwq_m = 1;
    }
    a.R = (flags & 2) ? R : 1;
    if (flags & 2) {
        a.kw1 = kw1; a.kw2 = kw2;
        a.kw_m = a.s; a.kw_r = M * a.s; a.kw_g = a.R * M * a.s; a.kw_b = a.G * a.kw_g;
        a.dkw_b = a.kw_b; a.dkw_g = a.kw_g; a.dkw_r = a.kw_r; a.dkw_m = a.kw_m;
    }
    if (flags & 4) {
        a.kdd = kdd;
        a.kd_m = a.s; a.kd_g = M * a.s; a.kd_b = a.G * a.kd_g;
        a.dkd_b = a.kd_b; a.dkd_g = a.kd_g; a.dkd_m = a.kd_m;
    }
}

/* Gradient buffers: zeroed (the kernel accumulates), then attached where present. */
static void dcmha_grads(Args &a, float *dwq, size_t n_dwq, float *dkw1, float *dkw2,
                        size_t n_dkw, float *dkdd, size_t n_dkdd, int64_t flags) {
    std::memset(dwq, 0, n_dwq * sizeof(float));
    std::memset(dkw1, 0, n_dkw * sizeof(float));
    std::memset(dkw2, 0, n_dkw * sizeof(float));
    std::memset(dkdd, 0, n_dkdd * sizeof(float));
    if (flags & 1) a.dwq = dwq;
    if (flags & 2) { a.dkw1 = dkw1; a.dkw2 = dkw2; }
    if (flags & 4) a.dkdd = dkdd;
}
"""

#: XLA FFI handlers around the kernel, for ``jax.ffi`` on CPU (C++, compiled with
#: jaxlib's FFI headers).
_FFI_SOURCE = _CXX_COMMON + r"""
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using F32 = ffi::Buffer<ffi::F32>;
using Out = ffi::ResultBuffer<ffi::F32>;

static ffi::Error Forward(F32 x, F32 wq, F32 kw1, F32 kw2, F32 kdd, Out out, int64_t flags) {
    Args a;
    const int64_t R = kw1.dimensions().size() == 5 ? kw1.dimensions()[2] : 1;
    dcmha_fill(a, x.dimensions().begin(), R, x.typed_data(), wq.typed_data(),
               kw1.typed_data(), kw2.typed_data(), kdd.typed_data(), flags);
    a.out = out->typed_data();
    if (dcmha_compose_forward(&a)) return ffi::Error::Internal("dcmha compose: out of memory");
    return ffi::Error::Success();
}

static ffi::Error Backward(F32 x, F32 g, F32 wq, F32 kw1, F32 kw2, F32 kdd, Out dx, Out dwq,
                           Out dkw1, Out dkw2, Out dkdd, int64_t flags) {
    Args a;
    const int64_t R = kw1.dimensions().size() == 5 ? kw1.dimensions()[2] : 1;
    dcmha_fill(a, x.dimensions().begin(), R, x.typed_data(), wq.typed_data(),
               kw1.typed_data(), kw2.typed_data(), kdd.typed_data(), flags);
    a.g = g.typed_data();
    a.out = dx->typed_data();
    dcmha_grads(a, dwq->typed_data(), dwq->element_count(), dkw1->typed_data(),
                dkw2->typed_data(), dkw1->element_count(), dkdd->typed_data(),
                dkdd->element_count(), flags);
    if (dcmha_compose_backward(&a)) return ffi::Error::Internal("dcmha compose: out of memory");
    return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DcmhaComposeForward, Forward,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("flags"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DcmhaComposeBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Arg<F32>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("flags"));
"""

#: TensorFlow CPU ops around the kernel (``tf.load_op_library``): DcmhaComposeForward(x, wq,
#: kw1, kw2, kdd; flags) -> out and DcmhaComposeBackward(x, g, wq, kw1, kw2, kdd; flags) ->
#: (dx, dwq, dkw1, dkw2, dkdd), the same arrays as the FFI handlers.
_TF_SOURCE = _CXX_COMMON + r"""
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

using namespace tensorflow;

static absl::Status same_shapes(shape_inference::InferenceContext *c, int first_input) {
    for (int i = 0; i < c->num_outputs(); i++) c->set_output(i, c->input(first_input + i));
    return absl::OkStatus();
}

REGISTER_OP("DcmhaComposeForward")
    .Input("x: float").Input("wq: float").Input("kw1: float").Input("kw2: float")
    .Input("kdd: float").Output("out: float").Attr("flags: int")
    .SetShapeFn([](shape_inference::InferenceContext *c) { return same_shapes(c, 0); });

REGISTER_OP("DcmhaComposeBackward")
    .Input("x: float").Input("g: float").Input("wq: float").Input("kw1: float")
    .Input("kw2: float").Input("kdd: float")
    .Output("dx: float").Output("dwq: float").Output("dkw1: float").Output("dkw2: float")
    .Output("dkdd: float").Attr("flags: int")
    .SetShapeFn([](shape_inference::InferenceContext *c) {
        c->set_output(0, c->input(0));
        for (int i = 1; i < 5; i++) c->set_output(i, c->input(i + 1));
        return absl::OkStatus();
    });

static void check_x(OpKernelContext *c, const Tensor &x) {
    OP_REQUIRES(c, x.dims() == 5,
                errors::InvalidArgument("dcmha compose: x must be (B, G, M, t, s), got rank ",
                                        x.dims()));
}

static void fill_from(Args &a, const Tensor &x, const Tensor &wq, const Tensor &kw1,
                      const Tensor &kw2, const Tensor &kdd, int64_t flags) {
    int64_t d[5];
    for (int i = 0; i < 5; i++) d[i] = x.dim_size(i);
    const int64_t R = kw1.dims() == 5 ? kw1.dim_size(2) : 1;
    dcmha_fill(a, d, R, x.flat<float>().data(), wq.flat<float>().data(),
               kw1.flat<float>().data(), kw2.flat<float>().data(), kdd.flat<float>().data(),
               flags);
}

/* Both ops: the "flags" attribute, read once. */
class DcmhaComposeOp : public OpKernel {
  public:
    explicit DcmhaComposeOp(OpKernelConstruction *c) : OpKernel(c) {
        OP_REQUIRES_OK(c, c->GetAttr("flags", &flags_));
    }
  protected:
    int64_t flags_;
};

class DcmhaComposeForwardOp : public DcmhaComposeOp {
  public:
    using DcmhaComposeOp::DcmhaComposeOp;
    void Compute(OpKernelContext *c) override {
        const Tensor &x = c->input(0);
        check_x(c, x);
        if (!c->status().ok()) return;
        Tensor *out = nullptr;
        OP_REQUIRES_OK(c, c->allocate_output(0, x.shape(), &out));
        Args a;
        fill_from(a, x, c->input(1), c->input(2), c->input(3), c->input(4), flags_);
        a.out = out->flat<float>().data();
        OP_REQUIRES(c, dcmha_compose_forward(&a) == 0,
                    errors::ResourceExhausted("dcmha compose: out of memory"));
    }
};

class DcmhaComposeBackwardOp : public DcmhaComposeOp {
  public:
    using DcmhaComposeOp::DcmhaComposeOp;
    void Compute(OpKernelContext *c) override {
        const Tensor &x = c->input(0);
        check_x(c, x);
        if (!c->status().ok()) return;
        Tensor *outs[5];
        for (int i = 0; i < 5; i++)
            OP_REQUIRES_OK(c, c->allocate_output(i, c->input(i == 0 ? 0 : i + 1).shape(),
                                                 &outs[i]));
        Args a;
        fill_from(a, x, c->input(2), c->input(3), c->input(4), c->input(5), flags_);
        a.g = c->input(1).flat<float>().data();
        a.out = outs[0]->flat<float>().data();
        dcmha_grads(a, outs[1]->flat<float>().data(), outs[1]->NumElements(),
                    outs[2]->flat<float>().data(), outs[3]->flat<float>().data(),
                    outs[2]->NumElements(), outs[4]->flat<float>().data(),
                    outs[4]->NumElements(), flags_);
        OP_REQUIRES(c, dcmha_compose_backward(&a) == 0,
                    errors::ResourceExhausted("dcmha compose: out of memory"));
    }
};

REGISTER_KERNEL_BUILDER(Name("DcmhaComposeForward").Device(DEVICE_CPU), DcmhaComposeForwardOp);
REGISTER_KERNEL_BUILDER(Name("DcmhaComposeBackward").Device(DEVICE_CPU), DcmhaComposeBackwardOp);
"""


def _kernel_object_step():
    """The build step compiling the C kernel to an object file (for the C++ wrappers)."""
    cc = _compiler("CC", ("cc", "gcc", "clang"))
    return (cc, [f for f in _FLAGS if f != "-shared"] + ["-c"], _SOURCE, ".c")


def _cxx():
    return _compiler("CXX", ("c++", "g++", "clang++"))


def build_ffi_library(include_dir):
    """The kernel with its XLA FFI handlers (``DcmhaComposeForward`` / ``Backward``), built
    against the FFI headers in ``include_dir``; (ctypes.CDLL, None) or (None, reason)."""
    # "{obj}": the kernel's object file (no recognised suffix: passed to the linker)
    flags = ["-O2", "-std=c++17", "-shared", "-fPIC", f"-I{include_dir}", "{obj}"]
    return build_library("compose_xla_ffi", [_kernel_object_step(),
                                             (_cxx(), flags, _FFI_SOURCE, ".cc")],
                         key_parts=(include_dir,))


def build_tf_library(compile_flags, link_flags):
    """The kernel as TensorFlow ops (see ``_TF_SOURCE``), built with TensorFlow's
    ``tf.sysconfig`` flags; (path of the library, None) or (None, reason). The library is
    not opened here: ``tf.load_op_library`` must be the first to load it."""
    # -w: TensorFlow's headers warn about their own deprecations by the hundred
    flags = ["-O2", "-w", "-std=c++17", "-shared", "-fPIC", *compile_flags, "{obj}"]
    return build_library("compose_tf", [_kernel_object_step(),
                                        (_cxx(), flags, _TF_SOURCE, ".cc", tuple(link_flags))],
                         load=False)


def _view(args, prefix, x, names):
    """Set ``prefix`` (pointer) and the strides ``names`` from tensor x (None: NULL)."""
    if x is None:
        setattr(args, prefix, None)
        return
    setattr(args, prefix, x.data_ptr())
    for name, st in zip(names, x.stride()):
        setattr(args, name, st)


def _args(x5, out5, st, G, M, R, s):
    wq, kw1, kw2, kdd = st
    B, t = x5.shape[0], x5.shape[1]
    a = _Args(B=B, t=t, G=G, M=M, R=R, s=s)
    _view(a, "x", x5, ("x_b", "x_i", "x_n"))
    _view(a, "out", out5, ("o_b", "o_i", "o_n"))
    _view(a, "wq", wq, ("wq_b", "wq_i", "wq_n", "wq_m"))
    if wq is not None:                      # block diagonal: group g's block at (gM, gM)
        a.wq_g = M * (a.wq_n + a.wq_m)
    _view(a, "kw1", kw1, ("kw_b", "kw_g", "kw_r", "kw_m"))
    a.kw2 = None if kw2 is None else kw2.data_ptr()
    _view(a, "kdd", kdd, ("kd_b", "kd_g", "kd_m"))
    return a


def compose_forward(lib, x, out, st, G, R):
    """out = Compose(x) for a block; x, out (B, t, N, s) views (out may be x).

    st = (wq rows of the block (B, t, N, N) or None, kw1, kw2 (B, G, R, M, s) or
    None, kdd (B, G, M, s) or None), every array float32 with a contiguous last
    axis; kw2's strides must equal kw1's.
    """
    B, t, N, s = x.shape
    a = _args(x, out, st, G, N // G, R, s)
    if lib.dcmha_compose_forward(ctypes.byref(a)):
        raise MemoryError("dcmha C kernel: out of memory for its chunk buffer")
    return out


def compose_backward(lib, x, g, dx, st, dst, G, R):
    """dx = dCompose/dx^T g for a block and d(terms) accumulated (dx may be g).

    dst = (d_wq rows (B, t, N, N) (written by +=, the diagonal blocks only),
    d_kw1, d_kw2 (B, G, R, M, s), d_kdd (B, G, M, s)), None where the term is
    absent; d_kw2's strides must equal d_kw1's.
    """
    B, t, N, s = x.shape
    a = _args(x, dx, st, G, N // G, R, s)
    _view(a, "g", g, ("g_b", "g_i", "g_n"))
    d_wq, d_kw1, d_kw2, d_kdd = dst
    _view(a, "dwq", d_wq, ("dwq_b", "dwq_i", "dwq_n", "dwq_m"))
    if d_wq is not None:
        a.dwq_g = (N // G) * (a.dwq_n + a.dwq_m)
    _view(a, "dkw1", d_kw1, ("dkw_b", "dkw_g", "dkw_r", "dkw_m"))
    a.dkw2 = None if d_kw2 is None else d_kw2.data_ptr()
    _view(a, "dkdd", d_kdd, ("dkd_b", "dkd_g", "dkd_m"))
    if lib.dcmha_compose_backward(ctypes.byref(a)):
        raise MemoryError("dcmha C kernel: out of memory for its chunk buffer")
    return dx
