"""DCMHA attention for TensorFlow on CPU: the blocked core of ``dcmha.backends.cpu_blocks``
with its composes, masked softmax and the stages' query factors run by the compiled C
kernel of ``dcmha.backends.cpu_kernel`` as TensorFlow ops (``DcmhaBlockProbsForward``,
``DcmhaQueryMatrix``, ``DcmhaComposeForward``, each with its backward op as its registered
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

    @tf.RegisterGradient("DcmhaBlockProbsForward")
    def _block_probs_grad(op, g, _g_p):
        # p (output 1) is read only by this gradient, so its own upstream gradient is None
        x, *rest = op.inputs
        grads = module.dcmha_block_probs_backward(
            x, op.outputs[1], g, *rest, **{n: op.get_attr(n) for n in cpu_blocks.BLOCK_ATTRS})
        return [*grads, None]                    # none for vis

    @tf.RegisterGradient("DcmhaQueryMatrix")
    def _query_matrix_grad(op, g):
        return module.dcmha_query_matrix_backward(*op.inputs, g, flags=op.get_attr("flags"))

    tf.RegisterGradient("DcmhaDynamicWeights")(_dynamic_weights_grad)
    return module, None


_DYNAMIC_NAMES = ("w1", "w2", "dd")     # the op's output lists, in order


def _dynamic_weights_grad(op, *upstream):
    """``DcmhaDynamicWeights``' gradient: that of ``slot_dynamic_weights`` (the form for
    TensorFlow's graphs, already split into the slots), for x and the weights (zeros for
    the dummies of absent parts). A registered gradient rather than ``tf.custom_gradient``,
    whose identity ops would sit in every step's graph."""
    C, rank = op.get_attr("c"), op.get_attr("rank")
    present = (op.get_attr("has_projection"),) * 2 + (op.get_attr("has_gating"),)
    x, dw1, qkw, dd = op.inputs
    inputs = [x, dw1, qkw, dd]
    scale = op.get_attr("weight_scale")
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        dw1, qkw, dd = (w if scale == 1.0 else w * scale for w in (dw1, qkw, dd))
        split = dops.slot_dynamic_weights(
            x, dw1 if present[0] else None, qkw if present[0] else None,
            dd if present[2] else None, C=C, rank=rank,
            gelu_approximate=bool(op.get_attr("gelu_approximate")))
        pairs = [(p, upstream[i * C + c])
                 for i, n in enumerate(_DYNAMIC_NAMES) if present[i]
                 for c, p in enumerate(split[n])
                 if upstream[i * C + c] is not None]
    if not pairs:
        return [tf.zeros_like(t) for t in inputs]
    return tape.gradient([p for p, _ in pairs], inputs,
                         output_gradients=[u for _, u in pairs],
                         unconnected_gradients=tf.UnconnectedGradients.ZERO)


def _primitives(module):
    """``cpu_blocks.attention``'s kernel primitives as this library's ops."""

    def compose(x, wq, kw1, kw2, kdd, flags):
        """Compose of a block x (B, G, M, t, s); terms as in ``csrc/compose_wrap.h``."""
        return module.dcmha_compose_forward(x, wq, kw1, kw2, kdd, flags=flags)

    def probs(x, pre, post, vis, pre_flags, post_flags):
        """A block's compose, masked softmax and compose (``DcmhaBlockProbsForward``)."""
        out, _ = module.dcmha_block_probs_forward(
            x, *pre, *post, tf.ones(cpu_blocks.NO_VIS_SHAPE, tf.bool) if vis is None else vis,
            **cpu_blocks.block_attrs(vis, pre_flags, post_flags))
        return out

    def query_matrix(qw1, qw2, qdd, static, flags, shape):
        """A stage's query factor as one op each way (``DcmhaQueryMatrix``)."""
        return module.dcmha_query_matrix(qw1, qw2, qdd, static, flags=flags, shape=list(shape))

    return dict(compose=compose, probs=probs, query_matrix=query_matrix)


_PATH = cpu_blocks.KernelPath(_build, _primitives)
#: load() -> bool, unavailable_reason() -> str or None, and
#: dcmha_attention(q, k, v, **kwargs): ``cpu_blocks.attention`` with this kernel.
load, unavailable_reason, dcmha_attention = _PATH.load, _PATH.unavailable_reason, _PATH.attention
def dynamic_weights(x, dw1, qkw, dd, *, C, rank, gelu_approximate, eps, weight_scale=1.0):
    """``dcmha.ops``' dynamic weights for x (B, L, D) as one kernel op
    (``DcmhaDynamicWeights``), split into the C slots: {"w1", "w2": [C arrays (B, L, G,
    R, M)], "dd": [C arrays (B, L, G, M)]} (those present), or None where the op cannot
    run: B L unknown or above ``cpu_kernel.DYNAMIC_ROWS``, a trace for XLA
    (``jit_compile=True``), no kernel. The weights are dw1, qkw and dd times
    ``weight_scale``, which the op applies itself. In a graph each op costs about 10 us
    to dispatch, and the plain form is some 20 ops; the op writes each slot's array in
    its final shape, so no reshape or unstack follows it, and scales no weight array.
    Its gradient (registered for the op) is ``slot_dynamic_weights``'."""
    from ..tf_common import in_xla_context
    B, L = x.shape[0], x.shape[1]
    if (B is None or L is None or B * L > cpu_kernel.DYNAMIC_ROWS or in_xla_context()
            or not load()):
        return None
    module = _PATH.handle()
    G, K, M = cpu_kernel.dynamic_sizes(dw1, qkw, dd, C)
    weights = [tf.zeros((1,), tf.float32) if w is None else tf.cast(w, tf.float32)
               for w in (dw1, qkw, dd)]
    outs = module.dcmha_dynamic_weights(
        tf.cast(x, tf.float32), *weights, c=C, gc=G * C, k=K, rank=rank, m=M,
        has_projection=int(dw1 is not None), has_gating=int(dd is not None),
        gelu_approximate=int(gelu_approximate), eps=eps, weight_scale=float(weight_scale))
    present = (dw1 is not None, dw1 is not None, dd is not None)
    return {n: list(a) for n, a, p in zip(_DYNAMIC_NAMES, outs, present) if p}


#: The plain function beside the kernel (no blocks, no kernel; materialising).
dcmha_attention_reference = cpu_blocks.reference
