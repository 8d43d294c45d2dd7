"""DCFormerBackbone: DCFormerLM's layers as a keras-hub Backbone."""

import types

import keras
from keras import ops
from keras_hub.layers import ReversibleEmbedding
from keras_hub.models import Backbone

from dcmha.hub._release import release_dir
from dcmha.models import (DCFormerLM, RMSNorm, decoder_blocks, resolve_config,
                          serialize_arguments)


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

    Args: those of `DCFormerLM` (vocab_size, num_layers, hidden_dim, num_heads,
    intermediate_dim, num_key_value_heads, num_groups, head_dim, sliding_window,
    window_pattern, qk_norm, rope_max_wavelength, norm_eps, tie_embeddings,
    attention, kernel_initializer, further DCMHA options) plus keras-hub's
    ``dtype``.

    `from_preset` also takes a checkpoint directory in the authors' release
    layout or an ``hf://owner/name`` handle (see `dcmha.checkpoints`).
    """

    def __init__(self, vocab_size, num_layers, hidden_dim, num_heads, intermediate_dim=None,
                 num_key_value_heads=None, num_groups=1, head_dim=None, sliding_window=None,
                 window_pattern="LG", qk_norm=False, rope_max_wavelength=10000, norm_eps=1e-6,
                 tie_embeddings=False, attention="dcmha", kernel_initializer="glorot_uniform",
                 dtype=None, **kwargs):
        base = {k: kwargs.pop(k) for k in ("name", "trainable") if k in kwargs}
        arguments = dict(
            vocab_size=vocab_size, num_layers=num_layers, hidden_dim=hidden_dim,
            num_heads=num_heads, intermediate_dim=intermediate_dim,
            num_key_value_heads=num_key_value_heads, num_groups=num_groups, head_dim=head_dim,
            sliding_window=sliding_window, window_pattern=window_pattern, qk_norm=qk_norm,
            rope_max_wavelength=rope_max_wavelength, norm_eps=norm_eps,
            tie_embeddings=tie_embeddings, attention=attention, **kwargs)
        # The same validation and per-layer attention options as DCFormerLM.
        spec = resolve_config(**arguments)

        # === Layers (DCFormerLM's, keras-hub names) ===
        self.token_embedding = ReversibleEmbedding(
            spec["vocab_size"], spec["hidden_dim"], tie_weights=bool(tie_embeddings),
            name="token_embedding", dtype=dtype)
        self.transformer_layers = decoder_blocks(
            spec, kernel_initializer=keras.initializers.get(kernel_initializer),
            norm_eps=norm_eps, dtype=dtype)
        self.layer_norm = RMSNorm(epsilon=float(norm_eps), name="norm", dtype=dtype)

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
        self.arguments = dict(arguments, kernel_initializer=kernel_initializer)
        for k in ("vocab_size", "num_layers", "hidden_dim", "num_heads"):
            setattr(self, k, spec[k])
        self.head_dim = spec["head_dim"]
        self.tie_embeddings = bool(tie_embeddings)

    def get_config(self):
        config = super().get_config()
        config.update(serialize_arguments(self.arguments))
        config["kernel_initializer"] = keras.initializers.serialize(
            keras.initializers.get(self.arguments["kernel_initializer"]))
        return config

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
        from dcmha import checkpoints

        lm = DCFormerLM(**self.arguments, dtype=self.dtype_policy.name)
        lm.build((None, None))
        sd = checkpoints.to_official_state_dict(self._lm_view())
        kw = dict(hidden_dim=self.hidden_dim, num_heads=self.num_heads, head_dim=self.head_dim,
                  num_key_value_heads=self.arguments["num_key_value_heads"],
                  attention=self.arguments["attention"], qk_norm=bool(self.arguments["qk_norm"]))
        checkpoints.assign_official_state_dict(lm, sd, kw)
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
