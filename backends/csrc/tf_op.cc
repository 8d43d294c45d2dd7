/* TensorFlow CPU ops around the dcmha compose kernel (loaded by dcmha.backends.tf_cpu with
   tf.load_op_library): DcmhaComposeForward(x, wq, kw1, kw2, kdd; flags) -> out and
   DcmhaComposeBackward(x, g, wq, kw1, kw2, kdd; flags) -> (dx, dwq, dkw1, dkw2, dkdd), the
   same arrays as the XLA FFI handlers (compose_wrap.h), each split over the device's CPU
   worker threads by (b, g) slices (dcmha_compose_split); DcmhaBlockProbsForward / Backward
   and DcmhaQueryMatrix / Backward, a training block's compose / masked softmax / compose
   and a stage's query factor, forward and backward, as xla_ffi.cc's handlers of the same
   names; and DcmhaDynamicWeights, a decoding step's dynamic weights
   (dcmha_dynamic_weights), split into its slots.

   Compiles on its own with TensorFlow's flags:
   c++ -std=c++17 -w $(python -c 'import tensorflow as tf;
   print(" ".join(tf.sysconfig.get_compile_flags()))') -c tf_op.cc */
#include "compose_wrap.h"

#include <functional>
#include <utility>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"

using namespace tensorflow;

static absl::Status same_shapes(shape_inference::InferenceContext *c, int first_input) {
    for (int i = 0; i < c->num_outputs(); i++) c->set_output(i, c->input(first_input + i));
    return absl::OkStatus();
}

/* The forward (backward = 0) or backward of a compose's Args or a block's DcmhaBlockProbs
   (dcmha_compose_split), split over the device's CPU worker threads (the intra-op pool);
   whole on this thread where there are none (threads 0: nothing is scheduled). */
template <typename Job>
static int split(OpKernelContext *c, const Job &job, int backward) {
    const auto *workers = c->device()->tensorflow_cpu_worker_threads();
    const int64_t threads = workers && workers->workers ? workers->num_threads : 0;
    return dcmha_compose_split(job, backward, threads, [workers](std::function<void()> task) {
        workers->workers->Schedule(std::move(task));
    });
}

/* The term-gradient outputs outs[0..k-1] as dcmha_grads / dcmha_block_grads take them:
   their data into d, their element counts into n. */
static void gradient_outputs(Tensor *const *outs, int k, float **d, int64_t *n) {
    for (int i = 0; i < k; i++) {
        d[i] = outs[i]->flat<float>().data();
        n[i] = outs[i]->NumElements();
    }
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

/* Both ops: the "flags" attribute, read once, and Args from x (input 0) and the terms. */
class DcmhaComposeOp : public OpKernel {
  public:
    explicit DcmhaComposeOp(OpKernelConstruction *c) : OpKernel(c) {
        OP_REQUIRES_OK(c, c->GetAttr("flags", &flags_));
    }
  protected:
    /* Args for x and the terms wq, kw1, kw2, kdd (inputs terms .. terms + 3); false, with
       the op failed, if x is not (B, G, M, t, s). */
    bool fill(OpKernelContext *c, Args &a, int terms) const {
        const Tensor &x = c->input(0);
        if (x.dims() != 5) {
            c->SetStatus(errors::InvalidArgument(
                "dcmha compose: x must be (B, G, M, t, s), got rank ", x.dims()));
            return false;
        }
        int64_t d[5];
        for (int i = 0; i < 5; i++) d[i] = x.dim_size(i);
        const Tensor &kw1 = c->input(terms + 1);
        /* the terms' sizes against x's before the kernel reads them; the backward's g
           (input 1) has x's shape */
        const char *why = dcmha_terms_problem(
            d, kw1.dims() == 5 ? kw1.dim_size(2) : 0, c->input(terms).NumElements(),
            kw1.NumElements(), c->input(terms + 2).NumElements(),
            c->input(terms + 3).NumElements(), flags_);
        if (!why && terms == 2 && c->input(1).NumElements() != x.NumElements())
            why = "dcmha compose: g must have x's shape (B, G, M, t, s)";
        if (why) {
            c->SetStatus(errors::InvalidArgument(why));
            return false;
        }
        const int64_t R = kw1.dims() == 5 ? kw1.dim_size(2) : 1;
        dcmha_fill(a, d, R, x.flat<float>().data(), c->input(terms).flat<float>().data(),
                   kw1.flat<float>().data(), c->input(terms + 2).flat<float>().data(),
                   c->input(terms + 3).flat<float>().data(), flags_);
        return true;
    }
    int64_t flags_;
};

class DcmhaComposeForwardOp : public DcmhaComposeOp {
  public:
    using DcmhaComposeOp::DcmhaComposeOp;
    void Compute(OpKernelContext *c) override {
        Args a;
        if (!fill(c, a, 1)) return;
        Tensor *out = nullptr;
        OP_REQUIRES_OK(c, c->allocate_output(0, c->input(0).shape(), &out));
        a.out = out->flat<float>().data();
        OP_REQUIRES(c, split(c, a, 0) == 0,
                    errors::ResourceExhausted("dcmha compose: out of memory"));
    }
};

class DcmhaComposeBackwardOp : public DcmhaComposeOp {
  public:
    using DcmhaComposeOp::DcmhaComposeOp;
    void Compute(OpKernelContext *c) override {
        Args a;
        if (!fill(c, a, 2)) return;
        Tensor *outs[5];        /* dx like x (input 0), the term gradients like the terms */
        for (int i = 0; i < 5; i++)
            OP_REQUIRES_OK(c, c->allocate_output(i, c->input(i == 0 ? 0 : i + 1).shape(),
                                                 &outs[i]));
        a.g = c->input(1).flat<float>().data();
        a.out = outs[0]->flat<float>().data();
        float *d[4];
        int64_t n[4];
        gradient_outputs(outs + 1, 4, d, n);
        dcmha_grads(a, d, n, flags_);
        OP_REQUIRES(c, split(c, a, 1) == 0,
                    errors::ResourceExhausted("dcmha compose: out of memory"));
    }
};

/* ---- A training block's probabilities (dcmha_block_probs_slices) and a stage's query
   factor (dcmha_query_matrix), as the XLA FFI handlers of the same names compute them ---- */

REGISTER_OP("DcmhaBlockProbsForward")
    .Input("x: float")
    .Input("pre_wq: float").Input("pre_kw1: float").Input("pre_kw2: float")
    .Input("pre_kdd: float")
    .Input("post_wq: float").Input("post_kw1: float").Input("post_kw2: float")
    .Input("post_kdd: float").Input("vis: bool")
    .Output("out: float").Output("p: float")
    .Attr("pre_flags: int").Attr("post_flags: int").Attr("has_vis: int").Attr("masked: float")
    .SetShapeFn([](shape_inference::InferenceContext *c) {
        c->set_output(0, c->input(0));
        c->set_output(1, c->input(0));
        return absl::OkStatus();
    });

REGISTER_OP("DcmhaBlockProbsBackward")
    .Input("x: float").Input("p: float").Input("g: float")
    .Input("pre_wq: float").Input("pre_kw1: float").Input("pre_kw2: float")
    .Input("pre_kdd: float")
    .Input("post_wq: float").Input("post_kw1: float").Input("post_kw2: float")
    .Input("post_kdd: float").Input("vis: bool")
    .Output("dx: float")
    .Output("dpre_wq: float").Output("dpre_kw1: float").Output("dpre_kw2: float")
    .Output("dpre_kdd: float")
    .Output("dpost_wq: float").Output("dpost_kw1: float").Output("dpost_kw2: float")
    .Output("dpost_kdd: float")
    .Attr("pre_flags: int").Attr("post_flags: int").Attr("has_vis: int").Attr("masked: float")
    .SetShapeFn([](shape_inference::InferenceContext *c) {
        c->set_output(0, c->input(0));
        for (int i = 1; i < 9; i++) c->set_output(i, c->input(i + 2));
        return absl::OkStatus();
    });

/* Both block ops: x at input 0, the stages' 8 terms from input `terms`, vis after them. */
class DcmhaBlockProbsOp : public OpKernel {
  public:
    explicit DcmhaBlockProbsOp(OpKernelConstruction *c) : OpKernel(c) {
        for (auto [name, field] : {std::pair{"pre_flags", &pre_flags_},
                                   {"post_flags", &post_flags_}, {"has_vis", &has_vis_}})
            OP_REQUIRES_OK(c, c->GetAttr(name, field));
        OP_REQUIRES_OK(c, c->GetAttr("masked", &masked_));
    }
  protected:
    static DcmhaTermSizes sizes(OpKernelContext *c, int first) {
        const Tensor &kw1 = c->input(first + 1);
        return {kw1.dims() == 5 ? kw1.dim_size(2) : 0, c->input(first).NumElements(),
                kw1.NumElements(), c->input(first + 2).NumElements(),
                c->input(first + 3).NumElements()};
    }
    /* The job for x and the terms; false, with the op failed, when they do not fit (the
       arrays of x's size counted in `same`). */
    bool job(OpKernelContext *c, int terms, DcmhaBlockProbs &j,
             std::initializer_list<int64_t> same) const {
        const Tensor &x = c->input(0), &vis = c->input(terms + 8);
        if (x.dims() != 5) {
            c->SetStatus(errors::InvalidArgument("dcmha compose: x must be (B, G, M, t, s)"));
            return false;
        }
        int64_t d[5], v[3] = {0, 0, 0};
        for (int i = 0; i < 5; i++) d[i] = x.dim_size(i);
        for (int i = 0; i < vis.dims() && i < 3; i++) v[i] = vis.dim_size(i);
        const DcmhaTermSizes pre = sizes(c, terms), post = sizes(c, terms + 4);
        if (const char *why = dcmha_block_problem(d, x.NumElements(), pre, post, pre_flags_,
                                                  post_flags_, has_vis_, vis.dims(), v, same)) {
            c->SetStatus(errors::InvalidArgument(why));
            return false;
        }
        const float *t[8];
        for (int i = 0; i < 8; i++) t[i] = c->input(terms + i).flat<float>().data();
        j = dcmha_block_job(d, x.flat<float>().data(), t, pre, post, pre_flags_, post_flags_,
                            has_vis_ ? reinterpret_cast<const uint8_t *>(vis.flat<bool>().data())
                                     : nullptr,
                            v[0], masked_);
        return true;
    }
    int64_t pre_flags_, post_flags_, has_vis_;
    float masked_;
};

class DcmhaBlockProbsForwardOp : public DcmhaBlockProbsOp {
  public:
    using DcmhaBlockProbsOp::DcmhaBlockProbsOp;
    void Compute(OpKernelContext *c) override {
        DcmhaBlockProbs j;
        if (!job(c, 1, j, {})) return;
        Tensor *out = nullptr, *p = nullptr;
        OP_REQUIRES_OK(c, c->allocate_output(0, c->input(0).shape(), &out));
        OP_REQUIRES_OK(c, c->allocate_output(1, c->input(0).shape(), &p));
        j.out = out->flat<float>().data();
        j.p = p->flat<float>().data();
        OP_REQUIRES(c, split(c, j, 0) == 0,
                    errors::ResourceExhausted("dcmha compose: out of memory"));
    }
};

class DcmhaBlockProbsBackwardOp : public DcmhaBlockProbsOp {
  public:
    using DcmhaBlockProbsOp::DcmhaBlockProbsOp;
    void Compute(OpKernelContext *c) override {
        DcmhaBlockProbs j;
        if (!job(c, 3, j, {c->input(1).NumElements(), c->input(2).NumElements()})) return;
        Tensor *outs[9];       /* dx like x, the term gradients like the terms (inputs 3-10) */
        for (int i = 0; i < 9; i++)
            OP_REQUIRES_OK(c, c->allocate_output(i, c->input(i == 0 ? 0 : i + 2).shape(),
                                                 &outs[i]));
        float *d[8];
        int64_t n[8];
        gradient_outputs(outs + 1, 8, d, n);
        dcmha_block_grads(j, d, n, pre_flags_, post_flags_);
        j.p = const_cast<float *>(c->input(1).flat<float>().data());
        j.g = c->input(2).flat<float>().data();
        j.dx = outs[0]->flat<float>().data();
        OP_REQUIRES(c, split(c, j, 1) == 0,
                    errors::ResourceExhausted("dcmha compose: out of memory"));
    }
};

REGISTER_OP("DcmhaQueryMatrix")
    .Input("qw1: float").Input("qw2: float").Input("qdd: float").Input("static: float")
    .Output("wq: float").Attr("flags: int").Attr("shape: list(int)")
    .SetShapeFn([](shape_inference::InferenceContext *c) {
        std::vector<int64_t> shape;
        TF_RETURN_IF_ERROR(c->GetAttr("shape", &shape));
        std::vector<shape_inference::DimensionHandle> dims;
        for (int64_t n : shape) dims.push_back(c->MakeDim(n));
        c->set_output(0, c->MakeShape(dims));
        return absl::OkStatus();
    });

REGISTER_OP("DcmhaQueryMatrixBackward")
    .Input("qw1: float").Input("qw2: float").Input("qdd: float").Input("static: float")
    .Input("dwq: float")
    .Output("dqw1: float").Output("dqw2: float").Output("dqdd: float").Output("dstatic: float")
    .Attr("flags: int")
    .SetShapeFn([](shape_inference::InferenceContext *c) { return same_shapes(c, 0); });

/* Both query ops: wq (B, T, G, M, M) is the "shape" attribute (forward) or dwq's shape. */
class DcmhaQueryMatrixOp : public OpKernel {
  public:
    explicit DcmhaQueryMatrixOp(OpKernelConstruction *c) : OpKernel(c) {
        OP_REQUIRES_OK(c, c->GetAttr("flags", &flags_));
        if (c->HasAttr("shape")) OP_REQUIRES_OK(c, c->GetAttr("shape", &shape_));
    }
    void Compute(OpKernelContext *c) override {
        const bool backward = shape_.empty();
        std::vector<int64_t> d = shape_;
        if (backward)
            for (int i = 0; i < c->input(4).dims(); i++) d.push_back(c->input(4).dim_size(i));
        const Tensor &qw1 = c->input(0);
        int64_t q[5] = {0, 0, 0, 0, 0}, n[4], R;
        for (int i = 0; i < qw1.dims() && i < 5; i++) q[i] = qw1.dim_size(i);
        for (int i = 0; i < 4; i++) n[i] = c->input(i).NumElements();
        const char *why = dcmha_query_problem(d.data(), d.size(), q, qw1.dims(), n, flags_, &R,
                                              nullptr);
        OP_REQUIRES(c, why == nullptr, errors::InvalidArgument(why ? why : ""));
        const float *t[4];
        for (int i = 0; i < 4; i++) t[i] = c->input(i).flat<float>().data();
        float *dt[4] = {nullptr, nullptr, nullptr, nullptr};
        Tensor *wq = nullptr;
        if (backward) {
            for (int i = 0; i < 4; i++) {
                Tensor *o = nullptr;
                OP_REQUIRES_OK(c, c->allocate_output(i, c->input(i).shape(), &o));
                dt[i] = o->flat<float>().data();
            }
        } else {
            TensorShape shape;
            for (int64_t k : d) shape.AddDim(k);
            OP_REQUIRES_OK(c, c->allocate_output(0, shape, &wq));
        }
        dcmha_query_run(d.data(), R, t, wq ? wq->flat<float>().data() : nullptr,
                        backward ? c->input(4).flat<float>().data() : nullptr, dt, n, flags_,
                        backward);
    }

  private:
    int64_t flags_;
    std::vector<int64_t> shape_;
};

/* A decoding step's dynamic weights (dcmha_dynamic_weights), one output per slot: x (...,
   D) (BL rows); dw1 (D, G C K), qkw (G C, K, 2 rank, M) and dd (D, G C M), 1-element
   dummies where has_projection / has_gating is 0 -> the lists w1, w2 (c arrays (..., G,
   rank, M)) and g (c arrays (..., G, M)), empty arrays (G = 0) where absent. The slots
   come out split, in x's leading shape: a graph then needs no reshape or unstack op
   after this one (about 10 us each on a CPU). The weights are dw1, qkw and dd times
   weight_scale, applied here to x's few rows and to qkw (x (s dw1) = (s x) dw1), so that
   a graph needs no op that scales the weights either. */
REGISTER_OP("DcmhaDynamicWeights")
    .Input("x: float").Input("dw1: float").Input("qkw: float").Input("dd: float")
    .Output("w1: c * float").Output("w2: c * float").Output("g: c * float")
    .Attr("c: int >= 1").Attr("gc: int").Attr("k: int").Attr("rank: int").Attr("m: int")
    .Attr("has_projection: int").Attr("has_gating: int").Attr("gelu_approximate: int")
    .Attr("eps: float").Attr("weight_scale: float = 1.0")
    .SetShapeFn([](shape_inference::InferenceContext *c) {
        int64_t n, gc, rank, m, proj, gating;
        TF_RETURN_IF_ERROR(c->GetAttr("c", &n));
        TF_RETURN_IF_ERROR(c->GetAttr("gc", &gc));
        TF_RETURN_IF_ERROR(c->GetAttr("rank", &rank));
        TF_RETURN_IF_ERROR(c->GetAttr("m", &m));
        TF_RETURN_IF_ERROR(c->GetAttr("has_projection", &proj));
        TF_RETURN_IF_ERROR(c->GetAttr("has_gating", &gating));
        shape_inference::ShapeHandle lead, w, g;
        TF_RETURN_IF_ERROR(c->Subshape(c->input(0), 0, -1, &lead));
        TF_RETURN_IF_ERROR(c->Concatenate(
            lead, c->MakeShape({c->MakeDim(proj ? gc / n : 0), c->MakeDim(rank),
                                c->MakeDim(m)}), &w));
        TF_RETURN_IF_ERROR(c->Concatenate(
            lead, c->MakeShape({c->MakeDim(gating ? gc / n : 0), c->MakeDim(m)}), &g));
        for (int64_t i = 0; i < n; i++) {
            c->set_output(i, w);
            c->set_output(n + i, w);
            c->set_output(2 * n + i, g);
        }
        return absl::OkStatus();
    });

class DcmhaDynamicWeightsOp : public OpKernel {
  public:
    explicit DcmhaDynamicWeightsOp(OpKernelConstruction *c) : OpKernel(c) {
        for (auto [name, field] : {std::pair{"c", &c_}, {"gc", &gc_}, {"k", &k_},
                                   {"rank", &rank_}, {"m", &m_}, {"has_projection", &proj_},
                                   {"has_gating", &gating_}, {"gelu_approximate", &approx_}})
            OP_REQUIRES_OK(c, c->GetAttr(name, field));
        OP_REQUIRES_OK(c, c->GetAttr("eps", &eps_));
        OP_REQUIRES_OK(c, c->GetAttr("weight_scale", &scale_));
        OP_REQUIRES(c, c_ > 0 && gc_ % c_ == 0, errors::InvalidArgument(
                        "dcmha dynamic weights: gc must be a multiple of c, got gc=", gc_,
                        ", c=", c_));
    }
    void Compute(OpKernelContext *c) override {
        const Tensor &x = c->input(0);
        OP_REQUIRES(c, x.dims() >= 2, errors::InvalidArgument(
                        "dcmha dynamic weights: x must be (..., D), got rank ", x.dims()));
        const int64_t D = x.dim_size(x.dims() - 1), BL = x.NumElements() / (D ? D : 1);
        /* the weights' sizes against the attributes before the kernel reads them */
        const bool sizes_ok =
            gc_ >= 1 && k_ >= 1 && rank_ >= 1 && m_ >= 1 &&
            (!proj_ || (dcmha_count_is(c->input(1).NumElements(), {D, gc_, k_}) &&
                        dcmha_count_is(c->input(2).NumElements(), {gc_, k_, 2, rank_, m_}))) &&
            (!gating_ || dcmha_count_is(c->input(3).NumElements(), {D, gc_, m_}));
        OP_REQUIRES(c, sizes_ok, errors::InvalidArgument(
                        "dcmha dynamic weights: need gc, k, rank, m >= 1, dw1 (D, gc k), qkw "
                        "(gc, k, 2 rank, m) and dd (D, gc m) for x (..., D) with D = ", D));
        const int64_t G = gc_ / c_, RM = rank_ * m_;
        /* The kernel's stacked (BL, G C, rank, M) / (BL, G C, M) results, then the slots. */
        Tensor stacked[3];
        OP_REQUIRES_OK(c, c->allocate_temp(DT_FLOAT, TensorShape({BL, gc_ * RM}), &stacked[0]));
        OP_REQUIRES_OK(c, c->allocate_temp(DT_FLOAT, TensorShape({BL, gc_ * RM}), &stacked[1]));
        OP_REQUIRES_OK(c, c->allocate_temp(DT_FLOAT, TensorShape({BL, gc_ * m_}), &stacked[2]));
        const float *in[3];
        for (int i = 0; i < 3; i++) in[i] = c->input(i + 1).flat<float>().data();
        const float *xs = x.flat<float>().data();
        Tensor scaled[2];     /* s x and s qkw, where weight_scale is not 1 */
        if (scale_ != 1.0f) {
            const Tensor *from[2] = {&x, &c->input(2)};
            for (int i = 0; i < 2; i++) {
                const int64_t n = from[i]->NumElements();
                OP_REQUIRES_OK(c, c->allocate_temp(DT_FLOAT, TensorShape({n}), &scaled[i]));
                const float *src = from[i]->flat<float>().data();
                float *dst = scaled[i].flat<float>().data();
                for (int64_t j = 0; j < n; j++) dst[j] = scale_ * src[j];
            }
            xs = scaled[0].flat<float>().data();
            in[1] = scaled[1].flat<float>().data();
        }
        OP_REQUIRES(c, dcmha_dynamic_weights(
                           BL, D, gc_, k_, rank_, m_, xs,
                           proj_ ? in[0] : nullptr, in[1], gating_ ? in[2] : nullptr,
                           (int)approx_, eps_, stacked[0].flat<float>().data(),
                           stacked[1].flat<float>().data(),
                           stacked[2].flat<float>().data()) == 0,
                    errors::ResourceExhausted("dcmha dynamic weights: out of memory"));
        TensorShape w = x.shape(), g = x.shape();
        w.RemoveLastDims(1);
        g.RemoveLastDims(1);
        w.AppendShape(TensorShape({proj_ ? G : 0, rank_, m_}));
        g.AppendShape(TensorShape({gating_ ? G : 0, m_}));
        OpOutputList outs[3];
        const char *names[3] = {"w1", "w2", "g"};
        for (int i = 0; i < 3; i++) OP_REQUIRES_OK(c, c->output_list(names[i], &outs[i]));
        for (int i = 0; i < 3; i++) {
            const int present = i < 2 ? proj_ : gating_;
            const int64_t row = i < 2 ? RM : m_;     /* floats per (position, group, slot) */
            const float *src = stacked[i].flat<float>().data();
            for (int64_t slot = 0; slot < c_; slot++) {
                Tensor *out = nullptr;
                OP_REQUIRES_OK(c, outs[i].allocate(slot, i < 2 ? w : g, &out));
                if (!present) continue;
                float *dst = out->flat<float>().data();
                for (int64_t r = 0; r < BL; r++)
                    for (int64_t gi = 0; gi < G; gi++)
                        memcpy(dst + (r * G + gi) * row,
                               src + ((r * G + gi) * c_ + slot) * row, sizeof(float) * row);
            }
        }
    }

  private:
    int64_t c_, gc_, k_, rank_, m_, proj_, gating_, approx_;
    float eps_, scale_;
};

REGISTER_KERNEL_BUILDER(Name("DcmhaComposeForward").Device(DEVICE_CPU), DcmhaComposeForwardOp);
REGISTER_KERNEL_BUILDER(Name("DcmhaComposeBackward").Device(DEVICE_CPU), DcmhaComposeBackwardOp);
REGISTER_KERNEL_BUILDER(Name("DcmhaDynamicWeights").Device(DEVICE_CPU), DcmhaDynamicWeightsOp);
REGISTER_KERNEL_BUILDER(Name("DcmhaBlockProbsForward").Device(DEVICE_CPU),
                        DcmhaBlockProbsForwardOp);
REGISTER_KERNEL_BUILDER(Name("DcmhaBlockProbsBackward").Device(DEVICE_CPU),
                        DcmhaBlockProbsBackwardOp);
REGISTER_KERNEL_BUILDER(Name("DcmhaQueryMatrix").Device(DEVICE_CPU), DcmhaQueryMatrixOp);
REGISTER_KERNEL_BUILDER(Name("DcmhaQueryMatrixBackward").Device(DEVICE_CPU), DcmhaQueryMatrixOp);

DCMHA_DEFINE_ARGS_LAYOUT(dcmha_cxx_args_layout, dcmha_cxx_args_names)
