"""One description of an attention call, built and validated once.

``describe(q, k, v, ...)`` checks every argument of an attention call (shapes,
compose terms, mask, flags) and returns a frozen ``AttentionCall``. It is the
only place the call contract is checked: ``dcmha.ops.dcmha_attention`` builds
it, the registry (``dcmha.registry``) selects an implementation from it, and
every implementation receives it and reads its fields without re-checking.

Only static facts are checked (shapes, Python values); unknown (None) sizes
are not. The module reads shapes and dtype names only and imports no array
framework. Shapes use the spec's letters: B, T, S, N, N_kv, G, M, d, d_v, R.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

import numpy as np

from dcmha.spec import terms as spec_terms

__all__ = ["AttentionCall", "describe", "check_positive_int", "shape_of", "shapes_agree",
           "block_rows"]


def _size(s) -> Optional[int]:
    # Anything but a plain int is unknown here: a symbolic size of an exporter
    # (torch SymInt, jax's dynamic dims) must not be forced into a number.
    return int(s) if isinstance(s, (int, np.integer)) and not isinstance(s, bool) else None


def shape_of(x) -> tuple:
    """The static shape of an array-like as a tuple (None for unknown sizes)."""
    shape = tuple(x.shape)
    if all(type(s) is int for s in shape):     # the common case, without a call per size
        return shape
    return tuple(_size(s) for s in shape)


def shapes_agree(shape, expected) -> bool:
    """Whether ``shape`` and ``expected`` (tuples of sizes) have the same rank and the same
    size on every axis where both are known: None in either (unknown, or free to be
    anything) agrees with any size. The one shape-fit rule of the package's checks."""
    return len(shape) == len(expected) and all(
        a is None or b is None or a == b for a, b in zip(shape, expected))


def _fmt(expected, free=()) -> str:
    """(2, 3, R, 4)-style text: ``free`` maps positions to a letter."""
    return "(" + ", ".join(dict(free).get(i, str(v)) for i, v in enumerate(expected)) + (
        ",)" if len(expected) == 1 else ")")


def _is_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def check_positive_int(name: str, value, allow_none: bool = False) -> None:
    """``value`` is a positive int (a Python or NumPy integer, not a bool), or None when
    ``allow_none``; else ``ValueError("`name` must be a positive integer. Received:
    name=value")`` ("None or a positive integer" when ``allow_none``). The one
    positive-integer check of the package's arguments."""
    if value is None and allow_none:
        return
    if not _is_int(value) or value <= 0:
        what = "None or a positive integer" if allow_none else "a positive integer"
        raise ValueError(f"`{name}` must be {what}. Received: {name}={value!r}")


def check_composition_lr_scale(value) -> float:
    """``value`` as a float when it is a positive finite real number (not a bool), else
    ``ValueError("`composition_lr_scale` must be a positive number. Received: ...")``: the
    one check of the composition weights' step scale (``DCMHA``'s parametrisation and
    ``dcmha.optimizers``' wrapper)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))
            or not np.isfinite(value) or not value > 0):
        raise ValueError("`composition_lr_scale` must be a positive number. Received: "
                         f"composition_lr_scale={value!r}")
    return float(value)


def block_rows(batch: int, num_heads: int, key_length: int, block_bytes: int, *,
               smallest: int = 16, largest: Optional[int] = 1024) -> int:
    """Query rows per block: the power of two whose (B, N, rows, S) float32 block is
    closest to ``block_bytes`` from below, clamped to [smallest, largest] (powers of
    two; largest None: no cap). The one rule behind every chunk and block size:
    ``dcmha.ops.auto_query_chunk_size`` and the fused kernels' defaults; kept here,
    framework-free, so that the kernel modules need not import Keras."""
    rows = block_bytes // (4 * max(1, batch * num_heads * key_length))
    rows = max(smallest, rows if largest is None else min(largest, rows))
    return 1 << (rows.bit_length() - 1)


def _dtype_name(x) -> str:
    dtype = x.dtype
    name = getattr(dtype, "name", None)
    if isinstance(name, str):
        return name
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------------------
# The pieces of the contract
# ---------------------------------------------------------------------------

def _check_qkv(q, k, v):
    for name, x, letters in (("q", q, "(B, T, N, d)"), ("k", k, "(B, S, N_kv, d)"),
                             ("v", v, "(B, S, N_kv, d_v)")):
        if not hasattr(x, "shape"):
            raise TypeError(f"`{name}` must be an array of rank 4 {letters}. "
                            f"Received: {type(x).__name__}")
        if len(x.shape) != 4:
            raise ValueError(f"`{name}` must have rank 4 {letters}. "
                             f"Received: {name}.shape={shape_of(x)}")
    qs, ks, vs = shape_of(q), shape_of(k), shape_of(v)
    if not shapes_agree(qs[3:], ks[3:]):
        raise ValueError("`q` and `k` must have the same head size d. "
                         f"Received: q.shape={qs}, k.shape={ks}")
    if not shapes_agree(ks[:3], vs[:3]):
        raise ValueError("`k` and `v` must have the same batch, length and heads (B, S, N_kv). "
                         f"Received: k.shape={ks}, v.shape={vs}")
    if not shapes_agree(qs[:1], ks[:1]):
        raise ValueError("`q` and `k` must have the same batch size. "
                         f"Received: q.shape={qs}, k.shape={ks}")
    if ks[2] == 0 or qs[2] == 0:
        raise ValueError("`q` and `k` must have at least one head. "
                         f"Received: q.shape={qs}, k.shape={ks}")
    if None not in (qs[2], ks[2]) and qs[2] % ks[2]:
        raise ValueError(f"The heads of `q` (N={qs[2]}) must be a multiple of the heads of `k` "
                         f"(N_kv={ks[2]}). Received: q.shape={qs}, k.shape={ks}")


def _check_groups(num_groups, N):
    check_positive_int("num_groups", num_groups)
    if N is not None and N % num_groups:
        raise ValueError(f"`num_groups` must divide the number of heads N={N}. "
                         f"Received: num_groups={num_groups}")


def check_terms(stage: str, terms: Mapping, B, T, S, G, M) -> Optional[int]:
    """Names, pairs and shapes of one stage's compose terms; returns their rank R (or None).

    The names, sides and shapes come from ``dcmha.spec.terms.COMPOSE_TERMS``. The
    checks of one set of names and shapes run once (``_check_term_shapes``): a
    decoding step repeats the same ones every layer and token.
    """
    if not isinstance(terms, Mapping):
        raise TypeError(f"`{stage}` must be None or a dict of compose terms. "
                        f"Received: {type(terms).__name__}")
    shapes = []
    for name, x in terms.items():
        if not hasattr(x, "shape"):
            _check_term_names(stage, terms)
            label = f"{stage}['{name}']" if stage else name
            raise TypeError(f"`{label}` must be an array. Received: {type(x).__name__}")
        shapes.append((name, shape_of(x)))
    return _check_term_shapes(stage, tuple(sorted(shapes, key=lambda t: str(t[0]))),
                              (B, T, S, G, M))


def _check_term_names(stage: str, terms) -> None:
    """Every name of ``terms`` a compose term, and the pairs (qw1 / qw2 ...) complete."""
    unknown = sorted(set(terms) - set(spec_terms.TERM_NAMES), key=str)
    if unknown:
        raise ValueError(f"`{stage}` has unknown compose terms {unknown}. Expected a subset of "
                         f"{sorted(spec_terms.TERM_NAMES)}")
    for a, b in spec_terms.PAIRS:
        present = [n for n in (a, b) if n in terms]
        if len(present) == 1:
            raise ValueError(f"`{stage}` must have both '{a}' and '{b}' or neither. "
                             f"Received: {present}")


@functools.lru_cache(maxsize=256)
def _check_term_shapes(stage: str, shapes: tuple, dims: tuple) -> Optional[int]:
    """``check_terms`` on ((name, shape), ...) and dims (B, T, S, G, M)."""
    label = (lambda n: f"{stage}['{n}']") if stage else (lambda n: n)
    terms = dict(shapes)
    _check_term_names(stage, terms)
    sizes = dict(zip("BTSGM", dims))
    R = None
    for term in spec_terms.COMPOSE_TERMS:
        if term.name not in terms:
            continue
        shape = terms[term.name]
        expected = spec_terms.term_shape(term.name, sizes)       # R free until a term sets it
        if not shapes_agree(shape, expected):
            free = {i: letter for i, letter in enumerate(term.shape)
                    if expected[i] is None and letter == "R"}
            raise ValueError(f"`{label(term.name)}` must have shape "
                             f"({', '.join(term.shape)}) = {_fmt(expected, free)}. "
                             f"Received: {label(term.name)}.shape={shape}")
        if "R" in term.shape and R is None:
            R = sizes["R"] = shape[term.shape.index("R")]
    return R


def _check_mask(attention_mask, B, T, S, N):
    """A boolean / integer mask broadcastable to (B, T, S), or per head (B, N, T, S)."""
    if attention_mask is None:
        return None
    if not hasattr(attention_mask, "shape"):
        raise TypeError("`attention_mask` must be a boolean tensor (True = attend). Received: "
                        f"{type(attention_mask).__name__}")
    dtype = _dtype_name(attention_mask)
    if dtype != "bool" and not dtype.startswith(("int", "uint")):
        raise TypeError("`attention_mask` must be boolean (True = attend) or integer (1 = "
                        f"attend). Received: attention_mask.dtype={dtype}")
    shape = shape_of(attention_mask)
    if len(shape) == 4:
        if not (shape[1] in (1, None) or N is None or shape[1] == N):
            raise ValueError("A rank-4 `attention_mask` must have a head axis of size 1 (shared "
                             f"by all heads) or N={N} (one mask per head). "
                             f"Received: attention_mask.shape={shape}")
        core = shape[:1] + shape[2:]
    else:
        core = shape
    if len(core) > 3 or not all(a in (1, None) or b is None or a == b
                                 for a, b in zip(core[::-1], (S, T, B))):
        raise ValueError(f"`attention_mask` must broadcast to (B, T, S) = {(B, T, S)}"
                         f"{'' if len(shape) != 4 else f' or (B, N, T, S) = {(B, N, T, S)}'}. "
                         f"Received: attention_mask.shape={shape}")
    return "per_head" if len(shape) == 4 and shape[1] not in (1, None) else "shared"


def _static_offset(query_offset) -> Optional[int]:
    """The query offset as a Python int when it is known without running anything."""
    if _is_int(query_offset):
        return int(query_offset)
    return None


# ---------------------------------------------------------------------------
# The description
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionCall:
    """A validated attention call (see ``describe``).

    Arrays: q (B, T, N, d), k (B, S, N_kv, d), v (B, S, N_kv, d_v); pre / post: the
    compose terms of each stage ({name: array}, float32) or None; attention_mask:
    as given (broadcastable to (B, T, S), or (B, N, T, S) per head) or None.
    Sizes are Python ints, None where unknown. ``mask_kind`` is None, "shared"
    or "per_head"; ``static_offset`` is ``query_offset`` as an int, or None when it
    is a tensor. ``needs`` is the set of capabilities (``dcmha.registry.CAPABILITIES``)
    an implementation must have to run the call.
    """

    q: Any
    k: Any
    v: Any
    num_groups: int
    pre: Optional[Mapping]
    post: Optional[Mapping]
    attention_mask: Any
    use_causal_mask: bool
    sliding_window: Optional[int]
    query_offset: Any
    query_chunk_size: Optional[int]
    dropout_rate: float
    seed: Any
    training: bool
    return_attention_scores: bool
    return_intermediates: bool
    auto_chunk: bool
    B: Optional[int]
    T: Optional[int]
    S: Optional[int]
    N: Optional[int]
    N_kv: Optional[int]
    d: Optional[int]
    d_v: Optional[int]
    ranks: Tuple[int, ...]
    mask_kind: Optional[str]
    static_offset: Optional[int]
    needs: frozenset = field(default=frozenset())

    @property
    def G(self) -> int:
        return self.num_groups

    @property
    def M(self) -> Optional[int]:
        return None if self.N is None else self.N // self.num_groups

    @property
    def stages(self) -> dict:
        """{"pre": terms, "post": terms} for the stages that are on."""
        return {n: t for n, t in (("pre", self.pre), ("post", self.post)) if t}

    @property
    def terms(self) -> frozenset:
        """The names of the compose terms present in any stage."""
        return frozenset(n for t in self.stages.values() for n in t)

    @property
    def one_query(self) -> bool:
        """T == 1 with no (B, N, T, S) output asked for and no dropout: a decoding step,
        what the one-query paths compute (``dcmha.ops``'s, "torch_decode", "tf_decode")."""
        return (self.T == 1 and not (self.return_attention_scores or self.return_intermediates)
                and not (self.training and self.dropout_rate > 0.0))

    @property
    def length_product(self) -> Optional[int]:
        """T * S, or None when either is unknown."""
        return None if self.T is None or self.S is None else self.T * self.S

    def arguments(self) -> dict:
        """The call as keyword arguments of the plain core (``dcmha.ops``'s names)."""
        return dict(q=self.q, k=self.k, v=self.v, num_groups=self.num_groups, pre=self.pre,
                    post=self.post, attention_mask=self.attention_mask,
                    use_causal_mask=self.use_causal_mask, sliding_window=self.sliding_window,
                    query_offset=self.query_offset, query_chunk_size=self.query_chunk_size,
                    dropout_rate=self.dropout_rate, seed=self.seed, training=self.training,
                    return_attention_scores=self.return_attention_scores,
                    return_intermediates=self.return_intermediates, auto_chunk=self.auto_chunk)


def describe(q, k, v, *, num_groups=1, pre=None, post=None, attention_mask=None,
             use_causal_mask=False, sliding_window=None, query_offset=0, query_chunk_size=None,
             dropout_rate=0.0, seed=None, training=False, return_attention_scores=False,
             return_intermediates=False, auto_chunk=True) -> AttentionCall:
    """Validate an attention call and describe it (see ``dcmha.ops.dcmha_attention``
    for the arguments). Raises ValueError / TypeError naming the argument."""
    _check_qkv(q, k, v)
    (B, T, N, d), (_, S, N_kv, d_v) = shape_of(q), shape_of(v)
    d = d if d is not None else shape_of(k)[3]
    _check_groups(num_groups, N)
    if (isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float))
            or not 0.0 <= dropout_rate < 1.0):
        raise ValueError("`dropout_rate` must be a float in [0, 1). "
                         f"Received: dropout_rate={dropout_rate!r}")
    check_positive_int("sliding_window", sliding_window, allow_none=True)
    check_positive_int("query_chunk_size", query_chunk_size, allow_none=True)
    if not hasattr(query_offset, "shape") and (not _is_int(query_offset) or query_offset < 0):
        raise ValueError("`query_offset` must be a non-negative integer. "
                         f"Received: query_offset={query_offset!r}")
    if hasattr(query_offset, "shape") and (
            len(query_offset.shape) != 0
            or not _dtype_name(query_offset).startswith(("int", "uint"))):
        raise ValueError("`query_offset` must be an integer or an integer scalar tensor. "
                         f"Received: query_offset.shape={shape_of(query_offset)}, "
                         f"query_offset.dtype={_dtype_name(query_offset)}")
    mask_kind = _check_mask(attention_mask, B, T, S, N)
    M = None if N is None else N // num_groups
    ranks = []
    for stage, terms in (("pre", pre), ("post", post)):
        if terms:
            r = check_terms(stage, terms, B, T, S, num_groups, M)
            if r is not None:
                ranks.append(r)
    offset = _static_offset(query_offset)
    needs = set()
    if return_attention_scores:
        needs.add("attention_scores")
    if return_intermediates:
        needs.add("intermediates")
    if training and dropout_rate > 0.0:
        needs.add("dropout")
    if mask_kind == "per_head":
        needs.add("head_masks")
    if offset is None:
        needs.add("traced_offset")
    elif offset and (use_causal_mask or sliding_window is not None):
        needs.add("query_offset")
    if None in (T, S, N, N_kv, d, d_v):
        needs.add("symbolic_shapes")
    return AttentionCall(
        q=q, k=k, v=v, num_groups=int(num_groups), pre=pre or None, post=post or None,
        attention_mask=attention_mask, use_causal_mask=bool(use_causal_mask),
        sliding_window=None if sliding_window is None else int(sliding_window),
        query_offset=query_offset, query_chunk_size=query_chunk_size,
        dropout_rate=float(dropout_rate), seed=seed, training=bool(training),
        return_attention_scores=bool(return_attention_scores),
        return_intermediates=bool(return_intermediates), auto_chunk=bool(auto_chunk),
        B=B, T=T, S=S, N=N, N_kv=N_kv, d=d, d_v=d_v, ranks=tuple(sorted(set(ranks))),
        mask_kind=mask_kind, static_offset=offset, needs=frozenset(needs))
