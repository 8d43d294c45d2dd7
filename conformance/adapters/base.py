"""The adapter protocol: how a backend plugs into the conformance suite.

An adapter is a class with a ``name``, a set of ``capabilities`` and ``run(case)``, registered
as an entry point in the group ``dcmha.conformance.adapters`` (name = adapter name, value =
"module:Class"). The runner instantiates it with no arguments, inside its own subprocess for
every adapter but the reference one (Keras fixes its backend at import, and TensorFlow and
Triton cannot share a process).

``run(case)`` returns a dict with the names of ``case.outputs`` ("output", "attention_scores",
"scores", "pre_composed", "probs", "dynamic/<slot>/<w1|w2|dd>", "grad/<name>") mapped to
arrays of the expected shapes (any float dtype). The runner compares every name in
``case.outputs`` against ``case.expected`` with ``case.tolerance``; a missing name fails the
case. Cases whose ``requires`` is not a subset of ``capabilities`` are skipped, never run.

Some outputs need a capability of their own (``output_capability``): "attention_scores" the
capability "attention_scores", the intermediates "intermediates", "grad/<name>" "gradients".
An adapter without it is not compared on that output: the row of the case says which outputs
were not covered, and a case none of whose outputs is covered is skipped. ``run(case)`` should
not compute them (``covered_outputs`` tells which to compute): e.g. an implementation that never
materialises the probabilities is called without ``return_attention_scores``.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import numpy as np

#: Every capability a case may require, or an output may need. "long_sequences": the case has
#: T * S >= ``LONG_LENGTH_PRODUCT`` (the sizes from which the CPU fast paths are taken);
#: interpreters leave it out to keep their runs short.
CAPABILITIES = frozenset({"forward", "gradients", "decode", "float32", "float16", "bfloat16",
                          "intermediates", "attention_scores", "long_sequences"})

#: Cases with T * S at least this require "long_sequences".
LONG_LENGTH_PRODUCT = 8192


def output_capability(name: str) -> Optional[str]:
    """The capability needed to produce the output ``name`` (None: every adapter produces it)."""
    if name == "attention_scores":
        return "attention_scores"
    if name.startswith("grad/"):
        return "gradients"
    if name in ("scores", "pre_composed", "probs") or name.startswith("dynamic/"):
        return "intermediates"
    return None


def covered_outputs(case, capabilities) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(outputs of ``case`` an adapter with ``capabilities`` is compared on, those it is not)."""
    caps = frozenset(capabilities)
    covered = tuple(n for n in case.outputs if output_capability(n) in caps | {None})
    return covered, tuple(n for n in case.outputs if n not in covered)


class Adapter:
    """Base class of conformance adapters (subclassing it is optional: duck typing suffices).

    Attributes:
        name: the backend's name, as registered.
        capabilities: the subset of ``CAPABILITIES`` this backend supports.
    """

    name: str = ""
    capabilities: frozenset = frozenset()
    #: Optional: after ``run``, the names of the attention paths the case ran on (e.g. which
    #: implementation ``"auto"`` chose); the runner reports them with the case's result.
    paths: Tuple[str, ...] = ()

    def run(self, case) -> Dict[str, np.ndarray]:
        """Compute ``case.outputs`` for one case (see the module docstring)."""
        raise NotImplementedError

    def skip_reason(self, case) -> Optional[str]:
        """Optional: why this adapter skips ``case`` although it has the capabilities
        (None: it runs the case). The runner asks after the capability check."""
        return None

    def missing(self, case) -> Tuple[str, ...]:
        """The requirements of ``case`` this adapter lacks (empty: it can run the case)."""
        return tuple(r for r in case.requires if r not in self.capabilities)

    def wanted(self, case) -> Tuple[str, ...]:
        """The outputs of ``case`` to compute: those this adapter is compared on."""
        return covered_outputs(case, self.capabilities)[0]


# ---------------------------------------------------------------------------
# Helpers for adapter authors
# ---------------------------------------------------------------------------

def call_inputs(case) -> dict:
    """The layer-call arguments of a forward/gradient case, as the contract specifies.

    Returns {"query", "value", "key", "attention_mask", "use_causal_mask"}: "value" and "key"
    are None for self-attention cases (call the layer as ``layer(query, query)``), and
    "attention_mask" is None when the case has none. Arrays are float32 / bool NumPy arrays.
    """
    self_attention = case.call["self_attention"]
    return {
        "query": case.inputs["query"],
        "value": None if self_attention else case.inputs["value"],
        "key": None if self_attention else case.inputs["key"],
        "attention_mask": case.inputs.get("attention_mask"),
        "use_causal_mask": bool(case.call["use_causal_mask"]),
    }


def decode_segments(case) -> Iterator[Tuple[int, int]]:
    """(start, stop) of each decode step of a decode case; the first is the prefill."""
    start = 0
    for n in case.call["decode_steps"]:
        yield start, start + n
        start += n


def has_one_query_call(case) -> bool:
    """Whether a call of ``case`` has one query (T = 1): a forward or gradient case with
    query length 1, or a decode case with a one-token step."""
    if case.kind == "decode":
        return any(stop - start == 1 for start, stop in decode_segments(case))
    return case.dims["query_length"] == 1


def cache_length(case) -> int:
    """The cache size S_max of a decode case (``call.cache_length``, default the sequence length)."""
    return int(case.call.get("cache_length") or sum(case.call["decode_steps"]))


def dtype_name(case) -> str:
    """The case's compute dtype name ("float32", "float16", "bfloat16")."""
    return case.dtype


__all__ = ["Adapter", "CAPABILITIES", "LONG_LENGTH_PRODUCT", "output_capability",
           "covered_outputs", "call_inputs", "decode_segments", "has_one_query_call",
           "cache_length", "dtype_name"]
