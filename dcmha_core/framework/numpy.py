"""The seam's module for Keras's NumPy backend: the defaults (``_common``)."""

from dcmha.framework._common import *  # noqa: F401,F403
from dcmha.framework._common import __all__  # noqa: F401
