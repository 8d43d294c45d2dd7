"""The compose stages of a DCMHA function body: each stage's factors, made once per call,
the compose itself (plain ops or one ``Compose*`` node) and a block's compose, softmax and
compose as one ``Probs*`` node."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from dcmha.export.body_state import BodyState
from dcmha.export.kernel_functions import merged_matrix
from dcmha.export.op_names import DOMAIN
from dcmha.spec import terms as spec_terms

#: The compose terms this translation writes (see ``Composition.factors``).
EXPORTED_TERMS = frozenset({"qw1", "qw2", "kw1", "kw2", "qdd", "kdd", "static"})


class Composition(BodyState):
    """Writes the compose stages of the scores (pre-softmax) and probabilities
    (post-softmax) within each group of heads, as ``reference.compose`` defines them:
    ``factors`` makes each stage's query and key factors from the dynamic weights (and the
    static term) once per call, ``compose`` applies a stage to a block, and ``_probs_node``
    writes compose, softmax and compose of a masked block as one kernel op."""

    # Compose works on x in the layout (B, G, T, M, S). Per query position t
    # the query-side terms and the residual form one (M, M) matrix per group,
    #     Wq_t^T = I + static^T + qw2_t^T qw1_t + diag(qdd_t),
    # applied to the (M, S) slices by one batched MatMul; per key position s
    # the key-side terms form Wk_s = kw1_s^T kw2_s + diag(kdd_s), applied to
    # the (T, M) slices of the (B, G, S, T, M) view. This is reference.compose
    # in merged form (every term reads the input). The (T*M, S) <-> (S, T*M)
    # switch is written as a 2-D transpose between reshapes: onnxruntime
    # transposes that fast, and the reshapes stop its transpose optimiser
    # from fusing it with neighbours into a (T, M, S) -> (S, M, T) transpose,
    # which is ~30x slower. (Einsums were ~7x slower than all this.)

    def _merged(self, w1, w2, dd, static, residual, transposed):
        """(B, G, L, M, M) matrices [I] + [static] + w1^T w2 + diag(dd), or their transpose
        (``merged_matrix``), float32.

        w1, w2: (B, L, G, R, M); dd: (B, L, G, M); static: (G, M, M). None if empty.
        """
        e, F = self.e, TensorProto.FLOAT
        cast = lambda t: None if t is None else e.cast(t, self.ft, F)
        return merged_matrix(e, cast(w1), cast(w2), cast(dd), cast(static), residual, transposed,
                             self.c(np.eye(self.cfg.M), F))

    def _query_matrix_node(self, q, static):
        """The per-query matrix Wq (B, G, L, M, M) of ``factors`` as one
        ``dcmha.QueryMatrix<W|D|S>`` node (``query_matrix_function``)."""
        e, F = self.e, TensorProto.FLOAT
        letters = ("W" if "w1" in q else "") + ("D" if "dd" in q else "") + (
            "S" if static is not None else "")
        terms = ([q["w1"], q["w2"]] if "w1" in q else []) + ([q["dd"]] if "dd" in q else []) + (
            [static] if static is not None else [])
        types = [self.dyn_type] * (len(terms) - (static is not None)) + [self.ft]   # static: a weight
        return e.op("QueryMatrix" + letters, *[e.cast(t, ty, F) for t, ty in zip(terms, types)],
                    domain=DOMAIN)

    def _key_side_low_rank(self, x, k):
        """The key-side terms applied to x (B, G, T, M, S) as they are (low rank + diagonal):

            out[t, n, s] = sum_r kw2[s, r, n] sum_m kw1[s, r, m] x[t, m, s] + kdd[s, n] x[t, n, s]

        by broadcasting along s, the last axis. A decode step has few queries, and the
        (S, M, M) matrices of the merged form would cost more than the step's scores.
        """
        e, F = self.e, TensorProto.FLOAT
        out = None
        if "w1" in k:
            def key_major(w):   # (B, S, G, R, M) -> (B, G, 1, R, M, S)
                return e.op("Unsqueeze", e.op("Transpose", e.cast(w, self.ft, F), perm=[0, 2, 3, 4, 1]),
                            e.i64(2))
            h = e.op("ReduceSum", e.op("Mul", e.op("Unsqueeze", x, e.i64(3)), key_major(k["w1"])),
                     e.i64(4), keepdims=1)                                    # (B, G, T, R, 1, S)
            out = e.op("ReduceSum", e.op("Mul", h, key_major(k["w2"])), e.i64(3), keepdims=0)
        if "dd" in k:       # (B, S, G, M) -> (B, G, 1, M, S)
            dd = e.op("Unsqueeze", e.op("Transpose", e.cast(k["dd"], self.ft, F), perm=[0, 2, 3, 1]),
                      e.i64(2))
            diag = e.op("Mul", x, dd)
            out = diag if out is None else e.op("Add", out, diag)
        return out

    def factors(self, qdyn, kdyn):
        """The two factors of each enabled compose stage, made once for every position:
        ({stage: (Wq (B, G, T, M, M), position axis)}, {stage: (Wk, position axis)}).

        Wq = I + static + query terms, transposed for Wq @ x (position axis None when
        only the static term is on: (G, 1, M, M)); Wk = the key terms (B, G, S, M, M), or,
        for a decode step, the key-side weights themselves ({"w1", "w2", "dd"}, axis 1)
        for ``_key_side_low_rank``. The chunks of ``attend_chunks`` slice them.
        """
        cfg = self.cfg
        qf, kf = {}, {}
        for stage in [s for s, on in (("pre", cfg.pre_compose), ("post", cfg.post_compose)) if on]:
            q = qdyn.get(stage + "_query", {})
            k = kdyn.get(stage + "_key", {})
            static = self.w["static_" + stage] if cfg.static_compose else None
            # The terms the spec makes of these weights: a term this translation does not
            # know (one added to spec.terms later) is refused, never silently dropped.
            unknown = sorted(set(spec_terms.stage_terms(stage, qdyn, kdyn, static))
                             - EXPORTED_TERMS)
            if unknown:
                raise NotImplementedError(
                    f"The ONNX exporter does not translate the compose terms {unknown} of "
                    f"the {stage} stage (it translates {sorted(EXPORTED_TERMS)}).")
            if q and self.compose_nodes:
                qf[stage] = (self._query_matrix_node(q, static), 2)
            elif q or static is not None:
                W = self._merged(q.get("w1"), q.get("w2"), q.get("dd"), static, True, True)
                if self.compose_nodes:   # static only: (G, 1, M, M) -> (1, G, 1, M, M)
                    W = self.e.op("Unsqueeze", W, self.e.i64(0))
                qf[stage] = (W, 2 if q else None)
            if k and self.compose_nodes:   # the key-side weights as they are, for Compose*
                kf[stage] = ({n: self.e.cast(x, self.dyn_type, TensorProto.FLOAT)
                              for n, x in k.items()}, 1)
            elif k:
                kf[stage] = (k, 1) if self.call.decode else (
                    self._merged(k.get("w1"), k.get("w2"), k.get("dd"), None, False, False), 2)
        return qf, kf

    def compose(self, x, stage, qf, kf, shapes, plus=None):
        """Compose x (B, G, T, M, S), float32, within each group (see reference.compose),
        with the stage's factors from ``factors``; ``plus`` (broadcastable) is added to
        the result in the same pass.

        shapes: int64 shape tensors "gtms" (B, G, T, M, S), "g_tm_s" (B, G, T*M, S),
        "g_s_tm" (B, G, S, T*M), "gstm" (B, G, S, T, M).
        """
        e = self.e
        if self.compose_nodes:
            return self._compose_node(x, stage, qf, kf, plus)
        terms = [e.op("MatMul", qf[stage][0], x) if stage in qf else x]   # else the residual alone
        Wk = kf[stage][0] if stage in kf else None
        if isinstance(Wk, dict):
            terms.append(self._key_side_low_rank(x, Wk))
        elif Wk is not None:
            xs = e.op("Transpose", e.op("Reshape", x, shapes["g_tm_s"]), perm=[0, 1, 3, 2])
            ks = e.op("MatMul", e.op("Reshape", xs, shapes["gstm"]), Wk)       # (B, G, S, T, M)
            ks = e.op("Transpose", e.op("Reshape", ks, shapes["g_s_tm"]), perm=[0, 1, 3, 2])
            terms.append(e.op("Reshape", ks, shapes["gtms"]))
        if plus is not None:
            terms.append(plus)
        return terms[0] if len(terms) == 1 else e.op("Sum", *terms)

    def _stage_inputs(self, stage, qf, kf):
        """(letters, inputs) of a compose stage's ``Compose<letters>`` node after x: Q the
        per-query matrix, K the key-side pair, D the key-side gating ("": the residual)."""
        Wk = kf[stage][0] if stage in kf else {}
        letters = ("Q" if stage in qf else "") + ("K" if "w1" in Wk else "") + ("D" if "dd" in Wk else "")
        inputs = ([qf[stage][0]] if stage in qf else []) + (
            [Wk["w1"], Wk["w2"]] if "w1" in Wk else []) + ([Wk["dd"]] if "dd" in Wk else [])
        return letters, inputs

    def _compose_node(self, x, stage, qf, kf, plus):
        """compose() as one ``dcmha.Compose<Q|K|D>`` node on x (B, N, T, S) (see
        ``compose_function``); ``plus`` is added after it."""
        letters, inputs = self._stage_inputs(stage, qf, kf)
        out = self.e.op("Compose" + letters, x, *inputs, domain=DOMAIN) if letters else x
        return out if plus is None else self.e.op("Add", out, plus)

    def _keeps_mask(self) -> bool:
        """Whether a masked call multiplies its probabilities by the 0/1 mask (``attend``):
        where a row can have no visible key (with an attention_mask, or a window over a
        separate key input), and for (B, N, T, S) outputs."""
        cfg, call = self.cfg, self.call
        empty_rows = call.attention_mask or (cfg.sliding_window is not None
                                             and not (call.self_attention or call.decode))
        return bool(empty_rows or call.return_attention_scores or call.intermediates)

    def _fuses_probs(self, qf, kf) -> bool:
        """Whether a masked block's probabilities are one ``Probs`` node (``_probs_node``):
        with kernel nodes, a stage with a term, and no 0/1 multiplier (``_keeps_mask``)."""
        return bool(self.compose_nodes and (qf or kf) and not self._keeps_mask())

    def _probs_node(self, x, bias, qf, kf, offsets=None):
        """The probabilities Compose_post(softmax(Compose_pre(x) + bias)) of scores x
        (B, N, T, S) as one ``dcmha.Probs<pre>_<post>`` node (``probs_function``); x is
        the factors' block at ``offsets`` (t0, s0: int64 scalars; None: 0, 0)."""
        e = self.e
        stages = [self._stage_inputs(s, qf, kf) if on else ("", [])
                  for s, on in (("pre", self.cfg.pre_compose), ("post", self.cfg.post_compose))]
        if offsets is None:
            offsets = (e.const(0, TensorProto.INT64), e.const(0, TensorProto.INT64))
        return e.op(f"Probs{stages[0][0]}_{stages[1][0]}", x, bias, *offsets, *stages[0][1],
                    *stages[1][1], domain=DOMAIN)
