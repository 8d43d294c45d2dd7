"""The compose terms and the masking rules, declared once (framework-free).

Every implementation (the NumPy reference, ``dcmha.ops``, the fused kernels, the
ONNX exporter, the fixture generator and the conformance adapters) reads the
names, sides and shapes of the compose terms from ``COMPOSE_TERMS`` here, and
the visible-key range and the masked-score fill value from this module: adding
a term means adding one ``Term`` below and teaching the kernels and the
exporter its arithmetic.

Shapes use the spec's letters: B batch, T query length, S key length, G groups,
M = N / G heads per group, R rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

__all__ = ["Term", "COMPOSE_TERMS", "TERM_NAMES", "TERMS", "PAIRS", "MASKED_SCORE",
           "stage_terms", "term_shape", "key_range", "visible"]


@dataclass(frozen=True)
class Term:
    """One compose term: its keyword name, the side it comes from and its shape.

    side: "query" (one value per query position t), "key" (per key position s)
    or "static" (no position). dynamic: the dynamic weight it is read from
    ("w1", "w2" or "dd"; None for static). pair: the other half of a low-rank
    product (qw1 with qw2), which must be given together.
    """

    name: str
    side: str
    shape: Tuple[str, ...]
    dynamic: Optional[str]
    pair: Optional[str] = None


#: Every compose term, in the order of the spec's formula (SPEC.md, "Compose").
COMPOSE_TERMS: Tuple[Term, ...] = (
    Term("qw1", "query", ("B", "T", "G", "R", "M"), "w1", "qw2"),
    Term("qw2", "query", ("B", "T", "G", "R", "M"), "w2", "qw1"),
    Term("kw1", "key", ("B", "S", "G", "R", "M"), "w1", "kw2"),
    Term("kw2", "key", ("B", "S", "G", "R", "M"), "w2", "kw1"),
    Term("qdd", "query", ("B", "T", "G", "M"), "dd"),
    Term("kdd", "key", ("B", "S", "G", "M"), "dd"),
    Term("static", "static", ("G", "M", "M"), None),
)

TERMS = {t.name: t for t in COMPOSE_TERMS}
TERM_NAMES: Tuple[str, ...] = tuple(t.name for t in COMPOSE_TERMS)
#: The low-rank pairs, each as (first, second).
PAIRS: Tuple[Tuple[str, str], ...] = tuple(
    (t.name, t.pair) for t in COMPOSE_TERMS if t.pair and t.dynamic == "w1")

#: The value a masked score gets before the softmax. Finite, so that a fully
#: masked row stays finite through the softmax (it becomes uniform and is zeroed
#: afterwards: never NaN); far below any real score, so a partially masked row
#: gives its masked keys a probability of exactly 0 in float32.
MASKED_SCORE = -1.0e30


def term_shape(name: str, sizes: Mapping[str, Optional[int]]) -> Tuple[Optional[int], ...]:
    """The shape of term ``name`` for the sizes {"B": .., "T": .., ...} (None: any)."""
    return tuple(sizes.get(letter) for letter in TERMS[name].shape)


def stage_terms(stage: str, query_dynamic: Optional[Mapping] = None,
                key_dynamic: Optional[Mapping] = None, static=None) -> dict:
    """The compose terms of one stage ("pre" or "post") as ``compose`` keyword arguments.

    query_dynamic / key_dynamic: ``{slot: {"w1": .., "w2": .., "dd": ..}}`` (the
    dynamic weights of each side; slots ``<stage>_query`` / ``<stage>_key`` are
    read); static: the stage's static (G, M, M) weights or None. Works on any
    array type.
    """
    sides = {"query": (query_dynamic or {}).get(stage + "_query", {}),
             "key": (key_dynamic or {}).get(stage + "_key", {})}
    out = {}
    for term in COMPOSE_TERMS:
        if term.side == "static":
            if static is not None:
                out[term.name] = static
        elif term.dynamic in sides[term.side]:
            out[term.name] = sides[term.side][term.dynamic]
    return out


def key_range(t0: int, t1: int, S: int, *, causal: bool, window: Optional[int],
              offset: int = 0) -> Tuple[int, int]:
    """Keys [s0, s1) that queries [t0, t1) at absolute positions offset + t can see.

    Causal: s <= offset + t. Window W: |offset + t - s| < W (with causal, the W keys
    ending at the query). The range may be empty (s1 <= s0).
    """
    s0, s1 = 0, S
    if causal:
        s1 = min(S, t1 - 1 + offset + 1)
    if window is not None:
        s0 = max(0, t0 + offset - window + 1)
        if not causal:
            s1 = min(S, t1 - 1 + offset + window)
    return s0, s1


def visible(t: int, s: int, *, causal: bool, window: Optional[int], offset: int = 0) -> bool:
    """Whether query t (at absolute position offset + t) may see key s (scalar rule)."""
    pos = offset + t
    if causal and s > pos:
        return False
    return window is None or abs(pos - s) < window
