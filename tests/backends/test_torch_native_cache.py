"""The compiled compose kernel's cache and loader (``dcmha.backends.cpu_kernel``) under the
Keras torch backend, whose "torch" core calls the kernel through ctypes: the shared cases of
``tests/backends/kernel_cache_cases.py`` (a verified cache, damaged and planted libraries, untrusted
directories, refused libraries, complete reasons), then the torch core itself falling back
when the cached library is refused.

Runs with KERAS_BACKEND=torch (skipped on the other Keras backends); needs a C compiler.
"""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("the torch-native core runs on the Keras torch backend", allow_module_level=True)
torch = pytest.importorskip("torch")

from tests import kernel_cases  # noqa: E402
from tests.backends.kernel_cache_cases import *  # noqa: E402,F401,F403 - the shared cases run here
from tests.backends.kernel_cache_cases import plant  # noqa: E402

from dcmha.backends import cpu_kernel  # noqa: E402
from dcmha.backends.torch_native import dcmha_torch  # noqa: E402


def test_torch_core_falls_back_when_the_library_lacks_symbols(golden, libraries, cache):
    """A refused library (no kernel symbols): the core runs its PyTorch ops, no
    AttributeError, and its result is the spec's."""
    plant(libraries.no_symbols, cache, golden.name)
    p = kernel_cases.make_problem(3, S=40)
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    assert dcmha_torch._kernel(t(p["q"])) is None
    assert "lacks the symbols dcmha_compose_forward" in cpu_kernel.unavailable_reason()
    o = dcmha_torch.dcmha_attention(
        t(p["q"]), t(p["k"]), t(p["v"]), num_groups=p["G"], block_q=4,
        pre={n: t(x) for n, x in p["pre"].items()}, post={n: t(x) for n, x in p["post"].items()})
    expected, sigma = kernel_cases.spec_result(p, kernel_cases.full_mask(p), scores=False)
    kernel_cases.assert_close({"output": o.numpy().astype(np.float64)},
                              {"output": expected["output"]}, "float32", sigma,
                              "torch core (kernel refused) vs spec")
