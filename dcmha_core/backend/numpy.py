"""The seam's module for Keras's NumPy backend: the defaults (``_common``)."""

from dcmha.backend._common import *  # noqa: F401,F403
from dcmha.backend._common import __all__  # noqa: F401
