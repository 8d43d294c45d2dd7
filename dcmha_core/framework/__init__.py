"""The framework seam: everything dcmha's shared code (``dcmha.layers``, ``dcmha.ops``,
``dcmha.models``, ``dcmha.demo``) needs that depends on the active Keras backend.

One module per Keras backend (``jax``, ``torch``, ``tensorflow``, ``numpy``), chosen once,
on first use, from ``keras.backend.backend()``, as Keras keeps its own in
``keras/src/backend/<name>/``; a backend without a module here gets the defaults of
``_common`` (plain ``keras.ops``). Shared code reads the chosen module's names through
this package (``from dcmha import framework; framework.readable_value(x)``) and never
compares backend names. ``_common`` lists every name with its default and contract. The
first name read binds all of them to this package, as Keras's ``keras.src.backend`` does
at import, so later reads are plain attribute lookups.

The seam is the package's lowest layer but the spec: it imports nothing of dcmha above
it. What it needs from above is handed to it:

* A fast path (``dcmha.backends``) hands the seam its speed tricks for one Keras backend
  with ``provide(keras_backend, name, load)`` when its package is imported (e.g. eager
  PyTorch's step kernel of the dynamic weights, from ``backends/torch_native``); the
  backend's module here reads them with ``provided(keras_backend, name)``.
* The registry (``dcmha.registry``), which imports the fast paths' packages from their
  entry points, hands the seam that import with ``set_finder``: the first ``provided``
  runs it, so a fast path has registered before its first possible use, whichever call
  comes first.

``device(x)`` is the one device probe ("cpu", "gpu" or "tpu"); the plain core's block
size and the registry's ``current_device`` read it.
"""

import importlib
import threading

_chosen = None


def current():
    """The module of the active Keras backend (imported once)."""
    global _chosen
    if _chosen is None:
        import keras
        name = f"{__name__}.{keras.backend.backend()}"
        try:
            _chosen = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            _chosen = importlib.import_module(f"{__name__}._common")
    return _chosen


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    module = current()
    value = getattr(module, name)            # AttributeError: not a name of the seam
    from dcmha.framework import _common
    g = globals()
    for n in _common.__all__:                # bind the seam's names once
        g.setdefault(n, getattr(module, n))
    return value


# ---------------------------------------------------------------------------
# What fast paths hand the seam
# ---------------------------------------------------------------------------

#: The names a fast path may provide, with the contract of each (the seam's functions
#: that read them say when they are taken).
PROVIDED_NAMES = {
    "step_dynamic_weights": "(x, dw1, qkw, dd, *, C, rank, gelu_approximate, eps, "
                            "weight_scale=1.0) -> ``plain_dynamic_weights``' arrays of the "
                            "weights times weight_scale, stacked or split into C slots, or "
                            "None where it does not run",
    "fused_query_projection": "(x, kernel, bias, dw1, qkw, dd, *, C, rank, "
                              "gelu_approximate, eps) -> (the query projection, the "
                              "stacked dynamic weights), or None where it does not run",
    "prepare_onnx_export": "() -> None: whatever the framework's ONNX exporter needs first",
}

_lock = threading.Lock()
_find_lock = threading.Lock()
_loaders = {}     # (keras backend, name) -> load() -> the function
_loaded = {}      # (keras backend, name) -> the function, or None (its load failed)
_finder = None    # imports the packages that call ``provide``; run before the first lookup
_once = {}        # the seams' copy of ``_loaded`` (``_common.provided_once``), emptied with it


def provide(keras_backend, name, load):
    """Hand the seam the function ``name`` (one of ``PROVIDED_NAMES``) for the Keras
    backend ``keras_backend``: ``load()`` returns it, and is called on its first use
    (so that registering imports no framework). A later ``provide`` replaces it."""
    if name not in PROVIDED_NAMES:
        raise ValueError(f"`name` must be one of {sorted(PROVIDED_NAMES)}. "
                         f"Received: name={name!r}")
    if not callable(load):
        raise TypeError(f"`load` must be callable. Received: load={load!r}")
    with _lock:
        _loaders[(keras_backend, name)] = load
        _loaded.pop((keras_backend, name), None)
        _once.clear()


def set_finder(find):
    """``find()`` imports every package that calls ``provide`` (the registry's entry
    points); the first ``provided`` runs it, once. None removes it."""
    global _finder
    if find is not None and not callable(find):
        raise TypeError(f"`find` must be callable or None. Received: find={find!r}")
    with _lock:
        _finder = find
        for key in [k for k, fn in _loaded.items() if fn is None]:
            del _loaded[key]          # looked up before: look again, after ``find``
        _once.clear()


def provided(keras_backend, name):
    """The function ``name`` a fast path provided for ``keras_backend``, or None (none
    registered, or its ``load`` raised ImportError)."""
    key = (keras_backend, name)
    try:
        return _loaded[key]
    except KeyError:
        pass
    _find()
    load = _loaders.get(key)
    try:
        fn = None if load is None else load()
    except ImportError:
        fn = None
    _loaded[key] = fn
    return fn


def _find():
    """Run the finder once (other threads wait until it has run)."""
    global _finder
    with _find_lock:
        find, _finder = _finder, None
        if find is not None:
            find()
