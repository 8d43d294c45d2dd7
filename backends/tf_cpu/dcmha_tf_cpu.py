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

from dcmha import ops as dops

from .. import cpu_blocks, cpu_kernel

__all__ = ["dcmha_attention", "dcmha_attention_reference", "dynamic_weights", "load",
           "unavailable_reason"]


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
def dynamic_weights(x2, dw1, qkw, dd, *, C, rank, gelu_approximate, eps):
    """``dcmha.ops``' stacked dynamic weights for x2 (BL, D) float32 as one kernel op
    (``DcmhaDynamicWeights``): {"w1", "w2": (BL, G, C, R, M), "dd": (BL, G, C, M)} (those
    present), or None where the op cannot run: BL unknown or above ``cpu_kernel.DYNAMIC_ROWS``, a trace
    for XLA (``jit_compile=True``), no kernel. In a graph each op costs about 10 us to
    dispatch, and the plain form is some 20 ops. Its gradient is the plain form's."""
    from ..xla.dcmha_xla import in_xla_context
    BL = x2.shape[0]
    if BL is None or BL > cpu_kernel.DYNAMIC_ROWS or in_xla_context() or not load():
        return None
    module = _PATH.handle()
    G, K, M = cpu_kernel.dynamic_sizes(dw1, qkw, dd, C)
    weights = [tf.zeros((1,), tf.float32) if w is None else tf.cast(w, tf.float32)
               for w in (dw1, qkw, dd)]

    @tf.custom_gradient
    def run(x2, *weights):
        w1, w2, g = module.dcmha_dynamic_weights(
            x2, *weights, gc=G * C, k=K, rank=rank, m=M, has_projection=int(dw1 is not None),
            has_gating=int(dd is not None), gelu_approximate=int(gelu_approximate), eps=eps)

        def grad(*upstream):
            with tf.GradientTape() as tape:
                tape.watch([x2, *weights])
                plain = dops.plain_dynamic_weights(
                    x2[None], *(w if w_in is not None else None
                                for w, w_in in zip(weights, (dw1, qkw, dd))),
                    C=C, rank=rank, gelu_approximate=gelu_approximate)
                pairs = [(tf.reshape(plain[n][0], tf.shape(u)), u)   # as the op's outputs
                         for u, n in zip(upstream, ("w1", "w2", "dd")) if n in plain]
            flat, ups = [p for p, _ in pairs], [u for _, u in pairs]
            return tape.gradient(flat, [x2, *weights], output_gradients=ups,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return (w1, w2, g), grad

    w1, w2, g = run(tf.cast(x2, tf.float32), *weights)
    out = {}
    if dw1 is not None:
        out["w1"] = tf.reshape(w1, (BL, G, C, rank, M))
        out["w2"] = tf.reshape(w2, (BL, G, C, rank, M))
    if dd is not None:
        out["dd"] = tf.reshape(g, (BL, G, C, M))
    return out


#: The plain function beside the kernel (no blocks, no kernel; materialising).
dcmha_attention_reference = cpu_blocks.reference
