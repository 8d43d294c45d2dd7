"""The backend seam: everything dcmha's shared code (``dcmha.layers``, ``dcmha.ops``,
``dcmha.models``, ``dcmha.demo``) needs that depends on the active Keras backend.

One module per Keras backend (``jax``, ``torch``, ``tensorflow``, ``numpy``), chosen once,
on first use, from ``keras.backend.backend()``, as Keras keeps its own in
``keras/src/backend/<name>/``; a backend without a module here gets the defaults of
``_common`` (plain ``keras.ops``). Shared code reads the chosen module's names through
this package (``from dcmha import backend as seam; seam.readable_value(x)``) and never
compares backend names. ``_common`` lists every name with its default and contract.

A backend's speed tricks (compiled kernels, eager PyTorch shortcuts) live in its own
folder under ``dcmha.backends`` and are reached from its module here or through the
registry (``dcmha.registry``).
"""

import importlib

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
    return getattr(current(), name)
