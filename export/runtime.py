"""Checking, saving and running exported graphs: ``check_model`` (onnx.checker),
``session`` (an onnxruntime CPU session, with the kernel ops' library registered),
``save_model`` and ``atomic_output`` (write beside the target, rename onto it only when
everything passed)."""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Optional, Union

import onnx

from dcmha.export.op_names import DOMAIN, KERNEL_OPS


def check_model(model: onnx.ModelProto) -> None:
    """onnx.checker with full_check (strict shape inference through the functions)."""
    onnx.checker.check_model(model, full_check=True)


def session(model_or_path, *, threads: Optional[int] = None, spinning: bool = False,
            compose_kernel: bool = True):
    """An onnxruntime CPU session with every graph optimisation on (ORT_ENABLE_ALL).

    compose_kernel: for a graph with ``dcmha.Compose*`` nodes (exported with
    ``compose_nodes=True``), register the compiled compose kernel (``ort_ops``), built on
    first use; where it is unavailable (no compiler, ``DCMHA_CPU_KERNEL=0``; one
    ``KernelWarning`` says why) or with False, onnxruntime runs the nodes' plain-op bodies.

    threads: intra-op threads. Default: onnxruntime's (one per physical core), but 1
    for a decode graph (one with a ``cache_update_index`` input): a step's ops are
    so small that waking a second thread for each costs more than it saves.
    spinning: let idle intra-op threads spin-wait for work (onnxruntime's default).
    Off by default: spinning threads take the cores from everything else in the
    process and on the machine (a Keras backend, other sessions), which on a small
    machine slows a layer down more than the spin saves (``benchmarks/RESULTS.md, "onnxruntime on the exported graph"``).
    """
    import onnxruntime as ort
    model = model_or_path if isinstance(model_or_path, onnx.ModelProto) else onnx.load(
        str(model_or_path), load_external_data=False)
    if threads is None and any(i.name == "cache_update_index" for i in model.graph.input):
        threads = 1
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if compose_kernel and any(f.domain == DOMAIN and f.name in KERNEL_OPS
                              for f in model.functions):
        from dcmha.export.ort_ops import register
        register(so)
    src = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def output_target(path: Union[str, os.PathLike]) -> str:
    """The file that writing ``path`` replaces: ``path`` with every symlink resolved.

    A symlink at ``path`` is written through: its target gets the new content
    (and keeps the link), as when a program opens the link for writing. Raises
    ValueError when the target's folder does not exist or the target is a folder.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"`path` must be a str or os.PathLike. Received: {type(path).__name__}")
    path = os.fspath(path)
    target = os.path.realpath(path)
    if os.path.isdir(target):
        raise ValueError(f"`path` must be a file path, not a directory. Received: path={path!r}")
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise ValueError(f"`path` must be in an existing directory; {directory!r} does not exist. "
                         f"Received: path={path!r}")
    return target


def _new_file(directory: str, suffix: str) -> str:
    """A new empty file in ``directory`` with a random name, created with mode 0o666 so that
    the umask (and any default ACL) gives it the mode of any new file: no umask is read or
    changed (os.umask would change it process-wide for a moment, a race with other threads)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        name = os.path.join(directory, f".tmp-{os.urandom(8).hex()}{suffix}")
        try:
            os.close(os.open(name, flags, 0o666))
            return name
        except FileExistsError:
            continue
    raise FileExistsError(f"Could not create a temporary file in {directory!r}.")


@contextlib.contextmanager
def atomic_output(path: Union[str, os.PathLike], suffix: str = ".onnx"):
    """Yield a new temporary file beside ``path``'s target; when the block ends without an
    error, rename it onto the target, else remove it (the target is then untouched).

    The result keeps the mode of the file it replaces; a new file gets the mode
    that the umask gives any new file. A symlink at ``path`` is written through
    (see `output_target`).
    """
    target = output_target(path)
    tmp = _new_file(os.path.dirname(target), suffix)
    try:
        yield tmp
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = None
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def save_model(model: onnx.ModelProto, path: Union[str, os.PathLike], *, check_runtime: bool = True) -> str:
    """Write ``model`` to ``path`` atomically.

    The model goes to a temporary file beside the target; only after
    onnx.checker (full_check) passes and onnxruntime loads it with ORT_ENABLE_ALL
    is it renamed onto the target. On any failure the target is left untouched.
    An existing file keeps its mode; a symlink is written through to its target
    (see `atomic_output`). Returns ``path``.
    """
    with atomic_output(path) as tmp:
        onnx.save_model(model, tmp)
        onnx.checker.check_model(tmp, full_check=True)
        if check_runtime:
            session(tmp)
    return os.fspath(path)
