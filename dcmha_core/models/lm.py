"""`DCFormerLM`: a causal DCFormer language model, token ids (B, T) -> logits (B, T, V).

    model:  logits = output(norm(blocks(tok_embeddings(token_ids))))

The blocks are `dcmha.models.blocks.DCFormerBlock`s; the arguments are declared once in
`dcmha.models.config.resolve_config`; generation is `dcmha.models.generate`. Sublayer
names follow the official PyTorch checkpoint (``tok_embeddings``, ``layers_<i>``,
``norm``, ``output``) so that `dcmha.checkpoints` maps them one to one.
"""

from __future__ import annotations

import keras
from keras import ops

from dcmha import framework
from dcmha import checkpoints
from dcmha.layers import readable_value
from dcmha.models.blocks import RMSNorm, decoder_blocks, fresh_initializer
from dcmha.models.config import (NAMED_ARGUMENTS, init_signature, resolve_config,
                                 saved_arguments, serialize_arguments)
from dcmha.models.generate import check_token_range, generate
from dcmha.models.presets import PRESETS

__all__ = ["DCFormerLM"]

_register = keras.saving.register_keras_serializable(package="dcmha")


@_register
class DCFormerLM(keras.Model):
    """A causal DCFormer language model: token ids (B, T) -> logits (B, T, V).

    Args:
        vocab_size: V.
        num_layers: number of blocks L.
        hidden_dim: model width D.
        num_heads: query heads N per layer.
        intermediate_dim: SwiGLU width; None -> int(8 * D / 3) rounded up to a
            multiple of 256 (the official rule) when D >= 512, of 32 below.
        num_key_value_heads: N_kv (GQA); None -> N.
        num_groups: composition groups G.
        head_dim: head size d; None -> D // N.
        sliding_window: window W of the local layers; None -> every layer global.
        window_pattern: string of "L" (local) and "G" (global) repeated over the
            layers: "LG" makes even layers local and odd layers global; "LGLL"
            gives [L, G, L, L, L, G, L, L, ...]. Ignored when sliding_window is None.
        qk_norm: QK-norm in every attention layer.
        rope_max_wavelength: RoPE base; None switches RoPE off.
        norm_eps: epsilon of every RMSNorm block norm (QK-norm keeps 1e-6).
        tie_embeddings: reuse the token embedding as the output projection.
        attention: "dcmha", or "mha" for the Transformer++ baseline (the same
            model with pre_compose=False, post_compose=False).
        kernel_initializer: initializer of the SwiGLU kernels (and the output
            projection).
        dcmha_layers: which layers' attention is DCMHA; the others are plain
            multi-head attention, built exactly as ``attention="mha"`` builds
            them. None or "all": every layer. An int k: every k-th layer, i.e.
            layers k - 1, 2k - 1, ... (2: the odd layers; 4 with 8 layers:
            layers 3 and 7). A list of layer indices, e.g. [0, 5]. Not with
            ``attention="mha"``.
        **dcmha_options: further `DCMHA` arguments given to every attention layer
            (rank, dynamic_hidden_dim, pre_compose, post_compose, query_wise,
            key_wise, dynamic_projection, dynamic_gating, static_compose,
            gelu_approximate, query_chunk_size, dropout, implementation,
            composition_lr_scale, ...), plus the Keras `name` / `dtype` /
            `trainable`. ``composition_lr_scale`` (default 0.1) trains the
            composition weights at that fraction of an Adam-family optimizer's
            step with no wrapper (see `DCMHA`); it is always stored in the config,
            and a config saved without it (before it existed) loads with 1.0.

    Call arguments:
        token_ids: int (B, T), each in [0, vocab_size): outside it a ValueError
            in eager calls; under tracing (``jax.jit``, a ``tf.function``,
            ``torch.compile``, an export), where the values are unknown, the
            logits at the positions of such ids are NaN.
        training: Python bool.
        cache: list of per-layer decoding caches (`init_cache`), or None.
        cache_update_index: position of token_ids[:, 0] (Python int or int32
            scalar tensor) when `cache` is given; out of range it is a
            ValueError when known, else see `DCMHA` (clamped write, NaN output).

    Returns:
        logits (B, T, V) in the compute dtype; with a cache (logits, new cache).

    Decoding: `generate` (greedy or sampled, one cached step per token),
    `init_cache` / `call_with_cache` for a custom loop. `as_functional` gives
    the same network as a functional model (e.g. for `dcmha.export.to_onnx`).
    """

    def __init__(self, *args, **kwargs):
        base = {k: kwargs.pop(k) for k in ("name", "dtype", "trainable") if k in kwargs}
        super().__init__(**base)
        spec = resolve_config(*args, **kwargs)
        self._arguments = spec["arguments"]
        # One attribute per argument (vocab_size, ..., attention, dcmha_layers).
        for name in NAMED_ARGUMENTS:
            setattr(self, name, self._arguments[name])
        self.kernel_initializer = keras.initializers.get(self.kernel_initializer)
        self.dcmha_options = {k: v for k, v in self._arguments.items()
                              if k not in NAMED_ARGUMENTS}

        kw = dict(dtype=self.dtype_policy)
        self.tok_embeddings = keras.layers.Embedding(
            self.vocab_size, self.hidden_dim, name="tok_embeddings", **kw)
        self.blocks = decoder_blocks(spec, kernel_initializer=self.kernel_initializer,
                                     norm_eps=self.norm_eps, dtype=self.dtype_policy)
        self.norm = RMSNorm(epsilon=self.norm_eps, name="norm", **kw)
        self.output_projection = None if self.tie_embeddings else keras.layers.Dense(
            self.vocab_size, use_bias=False, kernel_initializer=self._initializer(7),
            name="output", **kw)

    # ---- configuration -------------------------------------------------
    def _initializer(self, offset=0):
        return fresh_initializer(self.kernel_initializer, offset=offset)

    def layer_sliding_windows(self):
        """The sliding window of each layer (None = global), e.g. [64, None, 64, None]."""
        return [b.attention_options["sliding_window"] for b in self.blocks]

    @classmethod
    def from_preset(cls, name, **overrides):
        """Build a preset configuration (random weights), with any argument overridden.

        Presets (parameter counts from `count_parameters`, untied embeddings;
        the "mha" column is the same preset with ``attention="mha"``):

        ==================  ======  ====  ==  ==  ======  ========  =============  =============
        name                layers  D     N   d   vocab   window    DCFormer       Transformer++
        ==================  ======  ====  ==  ==  ======  ========  =============  =============
        dcformer_tiny       4       128   8   16  256     64, LG    967,808        869,504
        dcformer_405m       24      1024  16  64  50432   256, LG   419,873,792    411,616,256
        dcformer_2.8b       32      2560  32  80  50432   256, LG   2,850,463,232  2,795,937,280
        dcformer_post_tiny  4       128   8   16  256     64, LG    918,656        869,504
        dcformer_post_405m  24      1024  16  64  50432   256, LG   415,745,024    411,616,256
        ==================  ======  ====  ==  ==  ======  ========  =============  =============

        dcformer_405m has the paper's 405M shape (24 x 1024, 16 heads; SwiGLU
        2816); its 103M embedding + output parameters are included above.
        dcformer_2.8b follows the released DCFormer-2.8B configuration (QK-norm,
        SwiGLU 6912, RoPE base 10000). DCMHA adds dw1 + qkw + dd per layer:
        24,576 (tiny), 344,064 (405m) and 1,703,936 (2.8b): about 2% of the two
        large models, 11% of the tiny one. The tiny presets have heads of 16, where
        the quality study measures DCMHA's gain (benchmarks/RESULTS.md); the larger
        ones keep the paper's shapes. The ``dcformer_post_*`` presets compose
        the attention probabilities only (``pre_compose=False``,
        ``post_compose=True``: two of the four dynamic-weight slots), which halves
        what DCMHA adds; with ``dcmha_layers`` (e.g. 2: every other layer) only the
        layers it places add it.

        Example: ``DCFormerLM.from_preset("dcformer_tiny", attention="mha")``,
        ``DCFormerLM.from_preset("dcformer_post_tiny", dcmha_layers=[3])``.

        `name` may also be a checkpoint directory in the authors' release layout
        (config.json plus pytorch_model*.bin or model*.safetensors, sharded or
        not) or an ``hf://owner/name`` handle: the released weights, loaded by
        `dcmha.checkpoints.from_official_directory` (overrides such as ``dtype``
        or ``query_chunk_size`` go to it).
        """
        import os
        if isinstance(name, os.PathLike) or (isinstance(name, str) and (
                name.startswith("hf://") or os.path.isdir(name))):
            return checkpoints.from_official_directory(name, **overrides)
        if name not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}. Available: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def get_config(self):
        base = {k: v for k, v in super().get_config().items()
                if k in ("name", "trainable", "dtype")}
        return {**base, **serialize_arguments(self._arguments),
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer)}

    @classmethod
    def from_config(cls, config):
        return cls(**saved_arguments(config))

    # ---- forward -------------------------------------------------------
    def build(self, input_shape=None):
        input_shape = tuple(input_shape) if input_shape is not None else (None, None)
        hidden = input_shape + (self.hidden_dim,)
        self.tok_embeddings.build(input_shape)
        for block in self.blocks:
            block.build(hidden)
        self.norm.build(hidden)
        if self.output_projection is not None:
            self.output_projection.build(hidden)
        self.built = True

    def _head(self, x):
        x = self.norm(x)
        if self.output_projection is not None:
            return self.output_projection(x)
        emb = ops.cast(self.tok_embeddings.embeddings, x.dtype)
        return ops.matmul(x, ops.transpose(emb))

    def call(self, token_ids, training=None, cache=None, cache_update_index=None):
        values = readable_value(token_ids)
        if values is not None:
            check_token_range(values, self.vocab_size)
            x = self.tok_embeddings(token_ids)
        else:
            # Traced (jit, tf.function, export): the ids cannot be checked. An id
            # outside [0, V) is looked up as 0 and its position's embedding made
            # NaN, so that its logits are NaN on every backend (instead of NaN on
            # jax, a wrapped row for negative ids, an indexing error on torch).
            ids = ops.cast(token_ids, "int32")
            bad = ops.logical_or(ops.less(ids, 0), ops.greater_equal(ids, self.vocab_size))
            x = self.tok_embeddings(ops.where(bad, 0, ids))
            x = ops.where(bad[..., None], ops.cast(float("nan"), x.dtype), x)
        if cache is None:
            for block in self.blocks:
                x = block(x, training=training)
            return self._head(x)
        new_cache = []
        for block, layer_cache in zip(self.blocks, cache):
            x, layer_cache = block(x, training=training, cache=layer_cache,
                                   cache_update_index=cache_update_index)
            new_cache.append(layer_cache)
        return self._head(x), new_cache

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.vocab_size,)

    def as_functional(self, name=None):
        """A functional `keras.Model` over the same layers: token_ids (B, T) -> logits.

        Every layer (and weight) is shared with this model, except with tied
        embeddings, where the output layer is a Dense holding a copy of the
        embedding matrix (transposed). Made of standard Keras layers plus DCMHA,
        so that `dcmha.export.to_onnx` can walk it.
        """
        if not self.built:
            self.build((None, None))
        def block_model(b):
            # One nested functional model per block: layer names repeat across
            # blocks, and a functional model needs unique names at each level.
            x = keras.Input((None, self.hidden_dim), name="x", dtype=self.compute_dtype)
            h = b.attention_norm(x)
            h = keras.layers.Add(name="attention_residual")(
                [x, b.attention(h, h, use_causal_mask=True)])
            f = b.ffn_norm(h)
            ff = b.feed_forward
            gate = keras.layers.Activation("silu", name="silu")(ff.w1(f))
            inner = keras.layers.Multiply(name="swiglu")([gate, ff.w3(f)])
            out = keras.layers.Add(name="ffn_residual")([h, ff.w2(inner)])
            return keras.Model(x, out, name=b.name)

        token_ids = keras.Input((None,), dtype="int32", name="token_ids")
        x = self.tok_embeddings(token_ids)
        for b in self.blocks:
            x = block_model(b)(x)
        x = self.norm(x)
        head = self.output_projection
        if head is None:
            head = keras.layers.Dense(self.vocab_size, use_bias=False, name="output",
                                      dtype=self.dtype_policy)
            head.build((None, None, self.hidden_dim))
            head.kernel.assign(ops.transpose(self.tok_embeddings.embeddings))
        return keras.Model(token_ids, head(x), name=name or f"{self.name}_functional")

    def export(self, filepath, format="tf_saved_model", verbose=None, input_signature=None,
               **kwargs):
        """Keras's `Model.export`, for token ids of any batch size and length by default.

        Without `input_signature` the artifact takes one int32 (B, T) input
        "token_ids" with B and T dynamic (Keras alone would take T from the
        first call and a float dtype from the policy). The backend prepares its
        exporter first (``dcmha.framework.prepare_export``: on torch, ONNX's
        TorchScript exporter learns `aten::rms_norm`). Exports the forward pass
        without a cache: token_ids -> logits (B, T, V).
        """
        if not self.built:
            self.build((None, None))
        if input_signature is None:
            input_signature = [keras.InputSpec(shape=(None, None), dtype="int32",
                                               name="token_ids")]
        framework.prepare_export(format)
        return super().export(filepath, format=format, verbose=verbose,
                              input_signature=input_signature, **kwargs)

    # ---- decoding ------------------------------------------------------
    def init_cache(self, batch_size, max_length, dtype=None):
        """One zero decoding cache per layer (list of dicts, see `DCMHA.init_cache`):
        keys, values and key-side dynamic weights for `max_length` positions."""
        if not self.built:
            self.build((batch_size, None))
        return [b.attention.init_cache(batch_size, max_length, dtype=dtype) for b in self.blocks]

    def call_with_cache(self, token_ids, cache, cache_update_index):
        """Logits of new tokens (B, T_new) at positions cache_update_index + arange(T_new).

        Reads and updates `cache` (from `init_cache`): the new tokens attend to
        every cached position before them, so nothing is recomputed.
        `cache_update_index` may be a Python int or an int32 scalar tensor.
        Returns (logits (B, T_new, V), new cache).
        """
        return self.call(token_ids, cache=cache, cache_update_index=cache_update_index)

    def _decode_function(self):
        """(tokens, cache, index) -> (last logits (B, V) float32, cache), compiled
        where that pays (``dcmha.framework.decode_step``); ``generate`` gives it the
        index as ``dcmha.framework.step_index`` makes it."""
        return framework.decode_step(self)

    def generate(self, token_ids, max_new_tokens, temperature=0.0, seed=None):
        """Continue `token_ids` (B, T) by `max_new_tokens` tokens.

        One prefill of the prompt, then one cached step per new token (keys,
        values and key-side dynamic weights of earlier positions are never
        recomputed). temperature 0 is greedy (argmax); > 0 samples from
        softmax(logits / temperature) with `seed`. On jax and tensorflow the
        step is compiled once per call of `generate`.

        Returns:
            int32 NumPy array (B, T + max_new_tokens): the prompt then the new tokens.
        """
        return generate(self, token_ids, max_new_tokens, temperature=temperature, seed=seed)


#: What `inspect.signature(DCFormerLM)`, `help` and Keras see: `resolve_config`'s arguments.
DCFormerLM.__init__.__signature__ = init_signature()
