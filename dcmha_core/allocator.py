"""The C library's allocator in a process that trains on the CPU.

On a CPU, a framework's step takes its buffers from the C library's ``malloc`` (XLA's
scratch for a jitted step, TensorFlow's and PyTorch's CPU tensors). glibc's ``malloc``
serves a block above its mmap threshold (at most 32 MiB) by a fresh ``mmap`` and unmaps
it when it is freed, and gives the free top of its heap back to the system beyond its trim
threshold. Either way the next step writes to new pages, and the system faults in and
zeroes every 4 KiB of them: a step whose scratch outgrows the threshold pays for its
memory again on every step. (A jitted DCFormer++ step at 2 layers x 64, batch 16, T 64 has
38.6 MiB of XLA scratch and took about 9,400 page faults a step, about 15 of its 35 ms on
the machine of ``benchmarks/RESULTS.md``; Transformer++'s 31.5 MiB took none.)

``keep_step_memory()`` makes glibc keep such blocks for the next step, once per process:
``mallopt(M_MMAP_MAX, 0)`` (large blocks come from the heap, which is reused) and
``mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)`` (up to 1 GiB of freed heap top is kept). The
process then holds its peak memory between steps, as it does during each of them. The
DCMHA layer calls it when it is built on a CPU. It does nothing where the C library is not
glibc, where the environment configures glibc's malloc already (``GLIBC_TUNABLES`` with a
``glibc.malloc.`` setting, or a ``MALLOC_*_`` variable), or where ``DCMHA_MALLOC_TUNING=0``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional

__all__ = ["keep_step_memory", "TRIM_THRESHOLD", "why_not"]

#: mallopt's parameters (glibc's <malloc.h>).
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
#: Bytes of free heap top glibc keeps before returning memory to the system.
TRIM_THRESHOLD = 1 << 30
#: The environment variables with which a user configures glibc's malloc.
_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
                  "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")

_lock = threading.Lock()
_done: dict = {}


def _libc():
    """The process's C library when it is glibc (it has ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc


def why_not(environ=None) -> Optional[str]:
    """Why ``keep_step_memory`` leaves the allocator as it is (None: it does not)."""
    env = os.environ if environ is None else environ
    if env.get("DCMHA_MALLOC_TUNING", "1").strip() == "0":
        return "DCMHA_MALLOC_TUNING=0"
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES configures malloc"
    for name in _USER_SETTINGS:
        if name in env:
            return f"{name} configures malloc"
    return None


def keep_step_memory(libc=None) -> bool:
    """Make glibc keep large freed blocks for reuse (see the module doc), once per process.

    Returns whether the allocator is so configured (by this call or an earlier one); False
    where it is left alone (``why_not``), the C library is not glibc, or ``mallopt``
    refused a setting. ``libc``: the C library to configure (default: the process's).
    """
    with _lock:
        if "result" in _done:
            return _done["result"]
        ok = False
        if why_not() is None:
            libc = _libc() if libc is None else libc
            if libc is not None:
                # mallopt returns 1 on success, 0 on error
                ok = (libc.mallopt(M_MMAP_MAX, 0) == 1
                      and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
        _done["result"] = ok
        return ok
