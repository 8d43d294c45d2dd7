"""DCMHA as Keras 3 layers: ``DCMHA`` and its ``DynamicWeightProjection``.

The math lives in ``dcmha.ops`` (functional, on ``keras.ops``); this package
owns the variables, their canonical (spec) names, masks, the decoding cache and
the Keras plumbing (config, build, symbolic shapes, dtype policies), one concern
per module:

    dcmha            the ``DCMHA`` layer: arguments, build, call, shapes, config
    forward          its forward pass (projections, dynamic weights, cache, core)
    core             the attention core and its override point ``_compute_attention``
    masking          the masks combined into the core's boolean mask
    cache            the decoding cache (``init_cache``) and its checks
    weights          canonical weight names, ``from_mha``, LoRA, quantization, 0.1.0 files
    dynamic_weights  ``DynamicWeightProjection``
    axes             ``attention_axes``: inputs of any rank onto the (B, L, D) core
"""

from dcmha.layers._checks import arange_int32, readable_value
from dcmha.layers.dcmha import DCMHA
from dcmha.layers.dynamic_weights import DynamicWeightProjection

__all__ = ["DCMHA", "DynamicWeightProjection", "arange_int32", "readable_value"]
