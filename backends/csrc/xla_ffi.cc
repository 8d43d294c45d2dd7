/* XLA FFI handlers around the dcmha compose kernel, for jax.ffi on CPU (registered by
   dcmha.backends.jax_cpu as "dcmha_compose_forward" / "dcmha_compose_backward").

   DcmhaComposeForward(x, wq, kw1, kw2, kdd; flags) -> out and DcmhaComposeBackward(x, g, wq,
   kw1, kw2, kdd; flags) -> (dx, dwq, dkw1, dkw2, dkdd), arrays as in compose_wrap.h; and
   DcmhaComposeCached(x, qw1, qw2, qdd, static, kw1, kw2, kdd; flags) -> out, the forward from
   the spec's terms with the key side in the decode cache's layout (registered by dcmha.backends.jax_cpu as
   "dcmha_compose_cached"); and DcmhaDecodeProbs(x, mask, 7 pre terms, 7 post terms; pre_flags,
   post_flags, has_mask, masked) -> p, one query's compose / masked softmax / compose
   (dcmha_decode_probs; registered as "dcmha_decode_probs", for one-query steps).

   Compiles on its own against jaxlib's FFI headers:
   c++ -std=c++17 -I"$(python -c 'import jax; print(jax.ffi.include_dir())')" -c xla_ffi.cc */
#include "compose_wrap.h"

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

/* One stage's DcmhaStage from its seven inputs (qw1 and kw1 give the ranks). */
static DcmhaStage stage(F32 qw1, F32 qw2, F32 qdd, F32 st, F32 kw1, F32 kw2, F32 kdd,
                        int64_t flags) {
    const float *data[7] = {qw1.typed_data(), qw2.typed_data(), qdd.typed_data(),
                            st.typed_data(), kw1.typed_data(), kw2.typed_data(),
                            kdd.typed_data()};
    const auto rank = [](F32 w) { return w.dimensions().size() == 5 ? w.dimensions()[3] : 1; };
    return dcmha_stage(data, rank(qw1), rank(kw1), flags);
}

/* x (B, G, M, T, S); qw1, qw2 (B, T, G, R, M); qdd (B, T, G, M); static (G, M, M); kw1, kw2
   (B, S, G, R, M); kdd (B, S, G, M): the spec's terms, the key side in the layout of the
   decode cache (dcmha_compose_cached). flags: DCMHA_HAS_QW / QDD / STATIC / KW / KDD. */
static ffi::Error Cached(F32 x, F32 qw1, F32 qw2, F32 qdd, F32 st, F32 kw1, F32 kw2, F32 kdd,
                         Out out, int64_t flags) {
    const auto d = x.dimensions();
    const DcmhaStage s = stage(qw1, qw2, qdd, st, kw1, kw2, kdd, flags);
    if (dcmha_compose_cached(d[0], d[1], d[2], d[3], d[4], s.rq, s.rk, x.typed_data(),
                             out->typed_data(), s.t[0], s.t[1], s.t[2], s.t[3], s.t[4], s.t[5],
                             s.t[6]))
        return ffi::Error::Internal("dcmha compose: out of memory");
    return ffi::Error::Success();
}

/* x (B, G, M, S); mask (mask_b, mask_n, mask_s) uint8 (a 1-element dummy when has_mask is 0);
   then the pre stage's and the post stage's terms as DcmhaComposeCached's (T = 1), with
   their flags: dcmha_decode_probs. */
static ffi::Error Probs(F32 x, ffi::Buffer<ffi::U8> mask, F32 a1, F32 a2, F32 a3, F32 a4,
                        F32 a5, F32 a6, F32 a7, F32 b1, F32 b2, F32 b3, F32 b4, F32 b5, F32 b6,
                        F32 b7, Out p, int64_t pre_flags, int64_t post_flags, int64_t has_mask,
                        float masked) {
    const DcmhaStage pre = stage(a1, a2, a3, a4, a5, a6, a7, pre_flags);
    const DcmhaStage post = stage(b1, b2, b3, b4, b5, b6, b7, post_flags);
    if (dcmha_probs(x.dimensions().begin(), x.typed_data(), p->typed_data(),
                    has_mask ? mask.typed_data() : nullptr, mask.dimensions().begin(), masked,
                    pre, post))
        return ffi::Error::Internal("dcmha decode probabilities: out of memory");
    return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DcmhaDecodeProbs, Probs,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Arg<F32>().Arg<F32>()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Arg<F32>().Arg<F32>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("pre_flags").Attr<int64_t>("post_flags")
                                  .Attr<int64_t>("has_mask").Attr<float>("masked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DcmhaComposeCached, Cached,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("flags"));

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

DCMHA_DEFINE_ARGS_LAYOUT(dcmha_cxx_args_layout, dcmha_cxx_args_names)
