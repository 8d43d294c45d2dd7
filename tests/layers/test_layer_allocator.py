"""``dcmha.allocator``: glibc keeps a CPU step's large blocks for the next step.

Its settings (``mallopt`` calls, once per process, left alone where the user configured
malloc or opted out), their effect on page faults (in a child process, so that this one's
allocator is not the one measured), and the DCMHA layer applying them when built on a CPU.
"""

import json
import subprocess
import sys

import pytest

from dcmha import allocator


class FakeLibc:
    def __init__(self, result=1):
        self.calls, self.result = [], result

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return self.result


@pytest.fixture
def fresh(monkeypatch):
    """A process state in which keep_step_memory has not run, with no malloc settings."""
    monkeypatch.setattr(allocator, "_done", {})
    for name in ("DCMHA_MALLOC_TUNING", "GLIBC_TUNABLES", *allocator._USER_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_settings_are_applied_once(fresh):
    libc = FakeLibc()
    assert allocator.keep_step_memory(libc) is True
    assert libc.calls == [(allocator.M_MMAP_MAX, 0),
                          (allocator.M_TRIM_THRESHOLD, allocator.TRIM_THRESHOLD)]
    assert allocator.keep_step_memory(libc) is True
    assert len(libc.calls) == 2


def test_a_refused_setting_reports_false(fresh):
    libc = FakeLibc(result=0)
    assert allocator.keep_step_memory(libc) is False
    assert libc.calls == [(allocator.M_MMAP_MAX, 0)]


@pytest.mark.parametrize("name,value,reason", [
    ("DCMHA_MALLOC_TUNING", "0", "DCMHA_MALLOC_TUNING=0"),
    ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2", "GLIBC_TUNABLES configures malloc"),
    ("MALLOC_TRIM_THRESHOLD_", "1000", "MALLOC_TRIM_THRESHOLD_ configures malloc"),
    ("MALLOC_ARENA_MAX", "4", "MALLOC_ARENA_MAX configures malloc"),
])
def test_user_settings_are_left_alone(fresh, name, value, reason):
    fresh.setenv(name, value)
    assert allocator.why_not() == reason
    libc = FakeLibc()
    assert allocator.keep_step_memory(libc) is False
    assert libc.calls == []


def test_other_tunables_do_not_count(fresh):
    fresh.setenv("GLIBC_TUNABLES", "glibc.rtld.nns=2")
    fresh.setenv("DCMHA_MALLOC_TUNING", "1")
    assert allocator.why_not() is None


CHILD = r"""
import ctypes, json, resource, sys
from dcmha import allocator
tuned = allocator.keep_step_memory() if sys.argv[1] == "tuned" else False
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
SIZE = 40 << 20                      # above glibc's largest mmap threshold (32 MiB)
faults = []
for step in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"tuned": tuned, "faults": faults}))
"""


def _child(mode):
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("GLIBC_TUNABLES", "DCMHA_MALLOC_TUNING", *allocator._USER_SETTINGS)}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         timeout=120, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(allocator._libc() is None, reason="the C library is not glibc")
def test_a_large_block_is_reused_without_faulting_its_pages_again():
    pages = (40 << 20) // 4096
    plain, tuned = _child("plain"), _child("tuned")
    assert tuned["tuned"] is True
    # untuned: every step maps and faults the block anew; tuned: only the first step does
    assert min(plain["faults"][1:]) > pages // 2, plain
    assert max(tuned["faults"][1:]) < pages // 20, tuned


def test_the_layer_applies_the_settings_on_a_cpu(monkeypatch):
    from dcmha import DCMHA, framework

    called = []
    monkeypatch.setattr(allocator, "keep_step_memory", lambda: called.append(True))
    DCMHA(num_heads=2, key_dim=4).build((1, 3, 8), (1, 3, 8))
    assert called == ([True] if framework.device() == "cpu" else [])
