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

static void dcmha_fill(Args &a, const int64_t *d, int64_t R, const float *x, const float *wq,
                       const float *kw1, const float *kw2, const float *kdd, int64_t flags) {
    dcmha_fill_args(&a, d, R, x, wq, kw1, kw2, kdd, flags);
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
