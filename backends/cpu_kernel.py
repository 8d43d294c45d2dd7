"""A compiled C kernel for the compose of one score block (CPU, float32), and its cache.

The CPU cores (``torch_native``, ``jax_cpu``, ``tf_cpu``) spend most of a call in the two
composes: done with framework ops they are a handful of arithmetic operations per score
entry spread over a dozen elementwise passes (and, for the query side, a batched 8x8 GEMM
per query). The kernel fuses a block's compose, and its backward, into one pass over the
block (``csrc/compose.c`` says how).

Sources
-------
C and C++ files in ``csrc/`` beside this module (package data), each compilable on its own:
``dcmha_args.h`` (the argument block ``Args``, shared with ctypes' ``_Args`` below),
``compose.c`` (the kernel), ``compose_wrap.h`` (what the C++ wrappers share), ``xla_ffi.cc``
(XLA FFI handlers), ``tf_op.cc`` (TensorFlow ops) and ``ort_op.cc`` (onnxruntime custom ops).
Four libraries are built from them,
each described by a ``Recipe``:

* ``compose_recipe()``, loaded by ``load()``: the kernel alone, called through ``ctypes`` by
  ``dcmha_torch`` (calls release the GIL, so its block threads run them in parallel);
* ``ffi_recipe(include_dir, jaxlib_version)``: the kernel with XLA FFI handlers, registered
  by ``jax_cpu`` as ``jax.ffi`` targets;
* ``tf_recipe(compile_flags, link_flags, tf_version)``: the kernel as TensorFlow ops, loaded
  by ``tf_cpu`` with ``tf.load_op_library``;
* ``ort_recipe(ort_version)``: the kernel as onnxruntime custom ops (``ort_op.cc``), which
  ``dcmha.export.ort_ops`` registers in onnxruntime sessions.

Building
--------
``build_library(recipe)`` compiles on first use with the system compilers: ``$CC`` (else
``cc``, ``gcc``, ``clang``) for the kernel (``-O3 -march=native``, ``_OPT``), ``$CXX``
(else ``c++``, ``g++``, ``clang++``) for the wrappers. A ``$CC`` / ``$CXX`` with arguments
(``"ccache gcc"``, ``"gcc -m32"``) is split like a shell command line and used whole; one
that names no program is refused with the reason (never replaced by another compiler).

The cache
---------
Directory: ``$DCMHA_CACHE_DIR``, else ``$XDG_CACHE_HOME/dcmha`` (an absolute
``XDG_CACHE_HOME``), else ``~/.cache/dcmha``; created with mode 0700. A library's name
``dcmha_<tag>_<key>`` carries a key over its sources, flags, each compiler's command line
and ``--version`` output, the CPU model and flags (``-march=native``) and the framework
version (jaxlib for the FFI library, TensorFlow for the ops). Each build writes the library
as ``<name>-<sha256 prefix>.so`` and then a record ``<name>.json`` with its file name, size
and SHA-256, each renamed into place (atomic), so a reader sees a whole record naming a
whole file. Before every load, and never after:

* the directory (symbolic links resolved) must belong to this user and not be writable by
  group or others, and every directory above it must belong to this user or root and not be
  writable by group or others unless sticky (``/tmp``), as ssh treats ``~/.ssh``;
* the record and the library must be regular files of this user, not writable by group or
  others;
* the library's size and SHA-256 must equal its record's.

A library that fails only the last rule (damaged: a full disk, a killed copy; or replaced)
is rebuilt in place and never opened. If the directory or an entry fails the ownership
rules, or the directory cannot be created or written, the library is built in a private
temporary directory of the process (``mkdtemp``, 0700), loaded from there and removed at
exit, with one ``KernelWarning`` per process saying why. A loaded library must export the
recipe's symbols, and its view of ``Args`` (size, and each field's offset and size, as
compiled by the C compiler and, in the wrappers, by the C++ compiler) must equal ctypes';
otherwise it is refused with the reason.

Fallback
--------
Without a usable library (no compiler, a failed build, a refused library) the cores fall
back (torch: its PyTorch ops; jax and tensorflow: ``implementation="auto"`` takes the other
paths), ``unavailable_reason()`` says why, and one ``KernelWarning`` per process and reason
is emitted. ``DCMHA_CPU_KERNEL=0`` switches the kernels off silently. Kernel and fallback
agree within float32 rounding (the tests run both).

Tests reset every in-process state with ``_reset()`` (the loaded kernel, the warnings
given, the private directory, compiler identities, ``LIBRARIES``: the verified path of each
library obtained) after pointing ``DCMHA_CACHE_DIR`` at a fresh directory, and may set
``_OPT = ("-O0",)`` to build the kernel in a second (``tests/kernel_cache_cases.py``).

Array conventions (all float32, last axis contiguous, strides in elements, passed in
``Args``): a block is x (B, t, N, s) with head n = g * M + m at stride ``x_n``; ``wq`` (B,
t, [G,] M, M) holds out[n] = sum_m wq[n, m] x[m] for group g's block at offset ``wq_g``
(torch: the diagonal blocks of a dense (N, N) matrix); kw1 / kw2 (B, G, R, M, s) and kdd
(B, G, M, s) are the key-side terms of the block's key columns.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import errno
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import Optional

__all__ = ["load", "unavailable_reason", "compose_forward", "compose_backward",
           "decode_probs", "dynamic_weights", "dynamic_finish", "dynamic_sizes", "DYNAMIC_ROWS",
           "cached_flags", "CACHED_TERMS", "disabled",
           "KernelWarning", "Recipe", "Plan", "compose_recipe", "ffi_recipe", "tf_recipe",
           "ort_recipe", "plan", "build_library", "check_library", "fallback", "cache_dir",
           "CSRC"]

#: The C / C++ sources (package data beside this module).
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")

#: Optimisation flags of the C kernel (part of the cache key).
_OPT = ("-O3", "-march=native")
#: Seconds one compiler run may take.
_TIMEOUT_S = 300
_CC = ("CC", "C", ("cc", "gcc", "clang"))
_CXX = ("CXX", "C++", ("c++", "g++", "clang++"))
_KERNEL_SYMBOLS = ("dcmha_compose_forward", "dcmha_compose_backward", "dcmha_fill_args",
                   "dcmha_cached_scratch", "dcmha_cached_args", "dcmha_compose_cached",
                   "dcmha_decode_probs", "dcmha_dynamic_weights", "dcmha_dynamic_finish")
#: The (layout, names) functions of DCMHA_DEFINE_ARGS_LAYOUT: the C kernel's, a C++ wrapper's.
_C_LAYOUT = ("dcmha_args_layout", "dcmha_args_names")
_CXX_LAYOUT = ("dcmha_cxx_args_layout", "dcmha_cxx_args_names")
_WRAP_HEADERS = ("dcmha_args.h", "compose_wrap.h")
_RECORD_MAX_BYTES = 4096


class KernelWarning(RuntimeWarning):
    """The compiled CPU kernel is unavailable (a slower path runs), or its cache is not
    trusted (it is built privately); given once per process and reason."""


@dataclasses.dataclass(frozen=True)
class _Step:
    """One compiler run: ``source`` (a file of ``csrc``, with the ``headers`` it includes)
    compiled by ``compiler`` (``_CC`` / ``_CXX``) with ``flags`` (``{obj}``: the previous
    step's output) and ``libs`` after the source."""
    compiler: tuple
    flags: tuple
    source: str
    headers: tuple = ()
    libs: tuple = ()


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A library to build: its steps (the last one's output is the library), the extra
    parts of its cache key, the symbols it must export, the ``Args`` layouts (pairs of
    layout / names functions) checked against ctypes' ``_Args`` when it is loaded, and what
    runs instead when it is unavailable (the ``KernelWarning``'s words)."""
    tag: str
    steps: tuple
    key_parts: tuple = ()
    symbols: tuple = ()
    layouts: tuple = ()
    instead: str = "the slower framework code runs"


@dataclasses.dataclass(frozen=True)
class Plan:
    """A recipe resolved for this machine: the compilers' command lines (one per step), the
    source texts (per step, (file name, text) pairs, read once: what is hashed is what is
    compiled) and the cache name ``dcmha_<tag>_<key>``."""
    recipe: Recipe
    commands: tuple
    texts: tuple
    name: str


def _kernel_step(shared: bool) -> _Step:
    """The C kernel, as a shared library or (for the C++ wrappers) an object file."""
    flags = (*_OPT, "-fopenmp-simd", "-std=c11", "-fPIC", "-shared" if shared else "-c")
    return _Step(_CC, flags, "compose.c", ("dcmha_args.h",), ("-lm",) if shared else ())


def compose_recipe() -> Recipe:
    """The kernel alone (for ctypes)."""
    return Recipe("compose", (_kernel_step(True),), symbols=(*_KERNEL_SYMBOLS, *_C_LAYOUT),
                  layouts=(_C_LAYOUT,))


def _wrapper_recipe(tag, source, flags, libs, key_parts, symbols) -> Recipe:
    # "{obj}": the kernel's object file (no recognised suffix: passed to the linker)
    step = _Step(_CXX, ("-O2", "-std=c++17", "-shared", "-fPIC", *flags, "{obj}"), source,
                 _WRAP_HEADERS, tuple(libs))
    return Recipe(tag, (_kernel_step(False), step), tuple(key_parts),
                  (*symbols, *_KERNEL_SYMBOLS, *_C_LAYOUT, *_CXX_LAYOUT), (_C_LAYOUT, _CXX_LAYOUT))


def ffi_recipe(include_dir: str, jaxlib_version: str) -> Recipe:
    """The kernel with its XLA FFI handlers (``DcmhaComposeForward`` / ``Backward``), built
    against jaxlib's FFI headers in ``include_dir``."""
    return _wrapper_recipe("compose_xla_ffi", "xla_ffi.cc", [f"-I{include_dir}"], (),
                           (f"jaxlib {jaxlib_version}", include_dir),
                           ("DcmhaComposeForward", "DcmhaComposeBackward", "DcmhaDecodeProbs"))


def tf_recipe(compile_flags, link_flags, tf_version: str) -> Recipe:
    """The kernel as TensorFlow ops (``csrc/tf_op.cc``), built with ``tf.sysconfig``'s flags.
    Build it with ``load=False``: ``tf.load_op_library`` must be the first to open it."""
    # -w: TensorFlow's headers warn about their own deprecations by the hundred
    return _wrapper_recipe("compose_tf", "tf_op.cc", ["-w", *compile_flags], link_flags,
                           (f"tensorflow {tf_version}",), ())


def ort_recipe(ort_version: str) -> Recipe:
    """The kernel as onnxruntime custom ops (``csrc/ort_op.cc``, the ``dcmha.Compose*`` nodes of
    ``dcmha.export``'s ``compose_nodes=True`` graphs). It needs no onnxruntime headers or
    libraries; ``SessionOptions.register_custom_ops_library`` opens it."""
    recipe = _wrapper_recipe("compose_ort", "ort_op.cc", [], (), (f"onnxruntime {ort_version}",),
                             ("RegisterCustomOps", "dcmha_ort_op_names"))
    return dataclasses.replace(recipe,
                               instead="onnxruntime runs the Compose nodes' plain-op bodies")


_FIELDS = (
    [(n, ctypes.c_int64) for n in ("B", "t", "G", "M", "R", "s")]
    + [("x", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("x_b", "x_i", "x_n")]
    + [("out", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("o_b", "o_i", "o_n")]
    + [("g", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("g_b", "g_i", "g_n")]
    + [("wq", ctypes.c_void_p)]
    + [(n, ctypes.c_int64) for n in ("wq_b", "wq_i", "wq_g", "wq_n", "wq_m")]
    + [("dwq", ctypes.c_void_p)]
    + [(n, ctypes.c_int64) for n in ("dwq_b", "dwq_i", "dwq_g", "dwq_n", "dwq_m")]
    + [("kw1", ctypes.c_void_p), ("kw2", ctypes.c_void_p)]
    + [(n, ctypes.c_int64) for n in ("kw_b", "kw_g", "kw_r", "kw_m")]
    + [("dkw1", ctypes.c_void_p), ("dkw2", ctypes.c_void_p)]
    + [(n, ctypes.c_int64) for n in ("dkw_b", "dkw_g", "dkw_r", "dkw_m")]
    + [("kdd", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("kd_b", "kd_g", "kd_m")]
    + [("dkdd", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("dkd_b", "dkd_g", "dkd_m")]
)


class _Args(ctypes.Structure):
    _fields_ = _FIELDS


_LOCK = threading.Lock()       # the compose library's state
_STATE: dict = {}              # "lib": the loaded library or None; "reason": why it is None
_ONCE_LOCK = threading.Lock()  # the per-process state below
_WARNED: set = set()           # warnings given (one per message and process)
_PRIVATE: dict = {}            # "dir": this process's private build directory
_IDENTITY: dict = {}           # compiler command line -> its --version line
#: Cache name -> path of the verified library last obtained for it (for tests and debugging).
LIBRARIES: dict = {}


def disabled() -> bool:
    """Whether ``DCMHA_CPU_KERNEL`` (0 / false / no / off) switches the compiled kernels off."""
    return os.environ.get("DCMHA_CPU_KERNEL", "1").strip().lower() in ("0", "false", "no", "off")


def _warn_once(message: str) -> None:
    with _ONCE_LOCK:
        if message in _WARNED:
            return
        _WARNED.add(message)
    warnings.warn(message, KernelWarning, stacklevel=3)


def fallback(tag: str, reason: str, instead: str = Recipe.instead):
    """(None, reason), after a ``KernelWarning`` (once per process and reason) that the
    ``tag`` library is unavailable and ``instead`` (a slower path) runs."""
    _warn_once(f"dcmha: the compiled CPU kernel ({tag}) is unavailable, so {instead}: {reason}")
    return None, reason


# ---------------------------------------------------------------------------
# Compilers and cache names
# ---------------------------------------------------------------------------

def _compiler(env: str, language: str, names: tuple):
    """(argv of the compiler, None) or (None, why): ``$env`` split like a shell command line
    (its program looked up on PATH), else the first of ``names`` on PATH."""
    value = os.environ.get(env, "").strip()
    if value:
        try:
            argv = shlex.split(value)
        except ValueError as e:
            return None, f"${env}={value!r} is not a valid command line ({e})"
        program = shutil.which(argv[0])
        if program is None:
            return None, f"${env}={value!r}: {argv[0]!r} is not a program on PATH"
        return [os.path.abspath(program), *argv[1:]], None     # absolute: run in a scratch dir
    for name in names:
        if shutil.which(name):
            return [os.path.abspath(shutil.which(name))], None
    return None, f"no {language} compiler found (set ${env}, or install {', '.join(names)})"


def _compiler_identity(argv) -> str:
    """The first line ``argv --version`` prints, and its exit status (cached per process)."""
    key = tuple(argv)
    with _ONCE_LOCK:
        if key in _IDENTITY:
            return _IDENTITY[key]
    try:
        res = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=60)
        lines = (res.stdout.strip() or res.stderr.strip()).splitlines()
        identity = f"{lines[0] if lines else ''} (status {res.returncode})"
    except (OSError, subprocess.SubprocessError) as e:
        identity = f"--version failed: {e}"
    with _ONCE_LOCK:
        _IDENTITY[key] = identity
    return identity


def _cpu_signature() -> str:
    """The CPU model and feature flags (``-march=native`` binaries are per CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def plan(recipe: Recipe):
    """(``Plan``, None), or (None, why) when a compiler or a source is missing."""
    commands = []
    for step in recipe.steps:
        argv, why = _compiler(*step.compiler)
        if argv is None:
            return None, why
        commands.append(tuple(argv))
    try:
        texts = []
        for step in recipe.steps:
            files = []
            for fname in (*step.headers, step.source):
                with open(os.path.join(CSRC, fname), encoding="utf-8") as f:
                    files.append((fname, f.read()))
            texts.append(tuple(files))
    except OSError as e:
        return None, f"the kernel sources are missing ({e})"
    parts = [_cpu_signature(), *recipe.key_parts]
    for step, argv, files in zip(recipe.steps, commands, texts):
        parts += [shlex.join(argv), _compiler_identity(argv), shlex.join(step.flags),
                  shlex.join(step.libs), *(f"{n}\n{t}" for n, t in files)]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return Plan(recipe, tuple(commands), tuple(texts), f"dcmha_{recipe.tag}_{key}"), None


# ---------------------------------------------------------------------------
# The cache: trust, lookup, build
# ---------------------------------------------------------------------------

class _Untrusted(Exception):
    """A cache entry that the ownership rules refuse (the cache is then not used)."""


def cache_dir() -> str:
    """The cache directory by the rules of the module docstring (not checked here)."""
    d = os.environ.get("DCMHA_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME", "")
        if not os.path.isabs(base):         # the XDG rule: a relative value is ignored
            base = os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "dcmha")
    return os.path.abspath(d)


def _ownership_problem(what: str, st) -> Optional[str]:
    """Why a file or directory (``os.stat`` result ``st``) cannot be trusted, or None."""
    if st.st_uid != os.geteuid():
        return f"{what} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        who = {0o020: "group", 0o002: "others", 0o022: "group and others"}[st.st_mode & 0o022]
        return f"{what} is writable by {who} (mode {st.st_mode & 0o7777:04o})"
    return None


def _trusted_dir(directory: str):
    """(the directory, resolved, None) when it can hold trusted libraries, else (None, why)."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        real = os.path.realpath(directory)
        st = os.stat(real)
    except OSError as e:
        return None, f"it cannot be created ({e})"
    if not stat.S_ISDIR(st.st_mode):
        return None, "it is not a directory"
    why = _ownership_problem("it" if real == directory else real, st)
    if why:
        return None, why
    parent = real
    while os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
        try:
            st = os.stat(parent)
        except OSError as e:
            return None, f"the directory above it cannot be read ({e})"
        if st.st_uid not in (os.geteuid(), 0):
            return None, f"{parent} above it belongs to uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return None, (f"{parent} above it is writable by group or others "
                          f"(mode {st.st_mode & 0o7777:04o})")
    return real, None


def _open_entry(path: str):
    """A cache entry opened for reading (no link followed, no FIFO waited on) after the
    ownership rules, or None if it does not exist; raises ``_Untrusted``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Untrusted(f"{path} is a symbolic link") from None
        raise
    f = os.fdopen(fd, "rb")
    st = os.fstat(fd)
    why = (f"{path} is not a regular file" if not stat.S_ISREG(st.st_mode)
           else _ownership_problem(path, st))
    if why:
        f.close()
        raise _Untrusted(why)
    return f


def _sha256(f) -> str:
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


def _lookup(directory: str, name: str) -> Optional[str]:
    """The path of ``name``'s library in ``directory`` if its record is whole and the
    library matches it; None if either is missing or damaged (then it is rebuilt)."""
    record = _open_entry(os.path.join(directory, name + ".json"))
    if record is None:
        return None
    with record:
        raw = record.read(_RECORD_MAX_BYTES + 1)
    try:
        entry = json.loads(raw.decode("utf-8"))
        lib, size, digest = entry["library"], entry["size"], entry["sha256"]
        if not (isinstance(lib, str) and re.fullmatch(re.escape(name) + r"-[0-9a-f]{16}\.so", lib)
                and isinstance(size, int) and isinstance(digest, str)):
            return None
    except (ValueError, KeyError, TypeError):
        return None
    path = os.path.join(directory, lib)
    f = _open_entry(path)
    if f is None:
        return None
    with f:
        if os.fstat(f.fileno()).st_size != size or _sha256(f) != digest:
            return None
    return path


def _install(directory: str, name: str, built: str) -> str:
    """Move the library file ``built`` into ``directory`` under its content name, then
    write its record; both atomically (rename). Returns the library's new path."""
    with open(built, "rb") as f:
        digest = _sha256(f)
        size = os.fstat(f.fileno()).st_size
    lib = f"{name}-{digest[:16]}.so"
    os.chmod(built, 0o755)          # whatever the umask: group / others must not write
    os.replace(built, os.path.join(directory, lib))
    fd, tmp = tempfile.mkstemp(prefix=".dcmha-record-", dir=directory)     # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"library": lib, "size": size, "sha256": digest}, f)
        os.replace(tmp, os.path.join(directory, name + ".json"))
    except BaseException:
        os.unlink(tmp)
        raise
    return os.path.join(directory, lib)


def _run_compiler(cmd, argv, tag, cwd) -> Optional[str]:
    """None, or why compiling failed (with what the compiler printed, or its status)."""
    what = f"compiling the {tag} kernel failed: {shlex.join(argv)}"
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, cwd=cwd)
    except subprocess.TimeoutExpired:
        return f"{what} ran longer than {_TIMEOUT_S} s"
    except OSError as e:
        return f"{what} could not be run ({e})"
    if res.returncode == 0:
        return None
    status = (f"exited with status {res.returncode}" if res.returncode > 0
              else f"was killed by signal {-res.returncode}")
    printed = (res.stderr.strip() + "\n" + res.stdout.strip()).strip()
    errors = [ln for ln in printed.splitlines() if "error" in ln.lower()]
    detail = "\n".join(errors[:5]) or printed[-800:]
    return f"{what} {status}" + (f":\n{detail}" if detail else " and printed nothing")


def _compile(directory: str, the_plan: Plan):
    """Build the library in a scratch directory inside ``directory`` and install it there:
    (its path, None), or (None, why the compiler failed). OSError: the directory is
    unusable. The compilers run in the scratch directory on relative names, so that no
    random path is written into the library (same sources, same bytes)."""
    recipe = the_plan.recipe
    with tempfile.TemporaryDirectory(prefix=".dcmha-build-", dir=directory) as scratch:
        prev = None
        for i, (step, argv, files) in enumerate(zip(recipe.steps, the_plan.commands,
                                                    the_plan.texts)):
            for fname, text in files:
                with open(os.path.join(scratch, fname), "w", encoding="utf-8") as f:
                    f.write(text)
            out = f"step{i}.out"
            cmd = [*argv, *(fl.replace("{obj}", prev or "") for fl in step.flags),
                   step.source, *step.libs, "-o", out]
            why = _run_compiler(cmd, argv, recipe.tag, scratch)
            if why:
                return None, why
            prev = out
        return _install(directory, the_plan.name, os.path.join(scratch, prev)), None


def _private_dir() -> str:
    """This process's private build directory (mode 0700), removed at exit."""
    with _ONCE_LOCK:
        if "dir" not in _PRIVATE:
            d = tempfile.mkdtemp(prefix="dcmha-kernel-")
            atexit.register(shutil.rmtree, d, True)
            _PRIVATE["dir"] = d
        return _PRIVATE["dir"]


def _obtain(the_plan: Plan):
    """(path of the plan's verified library, None) from the cache or built, privately where
    the cache is not trusted; or (None, why)."""
    directory = cache_dir()
    real, why = _trusted_dir(directory)
    if real is not None:
        try:
            path = _lookup(real, the_plan.name)
            return (path, None) if path else _compile(real, the_plan)
        except _Untrusted as e:
            why = str(e)
        except OSError as e:
            why = f"it cannot be used ({e})"
    _warn_once(f"dcmha: not using the kernel cache {directory}: {why}; the kernel is built "
               f"in a private temporary directory, removed at exit")
    try:
        private = _private_dir()
        path = _lookup(private, the_plan.name)
        return (path, None) if path else _compile(private, the_plan)
    except (OSError, _Untrusted) as e:
        return None, f"building the {the_plan.recipe.tag} kernel failed: {e}"


# ---------------------------------------------------------------------------
# Building and loading
# ---------------------------------------------------------------------------

def build_library(recipe: Recipe, load: bool = True):
    """The recipe's library, verified, from the cache or built: (ctypes.CDLL, None), with
    ``load=False`` (its path, None) for loaders that must open it first (then check it
    with ``check_library`` after loading), or (None, reason) after a ``KernelWarning``."""
    if disabled():
        return None, "disabled by DCMHA_CPU_KERNEL"

    def fail(why):
        return fallback(recipe.tag, why, recipe.instead)
    if sys.platform == "win32":
        return fail("the C kernels are built on POSIX systems only")
    the_plan, why = plan(recipe)
    if the_plan is None:
        return fail(why)
    path, why = _obtain(the_plan)
    if path is None:
        return fail(why)
    LIBRARIES[the_plan.name] = path
    if not load:
        return path, None
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return fail(f"loading {path} failed: {e}")
    why = check_library(lib, recipe)
    return (lib, None) if why is None else fail(why)


def check_library(lib, recipe: Recipe) -> Optional[str]:
    """None, or why the loaded library (a ctypes.CDLL) must not be used: a symbol of the
    recipe is missing, or its view of ``Args`` differs from ctypes' ``_Args``."""
    missing = [s for s in recipe.symbols if not hasattr(lib, s)]
    if missing:
        return f"the {recipe.tag} library {lib._name} lacks the symbols {', '.join(missing)}"
    for layout, names in recipe.layouts:
        why = _layout_mismatch(getattr(lib, layout), getattr(lib, names))
        if why:
            return (f"the {recipe.tag} library's Args layout ({layout}) differs from ctypes' "
                    f"_Args: {why}")
    return None


def _layout_mismatch(layout_fn, names_fn) -> Optional[str]:
    """None if the library's Args (size, each field's offset and size by name) is ctypes'
    ``_Args``, else the differences."""
    layout_fn.restype, layout_fn.argtypes = ctypes.c_int64, [ctypes.POINTER(ctypes.c_int64),
                                                             ctypes.c_int64]
    names_fn.restype, names_fn.argtypes = ctypes.c_char_p, []
    cap = 1 + 2 * 256
    buf = (ctypes.c_int64 * cap)()
    n = layout_fn(buf, cap)
    names = (names_fn() or b"").decode("ascii", "replace").split()
    if n != len(names) or 1 + 2 * n > cap:
        return f"it reports {n} fields and {len(names)} names"
    theirs = {name: (buf[1 + 2 * i], buf[2 + 2 * i]) for i, name in enumerate(names)}
    ours = {name: (getattr(_Args, name).offset, getattr(_Args, name).size)
            for name, _ in _Args._fields_}
    problems = []
    if buf[0] != ctypes.sizeof(_Args):
        problems.append(f"sizeof(Args) is {buf[0]} there, {ctypes.sizeof(_Args)} in ctypes")
    for what, a, b in (("only in the library", theirs, ours), ("only in ctypes", ours, theirs)):
        extra = [name for name in a if name not in b]
        if extra:
            problems.append(f"fields {what}: {', '.join(extra)}")
    problems += [f"field {name} at offset {theirs[name][0]} (size {theirs[name][1]}) there, "
                 f"{ours[name][0]} (size {ours[name][1]}) in ctypes"
                 for name in theirs if name in ours and theirs[name] != ours[name]]
    return "; ".join(problems[:6]) or None


def load():
    """The compiled kernel library, or None (see ``unavailable_reason``)."""
    with _LOCK:
        if "lib" not in _STATE:
            lib, reason = build_library(compose_recipe())
            if lib is not None:
                for fn in (lib.dcmha_compose_forward, lib.dcmha_compose_backward):
                    fn.argtypes = [ctypes.POINTER(_Args)]
                    fn.restype = ctypes.c_int
                i64, ptr = ctypes.c_int64, ctypes.c_void_p
                stage = [i64, i64] + [ptr] * 7 + [i64, i64]
                lib.dcmha_decode_probs.argtypes = ([i64] * 4 + [ptr] * 3 + [i64] * 3
                                                   + [ctypes.c_float] + stage + stage)
                lib.dcmha_decode_probs.restype = ctypes.c_int
                lib.dcmha_dynamic_weights.argtypes = ([i64] * 6 + [ptr] * 4 + [ctypes.c_int]
                                                      + [ctypes.c_float] + [ptr] * 3)
                lib.dcmha_dynamic_weights.restype = ctypes.c_int
                lib.dcmha_dynamic_finish.argtypes = ([i64] * 5 + [ptr] + [i64] * 3 + [ptr]
                                                     + [ctypes.c_int, ctypes.c_float]
                                                     + [ptr] * 3)
                lib.dcmha_dynamic_finish.restype = None
            _STATE["lib"], _STATE["reason"] = lib, reason
        return _STATE["lib"]


def unavailable_reason() -> Optional[str]:
    """Why ``load()`` returns None (None when the kernel is loaded)."""
    load()
    return _STATE["reason"]


def _reset() -> None:
    """Forget every in-process state: the loaded kernel and its reason, the warnings given,
    the private build directory (still removed at exit), the compiler identities and
    ``LIBRARIES``. For tests (with a fresh ``DCMHA_CACHE_DIR``) and for switching the kernel
    on and off; a library already loaded stays mapped (ctypes never unloads)."""
    with _LOCK:
        _STATE.clear()
    with _ONCE_LOCK:
        _WARNED.clear()
        _PRIVATE.clear()
        _IDENTITY.clear()
        LIBRARIES.clear()


def _view(args, prefix, x, names):
    """Set ``prefix`` (pointer) and the strides ``names`` from tensor x (None: NULL)."""
    if x is None:
        setattr(args, prefix, None)
        return
    setattr(args, prefix, x.data_ptr())
    for name, st in zip(names, x.stride()):
        setattr(args, name, st)


def _args(x5, out5, st, G, M, R, s):
    wq, kw1, kw2, kdd = st
    B, t = x5.shape[0], x5.shape[1]
    a = _Args(B=B, t=t, G=G, M=M, R=R, s=s)
    _view(a, "x", x5, ("x_b", "x_i", "x_n"))
    _view(a, "out", out5, ("o_b", "o_i", "o_n"))
    _view(a, "wq", wq, ("wq_b", "wq_i", "wq_n", "wq_m"))
    if wq is not None:                      # block diagonal: group g's block at (gM, gM)
        a.wq_g = M * (a.wq_n + a.wq_m)
    _view(a, "kw1", kw1, ("kw_b", "kw_g", "kw_r", "kw_m"))
    a.kw2 = None if kw2 is None else kw2.data_ptr()
    _view(a, "kdd", kdd, ("kd_b", "kd_g", "kd_m"))
    return a


def _refuse(message):
    raise ValueError(f"dcmha C kernel: {message}")


def _check_block(x, same, st, G, R, names=("wq", "kw1", "kw2", "kdd")):
    """x (B, t, N, s) with the arrays `same` of its shape and the terms st of a block
    (see `compose_forward`), checked before the kernel reads them: a mis-shaped array
    is refused, never read past."""
    B, t, N, s = x.shape
    if G < 1 or N % G or R < 1:
        _refuse(f"{N} heads do not split into {G} groups, or rank {R} < 1")
    M = N // G
    want = ((B, t, N, N), (B, G, R, M, s), (B, G, R, M, s), (B, G, M, s))
    for name, a, shape in zip(("x", *("out / g / dx" for _ in same)), (x, *same),
                              ((B, t, N, s),) * (1 + len(same))):
        if tuple(a.shape) != shape or (a.shape[-1] > 1 and a.stride()[-1] != 1):
            _refuse(f"{name} must be {shape} with a contiguous last axis; received "
                    f"{tuple(a.shape)}")
    for name, term, shape in zip(names, st, want):
        if term is not None and (tuple(term.shape) != shape
                                 or (shape[-1] > 1 and term.stride()[-1] != 1)):
            _refuse(f"{name} must be {shape} with a contiguous last axis for x "
                    f"{tuple(x.shape)}; received {tuple(term.shape)}")


def compose_forward(lib, x, out, st, G, R):
    """out = Compose(x) for a block; x, out (B, t, N, s) views (out may be x).

    st = (wq rows of the block (B, t, N, N) or None, kw1, kw2 (B, G, R, M, s) or
    None, kdd (B, G, M, s) or None), every array float32 with a contiguous last
    axis; kw2's strides must equal kw1's.
    """
    B, t, N, s = x.shape
    _check_block(x, (out,), st, G, R if st[1] is not None else 1)
    a = _args(x, out, st, G, N // G, R, s)
    if lib.dcmha_compose_forward(ctypes.byref(a)):
        raise MemoryError("dcmha C kernel: out of memory for its chunk buffer")
    return out


#: The spec's terms in the order of a stage's arguments of ``dcmha_compose_cached`` and
#: ``dcmha_decode_probs``.
CACHED_TERMS = ("qw1", "qw2", "qdd", "static", "kw1", "kw2", "kdd")
#: Each term's bit in a stage's flags (``DCMHA_HAS_*`` of ``csrc/dcmha_args.h``; the XLA FFI
#: handler ``DcmhaDecodeProbs`` takes them).
_CACHED_FLAGS = {"qw1": 8, "qw2": 8, "qdd": 16, "static": 32, "kw1": 2, "kw2": 2, "kdd": 4}


def cached_flags(names) -> int:
    """A stage's flags for the terms ``names`` (a subset of ``CACHED_TERMS``)."""
    flags = 0
    for n in names:
        flags |= _CACHED_FLAGS[n]
    return flags


def _stage_args(terms):
    """(Rq, Rk, the 7 term pointers, kw_row, kd_row) of one stage for
    ``dcmha_decode_probs`` (None: absent; see ``key_row``)."""
    terms = terms or {}
    return [terms["qw1"].shape[3] if "qw1" in terms else 1,
            terms["kw1"].shape[3] if "kw1" in terms else 1] + [
        terms[n].data_ptr() if n in terms else None for n in CACHED_TERMS] + [
        key_row(terms.get("kw1")), key_row(terms.get("kdd"))]


def key_row(term) -> int:
    """How many floats apart the key positions of a key-side term (B, S, G, ...) lie, for
    ``dcmha_decode_probs``: 0 when contiguous, else the stride of one slot's view into the
    decode cache's stacked entry (each position's (G, ...) block contiguous, batch b at
    b * S * row). ``decode_terms`` makes every term one of these."""
    if term is None or term.is_contiguous():
        return 0
    return term.stride(1)


def _key_row_layout(term) -> bool:
    """Whether ``key_row`` describes ``term``'s layout."""
    B, S = term.shape[:2]
    inner = term.shape[2:]
    expected, step = [], 1
    for n in reversed(inner):
        expected.insert(0, step)
        step *= n
    st = term.stride()
    return (list(st[2:]) == expected and st[1] >= step
            and (B == 1 or st[0] == S * st[1]))


def decode_terms(terms):
    """A stage's terms for ``decode_probs``: float32 torch tensors, each contiguous or, for
    kw1 / kw2 / kdd, a view of the layout ``key_row`` describes (kw1 and kw2 with the same
    strides); anything else copied to a contiguous tensor."""
    out = {n: w.contiguous() if n not in ("kw1", "kw2", "kdd") else w
           for n, w in terms.items()}
    for names in (("kw1", "kw2"), ("kdd",)):
        ws = [out[n] for n in names if n in out]
        if ws and not (all(_key_row_layout(w) for w in ws)
                       and all(w.stride() == ws[0].stride() for w in ws)):
            out.update({n: out[n].contiguous() for n in names if n in out})
    return out


def _check_decode(x, p, mask, pre, post):
    """decode_probs' arrays checked against x (B, G, M, S) before the kernel reads them."""
    B, G, M, S = x.shape
    if tuple(p.shape) != (B, G, M, S):
        _refuse(f"p must be x's shape {(B, G, M, S)}; received {tuple(p.shape)}")
    if mask is not None and (mask.dim() != 3 or mask.shape[0] not in (1, B)
                             or mask.shape[1] not in (1, G * M) or mask.shape[2] not in (1, S)):
        _refuse(f"mask must be (B|1, N|1, S|1) for x {(B, G, M, S)}; received "
                f"{tuple(mask.shape)}")
    for terms in (pre or {}, post or {}):
        rq = terms["qw1"].shape[3] if "qw1" in terms else 1
        rk = terms["kw1"].shape[3] if "kw1" in terms else 1
        want = {"qw1": (B, 1, G, rq, M), "qw2": (B, 1, G, rq, M), "qdd": (B, 1, G, M),
                "static": (G, M, M), "kw1": (B, S, G, rk, M), "kw2": (B, S, G, rk, M),
                "kdd": (B, S, G, M)}
        for name, term in terms.items():
            if tuple(term.shape) != want.get(name):
                _refuse(f"{name} must be {want.get(name)} for x {(B, G, M, S)}; received "
                        f"{tuple(term.shape)}")


def decode_probs(lib, x, p, mask, pre, post, masked):
    """One query's probabilities into p: Compose_post(softmax(where(mask, Compose_pre(x),
    masked))), ``dcmha_decode_probs`` of ``csrc/dcmha_args.h`` (the arithmetic of
    ``dcmha.ops.one_query_probs``). x, p (B, G, M, S) float32 contiguous, p not x; mask a
    contiguous one-byte (bool) array (B|1, 1|N, S|1), True = attend, or None; pre, post
    each a dict of the spec's terms (names of ``CACHED_TERMS``, float32 contiguous): qw1,
    qw2 (B, 1, G, R, M), qdd (B, 1, G, M), static (G, M, M), and the key side in the decode
    cache's layout, kw1, kw2 (B, S, G, R, M), kdd (B, S, G, M) (``decode_terms`` makes
    them); or None."""
    B, G, M, S = x.shape
    _check_decode(x, p, mask, pre, post)
    m = [None, 1, 1, 1] if mask is None else [mask.data_ptr(), *mask.shape]
    if lib.dcmha_decode_probs(B, G, M, S, x.data_ptr(), p.data_ptr(), *m, masked,
                              *_stage_args(pre), *_stage_args(post)):
        raise MemoryError("dcmha C kernel: out of memory for its scratch buffer")
    return p


#: Rows (B * L) up to which a framework takes ``dynamic_weights`` (one thread: a decoding
#: step's one row or a few; the frameworks' threaded products win beyond).
DYNAMIC_ROWS = 4


def dynamic_sizes(dw1, qkw, dd, C):
    """(G, K, M) of the dynamic-weight arrays (K = 1 without a projection)."""
    if dw1 is not None:
        return dw1.shape[1], dw1.shape[3], qkw.shape[-1]
    return dd.shape[1], 1, dd.shape[2] // C


def _check_counts(arrays):
    """{name: (array or None, the element count the kernel reads)}, checked."""
    for name, (a, n) in arrays.items():
        if a is not None and a.numel() != n:
            _refuse(f"{name} must hold {n} elements; received shape {tuple(a.shape)}")


def dynamic_weights(lib, x, dw1, qkw, dd, w1, w2, g, *, GC, K, M, rank, gelu_approximate,
                    eps):
    """``dcmha_dynamic_weights`` of ``csrc/dcmha_args.h`` into w1, w2 (BL, GC, R, M) and g
    (BL, GC M): x (BL, D), dw1 (D, GC K), qkw (GC, K, 2R, M), dd (D, GC M), every array
    float32 contiguous; dw1 / qkw / w1 / w2, or dd / g, None where absent."""
    BL, D = x.shape
    _check_counts({"dw1": (dw1, D * GC * K), "qkw": (qkw, GC * K * 2 * rank * M),
                   "dd": (dd, D * GC * M), "w1": (w1, BL * GC * rank * M),
                   "w2": (w2, BL * GC * rank * M), "g": (g, BL * GC * M)})
    ptr = lambda a: None if a is None else a.data_ptr()      # noqa: E731
    if lib.dcmha_dynamic_weights(BL, D, GC, K, rank, M, x.data_ptr(), ptr(dw1), ptr(qkw),
                                 ptr(dd), int(gelu_approximate), eps, ptr(w1), ptr(w2), ptr(g)):
        raise MemoryError("dcmha C kernel: out of memory for its scratch buffer")


def dynamic_finish(lib, pre, h_col, g_col, qkw, w1, w2, g, *, GC, K, M, rank,
                   gelu_approximate, eps):
    """``dcmha_dynamic_finish`` of ``csrc/dcmha_args.h``: ``dynamic_weights``' outputs from
    pre (BL, n), float32 with contiguous rows, whose columns [h_col, h_col + GC K) hold x dw1
    (gelu is applied there, in place) and [g_col, g_col + GC M) x dd; qkw / w1 / w2 (or g)
    None where absent, as in ``dynamic_weights``."""
    BL, n = pre.shape
    for col, width, used in ((h_col, GC * K, qkw is not None), (g_col, GC * M, g is not None)):
        if used and not (0 <= col <= n and width <= n - col):
            _refuse(f"columns [{col}, {col} + {width}) lie outside pre's {n}")
    _check_counts({"qkw": (qkw, GC * K * 2 * rank * M), "w1": (w1, BL * GC * rank * M),
                   "w2": (w2, BL * GC * rank * M), "g": (g, BL * GC * M)})
    ptr = lambda a: None if a is None else a.data_ptr()      # noqa: E731
    lib.dcmha_dynamic_finish(pre.shape[0], GC, K, rank, M, pre.data_ptr(), pre.stride(0),
                             h_col, g_col, ptr(qkw), int(gelu_approximate), eps, ptr(w1),
                             ptr(w2), ptr(g))


def compose_backward(lib, x, g, dx, st, dst, G, R):
    """dx = dCompose/dx^T g for a block and d(terms) accumulated (dx may be g).

    dst = (d_wq rows (B, t, N, N) (written by +=, the diagonal blocks only),
    d_kw1, d_kw2 (B, G, R, M, s), d_kdd (B, G, M, s)), None where the term is
    absent; d_kw2's strides must equal d_kw1's.
    """
    B, t, N, s = x.shape
    R_ = R if st[1] is not None else 1
    _check_block(x, (g, dx), st, G, R_)
    _check_block(x, (), dst, G, R_, names=("d_wq", "d_kw1", "d_kw2", "d_kdd"))
    a = _args(x, dx, st, G, N // G, R, s)
    _view(a, "g", g, ("g_b", "g_i", "g_n"))
    d_wq, d_kw1, d_kw2, d_kdd = dst
    _view(a, "dwq", d_wq, ("dwq_b", "dwq_i", "dwq_n", "dwq_m"))
    if d_wq is not None:
        a.dwq_g = (N // G) * (a.dwq_n + a.dwq_m)
    _view(a, "dkw1", d_kw1, ("dkw_b", "dkw_g", "dkw_r", "dkw_m"))
    a.dkw2 = None if d_kw2 is None else d_kw2.data_ptr()
    _view(a, "dkdd", d_kdd, ("dkd_b", "dkd_g", "dkd_m"))
    if lib.dcmha_compose_backward(ctypes.byref(a)):
        raise MemoryError("dcmha C kernel: out of memory for its chunk buffer")
    return dx
