"""The conformance tolerance policy: how close a backend must come to the float64 reference.

A backend result ``x`` passes against the reference ``y`` (float64, stored as float32) when,
for every element,

    |x - y| <= atol + rtol * |y|          (NaN anywhere fails)

with, for one expected array ``y`` of a case whose compute dtype has unit roundoff ``u``,

    rtol = u * (c[dtype, kind] + C_SIGMA * sigma)    arrays computed after the softmax
    rtol = u * c[dtype, kind]                        arrays before it (scores, pre_composed,
                                                     dynamic/*)
    atol = rtol * max(max|y|, floor)

where

* ``u`` is the unit roundoff of the case's dtype: float32 2^-24, float16 2^-11,
  bfloat16 2^-8 (``UNIT_ROUNDOFF``).
* ``sigma`` is the case's score magnitude, max |pre_composed| over the allowed entries: the
  largest softmax input (``score_scale``); ``C_SIGMA`` = 2.
* ``kind`` is "output" (output, attention_scores), "intermediate" (scores, pre_composed, probs,
  dynamic/<slot>/<w1|w2|dd>) or "gradient" (grad/<name>) (``kind_of``); "after the softmax"
  means output, attention_scores, probs and every gradient (``after_softmax``).
* ``c`` is ``FACTOR``: float32 64 (output), 256 (intermediate), 512 (gradient); float16 and
  bfloat16 8, 16 and 64.
* ``floor`` = ``FLOOR_FRACTION`` (1e-2) times the largest max|y| among the case's arrays of the
  same kind, so an array whose exact value is (near) 0, such as the key-bias gradient of plain
  attention, is held to the rounding noise of its neighbours rather than to 0.

The stored numbers are rounded to 3 significant digits. Typical values: float32 forward
rtol ~ 5e-6 (atol ~ 1e-5), float32 gradients ~ 3e-5 relative to the largest entry, float16
forward ~ 6e-3, bfloat16 forward ~ 5e-2.

Reasoning
---------
*Why eps x magnitude.* A correct implementation evaluates the same formulas with rounding;
each stage adds a relative error of a few ``u`` of the magnitude of what it computes, and
sums with cancellation make that relative to the array's largest entries, not to each entry.
Hence ``atol`` proportional to ``u * max|y|`` and a matching ``rtol``. For float16 /
bfloat16 cases the inputs and parameters are exactly representable in that dtype, so only the
arithmetic rounds: projections rounded to the dtype (a Keras mixed policy stores q, k, v, the
dynamic weights, P before P.V, O and y in the compute dtype), scores and softmax in float32.

*Why + 2 sigma after the softmax.* An absolute error ``e`` in a softmax input becomes a
relative error of up to ``2e`` in the probabilities. Scores of magnitude ``sigma`` carry an
absolute error of order ``u * sigma`` (q and k rounded, or the exp2(x*log2(e)) rewrite of
fused kernels), so probabilities, and everything computed from them, carry up to
``2 u sigma`` more; the term makes the large-magnitude cases fair without loosening the
others (a multiplicative (1 + sigma) was tried first: it made bfloat16 tolerances 25%).

*Why these factors.* ``c`` absorbs the number of roundings on the way (about ten stages, each
up to a few ulp, transcendental functions of 1 to 4 ulp, float32 accumulation over at most a
few dozen terms). Calibration (``tests/spec/test_reference.py`` repeats it on every fixture): a
NumPy emulation of a correct mixed-precision implementation (inputs, q, k, v, dynamic
weights, P, O and y stored in the dtype; scores, compose and softmax in float32; also with
float16 accumulation of the projections) is off by at most ~4 u max|y| (float16/bfloat16)
and ~8 u max|y| (float32, where the reference's own float32 storage adds 0.5 u), i.e. at most
0.17 of the tolerance; gradients, emulated by a relative perturbation of 4 u on every input,
parameter and operation of the float64 backward, by at most ~60 u max|g| (0.11 of it).
Float32 gets a larger ``c`` than the half types because there ``u`` is so small that
implementation details (fast exp/tanh/rsqrt, blocked online softmax, summation order)
dominate; it is still ~5e-6 relative, far below what a real bug does. Intermediates get twice
the output factor because the RMS normalisation of w1 over only M heads amplifies the error of
positions where w is small (the emulation reaches 0.13 of the float32 intermediate tolerance
there). Gradients chain several more stages (softmax backward, compose backward,
GELU/RMS-norm backward, reductions over B*T) and get 8x the output factor.

*Tight enough.* ``tests/spec/test_reference.py`` mutates the reference and checks that the cases
exercising the mutation fail. In float32, dropping one compose term, making compose terms read
the partial sum, shifting the window or the causal diagonal by one, reading the wrong GQA head,
skipping the w1 normalisation, the interleaved RoPE layout or dropping the QK-norm scale are
10^4 to 10^5 times the tolerance; the tanh GELU in place of the exact one (a 1e-3 effect) is
~25 times. A dropped gating term is still ~50 times the float16 and ~8 times the bfloat16
tolerance.

*Not covered.* float32 cases mean IEEE float32 arithmetic: TF32 matmuls (the default of some
GPU stacks: JAX on Ampere+, Triton ``tl.dot`` on float32) round inputs to 10 mantissa bits and
fail them; run those with full float32 precision.
"""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional

import numpy as np

#: Unit roundoff (half the machine epsilon) of each compute dtype.
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}

#: Multiplier c of the unit roundoff, per (dtype, kind).
FACTOR = {
    ("float32", "output"): 64.0,
    ("float32", "intermediate"): 256.0,
    ("float32", "gradient"): 512.0,
    ("float16", "output"): 8.0,
    ("float16", "intermediate"): 16.0,
    ("float16", "gradient"): 64.0,
    ("bfloat16", "output"): 8.0,
    ("bfloat16", "intermediate"): 16.0,
    ("bfloat16", "gradient"): 64.0,
}

#: Weight of the score magnitude sigma in rtol (arrays after the softmax).
C_SIGMA = 2.0

#: An array's magnitude is at least this fraction of the largest of its kind in the case.
FLOOR_FRACTION = 1e-2

#: Arrays computed after the softmax (their error grows with the score magnitude).
_AFTER_SOFTMAX = ("output", "attention_scores", "probs")


def kind_of(name: str) -> str:
    """"output", "intermediate" or "gradient" for an expected-array name."""
    if name.startswith("grad/"):
        return "gradient"
    if name in ("output", "attention_scores"):
        return "output"
    return "intermediate"


def after_softmax(name: str) -> bool:
    """Whether the array's error is amplified by the score magnitude."""
    return name in _AFTER_SOFTMAX or name.startswith("grad/")


def score_scale(pre_composed: np.ndarray, mask: np.ndarray) -> float:
    """sigma: max |softmax input| over allowed entries (0 when nothing is allowed).

    pre_composed: (B, N, T, S); mask: (B, T, S) boolean, True = attend.
    """
    allowed = np.broadcast_to(np.asarray(mask, bool)[:, None], pre_composed.shape)
    vals = np.abs(np.asarray(pre_composed, np.float64)[allowed])
    return float(vals.max()) if vals.size else 0.0


def _check_dtype(dtype: str) -> None:
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"`dtype` must be one of {sorted(UNIT_ROUNDOFF)}. Received: dtype={dtype!r}")


def tolerance(name: str, expected: np.ndarray, dtype: str, sigma: float,
              floor: float = 0.0) -> Dict[str, float]:
    """{"atol", "rtol"} for one expected array (see the module docstring)."""
    _check_dtype(dtype)
    c = FACTOR[dtype, kind_of(name)] + (C_SIGMA * sigma if after_softmax(name) else 0.0)
    rtol = c * UNIT_ROUNDOFF[dtype]
    magnitude = max(float(np.max(np.abs(expected))) if np.size(expected) else 0.0, floor)
    return {"atol": float(f"{rtol * magnitude:.3g}") if magnitude else 0.0,
            "rtol": float(f"{rtol:.3g}")}


def case_tolerances(expected: Mapping[str, np.ndarray], outputs: Iterable[str], dtype: str,
                    sigma: float) -> Dict[str, Dict[str, float]]:
    """Tolerances of every name in ``outputs``, with the per-kind floor of the module docstring."""
    outputs = list(outputs)
    largest: Dict[str, float] = {}
    for name in outputs:
        m = float(np.max(np.abs(expected[name]))) if np.size(expected[name]) else 0.0
        largest[kind_of(name)] = max(largest.get(kind_of(name), 0.0), m)
    return {name: tolerance(name, expected[name], dtype, sigma,
                            floor=FLOOR_FRACTION * largest[kind_of(name)])
            for name in outputs}


def within(got: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    """Elementwise pass mask: |got - expected| <= atol + rtol * |expected|; NaN fails."""
    got = np.asarray(got, np.float64)
    expected = np.asarray(expected, np.float64)
    return np.abs(got - expected) <= atol + rtol * np.abs(expected)


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 array of the values of ``x`` rounded (to nearest even) to ``dtype``.

    float32 values of the result are exactly representable in ``dtype``; bfloat16 is done
    by bit manipulation so no framework or ml_dtypes is needed.
    """
    _check_dtype(dtype)
    x32 = np.asarray(x, np.float32)
    if dtype == "float32":
        return x32.copy()
    if dtype == "float16":
        return x32.astype(np.float16).astype(np.float32)
    bits = x32.view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16   # round half to even
    out = bits.astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x32), out, x32)


__all__ = ["UNIT_ROUNDOFF", "FACTOR", "C_SIGMA", "FLOOR_FRACTION", "kind_of", "after_softmax",
           "score_scale", "tolerance", "case_tolerances", "within", "round_to_dtype"]
