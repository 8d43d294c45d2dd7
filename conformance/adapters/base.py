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
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import numpy as np

#: Every capability a case may require.
CAPABILITIES = frozenset({"forward", "gradients", "decode", "float32", "float16", "bfloat16",
                          "intermediates"})


class Adapter:
    """Base class of conformance adapters (subclassing it is optional: duck typing suffices).

    Attributes:
        name: the backend's name, as registered.
        capabilities: the subset of ``CAPABILITIES`` this backend supports.
    """

    name: str = ""
    capabilities: frozenset = frozenset()

    def run(self, case) -> Dict[str, np.ndarray]:
        """Compute ``case.outputs`` for one case (see the module docstring)."""
        raise NotImplementedError

    def missing(self, case) -> Tuple[str, ...]:
        """The requirements of ``case`` this adapter lacks (empty: it can run the case)."""
        return tuple(r for r in case.requires if r not in self.capabilities)


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


def cache_length(case) -> int:
    """The cache size S_max of a decode case (``call.cache_length``, default the sequence length)."""
    return int(case.call.get("cache_length") or sum(case.call["decode_steps"]))


def dtype_name(case) -> str:
    """The case's compute dtype name ("float32", "float16", "bfloat16")."""
    return case.dtype


__all__ = ["Adapter", "CAPABILITIES", "call_inputs", "decode_segments", "cache_length", "dtype_name"]
