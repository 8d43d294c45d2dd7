"""DCMHA as Keras 3 layers: ``DCMHA`` and its ``DynamicWeightProjection``.

The math lives in ``dcmha.ops`` (functional, on ``keras.ops``); this package owns the
variables, their canonical (spec) names, masks, the decoding cache and the Keras
plumbing (config, build, symbolic shapes, dtype policies):

    dcmha            the ``DCMHA`` layer, one class as ``keras.layers.MultiHeadAttention``:
                     arguments, build, the forward pass, the attention core and its
                     override point ``_compute_attention``, shapes, config; with its
                     module-level helpers for arguments, ``attention_axes`` and masks
    cache            the decoding cache: its layout (``init_cache``) and checks
    weights          canonical weight names, ``from_mha``'s weights, 0.1.0 files
    dynamic_weights  ``DynamicWeightProjection``
"""

from dcmha.layers.dcmha import DCMHA, readable_value
from dcmha.layers.dynamic_weights import DynamicWeightProjection

__all__ = ["DCMHA", "DynamicWeightProjection", "readable_value"]
