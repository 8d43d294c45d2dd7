"""DCFormerCausalLM: keras-hub's CausalLM over a DCFormerBackbone."""

import os

import keras
from keras import ops
from keras_hub.models import CausalLM
from keras_hub.src.utils.tensor_utils import any_equal

from dcmha.hub._release import release_dir
from dcmha.hub.backbone import DCFormerBackbone
from dcmha.hub.causal_lm_preprocessor import DCFormerCausalLMPreprocessor


@keras.saving.register_keras_serializable(package="dcmha")
class DCFormerCausalLM(CausalLM):
    """A DCFormer language model with keras-hub's `generate`, `fit`, LoRA,
    quantization and presets.

    Inputs {"token_ids": (B, T), "padding_mask": (B, T)} -> logits (B, T, V).
    `generate` takes strings when a preprocessor is attached and samples with
    the sampler given to `compile` ("greedy", "top_k", "top_p", "beam", ...).
    Decoding reads and writes each block's DCMHA cache (keys, values and the
    key-side dynamic weights of earlier positions, `DCMHA.init_cache`): one
    prefill, then one cached step per token.

    Args:
        backbone: a `DCFormerBackbone`.
        preprocessor: a `DCFormerCausalLMPreprocessor` or None.

    `from_preset` also takes a release-layout directory (its tokenizer.json, if
    any, gives the preprocessor) or an ``hf://owner/name`` handle.
    """

    backbone_cls = DCFormerBackbone
    preprocessor_cls = DCFormerCausalLMPreprocessor

    def __init__(self, backbone, preprocessor=None, **kwargs):
        # === Layers ===
        self.backbone = backbone
        self.preprocessor = preprocessor
        # === Functional model ===
        inputs = backbone.input
        hidden_states = backbone(inputs)
        outputs = backbone.token_embedding(hidden_states, reverse=True)
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)

    def init_cache(self, batch_size, max_length):
        """One zero DCMHA decoding cache per block (a list of dicts)."""
        return [block.attention.init_cache(batch_size, max_length, dtype=self.compute_dtype)
                for block in self.backbone.transformer_layers]

    def call_with_cache(self, token_ids, cache, cache_update_index):
        """Logits of token_ids (B, T_new) at cache_update_index + arange(T_new).

        Returns (logits (B, T_new, V), hidden states (B, T_new, D), new cache).
        """
        x = self.backbone.token_embedding(token_ids)
        new_cache = []
        for block, layer_cache in zip(self.backbone.transformer_layers, cache):
            x, layer_cache = block(x, cache=layer_cache, cache_update_index=cache_update_index)
            new_cache.append(layer_cache)
        hidden_states = self.backbone.layer_norm(x)
        logits = self.backbone.token_embedding(hidden_states, reverse=True)
        return logits, hidden_states, new_cache

    def _build_cache(self, token_ids):
        batch_size, max_length = ops.shape(token_ids)[0], ops.shape(token_ids)[1]
        cache = self.init_cache(batch_size, max_length)
        _, hidden_states, cache = self.call_with_cache(token_ids, cache, 0)
        return hidden_states, cache

    def generate_step(self, inputs, stop_token_ids=None):
        """One batch of generation (compiled by keras-hub): prefill the prompt
        (right-padded to the generation length), then let the sampler fill the
        padded positions one cached step at a time."""
        token_ids, padding_mask = inputs["token_ids"], inputs["padding_mask"]
        hidden_states, cache = self._build_cache(token_ids)
        # Start at the shortest prompt; longer prompts keep their own tokens
        # (the sampler only writes where the mask is off).
        index = ops.min(ops.sum(ops.cast(padding_mask, "int32"), axis=-1))

        def next(prompt, cache, index):
            cache_update_index = index - 1
            batch_size = ops.shape(prompt)[0]
            prompt = ops.slice(prompt, [0, cache_update_index], [batch_size, 1])
            logits, hidden_states, cache = self.call_with_cache(prompt, cache,
                                                                cache_update_index)
            return ops.squeeze(logits, axis=1), ops.squeeze(hidden_states, axis=1), cache

        token_ids = self.sampler(next=next, prompt=token_ids, cache=cache, index=index,
                                 mask=padding_mask, stop_token_ids=stop_token_ids,
                                 hidden_states=hidden_states, model=self)
        if stop_token_ids is not None:
            # Everything after the first stop token of the generated part is padding.
            end = ops.cast(any_equal(token_ids, stop_token_ids, ops.logical_not(padding_mask)),
                           "int32")
            after = ops.cast(ops.cumsum(end, axis=-1), "int32") - end
            padding_mask = ops.logical_not(ops.cast(after, "bool"))
        else:
            padding_mask = ops.ones_like(token_ids, dtype="bool")
        return {"token_ids": token_ids, "padding_mask": padding_mask}

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        """A keras-hub preset (``save_to_preset``), a release-layout directory or an
        ``hf://owner/name`` handle, as keras-hub's tasks load them: ``backbone=`` and
        ``preprocessor=`` (None included) replace the ones the preset would give.

        For a release-layout directory the other keyword arguments are DCFormerLM /
        DCMHA overrides of the backbone (``dtype``, ``query_chunk_size``, ...), and
        ``sequence_length`` goes to the preprocessor made from its tokenizer.json (none
        without one)."""
        directory = release_dir(preset)
        if directory is None:
            return super().from_preset(preset, load_weights=load_weights, **kwargs)
        task = {k: kwargs.pop(k) for k in ("backbone", "preprocessor") if k in kwargs}
        sequence_length = kwargs.pop("sequence_length", None)
        if "backbone" in task and kwargs:
            raise ValueError(f"{sorted(kwargs)} override the preset's backbone, which the given "
                             "`backbone` replaces: pass them to the backbone instead.")
        if "preprocessor" in task and sequence_length is not None:
            raise ValueError("`sequence_length` sets the preset's preprocessor, which the given "
                             f"`preprocessor` replaces. Received: sequence_length="
                             f"{sequence_length!r}, preprocessor={task['preprocessor']!r}")
        if "backbone" not in task:
            task["backbone"] = cls.backbone_cls.from_preset(directory, load_weights=load_weights,
                                                            **kwargs)
        if "preprocessor" not in task:
            task["preprocessor"] = None
            if os.path.isfile(os.path.join(directory, "tokenizer.json")):
                extra = {} if sequence_length is None else {"sequence_length": sequence_length}
                task["preprocessor"] = cls.preprocessor_cls.from_preset(directory, **extra)
        return cls(**task)
