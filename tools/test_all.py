"""Run the whole dcmha test suite: every Keras backend, each in its own process.

Usage: python tools/test_all.py [--only LABEL[,LABEL...]] [--jobs N] [--list]

Keras fixes its backend at import, and TensorFlow and Triton cannot share a
process, so the suite is a list of steps, each a separate pytest (or
conformance) process with its own environment. The script prints each step's
own output, then one summary row per step and the closing line
``N passed, M failed, K skipped``; it exits non-zero if any step failed,
errored, or collected no tests (pytest's exit code 5 is an error here: a step
that runs nothing proves nothing).

Steps run ``--jobs`` at a time (default: 2, or 1 on a one-CPU machine), longest
first; a step's output is printed whole when it ends. Most steps spend their time
in single-threaded tracing and compiling, so two at a time on two cores take
about two thirds of the sequential time.

Most of the JAX steps' time is XLA compiling, and many programs recur across their
processes (the same layer shapes in the conformance adapters, the subprocess tests,
keras-hub). The steps therefore share JAX's persistent compilation cache, in a
directory made for the run and removed after it (a compiled program loaded from the
cache is the one XLA would compile again): ``--no-jax-cache`` turns it off, and a
``JAX_COMPILATION_CACHE_DIR`` already set is left alone.

The programs of the JAX Keras steps (``FAST_XLA_STEPS``) are tiny and run once, so XLA's
CPU code generation runs there without LLVM's optimisation passes
(``--xla_backend_optimization_level=0`` in ``XLA_FLAGS``): compiling then takes about half
the time (tests/layers' determinism and training modules: 195 -> 110 s). Every other step
compiles as users do: the conformance suite certifies the numbers users get, and
TensorFlow's XLA at that level computes wrong gradients for the "xla" path's fully masked
rows (conformance's grad_fully_masked_rows and grad_long_all_switches fail with it and
pass without). ``--full-xla-optimization`` keeps the passes in every step.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERAS_BACKENDS = ("jax", "torch", "tensorflow", "numpy")
#: The Keras backend whose step runs the tests marked ``backend_independent`` (see
#: tests/conftest.py); the other Keras backends' steps deselect them.
ONCE_BACKEND = "numpy"
#: Adapters that CI holds to the fixtures (each runs in its own worker process).
CONFORMANCE_BACKENDS = "all"      # every adapter, and every implementation that runs here


def _glob(*patterns: str) -> list:
    files = sorted({str(p.relative_to(ROOT)) for pat in patterns for p in ROOT.glob(pat)})
    return files


def _folders(*names: str) -> list:
    """Every test module of the named folders under tests/ (tests/spec, tests/layers, ...)."""
    return _glob(*(f"tests/{name}/test_*.py" for name in names))


def steps() -> list:
    """(label, environment overrides, pytest arguments or None for the conformance CLI).

    The folders of tests/ say which steps run a module: spec and house once (no Keras
    backend), layers, ops, export, models, checkpoints and distribution on every Keras
    backend (those marked ``backend_independent`` only in keras-numpy), hub in its own
    process per backend, and backends by fast path (the file's name says which:
    test_cpu_paths*, test_torch_native*, test_triton*, ...).
    """
    out = [("spec", {}, _folders("spec", "house") + ["conformance"])]
    keras_tests = _folders("layers", "ops", "export", "models", "checkpoints", "distribution")
    backend_tests = {"torch": _glob("tests/backends/test_torch_native*.py"),
                     "jax": _glob("tests/backends/test_cpu_paths*.py"),
                     "tensorflow": _glob("tests/backends/test_cpu_paths*.py")}
    for b in KERAS_BACKENDS:
        # Tests that touch no Keras tensor run once, in the cheapest backend's step.
        once = [] if b == ONCE_BACKEND else ["-m", "not backend_independent"]
        out.append((f"keras-{b}", {"KERAS_BACKEND": b},
                    once + keras_tests + backend_tests.get(b, [])))
    triton_env = {"KERAS_BACKEND": "torch", "TRITON_INTERPRET": "1"}
    out.append(("triton-interpret", triton_env, _glob("tests/backends/test_triton*.py")))
    # Its own process: the dispatch tests may import TensorFlow, after which Triton aborts.
    out.append(("dispatch-triton", triton_env, _glob("tests/ops/test_dispatch*.py")))
    out.append(("pallas-interpret", {"KERAS_BACKEND": "jax"},
                _glob("tests/backends/test_pallas*.py")))
    out.append(("tf-xla", {"KERAS_BACKEND": "tensorflow"}, _glob("tests/backends/test_xla*.py")))
    # keras-hub imports TensorFlow (then Triton would abort): its own process per backend.
    for b in ("jax", "torch", "tensorflow"):
        out.append((f"hub-{b}", {"KERAS_BACKEND": b}, _folders("hub")))
    out.append(("conformance", {}, None))
    # Not here: tests/backends/test_gpu_*.py run the compiled Triton / Pallas kernels and
    # need a CUDA GPU (without one every module skips, and pytest collects nothing);
    # benchmarks/gpu_check.sh runs them on a GPU machine.
    return [s for s in out if s[2] is None or s[2]]


def _junit_counts(path: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if not path.exists():
        return counts
    root = ET.parse(path).getroot()
    for suite in root.iter("testsuite"):
        tests = int(suite.get("tests", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        counts["passed"] += tests - failed - skipped
        counts["failed"] += failed
        counts["skipped"] += skipped
    return counts


def _junit_times(path: Path) -> list:
    """(seconds, test id) of every testcase in a junit XML report (pytest's ``time``:
    setup, call and teardown), the id as pytest prints it (path::name)."""
    if not path.exists():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        # pytest writes "tests.layers.test_x" (or "tests.layers.test_x.TestClass").
        parts = [p for p in classname.split(".") if p]
        for i in range(len(parts), 0, -1):
            module = Path(*parts[:i]).with_suffix(".py")
            if (ROOT / module).exists():
                classname = "::".join([module.as_posix(), *parts[i:]])
                break
        out.append((float(case.get("time", 0) or 0), f"{classname}::{name}"))
    return out


#: How many of the run's slowest tests the summary lists.
SLOWEST = 10


#: Rough step durations (seconds, 2-core machine, two steps at a time) for ordering the
#: steps longest first.
_EXPECTED_SECONDS = {"keras-jax": 1360, "conformance": 1200, "keras-tensorflow": 630,
                     "keras-torch": 350, "spec": 150, "triton-interpret": 130,
                     "keras-numpy": 120, "hub-jax": 100, "pallas-interpret": 95,
                     "hub-tensorflow": 95, "tf-xla": 95, "hub-torch": 40, "dispatch-triton": 25}


def _jax_cache_env(tmp: Path) -> dict:
    """The environment that points every JAX process of the run at one persistent
    compilation cache under ``tmp`` (every program cached, however quick to compile)."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp / "jax-cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


#: XLA's LLVM passes off: tiny test programs compile in about half the time.
XLA_TEST_FLAG = "--xla_backend_optimization_level=0"
#: The steps that compile with ``XLA_TEST_FLAG`` (see the module docstring).
FAST_XLA_STEPS = frozenset({"keras-jax", "hub-jax"})


def _xla_env() -> dict:
    """XLA_FLAGS with the test flag added (the flags already set are kept)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" in flags:
        return {}
    return {"XLA_FLAGS": f"{flags} {XLA_TEST_FLAG}".strip()}


def run_step(label: str, env_over: dict, args, tmp: Path, capture: bool = False,
             shared_env: dict = None) -> dict:
    env = dict(os.environ, **(shared_env or {}), **env_over)
    env.setdefault("PYTHONHASHSEED", "0")
    if args is None:
        report = tmp / f"{label}.json"
        cmd = [sys.executable, "-m", "dcmha.conformance", "--backend", CONFORMANCE_BACKENDS,
               "--json", str(report)]
    else:
        report = tmp / f"{label}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", *args]
    header = (f"\n===== {label}: {' '.join(f'{k}={v}' for k, v in env_over.items())} "
              f"{' '.join(cmd[1:])}")
    t0 = time.time()
    if capture:
        log = tmp / f"{label}.log"
        with open(log, "w") as out:
            rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        print(header + "\n" + log.read_text(), flush=True)
    else:
        print(header, flush=True)
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
    elapsed = time.time() - t0
    if args is None:
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        if report.exists():
            # The CLI's --json report: {"summary": {"passed", "failed", "skipped"}, "results"}.
            summary = json.loads(report.read_text()).get("summary", {})
            counts = {k: int(summary.get(k, 0)) for k in counts}
        times = []
    else:
        counts = _junit_counts(report)
        times = _junit_times(report)
    status = "ok"
    if rc == 5:
        status = "error: collected no tests (pytest exit 5)"
    elif rc != 0:
        status = f"failed (exit {rc})"
    elif counts["passed"] == 0:
        status = "error: nothing passed"
    slowest = sorted(times, reverse=True)[:SLOWEST]
    return dict(label=label, rc=rc, status=status, seconds=round(elapsed, 1), slowest=slowest,
                **counts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated step labels to run")
    ap.add_argument("--list", action="store_true", help="list the steps and exit")
    ap.add_argument("--no-jax-cache", action="store_true",
                    help="compile every JAX program in every process (no shared cache)")
    ap.add_argument("--full-xla-optimization", action="store_true",
                    help="compile XLA programs with LLVM's optimisation passes, as users do")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="steps run at a time (default: %(default)s)")
    ns = ap.parse_args(argv)
    todo = steps()
    if ns.list:
        for label, env, args in todo:
            print(label, env, "conformance CLI" if args is None else " ".join(args))
        return 0
    if ns.only:
        wanted = ns.only.split(",")
        unknown = sorted(set(wanted) - {s[0] for s in todo})
        if unknown:
            print(f"unknown step(s) {unknown}; known: {[s[0] for s in todo]}", file=sys.stderr)
            return 2
        todo = [s for s in todo if s[0] in wanted]
    if ns.jobs < 1:
        print(f"--jobs must be >= 1, got {ns.jobs}", file=sys.stderr)
        return 2
    order = {s[0]: i for i, s in enumerate(todo)}
    with tempfile.TemporaryDirectory() as tmp:
        shared = {} if ns.no_jax_cache else _jax_cache_env(Path(tmp))
        if not ns.full_xla_optimization:
            xla = _xla_env()
            todo = [(label, dict(env, **xla) if label in FAST_XLA_STEPS else env, args)
                    for label, env, args in todo]
        if ns.jobs == 1:
            results = [run_step(label, env, args, Path(tmp), shared_env=shared)
                       for label, env, args in todo]
        else:
            queue = sorted(todo, key=lambda s: -_EXPECTED_SECONDS.get(s[0], 10))
            with concurrent.futures.ThreadPoolExecutor(ns.jobs) as pool:
                futures = [pool.submit(run_step, label, env, args, Path(tmp), True, shared)
                           for label, env, args in queue]
                results = [f.result() for f in futures]
            results.sort(key=lambda r: order[r["label"]])
    print("\n===== summary")
    print(f"{'step':<20} {'passed':>7} {'failed':>7} {'skipped':>8} {'seconds':>8}  status")
    for r in results:
        print(f"{r['label']:<20} {r['passed']:>7} {r['failed']:>7} {r['skipped']:>8} "
              f"{r['seconds']:>8}  {r['status']}")
    total = {k: sum(r[k] for r in results) for k in ("passed", "failed", "skipped")}
    bad = [r for r in results if r["status"] != "ok"]
    failed = total["failed"] + (len(bad) if total["failed"] == 0 else 0)
    print(f"{total['passed']} passed, {failed} failed, {total['skipped']} skipped")
    slowest = sorted(((t, r["label"], test) for r in results for t, test in r["slowest"]),
                     reverse=True)[:SLOWEST]
    if slowest:
        print(f"\n===== the {len(slowest)} slowest tests (seconds, step, test)")
        for t, label, test in slowest:
            print(f"{t:8.1f}  {label:<18} {test}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
