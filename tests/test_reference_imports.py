"""The ``dcmha`` package has no import cycle.

The import graph is read from the source with ``ast`` (no module is imported): every
``import`` and ``from ... import`` statement of a module, at module level or inside a
function, is an edge to the ``dcmha`` module it names. The folders are mapped onto
``dcmha`` as setup.py maps them (``ROOTS``). A cycle fails the test with its path.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _roots():
    """setup.py's ``ROOTS`` ({package name: folder}), read from its source."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "ROOTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no ROOTS")


def _modules():
    """{module name: source path} of every module of the package."""
    out = {}
    for name, folder in _roots().items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            if any(not (base.joinpath(*rel[:i]) / "__init__.py").exists()
                   for i in range(1, len(rel))):
                continue                     # a folder that is not a package (tests, data)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((name,) + rel)] = path
    return out


def _targets(module, path, node, modules):
    """The package's modules that one import statement of ``module`` imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if node.level:                               # relative: from its package
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = package[:len(package) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        if sub in modules:
            out.append(sub)                      # from package import submodule
        elif source in modules:
            out.append(source)                   # from module import name
    return out


def import_graph():
    """{module: {imported module: first line}} over the package's modules."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, path, node, modules):
                    if target != module:
                        edges.setdefault(target, node.lineno)
    return graph


def find_cycle(graph):
    """One cycle as [m0, m1, ..., m0], or None (depth-first search)."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _describe(cycle, graph):
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + \
        f" -> {cycle[-1]}"


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "dcmha" in graph and "dcmha.spec.reference" in graph
    # A module-level and a function-level import are both edges.
    assert "dcmha.spec.reference" in graph["dcmha"]
    assert "dcmha.registry" in graph["dcmha.backends.xla"]


def test_find_cycle_reports_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None


def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle:
        pytest.fail("import cycle: " + _describe(cycle, graph))


def _backend_folder(module):
    """The backend folder of ``dcmha.backends.<folder>.<module>``, else None."""
    parts = module.split(".")
    return parts[2] if len(parts) >= 4 and parts[1] == "backends" else None


def test_backend_folders_import_no_other_backend_folder():
    """Code two backends share lives in a shared module of ``backends/`` (e.g.
    ``tf_common``, ``torch_common``), not in one of the two backends' folders."""
    graph = import_graph()
    crossing = sorted(f"{m} -> {t} (line {line})" for m, edges in graph.items()
                      for t, line in edges.items()
                      if _backend_folder(m) and _backend_folder(t)
                      and _backend_folder(t) != _backend_folder(m))
    assert crossing == []


_BACKEND_NAMES = {"jax", "torch", "tensorflow", "numpy"}
#: The shared code of the package: it reaches backend-specific code through the seam
#: (``dcmha.backend``) or the registry, and names no Keras backend.
SHARED = ("dcmha.layers", "dcmha.ops", "dcmha.models", "dcmha.call", "dcmha.hub.backbone",
          "dcmha.hub.causal_lm")


def _names_a_backend(node):
    """Whether an expression is a backend name or ``keras.backend.backend()``."""
    if isinstance(node, ast.Constant):
        return node.value in _BACKEND_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_backend(e) for e in node.elts)
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "backend")


def backend_comparisons(path):
    """Lines of ``path`` that compare with a backend name or key a table on one."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(
                _names_a_backend(n) for n in [node.left] + node.comparators):
            lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(
                k is not None and _names_a_backend(k) for k in node.keys):
            lines.append(node.lineno)
    return lines


def test_backend_comparisons_are_seen(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("if keras.backend.backend() == 'torch':\n    pass\nT = {'jax': 1}\n"
                    "U = x in ('a', 'tensorflow')\n")
    assert backend_comparisons(path) == [1, 3, 4]


def test_shared_code_names_no_backend():
    modules = _modules()
    # A shared package's modules are shared code too (``dcmha.layers.cache``, ...).
    found = {m: backend_comparisons(path) for m, path in modules.items()
             if m in SHARED or m.startswith(tuple(s + "." for s in SHARED))}
    assert set(SHARED) <= set(found)
    assert {m: lines for m, lines in found.items() if lines} == {}
