/* XLA FFI handlers around the dcmha compose kernel, for jax.ffi on CPU (registered by
   dcmha.backends.jax_cpu as "dcmha_compose_forward" / "dcmha_compose_backward").

   DcmhaComposeForward(x, wq, kw1, kw2, kdd; flags) -> out and DcmhaComposeBackward(x, g, wq,
   kw1, kw2, kdd; flags) -> (dx, dwq, dkw1, dkw2, dkdd), arrays as in compose_wrap.h, each
   split over XLA's intra-op threads by (b, g) slices (dcmha_compose_split); and
   DcmhaDecodeProbs (registered as "dcmha_decode_probs"), one query's compose / masked
   softmax / compose (dcmha_decode_probs) for the one-query steps of "jax_decode"; and
   DcmhaBlockProbsForward / Backward ("dcmha_block_probs_forward" / "_backward"), a training
   block's compose / masked softmax / compose and its backward (dcmha_block_probs_slices),
   split like the compose; and DcmhaQueryMatrix / Backward ("dcmha_query_matrix" /
   "_backward"), a stage's query factor wq from its query-side terms (dcmha_query_matrix)
   and the terms' gradients.

   Compiles on its own against jaxlib's FFI headers:
   c++ -std=c++17 -I"$(python -c 'import jax; print(jax.ffi.include_dir())')" -c xla_ffi.cc */
#include "compose_wrap.h"

#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using F32 = ffi::Buffer<ffi::F32>;
using Out = ffi::ResultBuffer<ffi::F32>;

/* Why x (B, G, M, t, s) and the terms (compose_wrap.h's layouts) cannot be composed, with
   the arrays of the same size as x given in same (out, g, dx): nullptr when they can. A
   call built by hand (jax.ffi.ffi_call with other shapes) is refused, never read past. */
static const char *problem(F32 x, F32 wq, F32 kw1, F32 kw2, F32 kdd, int64_t flags,
                           std::initializer_list<size_t> same) {
    if (x.dimensions().size() != 5) return "dcmha compose: x must be (B, G, M, t, s)";
    for (size_t n : same)
        if (n != x.element_count())
            return "dcmha compose: the result and g must have x's shape (B, G, M, t, s)";
    const int64_t R = kw1.dimensions().size() == 5 ? kw1.dimensions()[2] : 0;
    return dcmha_terms_problem(x.dimensions().begin(), R, wq.element_count(),
                               kw1.element_count(), kw2.element_count(), kdd.element_count(),
                               flags);
}

/* dcmha_compose_split of a compose's Args or a block's DcmhaBlockProbs on XLA's intra-op
   thread pool (the one its CPU ops run on); num_threads is 0 where XLA offers none, and the
   call then runs whole on this thread. */
template <typename Job>
static int split(ffi::ThreadPool &pool, const Job &job, int backward) {
    return dcmha_compose_split(job, backward, pool.num_threads(),
                               [&pool](auto task) { pool.Schedule(std::move(task)); });
}

static ffi::Error Forward(ffi::ThreadPool pool, F32 x, F32 wq, F32 kw1, F32 kw2, F32 kdd,
                          Out out, int64_t flags) {
    if (const char *why = problem(x, wq, kw1, kw2, kdd, flags, {out->element_count()}))
        return ffi::Error::InvalidArgument(why);
    Args a;
    const int64_t R = kw1.dimensions().size() == 5 ? kw1.dimensions()[2] : 1;
    dcmha_fill(a, x.dimensions().begin(), R, x.typed_data(), wq.typed_data(),
               kw1.typed_data(), kw2.typed_data(), kdd.typed_data(), flags);
    a.out = out->typed_data();
    if (split(pool, a, 0)) return ffi::Error::Internal("dcmha compose: out of memory");
    return ffi::Error::Success();
}

static ffi::Error Backward(ffi::ThreadPool pool, F32 x, F32 g, F32 wq, F32 kw1, F32 kw2,
                           F32 kdd, Out dx, Out dwq, Out dkw1, Out dkw2, Out dkdd,
                           int64_t flags) {
    if (const char *why = problem(x, wq, kw1, kw2, kdd, flags,
                                  {g.element_count(), dx->element_count()}))
        return ffi::Error::InvalidArgument(why);
    if (dwq->element_count() != wq.element_count() ||
        dkw1->element_count() != kw1.element_count() ||
        dkw2->element_count() != kw1.element_count() ||
        dkdd->element_count() != kdd.element_count())
        return ffi::Error::InvalidArgument("dcmha compose: each term's gradient must have "
                                           "the term's shape");
    Args a;
    const int64_t R = kw1.dimensions().size() == 5 ? kw1.dimensions()[2] : 1;
    dcmha_fill(a, x.dimensions().begin(), R, x.typed_data(), wq.typed_data(),
               kw1.typed_data(), kw2.typed_data(), kdd.typed_data(), flags);
    a.g = g.typed_data();
    a.out = dx->typed_data();
    float *const d[4] = {dwq->typed_data(), dkw1->typed_data(), dkw2->typed_data(),
                         dkdd->typed_data()};
    const int64_t n[4] = {(int64_t)dwq->element_count(), (int64_t)dkw1->element_count(),
                          (int64_t)dkw2->element_count(), (int64_t)dkdd->element_count()};
    dcmha_grads(a, d, n, flags);
    if (split(pool, a, 1)) return ffi::Error::Internal("dcmha compose: out of memory");
    return ffi::Error::Success();
}

/* ---- The query factor of a stage (compose.c's dcmha_query_matrix) and its backward ---- */

/* dcmha_query_problem and dcmha_query_run over the FFI buffers. */
static ffi::Error query(F32 qw1, F32 qw2, F32 qdd, F32 st, const int64_t *d, size_t nd,
                        float *wq, const float *dwq, Out *grads, int64_t flags) {
    const int64_t n[4] = {(int64_t)qw1.element_count(), (int64_t)qw2.element_count(),
                          (int64_t)qdd.element_count(), (int64_t)st.element_count()};
    int64_t R, n_grads[4];
    float *dt[4] = {nullptr, nullptr, nullptr, nullptr};
    if (grads)
        for (int i = 0; i < 4; i++) {
            n_grads[i] = grads[i]->element_count();
            dt[i] = grads[i]->typed_data();
        }
    if (const char *why = dcmha_query_problem(d, nd, qw1.dimensions().begin(),
                                              qw1.dimensions().size(), n, flags, &R,
                                              grads ? n_grads : nullptr))
        return ffi::Error::InvalidArgument(why);
    const float *t[4] = {qw1.typed_data(), qw2.typed_data(), qdd.typed_data(), st.typed_data()};
    dcmha_query_run(d, R, t, wq, dwq, dt, n, flags, grads != nullptr);
    return ffi::Error::Success();
}

/* qw1, qw2, qdd, st (1-element dummies where flags lack them) -> wq (B, T, G, M, M). */
static ffi::Error QueryMatrix(F32 qw1, F32 qw2, F32 qdd, F32 st, Out wq, int64_t flags) {
    const auto &d = wq->dimensions();
    return query(qw1, qw2, qdd, st, d.begin(), d.size(), wq->typed_data(), nullptr, nullptr,
                 flags);
}

/* qw1, qw2, qdd, st and dwq = dL/dwq -> their gradients (zeros for an absent term). */
static ffi::Error QueryMatrixBackward(F32 qw1, F32 qw2, F32 qdd, F32 st, F32 dwq, Out dqw1,
                                      Out dqw2, Out dqdd, Out dst, int64_t flags) {
    Out grads[4] = {dqw1, dqw2, dqdd, dst};
    const auto &d = dwq.dimensions();
    return query(qw1, qw2, qdd, st, d.begin(), d.size(), nullptr, dwq.typed_data(), grads,
                 flags);
}

/* ---- A training block's probabilities (compose.c's dcmha_block_probs_slices) ---- */

using Pred = ffi::Buffer<ffi::PRED>;

static DcmhaTermSizes sizes(F32 wq, F32 kw1, F32 kw2, F32 kdd) {
    return {kw1.dimensions().size() == 5 ? kw1.dimensions()[2] : 0, (int64_t)wq.element_count(),
            (int64_t)kw1.element_count(), (int64_t)kw2.element_count(),
            (int64_t)kdd.element_count()};
}

/* dcmha_block_problem over the FFI buffers (x 5-D first). */
static const char *block_problem(F32 x, F32 pq, F32 pk1, F32 pk2, F32 pkd, F32 oq, F32 ok1,
                                 F32 ok2, F32 okd, Pred vis, int64_t pre_flags,
                                 int64_t post_flags, int64_t has_vis,
                                 std::initializer_list<int64_t> same) {
    if (x.dimensions().size() != 5) return "dcmha compose: x must be (B, G, M, t, s)";
    return dcmha_block_problem(x.dimensions().begin(), x.element_count(),
                               sizes(pq, pk1, pk2, pkd), sizes(oq, ok1, ok2, okd), pre_flags,
                               post_flags, has_vis, vis.dimensions().size(),
                               vis.dimensions().begin(), same);
}

/* dcmha_block_job over the FFI buffers (checked by block_problem). */
static DcmhaBlockProbs block_job(F32 x, F32 pq, F32 pk1, F32 pk2, F32 pkd, F32 oq, F32 ok1,
                                 F32 ok2, F32 okd, Pred vis, int64_t pre_flags,
                                 int64_t post_flags, int64_t has_vis, float masked) {
    const float *t[8] = {pq.typed_data(), pk1.typed_data(), pk2.typed_data(),
                         pkd.typed_data(), oq.typed_data(), ok1.typed_data(),
                         ok2.typed_data(), okd.typed_data()};
    return dcmha_block_job(x.dimensions().begin(), x.typed_data(), t, sizes(pq, pk1, pk2, pkd),
                           sizes(oq, ok1, ok2, okd), pre_flags, post_flags,
                           has_vis ? reinterpret_cast<const uint8_t *>(vis.typed_data())
                                   : nullptr,
                           has_vis ? vis.dimensions()[0] : 1, masked);
}

/* x (B, G, M, t, s), the pre stage's wq, kw1, kw2, kdd, the post stage's, vis (a 1-element
   dummy when has_vis is 0) -> out = Compose_post(p), p = the masked softmax of
   Compose_pre(x). */
static ffi::Error BlockProbsForward(ffi::ThreadPool pool, F32 x, F32 pq, F32 pk1, F32 pk2,
                                    F32 pkd, F32 oq, F32 ok1, F32 ok2, F32 okd, Pred vis,
                                    Out out, Out p, int64_t pre_flags, int64_t post_flags,
                                    int64_t has_vis, float masked) {
    if (const char *why = block_problem(x, pq, pk1, pk2, pkd, oq, ok1, ok2, okd, vis,
                                        pre_flags, post_flags, has_vis,
                                        {(int64_t)out->element_count(),
                                         (int64_t)p->element_count()}))
        return ffi::Error::InvalidArgument(why);
    DcmhaBlockProbs j = block_job(x, pq, pk1, pk2, pkd, oq, ok1, ok2, okd, vis, pre_flags,
                                  post_flags, has_vis, masked);
    j.p = p->typed_data();
    j.out = out->typed_data();
    if (split(pool, j, 0)) return ffi::Error::Internal("dcmha compose: out of memory");
    return ffi::Error::Success();
}

/* The forward's x and p, g = dL/d out, the stages' terms and vis -> dx and each stage's
   term gradients (dwq, dkw1, dkw2, dkdd; those of an absent term or stage zero). */
static ffi::Error BlockProbsBackward(ffi::ThreadPool pool, F32 x, F32 p, F32 g, F32 pq,
                                     F32 pk1, F32 pk2, F32 pkd, F32 oq, F32 ok1, F32 ok2,
                                     F32 okd, Pred vis, Out dx, Out dpq, Out dpk1, Out dpk2,
                                     Out dpkd, Out doq, Out dok1, Out dok2, Out dokd,
                                     int64_t pre_flags, int64_t post_flags, int64_t has_vis,
                                     float masked) {
    if (const char *why = block_problem(x, pq, pk1, pk2, pkd, oq, ok1, ok2, okd, vis,
                                        pre_flags, post_flags, has_vis,
                                        {(int64_t)p.element_count(), (int64_t)g.element_count(),
                                         (int64_t)dx->element_count()}))
        return ffi::Error::InvalidArgument(why);
    const F32 terms[8] = {pq, pk1, pk2, pkd, oq, ok1, ok2, okd};
    Out grads[8] = {dpq, dpk1, dpk2, dpkd, doq, dok1, dok2, dokd};
    float *d[8];
    int64_t n[8];
    for (int i = 0; i < 8; i++) {
        if (grads[i]->element_count() != terms[i].element_count())
            return ffi::Error::InvalidArgument("dcmha compose: each term's gradient must have "
                                               "the term's shape");
        d[i] = grads[i]->typed_data();
        n[i] = grads[i]->element_count();
    }
    DcmhaBlockProbs j = block_job(x, pq, pk1, pk2, pkd, oq, ok1, ok2, okd, vis, pre_flags,
                                  post_flags, has_vis, masked);
    dcmha_block_grads(j, d, n, pre_flags, post_flags);
    j.p = const_cast<float *>(p.typed_data());
    j.g = g.typed_data();
    j.dx = dx->typed_data();
    if (split(pool, j, 1)) return ffi::Error::Internal("dcmha compose: out of memory");
    return ffi::Error::Success();
}

/* One stage's DcmhaStage: its query-side terms read in turn from q (which moves past them;
   for x (B, G, M, S): qw1, qw2 B G rq M floats each, qdd B G M, static G M M, those present
   by flags); its key-side terms read from the stacked arrays kw (B, S, nw, G, R, M) and kd
   (B, S, nd, G, M) at slots iw (kw1; kw2 at iw + 1) and id, which move past them. */
static DcmhaStage stage(const float *&q, const int64_t *d, int64_t rq, F32 kw, F32 kd,
                        int64_t &iw, int64_t &id, int64_t flags) {
    const int64_t B = d[0], G = d[1], M = d[2];
    const auto &wd = kw.dimensions(), &dd = kd.dimensions();
    const int64_t rk = wd.size() == 6 ? wd[4] : 1;
    const int64_t w_slot = G * rk * M, d_slot = G * M;
    const float *data[7] = {nullptr};
    const int64_t bits[4] = {DCMHA_HAS_QW, DCMHA_HAS_QW, DCMHA_HAS_QDD, DCMHA_HAS_STATIC};
    const int64_t sizes[4] = {B * G * rq * M, B * G * rq * M, B * G * M, G * M * M};
    for (int i = 0; i < 4; i++)
        if (flags & bits[i]) {
            data[i] = q;
            q += sizes[i];
        }
    if (flags & DCMHA_HAS_KW) {      /* pointers into kw only where it holds this stage's */
        data[4] = kw.typed_data() + iw * w_slot;
        data[5] = data[4] + w_slot;
        iw += 2;
    }
    if (flags & DCMHA_HAS_KDD) {
        data[6] = kd.typed_data() + id * d_slot;
        id += 1;
    }
    DcmhaStage s = dcmha_stage(data, rq, rk, flags);
    if (flags & DCMHA_HAS_KW) s.kw_row = wd[2] * w_slot;
    if (flags & DCMHA_HAS_KDD) s.kd_row = dd[2] * d_slot;
    return s;
}

/* Why Probs' arrays do not fit x (B, G, M, S) (nullptr: they do): p as x; the query-side
   terms' floats at least what the stages' flags and ranks read; kw (B, S, nw, G, R, M)
   holding kw1 and kw2 of each stage with them (nw = 2 per such stage) and kd (B, S, nd, G,
   M) holding kdd of each stage with it, where any; a mask (mask_b in {1, B}, mask_n in
   {1, G M}, mask_s in {1, S}) when has_mask. */
static const char *probs_problem(F32 x, ffi::Buffer<ffi::PRED> mask, F32 query, F32 kw,
                                 F32 kd, size_t n_p, int64_t pre_flags, int64_t post_flags,
                                 int64_t pre_rank, int64_t post_rank, int64_t has_mask) {
    if (x.dimensions().size() != 4 || n_p != x.element_count())
        return "dcmha decode probabilities: x and p must be (B, G, M, S)";
    const int64_t *d = x.dimensions().begin();
    const int64_t B = d[0], G = d[1], M = d[2], S = d[3];
    int64_t need = 0, nw = 0, nd = 0;
    const int64_t flags[2] = {pre_flags, post_flags}, ranks[2] = {pre_rank, post_rank};
    for (int i = 0; i < 2; i++) {
        const int64_t f = flags[i], rq = ranks[i];
        int64_t n = 0;
        if ((f & DCMHA_HAS_QW) && (rq < 1 || rq > (int64_t(1) << 31) ||
                                   __builtin_mul_overflow(B * G * M, 2 * rq, &n)))
            return "dcmha decode probabilities: a query rank must be in [1, 2**31]";
        need += n + ((f & DCMHA_HAS_QDD) ? B * G * M : 0) +
                ((f & DCMHA_HAS_STATIC) ? G * M * M : 0);
        nw += (f & DCMHA_HAS_KW) ? 2 : 0;
        nd += (f & DCMHA_HAS_KDD) ? 1 : 0;
    }
    if (nw) {
        const auto &wd = kw.dimensions();
        const int64_t rk = wd.size() == 6 ? wd[4] : 0;
        if (rk < 1 || wd[2] != nw || !dcmha_count_is(kw.element_count(), {B, S, nw, G, rk, M}))
            return "dcmha decode probabilities: kw must be (B, S, 2 per stage with kw1, G, R, M)";
    }
    if (nd && (kd.dimensions().size() != 5 || kd.dimensions()[2] != nd ||
               !dcmha_count_is(kd.element_count(), {B, S, nd, G, M})))
        return "dcmha decode probabilities: kd must be (B, S, 1 per stage with kdd, G, M)";
    if ((int64_t)query.element_count() < need)
        return "dcmha decode probabilities: the query-side terms are shorter than the stages "
               "read";
    if (has_mask) {
        const auto &md = mask.dimensions();
        if (md.size() != 3 || (md[0] != 1 && md[0] != B) || (md[1] != 1 && md[1] != G * M) ||
            (md[2] != 1 && md[2] != S))
            return "dcmha decode probabilities: mask must be (B|1, N|1, S|1)";
    }
    return nullptr;
}

/* x (B, G, M, S); mask (mask_b, mask_n, mask_s) bool (a 1-element dummy when has_mask is 0);
   query: the query-side terms of the pre stage, then of the post stage, flat (qw1, qw2, qdd,
   static, each where its stage's flags have it; T = 1); kw: kw1 and kw2 of the pre stage,
   then of the post stage, those present, stacked in the decode cache's layout (B, S, nw, G,
   R, M); kd: kdd likewise (B, S, nd, G, M) (1-element dummies where absent). A stacked
   array is the cache's own entry when the stages' terms fill it in this order, so no
   term is copied out of it: dcmha_decode_probs. */
static ffi::Error Probs(F32 x, ffi::Buffer<ffi::PRED> mask, F32 query, F32 kw, F32 kd, Out p,
                        int64_t pre_flags, int64_t post_flags, int64_t pre_rank,
                        int64_t post_rank, int64_t has_mask, float masked) {
    if (const char *why = probs_problem(x, mask, query, kw, kd, p->element_count(), pre_flags,
                                        post_flags, pre_rank, post_rank, has_mask))
        return ffi::Error::InvalidArgument(why);
    const int64_t *d = x.dimensions().begin();
    const float *q = query.typed_data();
    int64_t iw = 0, id = 0;
    const DcmhaStage pre = stage(q, d, pre_rank, kw, kd, iw, id, pre_flags);
    const DcmhaStage post = stage(q, d, post_rank, kw, kd, iw, id, post_flags);
    if (dcmha_probs(d, x.typed_data(), p->typed_data(),
                    has_mask ? reinterpret_cast<const uint8_t *>(mask.typed_data()) : nullptr,
                    mask.dimensions().begin(), masked, pre, post))
        return ffi::Error::Internal("dcmha decode probabilities: out of memory");
    return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DcmhaDecodeProbs, Probs,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<ffi::Buffer<ffi::PRED>>().Arg<F32>()
                                  .Arg<F32>().Arg<F32>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("pre_flags").Attr<int64_t>("post_flags")
                                  .Attr<int64_t>("pre_rank").Attr<int64_t>("post_rank")
                                  .Attr<int64_t>("has_mask").Attr<float>("masked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DcmhaComposeForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("flags"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DcmhaComposeBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Arg<F32>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("flags"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DcmhaQueryMatrix, QueryMatrix,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("flags"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DcmhaQueryMatrixBackward, QueryMatrixBackward,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("flags"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DcmhaBlockProbsForward, BlockProbsForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32>()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Arg<Pred>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("pre_flags").Attr<int64_t>("post_flags")
                                  .Attr<int64_t>("has_vis").Attr<float>("masked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DcmhaBlockProbsBackward, BlockProbsBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Arg<Pred>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("pre_flags").Attr<int64_t>("post_flags")
                                  .Attr<int64_t>("has_vis").Attr<float>("masked"));

DCMHA_DEFINE_ARGS_LAYOUT(dcmha_cxx_args_layout, dcmha_cxx_args_names)
