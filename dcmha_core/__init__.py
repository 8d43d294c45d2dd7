"""dcmha: Dynamically Composable Multi-Head Attention for Keras 3."""

from dcmha.spec.reference import SPEC_VERSION

__version__ = "0.1.0"
__all__ = ["SPEC_VERSION", "__version__"]
