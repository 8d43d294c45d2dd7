"""The inputs' side of a DCMHA function body: the q, k, v projections (one MatMul for a
self-attention input), QK-norm, RoPE and the dynamic composition weights."""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from dcmha.export.body_state import BodyState
from dcmha.export.kernel_functions import _rope_ops
from dcmha.export.op_names import DOMAIN, ROPE_HEADS_OPS, ROPE_OPS
from dcmha.spec import reference as ref


class Projections(BodyState):
    """Writes what a DCMHA call makes of its inputs before the scores: the projections
    (``project``, ``fused_projections``), QK-norm (``rms``), RoPE (``rope``, or one
    ``RopeHeads`` node read from the fused projection) and the dynamic weights of every
    compose slot (``dynamic``), in spec.reference's order."""

    def gelu(self, x):
        """The dynamic weights' GELU of x (tanh form or exact, as the configuration says)."""
        e = self.e
        if self.cfg.gelu_approximate:
            # 0.5 x (1 + tanh(u)) == x / (1 + exp(-2u)): onnxruntime's Exp is accurate to
            # ~1 ulp while its Tanh is ~4 ulp, which the RMS-normalised w1 amplifies.
            x3 = e.op("Mul", e.op("Mul", x, x), x)
            u2 = e.op("Mul", e.op("Add", x, e.op("Mul", x3, self.c(0.044715))),
                      self.c(-2.0 * math.sqrt(2.0 / math.pi)))
            return e.op("Div", x, e.op("Add", e.op("Exp", u2), self.c(1.0)))
        t = e.op("Erf", e.op("Mul", x, self.c(1.0 / math.sqrt(2.0))))
        return e.op("Mul", e.op("Mul", x, self.c(0.5)), e.op("Add", t, self.c(1.0)))

    def rms(self, x, eps, out_type=None):
        """x / sqrt(mean(x**2, -1) + eps), in float32 (x**2 may overflow float16); the
        result in out_type (default: the dtype)."""
        e, F = self.e, TensorProto.FLOAT
        x32 = e.cast(x, self.ft, F)
        ms = e.op("ReduceMean", e.op("Mul", x32, x32), e.i64(-1), keepdims=1)
        y = e.op("Div", x32, e.op("Sqrt", e.op("Add", ms, self.c(eps, F))))
        return e.cast(y, F, self.ft if out_type is None else out_type)

    def rope(self, x, positions):
        """Rotate-half RoPE of x (B, L, H, d) at int64 positions (L,); angles in float64.
        With kernel nodes (``compose_nodes``) one ``dcmha.Rope`` / ``Rope16`` node
        (``rope_function``), else its plain ops."""
        cfg, inv = self.cfg, self._inv_freq()
        if self.compose_nodes:
            return self.e.op(ROPE_OPS[self.dtype], x, positions, inv, domain=DOMAIN)
        return _rope_ops(self.e, x, positions, inv, self.e.i64(cfg.d // 2), self.e.i64(cfg.d),
                         self.ft)

    def _inv_freq(self):
        """RoPE's inverse frequencies (d/2,), a float64 constant."""
        cfg = self.cfg
        return self.e.const(cfg.rope_max_wavelength ** (-np.arange(cfg.d // 2, dtype=np.float64)
                                                        * 2.0 / cfg.d), TensorProto.DOUBLE)

    def _rope_heads(self, y, positions):
        """(q (B, N, L, d), k (B, N_kv, L, d)): the query and key heads of a projection's
        output y (B, L, W) (its first (N + N_kv) d columns) after RoPE, heads first, as one
        ``dcmha.RopeHeads`` / ``RopeHeads16`` node (``rope_heads_function``)."""
        cfg, e = self.cfg, self.e
        return e.op(ROPE_HEADS_OPS[self.dtype], y, positions, self._inv_freq(),
                    e.i64(cfg.N, cfg.N_kv), domain=DOMAIN, outputs=2)

    def project(self, x, kernel, bias, D, H, hd):
        """x (B, L, D) projected to H heads of hd: (B, L, H, hd)."""
        e = self.e
        y = e.op("MatMul", x, e.reshape(kernel, D, H * hd))
        if bias is not None:
            y = e.op("Add", y, e.reshape(bias, H * hd))
        return e.reshape(y, 0, 0, H, hd)                                     # (B, L, H, hd)

    def fused_projections(self, x):
        """Every projection of the single input x (B, L, D) of a self-attention call as one
        MatMul (onnxruntime folds the concatenated kernel at load): q and k as one
        (B, L, N + N_kv, d) tensor after QK-norm and RoPE (one pass for both), v
        (B, L, N_kv, d_v), and x's products with dw1 / dd for ``dynamic``.

        Returns (q, k, v, positions (L,), {"dw1", "dd"}).
        """
        e, cfg, w = self.e, self.cfg, self.w
        N, N_kv, d, d_v, G, M, K = cfg.N, cfg.N_kv, cfg.d, cfg.d_v, cfg.G, cfg.M, cfg.K
        C, D = len(ref.slots(cfg)), self.D_q
        parts = [("qk", [("query", N * d), ("key", N_kv * d)]), ("v", [("value", N_kv * d_v)])]
        if C and cfg.dynamic_projection:
            parts.append(("dw1", [("dw1", G * C * K)]))
        if C and cfg.dynamic_gating:
            parts.append(("dd", [("dd", G * C * M)]))
        kernels, biases, sizes = [], [], []
        for _, members in parts:
            for name, width in members:
                kernels.append(e.reshape(w[name if name in ("dw1", "dd") else name + "_kernel"],
                                         D, width))
                if cfg.use_bias:
                    biases.append(e.reshape(w[name + "_bias"], width) if name + "_bias" in w
                                  else self.c(np.zeros(width)))
            sizes.append(sum(width for _, width in members))
        y = e.op("MatMul", x, e.op("Concat", *kernels, axis=1))
        if biases:
            y = e.op("Add", y, e.op("Concat", *biases, axis=0))
        # with ``heads_first``, RoPE reads q | k straight from y (``_rope_heads``): the other
        # parts are sliced out of y, the q | k part is left in place
        heads = self.heads_first
        if heads:
            ends = np.cumsum(sizes)
            outs = {n: e.op("Slice", y, e.i64(int(end - size)), e.i64(int(end)), e.i64(-1))
                    for (n, _), size, end in zip(parts, sizes, ends) if n != "qk"}
        else:
            outs = dict(zip([n for n, _ in parts], e.op("Split", y, e.i64(*sizes), axis=-1,
                                                       outputs=len(parts))
                            if len(parts) > 1 else [y]))
        qk = None if heads else e.reshape(outs["qk"], 0, 0, N + N_kv, d)
        if cfg.qk_norm:
            scale = e.op("Concat", *[e.op("Expand", e.op("Unsqueeze", w[n], e.i64(0)), e.i64(H, d))
                                     for n, H in (("query_norm_scale", N), ("key_norm_scale", N_kv))],
                         axis=0)                                             # (N + N_kv, d)
            qk = e.op("Mul", self.rms(qk, ref.QK_NORM_EPS), scale)
        T = e.scalar_dim(x, 1)
        one = e.const(1, TensorProto.INT64)
        if self.call.decode:
            positions = e.op("Range", "cache_update_index", e.op("Add", "cache_update_index", T), one)
        else:
            positions = e.op("Range", e.const(0, TensorProto.INT64), T, one)
        if heads:
            q, k = self._rope_heads(y, positions)
        else:
            if cfg.rope_max_wavelength is not None:
                qk = self.rope(qk, positions)
            q, k = e.op("Split", qk, e.i64(N, N_kv), axis=2, outputs=2)
        return q, k, e.reshape(outs["v"], 0, 0, N_kv, d_v), positions, outs

    def unstack(self, x, axis, num):
        """The ``num`` slices of x along ``axis`` (that axis dropped): one Gather each."""
        return [self.e.op("Gather", x, self.e.const(j, TensorProto.INT64), axis=axis)
                for j in range(num)]

    def dynamic(self, x, D, prefix, names, pick=None, pre=None, packed=None):
        """Dynamic weights of slots ``names`` from x (B, L, D): {slot: {"w1","w2","dd"}}.

        ``pick`` selects (by index) a subset of the projection's C slots, for a
        self-attention layer whose query and key inputs are different tensors.
        ``pre`` holds x's products with the dw1 / dd kernels where the caller made
        them (``fused_projections``). ``packed`` (slots of ``names``): their weights
        come stacked as the decode cache holds them (``spec.terms.KEY_CACHE``), made
        from the projection's output in a few nodes instead of one per slot and weight;
        returns (weights of the other slots, {"key_w", "key_dd"}).
        """
        pre = pre or {}
        e, cfg = self.e, self.cfg
        G, M, R, K = cfg.G, cfg.M, cfg.R, cfg.K
        C = len(names) if pick is None else len(ref.slots(cfg))
        out = {s: {} for s in names if s not in (packed or ())}
        entries = {}
        if not names:
            return out if packed is None else (out, entries)
        at = e.i64(*[names.index(s) for s in packed]) if packed else None
        sel = e.i64(*pick) if pick is not None else None
        Cs = len(names)
        if cfg.dynamic_projection:
            dw1, qkw = self.w[prefix + "dw1"], self.w[prefix + "qkw"]
            if sel is not None:
                dw1 = e.op("Gather", dw1, sel, axis=2)
                qkw = e.op("Gather", qkw, sel, axis=1)
            h = pre.get("dw1") or e.op("MatMul", x, e.reshape(dw1, D, G * Cs * K))
            h = self.gelu(h)                                                 # (B, L, G*C*K)
            # the G*C (K, 2RM) maps as one block-diagonal (G*C*K, G*C*2RM) MatMul: one GEMM
            # instead of B*L*G*C tiny ones (onnxruntime folds the block matrix at load)
            # (made in float32: onnxruntime has no float16 Mul kernel to fold it with)
            F = TensorProto.FLOAT
            blocks = e.op("Mul", e.cast(e.reshape(qkw, G, Cs, K, 1, 1, 2 * R * M), self.ft, F),
                          self.c(np.eye(G * Cs).reshape(G, Cs, 1, G, Cs, 1), F))
            w = e.op("MatMul", h, e.cast(e.reshape(blocks, G * Cs * K, G * Cs * 2 * R * M), F, self.ft))
            w = e.reshape(w, 0, 0, G, Cs, 2 * R, M)
            w1 = self.rms(e.op("Slice", w, e.i64(0), e.i64(R), e.i64(4)), ref.W1_NORM_EPS,
                          self.dyn_type)
            w2 = e.cast(e.op("Slice", w, e.i64(R), e.i64(2 * R), e.i64(4)), self.ft, self.dyn_type)
            for c, s in enumerate(names):
                if s in out:
                    out[s]["w1"] = e.op("Gather", w1, e.const(c, TensorProto.INT64), axis=3)
                    out[s]["w2"] = e.op("Gather", w2, e.const(c, TensorProto.INT64), axis=3)
            if at is not None:   # (B, L, G, C, 2R, M) -> (B, L, C_k, 2, G, R, M) -> key_w
                both = e.op("Gather", e.op("Concat", w1, w2, axis=4), at, axis=3)
                both = e.op("Transpose", e.reshape(both, 0, 0, G, len(packed), 2, R, M),
                            perm=[0, 1, 3, 4, 2, 5, 6])
                entries["key_w"] = e.cast(e.reshape(both, 0, 0, 2 * len(packed), G, R, M),
                                          self.dyn_type, self.ft)   # the cache's type
        if cfg.dynamic_gating:
            dd = self.w[prefix + "dd"]
            if sel is not None:
                dd = e.reshape(e.op("Gather", e.reshape(dd, D, G, C, M), sel, axis=2), D, G * Cs * M)
            g = e.op("Tanh", pre.get("dd") or e.op("MatMul", x, e.reshape(dd, D, G * Cs * M)))
            g = e.cast(e.reshape(g, 0, 0, G, Cs, M), self.ft, self.dyn_type)
            for c, s in enumerate(names):
                if s in out:
                    out[s]["dd"] = e.op("Gather", g, e.const(c, TensorProto.INT64), axis=3)
            if at is not None:   # (B, L, G, C_k, M) -> key_dd (B, L, C_k, G, M)
                entries["key_dd"] = e.cast(e.op("Transpose", e.op("Gather", g, at, axis=3),
                                                 perm=[0, 1, 3, 2, 4]), self.dyn_type, self.ft)
        return out if packed is None else (out, entries)
