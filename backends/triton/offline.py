"""Compiling the fused Triton kernels for a GPU on a machine without one.

``compile_only()`` makes every launch of ``dcmha_triton`` compile its kernel for CUDA
sm_90 (Triton's ``warmup``: the specialisation, cache key and compile pipeline of a
first launch on an H100 / H200) and never run it, so that the host code of a call
(``dcmha_attention_call``, forward and backward) can be driven with CPU tensors of the
real shapes. ``benchmarks/compile_time.py`` times the compiles this way, and
``tests/test_triton_compile.py`` checks which calls share a compiled kernel.

Triton must be loaded compiled (``TRITON_INTERPRET`` unset) in the process.
"""

from __future__ import annotations

import contextlib

__all__ = ["Sm90Driver", "compile_only"]


class Sm90Driver:
    """What Triton's active driver answers while compiling, for an sm_90 GPU (device 0)."""

    def __init__(self, arch: int = 90):
        self.arch = arch

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", self.arch, 32)


@contextlib.contextmanager
def compile_only(arch: int = 90, measure=None):
    """Within the block, ``dcmha_triton``'s launches compile for CUDA sm_``arch`` only.

    Yields a list that gets one entry per launch: (kernel name, ``measure()`` entered
    around the compile or None, whether the kernel's in-process cache already held it).
    ``measure``: a context-manager factory (e.g. a timer), or None.
    """
    from triton.runtime.driver import driver

    from . import dcmha_triton as kernels

    if kernels._interpreting():
        raise RuntimeError("compile_only needs Triton loaded compiled: unset TRITON_INTERPRET "
                           "before Triton is first imported")
    log = []

    def launch(kernel, grid, *args, **meta):
        cache = kernel.device_caches[0][0]
        before = len(cache)
        probe = measure() if measure is not None else contextlib.nullcontext()
        with probe:
            kernel.warmup(*args, grid=grid, **meta)
        log.append((kernel.__name__, probe if measure is not None else None,
                    len(cache) == before))

    saved, active = kernels._launch, driver._active   # no default driver without a GPU
    driver.set_active(Sm90Driver(arch))
    kernels._launch = launch
    try:
        yield log
    finally:
        kernels._launch = saved
        driver._active = active
