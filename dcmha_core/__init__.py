"""dcmha: Dynamically Composable Multi-Head Attention for Keras 3.

Keras is imported lazily (on first use of ``dcmha.DCMHA``, ``dcmha.ops`` or
``dcmha.layers``), so that ``import dcmha.spec`` or ``dcmha.conformance`` does
not fix the Keras backend before a caller has chosen it.

Yet ``import dcmha`` alone makes every serialisable class (DCMHA, DCFormerLM,
...) known to ``keras.saving.load_model``: the modules defining them are
imported as soon as Keras is, at once when Keras is already imported, else
right after Keras's own import finishes (a one-shot import hook). Registration
imports nothing but Keras and this package, so no framework the active backend
does not need.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from dcmha.spec.reference import SPEC_VERSION

__version__ = "0.1.0"
_LAZY = {"DCMHA": "dcmha.layers", "DynamicWeightProjection": "dcmha.layers",
         "DCFormerLM": "dcmha.models", "DCFormerBlock": "dcmha.models",
         "SwiGLU": "dcmha.models", "RMSNorm": "dcmha.models",
         "from_official_state_dict": "dcmha.checkpoints",
         "ops": "dcmha.ops", "layers": "dcmha.layers", "models": "dcmha.models",
         "checkpoints": "dcmha.checkpoints", "distribution": "dcmha.distribution",
         "optimizers": "dcmha.optimizers"}
_MODULES = ("ops", "layers", "models", "checkpoints", "distribution", "optimizers")
__all__ = ["SPEC_VERSION", "__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if name in _MODULES else getattr(module, name)
    raise AttributeError(f"module 'dcmha' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


#: The modules whose import registers dcmha's Keras-serialisable classes.
_SERIALIZABLE_MODULES = ("dcmha.layers", "dcmha.models", "dcmha.optimizers")
_pending = False


def _dcmha_initializing() -> bool:
    """Whether one of our modules is part-way through its import (then importing the
    serialisable modules now could meet it half-defined: wait until it is done)."""
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False)
               for n, m in list(sys.modules.items()) if n.startswith("dcmha."))


def _register_serializables():
    global _pending
    if _dcmha_initializing():
        _pending = True                 # finished after the import in progress (the hook)
        return
    _pending = False
    try:
        for name in _SERIALIZABLE_MODULES:
            importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - never break the user's `import keras`
        warnings.warn(f"dcmha could not register its Keras classes ({type(err).__name__}: "
                      f"{err}); import dcmha.models before keras.saving.load_model.",
                      stacklevel=2)
    _HOOK.remove()


class _AfterLoader(importlib.abc.Loader):
    """A module's own loader, then the (pending) registration once the module is complete."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        spec = getattr(module, "__spec__", None)
        if spec is not None:
            spec._initializing = False  # complete now (importlib clears it right after)
        if module.__name__ == "keras" or _pending:
            _register_serializables()

    def __getattr__(self, name):     # get_resource_reader, get_data, ... of the real loader
        return getattr(self._inner, name)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Wraps the loaders of the first import of `keras` and of our modules, so that the
    registration runs once Keras is there and none of our modules is half-imported;
    removed once registration ran."""

    def __init__(self):
        self._busy = False

    def install(self):
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self):
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname, path=None, target=None):
        wanted = fullname == "keras" or fullname.startswith("dcmha.")
        if self._busy or not wanted:
            return None
        self._busy = True                # the search below must not see this finder
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterLoader(spec.loader)
        return spec


_HOOK = _ImportHook()
if "keras" in sys.modules:
    _register_serializables()
else:
    _HOOK.install()
