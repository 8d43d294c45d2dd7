"""The compiled CPU kernel's cache and loader (``dcmha.backends.cpu_kernel``), as test cases
shared by ``test_torch_native_cache.py`` (torch) and ``test_cpu_paths_cache.py`` (jax,
tensorflow): those files import every name of this module, so pytest runs these cases there.

The kernel library here is the plain C one (``compose_recipe``, loaded with ctypes; no
framework needed). Every test gets a fresh cache directory (``DCMHA_CACHE_DIR`` under
``tmp_path``), fresh in-process state (``cpu_kernel._reset()``) and builds at ``-O0`` (a
second, where ``-O3`` takes 15: the optimised build is tested by test_torch_native and
test_cpu_paths). A warm cache is a copy of the library built once per module (``golden``).
A process that might crash while loading a damaged library runs as a subprocess, so a
regression fails the test instead of killing pytest.

A "planted" library is a valid library of another origin whose constructor and entry points
append to the file ``$DCMHA_TEST_MARKER``: it must never run, so the marker must never exist
(``test_planted_library_runs_when_loaded`` shows that loading it does write the marker).
"""

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import warnings

import numpy as np
import pytest

from dcmha.backends import cpu_kernel
from dcmha.backends.cpu_kernel import build, calls
from dcmha.spec import reference
from tests.kernel_cases import assert_close

# Tests that want the kernel's warnings record them; the others provoke them on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::dcmha.backends.cpu_kernel.KernelWarning")

C_COMPILER = next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
if C_COMPILER is None:
    pytest.skip("no C compiler on this machine", allow_module_level=True)

PLANTED_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include "dcmha_args.h"

static void mark(const char *what) {
    const char *path = getenv("DCMHA_TEST_MARKER");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (f) { fputs(what, f); fclose(f); }
}
__attribute__((constructor)) static void planted(void) { mark("constructor\n"); }
int dcmha_compose_forward(const Args *a) { (void)a; mark("forward\n"); return 0; }
int dcmha_compose_backward(const Args *a) { (void)a; mark("backward\n"); return 0; }
DCMHA_DEFINE_ARGS_LAYOUT(dcmha_args_layout, dcmha_args_names)
"""
NO_SYMBOLS_SOURCE = "int dcmha_unrelated(void) { return 0; }\n"
OPT = ("-O0",)
PRIVATE_PREFIX = os.path.join(tempfile.gettempdir(), "dcmha-kernel-")


def compile_library(source, out):
    """``source`` (C text) compiled to the shared library ``out`` (csrc/ on the include path)."""
    src = str(out) + ".c"
    with open(src, "w") as f:
        f.write(source)
    subprocess.run([C_COMPILER, "-shared", "-fPIC", f"-I{cpu_kernel.CSRC}", src, "-o", str(out)],
                   check=True, capture_output=True, timeout=120)
    return str(out)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """A cache directory holding the compose library (-O0) and its record, built once."""
    directory = tmp_path_factory.mktemp("golden") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DCMHA_CACHE_DIR", str(directory))
        mp.setenv("DCMHA_CPU_KERNEL", "1")
        mp.delenv("CC", raising=False)
        mp.setattr(build, "_OPT", OPT)
        cpu_kernel._reset()
        path, reason = cpu_kernel.build_library(cpu_kernel.compose_recipe(), load=False)
        assert path is not None, reason
        name = cpu_kernel.plan(cpu_kernel.compose_recipe())[0].name
        cpu_kernel._reset()
    return types.SimpleNamespace(dir=directory, name=name, library=os.path.basename(path))


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """Paths of the planted library and of one without the kernel's symbols."""
    d = tmp_path_factory.mktemp("foreign")
    return types.SimpleNamespace(planted=compile_library(PLANTED_SOURCE, d / "planted.so"),
                                 no_symbols=compile_library(NO_SYMBOLS_SOURCE, d / "bare.so"))


@pytest.fixture(autouse=True)
def cache(monkeypatch, tmp_path):
    """A fresh cache directory (not created yet), fresh state, -O0 builds, a marker path."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("DCMHA_CACHE_DIR", str(directory))
    monkeypatch.setenv("DCMHA_CPU_KERNEL", "1")
    monkeypatch.setenv("DCMHA_TEST_MARKER", str(tmp_path / "marker"))
    for var in ("CC", "CXX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(build, "_OPT", OPT)
    cpu_kernel._reset()
    yield directory
    cpu_kernel._reset()


def marker_written():
    return os.path.exists(os.environ["DCMHA_TEST_MARKER"])


def warm(golden, directory):
    """``directory``: a copy of the golden cache (mode 0700). Returns the library's path."""
    shutil.copytree(golden.dir, directory)
    os.chmod(directory, 0o700)
    return os.path.join(directory, golden.library)


def plant(library, directory, name):
    """Install a copy of ``library`` as ``name`` in ``directory``, with a record that matches
    it (as an intruder who can write there would). Returns the planted path."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    copy = os.path.join(directory, "incoming.so")
    shutil.copy(library, copy)
    return cpu_kernel._install(str(directory), name, copy)


def load_recording_warnings():
    """(cpu_kernel.load(), [messages of the KernelWarnings it gave])."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = cpu_kernel.load()
    return lib, [str(w.message) for w in caught if issubclass(w.category, cpu_kernel.KernelWarning)]


class _Strided:
    """A NumPy array seen as ``cpu_kernel``'s calls see a tensor (data_ptr, stride, shape)."""

    def __init__(self, a):
        self.a, self.shape = a, a.shape

    def data_ptr(self):
        return self.a.ctypes.data

    def stride(self):
        return tuple(s // self.a.itemsize for s in self.a.strides)


def assert_computes_compose(lib, seed=0):
    """The library's forward on a block with a static and every key-side term (S = 37: the
    vectorised keys and the generic tail) against the spec's compose, float32 tolerance."""
    rng = np.random.default_rng(seed)
    B, N, G, T, S, R = 2, 4, 2, 3, 37, 2
    M = N // G
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    a, static = f32(B, N, T, S), f32(G, M, M)
    kw1, kw2, kdd = f32(B, S, G, R, M), f32(B, S, G, R, M), f32(B, S, G, M)
    f64 = lambda x: x.astype(np.float64)  # noqa: E731
    expected = reference.compose(f64(a), G, kw1=f64(kw1), kw2=f64(kw2), kdd=f64(kdd),
                                 static=f64(static))
    # wq (B, T, N, N): out[n] = sum_m wq[n, m] x[m] in each group's diagonal block, i.e. the
    # residual plus the static term W[g, m, n]
    wq = np.zeros((B, T, N, N), np.float32)
    for g in range(G):
        wq[:, :, g * M:(g + 1) * M, g * M:(g + 1) * M] = np.eye(M, dtype=np.float32) + static[g].T
    terms = (wq, np.ascontiguousarray(kw1.transpose(0, 2, 3, 4, 1)),
             np.ascontiguousarray(kw2.transpose(0, 2, 3, 4, 1)),
             np.ascontiguousarray(kdd.transpose(0, 2, 3, 1)))
    out = np.full((B, T, N, S), np.nan, np.float32)
    cpu_kernel.compose_forward(lib, _Strided(a.transpose(0, 2, 1, 3)), _Strided(out),
                               tuple(_Strided(t) for t in terms), G, R)
    got = out.transpose(0, 2, 1, 3).astype(np.float64)
    assert_close({"scores": got}, {"scores": expected}, "float32", 0.0, "C kernel vs spec")


_ISOLATED = """
import json
from dcmha.backends import cpu_kernel
from dcmha.backends.cpu_kernel import build
build._OPT = {opt!r}
lib = cpu_kernel.load()
for _ in range({repeat} - 1):       # again, as a second path of the process would
    cpu_kernel._STATE.clear()
    lib = cpu_kernel.load()
print(json.dumps({{"path": None if lib is None else lib._name,
                  "reason": cpu_kernel.unavailable_reason(),
                  "private": cpu_kernel._PRIVATE.get("dir")}}))
"""


def load_in_subprocess(repeat=1):
    """``cpu_kernel.load()`` in a fresh process (this environment): (its report, stderr).
    Fails, rather than crashes, if that process dies."""
    res = subprocess.run([sys.executable, "-W", "always::RuntimeWarning", "-c",
                          _ISOLATED.format(opt=OPT, repeat=repeat)],
                         capture_output=True, text=True, timeout=300)
    how = (f"was killed by signal {-res.returncode}" if res.returncode < 0
           else f"exited with status {res.returncode}")
    assert res.returncode == 0, f"the loading process {how}:\n{res.stderr[-3000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


# ---------------------------------------------------------------------------
# A trusted cache: used as it is, repaired when damaged
# ---------------------------------------------------------------------------

def test_verified_library_is_loaded_from_the_cache(golden, cache):
    path = warm(golden, cache)
    lib, given = load_recording_warnings()
    assert lib is not None, cpu_kernel.unavailable_reason()
    assert cpu_kernel.LIBRARIES == {golden.name: path} and lib._name == path
    assert given == []
    assert_computes_compose(lib)


@pytest.mark.parametrize("damage", ["truncated", "replaced by a planted library"])
def test_damaged_library_is_rebuilt_and_never_loaded(golden, libraries, cache, damage):
    path = warm(golden, cache)
    size = os.path.getsize(path)
    if damage == "truncated":       # a full disk, a killed copy: loading it is a SIGBUS
        os.truncate(path, size // 2)
    else:
        shutil.copy(libraries.planted, path)
    report, _ = load_in_subprocess()
    assert report["reason"] is None and report["path"] == path
    assert not marker_written()
    assert os.path.getsize(path) == size
    lib, given = load_recording_warnings()
    assert lib._name == path and given == []
    assert_computes_compose(lib)
    assert not marker_written()


@pytest.mark.parametrize("record", ["garbage", "naming a file outside the cache"])
def test_damaged_record_is_rebuilt(golden, libraries, cache, tmp_path, record):
    path = warm(golden, cache)
    text = "{not json"
    if record != "garbage":         # a whole record, but of a library elsewhere
        outside = plant(libraries.planted, tmp_path / "elsewhere", golden.name)
        with open(os.path.join(tmp_path / "elsewhere", golden.name + ".json")) as f:
            entry = json.load(f)
        text = json.dumps(dict(entry, library=os.path.relpath(outside, cache)))
    with open(os.path.join(cache, golden.name + ".json"), "w") as f:
        f.write(text)
    lib, given = load_recording_warnings()
    assert lib is not None and lib._name == path and given == []
    assert_computes_compose(lib)
    assert not marker_written()


# ---------------------------------------------------------------------------
# An untrusted cache: a private build, one warning, nothing planted runs
# ---------------------------------------------------------------------------

UNTRUSTED = {
    "group-writable directory": lambda d, lib, record: os.chmod(d, 0o770),
    "library writable by others": lambda d, lib, record: os.chmod(lib, 0o757),
    "record is a symbolic link": lambda d, lib, record: (
        os.replace(record, record + ".real"), os.symlink(record + ".real", record)),
    "another owner": lambda d, lib, record: (os.chown(lib, 65534, 65534),
                                             os.chown(record, 65534, 65534)),
}
WHY = {
    "group-writable directory": "it is writable by group (mode 0770)",
    "library writable by others": "{lib} is writable by others (mode 0757)",
    "record is a symbolic link": "{record} is a symbolic link",
    "another owner": "{record} belongs to uid 65534, not to this user (uid 0)",
}


@pytest.mark.parametrize("how", list(UNTRUSTED))
def test_planted_library_in_an_untrusted_cache_never_runs(golden, libraries, cache, how):
    if how == "another owner" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    planted = plant(libraries.planted, cache, golden.name)
    record = os.path.join(cache, golden.name + ".json")
    UNTRUSTED[how](str(cache), planted, record)
    lib, given = load_recording_warnings()
    assert not marker_written()
    assert lib is not None, cpu_kernel.unavailable_reason()
    assert lib._name.startswith(PRIVATE_PREFIX)
    why = WHY[how].format(lib=planted, record=record)
    assert given == [f"dcmha: not using the kernel cache {cache}: {why}; the kernel is built "
                     f"in a private temporary directory, removed at exit"]
    assert_computes_compose(lib)
    # a second library of the process reuses the private directory, without a new warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again, _ = cpu_kernel.build_library(cpu_kernel.compose_recipe(), load=False)
    assert again == lib._name and caught == []
    assert not marker_written()


def test_private_build_is_removed_at_exit_and_warned_once(golden, cache):
    warm(golden, cache)
    os.chmod(cache, 0o775)
    report, stderr = load_in_subprocess(repeat=2)
    assert report["reason"] is None
    assert report["path"].startswith(report["private"] + os.sep)
    assert report["private"].startswith(PRIVATE_PREFIX)
    assert not os.path.exists(report["private"])
    assert stderr.count("KernelWarning") == 1, stderr
    assert f"not using the kernel cache {cache}: it is writable by group (mode 0775)" in stderr


def test_planted_library_runs_when_loaded(libraries):
    """The control of the planted cases: loading the planted library does write the marker."""
    code = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, libraries.planted], check=True, timeout=60)
    with open(os.environ["DCMHA_TEST_MARKER"]) as f:
        assert f.read() == "constructor\n"


def test_cache_directory_is_chosen_and_created_private(monkeypatch, tmp_path):
    monkeypatch.delenv("DCMHA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu_kernel.cache_dir() == str(tmp_path / "xdg" / "dcmha")
    assert cpu_kernel._trusted_dir(cpu_kernel.cache_dir()) == (cpu_kernel.cache_dir(), None)
    assert os.stat(cpu_kernel.cache_dir()).st_mode & 0o777 == 0o700
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")      # ignored, as XDG says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cpu_kernel.cache_dir() == str(tmp_path / "home" / ".cache" / "dcmha")


# ---------------------------------------------------------------------------
# Refused libraries and complete reasons
# ---------------------------------------------------------------------------

def test_library_without_the_symbols_falls_back(golden, libraries, cache):
    path = plant(libraries.no_symbols, cache, golden.name)
    lib, given = load_recording_warnings()
    assert lib is None
    reason = (f"the compose library {path} lacks the symbols dcmha_compose_forward, "
              f"dcmha_compose_backward, dcmha_fill_args, dcmha_cached_scratch, "
              f"dcmha_cached_args, dcmha_compose_cached, dcmha_decode_probs, "
              f"dcmha_dynamic_weights, dcmha_dynamic_finish, dcmha_block_probs_slices, "
              f"dcmha_query_matrix, dcmha_query_matrix_backward, dcmha_args_layout, "
              f"dcmha_args_names")
    assert cpu_kernel.unavailable_reason() == reason
    assert given == [f"dcmha: the compiled CPU kernel (compose) is unavailable, so the slower "
                     f"framework code runs: {reason}"]


def _fields(swap=(), extra=()):
    """ctypes' Args fields with two swapped and extra ones appended."""
    fields = list(cpu_kernel._FIELDS)
    if swap:
        i, j = (next(k for k, (n, _) in enumerate(fields) if n == s) for s in swap)
        fields[i], fields[j] = fields[j], fields[i]
    return fields + [(n, ctypes.c_int64) for n in extra]


@pytest.mark.parametrize("change", ["swapped fields", "an extra field"])
def test_args_layout_mismatch_is_refused(golden, cache, monkeypatch, change):
    """ctypes' ``_Args`` no longer the header's: the library is refused, naming the fields."""
    warm(golden, cache)
    real = calls._Args
    monkeypatch.setattr(calls, "_Args", type("_Args", (ctypes.Structure,), {
        "_fields_": _fields(swap=("x_b", "x_i")) if change == "swapped fields"
        else _fields(extra=("spare",))}))
    assert cpu_kernel.load() is None
    if change == "swapped fields":
        detail = (f"field x_b at offset {real.x_b.offset} (size 8) there, {real.x_i.offset} "
                  f"(size 8) in ctypes; field x_i at offset {real.x_i.offset} (size 8) there, "
                  f"{real.x_b.offset} (size 8) in ctypes")
    else:
        size = ctypes.sizeof(real)
        detail = f"sizeof(Args) is {size} there, {size + 8} in ctypes; fields only in ctypes: spare"
    assert cpu_kernel.unavailable_reason() == (
        f"the compose library's Args layout (dcmha_args_layout) differs from ctypes' _Args: "
        f"{detail}")


def test_failing_compiler_gives_its_status(monkeypatch):
    if not os.path.exists("/bin/false"):
        pytest.skip("no /bin/false")
    monkeypatch.setenv("CC", "/bin/false")
    lib, given = load_recording_warnings()
    reason = ("compiling the compose kernel failed: /bin/false exited with status 1 and "
              "printed nothing")
    assert lib is None and cpu_kernel.unavailable_reason() == reason
    assert given == [f"dcmha: the compiled CPU kernel (compose) is unavailable, so the slower "
                     f"framework code runs: {reason}"]


def test_compiler_with_arguments_is_used_whole(monkeypatch):
    plain = cpu_kernel.plan(cpu_kernel.compose_recipe())[0]
    monkeypatch.setenv("CC", f"{os.path.basename(C_COMPILER)} -O2")
    with_flags = cpu_kernel.plan(cpu_kernel.compose_recipe())[0]
    assert with_flags.commands == ((C_COMPILER, "-O2"),) and with_flags.name != plain.name
    lib = cpu_kernel.load()
    assert lib is not None, cpu_kernel.unavailable_reason()
    assert_computes_compose(lib)
    # an argument the compiler refuses: its own message names it (so it was passed)
    monkeypatch.setenv("CC", f"{C_COMPILER} --dcmha-no-such-option")
    cpu_kernel._reset()
    assert cpu_kernel.load() is None
    reason = cpu_kernel.unavailable_reason()
    assert reason.startswith(f"compiling the compose kernel failed: {C_COMPILER} "
                             f"--dcmha-no-such-option exited with status ")
    assert "--dcmha-no-such-option" in reason.split(":", 2)[2]


@pytest.mark.parametrize("value,reason", [
    ("no-such-compiler-dcmha -O2",
     "$CC='no-such-compiler-dcmha -O2': 'no-such-compiler-dcmha' is not a program on PATH"),
    ("'cc", "$CC=\"'cc\" is not a valid command line (No closing quotation)"),
])
def test_unusable_compiler_variable_is_refused(monkeypatch, value, reason):
    monkeypatch.setenv("CC", value)
    assert cpu_kernel.load() is None
    assert cpu_kernel.unavailable_reason() == reason


def test_cache_key_covers_compiler_identity_and_flags(monkeypatch):
    name = cpu_kernel.plan(cpu_kernel.compose_recipe())[0].name
    identity = build._compiler_identity
    monkeypatch.setattr(build, "_compiler_identity", lambda argv: "cc 0.0 (status 0)")
    assert cpu_kernel.plan(cpu_kernel.compose_recipe())[0].name != name
    monkeypatch.setattr(build, "_compiler_identity", identity)
    assert cpu_kernel.plan(cpu_kernel.compose_recipe())[0].name == name
    monkeypatch.setattr(build, "_OPT", ("-O1",))
    assert cpu_kernel.plan(cpu_kernel.compose_recipe())[0].name != name


def test_disabled_kernel_is_silent(monkeypatch):
    monkeypatch.setenv("DCMHA_CPU_KERNEL", "0")
    lib, given = load_recording_warnings()
    assert lib is None and given == []
    assert cpu_kernel.unavailable_reason() == "disabled by DCMHA_CPU_KERNEL"
