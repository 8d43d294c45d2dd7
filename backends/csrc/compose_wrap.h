/* What the framework wrappers of the compose kernel share (C++: xla_ffi.cc for jax.ffi,
   tf_op.cc for TensorFlow): filling Args for contiguous arrays.

   Arrays: x, out, g (B, G, M, t, s); wq, dwq (B, t, G, M, M) ([n, m]: out[n] = sum_m
   wq[n, m] x[m]); kw1, kw2 and their gradients (B, G, R, M, s); kdd, dkdd (B, G, M, s).
   ``flags`` says which terms are present (DCMHA_HAS_*; dcmha.backends.cpu_blocks.flags_of
   sets them); absent ones are passed as 1-element dummies.

   Each wrapper also exports its own view of the Args layout (DCMHA_DEFINE_ARGS_LAYOUT with
   dcmha_cxx_args_layout / dcmha_cxx_args_names), which the loader checks. */
#ifndef DCMHA_COMPOSE_WRAP_H
#define DCMHA_COMPOSE_WRAP_H

#include <cstring>

#include "dcmha_args.h"

enum : int64_t { DCMHA_HAS_WQ = 1, DCMHA_HAS_KW = 2, DCMHA_HAS_KDD = 4 };

static void dcmha_fill(Args &a, const int64_t *d, int64_t R, const float *x, const float *wq,
                       const float *kw1, const float *kw2, const float *kdd, int64_t flags) {
    std::memset(&a, 0, sizeof a);
    a.B = d[0]; a.G = d[1]; a.M = d[2]; a.t = d[3]; a.s = d[4];     /* x: (B, G, M, t, s) */
    const int64_t ts = a.t * a.s, M = a.M;
    a.x = x; a.x_b = a.G * M * ts; a.x_i = a.s; a.x_n = ts;
    a.o_b = a.x_b; a.o_i = a.x_i; a.o_n = a.x_n;
    a.g_b = a.x_b; a.g_i = a.x_i; a.g_n = a.x_n;
    if (flags & DCMHA_HAS_WQ) {
        a.wq = wq;
        a.wq_b = a.t * a.G * M * M; a.wq_i = a.G * M * M; a.wq_g = M * M; a.wq_n = M; a.wq_m = 1;
        a.dwq_b = a.wq_b; a.dwq_i = a.wq_i; a.dwq_g = a.wq_g; a.dwq_n = M; a.dwq_m = 1;
    }
    a.R = (flags & DCMHA_HAS_KW) ? R : 1;
    if (flags & DCMHA_HAS_KW) {
        a.kw1 = kw1; a.kw2 = kw2;
        a.kw_m = a.s; a.kw_r = M * a.s; a.kw_g = a.R * M * a.s; a.kw_b = a.G * a.kw_g;
        a.dkw_b = a.kw_b; a.dkw_g = a.kw_g; a.dkw_r = a.kw_r; a.dkw_m = a.kw_m;
    }
    if (flags & DCMHA_HAS_KDD) {
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
    if (flags & DCMHA_HAS_WQ) a.dwq = dwq;
    if (flags & DCMHA_HAS_KW) { a.dkw1 = dkw1; a.dkw2 = dkw2; }
    if (flags & DCMHA_HAS_KDD) a.dkdd = dkdd;
}

#endif /* DCMHA_COMPOSE_WRAP_H */
