"""The local functions of the kernel ops (``op_names.KERNEL_OPS``): each op's plain-op
body, which any ONNX runtime runs, and which onnxruntime replaces by the compiled op where
``dcmha.export.ort_ops`` is registered. ``kernel_function`` writes the function of any of
them; ``kernel_ops_used`` finds the ones a node list calls."""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dcmha.export.call_spec import DTYPES, check_opset
from dcmha.export.emitter import Emitter, rename_value
from dcmha.export.op_names import (CACHE_HEADS_OPS, CACHE_WIDEN_OP, COMPOSE_OPS, DOMAIN,
                                   KERNEL_OPS, PROBS_OPS, QUERY_OPS, ROPE_HEADS_OPS, ROPE_OPS,
                                   STAGE_LETTERS)


def compose_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function ``dcmha.Compose<Q|K|D...>`` (``_Body._compose_node``): compose
    x (B, N, T, S), float32, within each group, in plain ops.

    Inputs, in this order, each only where its letter is in the name: x; Q: wq (B|1, G,
    T|1, M, M), out[n] = sum_m wq[n, m] x[m] (residual and static terms included; without
    Q the residual x); K: kw1, kw2 (B, S, G, R, M); D: kdd (B, S, G, M) (the layout of the
    dynamic weights and the decode cache). onnxruntime runs the compiled kernel instead
    where ``dcmha.export.ort_ops`` is registered.
    """
    if name not in COMPOSE_OPS:
        raise ValueError(f"Not a Compose op name: {name!r} (expected Compose followed by Q, K, "
                         f"D in that order, e.g. 'ComposeQKD').")
    letters = name[len("Compose"):]
    e = Emitter()
    ins = ["x"] + _compose_inputs(letters)
    g_axis = 1 if "Q" in letters else 2          # wq (B, G, ...); kw1, kdd (B, S, G, ...)
    G = e.dims(ins[1], g_axis, g_axis + 1)
    x5 = e.op("Transpose", e.op("Reshape", "x", e.op("Concat", e.dims("x", 0, 1), G, e.i64(-1),
                                                      e.dims("x", 2, 4), axis=0)),
              perm=[0, 1, 3, 2, 4])                                           # (B, G, T, M, S)
    terms = [e.op("MatMul", "wq", x5) if "Q" in letters else x5]

    def key_major(w, perm):   # (B, S, G, ...) -> (B, G, 1, ..., S)
        return e.op("Unsqueeze", e.op("Transpose", w, perm=perm), e.i64(2))
    if "K" in letters:   # sum_r kw2[s, r, n] sum_m kw1[s, r, m] x[t, m, s]
        h = e.op("ReduceSum", e.op("Mul", e.op("Unsqueeze", x5, e.i64(3)),
                                   key_major("kw1", [0, 2, 3, 4, 1])), e.i64(4), keepdims=1)
        terms.append(e.op("ReduceSum", e.op("Mul", h, key_major("kw2", [0, 2, 3, 4, 1])),
                          e.i64(3), keepdims=0))                              # (B, G, T, M, S)
    if "D" in letters:
        terms.append(e.op("Mul", x5, key_major("kdd", [0, 2, 3, 1])))
    out = terms[0] if len(terms) == 1 else e.op("Sum", *terms)
    e.nodes.append(helper.make_node("Reshape", [e.op("Transpose", out, perm=[0, 1, 3, 2, 4]),
                                                e.op("Shape", "x")], ["out"], name="out_reshape"))
    return helper.make_function(DOMAIN, name, ins, ["out"], e.nodes,
                                [helper.make_opsetid("", check_opset(opset))],
                                doc_string=compose_function.__doc__.split("\n\n")[1].strip())


def _compose_inputs(letters: str, prefix: str = "") -> List[str]:
    """The inputs of ``Compose<letters>`` after x, in order (``compose_function``)."""
    return [prefix + n for n, on in (("wq", "Q" in letters), ("kw1", "K" in letters),
                                     ("kw2", "K" in letters), ("kdd", "D" in letters)) if on]


def probs_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function ``dcmha.Probs<pre>_<post>`` (``_Body._probs_node``): attention
    probabilities from scores, Compose_post(softmax(Compose_pre(x) + bias)).

    Inputs: x (B, N, T, S) float32, the block of queries [t0, t0 + T) and keys [s0, s0 + S);
    bias (B|1, 1, T, S), the mask's 0 / MASKED_SCORE; t0, s0: int64 scalars; then each
    stage's Compose inputs after x (``compose_function``), named pre_* / post_*, for every
    query and key: wq (B|1, G, T_q|1, M, M) (T_q >= t0 + T), kw1, kw2 (B, S_k, G, R, M) and
    kdd (B, S_k, G, M) (S_k >= s0 + S). A stage named by no letter is the identity. The body calls the ``Compose*`` functions, so a
    model with this function carries those too; onnxruntime runs the compiled op where
    ``dcmha.export.ort_ops`` is registered (one pass over a few query rows at a time).
    """
    if name not in PROBS_OPS:
        raise ValueError(f"Not a Probs op name: {name!r} (expected Probs<pre>_<post>, each "
                         f"stage one of {list(STAGE_LETTERS)}, not both empty).")
    pre, post = name[len("Probs"):].split("_")
    ins = ["x", "bias", "t0", "s0"] + _compose_inputs(pre, "pre_") + _compose_inputs(post, "post_")
    e = Emitter()
    T, S = e.dims("x", 2, 3), e.dims("x", 3, 4)
    t0, s0 = e.op("Unsqueeze", "t0", e.i64(0)), e.op("Unsqueeze", "s0", e.i64(0))

    def block(term):   # the term's part for x's block: rows [t0, t0 + T), keys [s0, s0 + S)
        if term.endswith("wq"):   # a row axis of 1 (broadcast) stays
            start = e.op("Min", t0, e.op("Sub", e.dims(term, 2, 3), e.i64(1)))
            return e.op("Slice", term, start, e.op("Add", start, T), e.i64(2))
        return e.op("Slice", term, s0, e.op("Add", s0, S), e.i64(1))
    y = "x"
    if pre:
        y = e.op("Compose" + pre, "x", *map(block, _compose_inputs(pre, "pre_")), domain=DOMAIN)
    p = e.op("Softmax", e.op("Add", y, "bias"), axis=-1)
    if post:
        p = e.op("Compose" + post, p, *map(block, _compose_inputs(post, "post_")), domain=DOMAIN)
    rename_value(e.nodes, p, "out")
    return helper.make_function(DOMAIN, name, ins, ["out"], e.nodes,
                                [helper.make_opsetid("", check_opset(opset)),
                                 helper.make_opsetid(DOMAIN, 1)],
                                doc_string=probs_function.__doc__.split("\n\n")[0].split(":", 1)[1].strip())


def cache_heads_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function ``dcmha.CacheHeads`` (float32) / ``CacheHeads16`` (float16) /
    ``CacheHeads16F`` (a float16 cache, float32 out): (cache (B, S_max, H, d), start, stop:
    int64 scalars) -> the cache's positions [start, stop) heads first, (B, H, stop - start,
    d). A decode step's Slice and Transpose (and Cast) of its key / value cache, which the
    compiled op does in one copy."""
    if name not in CACHE_HEADS_OPS:
        raise ValueError(f"Not a CacheHeads op name: {name!r} (expected one of "
                         f"{sorted(CACHE_HEADS_OPS)}).")
    e = Emitter()
    part = e.op("Slice", "cache", e.op("Unsqueeze", "start", e.i64(0)),
                e.op("Unsqueeze", "stop", e.i64(0)), e.i64(1))
    out = e.op("Transpose", part, perm=[0, 2, 1, 3])
    if name == CACHE_WIDEN_OP:
        out = e.op("Cast", out, to=TensorProto.FLOAT)
    rename_value(e.nodes, out, "out")
    return helper.make_function(DOMAIN, name, ["cache", "start", "stop"], ["out"], e.nodes,
                                [helper.make_opsetid("", check_opset(opset))],
                                doc_string=cache_heads_function.__doc__.split(":", 1)[1].strip())


def merged_matrix(e: "Emitter", w1, w2, dd, static, residual: bool, transposed: bool,
                  eye: str) -> Optional[str]:
    """(B, G, L, M, M) matrices [I] + [static] + w1^T w2 + diag(dd), or their transpose,
    in plain ops; None if every term is absent.

    w1, w2: (B, L, G, R, M); dd: (B, L, G, M); static: (G, M, M); each float32 or None.
    eye: the (M, M) float32 identity. Transposed, W[n, m] = [n == m] (1 + dd[n])
    + sum_r w1[r, m] w2[r, n] + static[g, m, n] with the residual: the query factor.
    """
    W = None
    if w1 is not None:
        left, right = (w2, w1) if transposed else (w1, w2)
        W = e.op("MatMul", e.op("Transpose", left, perm=[0, 2, 1, 4, 3]),    # (B, G, L, M, R)
                 e.op("Transpose", right, perm=[0, 2, 1, 3, 4]))             # (B, G, L, R, M)
    dmat = None
    if dd is not None:
        diag = e.op("Transpose", dd, perm=[0, 2, 1, 3])                      # (B, G, L, M)
        if residual:
            diag = e.op("Add", diag, e.const(1.0, TensorProto.FLOAT))
        dmat = e.op("Mul", e.op("Unsqueeze", diag, e.i64(-1)), eye)
    elif residual:
        dmat = eye
    if dmat is not None:
        W = dmat if W is None else e.op("Add", W, dmat)
    if static is not None:   # (G, M, M) -> (G, 1, M, M), shared by every position
        st = e.op("Transpose", static, perm=[0, 2, 1]) if transposed else static
        st = e.op("Unsqueeze", st, e.i64(1))
        W = st if W is None else e.op("Add", W, st)
    return W


def query_matrix_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function ``dcmha.QueryMatrix<W|D|S>`` (``_Body._query_matrix_node``): the
    per-query matrix wq (B, G, T, M, M) of a Compose node's Q input from the spec's
    query-side terms, each input only where its letter is in the name: W: qw1, qw2
    (B, T, G, R, M); D: qdd (B, T, G, M); S: static (G, M, M); all float32.
    wq[n, m] = [n == m] (1 + qdd[n]) + sum_r qw1[r, m] qw2[r, n] + static[g, m, n]."""
    if name not in QUERY_OPS:
        raise ValueError(f"Not a QueryMatrix op name: {name!r} (expected one of {list(QUERY_OPS)}).")
    letters = name[len("QueryMatrix"):]
    ins = (["qw1", "qw2"] if "W" in letters else []) + (["qdd"] if "D" in letters else []) + (
        ["static"] if "S" in letters else [])
    e = Emitter()
    M = e.op("Shape", ins[0], start=-1)
    eye = e.op("EyeLike", e.op("ConstantOfShape", e.op("Concat", M, M, axis=0),
                               value=numpy_helper.from_array(np.zeros(1, np.float32))))
    out = merged_matrix(e, "qw1" if "W" in letters else None, "qw2" if "W" in letters else None,
                        "qdd" if "D" in letters else None, "static" if "S" in letters else None,
                        True, True, eye)
    rename_value(e.nodes, out, "wq")
    return helper.make_function(DOMAIN, name, ins, ["wq"], e.nodes,
                                [helper.make_opsetid("", check_opset(opset))],
                                doc_string=query_matrix_function.__doc__.split(":", 1)[1].strip())


def _rope_ops(e: "Emitter", x: str, positions: str, inv_freq: str, half: str, d: str,
              ft: int) -> str:
    """The rotate-half RoPE of x (B, L, H, d), type ft, at int64 positions (L,), with
    inv_freq (d/2,) float64, in plain ops: angles in float64, their cos and sin in ft.
    half, d: int64 (1,) tensors, d / 2 and d."""
    x1 = e.op("Slice", x, e.i64(0), half, e.i64(-1))
    x2 = e.op("Slice", x, half, d, e.i64(-1))
    pos = e.op("Unsqueeze", e.op("Cast", positions, to=TensorProto.DOUBLE), e.i64(1))
    angle = e.op("Mul", pos, e.op("Unsqueeze", inv_freq, e.i64(0)))               # (L, d/2)
    cos = e.op("Unsqueeze", e.op("Cast", e.op("Cos", angle), to=ft), e.i64(1))    # (L, 1, d/2)
    sin = e.op("Unsqueeze", e.op("Cast", e.op("Sin", angle), to=ft), e.i64(1))
    return e.op("Concat", e.op("Sub", e.op("Mul", x1, cos), e.op("Mul", x2, sin)),
                e.op("Add", e.op("Mul", x2, cos), e.op("Mul", x1, sin)), axis=-1)


def rope_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function ``dcmha.Rope`` (float32) / ``Rope16`` (float16): (x (B, L, H, d),
    positions (L,) int64, inv_freq (d/2,) float64) -> the rotate-half RoPE of x, with the
    angles positions[l] inv_freq[j] in float64 and their cos / sin in x's type. The
    compiled op keeps the cos / sin rows of the positions it has seen."""
    if name not in ROPE_OPS.values():
        raise ValueError(f"Not a Rope op name: {name!r} (expected one of "
                         f"{sorted(ROPE_OPS.values())}).")
    ft = DTYPES[next(k for k, v in ROPE_OPS.items() if v == name)]
    e = Emitter()
    d = e.op("Shape", "x", start=3, end=4)
    out = _rope_ops(e, "x", "positions", "inv_freq", e.op("Div", d, e.i64(2)), d, ft)
    rename_value(e.nodes, out, "out")
    return helper.make_function(DOMAIN, name, ["x", "positions", "inv_freq"], ["out"], e.nodes,
                                [helper.make_opsetid("", check_opset(opset))],
                                doc_string=rope_function.__doc__.split(":", 1)[1].strip())


def rope_heads_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function ``dcmha.RopeHeads`` (float32) / ``RopeHeads16`` (float16): (y
    (B, L, W), positions (L,) int64, inv_freq (d/2,) float64, heads (2,) int64 = (N, N_kv))
    -> (q (B, N, L, d), k (B, N_kv, L, d)): y's first (N + N_kv) d columns as N query then
    N_kv key heads of d, rotated as ``rope_function`` does, heads first."""
    if name not in ROPE_HEADS_OPS.values():
        raise ValueError(f"Not a RopeHeads op name: {name!r} (expected one of "
                         f"{sorted(ROPE_HEADS_OPS.values())}).")
    ft = DTYPES[next(k for k, v in ROPE_HEADS_OPS.items() if v == name)]
    e = Emitter()
    half = e.op("Shape", "inv_freq")
    d = e.op("Mul", half, e.i64(2))
    N, H = e.op("Slice", "heads", e.i64(0), e.i64(1)), e.op("ReduceSum", "heads", keepdims=1)
    qk = e.op("Slice", "y", e.i64(0), e.op("Mul", H, d), e.i64(2))
    qk = e.op("Reshape", qk, e.op("Concat", e.dims("y", 0, 2), H, d, axis=0))    # (B, L, H, d)
    rotated = _rope_ops(e, qk, "positions", "inv_freq", half, d, ft)
    for out, lo, hi in (("q", e.i64(0), N), ("k", N, H)):
        e.nodes.append(helper.make_node(
            "Transpose", [e.op("Slice", rotated, lo, hi, e.i64(2))], [out], name="out_" + out,
            perm=[0, 2, 1, 3]))
    return helper.make_function(DOMAIN, name, ["y", "positions", "inv_freq", "heads"], ["q", "k"],
                                e.nodes, [helper.make_opsetid("", check_opset(opset))],
                                doc_string=rope_heads_function.__doc__.split(":", 1)[1].strip())


def kernel_function(name: str, opset: Optional[int] = None) -> onnx.FunctionProto:
    """The local function of one of ``KERNEL_OPS``."""
    if name in ROPE_OPS.values():
        return rope_function(name, opset)
    if name in ROPE_HEADS_OPS.values():
        return rope_heads_function(name, opset)
    if name in QUERY_OPS:
        return query_matrix_function(name, opset)
    if name in PROBS_OPS:
        return probs_function(name, opset)
    if name in CACHE_HEADS_OPS:
        return cache_heads_function(name, opset)
    return compose_function(name, opset)


def kernel_ops_used(nodes: Sequence[onnx.NodeProto]) -> List[str]:
    """The ``KERNEL_OPS`` that ``nodes`` (and their subgraphs) call, sorted."""
    found = set()

    def visit(ns):
        for node in ns:
            if node.domain == DOMAIN and node.op_type in KERNEL_OPS:
                found.add(node.op_type)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g.node)
    visit(nodes)
    return sorted(found)
