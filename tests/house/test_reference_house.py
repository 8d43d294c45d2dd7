"""The package's house rules, read from the source (nothing is imported):

- every library class has a docstring;
- outside the registry (``dcmha.registry``) and the framework seam (``dcmha.framework``), no
  module of ``dcmha_core/`` or ``export/`` compares with a Keras backend name or keys a
  table on one: backend-specific code lives behind the seam or in ``backends/``.

That imports point down (no cycle, no upward import, function-level and ``importlib``
imports included) is ``test_reference_imports.py``'s. A module's length is no rule: a
module is as long as its concept needs.
"""

import ast

import pytest

from tests.house.test_reference_imports import _modules, backend_comparisons

#: The modules allowed to name backends: the registry and the seam.
NAMING_BACKENDS = ("dcmha.registry", "dcmha.framework")
#: Comparisons that name no Keras backend behaviour, with the count the check sees.
NOT_BACKEND_BEHAVIOUR = {
    # the pickle module "torch" of a saved storage type (torch.FloatStorage, ...)
    "dcmha.checkpoints.torch_bin": 1,
    # `python -m dcmha demo --backend X` refuses when Keras is already imported with
    # another backend
    "dcmha.demo": 1,
}


def _shared(modules):
    """The modules of ``dcmha_core/`` and ``export/`` that must name no backend."""
    return {m: p for m, p in modules.items()
            if (m == "dcmha" or (m.startswith("dcmha.") and m.split(".")[1] not in
                                 ("spec", "backends", "conformance")) or
                m.startswith("dcmha.export"))
            and not any(m == n or m.startswith(n + ".") for n in NAMING_BACKENDS)}


def test_shared_modules_cover_core_and_export():
    shared = _shared(_modules())
    for name in ("dcmha.layers", "dcmha.ops", "dcmha.models", "dcmha.engines",
                 "dcmha.distribution", "dcmha.partition", "dcmha.export",
                 "dcmha.hub.backbone"):
        assert any(m == name or m.startswith(name + ".") for m in shared), name
    assert not any(m.startswith(("dcmha.framework.", "dcmha.backends")) for m in shared)
    assert "dcmha.registry" not in shared and "dcmha.framework" not in shared


@pytest.mark.parametrize("tree", ["core", "export"])
def test_core_and_export_name_no_backend(tree):
    shared = _shared(_modules())
    if tree == "export":
        shared = {m: p for m, p in shared.items() if m.startswith("dcmha.export")}
    else:
        shared = {m: p for m, p in shared.items() if not m.startswith("dcmha.export")}
    assert shared
    found = {m: len(backend_comparisons(p)) for m, p in shared.items()}
    assert {m: n for m, n in found.items() if n} == {
        m: n for m, n in NOT_BACKEND_BEHAVIOUR.items() if m in shared}


def test_every_library_class_has_a_docstring():
    modules = _modules()
    bare = [f"{m}:{node.lineno} {node.name}" for m, p in modules.items()
            for node in ast.walk(ast.parse(p.read_text(), str(p)))
            if isinstance(node, ast.ClassDef) and not ast.get_docstring(node)]
    assert bare == []
