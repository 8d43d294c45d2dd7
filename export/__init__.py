"""ONNX export of DCMHA layers and of Keras models containing them.

    to_onnx(obj, path, ...)      write a DCMHA layer / Keras model as ONNX (atomically)
    verify(path, obj, inputs)    run it in onnxruntime and compare with Keras
    export_layer(cfg, params)    the framework-free core: one call from a spec Config
    session(path)                an onnxruntime CPU session, with the compose kernel

Each DCMHA call is a node of an ONNX local function in the ``dcmha`` domain
(plain-op body; see ``dcmha.export.core``), whose composes are ``dcmha.Compose*``
nodes, local functions too, that onnxruntime runs as the compiled compose kernel
once ``dcmha.export.ort_ops`` is registered (``session`` does). Keras is imported
only by ``to_onnx`` / ``verify``, so the core runs without it.
"""

from __future__ import annotations

from typing import Optional

from dcmha.export.core import (DOMAIN, FUNCTION_NAME, CallSpec, atomic_output, check_model,
                               decode_names, export_layer, output_target, save_model, session)


def to_onnx(obj, path, *, opset: Optional[int] = None, dynamic: bool = True,
            dtype: str = "float32", decode: bool = False, self_attention: Optional[bool] = None,
            use_causal_mask: bool = False, attention_mask: bool = False,
            return_attention_scores: bool = False, input_shapes: Optional[dict] = None,
            batch_size: int = 1, cache_length: Optional[int] = None,
            compose_nodes: bool = True):
    """Export a built ``dcmha.DCMHA`` layer or a Keras model containing DCMHA layers to ONNX.

    Args:
        obj: a built DCMHA layer, or a functional / Sequential Keras model of
            supported layers (see ``dcmha.export.keras_export``) and DCMHA layers
            (a subclassed model with ``as_functional()``, e.g. DCFormerLM, too).
        path: the .onnx file; written to a temporary file in the same directory
            and renamed onto ``path`` only after onnx.checker (full_check)
            passes and onnxruntime loads it with ORT_ENABLE_ALL. A file that is
            replaced keeps its mode; a symlink is written through to its target.
        opset: ONNX opset (default 18; 18 up to the installed onnx's newest).
        dynamic: symbolic batch / sequence / cache axes (``batch``,
            ``query_length``, ``key_length``, ``cache_length``; model inputs get
            ``batch``, ``sequence_length`` and ``<input>_dim<i>``). With False,
            shapes come from the model, ``input_shapes``, ``batch_size`` and
            ``cache_length``.
        dtype: "float32" or "float16". float16 stores weights and computes in
            float16, except scores, compositions and softmax (float32, as in
            the Keras layer) and normalisations.
        decode: write one cached step instead of the full forward. Extra
            inputs: ``cache_update_index`` (int64 scalar: the position of the
            first new token) and ``past_<entry>`` for every entry of
            ``reference.cache_shapes`` (key, value, key_w, key_dd), shape
            (B, S_max, ...); outputs
            ``present_<entry>`` of the same shapes. In a model every DCMHA call
            must be causal self-attention; the entry names get the suffix
            ``.<layer path>``.
        self_attention, use_causal_mask, attention_mask, return_attention_scores:
            for a single layer only. self_attention (default: not
            cross_attention) gives one input ``query``; otherwise ``query``,
            ``value``, ``key``. attention_mask adds the bool input
            ``attention_mask`` (B, T, S), True = attend. return_attention_scores
            adds the float32 output ``attention_scores`` (B, N, T, S).
        compose_nodes: write each of a DCMHA call's composes as one
            ``dcmha.Compose*`` node: a model-local function with a plain-op body
            (any ONNX runtime runs it), which an onnxruntime session that registers
            ``dcmha.export.ort_ops`` (``dcmha.export.session`` does) runs as the
            compiled compose kernel, about 1.5x faster per layer on a CPU
            (benchmarks/RESULTS.md); the same holds for the RoPE of the query and key
            heads (``dcmha.Rope*``), each stage's per-query matrix
            (``dcmha.QueryMatrix*``), a causal block's compose, softmax and compose
            (``dcmha.Probs*``) and a decode step's cache reads (``dcmha.CacheHeads``).
            False: all of these inline as plain ops (the fastest graph for a runtime
            without the kernel).

    Graph names: a layer has inputs query [, value, key] [, attention_mask] and
    outputs output [, attention_scores]; a model keeps its Keras input names and
    has outputs ``output`` (or ``output_0``, ``output_1``, ...).

    Returns the ONNX ModelProto that was written. Raises ValueError naming the
    option, or the layer class and its place in the model, when something
    cannot be exported; ``path`` is then left untouched.
    """
    from dcmha.export.keras_export import build

    _check_options(path, dynamic=dynamic, decode=decode, use_causal_mask=use_causal_mask,
                   compose_nodes=compose_nodes,
                   attention_mask=attention_mask, return_attention_scores=return_attention_scores,
                   self_attention=self_attention, input_shapes=input_shapes,
                   batch_size=batch_size, cache_length=cache_length)
    model = build(obj, opset=opset, dynamic=dynamic, dtype=dtype, decode=decode,
                  self_attention=self_attention, use_causal_mask=use_causal_mask,
                  attention_mask=attention_mask, return_attention_scores=return_attention_scores,
                  input_shapes=input_shapes, batch_size=batch_size, cache_length=cache_length,
                  compose_nodes=compose_nodes)
    save_model(model, path)
    return model


def _check_options(path, *, self_attention, input_shapes, batch_size, cache_length, **flags):
    """Type and range checks of ``to_onnx``'s options, before anything is built."""
    output_target(path)      # a str / PathLike in an existing directory, not a directory
    if self_attention is not None:
        flags["self_attention"] = self_attention
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"`{name}` must be a boolean. Received: {name}={value!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"`batch_size` must be a positive integer. Received: "
                         f"batch_size={batch_size!r}")
    if cache_length is not None and (isinstance(cache_length, bool)
                                     or not isinstance(cache_length, int) or cache_length <= 0):
        raise ValueError("`cache_length` must be None or a positive integer. Received: "
                         f"cache_length={cache_length!r}")
    if input_shapes is not None and not isinstance(input_shapes, dict):
        raise TypeError("`input_shapes` must be None or a dict {input name: shape}. "
                        f"Received: {type(input_shapes).__name__}")


def verify(path, obj, inputs, **kwargs) -> dict:
    """Run ``path`` in onnxruntime and compare with the Keras ``obj``; see ``dcmha.export.verification.verify``.

    Returns {"max_abs", "max_rel", "outputs": {name: {"max_abs", "max_rel"}}}.
    """
    from dcmha.export.verification import verify as _verify

    return _verify(path, obj, inputs, **kwargs)


__all__ = ["to_onnx", "verify", "export_layer", "CallSpec", "save_model", "atomic_output",
           "output_target", "check_model", "session", "decode_names", "DOMAIN", "FUNCTION_NAME"]
