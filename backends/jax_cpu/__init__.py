"""Blocked DCMHA attention for JAX on CPU, its composes run by the compiled C kernel.

Importing this package does not import JAX: the module ``dcmha_jax_cpu`` loads
on first use of one of its names. See ``dcmha_jax_cpu`` for the API and
``keras_core`` for the Keras fast path (``DCMHA(implementation="jax_cpu")``).
"""

import importlib.util

__all__ = ["dcmha_attention", "dcmha_attention_reference", "is_available"]


def is_available() -> bool:
    """True when JAX is installed (whether the kernel builds: ``dcmha_jax_cpu.load()``)."""
    return importlib.util.find_spec("jax") is not None


def __getattr__(name):
    if name in ("dcmha_attention", "dcmha_attention_reference"):
        from . import dcmha_jax_cpu
        return getattr(dcmha_jax_cpu, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
