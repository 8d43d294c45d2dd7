/* What the framework wrappers of the compose kernel share (C++: xla_ffi.cc for jax.ffi,
   tf_op.cc for TensorFlow): checking the arrays they were given, filling Args for
   contiguous arrays (a training block's job and gradients: dcmha_block_job / _grads), and
   splitting a call over the framework's thread pool (dcmha_compose_split).

   Arrays: x, out, g (B, G, M, t, s); wq, dwq (B, t, G, M, M) ([n, m]: out[n] = sum_m
   wq[n, m] x[m]); kw1, kw2 and their gradients (B, G, R, M, s); kdd, dkdd (B, G, M, s).
   ``flags`` says which terms are present (DCMHA_HAS_*; dcmha.backends.cpu_blocks.flags_of
   sets them; absent ones are passed as 1-element dummies) and whether the block is causal
   (DCMHA_CAUSAL with its offset: dcmha.backends.cpu_kernel.causal_flags).

   Each wrapper also exports its own view of the Args layout (DCMHA_DEFINE_ARGS_LAYOUT with
   dcmha_cxx_args_layout / dcmha_cxx_args_names), which the loader checks. */
#ifndef DCMHA_COMPOSE_WRAP_H
#define DCMHA_COMPOSE_WRAP_H

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <utility>

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

/* One stage's terms as a wrapper received them: kw1's rank (0 when kw1 is not 5-D) and each
   term's element count. */
struct DcmhaTermSizes {
    int64_t R, n_wq, n_kw1, n_kw2, n_kdd;
};

/* The term bits of a stage's flags (none: the stage is absent from a block's probabilities). */
static const int64_t DCMHA_TERM_BITS = DCMHA_HAS_WQ | DCMHA_HAS_KW | DCMHA_HAS_KDD;

/* Why a training block's arrays do not fit x (B, G, M, t, s) = d (nullptr: they do): at least
   one stage present, each present stage's terms (dcmha_terms_problem), the arrays of x's
   size counted in `same` (the results, p, g), and vis (vis_rank dims vis_dims) (1|B, t, s)
   when has_vis. */
static const char *dcmha_block_problem(const int64_t *d, int64_t n_x, const DcmhaTermSizes &pre,
                                       const DcmhaTermSizes &post, int64_t pre_flags,
                                       int64_t post_flags, int64_t has_vis, int64_t vis_rank,
                                       const int64_t *vis_dims,
                                       std::initializer_list<int64_t> same) {
    if (!(pre_flags & DCMHA_TERM_BITS) && !(post_flags & DCMHA_TERM_BITS))
        return "dcmha block probabilities: at least one stage must have a term";
    for (int64_t n : same)
        if (n != n_x) return "dcmha compose: the result and g must have x's shape (B, G, M, t, s)";
    const DcmhaTermSizes *stages[2] = {&pre, &post};
    const int64_t flags[2] = {pre_flags, post_flags};
    for (int i = 0; i < 2; i++) {
        const DcmhaTermSizes &t = *stages[i];
        if (!(flags[i] & DCMHA_TERM_BITS)) continue;
        if (const char *why = dcmha_terms_problem(d, t.R, t.n_wq, t.n_kw1, t.n_kw2, t.n_kdd,
                                                  flags[i]))
            return why;
    }
    if (has_vis && (vis_rank != 3 || (vis_dims[0] != 1 && vis_dims[0] != d[0]) ||
                    vis_dims[1] != d[3] || vis_dims[2] != d[4]))
        return "dcmha block probabilities: vis must be (1|B, t, s) for x (B, G, M, t, s)";
    return nullptr;
}

/* Why a stage's query-side terms do not fit its query factor wq (B, T, G, M, M) = d (nd dims)
   (nullptr: they do): qw1, qw2 (B, T, G, R, M) (qw1's dims q, nq of them), qdd (B, T, G, M)
   and st (G, M, M), those present by flags (DCMHA_HAS_QW / QDD / STATIC), each counted in
   n[0..3]; the gradients counted in grads[0..3] (the terms' order; NULL: none, the
   forward). *R: qw1's rank. */
static const char *dcmha_query_problem(const int64_t *d, size_t nd, const int64_t *q, size_t nq,
                                       const int64_t n[4], int64_t flags, int64_t *R,
                                       const int64_t *grads) {
    if (nd != 5 || d[3] != d[4]) return "dcmha query factor: wq must be (B, T, G, M, M)";
    const int64_t B = d[0], T = d[1], G = d[2], M = d[3];
    *R = 1;
    if (flags & DCMHA_HAS_QW) {
        *R = nq == 5 ? q[3] : 0;
        if (*R < 1 || !dcmha_count_is(n[0], {B, T, G, *R, M}) || n[1] != n[0])
            return "dcmha query factor: qw1 and qw2 must be (B, T, G, R, M) for wq "
                   "(B, T, G, M, M)";
    }
    if ((flags & DCMHA_HAS_QDD) && !dcmha_count_is(n[2], {B, T, G, M}))
        return "dcmha query factor: qdd must be (B, T, G, M) for wq (B, T, G, M, M)";
    if ((flags & DCMHA_HAS_STATIC) && !dcmha_count_is(n[3], {G, M, M}))
        return "dcmha query factor: static must be (G, M, M) for wq (B, T, G, M, M)";
    for (int i = 0; grads && i < 4; i++)
        if (grads[i] != n[i])
            return "dcmha query factor: each term's gradient must have the term's shape";
    return nullptr;
}

/* dcmha_query_matrix (backward = 0: wq from the terms) or dcmha_query_matrix_backward (the
   terms' gradients from dwq) over the arrays t[0..3] = qw1, qw2, qdd, st and their
   gradients dt[0..3] (counted in n), wq (B, T, G, M, M) = d; the terms absent by flags are
   not read and their gradients are zeros. */
static void dcmha_query_run(const int64_t *d, int64_t R, const float *const t[4], float *wq,
                            const float *dwq, float *const dt[4], const int64_t n[4],
                            int64_t flags, int backward) {
    const bool qw = flags & DCMHA_HAS_QW, qdd = flags & DCMHA_HAS_QDD,
               st = flags & DCMHA_HAS_STATIC;
    if (!backward) {
        dcmha_query_matrix(d[0], d[1], d[2], d[3], R, qw ? t[0] : nullptr, qw ? t[1] : nullptr,
                           qdd ? t[2] : nullptr, st ? t[3] : nullptr, wq, 0);
        return;
    }
    /* the kernel writes every entry of the gradients it is given (dst zeroed first, then
       summed into): only the absent terms' are zeroed here */
    const bool present[4] = {qw, qw, qdd, st};
    for (int i = 0; i < 4; i++)
        if (!present[i]) std::memset(dt[i], 0, n[i] * sizeof(float));
    dcmha_query_matrix_backward(d[0], d[1], d[2], d[3], R, t[0], t[1], dwq,
                                qw ? dt[0] : nullptr, qw ? dt[1] : nullptr,
                                qdd ? dt[2] : nullptr, st ? dt[3] : nullptr);
}

static void dcmha_fill(Args &a, const int64_t *d, int64_t R, const float *x, const float *wq,
                       const float *kw1, const float *kw2, const float *kdd, int64_t flags) {
    dcmha_fill_args(&a, d, R, x, wq, kw1, kw2, kdd, flags);
}

/* One compose stage of dcmha_decode_probs: its ranks and its 7 terms (qw1, qw2, qdd, static,
   kw1, kw2, kdd), NULL where the stage's flags (DCMHA_HAS_QW / QDD / STATIC / KW / KDD) say
   the term is absent (the wrapper passes a dummy there); kw_row / kd_row: how many floats
   apart the key positions of kw1 / kw2 and of kdd lie (0: contiguous). */
struct DcmhaStage {
    int64_t rq = 1, rk = 1, kw_row = 0, kd_row = 0;
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
                              pre.t[4], pre.t[5], pre.t[6], pre.kw_row, pre.kd_row, post.rq,
                              post.rk, post.t[0], post.t[1], post.t[2], post.t[3], post.t[4],
                              post.t[5], post.t[6], post.kw_row, post.kd_row);
}

/* The term gradients d[0..3] = dwq, dkw1, dkw2, dkdd (each counted in n): zeroed (the kernel
   accumulates), then attached where present. Each is zeroed by its own count: an absent
   term's dummy and its gradient need not match another term's size. */
static void dcmha_grads(Args &a, float *const d[4], const int64_t n[4], int64_t flags) {
    for (int i = 0; i < 4; i++) std::memset(d[i], 0, n[i] * sizeof(float));
    if (flags & DCMHA_HAS_WQ) a.dwq = d[0];
    if (flags & DCMHA_HAS_KW) { a.dkw1 = d[1]; a.dkw2 = d[2]; }
    if (flags & DCMHA_HAS_KDD) a.dkdd = d[3];
}

/* One split call's state, shared by the calling thread and its helper tasks: the chunks
   [0, n) of the call's slices, claimed in turn from `next` and each run as run(begin, end)
   over its range of slices; `done` counts the finished ones under `mu`. */
struct DcmhaSplit {
    DcmhaSplit(std::function<int(int64_t, int64_t)> range, int64_t chunks, int64_t count)
        : run(std::move(range)), n(chunks), slices(count) {}

    /* Claims and runs chunks until none is left. */
    void work() {
        for (int64_t c; (c = next.fetch_add(1)) < n;) {
            if (run(c * slices / n, (c + 1) * slices / n)) failed.store(1);
            std::lock_guard<std::mutex> lock(mu);
            if (++done == n) finished.notify_all();
        }
    }

    const std::function<int(int64_t, int64_t)> run;
    const int64_t n, slices;
    std::atomic<int64_t> next{0};
    std::atomic<int> failed{0};
    std::mutex mu;
    std::condition_variable finished;
    int64_t done = 0;
};

/* run(begin, end) over the (b, g) slices of `a`'s shape, split into dcmha_compose_chunks(a,
   threads) chunks. schedule(task) hands a callable to the framework's thread pool, once per
   chunk but one; the calling thread runs chunks as well. A chunk is run by whichever thread
   claims it first, and the caller, once none is left to claim, waits only for chunks that
   running threads have claimed: it never waits on a task still queued, so the call ends
   however late the pool starts its tasks, or if it runs them inline. A helper that starts
   after the work is gone does nothing; it shares ownership of the state, which may outlive
   the call. 0 on success, 1 when a chunk ran out of memory. */
template <typename Run, typename Schedule>
static int dcmha_split(const Args &a, int64_t threads, Run &&run, Schedule &&schedule) {
    const int64_t n = dcmha_compose_chunks(&a, threads), slices = a.B * a.G;
    if (n <= 1) return run(0, slices);     /* unsplit: run is not wrapped (no allocation) */
    auto split = std::make_shared<DcmhaSplit>(std::forward<Run>(run), n, slices);
    try {
        for (int64_t i = 1; i < n; i++) schedule([split] { split->work(); });
    } catch (...) {
        /* a task the pool could not take: its chunks go to the threads already working */
    }
    split->work();
    std::unique_lock<std::mutex> lock(split->mu);
    split->finished.wait(lock, [&] { return split->done == split->n; });
    return split->failed.load();
}

/* The forward (backward = 0) or backward of a, split over the framework's threads
   (dcmha_split; compose.c's dcmha_compose_slices: results bit for bit the whole call's). */
template <typename Schedule>
static int dcmha_compose_split(const Args &a, int backward, int64_t threads,
                               Schedule &&schedule) {
    return dcmha_split(a, threads, [a, backward](int64_t begin, int64_t end) {
        return dcmha_compose_slices(&a, backward, begin, end);
    }, std::forward<Schedule>(schedule));
}

/* A training block's probabilities (compose.c's dcmha_block_probs_slices) as one job, built
   by dcmha_block_job: the stages' Args (a stage absent: has_pre / has_post false) and the
   block's arrays. */
struct DcmhaBlockProbs {
    Args pre, post;
    bool has_pre = false, has_post = false;
    const float *x = nullptr, *g = nullptr;
    float *p = nullptr, *out = nullptr, *dx = nullptr;
    const uint8_t *vis = nullptr;
    int64_t vis_b = 1;
    float masked = 0.0f;
};

/* A block's stage Args from its terms (those flags has); false (the stage absent) when flags
   has no term bit. d: x's dims. */
static bool dcmha_block_stage(Args &a, const int64_t *d, int64_t R, const float *x,
                              const float *wq, const float *kw1, const float *kw2,
                              const float *kdd, int64_t flags) {
    if (!(flags & DCMHA_TERM_BITS)) return false;
    dcmha_fill(a, d, R, x, wq, kw1, kw2, kdd, flags);
    return true;
}

/* A block's job (dcmha_block_stage's stages, x, vis, masked) from x (B, G, M, t, s) = d and
   the stages' terms t[0..7] (the pre stage's wq, kw1, kw2, kdd, then the post stage's),
   which dcmha_block_problem has checked against x with their sizes pre and post; vis
   (vis_b, t, s), NULL when the block has none. The caller sets p, out, g, dx. */
static DcmhaBlockProbs dcmha_block_job(const int64_t *d, const float *x, const float *const t[8],
                                       const DcmhaTermSizes &pre, const DcmhaTermSizes &post,
                                       int64_t pre_flags, int64_t post_flags,
                                       const uint8_t *vis, int64_t vis_b, float masked) {
    DcmhaBlockProbs j;
    j.has_pre = dcmha_block_stage(j.pre, d, pre.R ? pre.R : 1, x, t[0], t[1], t[2], t[3],
                                  pre_flags);
    j.has_post = dcmha_block_stage(j.post, d, post.R ? post.R : 1, x, t[4], t[5], t[6], t[7],
                                   post_flags);
    j.x = x;
    if (vis) {
        j.vis = vis;
        j.vis_b = vis_b;
    }
    j.masked = masked;
    return j;
}

/* The stages' term gradients d[0..7] (the terms' order, each counted in n), zeroed and
   attached to the job's stages (dcmha_grads); an absent stage's are zeros. */
static void dcmha_block_grads(DcmhaBlockProbs &j, float *const d[8], const int64_t n[8],
                              int64_t pre_flags, int64_t post_flags) {
    dcmha_grads(j.pre, d, n, pre_flags & DCMHA_TERM_BITS);
    dcmha_grads(j.post, d + 4, n + 4, post_flags & DCMHA_TERM_BITS);
}

/* A block's job, forward or backward, split over the framework's threads as dcmha_split
   does (the stages' Args are copied into the tasks). An overload of the compose's
   dcmha_compose_split, so that a wrapper's one helper over its thread pool runs either. */
template <typename Schedule>
static int dcmha_compose_split(const DcmhaBlockProbs &j, int backward, int64_t threads,
                               Schedule &&schedule) {
    return dcmha_split(j.has_pre ? j.pre : j.post, threads,
                       [j, backward](int64_t begin, int64_t end) {
        return dcmha_block_probs_slices(j.has_pre ? &j.pre : nullptr,
                                        j.has_post ? &j.post : nullptr, j.x, j.p, j.out,
                                        j.vis, j.vis_b, j.masked, backward, j.g, j.dx, begin,
                                        end);
    }, std::forward<Schedule>(schedule));
}

#endif /* DCMHA_COMPOSE_WRAP_H */
