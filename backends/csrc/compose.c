/* The dcmha compose kernel (CPU, float32): one score block's compose, and its backward, in
   one pass over the block. See the package dcmha/backends/cpu_kernel/ for what it computes
   and how it is built and loaded, and dcmha_args.h for its argument block.

   Per (batch, query row, group) the forward loads the M heads' values at VL keys at a time
   (one vector register each: VL floats, 16 with AVX-512, else 8), applies every term in registers (residual, static and
   query-side terms as the per-query M x M matrix wq; key-side rank-R terms; key-side
   gating) and writes the result once. The backward recomputes the key-side hidden values and
   accumulates every term gradient in the same pass. (M, R) with M in 1, 2, 4, 8, 16 and R in
   1, 2, 4 are compiled with M and R fixed; other sizes, and the last s % VL keys, run
   generic loops. In a causal block (Args.causal) the compiled rows stop after each row's
   last visible key, rounded up to VL, and write zeros past it.

   Compiles on its own: cc -O3 -march=native -fopenmp-simd -std=c11 -shared -fPIC compose.c */
#include <math.h>
#include <stdint.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "dcmha_args.h"

/* Keys per chunk of the generic loops (the chunk of M rows stays in L1). */
#define CH 64

DCMHA_DEFINE_ARGS_LAYOUT(dcmha_args_layout, dcmha_args_names)

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

/* Floats per vector: one register of the widest vector unit the build targets. A wider
   vector than the registers (16 floats on AVX2's 256-bit registers) spills the M rows of
   X and O to the stack in every loop below: measured 2x slower at M = 8. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#define VCH 128                     /* keys per chunk (the chunk's key-side terms stay in L1) */
typedef float vf __attribute__((vector_size(4 * VL), aligned(4)));
#define LD(p) (*(const vf *)(p))
#define ST(p, v) (*(vf *)(p) = (v))
#define INLINE static inline __attribute__((always_inline))

/* (by pointer: a 64-byte vector passed by value draws GCC's -Wpsabi note without AVX-512) */
INLINE float hsum(const vf *v) {
    float t = 0.0f;
    for (int l = 0; l < VL; l++) t += (*v)[l];
    return t;
}

/* One past row i's last visible key in a causal block (Args.causal): i + causal_off + 1,
   not yet clipped to the keys (it may be <= 0, or past them). */
INLINE int64_t causal_end(const Args *a, int64_t i) {
    return i + a->causal_off + 1;
}

/* Keys of row i that a causal stage leaves visible: all s, or [0, causal_end) clipped to
   [0, s]. */
INLINE int64_t visible_keys(const Args *a, int64_t i, int64_t s) {
    if (!a || !a->causal) return s;
    const int64_t n = causal_end(a, i);
    return n < 0 ? 0 : n < s ? n : s;
}

/* n keys rounded up to whole vectors, at most s: where a row's vector work ends. */
INLINE int64_t vector_end(int64_t n, int64_t s) {
    const int64_t e = (n + VL - 1) / VL * VL;
    return e < s ? e : s;
}

/* Where row i's vectorised keys end: visible_keys(a, i, jv) rounded up to whole vectors, so
   jv, or in a causal block the first multiple of VL past its last visible key, at most jv.
   Not written as vector_end(visible_keys(...)): clipping to jv before rounding (the same
   result) makes GCC compile the vectorised kernels' loops differently; from causal_end,
   they compile as before. */
INLINE int64_t row_end(const Args *a, int64_t i, int64_t jv) {
    if (!a->causal) return jv;
    const int64_t n = causal_end(a, i);
    if (n <= 0) return 0;
    return vector_end(n, jv);
}

/* Zeros into the M rows (stride n) of row at keys [j0, j1) (multiples of VL). */
INLINE void zero_rows(float *row, int64_t n, int64_t j0, int64_t j1, const int M) {
    for (int64_t j = j0; j < j1; j += VL)
        _Pragma("GCC unroll 16") for (int m = 0; m < M; m++) ST(row + m * n + j, (vf){0});
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
            const int64_t je = row_end(a, i, jv), jc = je < j1 ? (je > j0 ? je : j0) : j1;
            zero_rows(orow, a->o_n, jc, j1, M);     /* masked keys (a causal block) */
            for (int64_t j = j0; j < jc; j += VL) {
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
                dwq[n0 * a->dwq_n + m * a->dwq_m] += hsum(&A0[m]);
                if (two) dwq[(n0 + 1) * a->dwq_n + m * a->dwq_m] += hsum(&A1[m]);
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
        const int64_t je = row_end(a, i, jv);   /* keys [je, jv) masked: dx 0, no gradient */
        if (a->wq) backward_wq_row(a, b, gi, i, je, M);   /* reads g before dx overwrites it */
        {
            const int64_t j0 = 0, j1 = je;
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
            zero_rows(orow, a->o_n, j1, jv, M);
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

/* a narrowed to batch rows [b, b + nb) and groups [g, g + ng): every array pointer moved to
   the first of its (b, g) slices (absent arrays stay NULL), the strides kept. */
static Args narrowed(const Args *a, int64_t b, int64_t nb, int64_t g, int64_t ng) {
    Args p = *a;
    const int64_t M = a->M;
    p.B = nb;
    p.G = ng;
    if (a->x) p.x = a->x + b * a->x_b + g * M * a->x_n;
    if (a->out) p.out = a->out + b * a->o_b + g * M * a->o_n;
    if (a->g) p.g = a->g + b * a->g_b + g * M * a->g_n;
    if (a->wq) p.wq = a->wq + b * a->wq_b + g * a->wq_g;
    if (a->dwq) p.dwq = a->dwq + b * a->dwq_b + g * a->dwq_g;
    if (a->kw1) p.kw1 = a->kw1 + b * a->kw_b + g * a->kw_g;
    if (a->kw2) p.kw2 = a->kw2 + b * a->kw_b + g * a->kw_g;
    if (a->dkw1) p.dkw1 = a->dkw1 + b * a->dkw_b + g * a->dkw_g;
    if (a->dkw2) p.dkw2 = a->dkw2 + b * a->dkw_b + g * a->dkw_g;
    if (a->kdd) p.kdd = a->kdd + b * a->kd_b + g * a->kd_g;
    if (a->dkdd) p.dkdd = a->dkdd + b * a->dkd_b + g * a->dkd_g;
    return p;
}

/* Each (b, g) slice reads and writes only its own rows of every array (the term gradients
   are per batch row and group, none summed over b or g), and within a slice the work runs
   in the order of the whole call (the vectorised keys, then the generic tail); so any
   partition of the slices gives the whole call's results bit for bit. The range runs as at
   most three rectangles: the rest of a first partial batch row, whole batch rows, and the
   start of a last partial one. */
int dcmha_compose_slices(const Args *a, int backward, int64_t begin, int64_t end) {
    int (*run)(const Args *) = backward ? dcmha_compose_backward : dcmha_compose_forward;
    const int64_t G = a->G, n = a->B * a->G;
    if (begin < 0) begin = 0;
    if (end > n) end = n;
    int failed = 0;
    while (begin < end && !failed) {
        const int64_t b = begin / G, g = begin % G;
        Args p;
        if (g == 0 && end - begin >= G) {
            const int64_t nb = (end - begin) / G;
            p = narrowed(a, b, nb, 0, G);
            begin += nb * G;
        } else {
            const int64_t ng = G - g < end - begin ? G - g : end - begin;
            p = narrowed(a, b, 1, g, ng);
            begin += ng;
        }
        failed = run(&p);
    }
    return failed;
}

/* Floats of x (each (b, g) slice holds M t s) below which a chunk is not split off: a hand-over
   to a pool thread and the wait for it cost microseconds, which a smaller chunk's work would
   not repay. */
#define SPLIT_MIN_FLOATS 16384

int64_t dcmha_compose_chunks(const Args *a, int64_t threads) {
    const int64_t slices = a->B * a->G, per_slice = a->M * a->t * a->s;
    if (threads <= 1 || slices <= 1 || per_slice <= 0) return 1;
    const int64_t by_size = per_slice >= SPLIT_MIN_FLOATS
                                ? slices : slices * per_slice / SPLIT_MIN_FLOATS;
    int64_t n = threads < slices ? threads : slices;
    if (by_size < n) n = by_size;
    return n < 1 ? 1 : n;
}

void dcmha_fill_args(Args *a, const int64_t *d, int64_t R, const float *x, const float *wq,
                     const float *kw1, const float *kw2, const float *kdd, int64_t flags) {
    memset(a, 0, sizeof *a);
    a->B = d[0]; a->G = d[1]; a->M = d[2]; a->t = d[3]; a->s = d[4];
    const int64_t ts = a->t * a->s, M = a->M;
    a->x = x; a->x_b = a->G * M * ts; a->x_i = a->s; a->x_n = ts;
    a->o_b = a->x_b; a->o_i = a->x_i; a->o_n = a->x_n;
    a->g_b = a->x_b; a->g_i = a->x_i; a->g_n = a->x_n;
    if (flags & DCMHA_HAS_WQ) {
        a->wq = wq;
        a->wq_b = a->t * a->G * M * M; a->wq_i = a->G * M * M; a->wq_g = M * M;
        a->wq_n = M; a->wq_m = 1;
        a->dwq_b = a->wq_b; a->dwq_i = a->wq_i; a->dwq_g = a->wq_g; a->dwq_n = M; a->dwq_m = 1;
    }
    a->R = (flags & DCMHA_HAS_KW) ? R : 1;
    if (flags & DCMHA_HAS_KW) {
        a->kw1 = kw1; a->kw2 = kw2;
        a->kw_m = a->s; a->kw_r = M * a->s; a->kw_g = a->R * M * a->s; a->kw_b = a->G * a->kw_g;
        a->dkw_b = a->kw_b; a->dkw_g = a->kw_g; a->dkw_r = a->kw_r; a->dkw_m = a->kw_m;
    }
    if (flags & DCMHA_HAS_KDD) {
        a->kdd = kdd;
        a->kd_m = a->s; a->kd_g = M * a->s; a->kd_b = a->G * a->kd_g;
        a->dkd_b = a->kd_b; a->dkd_g = a->kd_g; a->dkd_m = a->kd_m;
    }
    if (flags & DCMHA_CAUSAL) {
        a->causal = 1;
        a->causal_off = (flags - (flags & ((1 << DCMHA_CAUSAL_SHIFT) - 1)))
                        / (1 << DCMHA_CAUSAL_SHIFT);
    }
}

#if defined(__AVX__)
/* The 8 x 8 block at src (rows ss floats apart) transposed into dst (rows ds apart). */
static inline void transpose8(const float *src, int64_t ss, float *dst, int64_t ds) {
    __m256 r[8], t[8], u[8];
    for (int k = 0; k < 8; k++) r[k] = _mm256_loadu_ps(src + k * ss);
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);       /* rows k, k+1: columns 0 1 | 4 5 */
        t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);   /*              columns 2 3 | 6 7 */
    }
    for (int k = 0; k < 8; k += 4)
        for (int h = 0; h < 2; h++) {                    /* four rows' column c | c + 4 */
            u[k + 2 * h] = _mm256_shuffle_ps(t[k + h], t[k + h + 2], _MM_SHUFFLE(1, 0, 1, 0));
            u[k + 2 * h + 1] = _mm256_shuffle_ps(t[k + h], t[k + h + 2], _MM_SHUFFLE(3, 2, 3, 2));
        }
    for (int c = 0; c < 4; c++) {
        _mm256_storeu_ps(dst + c * ds, _mm256_permute2f128_ps(u[c], u[c + 4], 0x20));
        _mm256_storeu_ps(dst + (c + 4) * ds, _mm256_permute2f128_ps(u[c], u[c + 4], 0x31));
    }
}
#endif

/* dst (B, G, rest, S) from src (B, S_b, G, rest) whose key positions lie `row_stride` floats
   apart (G * rest when contiguous; more for one slot's part of the decode cache's stacked
   entry), batch b from position b * b_rows (b_rows = S_b >= S: the first S of each batch's).
   With AVX, 8 keys x 8 of the G * rest values at a time by an in-register transpose. */
static void keys_last(const float *src, int64_t B, int64_t S, int64_t G, int64_t rest,
                      int64_t row_stride, int64_t b_rows, float *dst) {
    const int64_t n = G * rest;
#if defined(__AVX__)
    const int64_t s8 = S - S % 8, n8 = n - n % 8;
#else
    const int64_t s8 = 0, n8 = 0;
#endif
    for (int64_t b = 0; b < B; b++) {
        const float *sb = src + b * b_rows * row_stride;
        float *ob = dst + b * n * S;
#if defined(__AVX__)
        for (int64_t s0 = 0; s0 < s8; s0 += 8)
            for (int64_t i0 = 0; i0 < n8; i0 += 8)
                transpose8(sb + s0 * row_stride + i0, row_stride, ob + i0 * S + s0, S);
#endif
        for (int64_t i = 0; i < n; i++) {        /* what the blocks leave: scalar copies */
            const float *c = sb + i;
            float *o = ob + i * S;
            for (int64_t s = i < n8 ? s8 : 0; s < S; s++) o[s] = c[s * row_stride];
        }
    }
}

int64_t dcmha_cached_scratch(int64_t B, int64_t G, int64_t M, int64_t S, int64_t R,
                             int has_kw, int has_kdd) {
    return (has_kw ? 2 * B * G * R * M * S : 0) + (has_kdd ? B * G * M * S : 0);
}

/* dcmha_cached_args with the key positions of kw1 / kw2 kw_row floats apart and those of
   kdd kd_row apart (0: contiguous), and each batch's key terms k_rows positions long (the
   first S used). */
static void cached_args_rows(Args *a, int64_t B, int64_t G, int64_t M, int64_t T, int64_t S,
                             int64_t R, const float *x, float *out, const float *wq,
                             int64_t wq_b, int64_t wq_t, const float *kw1, const float *kw2,
                             const float *kdd, int64_t kw_row, int64_t kd_row, int64_t k_rows,
                             float *scratch) {
    const int64_t n_kw = kw1 ? B * G * R * M * S : 0;
    float *k1 = scratch, *k2 = scratch + n_kw, *kd = scratch + 2 * n_kw;
    if (kw1) {
        keys_last(kw1, B, S, G, R * M, kw_row ? kw_row : G * R * M, k_rows, k1);
        keys_last(kw2, B, S, G, R * M, kw_row ? kw_row : G * R * M, k_rows, k2);
    }
    if (kdd) keys_last(kdd, B, S, G, M, kd_row ? kd_row : G * M, k_rows, kd);
    const int64_t d[5] = {B, G, M, T, S};
    const int64_t flags = (wq ? DCMHA_HAS_WQ : 0) | (kw1 ? DCMHA_HAS_KW : 0)
                          | (kdd ? DCMHA_HAS_KDD : 0);
    dcmha_fill_args(a, d, R, x, wq, k1, k2, kd, flags);
    a->out = out;
    if (wq) {                       /* (wq_b, G, wq_t, M, M): a size-1 axis is broadcast */
        a->wq_b = wq_b == 1 ? 0 : G * wq_t * M * M;
        a->wq_g = wq_t * M * M;
        a->wq_i = wq_t == 1 ? 0 : M * M;
    }
}

void dcmha_cached_args(Args *a, int64_t B, int64_t G, int64_t M, int64_t T, int64_t S,
                       int64_t R, const float *x, float *out, const float *wq, int64_t wq_b,
                       int64_t wq_t, const float *kw1, const float *kw2, const float *kdd,
                       int64_t k_rows, float *scratch) {
    cached_args_rows(a, B, G, M, T, S, R, x, out, wq, wq_b, wq_t, kw1, kw2, kdd, 0, 0, k_rows,
                     scratch);
}

void dcmha_query_matrix(int64_t B, int64_t T, int64_t G, int64_t M, int64_t R,
                        const float *qw1, const float *qw2, const float *qdd, const float *st,
                        float *wq, int groups_first) {
    for (int64_t i = 0; i < B * T * G; i++) {   /* row i = (b, t, g) of the terms */
        const int64_t g = i % G, t = (i / G) % T, b = i / (G * T);
        float *w = wq + (groups_first ? (b * G + g) * T + t : i) * M * M;
        for (int64_t n = 0; n < M; n++)
            for (int64_t m = 0; m < M; m++) {
                float v = n == m ? 1.0f + (qdd ? qdd[i * M + n] : 0.0f) : 0.0f;
                if (qw1)
                    for (int64_t r = 0; r < R; r++)
                        v += qw1[(i * R + r) * M + m] * qw2[(i * R + r) * M + n];
                if (st) v += st[(g * M + m) * M + n];
                w[n * M + m] = v;
            }
    }
}

void dcmha_query_matrix_backward(int64_t B, int64_t T, int64_t G, int64_t M, int64_t R,
                                 const float *qw1, const float *qw2, const float *dwq,
                                 float *dqw1, float *dqw2, float *dqdd, float *dst) {
    if (dst) memset(dst, 0, sizeof(float) * (size_t)(G * M * M));
    for (int64_t i = 0; i < B * T * G; i++) {   /* row i = (b, t, g) of the terms */
        const float *d = dwq + i * M * M;       /* d[n, m] = dL/dwq[n, m] */
        if (dqdd)
            for (int64_t n = 0; n < M; n++) dqdd[i * M + n] = d[n * M + n];
        if (dqw1)
            for (int64_t r = 0; r < R; r++) {
                const float *a = qw1 + (i * R + r) * M, *c = qw2 + (i * R + r) * M;
                float *da = dqw1 + (i * R + r) * M, *dc = dqw2 + (i * R + r) * M;
                for (int64_t m = 0; m < M; m++) da[m] = 0.0f;
                for (int64_t n = 0; n < M; n++) {
                    float v = 0.0f;
                    for (int64_t m = 0; m < M; m++) {
                        da[m] += d[n * M + m] * c[n];
                        v += d[n * M + m] * a[m];
                    }
                    dc[n] = v;
                }
            }
        if (dst) {
            float *w = dst + (i % G) * M * M;
            for (int64_t n = 0; n < M; n++)
                for (int64_t m = 0; m < M; m++) w[m * M + n] += d[n * M + m];
        }
    }
}

/* dcmha_compose_cached with key rows kw_row / kd_row floats apart (0: contiguous). */
static int compose_cached_rows(int64_t B, int64_t G, int64_t M, int64_t T, int64_t S,
                               int64_t Rq, int64_t Rk, const float *x, float *out,
                               const float *qw1, const float *qw2, const float *qdd,
                               const float *st, const float *kw1, const float *kw2,
                               const float *kdd, int64_t kw_row, int64_t kd_row) {
    const int64_t n_wq = (qw1 || qdd || st) ? B * T * G * M * M : 0;
    const int64_t n = n_wq + dcmha_cached_scratch(B, G, M, S, Rk, kw1 != 0, kdd != 0);
    float *scratch = n ? (float *)malloc(sizeof(float) * (size_t)n) : 0;
    if (n && !scratch) return 1;
    float *wq = n_wq ? scratch : 0;
    if (wq) dcmha_query_matrix(B, T, G, M, Rq, qw1, qw2, qdd, st, wq, 0);
    Args a;
    cached_args_rows(&a, B, G, M, T, S, Rk, x, out, wq, B, T, kw1, kw2, kdd, kw_row, kd_row, S,
                     scratch + n_wq);
    const int failed = dcmha_compose_forward(&a);
    free(scratch);
    return failed;
}

int dcmha_compose_cached(int64_t B, int64_t G, int64_t M, int64_t T, int64_t S, int64_t Rq,
                         int64_t Rk, const float *x, float *out, const float *qw1,
                         const float *qw2, const float *qdd, const float *st,
                         const float *kw1, const float *kw2, const float *kdd) {
    return compose_cached_rows(B, G, M, T, S, Rq, Rk, x, out, qw1, qw2, qdd, st, kw1, kw2, kdd,
                               0, 0);
}

/* exp(x) of VL lanes with x <= 0 (a softmax's shifted scores): 2^k p(r) with
   k = round(x log2 e), r = x - k ln 2 (two-part ln 2) and p the degree-7 Taylor polynomial
   (relative error ~1e-8 on |r| <= ln2 / 2, below float32's rounding); 0 below -87.3 (where
   float32's exp underflows), so masked keys get exactly 0. */
typedef int32_t vi __attribute__((vector_size(4 * VL), aligned(4)));
INLINE vf vexp(vf x) {
    const vf zero = {0}, lo = zero - 87.3f;
    const vi under = x < lo;
    x = (vf)(((vi)x & ~under) | ((vi)lo & under));
    const vf k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   /* round */
    const vf r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
    vf p = r * (1.0f / 5040) + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi scale = (__builtin_convertvector(k, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)scale) & ~under);
}

/* A row of S floats as its softmax, in place, in float32 (the maximum subtracted; the
   exponentials by vexp, VL at a time): entries at or below -87.3 under the maximum, such
   as masked scores, get exactly 0. */
static void softmax_row(float *row, int64_t S) {
    const int64_t sv = S - S % VL;
    float mx = -INFINITY;
    if (sv) {                                 /* the maximum, VL lanes at a time */
        vf vm = LD(row);
        for (int64_t s = VL; s < sv; s += VL) {
            const vf v = LD(row + s);
            const vi gt = v > vm;
            vm = (vf)(((vi)v & gt) | ((vi)vm & ~gt));
        }
        for (int l = 0; l < VL; l++) mx = vm[l] > mx ? vm[l] : mx;
    }
    for (int64_t s = sv; s < S; s++) mx = row[s] > mx ? row[s] : mx;
    vf sum = {0};
    for (int64_t s = 0; s < sv; s += VL) {
        const vf e = vexp(LD(row + s) - mx);
        ST(row + s, e);
        sum += e;
    }
    float total = hsum(&sum);
    for (int64_t s = sv; s < S; s++) total += row[s] = expf(row[s] - mx);
    const float inv = 1.0f / total;
    for (int64_t s = 0; s < S; s++) row[s] *= inv;
}

/* The rows of x (n rows of S) as softmax(where(mask, x, masked)) into p (p may be x); row i
   reads mask + mask_row(i) (a row of mask_s values, a size-1 row broadcast), NULL: no mask. */
static void masked_softmax(const float *x, float *p, int64_t B, int64_t N, int64_t S,
                           const uint8_t *mask, int64_t mask_b, int64_t mask_n,
                           int64_t mask_s, float masked) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t n = 0; n < N; n++) {
            const float *xr = x + (b * N + n) * S;
            float *pr = p + (b * N + n) * S;
            const uint8_t *mr = mask ? mask + ((mask_b == 1 ? 0 : b) * mask_n
                                               + (mask_n == 1 ? 0 : n)) * mask_s : 0;
            for (int64_t s = 0; s < S; s++)
                pr[s] = mr && !mr[mask_s == 1 ? 0 : s] ? masked : xr[s];
            softmax_row(pr, S);
        }
}

int dcmha_decode_probs(int64_t B, int64_t G, int64_t M, int64_t S, const float *x, float *p,
                       const uint8_t *mask, int64_t mask_b, int64_t mask_n, int64_t mask_s,
                       float masked, int64_t pre_rq, int64_t pre_rk, const float *pre_qw1,
                       const float *pre_qw2, const float *pre_qdd, const float *pre_static,
                       const float *pre_kw1, const float *pre_kw2, const float *pre_kdd,
                       int64_t pre_kw_row, int64_t pre_kd_row,
                       int64_t post_rq, int64_t post_rk, const float *post_qw1,
                       const float *post_qw2, const float *post_qdd, const float *post_static,
                       const float *post_kw1, const float *post_kw2, const float *post_kdd,
                       int64_t post_kw_row, int64_t post_kd_row) {
    const int has_pre = pre_qw1 || pre_qdd || pre_static || pre_kw1 || pre_kdd;
    const int has_post = post_qw1 || post_qdd || post_static || post_kw1 || post_kdd;
    float *tmp = has_post ? (float *)malloc(sizeof(float) * (size_t)(B * G * M * S)) : 0;
    if (has_post && !tmp) return 1;
    float *probs = has_post ? tmp : p;       /* the softmax's output */
    if (has_pre) {                           /* composed scores, straight into probs */
        if (compose_cached_rows(B, G, M, 1, S, pre_rq, pre_rk, x, probs, pre_qw1, pre_qw2,
                                pre_qdd, pre_static, pre_kw1, pre_kw2, pre_kdd, pre_kw_row,
                                pre_kd_row)) {
            free(tmp);
            return 1;
        }
        x = probs;
    }
    masked_softmax(x, probs, B, G * M, S, mask, mask_b, mask_n, mask_s, masked);
    int failed = 0;
    if (has_post)
        failed = compose_cached_rows(B, G, M, 1, S, post_rq, post_rk, probs, p, post_qw1,
                                     post_qw2, post_qdd, post_static, post_kw1, post_kw2,
                                     post_kdd, post_kw_row, post_kd_row);
    free(tmp);
    return failed;
}

/* Each of n rows of S floats (row i at x + i * S) as softmax(row + bias row), in place, in
   float32; bias row i at bias + i * bias_i (S floats). */
static void bias_softmax_rows(float *x, int64_t n, int64_t S, const float *bias,
                              int64_t bias_i) {
    for (int64_t i = 0; i < n; i++) {
        float *row = x + i * S;
        const float *br = bias + i * bias_i;
        for (int64_t s = 0; s < S; s++) row[s] += br[s];
        softmax_row(row, S);
    }
}

/* Rows per block of dcmha_probs_rows: a block's (B, N, rows, S) scores stay in L2. */
#define PROBS_ROWS 8

int dcmha_probs_rows(const Args *pre, const Args *post, const float *x, float *out,
                     const float *bias, int64_t bias_b, int64_t B, int64_t N, int64_t T,
                     int64_t S, int64_t r0, int64_t r1) {
    const int64_t rows = r1 - r0 < PROBS_ROWS ? r1 - r0 : PROBS_ROWS;
    float *tmp = (float *)malloc(sizeof(float) * (size_t)(B * N * (rows > 0 ? rows : 1) * S));
    if (!tmp) return 1;
    int failed = 0;
    for (int64_t i0 = r0; i0 < r1 && !failed; i0 += PROBS_ROWS) {
        const int64_t tb = r1 - i0 < PROBS_ROWS ? r1 - i0 : PROBS_ROWS;
        /* x's rows [i0, i0 + tb) -> tmp (B, N, tb, S): composed, or copied */
        if (pre) {
            Args a = *pre;
            a.t = tb;
            a.x = x + i0 * S;
            a.out = tmp; a.o_b = N * tb * S; a.o_n = tb * S; a.o_i = S;
            if (a.wq) a.wq += i0 * a.wq_i;
            failed = dcmha_compose_forward(&a);
        } else {
            for (int64_t bn = 0; bn < B * N; bn++)
                memcpy(tmp + bn * tb * S, x + (bn * T + i0) * S, sizeof(float) * (size_t)(tb * S));
        }
        for (int64_t b = 0; b < B; b++)       /* + the mask's bias, softmax over the keys */
            for (int64_t n = 0; n < N; n++)
                bias_softmax_rows(tmp + (b * N + n) * tb * S, tb, S,
                                  bias + ((bias_b == 1 ? 0 : b) * T + i0) * S, S);
        if (post) {                           /* tmp -> out's rows: composed, or copied */
            Args a = *post;
            a.t = tb;
            a.x = tmp; a.x_b = N * tb * S; a.x_n = tb * S; a.x_i = S;
            a.out = out + i0 * S;
            if (a.wq) a.wq += i0 * a.wq_i;
            failed = failed || dcmha_compose_forward(&a);
        } else {
            for (int64_t bn = 0; bn < B * N; bn++)
                memcpy(out + (bn * T + i0) * S, tmp + bn * tb * S, sizeof(float) * (size_t)(tb * S));
        }
    }
    free(tmp);
    return failed;
}

/* ---- A training block's probabilities: Compose, masked softmax, Compose; and backward ---- */

/* The (M, t, s) rows of one slice as their masked softmax, in place: entries whose vis byte
   is 0 get `masked` (vis: (t, s), NULL: none), and in a causal block (c: a stage's Args)
   the keys past row i's last visible one are exactly 0 (a row with none is all 0). */
static void block_softmax(float *x, int64_t M, int64_t t, int64_t s, const uint8_t *vis,
                          float masked, const Args *c) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < t; i++) {
            float *row = x + (m * t + i) * s;
            const int64_t n = visible_keys(c, i, s);
            /* the softmax runs over whole vectors where the row has room: the keys from n
               to the vector's end get -inf, so exactly 0 (a scalar tail costs more) */
            const int64_t e = vector_end(n, s);     /* 0 when n is */
            if (vis)
                for (int64_t j = 0; j < n; j++)
                    if (!vis[i * s + j]) row[j] = masked;
            for (int64_t j = n; j < e; j++) row[j] = -INFINITY;
            if (n > 0) softmax_row(row, e);
            if (e < s) memset(row + e, 0, sizeof(float) * (size_t)(s - e));
        }
}

/* d = p * (d - sum_j p_j d_j) over each of the slice's (M, t, s) rows (the softmax's
   backward, in place); in a causal block only each row's visible keys (the rest of d is
   0 there, since p is). */
static void block_softmax_backward(float *d, const float *p, int64_t M, int64_t t, int64_t s,
                                   const Args *c) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < t; i++) {
            float *dr = d + (m * t + i) * s;
            const float *pr = p + (m * t + i) * s;
            const int64_t n = visible_keys(c, i, s);
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < n; j++) dot += pr[j] * dr[j];
#pragma omp simd
            for (int64_t j = 0; j < n; j++) dr[j] = pr[j] * (dr[j] - dot);
            if (n < s) memset(dr + n, 0, sizeof(float) * (size_t)(s - n));
        }
}

/* A stage's Args narrowed to slice (b, gi), with its block arrays at the slice's x, out, g. */
static Args stage_slice(const Args *a, int64_t b, int64_t gi, const float *x, float *out,
                        const float *g) {
    Args p = narrowed(a, b, 1, gi, 1);
    p.x = x;
    p.out = out;
    p.g = g;
    return p;
}

int dcmha_block_probs_slices(const Args *pre, const Args *post, const float *x, float *p,
                             float *out, const uint8_t *vis, int64_t vis_b, float masked,
                             int backward, const float *g, float *dx, int64_t begin,
                             int64_t end) {
    const Args *c = pre ? pre : post;
    const int64_t B = c->B, G = c->G, M = c->M, t = c->t, s = c->s, n = M * t * s;
    if (begin < 0) begin = 0;
    if (end > B * G) end = B * G;
    for (int64_t k = begin; k < end; k++) {
        const int64_t b = k / G, gi = k % G;
        const float *xs = x + k * n;
        const uint8_t *vs = vis ? vis + (vis_b == 1 ? 0 : b) * t * s : 0;
        if (!backward) {
            float *ps = p + k * n, *os = out + k * n;
            if (pre) {
                const Args a = stage_slice(pre, b, gi, xs, ps, 0);
                if (dcmha_compose_forward(&a)) return 1;
            } else {
                memcpy(ps, xs, sizeof(float) * (size_t)n);
            }
            block_softmax(ps, M, t, s, vs, masked, c);
            if (post) {
                const Args a = stage_slice(post, b, gi, ps, os, 0);
                if (dcmha_compose_forward(&a)) return 1;
            } else {
                memcpy(os, ps, sizeof(float) * (size_t)n);
            }
        } else {
            const float *ps = p + k * n, *gs = g + k * n;
            float *ds = dx + k * n;
            if (post) {
                const Args a = stage_slice(post, b, gi, ps, ds, gs);
                if (dcmha_compose_backward(&a)) return 1;
            } else {
                memcpy(ds, gs, sizeof(float) * (size_t)n);
            }
            block_softmax_backward(ds, ps, M, t, s, c);
            if (pre) {
                const Args a = stage_slice(pre, b, gi, xs, ds, ds);
                if (dcmha_compose_backward(&a)) return 1;
            }
        }
    }
    return 0;
}

/* y[j] += sum_d x[d] w[d, j] for one row (j < n; w rows of n floats). */
static void row_times(const float *x, const float *w, int64_t D, int64_t n, float *y) {
    for (int64_t d = 0; d < D; d++) {
        const float xd = x[d], *wd = w + d * n;
        for (int64_t j = 0; j < n; j++) y[j] += xd * wd[j];
    }
}

void dcmha_dynamic_finish(int64_t BL, int64_t GC, int64_t K, int64_t R, int64_t M,
                          float *pre, int64_t ld, int64_t h_col, int64_t g_col,
                          const float *qkw, int gelu_approximate, float eps, float *w1,
                          float *w2, float *ddo) {
    const int64_t RM = R * M;
    for (int64_t i = 0; i < BL; i++) {
        if (qkw) {
            float *h = pre + i * ld + h_col;
            for (int64_t j = 0; j < GC * K; j++) {
                const float v = h[j];
                h[j] = gelu_approximate
                    ? 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)))
                    : 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
            }
            for (int64_t c = 0; c < GC; c++) {        /* w[c] = h[c] . qkw[c]: (2R, M) */
                float *o1 = w1 + (i * GC + c) * RM, *o2 = w2 + (i * GC + c) * RM;
                memset(o1, 0, sizeof(float) * (size_t)RM);
                memset(o2, 0, sizeof(float) * (size_t)RM);
                for (int64_t k = 0; k < K; k++) {
                    const float hk = h[c * K + k];
                    const float *q = qkw + (c * K + k) * 2 * RM;
                    for (int64_t j = 0; j < RM; j++) o1[j] += hk * q[j];
                    for (int64_t j = 0; j < RM; j++) o2[j] += hk * q[RM + j];
                }
                for (int64_t r = 0; r < R; r++) {     /* w1 rows over M: RMS-normalised */
                    float *row = o1 + r * M, sq = 0.0f;
                    for (int64_t m = 0; m < M; m++) sq += row[m] * row[m];
                    const float inv = 1.0f / sqrtf(sq / (float)M + eps);
                    for (int64_t m = 0; m < M; m++) row[m] *= inv;
                }
            }
        }
        if (ddo) {
            const float *g = pre + i * ld + g_col;
            float *o = ddo + i * GC * M;
            for (int64_t j = 0; j < GC * M; j++) o[j] = tanhf(g[j]);
        }
    }
}

int dcmha_dynamic_weights(int64_t BL, int64_t D, int64_t GC, int64_t K, int64_t R, int64_t M,
                          const float *x, const float *dw1, const float *qkw, const float *dd,
                          int gelu_approximate, float eps, float *w1, float *w2,
                          float *ddo) {
    /* one row's pre-activations: x dw1 (GC K values), then x dd (GC M) */
    const int64_t nh = dw1 ? GC * K : 0, ld = nh + (dd ? GC * M : 0);
    float *pre = (float *)malloc(sizeof(float) * (size_t)(ld ? ld : 1));
    if (!pre) return 1;
    for (int64_t i = 0; i < BL; i++) {
        const float *xi = x + i * D;
        memset(pre, 0, sizeof(float) * (size_t)ld);
        if (dw1) row_times(xi, dw1, D, nh, pre);
        if (dd) row_times(xi, dd, D, GC * M, pre + nh);
        dcmha_dynamic_finish(1, GC, K, R, M, pre, ld, 0, nh, dw1 ? qkw : 0, gelu_approximate,
                             eps, dw1 ? w1 + i * GC * R * M : 0, dw1 ? w2 + i * GC * R * M : 0,
                             dd ? ddo + i * GC * M : 0);
    }
    free(pre);
    return 0;
}

/* float16 <-> float32 (round to nearest even; infinities and NaNs kept): F16C's
   instructions where -march=native has them (8 at a time), else bit by bit. */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) {   /* zero or subnormal: m 2^-24, exact in float */
        const float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    const uint32_t bits = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return sign | 0x7c00 | (a > 0x7f800000u ? 0x200 : 0);
    if (a >= 0x477ff000u) return sign | 0x7c00;   /* >= 65520: past the largest half */
    if (a < 0x38800000u) {                         /* below 2^-14: subnormal half (or 0) */
        float v;
        memcpy(&v, &a, 4);
        return sign | (uint16_t)nearbyintf(v * 16777216.0f);   /* the product is exact */
    }
    uint32_t h = ((a >> 23) - 112) << 10 | ((a & 0x7fffff) >> 13);
    const uint32_t rest = a & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;   /* a carry moves into the exponent */
    return sign | (uint16_t)h;
}

void dcmha_half_to_float(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) f[i] = half_to_float(h[i]);
}

static void floats_to_half(const float *f, uint16_t *h, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) h[i] = float_to_half(f[i]);
}

void dcmha_round_to_half(float *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) v[i] = half_to_float(float_to_half(v[i]));
}

void dcmha_rope_rows(int64_t r0, int64_t r1, int64_t L, int64_t H, int64_t d, const void *x,
                     int64_t x_row, void *out0, void *out1, int64_t H0, int heads_first,
                     const float *c, const float *s, int f16) {
    const int64_t h2 = d / 2, item = f16 ? 2 : 4;
    float in[d], res[d];
    for (int64_t r = r0; r < r1; r++) {
        const float *cr = c + (r % L) * h2, *sr = s + (r % L) * h2;
        const int64_t b = r / L, l = r % L;
        for (int64_t h = 0; h < H; h++) {
            const int64_t hk = h < H0 ? h : h - H0, Hk = h < H0 ? H0 : H - H0;
            const int64_t at = heads_first ? ((b * Hk + hk) * L + l) * d : (r * Hk + hk) * d;
            const char *src = (const char *)x + (r * x_row + h * d) * item;
            char *dst = (char *)(h < H0 ? out0 : out1) + at * item;
            const float *xi = (const float *)src;
            float *o = (float *)dst;
            if (f16) {
                dcmha_half_to_float((const uint16_t *)src, in, d);
                xi = in;
                o = res;
            }
            for (int64_t i = 0; i < h2; i++) {
                const float u = xi[i], v = xi[i + h2];
                o[i] = u * cr[i] - v * sr[i];
                o[i + h2] = v * cr[i] + u * sr[i];
            }
            if (f16) floats_to_half(res, (uint16_t *)dst, d);
        }
    }
}
