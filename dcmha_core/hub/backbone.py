"""DCFormerBackbone: DCFormerLM's layers as a keras-hub Backbone."""

import types

import keras
from keras import ops
from keras_hub.layers import ReversibleEmbedding
from keras_hub.models import Backbone

from dcmha.hub._release import release_dir
from dcmha.models import (DCFormerLM, RMSNorm, decoder_blocks, resolve_config,
                          serialize_arguments)
from dcmha.models.config import init_signature, saved_arguments


@keras.saving.register_keras_serializable(package="dcmha")
class DCFormerBackbone(Backbone):
    """A DCFormer decoder (the layers of `dcmha.models.DCFormerLM`) as a keras-hub
    Backbone: {"token_ids": (B, T), "padding_mask": (B, T)} -> hidden states (B, T, D).

    The blocks are `DCFormerBlock`s (causal DCMHA self-attention + SwiGLU) and
    decoding uses their DCMHA cache; the output head is the token embedding's
    reverse (``token_embedding(h, reverse=True)``, untied unless
    ``tie_embeddings``). The padding mask is right padding (keras-hub's packer):
    with causal attention a padded position is never seen by a real one, so it
    zeroes the padded positions' embeddings and changes no real position.

    Args: those of `DCFormerLM` (declared once, by
    `dcmha.models.config.resolve_config`) plus keras-hub's ``dtype``.

    `from_preset` also takes a checkpoint directory in the authors' release
    layout or an ``hf://owner/name`` handle (see `dcmha.checkpoints`).
    """

    def __init__(self, *args, dtype=None, **kwargs):
        base = {k: kwargs.pop(k) for k in ("name", "trainable") if k in kwargs}
        # DCFormerLM's arguments, validation and per-layer attention options.
        spec = resolve_config(*args, **kwargs)
        arguments = spec["arguments"]
        kernel_initializer = arguments["kernel_initializer"]
        norm_eps = arguments["norm_eps"]

        # === Layers (DCFormerLM's, keras-hub names) ===
        self.token_embedding = ReversibleEmbedding(
            spec["vocab_size"], spec["hidden_dim"], tie_weights=spec["tie_embeddings"],
            name="token_embedding", dtype=dtype)
        self.transformer_layers = decoder_blocks(
            spec, kernel_initializer=keras.initializers.get(kernel_initializer),
            norm_eps=norm_eps, dtype=dtype)
        self.layer_norm = RMSNorm(epsilon=norm_eps, name="norm", dtype=dtype)

        # === Functional model ===
        token_ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        padding_mask = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        x = self.token_embedding(token_ids)
        x = x * ops.cast(ops.expand_dims(padding_mask, -1), x.dtype)
        for block in self.transformer_layers:
            x = block(x)
        x = self.layer_norm(x)
        super().__init__(inputs={"token_ids": token_ids, "padding_mask": padding_mask},
                         outputs=x, dtype=dtype, **base)

        # === Config ===
        self.arguments = arguments
        for k in ("vocab_size", "num_layers", "hidden_dim", "num_heads", "head_dim",
                  "tie_embeddings"):
            setattr(self, k, spec[k])

    def get_config(self):
        config = super().get_config()
        config.update(serialize_arguments(self.arguments))
        config["kernel_initializer"] = keras.initializers.serialize(
            keras.initializers.get(self.arguments["kernel_initializer"]))
        return config

    @classmethod
    def from_config(cls, config):
        return super().from_config(saved_arguments(config))

    def _lm_view(self):
        """The attributes `dcmha.checkpoints` assigns an official state dict to, as
        DCFormerLM names them, pointing at this backbone's variables."""
        head = None if self.tie_embeddings else types.SimpleNamespace(
            kernel=self.token_embedding.reverse_embeddings)
        return types.SimpleNamespace(tok_embeddings=self.token_embedding, norm=self.layer_norm,
                                     output_projection=head, blocks=self.transformer_layers)

    def to_dcformer_lm(self):
        """A `dcmha.models.DCFormerLM` holding this backbone's current weights (LoRA
        merged into the kernels), e.g. for `dcmha.export.to_onnx` or
        `DCFormerLM.export` after fine-tuning. Float (not quantized) backbones only."""
        lm = DCFormerLM(**self.arguments, dtype=self.dtype_policy.name)
        lm.build((None, None))
        source = self._lm_view()
        pairs = [(lm.tok_embeddings.embeddings, source.tok_embeddings.embeddings),
                 (lm.norm.scale, source.norm.scale)]
        if lm.output_projection is not None:
            pairs.append((lm.output_projection.kernel, source.output_projection.kernel))
        for mine, theirs in zip(lm.blocks, source.blocks):
            # The attention kernels the layer computes with (LoRA merged), by spec name.
            mine.attention.load_spec_weights(theirs.attention.spec_weights())
            pairs += [(mine.attention_norm.scale, theirs.attention_norm.scale),
                      (mine.ffn_norm.scale, theirs.ffn_norm.scale)]
            pairs += [(getattr(mine.feed_forward, n).kernel,
                       getattr(theirs.feed_forward, n).kernel) for n in ("w1", "w3", "w2")]
        for variable, value in pairs:
            variable.assign(ops.cast(value, variable.dtype))
        return lm

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        """A keras-hub preset (`save_to_preset`), or the released weights: a
        directory in the authors' release layout or an ``hf://owner/name`` handle.
        For the latter, `kwargs` are DCFormerLM / DCMHA overrides (``dtype``,
        ``query_chunk_size``, ...)."""
        directory = release_dir(preset)
        if directory is None:
            return super().from_preset(preset, load_weights=load_weights, **kwargs)
        from dcmha import checkpoints

        config = checkpoints.read_official_config(directory)
        state_dict = checkpoints.load_official_state_dict(directory)
        sd, kw, args = checkpoints.official_model_arguments(state_dict, config, **kwargs)
        backbone = cls(**args)
        if load_weights:
            checkpoints.assign_official_state_dict(backbone._lm_view(), sd, kw)
        return backbone


#: What `inspect.signature(DCFormerBackbone)`, `help` and Keras see: DCFormerLM's
#: arguments (`dcmha.models.config.resolve_config`) plus keras-hub's ``dtype``.
DCFormerBackbone.__init__.__signature__ = init_signature(dtype=None)
