"""DCFormer for keras-hub users: `dcmha.hub` (the optional extra ``dcmha[hub]``).

    DCFormerBackbone               token ids (B, T) -> hidden states (B, T, D)
    DCFormerCausalLM               generate() with strings and keras-hub's samplers,
                                   fit(), enable_lora(), quantize(), presets
    DCFormerCausalLMPreprocessor   strings -> packed token ids, padding mask, labels
    DCFormerTokenizer              a Hugging Face tokenizer.json (`tokenizers` library)

Every ``from_preset`` takes a keras-hub preset (``save_to_preset``), a checkpoint
directory in the authors' release layout (config.json, pytorch_model*.bin or
model*.safetensors, tokenizer.json) or an ``hf://owner/name`` handle.

keras-hub (and, through tensorflow-text, TensorFlow) is imported only when one
of these classes is first used, never by ``import dcmha``.
"""

import importlib

_LAZY = {"DCFormerBackbone": "dcmha.hub.backbone",
         "DCFormerCausalLM": "dcmha.hub.causal_lm",
         "DCFormerCausalLMPreprocessor": "dcmha.hub.causal_lm_preprocessor",
         "DCFormerTokenizer": "dcmha.hub.tokenizer"}
__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dcmha.hub' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
