"""DCMHA attention for TensorFlow on CPU: the blocked core of ``dcmha.backends.cpu_blocks``
with its composes run by the compiled C kernel of ``dcmha.backends.cpu_kernel`` as two
TensorFlow ops, ``DcmhaComposeForward`` and ``DcmhaComposeBackward`` (its registered
gradient).

``load()`` builds the op library on first use (C and C++ compilers and TensorFlow's headers,
``tf.sysconfig``; cached and verified as ``cpu_kernel`` describes, keyed by TensorFlow's
version) and loads it with ``tf.load_op_library``. The ops run eagerly and
inside ``tf.function`` graphs, not inside XLA clusters (``jit_compile=True``): there the
"xla" path runs. ``dcmha_attention`` is the fast function, ``dcmha_attention_reference`` the
plain one beside it (``cpu_blocks.reference``). Both run on the Keras tensorflow backend
(they are written in ``keras.ops``).
"""

from __future__ import annotations

import ctypes

import tensorflow as tf

from .. import cpu_blocks, cpu_kernel

__all__ = ["dcmha_attention", "dcmha_attention_reference", "load", "unavailable_reason"]


def _recipe():
    """The op library's recipe: its cache key carries TensorFlow's version and flags."""
    return cpu_kernel.tf_recipe(tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags(),
                                tf.__version__)


def _build():
    """(the loaded op module, None), or (None, reason)."""
    recipe = _recipe()
    path, reason = cpu_kernel.build_library(recipe, load=False)   # verified, not yet opened
    if path is None:
        return None, reason
    try:
        module = tf.load_op_library(path)
    except Exception as e:      # noqa: BLE001 - any loading failure
        return cpu_kernel.fallback(recipe.tag, f"loading the TensorFlow ops failed: {e}")
    # Opened by TensorFlow first (it registers the ops while loading); the symbols and the
    # Args layout are checked before any op runs.
    reason = cpu_kernel.check_library(ctypes.CDLL(path), recipe)
    if reason is not None:
        return cpu_kernel.fallback(recipe.tag, reason)

    @tf.RegisterGradient("DcmhaComposeForward")
    def _compose_grad(op, g):
        return module.dcmha_compose_backward(op.inputs[0], g, *op.inputs[1:],
                                             flags=op.get_attr("flags"))
    return module, None


def _compose_with(module):
    def compose(x, wq, kw1, kw2, kdd, flags):
        """Compose of a block x (B, G, M, t, s); terms as in ``csrc/compose_wrap.h``."""
        return module.dcmha_compose_forward(x, wq, kw1, kw2, kdd, flags=flags)
    return compose


_PATH = cpu_blocks.KernelPath(_build, _compose_with)
#: load() -> bool, unavailable_reason() -> str or None, and
#: dcmha_attention(q, k, v, **kwargs): ``cpu_blocks.attention`` with this kernel.
load, unavailable_reason, dcmha_attention = _PATH.load, _PATH.unavailable_reason, _PATH.attention
#: The plain function beside the kernel (no blocks, no kernel; materialising).
dcmha_attention_reference = cpu_blocks.reference
