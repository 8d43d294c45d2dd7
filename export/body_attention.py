"""The attention of a DCMHA function body: scores, masks, the composed softmax and P.V,
over chunks of queries (an ONNX Loop) where the call is causal or windowed."""

from __future__ import annotations

import math
from typing import Dict

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from dcmha.export.body_compose import Composition
from dcmha.export.emitter import Emitter
from dcmha.export.op_names import CACHE_OPS, CACHE_WIDEN_OP, DOMAIN
from dcmha.spec import terms as spec_terms

#: Added to masked scores before the float32 softmax (``spec.terms.MASKED_SCORE``):
#: finite, so a fully masked row gives a finite (uniform) softmax that the final
#: mask zeroes, and far below any real score, so it absorbs the score.
MASKED_SCORE = float(spec_terms.MASKED_SCORE)
#: Queries per chunk of the chunked attention (``attend_chunks``) unless the
#: configuration sets ``query_chunk_size``: with plain-op composes, and with Compose nodes
#: (the kernel leaves less work per chunk, so fewer, larger chunks pay: benchmarks/RESULTS.md).
CHUNK = 64
KERNEL_CHUNK = 128


class Attention(Composition):
    """Writes the attention of the queries to the keys they can see: ``attend`` for one
    block (scores in float32, the mask as a bias and a 0/1 multiplier, the composes,
    softmax, P.V), ``_block`` for the visible key range of a run of queries, and
    ``attend_chunks`` for a whole call (one block, or a Loop over query chunks)."""

    def attend_chunks(self, rows, cols, T, S, offset):
        """attend() over chunks of CHUNK queries, each on the keys it can see (B, T, N*d_v).

        An ONNX Loop over ceil(T / CHUNK) chunks (SPEC.md, "Query chunking"): a
        causal or windowed chunk reads only its visible key range (terms.key_range),
        so the big (B, N, t, s) tensors shrink to the visible block (about half the
        work at T = S) and stay in the CPU cache. Keys outside that range are masked
        for every query of the chunk: their probabilities are exactly 0 and compose
        mixes heads at one (t, s) only, so the result is that of the full block.
        A decode step is one block (no Loop: its few new tokens would pay the
        Loop's overhead for nothing) on the keys written so far.
        """
        e, cfg, call = self.e, self.cfg, self.call
        I64 = TensorProto.INT64
        if not (call.use_causal_mask or call.decode) and cfg.sliding_window is None:
            o, _ = self.attend(rows, cols, e.const(0, I64), S)   # every query sees every key
            return o
        if call.decode:
            return self._block(rows, cols, e.const(0, I64), T, S, offset)
        chunk = cfg.query_chunk_size or (KERNEL_CHUNK if self.compose_nodes else CHUNK)
        c = e.const(chunk, I64)
        trips = e.op("Div", e.op("Add", T, e.const(chunk - 1, I64)), c)
        B = e.dims(rows[0], 0, 1)
        acc0 = e.op("ConstantOfShape", e.op("Concat", B, e.i64(0, cfg.N * cfg.d_v), axis=0),
                    value=numpy_helper.from_array(np.zeros(1, helper.tensor_dtype_to_np_dtype(self.ft))))
        outer = self.e
        self.e = body = Emitter(prefix="chunk_")
        i, cond, acc = "chunk_i", "chunk_cond", "chunk_acc"
        t0 = body.op("Mul", i, c)
        o = self._block(rows, cols, t0, body.op("Min", body.op("Add", t0, c), T), S, offset)
        nodes = body.nodes + [
            helper.make_node("Identity", [cond], ["chunk_cond_out"], name="chunk_cond_id"),
            helper.make_node("Concat", [acc, o], ["chunk_acc_out"], name="chunk_acc_cat", axis=1)]
        graph = helper.make_graph(
            nodes, "query_chunk",
            [helper.make_tensor_value_info(i, I64, []),
             helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
             helper.make_tensor_value_info(acc, self.ft, None)],
            [helper.make_tensor_value_info("chunk_cond_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("chunk_acc_out", self.ft, None)])
        self.e = outer
        return outer.op("Loop", trips, "", acc0, body=graph)

    def kv_layouts(self, k, v):
        """(k (B, N_kv, S, d) float32, v (B, N_kv, S, d_v)) from k, v (B, S, N_kv, ...): the
        positions of both on axis 2, where a chunk's key range is a contiguous run per head."""
        e = self.e
        if not self.heads_first:
            k = e.op("Transpose", k, perm=[0, 2, 1, 3])
        return e.cast(k, self.ft, TensorProto.FLOAT), e.op("Transpose", v, perm=[0, 2, 1, 3])

    def _block(self, rows, cols, t0, t1, S, offset):
        """attend() of the queries [t0, t1) to the keys they can see (terms.key_range): the
        queries sit at absolute positions offset + t; S is the number of keys."""
        e, cfg, call = self.e, self.cfg, self.call
        I64 = TensorProto.INT64
        causal, window = call.use_causal_mask or call.decode, cfg.sliding_window
        s0, s1 = e.const(0, I64), S
        if causal:
            s1 = e.op("Min", S, e.op("Add", t1, offset))
        if window is not None:
            w = e.const(window, I64)
            s0 = e.op("Max", s0, e.op("Add", e.op("Sub", e.op("Add", t0, offset), w), e.const(1, I64)))
            if not causal:
                s1 = e.op("Min", S, e.op("Sub", e.op("Add", e.op("Add", t1, offset), w), e.const(1, I64)))
            # queries past the last key + window see none: keep one (masked) key, never
            # an empty block
            s0 = e.op("Min", s0, e.op("Sub", s1, e.const(1, I64)))
        tt = (e.op("Unsqueeze", t0, e.i64(0)), e.op("Unsqueeze", t1, e.i64(0)))
        ss = (e.op("Unsqueeze", s0, e.i64(0)), e.op("Unsqueeze", s1, e.i64(0)))

        def cut(x, lo_hi, axis):
            return e.op("Slice", x, lo_hi[0], lo_hi[1], e.i64(axis))

        def cut_factors(factors, lo_hi):
            out = {}
            for stage, (t, axis) in factors.items():
                if axis is not None:
                    t = ({n: cut(x, lo_hi, axis) for n, x in t.items()} if isinstance(t, dict)
                         else cut(t, lo_hi, axis))
                out[stage] = (t, axis)
            return out

        q, qf, q_pos, mask = rows
        k, v, kf = cols
        # a Probs node reads the block's part of the factors itself: they stay uncut
        fused = self._fuses_probs(qf, kf)
        offsets = (t0, s0) if fused else None
        cut_q = (lambda f: f) if fused else (lambda f: cut_factors(f, tt))
        cut_k = (lambda f: f) if fused else (lambda f: cut_factors(f, ss))
        if call.decode:   # one block of every query: only the keys are cut
            rows = (q, qf, q_pos, None if mask is None else cut(mask, ss, 2))
        else:
            rows = (cut(q, tt, 2 if self.heads_first else 1), cut_q(qf), cut(q_pos, tt, 0),
                    None if mask is None else cut(cut(mask, tt, 1), ss, 2))
        if call.decode and self.compose_nodes:   # the visible range heads first, one copy each
            # in float32 (a float16 cache widened in the same copy): the scores' and P.V's
            # MatMuls run in float32 on onnxruntime's CPU provider either way
            op = CACHE_OPS["float32"] if self.ft == TensorProto.FLOAT else CACHE_WIDEN_OP
            cols = (e.op(op, k, s0, s1, domain=DOMAIN), e.op(op, v, s0, s1, domain=DOMAIN),
                    cut_k(kf), TensorProto.FLOAT)                          # (B, N_kv, S, d)
        elif call.decode:
            cols = self.kv_layouts(cut(k, ss, 1), cut(v, ss, 1)) + (cut_k(kf),)
        else:
            cols = (cut(k, ss, 2), cut(v, ss, 2), cut_k(kf))
        o, _ = self.attend(rows, cols, s0, e.op("Sub", s1, s0), offsets)
        return o

    def attend(self, rows, cols, s0, S, offsets=None):
        """Attention of the queries ``rows`` to the keys ``cols`` at positions s0 + [0, S).
        ``offsets`` (t0, s0): where the block lies in the query and key factors, which
        are then uncut (for ``_probs_node``); None: the factors are the block's.

        rows: (q (B, T, N, d), or (B, N, T, d) with ``heads_first``, the query factors
        (``factors``), absolute query positions
        (T,), attention_mask (B, T, S) or None); cols: (k (B, N_kv, S, d) float32,
        v (B, N_kv, S, d_v), the key factors[, v's type when it is not the dtype]).
        Returns (o (B, T, N*d_v), {"scores", "pre_composed", "probs", "attention_scores"}).
        """
        e, cfg, call, ft = self.e, self.cfg, self.call, self.ft
        F, I64 = TensorProto.FLOAT, TensorProto.INT64
        N, N_kv, d, d_v, G, M = cfg.N, cfg.N_kv, cfg.d, cfg.d_v, cfg.G, cfg.M
        q, qf, q_pos, mask = rows
        k, v, kf = cols[:3]
        outputs: Dict[str, str] = {}

        # mask (T, S) or (B, T, S), True = attend; None when nothing is masked
        causal = call.use_causal_mask or call.decode
        geometric = None
        if causal or cfg.sliding_window is not None:
            t = e.op("Unsqueeze", q_pos, e.i64(1))                                   # (T, 1)
            s = e.op("Unsqueeze", e.op("Range", s0, e.op("Add", s0, S), e.const(1, I64)),
                     e.i64(0))                                                       # (1, S)
            if causal:
                geometric = e.op("LessOrEqual", s, t)
            if cfg.sliding_window is not None:
                band = e.op("Less", e.op("Abs", e.op("Sub", t, s)), e.const(cfg.sliding_window, I64))
                geometric = band if geometric is None else e.op("And", geometric, band)
        if geometric is not None:
            geometric = e.op("Unsqueeze", geometric, e.i64(0))
            mask = geometric if mask is None else e.op("And", mask, geometric)

        # scores in float32. GQA: query head h reads kv head h // rep; the query heads are
        # grouped as (N_kv, rep) so that MatMul broadcasts k and v instead of copying them.
        rep = N // N_kv
        q32 = e.cast(q if self.heads_first else e.op("Transpose", q, perm=[0, 2, 1, 3]), ft, F)
        # (B, N, T, d)
        # k (B, N_kv, S, d) transposed right at the MatMul: onnxruntime folds the transpose
        # into the product (FusedMatMul, transB) instead of copying k
        if rep == 1:
            a = e.op("MatMul", q32, e.op("Transpose", k, perm=[0, 1, 3, 2]))        # (B, N, T, S)
        else:
            a = e.op("MatMul", e.reshape(q32, 0, N_kv, rep, -1, d),
                     e.op("Transpose", e.op("Unsqueeze", k, e.i64(2)), perm=[0, 1, 2, 4, 3]))
            # (B, N_kv, rep, T, S)
            a = e.op("Reshape", a, e.op("Concat", e.dims(a, 0, 1), e.i64(N), e.dims(a, 3, 5), axis=0))
        a = e.op("Mul", a, self.c(1.0 / math.sqrt(d), F))                            # (B, N, T, S)
        outputs["scores"] = a
        bnts = e.op("Shape", a)
        # the plain-op compose works on (B, G, T, M, S); Compose* nodes on (B, N, T, S)
        composing = (cfg.pre_compose or cfg.post_compose) and not self.compose_nodes

        shapes = {}
        if composing:
            B1, TS = e.dims(a, 0, 1), e.dims(a, 2, 4)
            T1, S1 = e.dims(a, 2, 3), e.dims(a, 3, 4)
            TM = e.op("Mul", T1, e.i64(M))
            shapes = {"gmts": e.op("Concat", B1, e.i64(G, M), TS, axis=0),
                      "gtms": e.op("Concat", B1, e.i64(G), T1, e.i64(M), S1, axis=0),
                      "g_tm_s": e.op("Concat", B1, e.i64(G), TM, S1, axis=0),
                      "g_s_tm": e.op("Concat", B1, e.i64(G), S1, TM, axis=0),
                      "gstm": e.op("Concat", B1, e.i64(G), S1, T1, e.i64(M), axis=0)}

        def to_gtms(t):   # (B, N, T, S) -> (B, G, T, M, S)
            return e.op("Transpose", e.op("Reshape", t, shapes["gmts"]), perm=[0, 1, 3, 2, 4])

        def to_bnts(t):   # (B, G, T, M, S) -> (B, N, T, S)
            return e.op("Reshape", e.op("Transpose", t, perm=[0, 1, 3, 2, 4]), bnts) if composing else t

        # The mask enters the big (B, N, T, S) tensors as two float factors made on
        # the small (B|1, T, S) mask: a bias added before the softmax (0 or
        # MASKED_SCORE: a + MASKED_SCORE == MASKED_SCORE for any real score) and a
        # 0/1 multiplier after it. onnxruntime's broadcasting Where is ~10x slower
        # than Add / Mul on these tensors (it was a third of the layer's time).
        # In a row with a visible key, exp(MASKED_SCORE - max) underflows to exactly 0
        # in float32 and compose mixes heads at one (t, s) only, so the multiplier is
        # needed only where a row can have no visible key (its softmax is uniform):
        # with an attention_mask, or a window over a separate key input.
        bias = keep = None
        if mask is not None:   # (B|1, T, S) -> (B|1, 1, T, 1, S) or (B|1, 1, T, S)
            mask = e.op("Unsqueeze", mask, e.i64(1, 3) if composing else e.i64(1))
            bias = e.op("Mul", e.op("Cast", e.op("Not", mask), to=F), self.c(MASKED_SCORE, F))
            if self._keeps_mask():
                keep = e.op("Cast", mask, to=F)
        if composing:
            a = to_gtms(a)
        fused = None
        if bias is not None and self._fuses_probs(qf, kf):   # compose, softmax, compose
            fused = self._probs_node(a, bias, qf, kf, offsets)
        elif offsets is not None:   # uncut factors reach only a Probs node (``_block``)
            raise AssertionError("a block with uncut factors must become a Probs node")
        if fused is not None:
            p = fused
        elif cfg.pre_compose and not call.intermediates:   # the mask bias in compose's last pass
            a = self.compose(a, "pre", qf, kf, shapes, plus=bias)
        else:
            if cfg.pre_compose:
                a = self.compose(a, "pre", qf, kf, shapes)
            if call.intermediates:
                outputs["pre_composed"] = to_bnts(a)
            if bias is not None:
                a = e.op("Add", a, bias)
        if fused is None:
            p = e.op("Softmax", a, axis=-1)
            if call.intermediates:
                outputs["probs"] = to_bnts(p if keep is None else e.op("Mul", p, keep))
            if cfg.post_compose:
                p = self.compose(p, "post", qf, kf, shapes)
        if keep is not None:
            # masked entries (and fully masked rows, whose softmax is uniform) become
            # exactly 0: p is finite, and p * 0 == 0, p * 1 == p
            p = e.op("Mul", p, keep)
        p = to_bnts(p)                                                               # (B, N, T, S)
        outputs["attention_scores"] = p
        # the probabilities leave float32 only for P.V (as in the Keras layer); with v in
        # float32 (``cols``' optional 4th entry: v's type), rounded to the dtype and back
        vh, v_type = v, (cols[3] if len(cols) > 3 else ft)                           # (B, N_kv, S, d_v)
        pc = e.cast(e.cast(p, F, ft), ft, v_type)
        if rep == 1:
            o = e.op("MatMul", pc, vh)                                               # (B, N, T, d_v)
        else:
            p5 = e.op("Reshape", pc, e.op("Concat", e.dims(pc, 0, 1), e.i64(N_kv, rep),
                                          e.dims(pc, 2, 4), axis=0))
            o = e.reshape(e.op("MatMul", p5, e.op("Unsqueeze", vh, e.i64(2))), 0, N, -1, d_v)
        o = e.op("Transpose", e.cast(o, v_type, ft), perm=[0, 2, 1, 3])             # (B, T, N, d_v)
        return e.reshape(o, 0, 0, N * d_v), outputs
