"""Building, loading and checking the C kernel's libraries.

A ``Recipe`` names a library's compiler steps, the extra parts of its cache key, the symbols
it must export and the ``Args`` layouts checked against ctypes' ``calls._Args``; ``plan``
resolves it for this machine (the compilers' command lines and ``--version`` lines, the
source texts, the CPU's model and flags) into the cache name ``dcmha_<tag>_<key>``;
``build_library`` finds the verified library in the cache (``cache``) or compiles and
installs it, in a private temporary directory of the process where the cache is not trusted
(one ``KernelWarning`` per process saying why), and checks what it loaded.

This module holds every in-process state of the package (the loaded compose library, the
warnings given, the private directory, the compiler identities, ``LIBRARIES``), each under
``_LOCK`` or ``_ONCE_LOCK``; ``_reset`` forgets it.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import Optional

from . import calls
from .cache import _Untrusted, _install, _lookup, _trusted_dir, cache_dir

__all__ = ["load", "unavailable_reason", "disabled", "KernelWarning", "Recipe", "Plan",
           "compose_recipe", "ffi_recipe", "tf_recipe", "ort_recipe", "plan", "build_library",
           "check_library", "fallback", "CSRC", "LIBRARIES"]

#: The C / C++ sources (package data beside this package).
CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")

#: Optimisation flags of the C kernel (part of the cache key). ``-ffp-contract=fast``: a
#: product and a sum become one fused multiply-add (ISO C's ``-std=c11`` turns contraction
#: off, which halves the arithmetic rate of every loop of the kernel).
_OPT = ("-O3", "-march=native", "-ffp-contract=fast")
#: Seconds one compiler run may take.
_TIMEOUT_S = 300
_CC = ("CC", "C", ("cc", "gcc", "clang"))
_CXX = ("CXX", "C++", ("c++", "g++", "clang++"))
_KERNEL_SYMBOLS = ("dcmha_compose_forward", "dcmha_compose_backward", "dcmha_fill_args",
                   "dcmha_cached_scratch", "dcmha_cached_args", "dcmha_compose_cached",
                   "dcmha_decode_probs", "dcmha_dynamic_weights", "dcmha_dynamic_finish",
                   "dcmha_block_probs_slices", "dcmha_query_matrix",
                   "dcmha_query_matrix_backward")
#: The (layout, names) functions of DCMHA_DEFINE_ARGS_LAYOUT: the C kernel's, a C++ wrapper's.
_C_LAYOUT = ("dcmha_args_layout", "dcmha_args_names")
_CXX_LAYOUT = ("dcmha_cxx_args_layout", "dcmha_cxx_args_names")
_WRAP_HEADERS = ("dcmha_args.h", "compose_wrap.h")


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
                           ("DcmhaComposeForward", "DcmhaComposeBackward", "DcmhaDecodeProbs",
                            "DcmhaBlockProbsForward", "DcmhaBlockProbsBackward", "DcmhaQueryMatrix",
                            "DcmhaQueryMatrixBackward"))


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
# Compiling into the cache
# ---------------------------------------------------------------------------

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
    ours = {name: (getattr(calls._Args, name).offset, getattr(calls._Args, name).size)
            for name, _ in calls._Args._fields_}
    problems = []
    if buf[0] != ctypes.sizeof(calls._Args):
        problems.append(f"sizeof(Args) is {buf[0]} there, {ctypes.sizeof(calls._Args)} "
                        f"in ctypes")
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
                    fn.argtypes = [ctypes.POINTER(calls._Args)]
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
