"""The compiled compose kernel's cache and loader (``dcmha.backends.cpu_kernel``) under the
Keras jax and tensorflow backends: the shared cases of ``tests/backends/kernel_cache_cases.py``
(on the plain C library), then the framework libraries of "jax_cpu" (XLA FFI handlers) and "tf_cpu"
(TensorFlow ops): the framework's version is in their cache key, their two views of the
argument block (C kernel, C++ wrapper) are checked against ctypes', and a damaged copy is
never accepted.

Runs with KERAS_BACKEND=jax or tensorflow (skipped on the others); needs a C compiler, and a
C++ compiler for the framework library cases (which reuse the library that "jax_cpu" /
"tf_cpu" loaded, from the user's cache).
"""

import ctypes
import importlib
import os
import shutil

import pytest

from tests.kernel_cases import cpu_path_or_skip

BACKEND, PATH, core = cpu_path_or_skip()

from tests.backends.kernel_cache_cases import *  # noqa: E402,F401,F403 - the shared cases run here
from tests.backends.kernel_cache_cases import _fields  # noqa: E402

from dcmha.backends import cpu_kernel  # noqa: E402
from dcmha.backends.cpu_kernel import calls  # noqa: E402

framework = importlib.import_module({"jax": "jaxlib", "tensorflow": "tensorflow"}[BACKEND])


@pytest.fixture(scope="module")
def framework_library():
    """(plan, path) of the library the core loaded (the user's cache, optimised build)."""
    if not core.load():
        pytest.skip(f"kernel: {core.unavailable_reason()}")
    the_plan, why = cpu_kernel.plan(core._recipe())
    path, why = cpu_kernel.build_library(core._recipe(), load=False)     # found, verified
    assert path is not None, why
    return the_plan, path


def test_framework_version_is_in_the_cache_key(monkeypatch):
    version = framework.__version__
    name = cpu_kernel.plan(core._recipe())[0].name
    assert f"{'jaxlib' if BACKEND == 'jax' else 'tensorflow'} {version}" in core._recipe().key_parts
    monkeypatch.setattr(framework, "__version__", version + ".post1")
    assert cpu_kernel.plan(core._recipe())[0].name != name
    monkeypatch.setattr(framework, "__version__", version)
    assert cpu_kernel.plan(core._recipe())[0].name == name


def test_framework_library_layouts_are_checked(framework_library, monkeypatch):
    the_plan, path = framework_library
    recipe = the_plan.recipe
    assert recipe.layouts == (cpu_kernel._C_LAYOUT, cpu_kernel._CXX_LAYOUT)
    lib = ctypes.CDLL(path)         # the handle the core opened (TensorFlow: already loaded)
    assert cpu_kernel.check_library(lib, recipe) is None
    real = calls._Args
    monkeypatch.setattr(calls, "_Args", type("_Args", (ctypes.Structure,), {
        "_fields_": _fields(swap=("kd_b", "kd_g"))}))
    detail = (f"field kd_b at offset {real.kd_b.offset} (size 8) there, {real.kd_g.offset} "
              f"(size 8) in ctypes; field kd_g at offset {real.kd_g.offset} (size 8) there, "
              f"{real.kd_b.offset} (size 8) in ctypes")
    assert cpu_kernel.check_library(lib, recipe) == (
        f"the {recipe.tag} library's Args layout (dcmha_args_layout) differs from ctypes' "
        f"_Args: {detail}")
    # the C++ wrapper's own view, checked the same way
    assert cpu_kernel._layout_mismatch(lib.dcmha_cxx_args_layout,
                                       lib.dcmha_cxx_args_names) == detail


@pytest.mark.parametrize("damage", ["truncated", "replaced"])
def test_damaged_framework_library_is_not_accepted(framework_library, libraries, cache,
                                                   damage):
    """A copy of the framework library and its record: accepted whole, refused damaged
    (found missing, so rebuilt: the rebuild itself is the shared cases' subject)."""
    the_plan, path = framework_library
    os.makedirs(cache, mode=0o700)
    for f in (path, os.path.join(os.path.dirname(path), the_plan.name + ".json")):
        shutil.copy2(f, cache)
    copy = os.path.join(cache, os.path.basename(path))
    assert cpu_kernel._lookup(str(cache), the_plan.name) == copy
    if damage == "truncated":
        os.truncate(copy, os.path.getsize(copy) // 2)
    else:
        shutil.copy(libraries.planted, copy)
    assert cpu_kernel._lookup(str(cache), the_plan.name) is None
