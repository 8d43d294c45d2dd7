/* The argument block of the dcmha compose kernel, shared by the kernel (compose.c), its C++
   wrappers (compose_wrap.h: xla_ffi.cc, tf_op.cc) and Python (ctypes' ``_Args`` in
   dcmha/backends/cpu_kernel/calls.py, which lists the same fields in the same order).

   The layout is not trusted across compilers and languages: every library built from these
   files exports its view of it (DCMHA_DEFINE_ARGS_LAYOUT), and the Python loader compares
   it, field by field, with ctypes' before calling anything; a library whose layout differs
   is refused.

   Arrays are float32 with a contiguous last axis; strides are in elements. A block is x
   (B, t, N, s), head n = g * M + m at stride x_n; wq (B, t, [G,] M, M) holds
   out[n] = sum_m wq[n, m] x[m] for group g at offset wq_g; kw1 / kw2 (B, G, R, M, s) and
   kdd (B, G, M, s) are the key-side terms of the block's key columns. A NULL term pointer
   means the term is absent. */
#ifndef DCMHA_ARGS_H
#define DCMHA_ARGS_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define DCMHA_EXPORT __attribute__((visibility("default")))
#else
#define DCMHA_EXPORT
#endif

#ifdef __cplusplus
#define DCMHA_C_LINKAGE extern "C"
#else
#define DCMHA_C_LINKAGE
#endif

typedef struct DcmhaArgs {
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
    /* A causal block: when causal is nonzero, row i's keys j > i + causal_off are masked.
       The vectorised rows skip them: out there is 0 (forward and backward), and they add
       nothing to a term gradient, which is exact for the blocks of a DCMHA core: before the
       softmax (the caller masks those entries afterwards; g, the softmax's gradient, is 0
       there) and after it (x, the masked probabilities, is 0 there). */
    int64_t causal, causal_off;
} Args;

/* Which terms a wrapper passes (the others are 1-element dummies, or NULL). */
enum { DCMHA_HAS_WQ = 1, DCMHA_HAS_KW = 2, DCMHA_HAS_KDD = 4,
       /* dcmha_compose_cached's query side, as the spec's terms */
       DCMHA_HAS_QW = 8, DCMHA_HAS_QDD = 16, DCMHA_HAS_STATIC = 32,
       /* a causal block (Args.causal), its causal_off in the flags' bits from
          DCMHA_CAUSAL_SHIFT up: flags = bits + causal_off * 256 (causal_off may be < 0) */
       DCMHA_CAUSAL = 64, DCMHA_CAUSAL_SHIFT = 8 };

/* The kernel's entry points: 0 on success, 1 when its chunk buffer cannot be allocated.
   Forward: out = Compose(x). Backward: out = dCompose/dx^T g (out may alias g), and the
   term gradients accumulated (+=) into dwq, dkw1, dkw2, dkdd. */
DCMHA_C_LINKAGE DCMHA_EXPORT int dcmha_compose_forward(const Args *a);
DCMHA_C_LINKAGE DCMHA_EXPORT int dcmha_compose_backward(const Args *a);

/* The forward (backward = 0) or backward of a over its (b, g) slices [begin, end) only,
   slice b G + g being batch row b's group g (the range clipped to [0, B G)): each slice's
   results are the whole call's, bit for bit, so disjoint ranges may run on different
   threads at once. 0 on success, 1 when out of memory. */
DCMHA_C_LINKAGE DCMHA_EXPORT int dcmha_compose_slices(const Args *a, int backward,
                                                      int64_t begin, int64_t end);
/* How many chunks of its (b, g) slices a call on `threads` threads is worth splitting into:
   at most threads and B G, and few enough that each chunk holds at least SPLIT_MIN_FLOATS
   (compose.c) floats of x; 1 (run it whole) for a small call or one thread. */
DCMHA_C_LINKAGE DCMHA_EXPORT int64_t dcmha_compose_chunks(const Args *a, int64_t threads);

/* Args for contiguous arrays: x (and out, g) (B, G, M, t, s) from d = {B, G, M, t, s}; wq
   (B, t, G, M, M); kw1, kw2 (B, G, R, M, s); kdd (B, G, M, s); a term whose DCMHA_HAS_* bit
   is not in flags is left absent (NULL); DCMHA_CAUSAL sets causal and causal_off. Every
   other field is zero. */
DCMHA_C_LINKAGE DCMHA_EXPORT void dcmha_fill_args(Args *a, const int64_t *d, int64_t R,
                                                  const float *x, const float *wq,
                                                  const float *kw1, const float *kw2,
                                                  const float *kdd, int64_t flags);

/* The compose with the key-side terms in the layout of the layer's dynamic weights and of the
   decode cache: x, out (B, G, M, T, S) (head n = g M + m); wq (wq_b, G, wq_t, M, M) with
   wq_b in {1, B} and wq_t in {1, T} (a size-1 axis is broadcast), out[n] = sum_m wq[n, m]
   x[m] (residual and static terms included); kw1, kw2 (B, S, G, R, M); kdd (B, S, G, M). A
   NULL term is absent (no wq: the residual x is the base term).

   dcmha_cached_args fills a for that call and copies the key-side terms keys-last into
   scratch, which holds dcmha_cached_scratch(...) floats. The call may be a part of larger
   terms: wq then points at the part's first row (wq_t the terms' full row count, or 1:
   broadcast) and kw1, kw2, kdd at its first key position, each batch's key terms k_rows
   positions long (S of them used; k_rows = S for terms of exactly the call's keys).

   dcmha_compose_cached does the whole forward from the spec's terms (its scratch
   allocated; 0 on success, 1 when out of memory): the query side as qw1, qw2 (B, T, G, Rq,
   M), qdd (B, T, G, M) and static (G, M, M) (wq[n, m] = [n == m] (1 + qdd[n]) +
   sum_r qw1[r, m] qw2[r, n] + static[g, m, n]), the key side as above with rank Rk. */
DCMHA_C_LINKAGE DCMHA_EXPORT int64_t dcmha_cached_scratch(int64_t B, int64_t G, int64_t M,
                                                          int64_t S, int64_t R, int has_kw,
                                                          int has_kdd);
DCMHA_C_LINKAGE DCMHA_EXPORT void dcmha_cached_args(
    Args *a, int64_t B, int64_t G, int64_t M, int64_t T, int64_t S, int64_t R,
    const float *x, float *out, const float *wq, int64_t wq_b, int64_t wq_t,
    const float *kw1, const float *kw2, const float *kdd, int64_t k_rows, float *scratch);
DCMHA_C_LINKAGE DCMHA_EXPORT int dcmha_compose_cached(
    int64_t B, int64_t G, int64_t M, int64_t T, int64_t S, int64_t Rq, int64_t Rk,
    const float *x, float *out, const float *qw1, const float *qw2, const float *qdd,
    const float *st, const float *kw1, const float *kw2, const float *kdd);

/* Attention probabilities of query rows [r0, r1) from their scores, as a Compose, a biased
   softmax and a Compose: out = Compose_post(softmax(Compose_pre(x) + bias)) for x, out
   (B, N, T, S) (head n = g M + m) and bias (bias_b, 1, T, S) with bias_b in {1, B} (the
   mask's 0 / MASKED_SCORE); the softmax in float32 over S. pre / post: a stage's Args
   for x and out (dcmha_cached_args: its terms; x, out and t are set per block), NULL for
   an absent stage. The rows go in blocks of a few (their (B, N, rows, S) scores stay in
   cache). 0 on success, 1 when out of memory. */
DCMHA_C_LINKAGE DCMHA_EXPORT int dcmha_probs_rows(const Args *pre, const Args *post,
                                                  const float *x, float *out, const float *bias,
                                                  int64_t bias_b, int64_t B, int64_t N,
                                                  int64_t T, int64_t S, int64_t r0, int64_t r1);

/* A training block's probabilities over its (b, g) slices [begin, end) (slice b G + g; the
   range clipped to [0, B G)), each slice's results the whole call's, so disjoint ranges may
   run at once. x, p, out, g, dx: contiguous (B, G, M, t, s); pre / post: a stage's Args
   (dcmha_fill_args: its terms, their gradients attached for the backward; the block arrays
   are set per slice), NULL for an absent stage (at least one present; both carry the same
   B, G, M, t, s and causal bits). Forward (backward = 0): p = softmax(Compose_pre(x)), each
   entry whose byte of vis (vis_b, t, s) is 0 (vis_b in {1, B}; NULL: none) set to `masked`
   first and, in a causal block, each row's keys past its last visible one exactly 0 (a row
   with none all 0); out = Compose_post(p). Backward: from g = dL/d out and the forward's x
   and p, dx = dL/dx, the term gradients accumulated (+=) into each stage's. 0 on success,
   1 when out of memory. */
DCMHA_C_LINKAGE DCMHA_EXPORT int dcmha_block_probs_slices(
    const Args *pre, const Args *post, const float *x, float *p, float *out, const uint8_t *vis,
    int64_t vis_b, float masked, int backward, const float *g, float *dx, int64_t begin,
    int64_t end);
/* The spec's query factor of each (b, t, g): wq[n, m] = [n == m] (1 + qdd[n])
   + sum_r qw1[r, m] qw2[r, n] + static[g, m, n] (out[n] = sum_m wq[n, m] x[m], the residual
   included), from qw1, qw2 (B, T, G, R, M), qdd (B, T, G, M), static (G, M, M), each NULL
   when absent; into wq (B, T, G, M, M), or (B, G, T, M, M) when groups_first. */
DCMHA_C_LINKAGE DCMHA_EXPORT void dcmha_query_matrix(int64_t B, int64_t T, int64_t G, int64_t M,
                                                     int64_t R, const float *qw1,
                                                     const float *qw2, const float *qdd,
                                                     const float *st, float *wq,
                                                     int groups_first);

/* The gradients of dcmha_query_matrix's terms from dwq = dL/dwq (B, T, G, M, M), into dqw1,
   dqw2 (B, T, G, R, M), dqdd (B, T, G, M) and dst (G, M, M, summed over B and T), each
   NULL when its term is absent (qw1, qw2 are read where dqw1 is given). */
DCMHA_C_LINKAGE DCMHA_EXPORT void dcmha_query_matrix_backward(
    int64_t B, int64_t T, int64_t G, int64_t M, int64_t R, const float *qw1, const float *qw2,
    const float *dwq, float *dqw1, float *dqw2, float *dqdd, float *dst);
/* One query's probabilities, as the plain core's one-query path computes them: p (B, G, M, S)
   = Compose_post(softmax(where(mask, Compose_pre(x), masked))) for the scores x (B, G, M, S)
   (p must not alias x). Each stage's terms as dcmha_compose_cached's (T = 1), all NULL for
   an absent stage. mask (mask_b, mask_n, mask_s), 1 = attend, with mask_b in {1, B}, mask_n
   in {1, G M} and mask_s in {1, S} (a size-1 axis broadcast), or NULL. The softmax is in
   float32 and subtracts the row's maximum. Each stage's kw_row / kd_row: how many floats
   apart the key positions of its kw1 / kw2 and of its kdd lie (each position's (G, ...)
   block contiguous, batch b at b S row), as in one slot's part of the decode cache's
   stacked entries; 0 for contiguous terms. 0 on success, 1 when out of memory. */
DCMHA_C_LINKAGE DCMHA_EXPORT int dcmha_decode_probs(
    int64_t B, int64_t G, int64_t M, int64_t S, const float *x, float *p, const uint8_t *mask,
    int64_t mask_b, int64_t mask_n, int64_t mask_s, float masked, int64_t pre_rq,
    int64_t pre_rk, const float *pre_qw1, const float *pre_qw2, const float *pre_qdd,
    const float *pre_static, const float *pre_kw1, const float *pre_kw2, const float *pre_kdd,
    int64_t pre_kw_row, int64_t pre_kd_row,
    int64_t post_rq, int64_t post_rk, const float *post_qw1, const float *post_qw2,
    const float *post_qdd, const float *post_static, const float *post_kw1,
    const float *post_kw2, const float *post_kdd, int64_t post_kw_row, int64_t post_kd_row);

/* The dynamic composition weights of BL rows x (BL, D), float32, for the terms present:
   with dw1 (D, GC K) and qkw (GC, K, 2 R, M), h = gelu(x dw1) (tanh approximation when
   gelu_approximate, else erf) and w = h . qkw per (row, gc) over K; w1 (BL, GC, R, M) = w's
   first R rows, each RMS-normalised over M with eps; w2 (BL, GC, R, M) = its last R rows;
   with dd (D, GC M), ddo (BL, GC M) = tanh(x dd). A NULL dw1 or dd skips its outputs. One
   thread, for a few rows (a decoding step). 0 on success, 1 when out of memory. */
DCMHA_C_LINKAGE DCMHA_EXPORT int dcmha_dynamic_weights(
    int64_t BL, int64_t D, int64_t GC, int64_t K, int64_t R, int64_t M, const float *x,
    const float *dw1, const float *qkw, const float *dd, int gelu_approximate, float eps,
    float *w1, float *w2, float *ddo);

/* dcmha_dynamic_weights' outputs from BL rows of pre-activations already computed (a
   caller that folds x dw1 and x dd into a wider product): row i's x dw1 (GC K values) at
   pre + i ld + h_col when qkw is given (gelu is applied there, in place), and its x dd (GC M
   values) at pre + i ld + g_col when ddo is given. Writes w1, w2 (with qkw) and ddo (when
   given) as dcmha_dynamic_weights does. */
DCMHA_C_LINKAGE DCMHA_EXPORT void dcmha_dynamic_finish(
    int64_t BL, int64_t GC, int64_t K, int64_t R, int64_t M, float *pre, int64_t ld,
    int64_t h_col, int64_t g_col, const float *qkw, int gelu_approximate, float eps,
    float *w1, float *w2, float *ddo);

/* The rotate-half RoPE of rows [r0, r1) of x (B L rows, row r = (b, l) at x + r x_row,
   holding H heads of d values; float32, or float16 when f16): with h = d / 2 and row r's
   cos / sin rows c, s + (r % L) h, out[j] = x[j] c[j] - x[j + h] s[j],
   out[j + h] = x[j + h] c[j] + x[j] s[j], in float32. Heads [0, H0) go to out0, the rest
   to out1, each (B, L, heads, d), or (B, heads, L, d) when heads_first.
   dcmha_round_to_half rounds n floats to float16 precision in place (nearest even). */
DCMHA_C_LINKAGE DCMHA_EXPORT void dcmha_rope_rows(int64_t r0, int64_t r1, int64_t L, int64_t H,
                                                  int64_t d, const void *x, int64_t x_row,
                                                  void *out0, void *out1, int64_t H0,
                                                  int heads_first, const float *c,
                                                  const float *s, int f16);
DCMHA_C_LINKAGE DCMHA_EXPORT void dcmha_round_to_half(float *v, int64_t n);
/* f[i] = h[i] for n float16 values h (exact). */
DCMHA_C_LINKAGE DCMHA_EXPORT void dcmha_half_to_float(const uint16_t *h, float *f, int64_t n);

/* Every field of Args, in declaration order (the loader checks each by name). */
#define DCMHA_ARGS_FIELDS(F)                                                            \
    F(B) F(t) F(G) F(M) F(R) F(s)                                                       \
    F(x) F(x_b) F(x_i) F(x_n) F(out) F(o_b) F(o_i) F(o_n) F(g) F(g_b) F(g_i) F(g_n)     \
    F(wq) F(wq_b) F(wq_i) F(wq_g) F(wq_n) F(wq_m)                                       \
    F(dwq) F(dwq_b) F(dwq_i) F(dwq_g) F(dwq_n) F(dwq_m)                                 \
    F(kw1) F(kw2) F(kw_b) F(kw_g) F(kw_r) F(kw_m)                                       \
    F(dkw1) F(dkw2) F(dkw_b) F(dkw_g) F(dkw_r) F(dkw_m)                                 \
    F(kdd) F(kd_b) F(kd_g) F(kd_m) F(dkdd) F(dkd_b) F(dkd_g) F(dkd_m)                 \
    F(causal) F(causal_off)

#define DCMHA_FIELD_LAYOUT_(f) (int64_t)offsetof(Args, f), (int64_t)sizeof(((Args *)0)->f),
#define DCMHA_FIELD_NAME_(f) #f " "

/* Defines LAYOUT(out, cap), which writes sizeof(Args), then each field's offset and size
   (out[1 + 2 i], out[2 + 2 i]), as far as cap allows, and returns the number of fields; and
   NAMES(), the fields' names separated by spaces. Use once per library and language: the
   kernel exports dcmha_args_layout / dcmha_args_names, a C++ wrapper dcmha_cxx_args_layout /
   dcmha_cxx_args_names, so each compiler's view is checked. */
#define DCMHA_DEFINE_ARGS_LAYOUT(LAYOUT, NAMES)                                          \
    DCMHA_C_LINKAGE DCMHA_EXPORT int64_t LAYOUT(int64_t *out, int64_t cap) {             \
        const int64_t table[] = {(int64_t)sizeof(Args), DCMHA_ARGS_FIELDS(DCMHA_FIELD_LAYOUT_)}; \
        const int64_t n = (int64_t)(sizeof table / sizeof table[0]);                     \
        for (int64_t i = 0; i < n && i < cap; i++) out[i] = table[i];                    \
        return (n - 1) / 2;                                                              \
    }                                                                                    \
    DCMHA_C_LINKAGE DCMHA_EXPORT const char *NAMES(void) {                               \
        return DCMHA_ARGS_FIELDS(DCMHA_FIELD_NAME_);                                     \
    }

#endif /* DCMHA_ARGS_H */
