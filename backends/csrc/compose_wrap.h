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
#include <initializer_list>

#include "dcmha_args.h"

/* Whether n (an array's element count) is the product of dims; false as well when a
   factor is negative or the product overflows int64 (no array holds that many). */
static bool dcmha_count_is(int64_t n, std::initializer_list<int64_t> dims) {
    int64_t p = 1;
    for (int64_t d : dims)
        if (d < 0 || __builtin_mul_overflow(p, d, &p)) return false;
    return n == p;
}

/* Why the terms do not fit x (B, G, M, t, s) = d with rank R (nullptr: they do), as the
   compose wrappers pass them: wq (B, t, G, M, M), kw1, kw2 (B, G, R, M, s), kdd
   (B, G, M, s), counted in elements; a term absent by flags is not read. Checked before
   the kernel runs, so that arrays a caller mis-shaped are refused, never read past. */
static const char *dcmha_terms_problem(const int64_t *d, int64_t R, int64_t n_wq,
                                       int64_t n_kw1, int64_t n_kw2, int64_t n_kdd,
                                       int64_t flags) {
    const int64_t B = d[0], G = d[1], M = d[2], t = d[3], s = d[4];
    if ((flags & DCMHA_HAS_WQ) && !dcmha_count_is(n_wq, {B, t, G, M, M}))
        return "dcmha compose: wq must be (B, t, G, M, M) for x (B, G, M, t, s)";
    if ((flags & DCMHA_HAS_KW) && (R < 1 || !dcmha_count_is(n_kw1, {B, G, R, M, s}) ||
                                   n_kw2 != n_kw1))
        return "dcmha compose: kw1 and kw2 must be (B, G, R, M, s) for x (B, G, M, t, s)";
    if ((flags & DCMHA_HAS_KDD) && !dcmha_count_is(n_kdd, {B, G, M, s}))
        return "dcmha compose: kdd must be (B, G, M, s) for x (B, G, M, t, s)";
    return nullptr;
}

static void dcmha_fill(Args &a, const int64_t *d, int64_t R, const float *x, const float *wq,
                       const float *kw1, const float *kw2, const float *kdd, int64_t flags) {
    dcmha_fill_args(&a, d, R, x, wq, kw1, kw2, kdd, flags);
}

/* One compose stage of dcmha_decode_probs: its ranks and its 7 terms (qw1, qw2, qdd, static,
   kw1, kw2, kdd), NULL where the stage's flags (DCMHA_HAS_QW / QDD / STATIC / KW / KDD) say
   the term is absent (the wrapper passes a dummy there). */
struct DcmhaStage {
    int64_t rq = 1, rk = 1;
    const float *t[7] = {nullptr};
};

static DcmhaStage dcmha_stage(const float *const data[7], int64_t rq, int64_t rk,
                              int64_t flags) {
    static const int64_t bits[7] = {DCMHA_HAS_QW, DCMHA_HAS_QW, DCMHA_HAS_QDD, DCMHA_HAS_STATIC,
                                    DCMHA_HAS_KW, DCMHA_HAS_KW, DCMHA_HAS_KDD};
    DcmhaStage s;
    for (int i = 0; i < 7; i++) s.t[i] = (flags & bits[i]) ? data[i] : nullptr;
    if (flags & DCMHA_HAS_QW) s.rq = rq;
    if (flags & DCMHA_HAS_KW) s.rk = rk;
    return s;
}

/* dcmha_decode_probs with each stage as a DcmhaStage; mask dims d[0..2] (NULL: no mask). */
static int dcmha_probs(const int64_t *x_dims, const float *x, float *p, const uint8_t *mask,
                       const int64_t *mask_dims, float masked, const DcmhaStage &pre,
                       const DcmhaStage &post) {
    const int64_t *d = x_dims;
    return dcmha_decode_probs(d[0], d[1], d[2], d[3], x, p, mask, mask ? mask_dims[0] : 1,
                              mask ? mask_dims[1] : 1, mask ? mask_dims[2] : 1, masked,
                              pre.rq, pre.rk, pre.t[0], pre.t[1], pre.t[2], pre.t[3],
                              pre.t[4], pre.t[5], pre.t[6], 0, 0, post.rq, post.rk,
                              post.t[0], post.t[1], post.t[2], post.t[3], post.t[4],
                              post.t[5], post.t[6], 0, 0);
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
