"""The dcmha compose kernel inside onnxruntime: the custom-op library for ``Compose*`` nodes
(and ``Probs*``, a causal block's compose, softmax and compose; ``QueryMatrix*``, a stage's
per-query matrix; ``Rope*``, the query and key heads' rotation; ``CacheHeads*``, a decode
step's cache reads).

A graph exported with ``compose_nodes=True`` writes each compose as one ``dcmha.Compose*``
node (``ComposeQ`` ... ``ComposeQKD``: which terms it has). Each is also a model-local
function with a plain-op body, so any ONNX runtime runs the graph; an onnxruntime session
that registers this library runs the compiled compose kernel (``backends/csrc/compose.c``,
the one behind the ``jax_cpu`` / ``tf_cpu`` / torch CPU cores) instead.

``library_path()`` builds the library on first use with the system C/C++ compilers and
caches it (``dcmha.backends.cpu_kernel``: the same cache, checks and ``DCMHA_CPU_KERNEL=0``
switch); ``register(session_options)`` registers it. ``dcmha.export.session`` does both.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional, Tuple

from dcmha.export.op_names import KERNEL_OPS as OP_NAMES   # the ops the library must define

_LOCK = threading.Lock()
_STATE: dict = {}


def library() -> Tuple[Optional[str], Optional[str]]:
    """(path of the verified custom-op library, None), or (None, why it is unavailable)."""
    with _LOCK:
        if "path" not in _STATE:
            import onnxruntime

            from dcmha.backends import cpu_kernel
            recipe = cpu_kernel.ort_recipe(onnxruntime.__version__)
            lib, why = cpu_kernel.build_library(recipe)
            path = None
            if lib is not None:
                names = lib.dcmha_ort_op_names
                names.restype = ctypes.c_char_p
                found = tuple((names() or b"").decode("ascii").split())
                if found == OP_NAMES:
                    path = lib._name
                else:      # refused like any other unusable library: one KernelWarning
                    _, why = cpu_kernel.fallback(recipe.tag, f"the library {lib._name} defines "
                                                 f"the ops {found}, expected {OP_NAMES}",
                                                 recipe.instead)
            _STATE["path"], _STATE["why"] = path, why
        return _STATE["path"], _STATE["why"]


def library_path() -> Optional[str]:
    """The custom-op library's path, or None (``unavailable_reason`` says why)."""
    return library()[0]


def unavailable_reason() -> Optional[str]:
    """Why ``library_path()`` is None (None when the library is available)."""
    return library()[1]


def register(session_options) -> bool:
    """Register the custom-op library in an ``onnxruntime.SessionOptions``; False (the
    sessions then run the ``Compose*`` nodes' plain-op bodies) when it is unavailable."""
    path = library_path()
    if path is None:
        return False
    session_options.register_custom_ops_library(path)
    return True


def _reset() -> None:
    """Forget the library found (tests)."""
    with _LOCK:
        _STATE.clear()
