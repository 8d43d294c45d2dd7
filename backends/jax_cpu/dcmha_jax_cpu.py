"""DCMHA attention for JAX on CPU: the blocked core of ``dcmha.backends.cpu_blocks`` with
its composes run by the compiled C kernel of ``dcmha.backends.cpu_kernel`` through the XLA
FFI (``jax.ffi``), as a ``jax.custom_vjp`` whose backward is the kernel's backward.

``load()`` builds the kernel with its FFI handlers on first use (C and C++ compilers needed;
cached and verified as ``cpu_kernel`` describes, keyed by jaxlib's version) and registers
them as ``jax.ffi`` targets. ``dcmha_attention`` is the fast function,
``dcmha_attention_reference`` the plain one beside it (``cpu_blocks.reference``: no blocks,
no kernel). Both run on the Keras jax backend (they are written in ``keras.ops``).
"""

from __future__ import annotations

import functools

import numpy as np

import jax
import jax.numpy as jnp
import jaxlib

from dcmha import ops as dops

from .. import cpu_blocks, cpu_kernel

__all__ = ["dcmha_attention", "dcmha_attention_reference", "decode_compose", "load",
           "unavailable_reason"]

_FORWARD, _BACKWARD = "dcmha_compose_forward", "dcmha_compose_backward"
_CACHED = "dcmha_compose_cached"


def _recipe():
    """The FFI library's recipe: its cache key carries jaxlib's version and FFI headers."""
    return cpu_kernel.ffi_recipe(jax.ffi.include_dir(), jaxlib.__version__)


def _build():
    """(True, None) once the FFI kernel is built and registered, else (None, reason)."""
    lib, reason = cpu_kernel.build_library(_recipe())
    if lib is None:
        return None, reason
    try:
        jax.ffi.register_ffi_target(_FORWARD, jax.ffi.pycapsule(lib.DcmhaComposeForward),
                                    platform="cpu")
        jax.ffi.register_ffi_target(_BACKWARD, jax.ffi.pycapsule(lib.DcmhaComposeBackward),
                                    platform="cpu")
        jax.ffi.register_ffi_target(_CACHED, jax.ffi.pycapsule(lib.DcmhaComposeCached),
                                    platform="cpu")
    except Exception as e:      # noqa: BLE001 - any registration failure
        return cpu_kernel.fallback("compose_xla_ffi", f"registering the FFI targets failed: {e}")
    return True, None


# ---------------------------------------------------------------------------
# The compose kernel as a differentiable JAX function
# ---------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _compose(x, wq, kw1, kw2, kdd, flags):
    """Compose of a block x (B, G, M, t, s); terms as in ``csrc/compose_wrap.h``."""
    return jax.ffi.ffi_call(_FORWARD, jax.ShapeDtypeStruct(x.shape, jnp.float32),
                            vmap_method="sequential")(x, wq, kw1, kw2, kdd,
                                                      flags=np.int64(flags))


def _compose_fwd(x, wq, kw1, kw2, kdd, flags):
    return _compose(x, wq, kw1, kw2, kdd, flags), (x, wq, kw1, kw2, kdd)


def _compose_bwd(flags, res, g):
    shapes = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in res]
    x, wq, kw1, kw2, kdd = res
    return tuple(jax.ffi.ffi_call(_BACKWARD, shapes, vmap_method="sequential")(
        x, g, wq, kw1, kw2, kdd, flags=np.int64(flags)))


_compose.defvjp(_compose_fwd, _compose_bwd)


# ---------------------------------------------------------------------------
# One query's compose with the key-side terms read from the decode cache
# ---------------------------------------------------------------------------

def _cached_ffi(x, terms, M):
    """``dcmha.ops.decode_compose``'s arithmetic by the kernel (``DcmhaComposeCached``): x
    (B, G, M, S); the spec's terms as they are, absent ones as 1-element dummies."""
    B, G, _, S = x.shape
    dummy = jnp.zeros((1,), jnp.float32)
    ins = [jnp.reshape(x, (B, G, M, 1, S))] + [
        terms[n].astype(jnp.float32) if n in terms else dummy for n in cpu_kernel.CACHED_TERMS]
    out = jax.ffi.ffi_call(_CACHED, jax.ShapeDtypeStruct((B, G, M, 1, S), jnp.float32),
                           vmap_method="sequential")(
        *ins, flags=np.int64(cpu_kernel.cached_flags(terms)))
    return jnp.reshape(out, (B, G, M, S))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _decode_compose(x, terms, M):
    return _cached_ffi(x, terms, M)


def _decode_compose_fwd(x, terms, M):
    return _cached_ffi(x, terms, M), (x, terms)


def _decode_compose_bwd(M, res, g):
    # the gradient of the plain form (decoding steps are rarely differentiated)
    _, vjp = jax.vjp(lambda x, terms: dops.decode_compose(x, terms, M), *res)
    return vjp(g)


_decode_compose.defvjp(_decode_compose_fwd, _decode_compose_bwd)


def decode_compose(x, terms, M):
    """``dcmha.ops.decode_compose`` (one query: x (B, G, M, S) float32, the key-side terms
    in the cache's (B, S, G, ...) layout) by the compiled kernel, for the terms of
    ``dcmha.ops.LOW_RANK_TERMS``; other terms, or no kernel, take the plain form. Its
    gradient is the plain form's."""
    if not terms.keys() <= dops.LOW_RANK_TERMS or not load():
        return dops.decode_compose(x, terms, M)
    return _decode_compose(x, dict(terms), M)


_PATH = cpu_blocks.KernelPath(_build, lambda _: _compose)
#: load() -> bool, unavailable_reason() -> str or None, and
#: dcmha_attention(q, k, v, **kwargs): ``cpu_blocks.attention`` with this kernel.
load, unavailable_reason, dcmha_attention = _PATH.load, _PATH.unavailable_reason, _PATH.attention
#: The plain function beside the kernel (no blocks, no kernel; materialising).
dcmha_attention_reference = cpu_blocks.reference
