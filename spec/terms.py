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

__all__ = ["Term", "COMPOSE_TERMS", "TERM_NAMES", "TERMS", "PAIRS", "BASE_TERMS", "MASKED_SCORE",
           "stage_terms", "term_shape", "compose_factors", "key_range", "visible", "KEY_CACHE",
           "pack_key_weights", "unpack_key_weights"]


@dataclass(frozen=True)
class Term:
    """One compose term: its keyword name, the side it comes from, its shape and its
    arithmetic.

    side: "query" (one value per query position t), "key" (per key position s)
    or "static" (no position). dynamic: the dynamic weight it is read from
    ("w1", "w2" or "dd"; None for static). pair: the other half of a low-rank
    product (qw1 with qw2), which must be given together.

    factor / equation: what the term adds to one of the two small factors of
    compose (``compose_factors``): ``factor`` is "query" (the (.., T, G, M, M)
    factor, which also holds the residual I) or "key" (the (.., S, G, M, M)
    factor), and ``equation`` an einsum equation whose operands are the term,
    then its pair when it has one, then the (M, M) identity when the equation
    has a third (or second, unpaired) operand, and whose output is the factor
    transposed, [.., n, m]: the weight with which source head m reaches head n.
    The second term of a pair has no equation (its first term's covers both).
    """

    name: str
    side: str
    shape: Tuple[str, ...]
    dynamic: Optional[str]
    pair: Optional[str] = None
    factor: Optional[str] = None
    equation: Optional[str] = None


#: Every compose term, in the order of the spec's formula (SPEC.md, "Compose").
COMPOSE_TERMS: Tuple[Term, ...] = (
    Term("qw1", "query", ("B", "T", "G", "R", "M"), "w1", "qw2", "query",
         "btgrm,btgrn->btgnm"),
    Term("qw2", "query", ("B", "T", "G", "R", "M"), "w2", "qw1", "query"),
    Term("kw1", "key", ("B", "S", "G", "R", "M"), "w1", "kw2", "key", "bsgrm,bsgrn->bsgnm"),
    Term("kw2", "key", ("B", "S", "G", "R", "M"), "w2", "kw1", "key"),
    Term("qdd", "query", ("B", "T", "G", "M"), "dd", None, "query", "btgn,nm->btgnm"),
    Term("kdd", "key", ("B", "S", "G", "M"), "dd", None, "key", "bsgn,nm->bsgnm"),
    Term("static", "static", ("G", "M", "M"), None, None, "query", "gmn->gnm"),
)

TERMS = {t.name: t for t in COMPOSE_TERMS}
TERM_NAMES: Tuple[str, ...] = tuple(t.name for t in COMPOSE_TERMS)
#: The low-rank pairs, each as (first, second).
PAIRS: Tuple[Tuple[str, str], ...] = tuple(
    (t.name, t.pair) for t in COMPOSE_TERMS if t.pair and t.dynamic == "w1")

#: The terms of the first version of the spec: what an implementation that does not
#: declare its terms (``dcmha.registry.Implementation.terms``) is taken to compute. A
#: term added to ``COMPOSE_TERMS`` later is refused on such an implementation, so
#: that no kernel silently drops a term it has never heard of.
BASE_TERMS = frozenset({"qw1", "qw2", "kw1", "kw2", "qdd", "kdd", "static"})

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


#: The decoding cache's entries of key-side dynamic weights (SPEC.md section 9): entry name ->
#: the weights it stacks per key slot. Along axis 2 an entry holds, for each enabled key slot
#: in order (pre_key, post_key), these weights in this order: "key_w" (B, S_max, 2 C_k, G, R,
#: M) is [w1, w2] of each slot, "key_dd" (B, S_max, C_k, G, M) the gates of each slot. Two
#: entries, not one per slot and weight, because every entry costs a write and a pass through
#: a compiled step's arguments at every decoding step, whatever its size.
KEY_CACHE = {"key_w": ("w1", "w2"), "key_dd": ("dd",)}


def pack_key_weights(key_dynamic: Mapping, slots, *, stack) -> dict:
    """The ``KEY_CACHE`` entries holding ``key_dynamic`` ({slot: {"w1", "w2", "dd"}}, each
    (B, L, G, ...)) of the key ``slots`` in order: {"key_w": (B, L, 2 C_k, G, R, M),
    "key_dd": (B, L, C_k, G, M)}, those with weights. ``stack(arrays, axis)``: the array
    library's stack (works on any array type)."""
    out = {}
    for entry, names in KEY_CACHE.items():
        parts = [key_dynamic[s][n] for s in slots for n in names if n in key_dynamic[s]]
        if parts:
            out[entry] = stack(parts, 2)
    return out


def unpack_key_weights(entries: Mapping, slots, *, unstack) -> dict:
    """``pack_key_weights`` undone: {slot: {"w1", "w2", "dd"}} (each (B, S, G, ...)) of the
    key ``slots`` from the ``KEY_CACHE`` entries present in ``entries``.
    ``unstack(array, axis, num)``: the ``num`` slices along ``axis``."""
    out = {s: {} for s in slots}
    for entry, names in KEY_CACHE.items():
        if entry in entries:
            parts = iter(unstack(entries[entry], 2, len(slots) * len(names)))
            for s in slots:
                for n in names:
                    out[s][n] = next(parts)
    return out


def compose_factors(terms: Mapping, num_heads_per_group: int, *, einsum, eye,
                    factors=("query", "key")):
    """The two small factors of compose from ``terms`` (the present ones, by name).

    einsum(equation, *operands) and eye(M) come from the caller's array library
    (NumPy, ``keras.ops``, torch, ...); each term adds ``einsum(term.equation,
    ...)`` to its factor. Returns (wq, wk): wq = I + the query-factor terms,
    [.., n, m], (B, T, G, M, M) (or (G, M, M) with static terms only), or None
    when no query-factor term is present (the residual is then added as is); wk
    = the key-factor terms, (B, S, G, M, M), or None. ``factors`` limits the
    work to one of them (the other is then None). compose is then
    out[n, t, s] = sum_m wq[t, n, m] a[m, t, s] + sum_m wk[s, n, m] a[m, t, s].
    """
    identity = None
    wanted = factors
    factors = {"query": None, "key": None}
    for term in COMPOSE_TERMS:
        if term.equation is None or term.name not in terms or term.factor not in wanted:
            continue
        operands = [terms[term.name]] + ([terms[term.pair]] if term.pair else [])
        if term.equation.count(",") == len(operands):     # one more operand: the identity
            identity = eye(num_heads_per_group) if identity is None else identity
            operands.append(identity)
        part = einsum(term.equation, *operands)
        old = factors[term.factor]
        factors[term.factor] = part if old is None else old + part
    wq, wk = factors["query"], factors["key"]
    if wq is not None:
        wq = (eye(num_heads_per_group) if identity is None else identity) + wq
    return wq, wk


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


def visible(t, s, *, causal: bool, window: Optional[int], offset=0):
    """Whether query t (at absolute position offset + t) may see key s.

    The one position rule of every mask: causal, s <= offset + t; window W,
    |offset + t - s| < W. ``t`` and ``s`` are ints (the result is a bool) or
    integer arrays of any array library that broadcast together (the result is
    their boolean array, through the operators ``<=``, ``abs``, ``<`` and ``&``
    only). ``True`` (the Python bool) when neither rule applies.
    """
    pos = offset + t
    vis = True
    if causal:
        vis = s <= pos
    if window is not None:
        band = abs(pos - s) < window
        vis = band if vis is True else vis & band
    return vis
