"""Pick a Keras backend for the command lines when the user configured none.

Keras fixes its backend when it is first imported: ``KERAS_BACKEND``, else the
``backend`` of ``keras.json`` (in ``$KERAS_HOME``, else ``~/.keras``), else
TensorFlow. On a fresh machine with only ``dcmha[jax]`` (or ``[torch]``)
installed that default is a framework that is not there, and the first Keras
import dies with ``ModuleNotFoundError: No module named 'tensorflow'``.

`ensure_keras_backend` runs before Keras is imported (every ``python -m dcmha``
command calls it first) and, when nothing usable is configured, sets
``KERAS_BACKEND`` to the first installed of jax, torch, tensorflow, saying so in
one line on stderr. It never imports a framework (``importlib.util.find_spec``
only) nor Keras, so this module is cheap to import.

A ``keras.json`` naming a framework that is not installed counts as not
configured: Keras writes that file itself on its first import with its own
default ("tensorflow"), even when ``KERAS_BACKEND`` chose another backend, so
its value is often not the user's choice. An explicit ``KERAS_BACKEND`` naming a
framework that is not installed is the user's choice and is refused with what
to install.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

#: Frameworks tried in this order when no backend is configured.
CANDIDATES = ("jax", "torch", "tensorflow")

NONE_INSTALLED = ('dcmha: no Keras backend is installed (none of jax, torch, tensorflow can be '
                  'imported). Install one, e.g. pip install "dcmha[jax]" (or "dcmha[torch]", '
                  '"dcmha[tensorflow]").')


def keras_config_path() -> str:
    """The keras.json Keras reads: ``$KERAS_HOME/keras.json``, else ``~/.keras/keras.json``
    (``/tmp/.keras`` when the home folder is not writable, as Keras does)."""
    if "KERAS_HOME" in os.environ:
        base = os.environ["KERAS_HOME"]
    else:
        home = os.path.expanduser("~")
        base = os.path.join(home if os.access(home, os.W_OK) else "/tmp", ".keras")
    return os.path.expanduser(os.path.join(base, "keras.json"))


def configured_backend():
    """(backend, source) as Keras would take it, or (None, None) when nothing configures one."""
    env = os.environ.get("KERAS_BACKEND")
    if env:                       # Keras ignores an empty KERAS_BACKEND
        return env, "KERAS_BACKEND"
    path = keras_config_path()
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return None, None         # missing or unreadable: Keras falls back to its default
    backend = config.get("backend") if isinstance(config, dict) else None
    if isinstance(backend, str) and backend:
        return backend, path
    return None, None


def installed(name: str) -> bool:
    """Whether the framework ``name`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def ensure_keras_backend(stream=None):
    """Make sure Keras will start on an installed backend; returns the backend name.

    Does nothing when Keras is already imported (its backend is fixed; returns
    None) or when the configured backend is installed (or is not one of
    jax / torch / tensorflow, e.g. "numpy"). Otherwise sets ``KERAS_BACKEND`` to
    the first installed of `CANDIDATES` and prints one line saying so to
    ``stream`` (default stderr). Raises SystemExit with what to install when
    ``KERAS_BACKEND`` names a framework that is not installed, or when none is.
    """
    if "keras" in sys.modules:
        return None
    stream = sys.stderr if stream is None else stream
    backend, source = configured_backend()
    if backend is not None and (backend not in CANDIDATES or installed(backend)):
        return backend
    if source == "KERAS_BACKEND":
        raise SystemExit(f"dcmha: KERAS_BACKEND={backend} but {backend} is not installed. "
                         f'Install it (pip install "dcmha[{backend}]") or unset KERAS_BACKEND '
                         "to use an installed backend.")
    for name in CANDIDATES:
        if installed(name):
            os.environ["KERAS_BACKEND"] = name
            reason = ("no Keras backend configured" if backend is None else
                      f"the Keras backend {backend!r} set in {source} is not installed")
            print(f"dcmha: {reason}; using {name} (set KERAS_BACKEND to choose).", file=stream)
            return name
    raise SystemExit(NONE_INSTALLED)
