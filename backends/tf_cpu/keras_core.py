"""The TensorFlow CPU core as a fast path of ``dcmha.ops.dcmha_attention``.

Registered in ``dcmha.ops.FAST_PATHS`` as "tf_cpu" (Keras tensorflow backend),
tried before "xla" by ``implementation="auto"``; the module implements the
registry's contract (``dcmha.backends.cpu_blocks`` holds the rules it shares
with "jax_cpu"):

* ``unsupported(call)``: None, or why this path cannot run ``call``:
  TensorFlow sees a GPU; the call is traced inside an XLA cluster
  (``tf.function(jit_compile=True)``, e.g. ``Model.fit`` with its default
  ``jit_compile="auto"``), where the kernel's ops cannot be compiled (the "xla"
  path runs there); ``return_attention_scores`` or ``return_intermediates``;
  dropout in training; a ``query_offset`` that is not a Python int; unknown
  shapes; the compiled ops are unavailable (no C / C++ compiler or TensorFlow
  headers, ``DCMHA_CPU_KERNEL=0``); more than ``cpu_blocks.MAX_BLOCKS`` query
  blocks.
* ``preferred(call)``: T * S >= ``cpu_blocks.MIN_PREFERRED_TS`` (8192), eager or
  in a ``tf.function`` graph.
* ``attention(**call)``: the contract of ``dcmha.ops._attention_ops``.
"""

from __future__ import annotations

from .. import cpu_blocks

preferred = cpu_blocks.preferred


def unsupported(call):
    """None if this path can run ``call``, else the reason why not."""
    import tensorflow as tf

    from ..xla.dcmha_xla import _in_xla_context
    from . import dcmha_tf_cpu
    if tf.config.list_logical_devices("GPU"):
        return "TensorFlow computes on a GPU (this path is for CPU; see 'xla')"
    if _in_xla_context():
        return ("the call is traced for XLA (jit_compile=True), which cannot compile the "
                "kernel's ops; the 'xla' path runs there")
    return cpu_blocks.unsupported(call, dcmha_tf_cpu)


def attention(q, k, v, **call):
    """The contract of ``dcmha.ops._attention_ops`` (see the module doc)."""
    from . import dcmha_tf_cpu
    return cpu_blocks.keras_attention(dcmha_tf_cpu, q, k, v, **call)
