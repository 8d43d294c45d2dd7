"""DCMHA attention for JAX on CPU: the blocked core of ``dcmha.backends.cpu_blocks`` with
each block's compose, masked softmax and compose, and each stage's query factor, run by the
compiled C kernel of ``dcmha.backends.cpu_kernel`` through the XLA FFI (``jax.ffi``), each a
``jax.custom_vjp`` whose backward is the kernel's backward.

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
from dcmha.spec import terms as spec_terms

from .. import cpu_blocks, cpu_kernel

__all__ = ["dcmha_attention", "dcmha_attention_reference", "decode_probs", "load",
           "unavailable_reason"]

_FORWARD, _BACKWARD = "dcmha_compose_forward", "dcmha_compose_backward"
_PROBS = "dcmha_decode_probs"
_BLOCK_FORWARD, _BLOCK_BACKWARD = "dcmha_block_probs_forward", "dcmha_block_probs_backward"
_QUERY, _QUERY_BACKWARD = "dcmha_query_matrix", "dcmha_query_matrix_backward"
_DUMMY = np.zeros((1,), np.float32)
_QUERY_TERMS = cpu_blocks.QUERY_TERMS


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
        jax.ffi.register_ffi_target(_PROBS, jax.ffi.pycapsule(lib.DcmhaDecodeProbs),
                                    platform="cpu")
        jax.ffi.register_ffi_target(_QUERY, jax.ffi.pycapsule(lib.DcmhaQueryMatrix),
                                    platform="cpu")
        jax.ffi.register_ffi_target(_QUERY_BACKWARD,
                                    jax.ffi.pycapsule(lib.DcmhaQueryMatrixBackward), platform="cpu")
        jax.ffi.register_ffi_target(_BLOCK_FORWARD,
                                    jax.ffi.pycapsule(lib.DcmhaBlockProbsForward), platform="cpu")
        jax.ffi.register_ffi_target(_BLOCK_BACKWARD,
                                    jax.ffi.pycapsule(lib.DcmhaBlockProbsBackward), platform="cpu")
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
# A stage's query factor from its query-side terms
# ---------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _query_ffi(qw1, qw2, qdd, static, flags, shape):
    """``cpu_blocks.attention``'s ``query_matrix``: a stage's query factor as one kernel call
    each way (``DcmhaQueryMatrix``)."""
    return jax.ffi.ffi_call(_QUERY, jax.ShapeDtypeStruct(shape, jnp.float32))(
        qw1, qw2, qdd, static, flags=np.int64(flags))


def _query_ffi_fwd(qw1, qw2, qdd, static, flags, shape):
    return _query_ffi(qw1, qw2, qdd, static, flags, shape), (qw1, qw2, qdd, static)


def _query_ffi_bwd(flags, shape, res, g):
    shapes = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in res]
    return tuple(jax.ffi.ffi_call(_QUERY_BACKWARD, shapes)(*res, g, flags=np.int64(flags)))


_query_ffi.defvjp(_query_ffi_fwd, _query_ffi_bwd)


# ---------------------------------------------------------------------------
# A training block's composes, mask and softmax in one call each way
# ---------------------------------------------------------------------------

def _block_attrs(vis, flags):
    return cpu_blocks.block_attrs(vis, *flags, integer=np.int64, real=np.float32)


def _vis_operand(vis):
    return np.ones(cpu_blocks.NO_VIS_SHAPE, bool) if vis is None else vis


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _block_probs(x, pre, post, vis, flags):
    return _block_probs_fwd(x, pre, post, vis, flags)[0]


def _block_probs_fwd(x, pre, post, vis, flags):
    out, p = jax.ffi.ffi_call(_BLOCK_FORWARD, (jax.ShapeDtypeStruct(x.shape, jnp.float32),) * 2,
                              vmap_method="sequential")(
        x, *pre, *post, _vis_operand(vis), **_block_attrs(vis, flags))
    return out, (x, p, pre, post, vis)


def _block_probs_bwd(flags, res, g):
    x, p, pre, post, vis = res
    shapes = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (x, *pre, *post)]
    dx, *grads = jax.ffi.ffi_call(_BLOCK_BACKWARD, shapes, vmap_method="sequential")(
        x, p, g, *pre, *post, _vis_operand(vis), **_block_attrs(vis, flags))
    return dx, tuple(grads[:4]), tuple(grads[4:]), None


_block_probs.defvjp(_block_probs_fwd, _block_probs_bwd)


def _probs(x, pre, post, vis, pre_flags, post_flags):
    """``cpu_blocks.attention``'s ``probs``: a block's compose, masked softmax and compose
    (``DcmhaBlockProbsForward``), differentiable by the kernel's backward."""
    return _block_probs(x, tuple(pre), tuple(post), vis, (int(pre_flags), int(post_flags)))


# ---------------------------------------------------------------------------
# One query's composes and masked softmax, the key-side terms read from the decode cache
# ---------------------------------------------------------------------------



def _stacked(stages, names):
    """The stages' key-side terms ``names``, those present, stacked on a new axis 2 in the
    decode cache's order (the pre stage's, then the post stage's); a dummy when none. Where
    the terms are the slices of one cache entry in this order (``spec.terms.KEY_CACHE``),
    XLA folds the stack back into the entry, so the kernel reads the cache in place."""
    parts = [st[n].astype(jnp.float32) for st in stages for n in names if n in st]
    return jnp.stack(parts, 2) if parts else _DUMMY


def _probs_ffi(x, mask, pre, post, M):
    """``dcmha.ops.one_query_probs`` by the kernel (``DcmhaDecodeProbs``): the query-side
    terms of both stages packed into one array (one XLA fusion writes it, where one operand
    per term would cost one copy each), the key-side terms stacked as the cache holds them
    (``_stacked``)."""
    B, G, _, S = x.shape
    if mask is None:
        m = np.zeros((1, 1, 1), bool)
    else:          # (B|1, 1, S|1) or per head (B|1, N, 1, S|1) -> (B|1, 1|N, S|1)
        m = jnp.reshape(mask, (mask.shape[0], mask.shape[1] if mask.ndim == 4 else 1,
                               mask.shape[-1]))
    stages = (pre or {}, post or {})
    query = [jnp.ravel(st[n]).astype(jnp.float32) for st in stages for n in _QUERY_TERMS
             if n in st]
    rank = [st["qw1"].shape[3] if "qw1" in st else 1 for st in stages]
    return jax.ffi.ffi_call(_PROBS, jax.ShapeDtypeStruct((B, G, M, S), jnp.float32),
                            vmap_method="sequential")(
        x, m, jnp.concatenate(query) if query else _DUMMY, _stacked(stages, ("kw1", "kw2")),
        _stacked(stages, ("kdd",)),
        pre_flags=np.int64(cpu_kernel.cached_flags(stages[0])),
        post_flags=np.int64(cpu_kernel.cached_flags(stages[1])), pre_rank=np.int64(rank[0]),
        post_rank=np.int64(rank[1]), has_mask=np.int64(mask is not None),
        masked=np.float32(spec_terms.MASKED_SCORE))


# Differentiable: the backward is the plain form's vjp (decoding steps are rarely
# differentiated).
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _decode_probs(x, mask, pre, post, M):
    return _probs_ffi(x, mask, pre, post, M)


def _decode_probs_fwd(x, mask, pre, post, M):
    return _probs_ffi(x, mask, pre, post, M), (x, mask, pre, post)


def _decode_probs_bwd(M, res, g):
    x, mask, pre, post = res
    _, vjp = jax.vjp(lambda x, pre, post: dops.one_query_probs(x, mask, pre, post, M),
                     x, pre, post)
    dx, dpre, dpost = vjp(g)
    return dx, None, dpre, dpost


_decode_probs.defvjp(_decode_probs_fwd, _decode_probs_bwd)


def decode_probs(x, mask, pre, post, M):
    """``dcmha.ops.one_query_probs`` (one query's composes and masked softmax: scores x (B,
    G, M, S) -> probabilities, float32; the key-side terms in the cache's (B, S, G, ...)
    layout) as one call of the compiled kernel when a stage is present, every term is one
    of ``dcmha.ops.LOW_RANK_TERMS``, the stages' kw1 share a shape (one rank, as a layer's
    cache holds them) and the kernel is built; otherwise the plain form. Its gradient is the
    plain form's."""
    if (not dops.kernel_stages(pre, post) or not load()
            or len({st["kw1"].shape for st in (pre or {}, post or {}) if "kw1" in st}) > 1):
        return dops.one_query_probs(x, mask, pre, post, M)
    return _decode_probs(x, mask, dict(pre or {}), dict(post or {}), M)


_PATH = cpu_blocks.KernelPath(
    _build, lambda _: dict(compose=_compose, probs=_probs, query_matrix=_query_ffi))
#: load() -> bool, unavailable_reason() -> str or None, and
#: dcmha_attention(q, k, v, **kwargs): ``cpu_blocks.attention`` with this kernel.
load, unavailable_reason, dcmha_attention = _PATH.load, _PATH.unavailable_reason, _PATH.attention
#: The plain function beside the kernel (no blocks, no kernel; materialising).
dcmha_attention_reference = cpu_blocks.reference
