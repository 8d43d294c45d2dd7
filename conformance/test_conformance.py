"""pytest entry to the conformance suite: one test per (backend, case).

    pytest conformance/                                        # the reference only
    DCMHA_CONFORMANCE_BACKENDS=keras-jax,keras-torch pytest conformance/
    DCMHA_CONFORMANCE_BACKENDS=impl-torch,impl-jax_cpu pytest conformance/
    DCMHA_CONFORMANCE_BACKENDS=all pytest conformance/

The reference adapter runs in this process, case by case. Every other backend runs once, all
its cases, in its own worker subprocess (``python -m dcmha.conformance --_worker NAME``); its
results are cached for the session and reported here per case. SKIP (a capability the backend
lacks) becomes a pytest skip with the reason. With ``all``, a backend that cannot be imported
is skipped; named explicitly, it fails.
"""

import os

import pytest

from dcmha.conformance import load_cases
from dcmha.conformance.runner import (REFERENCE_TARGET, discover_adapters, load_adapter,
                                      resolve_alias, run_backend, run_case)

CASES = load_cases()
_SELECTED = os.environ.get("DCMHA_CONFORMANCE_BACKENDS", "reference").strip() or "reference"
EXPLICIT = _SELECTED != "all"
# The implementation registry (impl-* adapters) is read only when the selection needs it.
REGISTRY = discover_adapters(implementations=_SELECTED != "reference")
BACKENDS = list(REGISTRY) if not EXPLICIT else [b.strip() for b in _SELECTED.split(",") if b.strip()]

_batches = {}
_adapters = {}


def _result(backend, case):
    entry = resolve_alias(backend, REGISTRY)
    if entry is None:
        pytest.fail(f"unknown backend {backend!r} in DCMHA_CONFORMANCE_BACKENDS; "
                    f"known backends: {', '.join(REGISTRY)}")
    if entry.target == REFERENCE_TARGET:
        if backend not in _adapters:
            _adapters[backend] = load_adapter(entry.target, entry.args)
        return run_case(backend, _adapters[backend], case)
    if backend not in _batches:
        _batches[backend] = {r.case: r for r in
                             run_backend(backend, entry, CASES, explicit=EXPLICIT)}
    return _batches[backend][case.name]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_conformance(backend, case):
    r = _result(backend, case)
    if r.status == "SKIP":
        pytest.skip(r.reason)
    assert r.status == "PASS", f"{backend} / {case.name}: {r.reason}\n{r.details}"
