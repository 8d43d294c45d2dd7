"""Dynamic composition weights: the input-dependent ``w1``, ``w2`` and ``dd`` of each
compose slot, from a side's input x (B, L, D) (see ``dcmha.spec.reference``).

``dynamic_weights`` is the entry point (split by slot); ``plain_dynamic_weights``
computes them with ``keras.ops``; the seam (``dcmha.framework``) may supply a backend's
own step (``step_dynamic_weights``, ``fused_query_projection``).
"""

from __future__ import annotations

import keras
from keras import ops

from dcmha import framework
from dcmha.call import check_positive_int, shape_of, shapes_agree
from dcmha.ops.tensors import as_dtype, rms_normalize
from dcmha.spec.reference import ALL_SLOTS, W1_NORM_EPS


def dynamic_weights(x, dw1=None, qkw=None, dd=None, *, slots, rank, gelu_approximate=True,
                    check=True):
    """Input-dependent composition weights, in float32.

    Args:
        x: (B, L, D) input of the side (query or key).
        dw1: (D, G, C, K) or None; qkw: (G, C, K, 2R, M) or None (projection).
        dd: (D, G, C*M) or None (gating). C = len(slots).
        slots: slot names, in the order of the C axis.
        rank: R.
        check: validate the arguments' shapes (``DynamicWeightProjection``, which
            created the weights, passes False: the checks cost a decoding step
            more than the arithmetic).

    Returns:
        ``{slot: {"w1": (B, L, G, R, M), "w2": (B, L, G, R, M), "dd": (B, L, G, M)}}``;
        "w1"/"w2" only with a projection, "dd" only with gating.
    """
    if check:
        _check_dynamic_args(x, dw1, qkw, dd, slots, rank)
    weights = [w.value if isinstance(w, keras.Variable) else w for w in (dw1, qkw, dd)]
    C = len(slots)
    split = framework.step_dynamic_weights(x, *weights, C=C, rank=rank,
                                           gelu_approximate=gelu_approximate)
    if split is None:
        stacked = plain_dynamic_weights(x, dw1, qkw, dd, C=C, rank=rank,
                                        gelu_approximate=gelu_approximate)
        split = {n: ops.unstack(a, C, axis=3) for n, a in stacked.items()}
    return _by_slot(split, slots)


def _by_slot(split, slots):
    """{slot: {name: array}} from {name: [one array per slot, in ``slots``' order]}."""
    out = {s: {} for s in slots}
    for name, arrays in split.items():       # the C axis (3) split: one array per slot
        for s, a_s in zip(slots, arrays):
            out[s][name] = a_s
    return out


def fused_query_projection(x, kernel, bias, dw1, qkw, dd, *, slots, rank,
                           gelu_approximate=True):
    """A decoding step's query projection and ``dynamic_weights`` from one matrix product
    of x (B, L, D) with [kernel | dw1 | dd], where the backend has it
    (``dcmha.framework.fused_query_projection``), else None.

    kernel (D, N, d), bias (N, d) or None: the query projection (``EinsumDense``'s
    weights). Returns (x . kernel + bias as (B, L, N, d) float32, ``dynamic_weights``'
    dict)."""
    weights = [w.value if isinstance(w, keras.Variable) else w
               for w in (kernel, bias, dw1, qkw, dd)]
    out = framework.fused_query_projection(x, *weights, C=len(slots), rank=rank,
                                           gelu_approximate=gelu_approximate)
    if out is None:
        return None
    q, stacked = out
    return q, _by_slot({n: framework.unstack(a, 3, len(slots)) for n, a in stacked.items()}, slots)


def plain_dynamic_weights(x, dw1, qkw, dd, *, C, rank, gelu_approximate):
    """``dynamic_weights`` before the split into slots, with ``keras.ops``:
    {"w1", "w2": (B, L, G, C, R, M), "dd": (B, L, G, C, M)} (those present)."""
    x = as_dtype(x, "float32")
    out = {}
    if dw1 is not None:
        h = ops.gelu(ops.einsum("bld,dgck->blgck", x, as_dtype(dw1, "float32")),
                     approximate=gelu_approximate)
        # qkw first: with h first, XLA (jax) copies qkw into a transposed layout at every
        # call (for a decoding step, a copy of the weight per step).
        w = ops.einsum("gckrm,blgck->blgcrm", as_dtype(qkw, "float32"), h)
        out["w1"] = rms_normalize(w[..., :rank, :], W1_NORM_EPS)
        out["w2"] = w[..., rank:, :]
    if dd is not None:
        D, G, CM = dd.shape
        dd4 = ops.reshape(as_dtype(dd, "float32"), (D, G, C, CM // C))
        out["dd"] = ops.tanh(ops.einsum("bld,dgcm->blgcm", x, dd4))
    return out


def _check_dynamic_args(x, dw1, qkw, dd, slots, rank):
    if len(x.shape) != 3:
        raise ValueError(f"`x` must have rank 3 (B, L, D). Received: x.shape={shape_of(x)}")
    if (isinstance(slots, str) or not isinstance(slots, (tuple, list)) or not slots
            or any(sl not in ALL_SLOTS for sl in slots)):
        raise ValueError(f"`slots` must be a sequence of slot names from {ALL_SLOTS}. "
                         f"Received: slots={slots!r}")
    check_positive_int("rank", rank)
    if (dw1 is None) != (qkw is None):
        got = lambda n, w: f"{n}=None" if w is None else f"{n}.shape={shape_of(w)}"
        raise ValueError("`dw1` and `qkw` must be given together. "
                         f"Received: {got('dw1', dw1)}, {got('qkw', qkw)}")
    D, C = x.shape[-1], len(slots)
    if dw1 is not None:
        if not shapes_agree(shape_of(dw1), (D, None, C, None)):
            raise ValueError(f"`dw1` must have shape (D, G, C, K) = ({D}, G, {C}, K) (D: the "
                             "width of `x`, C: the number of slots). "
                             f"Received: dw1.shape={shape_of(dw1)}")
        G, K = dw1.shape[1], dw1.shape[3]
        if not shapes_agree(shape_of(qkw), (G, C, K, 2 * rank, None)):
            raise ValueError(f"`qkw` must have shape (G, C, K, 2R, M) = ({G}, {C}, {K}, "
                             f"{2 * rank}, M). Received: qkw.shape={shape_of(qkw)}")
    if dd is not None:
        G = "G" if dw1 is None else dw1.shape[1]
        shape = shape_of(dd)
        if (len(shape) != 3 or not shapes_agree(shape[:1], (D,))
                or (dw1 is not None and not shapes_agree(shape[1:2], (G,)))
                or (shape[2] is not None and shape[2] % C)):
            raise ValueError(f"`dd` must have shape (D, G, C*M) = ({D}, {G}, {C}*M). "
                             f"Received: dd.shape={shape}")
