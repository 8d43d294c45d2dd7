"""ctypes' view of the kernel's argument block, and the calls into the compose library.

``_Args`` lists the fields of ``Args`` (``csrc/dcmha_args.h``) in the same order; ``build``
checks every loaded library's view of it against this one. The wrappers check their arrays'
shapes and strides before the kernel reads them (a mis-shaped array is refused with a
ValueError, never read past) and raise MemoryError when the kernel cannot get its scratch
buffer.

Array conventions (all float32, last axis contiguous, strides in elements, passed in
``Args``): a block is x (B, t, N, s) with head n = g * M + m at stride ``x_n``; ``wq`` (B,
t, [G,] M, M) holds out[n] = sum_m wq[n, m] x[m] for group g's block at offset ``wq_g``
(torch: the diagonal blocks of a dense (N, N) matrix); kw1 / kw2 (B, G, R, M, s) and kdd
(B, G, M, s) are the key-side terms of the block's key columns.
"""

from __future__ import annotations

import ctypes

__all__ = ["compose_forward", "compose_backward", "decode_probs", "decode_terms", "key_row",
           "dynamic_weights", "dynamic_finish", "dynamic_sizes", "DYNAMIC_ROWS", "cached_flags",
           "causal_flags", "block_causal_off",
           "CACHED_TERMS"]

_FIELDS = (
    [(n, ctypes.c_int64) for n in ("B", "t", "G", "M", "R", "s")]
    + [("x", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("x_b", "x_i", "x_n")]
    + [("out", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("o_b", "o_i", "o_n")]
    + [("g", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("g_b", "g_i", "g_n")]
    + [("wq", ctypes.c_void_p)]
    + [(n, ctypes.c_int64) for n in ("wq_b", "wq_i", "wq_g", "wq_n", "wq_m")]
    + [("dwq", ctypes.c_void_p)]
    + [(n, ctypes.c_int64) for n in ("dwq_b", "dwq_i", "dwq_g", "dwq_n", "dwq_m")]
    + [("kw1", ctypes.c_void_p), ("kw2", ctypes.c_void_p)]
    + [(n, ctypes.c_int64) for n in ("kw_b", "kw_g", "kw_r", "kw_m")]
    + [("dkw1", ctypes.c_void_p), ("dkw2", ctypes.c_void_p)]
    + [(n, ctypes.c_int64) for n in ("dkw_b", "dkw_g", "dkw_r", "dkw_m")]
    + [("kdd", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("kd_b", "kd_g", "kd_m")]
    + [("dkdd", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("dkd_b", "dkd_g", "dkd_m")]
    + [(n, ctypes.c_int64) for n in ("causal", "causal_off")]
)


class _Args(ctypes.Structure):
    """The kernel's argument block ``Args`` (``csrc/dcmha_args.h``), field for field."""
    _fields_ = _FIELDS



def _view(args, prefix, x, names):
    """Set ``prefix`` (pointer) and the strides ``names`` from tensor x (None: NULL)."""
    if x is None:
        setattr(args, prefix, None)
        return
    setattr(args, prefix, x.data_ptr())
    for name, st in zip(names, x.stride()):
        setattr(args, name, st)


def _args(x5, out5, st, G, M, R, s):
    wq, kw1, kw2, kdd = st
    B, t = x5.shape[0], x5.shape[1]
    a = _Args(B=B, t=t, G=G, M=M, R=R, s=s)
    _view(a, "x", x5, ("x_b", "x_i", "x_n"))
    _view(a, "out", out5, ("o_b", "o_i", "o_n"))
    _view(a, "wq", wq, ("wq_b", "wq_i", "wq_n", "wq_m"))
    if wq is not None:                      # block diagonal: group g's block at (gM, gM)
        a.wq_g = M * (a.wq_n + a.wq_m)
    _view(a, "kw1", kw1, ("kw_b", "kw_g", "kw_r", "kw_m"))
    a.kw2 = None if kw2 is None else kw2.data_ptr()
    _view(a, "kdd", kdd, ("kd_b", "kd_g", "kd_m"))
    return a


def _refuse(message):
    raise ValueError(f"dcmha C kernel: {message}")


def _check_block(x, same, st, G, R, names=("wq", "kw1", "kw2", "kdd")):
    """x (B, t, N, s) with the arrays `same` of its shape and the terms st of a block
    (see `compose_forward`), checked before the kernel reads them: a mis-shaped array
    is refused, never read past."""
    B, t, N, s = x.shape
    if G < 1 or N % G or R < 1:
        _refuse(f"{N} heads do not split into {G} groups, or rank {R} < 1")
    M = N // G
    want = ((B, t, N, N), (B, G, R, M, s), (B, G, R, M, s), (B, G, M, s))
    for name, a, shape in zip(("x", *("out / g / dx" for _ in same)), (x, *same),
                              ((B, t, N, s),) * (1 + len(same))):
        if tuple(a.shape) != shape or (a.shape[-1] > 1 and a.stride()[-1] != 1):
            _refuse(f"{name} must be {shape} with a contiguous last axis; received "
                    f"{tuple(a.shape)}")
    for name, term, shape in zip(names, st, want):
        if term is not None and (tuple(term.shape) != shape
                                 or (shape[-1] > 1 and term.stride()[-1] != 1)):
            _refuse(f"{name} must be {shape} with a contiguous last axis for x "
                    f"{tuple(x.shape)}; received {tuple(term.shape)}")


def _causal(a, causal_off):
    if causal_off is not None:
        a.causal, a.causal_off = 1, int(causal_off)


def block_causal_off(causal, t0, s0, s, query_offset=0):
    """The kernel's ``causal_off`` for a block of queries from t0 against s keys from s0:
    under a causal mask row i sees keys j <= i + causal_off; None where there is no causal
    mask or every key is visible. The kernel then skips the masked keys, which no later
    step reads: the mask replaces them before the softmax, and its gradient is 0 there."""
    off = t0 + query_offset - s0
    return off if causal and off < s - 1 else None


def causal_flags(causal_off) -> int:
    """The flags bits (``DCMHA_CAUSAL`` of ``csrc/dcmha_args.h``) of a causal block whose
    row i sees its keys j <= i + causal_off (the framework wrappers' compose calls); 0 for
    None (no causal block)."""
    return 0 if causal_off is None else 64 + int(causal_off) * 256


def compose_forward(lib, x, out, st, G, R, causal_off=None):
    """out = Compose(x) for a block; x, out (B, t, N, s) views (out may be x).

    st = (wq rows of the block (B, t, N, N) or None, kw1, kw2 (B, G, R, M, s) or
    None, kdd (B, G, M, s) or None), every array float32 with a contiguous last
    axis; kw2's strides must equal kw1's. ``causal_off``: a causal block whose row i
    sees keys j <= i + causal_off (``Args.causal``: out is 0 at the others), or None.
    """
    B, t, N, s = x.shape
    _check_block(x, (out,), st, G, R if st[1] is not None else 1)
    a = _args(x, out, st, G, N // G, R, s)
    _causal(a, causal_off)
    if lib.dcmha_compose_forward(ctypes.byref(a)):
        raise MemoryError("dcmha C kernel: out of memory for its chunk buffer")
    return out


#: The spec's terms in the order of a stage's arguments of ``dcmha_compose_cached`` and
#: ``dcmha_decode_probs``.
CACHED_TERMS = ("qw1", "qw2", "qdd", "static", "kw1", "kw2", "kdd")
#: Each term's bit in a stage's flags (``DCMHA_HAS_*`` of ``csrc/dcmha_args.h``; the XLA FFI
#: handler ``DcmhaDecodeProbs`` takes them).
_CACHED_FLAGS = {"qw1": 8, "qw2": 8, "qdd": 16, "static": 32, "kw1": 2, "kw2": 2, "kdd": 4}


def cached_flags(names) -> int:
    """A stage's flags for the terms ``names`` (a subset of ``CACHED_TERMS``)."""
    flags = 0
    for n in names:
        flags |= _CACHED_FLAGS[n]
    return flags


def _stage_args(terms):
    """(Rq, Rk, the 7 term pointers, kw_row, kd_row) of one stage for
    ``dcmha_decode_probs`` (None: absent; see ``key_row``)."""
    terms = terms or {}
    return [terms["qw1"].shape[3] if "qw1" in terms else 1,
            terms["kw1"].shape[3] if "kw1" in terms else 1] + [
        terms[n].data_ptr() if n in terms else None for n in CACHED_TERMS] + [
        key_row(terms.get("kw1")), key_row(terms.get("kdd"))]


def key_row(term) -> int:
    """How many floats apart the key positions of a key-side term (B, S, G, ...) lie, for
    ``dcmha_decode_probs``: 0 when contiguous, else the stride of one slot's view into the
    decode cache's stacked entry (each position's (G, ...) block contiguous, batch b at
    b * S * row). ``decode_terms`` makes every term one of these."""
    if term is None or term.is_contiguous():
        return 0
    return term.stride(1)


def _key_row_layout(term) -> bool:
    """Whether ``key_row`` describes ``term``'s layout."""
    B, S = term.shape[:2]
    inner = term.shape[2:]
    expected, step = [], 1
    for n in reversed(inner):
        expected.insert(0, step)
        step *= n
    st = term.stride()
    return (list(st[2:]) == expected and st[1] >= step
            and (B == 1 or st[0] == S * st[1]))


def decode_terms(terms):
    """A stage's terms for ``decode_probs``: float32 torch tensors, each contiguous or, for
    kw1 / kw2 / kdd, a view of the layout ``key_row`` describes (kw1 and kw2 with the same
    strides); anything else copied to a contiguous tensor."""
    out = {n: w.contiguous() if n not in ("kw1", "kw2", "kdd") else w
           for n, w in terms.items()}
    for names in (("kw1", "kw2"), ("kdd",)):
        ws = [out[n] for n in names if n in out]
        if ws and not (all(_key_row_layout(w) for w in ws)
                       and all(w.stride() == ws[0].stride() for w in ws)):
            out.update({n: out[n].contiguous() for n in names if n in out})
    return out


def _check_decode(x, p, mask, pre, post):
    """decode_probs' arrays checked against x (B, G, M, S) before the kernel reads them."""
    B, G, M, S = x.shape
    if tuple(p.shape) != (B, G, M, S):
        _refuse(f"p must be x's shape {(B, G, M, S)}; received {tuple(p.shape)}")
    if mask is not None and (mask.dim() != 3 or mask.shape[0] not in (1, B)
                             or mask.shape[1] not in (1, G * M) or mask.shape[2] not in (1, S)):
        _refuse(f"mask must be (B|1, N|1, S|1) for x {(B, G, M, S)}; received "
                f"{tuple(mask.shape)}")
    for terms in (pre or {}, post or {}):
        rq = terms["qw1"].shape[3] if "qw1" in terms else 1
        rk = terms["kw1"].shape[3] if "kw1" in terms else 1
        want = {"qw1": (B, 1, G, rq, M), "qw2": (B, 1, G, rq, M), "qdd": (B, 1, G, M),
                "static": (G, M, M), "kw1": (B, S, G, rk, M), "kw2": (B, S, G, rk, M),
                "kdd": (B, S, G, M)}
        for name, term in terms.items():
            if tuple(term.shape) != want.get(name):
                _refuse(f"{name} must be {want.get(name)} for x {(B, G, M, S)}; received "
                        f"{tuple(term.shape)}")


def decode_probs(lib, x, p, mask, pre, post, masked):
    """One query's probabilities into p: Compose_post(softmax(where(mask, Compose_pre(x),
    masked))), ``dcmha_decode_probs`` of ``csrc/dcmha_args.h`` (the arithmetic of
    ``dcmha.ops.one_query_probs``). x, p (B, G, M, S) float32 contiguous, p not x; mask a
    contiguous one-byte (bool) array (B|1, 1|N, S|1), True = attend, or None; pre, post
    each a dict of the spec's terms (names of ``CACHED_TERMS``, float32 contiguous): qw1,
    qw2 (B, 1, G, R, M), qdd (B, 1, G, M), static (G, M, M), and the key side in the decode
    cache's layout, kw1, kw2 (B, S, G, R, M), kdd (B, S, G, M) (``decode_terms`` makes
    them); or None."""
    B, G, M, S = x.shape
    _check_decode(x, p, mask, pre, post)
    m = [None, 1, 1, 1] if mask is None else [mask.data_ptr(), *mask.shape]
    if lib.dcmha_decode_probs(B, G, M, S, x.data_ptr(), p.data_ptr(), *m, masked,
                              *_stage_args(pre), *_stage_args(post)):
        raise MemoryError("dcmha C kernel: out of memory for its scratch buffer")
    return p


#: Rows (B * L) up to which a framework takes ``dynamic_weights`` (one thread: a decoding
#: step's one row or a few; the frameworks' threaded products win beyond).
DYNAMIC_ROWS = 4


def dynamic_sizes(dw1, qkw, dd, C):
    """(G, K, M) of the dynamic-weight arrays (K = 1 without a projection)."""
    if dw1 is not None:
        return dw1.shape[1], dw1.shape[3], qkw.shape[-1]
    return dd.shape[1], 1, dd.shape[2] // C


def _check_counts(arrays):
    """{name: (array or None, the element count the kernel reads)}, checked."""
    for name, (a, n) in arrays.items():
        if a is not None and a.numel() != n:
            _refuse(f"{name} must hold {n} elements; received shape {tuple(a.shape)}")


def dynamic_weights(lib, x, dw1, qkw, dd, w1, w2, g, *, GC, K, M, rank, gelu_approximate,
                    eps):
    """``dcmha_dynamic_weights`` of ``csrc/dcmha_args.h`` into w1, w2 (BL, GC, R, M) and g
    (BL, GC M): x (BL, D), dw1 (D, GC K), qkw (GC, K, 2R, M), dd (D, GC M), every array
    float32 contiguous; dw1 / qkw / w1 / w2, or dd / g, None where absent."""
    BL, D = x.shape
    _check_counts({"dw1": (dw1, D * GC * K), "qkw": (qkw, GC * K * 2 * rank * M),
                   "dd": (dd, D * GC * M), "w1": (w1, BL * GC * rank * M),
                   "w2": (w2, BL * GC * rank * M), "g": (g, BL * GC * M)})
    ptr = lambda a: None if a is None else a.data_ptr()      # noqa: E731
    if lib.dcmha_dynamic_weights(BL, D, GC, K, rank, M, x.data_ptr(), ptr(dw1), ptr(qkw),
                                 ptr(dd), int(gelu_approximate), eps, ptr(w1), ptr(w2), ptr(g)):
        raise MemoryError("dcmha C kernel: out of memory for its scratch buffer")


def dynamic_finish(lib, pre, h_col, g_col, qkw, w1, w2, g, *, GC, K, M, rank,
                   gelu_approximate, eps):
    """``dcmha_dynamic_finish`` of ``csrc/dcmha_args.h``: ``dynamic_weights``' outputs from
    pre (BL, n), float32 with contiguous rows, whose columns [h_col, h_col + GC K) hold x dw1
    (gelu is applied there, in place) and [g_col, g_col + GC M) x dd; qkw / w1 / w2 (or g)
    None where absent, as in ``dynamic_weights``."""
    BL, n = pre.shape
    for col, width, used in ((h_col, GC * K, qkw is not None), (g_col, GC * M, g is not None)):
        if used and not (0 <= col <= n and width <= n - col):
            _refuse(f"columns [{col}, {col} + {width}) lie outside pre's {n}")
    _check_counts({"qkw": (qkw, GC * K * 2 * rank * M), "w1": (w1, BL * GC * rank * M),
                   "w2": (w2, BL * GC * rank * M), "g": (g, BL * GC * M)})
    ptr = lambda a: None if a is None else a.data_ptr()      # noqa: E731
    lib.dcmha_dynamic_finish(pre.shape[0], GC, K, rank, M, pre.data_ptr(), pre.stride(0),
                             h_col, g_col, ptr(qkw), int(gelu_approximate), eps, ptr(w1),
                             ptr(w2), ptr(g))


def compose_backward(lib, x, g, dx, st, dst, G, R, causal_off=None):
    """dx = dCompose/dx^T g for a block and d(terms) accumulated (dx may be g).

    dst = (d_wq rows (B, t, N, N) (written by +=, the diagonal blocks only),
    d_kw1, d_kw2 (B, G, R, M, s), d_kdd (B, G, M, s)), None where the term is
    absent; d_kw2's strides must equal d_kw1's. ``causal_off`` as ``compose_forward``'s
    (dx is 0 at the masked keys, which add nothing to d(terms)).
    """
    B, t, N, s = x.shape
    R_ = R if st[1] is not None else 1
    _check_block(x, (g, dx), st, G, R_)
    _check_block(x, (), dst, G, R_, names=("d_wq", "d_kw1", "d_kw2", "d_kdd"))
    a = _args(x, dx, st, G, N // G, R, s)
    _view(a, "g", g, ("g_b", "g_i", "g_n"))
    d_wq, d_kw1, d_kw2, d_kdd = dst
    _view(a, "dwq", d_wq, ("dwq_b", "dwq_i", "dwq_n", "dwq_m"))
    if d_wq is not None:
        a.dwq_g = (N // G) * (a.dwq_n + a.dwq_m)
    _view(a, "dkw1", d_kw1, ("dkw_b", "dkw_g", "dkw_r", "dkw_m"))
    a.dkw2 = None if d_kw2 is None else d_kw2.data_ptr()
    _view(a, "dkdd", d_kdd, ("dkd_b", "dkd_g", "dkd_m"))
    _causal(a, causal_off)
    if lib.dcmha_compose_backward(ctypes.byref(a)):
        raise MemoryError("dcmha C kernel: out of memory for its chunk buffer")
    return dx
