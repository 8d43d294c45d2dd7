/* The dcmha compose kernel as onnxruntime custom ops (CPU, float32), for the graphs that
   dcmha.export writes with compose_nodes=True.

   Ops, domain "dcmha", one per set of terms present (Q: the per-query matrix, K: the
   key-side rank-R pair, D: the key-side gating), inputs in this order:

       ComposeQ / ComposeK / ComposeD / ComposeQK / ComposeQD / ComposeKD / ComposeQKD
           (x, [wq], [kw1, kw2], [kdd]) -> out

   x, out (B, N, T, S) with head n = g * M + m; wq (B|1, G, T|1, M, M), where
   out[n] = sum_m wq[n, m] x[m] (the residual and static terms included; a size-1 axis is
   broadcast); kw1, kw2 (B, S, G, R, M) and kdd (B, S, G, M), the layout of the layer's
   dynamic weights and of the decode cache (the kernel copies them keys-last). Without Q the
   residual x is the base term.

       CacheHeads (float32) / CacheHeads16 (float16) / CacheHeads16F (a float16 cache, float32
       out): (cache, start, stop) -> out

   cache (B, S_max, H, d), start and stop int64 scalars, 0 <= start < stop <= S_max;
   out (B, H, stop - start, d) = the cache's positions [start, stop), heads first: the
   Slice and Transpose of a decode step's key / value cache in one copy.

       QueryMatrixW / D / WD / WS / DS / WDS: ([qw1, qw2], [qdd], [static]) -> wq

   The per-query matrix of Compose's wq input, (B, G, T, M, M), from the spec's query-side
   terms (W: qw1, qw2 (B, T, G, R, M); D: qdd (B, T, G, M); S: static (G, M, M)):
   wq[n, m] = [n == m] (1 + qdd[n]) + sum_r qw1[r, m] qw2[r, n] + static[g, m, n].

       Rope (float32) / Rope16 (float16): (x, positions, inv_freq) -> out
       RopeHeads (float32) / RopeHeads16 (float16): (y, positions, inv_freq, heads) -> q, k

   x, out (B, L, H, d), positions (L,) int64, inv_freq (d / 2,) float64: the rotate-half
   RoPE. With a = positions[l] inv_freq[j] (float64) and c, s = cos a, sin a rounded to x's
   type, out[.., j] = x[j] c - x[j + d/2] s and out[.., j + d/2] = x[j + d/2] c + x[j] s
   (each in float32; Rope16 rounds the result to float16 once). The cos / sin rows of the
   positions seen are kept per thread (grown on demand), so a call costs the rotation.
   RopeHeads reads the heads from a projection's output y (B, L, W), heads (2,) int64 =
   (N, N_kv): columns [0, (N + N_kv) d) are N query heads then N_kv key heads of d; it
   writes them rotated, heads first: q (B, N, L, d), k (B, N_kv, L, d).

   The same ops are model-local functions of the exported graph (plain-op bodies,
   dcmha/export/core.py); a session that registers this library runs the kernel instead.

   onnxruntime loads the library with SessionOptions.register_custom_ops_library, which calls
   RegisterCustomOps. The library needs no onnxruntime headers: the few entries of the C API
   it calls are declared below by their positions in onnxruntime's OrtApi table (which only
   grows: an entry never moves) and OrtCustomOp's fields in their documented order. A
   Compose splits its query rows over the session's intra-op threads
   (KernelContext_ParallelFor, when the onnxruntime serves API version 20 or later).

   Compiles on its own: c++ -std=c++17 -O2 -shared -fPIC ort_op.cc compose.o */
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "compose_wrap.h"

extern "C" {
struct OrtStatus;
struct OrtSessionOptions;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtShapeInfo;
struct OrtCustomOpDomain;
typedef void (*OrtFn)(void);

struct OrtApiBase {
    const OrtFn *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
};

struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const OrtCustomOp *, const void *, const OrtKernelInfo *);
    const char *(*GetName)(const OrtCustomOp *);
    const char *(*GetExecutionProviderType)(const OrtCustomOp *);
    int (*GetInputType)(const OrtCustomOp *, size_t);
    size_t (*GetInputTypeCount)(const OrtCustomOp *);
    int (*GetOutputType)(const OrtCustomOp *, size_t);
    size_t (*GetOutputTypeCount)(const OrtCustomOp *);
    void (*KernelCompute)(void *, OrtKernelContext *);
    void (*KernelDestroy)(void *);
    int (*GetInputCharacteristic)(const OrtCustomOp *, size_t);
    int (*GetOutputCharacteristic)(const OrtCustomOp *, size_t);
    int (*GetInputMemoryType)(const OrtCustomOp *, size_t);
    int (*GetVariadicInputMinArity)(const OrtCustomOp *);
    int (*GetVariadicInputHomogeneity)(const OrtCustomOp *);
    int (*GetVariadicOutputMinArity)(const OrtCustomOp *);
    int (*GetVariadicOutputHomogeneity)(const OrtCustomOp *);
    OrtStatus *(*CreateKernelV2)(const OrtCustomOp *, const void *, const OrtKernelInfo *,
                                 void **);
    OrtStatus *(*KernelComputeV2)(void *, OrtKernelContext *);
    OrtStatus *(*InferOutputShapeFn)(const OrtCustomOp *, void *);
    int (*GetStartVersion)(const OrtCustomOp *);
    int (*GetEndVersion)(const OrtCustomOp *);
    size_t (*GetMayInplace)(int **, int **);
    void (*ReleaseMayInplace)(int *, int *);
    size_t (*GetAliasMap)(int **, int **);
    void (*ReleaseAliasMap)(int *, int *);
};
}

namespace {

/* OrtApi entries used, by position (version 1 of the table). */
enum : int {
    kCreateStatus = 0, kCreateCustomOpDomain = 26, kCustomOpDomainAdd = 27,
    kAddCustomOpDomain = 28, kGetTensorMutableData = 51, kGetTensorElementType = 60,
    kGetDimensionsCount = 61, kGetDimensions = 62, kGetTensorTypeAndShape = 65,
    kKernelContextGetInput = 90,
    kKernelContextGetOutput = 91, kReleaseStatus = 93, kReleaseTensorTypeAndShapeInfo = 99,
    kKernelContextParallelFor = 274,
};
constexpr uint32_t kParallelApi = 20;   /* an API version that has KernelContext_ParallelFor */
constexpr int kInvalidArgument = 2, kFail = 1;   /* OrtErrorCode */
constexpr int kFloat = 1, kFloat16 = 10, kInt64 = 7, kDouble = 11;   /* ONNX_TENSOR_ELEMENT_DATA_TYPE_* */
/* OrtCustomOp fields read by onnxruntime: those of this version and below. */
constexpr uint32_t kOpVersion = 16;

const OrtFn *g_api = nullptr;
bool g_parallel = false;   /* the table has KernelContext_ParallelFor */

template <typename F>
F api(int index) { return reinterpret_cast<F>(g_api[index]); }

OrtStatus *status(int code, const char *message) {
    return api<OrtStatus *(*)(int, const char *)>(kCreateStatus)(code, message);
}

struct Op {
    OrtCustomOp base;   /* first: onnxruntime passes &base back */
    const char *name;
    int64_t flags;      /* Compose*: DCMHA_HAS_*; CacheHeads*: the element type */
    size_t inputs;
};

const Op &op_of(const OrtCustomOp *o) { return *reinterpret_cast<const Op *>(o); }

/* A tensor input: its data and shape (at most 6 axes), or an error status. */
struct Tensor {
    const float *data = nullptr;
    int64_t dims[6] = {0};
    size_t rank = 0;
};

const char *type_name(int type) {
    return type == kFloat ? "float32" : type == kFloat16 ? "float16" : type == kInt64 ? "int64"
           : type == kDouble ? "float64" : "other";
}

OrtStatus *read_input(OrtKernelContext *ctx, size_t i, const char *what, size_t rank,
                      Tensor &t, int want = kFloat) {
    const OrtValue *v = nullptr;
    OrtStatus *st = api<OrtStatus *(*)(OrtKernelContext *, size_t, const OrtValue **)>(
        kKernelContextGetInput)(ctx, i, &v);
    if (st) return st;
    OrtShapeInfo *info = nullptr;
    if ((st = api<OrtStatus *(*)(const OrtValue *, OrtShapeInfo **)>(kGetTensorTypeAndShape)(
             v, &info)))
        return st;
    int type = 0;
    size_t n = 0;
    st = api<OrtStatus *(*)(const OrtShapeInfo *, int *)>(kGetTensorElementType)(info, &type);
    if (!st) st = api<OrtStatus *(*)(const OrtShapeInfo *, size_t *)>(kGetDimensionsCount)(info, &n);
    if (!st && n == rank)
        st = api<OrtStatus *(*)(const OrtShapeInfo *, int64_t *, size_t)>(kGetDimensions)(
            info, t.dims, n);
    api<void (*)(OrtShapeInfo *)>(kReleaseTensorTypeAndShapeInfo)(info);
    if (st) return st;
    char msg[160];
    if (type != want || n != rank) {
        std::snprintf(msg, sizeof msg,
                      "dcmha: input %s must be a %s tensor of rank %zu; received %s, rank %zu",
                      what, type_name(want), rank, type_name(type), n);
        return status(kInvalidArgument, msg);
    }
    t.rank = n;
    void *data = nullptr;
    if ((st = api<OrtStatus *(*)(OrtValue *, void **)>(kGetTensorMutableData)(
             const_cast<OrtValue *>(v), &data)))
        return st;
    t.data = static_cast<const float *>(data);
    return nullptr;
}

/* An int64 scalar input's value (read_input checked its type and rank). */
int64_t scalar(const Tensor &t) { return *reinterpret_cast<const int64_t *>(t.data); }

/* The op's output `index` with these dims: its data in data, or an error status. */
OrtStatus *output(OrtKernelContext *ctx, const int64_t *dims, size_t rank, void *&data,
                  size_t index = 0) {
    OrtValue *out = nullptr;
    OrtStatus *st = api<OrtStatus *(*)(OrtKernelContext *, size_t, const int64_t *, size_t,
                                       OrtValue **)>(kKernelContextGetOutput)(ctx, index, dims,
                                                                               rank, &out);
    if (st) return st;
    return api<OrtStatus *(*)(OrtValue *, void **)>(kGetTensorMutableData)(out, &data);
}

OrtStatus *mismatch(const char *what, const char *expected, const Tensor &t) {
    char msg[200];
    std::snprintf(msg, sizeof msg,
                  "dcmha Compose: input %s must have shape %s; received (%lld, %lld, %lld, "
                  "%lld%s", what, expected, (long long)t.dims[0], (long long)t.dims[1],
                  (long long)t.dims[2], (long long)t.dims[3], t.rank == 5 ? ", ...)" : ")");
    return status(kInvalidArgument, msg);
}

/* One compose stage's inputs (flags: DCMHA_HAS_WQ / KW / KDD), read from input i on
   (i advanced past them) and checked against x (B, N, T, S); then its Args for x -> out
   (stage_args: the key-side terms copied keys-last into scratch, resized there).
   part: the terms may be longer than x's block, which is their rows [t0, t0 + T) and keys
   [s0, s0 + S) (wq's row axis may still be 1: broadcast); else exactly x's T (or 1) and S. */
struct Stage {
    Tensor wq, kw1, kw2, kdd;
    int64_t G = 0, R = 1, S_all = 0;
};

OrtStatus *read_stage(OrtKernelContext *ctx, size_t &i, int64_t flags, const Tensor &x,
                      Stage &t, bool part = false, int64_t t0 = 0, int64_t s0 = 0) {
    const int64_t B = x.dims[0], N = x.dims[1], T = x.dims[2], S = x.dims[3];
    OrtStatus *st;
    if (flags & DCMHA_HAS_WQ) {
        if ((st = read_input(ctx, i++, "wq", 5, t.wq))) return st;
        t.G = t.wq.dims[1];
    }
    if (flags & DCMHA_HAS_KW) {
        if ((st = read_input(ctx, i++, "kw1", 5, t.kw1))) return st;
        if ((st = read_input(ctx, i++, "kw2", 5, t.kw2))) return st;
        t.G = t.G ? t.G : t.kw1.dims[2];
        t.R = t.kw1.dims[3];
        t.S_all = t.kw1.dims[1];
    }
    if (flags & DCMHA_HAS_KDD) {
        if ((st = read_input(ctx, i++, "kdd", 4, t.kdd))) return st;
        t.G = t.G ? t.G : t.kdd.dims[2];
        t.S_all = t.S_all ? t.S_all : t.kdd.dims[1];
    }
    const int64_t G = t.G;
    if (G <= 0 || N % G) {
        char msg[120];
        std::snprintf(msg, sizeof msg, "dcmha Compose: %lld heads in x do not split into %lld "
                      "groups", (long long)N, (long long)G);
        return status(kInvalidArgument, msg);
    }
    /* [t0, t0 + T) inside rows and [s0, s0 + S) inside S_all, compared against the sizes
       (t0 <= rows, then T <= rows - t0): a sum such as t0 + T could overflow. */
    const int64_t M = N / G, rows = t.wq.dims[2];
    const bool rows_ok = part ? rows == 1 || (t0 >= 0 && t0 <= rows && T <= rows - t0)
                              : rows == 1 || rows == T;
    const bool keys_ok = part ? s0 >= 0 && s0 <= t.S_all && S <= t.S_all - s0 : t.S_all == S;
    if ((flags & DCMHA_HAS_WQ) && ((t.wq.dims[0] != B && t.wq.dims[0] != 1) || !rows_ok ||
                                   t.wq.dims[3] != M || t.wq.dims[4] != M))
        return mismatch("wq", part ? "(B|1, G, 1 or >= t0 + T, M, M)" : "(B|1, G, T|1, M, M)",
                        t.wq);
    if (flags & DCMHA_HAS_KW) {
        const Tensor *pair[2] = {&t.kw1, &t.kw2};
        for (const Tensor *k : pair)
            if (k->dims[0] != B || k->dims[1] != t.S_all || !keys_ok || k->dims[2] != G ||
                k->dims[3] != t.R || k->dims[4] != M)
                return mismatch(k == &t.kw1 ? "kw1" : "kw2",
                                part ? "(B, >= s0 + S, G, R, M)" : "(B, S, G, R, M)", *k);
    }
    if ((flags & DCMHA_HAS_KDD) &&
        (t.kdd.dims[0] != B || t.kdd.dims[1] != t.S_all || !keys_ok || t.kdd.dims[2] != G ||
         t.kdd.dims[3] != M))
        return mismatch("kdd", part ? "(B, >= s0 + S, G, M) (as kw1's)" : "(B, S, G, M)", t.kdd);
    return nullptr;
}

void stage_args(Args &a, const Stage &t, const Tensor &x, float *out,
                std::vector<float> &scratch, int64_t t0 = 0, int64_t s0 = 0) {
    const int64_t B = x.dims[0], N = x.dims[1], T = x.dims[2], S = x.dims[3], M = N / t.G;
    const int64_t n = dcmha_cached_scratch(B, t.G, M, S, t.R, t.kw1.data != nullptr,
                                           t.kdd.data != nullptr);
    if (scratch.size() < (size_t)n) scratch.resize((size_t)n);
    const int64_t wq_t = t.wq.dims[2];
    auto at = [](const float *p, int64_t offset) { return p ? p + offset : p; };
    dcmha_cached_args(&a, B, t.G, M, T, S, t.R, x.data, out,
                      at(t.wq.data, wq_t == 1 ? 0 : t0 * M * M), t.wq.dims[0], wq_t,
                      at(t.kw1.data, s0 * t.G * t.R * M), at(t.kw2.data, s0 * t.G * t.R * M),
                      at(t.kdd.data, s0 * t.G * M), t.S_all,
                      scratch.data());     /* an absent term's data is NULL */
}

/* Runs part(job, p) for p < parts = want over the intra-op threads where onnxruntime has
   KernelContext_ParallelFor; else parts = 1 and part(job, 0) does the whole. */
OrtStatus *in_parts(OrtKernelContext *ctx, int64_t want, void (*part)(void *, size_t),
                    void *job, int64_t &parts) {
    parts = want;
    if (parts > 1 && g_parallel)
        return api<OrtStatus *(*)(OrtKernelContext *, void (*)(void *, size_t), size_t, size_t,
                                  void *)>(kKernelContextParallelFor)(ctx, part, (size_t)parts,
                                                                      0, job);
    parts = 1;
    part(job, 0);
    return nullptr;
}

OrtStatus *compute(void *kernel, OrtKernelContext *ctx) {
    const Op &op = *static_cast<const Op *>(kernel);
    Tensor x;
    Stage t;
    OrtStatus *st;
    size_t i = 0;
    if ((st = read_input(ctx, i++, "x", 4, x))) return st;
    if ((st = read_stage(ctx, i, op.flags, x, t))) return st;
    void *out_data = nullptr;
    if ((st = output(ctx, x.dims, 4, out_data))) return st;
    if (x.dims[0] * x.dims[1] * x.dims[2] * x.dims[3] == 0) return nullptr;

    /* the key-side terms keys-last, in one scratch buffer per thread */
    thread_local std::vector<float> scratch;
    Args a;
    stage_args(a, t, x, static_cast<float *>(out_data), scratch);
    /* query rows in parts over the intra-op threads: each part is the same call on rows
       [t0, t1) (the key-side terms are shared) */
    struct Parts {
        Args a;
        int64_t parts;
        int failed;
    } job{a, 1, 0};
    auto run = [](void *data, size_t p) {
        Parts &j = *static_cast<Parts *>(data);
        const int64_t T = j.a.t, t0 = T * (int64_t)p / j.parts, t1 = T * ((int64_t)p + 1) / j.parts;
        Args part = j.a;
        part.t = t1 - t0;
        part.x += t0 * j.a.x_i;
        part.out += t0 * j.a.o_i;
        if (part.wq) part.wq += t0 * j.a.wq_i;
        if (part.t > 0 && dcmha_compose_forward(&part)) j.failed = 1;
    };
    if ((st = in_parts(ctx, std::min<int64_t>(a.t, 8), run, &job, job.parts))) return st;
    if (job.failed) return status(kFail, "dcmha Compose: out of memory");
    return nullptr;
}

/* Probs<pre>_<post>: (x, bias, t0, s0, [pre terms], [post terms]) -> Compose_post(softmax(
   Compose_pre(x) + bias)) (flags: the pre stage's DCMHA_HAS_* bits, the post stage's << 3),
   x the block of the terms' rows [t0, t0 + T) and keys [s0, s0 + S). */
OrtStatus *probs(void *kernel, OrtKernelContext *ctx) {
    const Op &op = *static_cast<const Op *>(kernel);
    const int64_t fpre = op.flags & 7, fpost = (op.flags >> 3) & 7;
    Tensor x, bias, t0, s0;
    Stage pre, post;
    OrtStatus *st;
    size_t i = 0;
    if ((st = read_input(ctx, i++, "x", 4, x))) return st;
    if ((st = read_input(ctx, i++, "bias", 4, bias))) return st;
    if ((st = read_input(ctx, i++, "t0", 0, t0, kInt64))) return st;
    if ((st = read_input(ctx, i++, "s0", 0, s0, kInt64))) return st;
    const int64_t r0 = scalar(t0), k0 = scalar(s0);
    if (r0 < 0 || k0 < 0) {
        char msg[120];
        std::snprintf(msg, sizeof msg, "dcmha Probs: need t0 >= 0 and s0 >= 0; received t0=%lld, "
                      "s0=%lld", (long long)r0, (long long)k0);
        return status(kInvalidArgument, msg);
    }
    if ((fpre && (st = read_stage(ctx, i, fpre, x, pre, true, r0, k0))) ||
        (fpost && (st = read_stage(ctx, i, fpost, x, post, true, r0, k0))))
        return st;
    const int64_t B = x.dims[0], N = x.dims[1], T = x.dims[2], S = x.dims[3];
    if ((bias.dims[0] != B && bias.dims[0] != 1) || bias.dims[1] != 1 || bias.dims[2] != T ||
        bias.dims[3] != S)
        return mismatch("bias", "(B|1, 1, T, S)", bias);
    void *out_data = nullptr;
    if ((st = output(ctx, x.dims, 4, out_data))) return st;
    if (B * N * T * S == 0) return nullptr;
    thread_local std::vector<float> scratch_pre, scratch_post;
    struct Parts {
        Args pre, post;
        const Args *pre_p, *post_p;
        const float *x, *bias;
        float *out;
        int64_t bias_b, B, N, T, S, parts;
        int failed;
    } job;
    float *out = static_cast<float *>(out_data);
    if (fpre) stage_args(job.pre, pre, x, out, scratch_pre, r0, k0);
    if (fpost) stage_args(job.post, post, x, out, scratch_post, r0, k0);
    job.pre_p = fpre ? &job.pre : nullptr;
    job.post_p = fpost ? &job.post : nullptr;
    job.x = x.data;
    job.bias = bias.data;
    job.out = out;
    job.bias_b = bias.dims[0];
    job.B = B; job.N = N; job.T = T; job.S = S;
    job.failed = 0;
    auto run = [](void *data, size_t p) {
        Parts &j = *static_cast<Parts *>(data);
        if (dcmha_probs_rows(j.pre_p, j.post_p, j.x, j.out, j.bias, j.bias_b, j.B, j.N, j.T, j.S,
                             j.T * (int64_t)p / j.parts, j.T * ((int64_t)p + 1) / j.parts))
            j.failed = 1;
    };
    if ((st = in_parts(ctx, std::min<int64_t>(T, 8), run, &job, job.parts))) return st;
    if (job.failed) return status(kFail, "dcmha Probs: out of memory");
    return nullptr;
}

/* CacheHeads: out (B, H, stop - start, d) = cache (B, S_max, H, d)[:, start:stop], heads first. */
constexpr int64_t kToFloat = 1 << 8;   /* CacheHeads16F: a float16 cache, float32 heads */

OrtStatus *cache_heads(void *kernel, OrtKernelContext *ctx) {
    const Op &op = *static_cast<const Op *>(kernel);
    const int type = (int)(op.flags & 0xff);
    const bool widen = (op.flags & kToFloat) != 0;
    const size_t item = type == kFloat16 ? 2 : 4;
    Tensor cache, start, stop;
    OrtStatus *st;
    if ((st = read_input(ctx, 0, "cache", 4, cache, type))) return st;
    if ((st = read_input(ctx, 1, "start", 0, start, kInt64))) return st;
    if ((st = read_input(ctx, 2, "stop", 0, stop, kInt64))) return st;
    const int64_t B = cache.dims[0], S = cache.dims[1], H = cache.dims[2], d = cache.dims[3];
    const int64_t s0 = scalar(start), s1 = scalar(stop);
    if (s0 < 0 || s1 <= s0 || s1 > S) {
        char msg[160];
        std::snprintf(msg, sizeof msg, "dcmha CacheHeads: need 0 <= start < stop <= %lld "
                      "(the cache length); received start=%lld, stop=%lld", (long long)S,
                      (long long)s0, (long long)s1);
        return status(kInvalidArgument, msg);
    }
    const int64_t L = s1 - s0, dims[4] = {B, H, L, d};
    void *out_data = nullptr;
    if ((st = output(ctx, dims, 4, out_data))) return st;
    const char *src = reinterpret_cast<const char *>(cache.data);
    char *dst = static_cast<char *>(out_data);
    const size_t row = (size_t)d * item;
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < L; s++) {
            const char *in = src + ((size_t)(b * S + s0 + s) * H) * row;
            for (int64_t h = 0; h < H; h++) {
                const size_t at = (size_t)((b * H + h) * L + s);
                if (widen)
                    dcmha_half_to_float(reinterpret_cast<const uint16_t *>(in + (size_t)h * row),
                                        reinterpret_cast<float *>(dst) + at * d, d);
                else
                    std::memcpy(dst + at * row, in + (size_t)h * row, row);
            }
        }
    return nullptr;
}

/* QueryMatrix*: wq (B, G, T, M, M) from the query-side terms present (flags: 1 W, 2 D, 4 S). */
constexpr int64_t kW = 1, kD = 2, kS = 4;

OrtStatus *query_matrix(void *kernel, OrtKernelContext *ctx) {
    const Op &op = *static_cast<const Op *>(kernel);
    Tensor qw1, qw2, qdd, st;
    OrtStatus *st_;
    size_t i = 0;
    if ((op.flags & kW) && ((st_ = read_input(ctx, i++, "qw1", 5, qw1)) ||
                            (st_ = read_input(ctx, i++, "qw2", 5, qw2))))
        return st_;
    if ((op.flags & kD) && (st_ = read_input(ctx, i++, "qdd", 4, qdd))) return st_;
    if ((op.flags & kS) && (st_ = read_input(ctx, i++, "static", 3, st))) return st_;
    const Tensor &first = (op.flags & kW) ? qw1 : qdd;   /* every op has W or D */
    const int64_t B = first.dims[0], T = first.dims[1], G = first.dims[2],
                  M = first.dims[first.rank - 1], R = (op.flags & kW) ? qw1.dims[3] : 1;
    bool ok = true;
    if (op.flags & kW)
        for (int a = 0; a < 5; a++) ok = ok && qw2.dims[a] == qw1.dims[a];
    if (op.flags & kD)
        ok = ok && qdd.dims[0] == B && qdd.dims[1] == T && qdd.dims[2] == G && qdd.dims[3] == M;
    if (op.flags & kS) ok = ok && st.dims[0] == G && st.dims[1] == M && st.dims[2] == M;
    if (!ok) {
        char msg[200];
        std::snprintf(msg, sizeof msg, "dcmha %s: need qw1, qw2 (B, T, G, R, M), qdd (B, T, G, M) "
                      "and static (G, M, M) of one B, T, G, M; the first term present has "
                      "(B, T, G, M) = (%lld, %lld, %lld, %lld)", op.name, (long long)B,
                      (long long)T, (long long)G, (long long)M);
        return status(kInvalidArgument, msg);
    }
    const int64_t dims[5] = {B, G, T, M, M};
    void *out_data = nullptr;
    if ((st_ = output(ctx, dims, 5, out_data))) return st_;
    dcmha_query_matrix(B, T, G, M, R, qw1.data, qw2.data, qdd.data, st.data,
                       static_cast<float *>(out_data), 1);
    return nullptr;
}

/* The cos / sin rows (d/2 floats each, float64 angles rounded to float) of positions
   [0, n) for one inv_freq, per thread: a graph's calls share their positions. */
struct RopeTable {
    std::vector<double> inv;
    std::vector<float> c, s;
    int64_t n = 0;
};
constexpr int64_t kRopeTableFloats = int64_t(1) << 22;   /* per table; later positions: per call */

void rope_row(const double *inv, int64_t half, int64_t p, float *c, float *s) {
    for (int64_t j = 0; j < half; j++) {
        const double a = (double)p * inv[j];
        c[j] = (float)std::cos(a);
        s[j] = (float)std::sin(a);
    }
}

constexpr int64_t kHeads = 1 << 8;   /* RopeHeads*: a projection's q | k columns, heads first */

OrtStatus *rope(void *kernel, OrtKernelContext *ctx) {
    const Op &op = *static_cast<const Op *>(kernel);
    const int type = (int)(op.flags & 0xff);
    const bool split = (op.flags & kHeads) != 0;
    Tensor x, pos, inv, heads;
    OrtStatus *st;
    if ((st = read_input(ctx, 0, "x", split ? 3 : 4, x, type))) return st;
    if ((st = read_input(ctx, 1, "positions", 1, pos, kInt64))) return st;
    if ((st = read_input(ctx, 2, "inv_freq", 1, inv, kDouble))) return st;
    const int64_t B = x.dims[0], L = x.dims[1], half = inv.dims[0], d = 2 * half;
    int64_t H, H0, x_row;
    void *out0 = nullptr, *out1 = nullptr;
    if (split) {   /* x (B, L, W): heads[0] query heads, then heads[1] key heads of d */
        if ((st = read_input(ctx, 3, "heads", 1, heads, kInt64))) return st;
        const int64_t *nh = reinterpret_cast<const int64_t *>(heads.data);
        x_row = x.dims[2];
        /* N, N_kv >= 1 with (N + N_kv) d <= W, compared as N <= W / d and
           N_kv <= W / d - N, so that no product or sum of the inputs' values overflows */
        const int64_t fit = half < 1 ? 0 : x_row / d;
        const bool ok = heads.dims[0] == 2 && nh[0] >= 1 && nh[1] >= 1 && nh[0] <= fit &&
                        nh[1] <= fit - nh[0];
        H0 = ok ? nh[0] : 0;
        H = ok ? nh[0] + nh[1] : 0;
        if (!ok || pos.dims[0] != L || half < 1) {
            char msg[240];
            std::snprintf(msg, sizeof msg, "dcmha RopeHeads: need positions (L,), inv_freq "
                          "(d/2,) and heads (N, N_kv), both >= 1, with (N + N_kv) d <= W for x "
                          "(B, L, W) = (%lld, %lld, %lld); received positions (%lld,), inv_freq "
                          "(%lld,), heads of %lld values", (long long)B, (long long)L,
                          (long long)x_row, (long long)pos.dims[0], (long long)half,
                          (long long)heads.dims[0]);
            return status(kInvalidArgument, msg);
        }
        const int64_t qd[4] = {B, H0, L, d}, kd[4] = {B, H - H0, L, d};
        if ((st = output(ctx, qd, 4, out0, 0)) || (st = output(ctx, kd, 4, out1, 1))) return st;
    } else {       /* x (B, L, H, d) -> out, the same layout */
        H = H0 = x.dims[2];
        x_row = H * x.dims[3];
        if (pos.dims[0] != L || x.dims[3] % 2 || half != x.dims[3] / 2) {
            char msg[200];
            std::snprintf(msg, sizeof msg, "dcmha Rope: need positions (L,) and inv_freq (d/2,) "
                          "for x (B, L, H, d) = (%lld, %lld, %lld, %lld) with d even; received "
                          "positions (%lld,), inv_freq (%lld,)", (long long)B, (long long)L,
                          (long long)H, (long long)x.dims[3], (long long)pos.dims[0],
                          (long long)half);
            return status(kInvalidArgument, msg);
        }
        if ((st = output(ctx, x.dims, 4, out0))) return st;
    }
    if (B * L * H * d == 0) return nullptr;

    /* this call's cos / sin rows (L, half), from the thread's table */
    const double *invf = reinterpret_cast<const double *>(inv.data);
    const int64_t *p = reinterpret_cast<const int64_t *>(pos.data);
    thread_local RopeTable table;
    if (table.inv.size() != (size_t)half ||
        std::memcmp(table.inv.data(), invf, sizeof(double) * (size_t)half)) {
        table.inv.assign(invf, invf + half);
        table.c.clear();
        table.s.clear();
        table.n = 0;
    }
    const int64_t most = kRopeTableFloats / half;   /* positions the table may hold */
    int64_t need = 0;
    for (int64_t l = 0; l < L; l++)
        if (p[l] >= need && p[l] < most) need = p[l] + 1;
    if (need > table.n) {
        const int64_t n = std::min(most, std::max(need, 2 * table.n));
        table.c.resize((size_t)(n * half));
        table.s.resize((size_t)(n * half));
        for (int64_t i = table.n; i < n; i++)
            rope_row(invf, half, i, &table.c[(size_t)(i * half)], &table.s[(size_t)(i * half)]);
        table.n = n;
    }
    thread_local std::vector<float> rows;
    rows.resize((size_t)(2 * L * half));
    float *cs = rows.data(), *sn = cs + L * half;
    for (int64_t l = 0; l < L; l++) {
        float *c = cs + l * half, *s = sn + l * half;
        if (p[l] >= 0 && p[l] < table.n) {
            std::memcpy(c, &table.c[(size_t)(p[l] * half)], sizeof(float) * (size_t)half);
            std::memcpy(s, &table.s[(size_t)(p[l] * half)], sizeof(float) * (size_t)half);
        } else {
            rope_row(invf, half, p[l], c, s);
        }
        if (type == kFloat16) {   /* the angles' cos / sin in x's type, as the body has them */
            dcmha_round_to_half(c, half);
            dcmha_round_to_half(s, half);
        }
    }
    struct Job {
        const void *x;
        void *out0, *out1;
        const float *c, *s;
        int64_t L, H, H0, d, x_row, rows, parts;
        int f16, heads_first;
    } job{x.data, out0, out1, cs, sn, L, H, H0, d, x_row, B * L, 1, type == kFloat16, split};
    auto run = [](void *data, size_t part) {   /* rows [r0, r1) of the B L rows */
        const Job &j = *static_cast<const Job *>(data);
        dcmha_rope_rows(j.rows * (int64_t)part / j.parts, j.rows * ((int64_t)part + 1) / j.parts,
                        j.L, j.H, j.d, j.x, j.x_row, j.out0, j.out1, j.H0, j.heads_first, j.c,
                        j.s, j.f16);
    };
    /* rows in parts over the intra-op threads where the call is large enough */
    return in_parts(ctx, B * L * H * d >= 65536 ? std::min<int64_t>(B * L, 8) : 1, run, &job,
                    job.parts);
}

int rope_input_type(const OrtCustomOp *o, size_t i) {
    return i == 0 ? (int)(op_of(o).flags & 0xff) : i == 2 ? kDouble : kInt64;
}
int rope_output_type(const OrtCustomOp *o, size_t) { return (int)(op_of(o).flags & 0xff); }
size_t rope_outputs(const OrtCustomOp *o) { return op_of(o).flags & kHeads ? 2 : 1; }

int cache_heads_input_type(const OrtCustomOp *o, size_t i) {
    return i == 0 ? (int)(op_of(o).flags & 0xff) : kInt64;
}
int cache_heads_output_type(const OrtCustomOp *o, size_t) {
    return op_of(o).flags & kToFloat ? kFloat : (int)(op_of(o).flags & 0xff);
}

template <OrtStatus *(*F)(void *, OrtKernelContext *)>
void compute_v1(void *kernel, OrtKernelContext *ctx) {
    OrtStatus *st = F(kernel, ctx);
    if (st) api<void (*)(OrtStatus *)>(kReleaseStatus)(st);
}

void *create(const OrtCustomOp *o, const void *, const OrtKernelInfo *) {
    return const_cast<Op *>(&op_of(o));
}
OrtStatus *create_v2(const OrtCustomOp *o, const void *, const OrtKernelInfo *, void **k) {
    *k = const_cast<Op *>(&op_of(o));
    return nullptr;
}
void destroy(void *) {}
const char *name_of(const OrtCustomOp *o) { return op_of(o).name; }
const char *cpu(const OrtCustomOp *) { return nullptr; }   /* the CPU provider */
int float_type(const OrtCustomOp *, size_t) { return kFloat; }
size_t input_count(const OrtCustomOp *o) { return op_of(o).inputs; }
size_t one(const OrtCustomOp *) { return 1; }
int required(const OrtCustomOp *, size_t) { return 0; }     /* INPUT_OUTPUT_REQUIRED */
int default_memory(const OrtCustomOp *, size_t) { return 0; }   /* OrtMemTypeDefault */
int arity(const OrtCustomOp *) { return 1; }
int first_version(const OrtCustomOp *) { return 1; }
int last_version(const OrtCustomOp *) { return 2147483647; }
size_t no_pairs(int **a, int **b) { *a = nullptr; *b = nullptr; return 0; }
void release_pairs(int *, int *) {}

int probs_input_type(const OrtCustomOp *, size_t i) { return i == 2 || i == 3 ? kInt64 : kFloat; }

/* An op's OrtCustomOp: compute function F, its input and output types and output count. */
template <OrtStatus *(*F)(void *, OrtKernelContext *)>
constexpr OrtCustomOp custom_op(int (*input_type)(const OrtCustomOp *, size_t) = float_type,
                                int (*output_type)(const OrtCustomOp *, size_t) = float_type,
                                size_t (*outputs)(const OrtCustomOp *) = one) {
    return OrtCustomOp{kOpVersion, create, name_of, cpu, input_type, input_count, output_type,
                       outputs, compute_v1<F>, destroy, required, required, default_memory,
                       arity, arity, arity, arity, create_v2, F, nullptr, first_version,
                       last_version, no_pairs, release_pairs, no_pairs, release_pairs};
}

constexpr OrtCustomOp kComposeOp = custom_op<compute>(),
                      kCacheHeadsOp = custom_op<cache_heads>(cache_heads_input_type,
                                                             cache_heads_output_type),
                      kQueryMatrixOp = custom_op<query_matrix>(),
                      kRopeOp = custom_op<rope>(rope_input_type, rope_output_type, rope_outputs),
                      kProbsOp = custom_op<probs>(probs_input_type);

constexpr int64_t Q = DCMHA_HAS_WQ, K = DCMHA_HAS_KW, D = DCMHA_HAS_KDD;
Op g_ops[] = {
    {kComposeOp, "ComposeQ", Q, 2},           {kComposeOp, "ComposeK", K, 3},
    {kComposeOp, "ComposeD", D, 2},           {kComposeOp, "ComposeQK", Q | K, 4},
    {kComposeOp, "ComposeQD", Q | D, 3},      {kComposeOp, "ComposeKD", K | D, 4},
    {kComposeOp, "ComposeQKD", Q | K | D, 5},
    {kCacheHeadsOp, "CacheHeads", kFloat, 3},
    {kCacheHeadsOp, "CacheHeads16", kFloat16, 3},
    {kCacheHeadsOp, "CacheHeads16F", kFloat16 | kToFloat, 3},
    {kQueryMatrixOp, "QueryMatrixW", kW, 2},
    {kQueryMatrixOp, "QueryMatrixD", kD, 1},
    {kQueryMatrixOp, "QueryMatrixWD", kW | kD, 3},
    {kQueryMatrixOp, "QueryMatrixWS", kW | kS, 3},
    {kQueryMatrixOp, "QueryMatrixDS", kD | kS, 2},
    {kQueryMatrixOp, "QueryMatrixWDS", kW | kD | kS, 4},
    {kRopeOp, "Rope", kFloat, 3},
    {kRopeOp, "Rope16", kFloat16, 3},
    {kRopeOp, "RopeHeads", kFloat | kHeads, 4},
    {kRopeOp, "RopeHeads16", kFloat16 | kHeads, 4},
};

/* Every op: g_ops, then Probs<pre>_<post> for each pair of stages (a stage: the letters of
   a Compose op, or none; not both none), in dcmha.export.core.PROBS_OPS's order. Built once;
   onnxruntime keeps pointers to the entries. */
const std::vector<Op> &all_ops() {
    static const std::vector<std::string> names = [] {
        std::vector<std::string> n;
        for (const char *a : {"", "Q", "K", "D", "QK", "QD", "KD", "QKD"})
            for (const char *b : {"", "Q", "K", "D", "QK", "QD", "KD", "QKD"})
                if (*a || *b) n.push_back(std::string("Probs") + a + "_" + b);
        return n;
    }();
    static const std::vector<Op> ops = [] {
        std::vector<Op> all(std::begin(g_ops), std::end(g_ops));
        for (const std::string &name : names) {
            int64_t flags = 0, inputs = 4;   /* x, bias, t0, s0, then the stages' terms */
            const size_t cut = name.find('_');
            for (size_t c = 5; c < name.size(); c++) {
                const int64_t bit = name[c] == 'Q' ? Q : name[c] == 'K' ? K : name[c] == 'D' ? D : 0;
                flags |= c < cut ? bit : bit << 3;
                inputs += name[c] == 'K' ? 2 : bit ? 1 : 0;
            }
            all.push_back(Op{kProbsOp, name.c_str(), flags, (size_t)inputs});
        }
        return all;
    }();
    return ops;
}

}  // namespace

extern "C" DCMHA_EXPORT OrtStatus *RegisterCustomOps(OrtSessionOptions *options,
                                                     const OrtApiBase *base) {
    g_api = base->GetApi(kParallelApi);
    g_parallel = g_api != nullptr;
    if (!g_api) g_api = base->GetApi(1);
    if (!g_api) return nullptr;   /* cannot happen: every onnxruntime serves version 1 */
    OrtCustomOpDomain *domain = nullptr;
    OrtStatus *st = api<OrtStatus *(*)(const char *, OrtCustomOpDomain **)>(
        kCreateCustomOpDomain)("dcmha", &domain);
    for (const Op &op : all_ops())
        if (!st)
            st = api<OrtStatus *(*)(OrtCustomOpDomain *, const OrtCustomOp *)>(
                kCustomOpDomainAdd)(domain, &op.base);
    if (!st)
        st = api<OrtStatus *(*)(OrtSessionOptions *, OrtCustomOpDomain *)>(kAddCustomOpDomain)(
            options, domain);
    return st;
}

/* The names of the ops registered (all_ops), separated by spaces (the loader checks them). */
extern "C" DCMHA_EXPORT const char *dcmha_ort_op_names(void) {
    static const std::string names = [] {
        std::string all;
        for (const Op &op : all_ops()) all += (all.empty() ? "" : " ") + std::string(op.name);
        return all;
    }();
    return names.c_str();
}

DCMHA_DEFINE_ARGS_LAYOUT(dcmha_cxx_args_layout, dcmha_cxx_args_names)
