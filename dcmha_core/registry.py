"""The registry of attention implementations, and how one is chosen for a call.

Every attention path, the plain ``keras.ops`` core included, is an
``Implementation``: a name, the Keras backend it runs on, the devices it runs
on, the capabilities it lacks and its preference rule, declared as data. The
built-in paths and third-party packages register the same way, through the
entry-point group ``dcmha.implementations`` (each entry point loads an
``Implementation``)::

    # pyproject.toml of a package "my_dcmha_path"
    [project.entry-points."dcmha.implementations"]
    mine = "my_dcmha_path:IMPLEMENTATION"

The implementation's ``module`` defines ``attention(call) -> (o, extras)`` and
may define ``preferred(call) -> bool`` (cheap, no building or compiling) and
``unsupported(call) -> None | str`` (checks that need the framework, such as a
kernel that must build; run last). ``call`` is the validated
``dcmha.call.AttentionCall``: implementations never re-check it.

Selection (``select``): a forced name runs, or a ValueError says why it
cannot; ``"auto"`` walks the active backend's implementations by ``priority``
and takes the first whose declared facts (device, capabilities, size
threshold, one-query calls only, graph calls only) and ``preferred`` accept the call and whose
``unsupported`` finds nothing, else ``"ops"``. Declared facts and preferences are
evaluated before anything is imported or built, so a small call never builds a kernel.
``explain(call)`` returns every candidate with the reason it was passed over;
``logging.getLogger("dcmha.dispatch")`` logs the choice at DEBUG level.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from dcmha import framework
from dcmha.spec import terms as spec_terms

__all__ = ["CAPABILITIES", "ENTRY_POINT_GROUP", "Implementation", "implementations", "get",
           "register", "unregister", "select", "explain", "resolve", "current_device",
           "load_errors"]

_log = logging.getLogger("dcmha.dispatch")

ENTRY_POINT_GROUP = "dcmha.implementations"

#: What a call may need that an implementation may lack (``AttentionCall.needs``):
#: attention_scores: ``return_attention_scores``; intermediates:
#: ``return_intermediates``; dropout: attention dropout in training; head_masks:
#: a per-head (B, N, T, S) mask; traced_offset: ``query_offset`` given as a
#: tensor; query_offset: a non-zero ``query_offset`` with a causal mask or
#: window (decoding); symbolic_shapes: sizes unknown when the call is traced.
CAPABILITIES = frozenset({"attention_scores", "intermediates", "dropout", "head_masks",
                          "traced_offset", "query_offset", "symbolic_shapes"})

_DEVICES = frozenset({"cpu", "gpu", "tpu"})
_BACKENDS = ("any", "jax", "torch", "tensorflow", "numpy")


@dataclass(frozen=True)
class Implementation:
    """A registered attention path (see the module docstring).

    Args:
        name: the value of ``implementation=`` that forces it.
        backend: the Keras backend it runs on ("jax", "torch", "tensorflow",
            "numpy"), or "any".
        module: the module that holds ``attention(call)`` (imported on first use).
        devices: where it runs: a subset of {"cpu", "gpu", "tpu"}.
        auto_devices: where ``"auto"`` may take it (a subset of ``devices``).
        lacks: the capabilities (``CAPABILITIES``) it does not have.
        terms: the compose terms it computes (names of
            ``dcmha.spec.terms.COMPOSE_TERMS``); default: the spec's first set,
            ``BASE_TERMS``, so that a term added to the spec later is refused on
            an implementation until it declares it.
        priority: ``"auto"`` tries higher priorities first.
        min_length_product: ``"auto"`` takes it only when T * S is known and at
            least this (0: no threshold): below it the plain core is as fast.
        cpu_env: environment variables a process must set before importing the
            framework to run it on a CPU (e.g. Triton's interpreter), {} if none.
        one_query_only: it computes one-query calls (T = 1, a decoding step) itself
            and runs every other call through the plain core (``dcmha.ops``);
            ``"auto"`` takes it for one-query calls only.
        graph_only: ``"auto"`` takes it only for calls traced into a graph with their
            lengths known (``dcmha.framework.building_graph()``: TensorFlow's
            ``tf.function``); an eager call would pay its per-shape compile.
        description: one line for tables and error messages.
    """

    name: str
    backend: str
    module: str
    devices: frozenset = frozenset({"cpu", "gpu"})
    auto_devices: frozenset = frozenset()
    lacks: frozenset = frozenset()
    terms: frozenset = spec_terms.BASE_TERMS
    priority: int = 0
    min_length_product: int = 0
    cpu_env: Mapping[str, str] = field(default_factory=dict)
    one_query_only: bool = False
    graph_only: bool = False
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or self.name == "auto":
            raise ValueError(f"`name` must be a non-empty string other than 'auto'. "
                             f"Received: name={self.name!r}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"`backend` of implementation {self.name!r} must be one of "
                             f"{list(_BACKENDS)}. Received: backend={self.backend!r}")
        if not isinstance(self.module, str) or not self.module:
            raise ValueError(f"`module` of implementation {self.name!r} must be a module name. "
                             f"Received: module={self.module!r}")
        for attr in ("priority", "min_length_product"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or (
                    attr == "min_length_product" and value < 0):
                what = "an integer" if attr == "priority" else "a non-negative integer"
                raise ValueError(f"`{attr}` of implementation {self.name!r} must be {what}. "
                                 f"Received: {attr}={value!r}")
        for attr in ("one_query_only", "graph_only"):
            value = getattr(self, attr)
            if not isinstance(value, bool):
                raise ValueError(f"`{attr}` of implementation {self.name!r} must be a bool. "
                                 f"Received: {attr}={value!r}")
        if not isinstance(self.cpu_env, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.cpu_env.items()):
            raise ValueError(f"`cpu_env` of implementation {self.name!r} must map variable names "
                             f"to strings. Received: cpu_env={self.cpu_env!r}")
        for attr, allowed in (("devices", _DEVICES), ("auto_devices", self.devices),
                              ("lacks", CAPABILITIES),
                              ("terms", frozenset(spec_terms.TERM_NAMES))):
            value = frozenset(getattr(self, attr))
            if not value <= allowed:
                raise ValueError(f"`{attr}` of implementation {self.name!r} must be a subset of "
                                 f"{sorted(allowed)}. Received: {sorted(value)}")
            object.__setattr__(self, attr, value)

    def load(self):
        """The implementation's module."""
        return importlib.import_module(self.module)

    def runs_on(self, backend: str) -> bool:
        return self.backend in ("any", backend)


# ---------------------------------------------------------------------------
# The table: entry points, loaded once, plus in-process registrations
# ---------------------------------------------------------------------------

_lock = threading.Lock()
_table: Optional[Dict[str, Implementation]] = None
_extra: Dict[str, Implementation] = {}
_errors: Dict[str, str] = {}


def _entry_points():
    from importlib.metadata import entry_points
    return entry_points(group=ENTRY_POINT_GROUP)


def _load_table() -> Dict[str, Implementation]:
    table: Dict[str, Implementation] = {}
    _errors.clear()
    for ep in sorted(_entry_points(), key=lambda e: (e.value.startswith("dcmha."), e.name),
                     reverse=True):
        # dcmha's own entry points first, so that another package cannot shadow them.
        try:
            impl = ep.load()
        except Exception as e:   # a broken third-party package must not break dcmha
            _errors[ep.name] = f"{type(e).__name__}: {e}"
            warnings.warn(f"dcmha: the implementation entry point {ep.name!r} ({ep.value}) "
                          f"could not be loaded: {e}", RuntimeWarning, stacklevel=3)
            continue
        if not isinstance(impl, Implementation) or impl.name != ep.name:
            _errors[ep.name] = (f"entry point {ep.value} must load a dcmha.registry."
                                f"Implementation named {ep.name!r}; got {impl!r}")
            warnings.warn(f"dcmha: {_errors[ep.name]}", RuntimeWarning, stacklevel=3)
            continue
        if impl.name in table:
            _errors[ep.name] = f"{ep.value} repeats the name {impl.name!r}; ignored"
            warnings.warn(f"dcmha: {_errors[ep.name]}", RuntimeWarning, stacklevel=3)
            continue
        table[impl.name] = impl
    return table


def implementations() -> Dict[str, Implementation]:
    """{name: Implementation}: every registered implementation."""
    global _table
    with _lock:
        if _table is None:
            _table = _load_table()
        return {**_table, **_extra}


def load_errors() -> Dict[str, str]:
    """Entry points that failed to load: {name: reason}."""
    implementations()
    return dict(_errors)


def get(name: str) -> Implementation:
    """The implementation named ``name`` (KeyError if none)."""
    return implementations()[name]


def register(impl: Implementation, *, replace: bool = False) -> Implementation:
    """Register ``impl`` in this process (tests, notebooks; packages use the entry point)."""
    if not isinstance(impl, Implementation):
        raise TypeError(f"`impl` must be a dcmha.registry.Implementation. Received: {impl!r}")
    if impl.name in implementations() and not replace:
        raise ValueError(f"An implementation named {impl.name!r} is already registered; pass "
                         "replace=True to replace it.")
    _extra[impl.name] = impl
    return impl


def unregister(name: str) -> None:
    """Remove an implementation registered with ``register``."""
    _extra.pop(name, None)


def resolve(implementation) -> str:
    """Validate an ``implementation`` value: "auto" or a registered name."""
    known = ("auto",) + tuple(sorted(implementations()))
    if not isinstance(implementation, str) or implementation not in known:
        raise ValueError(f"`implementation` must be one of {list(known)}. "
                         f"Received: implementation={implementation!r}")
    return implementation


# ---------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------

def current_device(call) -> str:
    """Where the call runs: "cpu", "gpu" or "tpu" (the framework seam's ``device`` of q)."""
    return framework.device(call.q)


def _env_set(name: str, value: str) -> bool:
    """Whether the environment has ``name=value`` ("1" also matches true/on/yes)."""
    got = os.environ.get(name, "").lower()
    return got == value.lower() or (value == "1" and got in ("1", "true", "on", "yes"))


def _device_problem(impl: Implementation, device: str) -> Optional[str]:
    if device in impl.devices:
        return None
    if device == "cpu" and impl.cpu_env and all(_env_set(k, v) for k, v in impl.cpu_env.items()):
        return None
    how = "" if not impl.cpu_env else " (on CPU set " + ", ".join(
        f"{k}={v}" for k, v in impl.cpu_env.items()) + " before the framework is imported)"
    return f"runs on {'/'.join(sorted(impl.devices))}, not on {device}{how}"


def _lacks_problem(impl: Implementation, call) -> Optional[str]:
    unknown = sorted(call.terms - impl.terms)
    if unknown:
        return (f"the call uses the compose term{'s' * (len(unknown) > 1)} {unknown}, which it "
                f"does not compute (it declares {sorted(impl.terms)})")
    missing = sorted(call.needs & impl.lacks)
    if not missing:
        return None
    return "the call needs " + "; ".join(_NEED_TEXT[m](call) for m in missing)


_NEED_TEXT: Dict[str, Callable] = {
    "attention_scores": lambda c: "the attention scores (return_attention_scores=True), "
                                  "which it does not return",
    "intermediates": lambda c: "the intermediates (return_intermediates=True), which it never "
                               "materialises",
    "dropout": lambda c: f"attention dropout (dropout_rate={c.dropout_rate} in training), "
                         "which it does not do",
    "head_masks": lambda c: "a per-head (B, N, T, S) attention mask, which it does not take",
    "traced_offset": lambda c: "a query_offset that is a tensor (e.g. a cache_update_index "
                               "inside a traced function), which it takes only as an int",
    "query_offset": lambda c: f"query_offset={c.static_offset} with a causal mask or window, "
                              "which it does not take",
    "symbolic_shapes": lambda c: "static sizes, which are unknown in this traced call",
}


def _module_problem(impl: Implementation, module, call, *, auto: bool) -> Optional[str]:
    if auto:
        preferred = getattr(module, "preferred", None)
        if preferred is not None and not preferred(call):
            return "not preferred for this call"
    unsupported = getattr(module, "unsupported", None)
    return None if unsupported is None else unsupported(call)


def _candidates(backend: str) -> List[Implementation]:
    impls = [i for i in implementations().values() if i.runs_on(backend) and i.name != "ops"]
    return sorted(impls, key=lambda i: (-i.priority, i.name))


def _auto_problem(impl: Implementation, call, device: str) -> Tuple[Optional[str], object]:
    """Why "auto" passes over ``impl`` for ``call`` (None: it takes it), and its module."""
    if device not in impl.auto_devices:
        return f"'auto' takes it on {'/'.join(sorted(impl.auto_devices)) or 'no device'}, " \
               f"not on {device}", None
    problem = _lacks_problem(impl, call)
    if problem:
        return problem, None
    if impl.one_query_only and call.T != 1:
        return f"'auto' takes it for one-query calls (T = 1); this call has T = {call.T}", None
    if impl.graph_only and not framework.building_graph():
        return "'auto' takes it for calls traced into a graph; this call runs eagerly", None
    if impl.graph_only and None in (call.T, call.S):
        return (f"'auto' takes it for calls whose lengths are known; this call has "
                f"T = {call.T}, S = {call.S}"), None
    if impl.min_length_product and (call.length_product is None
                                    or call.length_product < impl.min_length_product):
        return (f"'auto' takes it from T * S >= {impl.min_length_product}; this call has "
                f"T * S = {call.length_product}"), None
    try:
        module = impl.load()
    except ImportError as e:
        return f"cannot be imported: {e}", None
    return _module_problem(impl, module, call, auto=True), module


def explain(call) -> List[Tuple[str, Optional[str]]]:
    """[(name, reason)] for "auto" on ``call``, in the order tried: the reason each
    candidate was passed over, None for the one taken (the last row is "ops" when
    no fast path takes the call)."""
    import keras
    backend = keras.backend.backend()
    device = current_device(call)
    rows = []
    for impl in _candidates(backend):
        problem, _ = _auto_problem(impl, call, device)
        rows.append((impl.name, problem))
        if problem is None:
            return rows
    rows.append(("ops", None))
    return rows


def _plain(table) -> Callable:
    """The plain core's ``attention``: the implementation "ops", registered by its entry
    point like every other path."""
    if "ops" not in table:
        raise RuntimeError(f"The entry point 'ops' of {ENTRY_POINT_GROUP!r} is missing: the "
                           "installed metadata is not this dcmha's. Reinstall dcmha "
                           "(pip install -e . in a checkout).")
    return table["ops"].load().attention


def select(implementation: str, call) -> Tuple[str, Callable]:
    """(name, attention function) for ``call`` (a ``dcmha.call.AttentionCall``).

    "auto" takes the first fast path of the active Keras backend that accepts the
    call (see the module docstring), else "ops". A name runs that implementation,
    or a ValueError says why it cannot. Shape inference on torch (meta tensors)
    always runs "ops".
    """
    import keras
    resolve(implementation)
    backend = keras.backend.backend()
    table = implementations()
    if backend == "torch" and getattr(getattr(call.q, "device", None), "type", None) == "meta":
        return "ops", _plain(table)
    if implementation == "auto":
        device = current_device(call)
        for impl in _candidates(backend):
            problem, module = _auto_problem(impl, call, device)
            if problem is None:
                _log.debug("dcmha: 'auto' takes %r", impl.name)
                return impl.name, module.attention
            _log.debug("dcmha: 'auto' passes over %r: %s", impl.name, problem)
        return "ops", _plain(table)
    impl = table[implementation]
    if not impl.runs_on(backend):
        raise ValueError(f"`implementation={implementation!r}` runs on the {impl.backend!r} "
                         f"Keras backend. Received: the active Keras backend is {backend!r}")
    problem = _device_problem(impl, current_device(call)) or _lacks_problem(impl, call)
    module = None
    if problem is None:
        try:
            module = impl.load()
        except ImportError as e:
            raise ValueError(f"`implementation={implementation!r}` is not available here: "
                             f"{e}") from None
        problem = _module_problem(impl, module, call, auto=False)
    if problem is not None:
        raise ValueError(f"`implementation={implementation!r}` cannot run this call: {problem}")
    return implementation, module.attention


# The framework seam reads what fast paths provide (``dcmha.framework.provide``); the table's
# first load imports their packages, which provide it: the seam's first lookup runs it.
framework.set_finder(implementations)
