"""dcmha: Dynamically Composable Multi-Head Attention for Keras 3.

Keras is imported lazily (on first use of ``dcmha.DCMHA``, ``dcmha.ops`` or
``dcmha.layers``), so that ``import dcmha.spec`` or ``dcmha.conformance`` does
not fix the Keras backend before a caller has chosen it.
"""

import importlib

from dcmha.spec.reference import SPEC_VERSION

__version__ = "0.1.0"
_LAZY = {"DCMHA": "dcmha.layers", "DynamicWeightProjection": "dcmha.layers",
         "DCFormerLM": "dcmha.models", "DCFormerBlock": "dcmha.models",
         "SwiGLU": "dcmha.models", "RMSNorm": "dcmha.models",
         "from_official_state_dict": "dcmha.checkpoints",
         "ops": "dcmha.ops", "layers": "dcmha.layers", "models": "dcmha.models",
         "checkpoints": "dcmha.checkpoints", "distribution": "dcmha.distribution"}
_MODULES = ("ops", "layers", "models", "checkpoints", "distribution")
__all__ = ["SPEC_VERSION", "__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if name in _MODULES else getattr(module, name)
    raise AttributeError(f"module 'dcmha' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
