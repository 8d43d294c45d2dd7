"""DCFormer language models built from the `DCMHA` layer, one concept per module.

A DCFormer (Xiao et al., ICML 2024) is a Transformer++ (pre-norm RMSNorm,
rotary embeddings, SwiGLU MLP, no biases) whose attention is DCMHA. With
``attention="mha"`` every composition is switched off and the same class is
the Transformer++ baseline with identical everything else; ``dcmha_layers``
places DCMHA in some layers only.

    config.py     resolve_config (DCFormer's arguments, declared once), count_parameters
    presets.py    PRESETS for DCFormerLM.from_preset
    blocks.py     SwiGLU, DCFormerBlock, decoder_blocks (RMSNorm is Keras's)
    lm.py         DCFormerLM: build, call, config, presets, as_functional, export, caches
    generate.py   generate: one prefill, then one cached step per token

Rotary embeddings and QK-norm are applied inside the attention layer
(``rope_max_wavelength``, ``qk_norm``).
"""

from dcmha.models.blocks import (DCFormerBlock, RMSNorm, SwiGLU, decoder_blocks,
                                 fresh_initializer)
from dcmha.models.config import (count_parameters, default_intermediate_dim,
                                 official_intermediate_size, resolve_config,
                                 serialize_arguments)
from dcmha.models.lm import DCFormerLM
from dcmha.models.presets import PRESETS

__all__ = [
    "RMSNorm", "SwiGLU", "DCFormerBlock", "DCFormerLM", "PRESETS",
    "official_intermediate_size", "default_intermediate_dim", "count_parameters",
    "resolve_config", "decoder_blocks", "fresh_initializer", "serialize_arguments",
]
