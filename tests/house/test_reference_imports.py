"""The ``dcmha`` package's imports point down: no import cycle, and no import from a layer
to a layer above it (``LAYERS``).

The import graph is read from the source with ``ast`` (no module is imported). An edge
from a module to a module of the package is any of:

* an ``import`` or ``from ... import`` statement, at module level or inside a function,
  absolute or relative (resolved against the module's package);
* a call of ``importlib.import_module`` / ``import_module`` / ``__import__`` whose name
  is a constant (an f-string or sum of constants and ``__name__`` / ``__package__``
  included), with its ``package`` argument for a relative name;
* a module of the package named as data: a string that is exactly a dotted module name
  of the package, or a "module:attribute" target. That is how a module is loaded later
  by name: the root package's and ``dcmha.hub``'s lazy attributes, an ``Implementation``'s
  ``module``, and conformance's adapter targets (``runner.REFERENCE_TARGET``,
  ``IMPL_TARGET``, imported by ``runner.load_adapter`` in the worker process).

A module's own packages are no edge: Python imports them before the module, so naming
one adds no dependency. Entry points (``pyproject.toml``) are not edges either: the registry and conformance find the
modules they name at run time, which is how a higher layer registers with a lower one.
Names built at run time (``backend.current``'s module of the active Keras backend,
``backends.lazy_attributes``) are not seen; they stay inside one layer.

The folders are mapped onto ``dcmha`` as setup.py maps them (``ROOTS``). A cycle fails
with its path; an upward edge with the importing module, the line and the target.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The layers of the package, bottom first: a module may import its own layer and the
#: layers below it. A name covers its submodules; the root ``dcmha`` covers only its
#: ``__init__``.
LAYERS = [
    ("spec", ("dcmha.spec",),
     "the NumPy truth every implementation is checked against; imports no framework"),
    ("framework", ("dcmha.framework", "dcmha._keras_backend", "dcmha.allocator"),
     "the framework seam (what differs per Keras backend), the choice of the Keras "
     "backend and the C allocator's settings for a CPU process; fast paths provide their "
     "kernels to the seam instead of it importing them"),
    ("files", ("dcmha.checkpoints",),
     "readers of the official checkpoint files, NumPy only"),
    ("contract", ("dcmha.call", "dcmha.registry"),
     "the validated description of one attention call and the table of implementations, "
     "which loads them from their entry points, never by importing them"),
    ("core", ("dcmha.ops", "dcmha.partition"),
     "the plain keras.ops core, and the per-shard run under a device mesh that the fast "
     "paths share"),
    ("fast paths", ("dcmha.backends",),
     "registered implementations of the core's contract, each beside its reference; the "
     "layers reach them only through the registry"),
    ("layers", ("dcmha.layers", "dcmha.optimizers"),
     "Keras layers (and the optimizer) over the core"),
    ("models", ("dcmha.models", "dcmha.hub", "dcmha.distribution", "dcmha.engines"),
     "networks of the layers: DCFormerLM, its presets, keras-hub's classes, layouts over a "
     "device mesh, engine wrappers"),
    ("export", ("dcmha.export",),
     "ONNX graphs of the layers and models, with the compiled kernels as ONNX Runtime ops"),
    ("applications", ("dcmha", "dcmha.__main__", "dcmha.demo"),
     "the package root (its public names, loaded lazily) and the command lines"),
    ("conformance", ("dcmha.conformance",),
     "the suite that proves every implementation equal to the spec, through adapters"),
]

#: Upward edges that remain, {(module, target): reason}. Empty: every edge points down.
ALLOWED_UPWARD = {}

_IMPORT_FUNCTIONS = ("import_module", "__import__")


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


def _package_of(module, is_package):
    """The package a relative import of ``module`` starts from, as a list of names."""
    parts = module.split(".")
    return parts if is_package else parts[:-1]


def _resolve(module, is_package, name, level):
    """The absolute name of ``name`` imported with ``level`` leading dots by ``module``."""
    if not level:
        return name
    package = _package_of(module, is_package)
    base = package[:len(package) - level + 1]
    return ".".join(base + ([name] if name else []))


def _constant_string(node, module, is_package):
    """The value of a string expression built from constants, ``__name__`` and
    ``__package__`` (an f-string or a sum), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in ("__name__", "__package__"):
        return module if node.id == "__name__" else ".".join(_package_of(module, is_package))
    if isinstance(node, ast.JoinedStr):
        parts = [_constant_string(v.value if isinstance(v, ast.FormattedValue) else v,
                                  module, is_package) for v in node.values]
        return None if None in parts else "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _constant_string(node.left, module, is_package)
        right = _constant_string(node.right, module, is_package)
        return None if left is None or right is None else left + right
    return None


def _import_call(node, module, is_package):
    """The absolute module name an ``import_module("...")`` / ``__import__("...")`` call
    with a constant name imports, else None."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in _IMPORT_FUNCTIONS or not node.args:
        return None
    target = _constant_string(node.args[0], module, is_package)
    if target is None:
        return None
    if name == "import_module" and target.startswith("."):
        package = node.args[1] if len(node.args) > 1 else next(
            (k.value for k in node.keywords if k.arg == "package"), None)
        package = None if package is None else _constant_string(package, module, is_package)
        if package is None:
            return None
        level = len(target) - len(target.lstrip("."))
        return _resolve(package + ".x", False, target[level:], level)
    return target


def _named_module(value, modules):
    """The module a string names as data ("dcmha.x.y" or "dcmha.x.y:attribute"), or None
    (a plain "dcmha" is the Keras package name of the serialisable classes, not a load)."""
    name, _, attribute = value.partition(":")
    if "." not in name or name not in modules:
        return None
    if attribute and not all(p.isidentifier() for p in attribute.split(".")):
        return None
    return name


def edges_of(module, source, modules, is_package=False):
    """[(target, line)]: the package's modules that ``module`` imports (see the module
    docstring), in the order met. ``modules``: every module name of the package."""
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                    ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr)
                  and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        found = []
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source_name = _resolve(module, is_package, node.module, node.level)
            for alias in node.names:
                sub = f"{source_name}.{alias.name}"
                found.append(sub if sub in modules else source_name)
        elif isinstance(node, ast.Call):
            found = [_import_call(node, module, is_package)]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings):
            found = [_named_module(node.value, modules)]
        for target in found:
            # ``import a.b.c`` of a module that does not exist: its nearest package.
            while target and target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            # A module's own packages are imported before it runs: importing one adds no
            # dependency (``from dcmha.backends import pallas`` in pallas.core).
            if target in modules and not (module + ".").startswith(target + "."):
                out.append((target, node.lineno))
    return out


def graph_of(sources):
    """{module: {imported module: first line}} of ``sources`` ({module: (source text,
    is_package)})."""
    graph = {}
    for module, (source, is_package) in sources.items():
        edges = graph.setdefault(module, {})
        for target, line in sorted(edges_of(module, source, sources, is_package),
                                   key=lambda e: e[1]):
            edges.setdefault(target, line)
    return graph


def import_graph():
    """{module: {imported module: first line}} over the package's modules."""
    return graph_of({m: (p.read_text(), p.name == "__init__.py")
                     for m, p in _modules().items()})


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


def _covers(name, module):
    return module == name or (name != "dcmha" and module.startswith(name + "."))


def layer_of(module, layers=LAYERS):
    """(index, name) of the layer of ``module`` (its longest covering name), or None."""
    best = None
    for index, (layer, names, _) in enumerate(layers):
        for name in names:
            if _covers(name, module) and (best is None or len(name) > best[0]):
                best = (len(name), index, layer)
    return None if best is None else best[1:]


def upward_edges(graph, layers=LAYERS):
    """["module:line imports target (layer a below layer b)"] for every edge to a higher
    layer."""
    out = []
    for module, edges in sorted(graph.items()):
        own = layer_of(module, layers)
        for target, line in sorted(edges.items()):
            up = layer_of(target, layers)
            if own is not None and up is not None and up[0] > own[0]:
                out.append(f"{module}:{line} imports {target} (layer {own[1]!r} below "
                           f"layer {up[1]!r})")
    return out


# ---------------------------------------------------------------------------
# The graph sees every kind of import
# ---------------------------------------------------------------------------

def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "dcmha" in graph and "dcmha.spec.reference" in graph
    # A module-level and a function-level import are both edges.
    assert "dcmha.spec.reference" in graph["dcmha"]
    assert "dcmha.registry" in graph["dcmha.backends.xla"]
    # Conformance's adapters are loaded by their "module:attribute" targets.
    runner = graph["dcmha.conformance.runner"]
    assert {"dcmha.conformance.adapters.reference",
            "dcmha.conformance.adapters.keras_adapter"} <= set(runner)
    # The root's lazy public names are edges to the modules that define them.
    assert {"dcmha.layers", "dcmha.ops"} <= set(graph["dcmha"])


SYNTHETIC = {
    "dcmha": ("", True),
    "dcmha.spec": ("", True),
    "dcmha.spec.low": ("import importlib\n"
                       "def f():\n"
                       "    from dcmha.layers import Layer\n"
                       "def g():\n"
                       "    return importlib.import_module('dcmha.models')\n", False),
    "dcmha.spec.other": ("def h():\n"
                         "    __import__(f'dcmha.layers')\n"
                         "    from ..models import Model\n"
                         "    return 'dcmha.layers:Layer'\n", False),
    "dcmha.spec.sibling": ("from . import low\nimport dcmha.spec\n", False),
    "dcmha.layers": ("from dcmha.spec import low\n", True),
    "dcmha.models": ("\"\"\"dcmha.layers\"\"\"\nimport dcmha.layers.missing\n", False),
}
SYNTHETIC_LAYERS = [("spec", ("dcmha.spec",), ""), ("layers", ("dcmha.layers",), ""),
                    ("models", ("dcmha.models",), ""), ("root", ("dcmha",), "")]


def test_function_level_importlib_and_relative_imports_are_edges():
    graph = graph_of(SYNTHETIC)
    assert graph["dcmha.spec.low"] == {"dcmha.layers": 3, "dcmha.models": 5}
    assert graph["dcmha.spec.other"] == {"dcmha.layers": 2, "dcmha.models": 3}
    assert graph["dcmha.spec.sibling"] == {"dcmha.spec.low": 1}
    # A docstring naming a module is no edge; ``import a.b.c`` is an edge to a.b.
    assert graph["dcmha.models"] == {"dcmha.layers": 2}


def test_an_upward_import_fails_with_module_line_and_target():
    graph = graph_of(SYNTHETIC)
    assert upward_edges(graph, SYNTHETIC_LAYERS) == [
        "dcmha.spec.low:3 imports dcmha.layers (layer 'spec' below layer 'layers')",
        "dcmha.spec.low:5 imports dcmha.models (layer 'spec' below layer 'models')",
        "dcmha.spec.other:2 imports dcmha.layers (layer 'spec' below layer 'layers')",
        "dcmha.spec.other:3 imports dcmha.models (layer 'spec' below layer 'models')"]
    assert find_cycle(graph) == ["dcmha.layers", "dcmha.spec.low", "dcmha.layers"]


def test_find_cycle_reports_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None


# ---------------------------------------------------------------------------
# The package
# ---------------------------------------------------------------------------

def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle:
        pytest.fail("import cycle: " + _describe(cycle, graph))


def test_every_module_has_a_layer():
    assert [m for m in _modules() if layer_of(m) is None] == []
    names = [n for _, names, _ in LAYERS for n in names]
    assert len(names) == len(set(names))
    assert all(why for _, _, why in LAYERS)


def test_no_upward_import():
    graph = import_graph()
    allowed = {f"{m} -> {t}" for m, t in ALLOWED_UPWARD}
    found = [e for e in upward_edges(graph)
             if f"{e.split(':')[0]} -> {e.split(' imports ')[1].split(' ')[0]}" not in allowed]
    assert found == []


def test_the_seam_imports_only_the_spec_and_itself():
    graph = import_graph()
    seam = {m: sorted(t for t in edges if not _covers("dcmha.framework", t)
                      and not _covers("dcmha.spec", t))
            for m, edges in graph.items() if _covers("dcmha.framework", m)}
    assert {m: t for m, t in seam.items() if t} == {}


def test_fast_paths_do_not_import_the_distribution_or_the_layers():
    graph = import_graph()
    found = sorted(f"{m}:{line} imports {t}" for m, edges in graph.items()
                   if _covers("dcmha.backends", m) for t, line in edges.items()
                   if layer_of(t)[1] in ("layers", "models"))
    assert found == []


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
#: (``dcmha.framework``) or the registry, and names no Keras backend.
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
