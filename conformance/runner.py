"""Discover adapters, run cases on them and compare against the fixtures.

The reference adapter runs in this process; every other adapter runs in a subprocess of its
own (``python -m dcmha.conformance --_worker NAME``) that writes its results as JSON, so
Keras backends, TensorFlow and Triton never share a process.

Adapters come from the entry-point group ``dcmha.conformance.adapters`` (the reference, one
per Keras backend, onnxruntime), ``$DCMHA_CONFORMANCE_ADAPTERS`` / ``--adapter``, and the
implementation registry: every registered implementation but "ops" (which the keras-<backend>
adapters run, as ``"auto"``) is the adapter "impl-<name>" (``implementation_entries``). Its
worker gets ``KERAS_BACKEND`` and the implementation's ``cpu_env`` in its environment, with
accelerators hidden: impl-* adapters check each path on the CPU. The registry is read in a
subprocess on the numpy Keras backend, so this process never imports Keras and needs no
configured backend.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from importlib.metadata import entry_points
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from dcmha.conformance.adapters.base import covered_outputs, output_capability
from dcmha.spec.tolerance import within

ENTRY_POINT_GROUP = "dcmha.conformance.adapters"
#: Extra adapters, "name=module:Class" separated by commas (tests, out-of-tree backends).
ADAPTERS_ENV = "DCMHA_CONFORMANCE_ADAPTERS"
REFERENCE_TARGET = "dcmha.conformance.adapters.reference:ReferenceAdapter"
#: The adapter of a registered implementation: "impl-<name>".
IMPL_PREFIX = "impl-"
IMPL_TARGET = "dcmha.conformance.adapters.keras_adapter:implementation_adapter"
#: Former names of adapters, still accepted by ``--backend`` (never part of "all").
ALIASES = {"triton-interpret": "impl-triton", "pallas-interpret": "impl-pallas",
           "tf-xla": "impl-xla"}
#: The Keras backends an implementation on backend "any" is checked on.
KERAS_BACKENDS = ("jax", "torch", "tensorflow", "numpy")
#: What an impl-* worker sets besides the implementation's cpu_env: the CPU only.
CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}


@dataclasses.dataclass(frozen=True)
class AdapterEntry:
    """How to build one adapter: ``target`` ("module:Callable") called with ``args``, in a
    worker whose environment adds ``env``; ``unavailable`` says why it cannot run on this
    machine (None: it can)."""

    target: str
    args: Tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    unavailable: Optional[str] = None


@dataclasses.dataclass
class Result:
    """The outcome of one (backend, case).

    ``max_abs`` / ``max_rel`` / ``atol`` / ``rtol`` are those of the limiting output ``worst``
    (the one closest to or furthest past its tolerance); ``max_rel`` is max|err| / max|expected|.
    ``outputs`` has one dict per compared output; ``not_covered`` names the case's outputs the
    backend was not compared on because it lacks their capability (see
    ``adapters.base.output_capability``).
    """

    backend: str
    case: str
    status: str                      # "PASS" | "FAIL" | "SKIP"
    reason: str = ""
    worst: str = ""
    max_abs: Optional[float] = None
    max_rel: Optional[float] = None
    atol: Optional[float] = None
    rtol: Optional[float] = None
    outputs: List[dict] = dataclasses.field(default_factory=list)
    details: str = ""                # e.g. the traceback of an adapter error
    not_covered: List[str] = dataclasses.field(default_factory=list)
    paths: List[str] = dataclasses.field(default_factory=list)   # attention paths the case ran on

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Result":
        return cls(**dict(d))


# ---------------------------------------------------------------------------
# Discovery
# ---------------------------------------------------------------------------

def parse_adapter_specs(specs: Sequence[str]) -> Dict[str, str]:
    """{"name": "module:Class"} from strings "name=module:Class" (ValueError naming a bad one)."""
    out = {}
    for spec in specs:
        spec = spec.strip()
        if not spec:
            continue
        name, sep, target = spec.partition("=")
        if not sep or not name.strip() or ":" not in target:
            raise ValueError("An adapter must be given as NAME=MODULE:CLASS. "
                             f"Received: {spec!r}")
        out[name.strip()] = target.strip()
    return out


_LIST_IMPLEMENTATIONS = """
import json, sys
from dcmha import registry
rows = [dict(name=i.name, backend=i.backend, devices=sorted(i.devices), cpu_env=dict(i.cpu_env))
        for i in registry.implementations().values()]
json.dump({"implementations": rows, "errors": registry.load_errors()}, sys.stdout)
"""


def _registered_implementations() -> Tuple[List[dict], Dict[str, str]]:
    """([{name, backend, devices, cpu_env}], {entry point: load error}) of the registry, read
    in a subprocess on the numpy Keras backend (loading the registry imports Keras)."""
    env = dict(os.environ, KERAS_BACKEND="numpy")
    proc = subprocess.run([sys.executable, "-c", _LIST_IMPLEMENTATIONS], capture_output=True,
                          text=True, env=env, timeout=300)
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"Reading the implementation registry (dcmha.registry) failed with "
                           f"exit code {proc.returncode}: {tail}") from None
    return data["implementations"], data["errors"]


def _unavailable(row: Mapping) -> Optional[str]:
    """Why the implementation ``row`` cannot run on this machine's CPU (None: it can)."""
    backend = row["backend"]
    if backend != "numpy" and importlib.util.find_spec(backend) is None:
        return f"its Keras backend {backend!r} is not installed"
    if "cpu" not in row["devices"] and not row["cpu_env"]:
        return (f"it runs on {'/'.join(row['devices']) or 'no device'} only and declares no "
                "cpu_env to run on a CPU")
    return None


def implementation_entries() -> Dict[str, AdapterEntry]:
    """{"impl-<name>": AdapterEntry} for every registered implementation but "ops" (one per
    Keras backend, "impl-<name>-<backend>", for an implementation on backend "any"), and one
    that cannot run for each entry point that failed to load."""
    rows, errors = _registered_implementations()
    out = {}
    for row in rows:
        if row["name"] == "ops":
            continue
        backends = KERAS_BACKENDS if row["backend"] == "any" else (row["backend"],)
        for backend in backends:
            name = IMPL_PREFIX + row["name"] + ("" if len(backends) == 1 else f"-{backend}")
            env = {**CPU_ONLY_ENV, "KERAS_BACKEND": backend, **row["cpu_env"]}
            out[name] = AdapterEntry(IMPL_TARGET, (row["name"], backend), env,
                                     _unavailable(dict(row, backend=backend)))
    for name, error in errors.items():
        out[IMPL_PREFIX + name] = AdapterEntry(IMPL_TARGET, (name, ""), {},
                                               f"its entry point failed to load: {error}")
    return out


def discover_adapters(extra: Sequence[str] = (),
                      implementations: bool = True) -> Dict[str, AdapterEntry]:
    """Registered adapters {name: AdapterEntry}: entry points of the group
    ``dcmha.conformance.adapters``, then ``$DCMHA_CONFORMANCE_ADAPTERS``, then ``extra``
    (later ones override), and with ``implementations`` one "impl-<name>" adapter per
    registered implementation (``implementation_entries``; costs one subprocess)."""
    found = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    found.update(parse_adapter_specs(os.environ.get(ADAPTERS_ENV, "").split(",")))
    found.update(parse_adapter_specs(extra))
    entries = {n: AdapterEntry(t) for n, t in found.items() if n not in ALIASES}
    if implementations:
        entries.update({n: e for n, e in implementation_entries().items() if n not in found})
    return dict(sorted(entries.items(), key=lambda kv: (kv[0] != "reference", kv[0])))


def resolve_alias(name: str, registry: Mapping[str, AdapterEntry]) -> Optional[AdapterEntry]:
    """The entry of ``name``, or of the adapter a former name ``ALIASES`` stands for."""
    return registry.get(name) or registry.get(ALIASES.get(name, ""))


def load_adapter(target: str, args: Sequence[str] = ()):
    """Import "module:Callable" and call it with ``args``."""
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj(*args)


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------

def compare_output(name: str, got, expected: np.ndarray, atol: float, rtol: float) -> dict:
    """One output's check: ok, max_abs, max_rel, ratio (error / allowed, > 1 fails), reason."""
    rec = {"name": name, "ok": False, "max_abs": None, "max_rel": None, "ratio": None,
           "atol": atol, "rtol": rtol, "reason": ""}
    if got is None:
        rec["reason"] = f"missing output {name}"
        return rec
    try:
        got = np.asarray(got, np.float64)
    except (TypeError, ValueError) as e:
        rec["reason"] = f"{name}: not a numeric array ({e})"
        return rec
    exp = np.asarray(expected, np.float64)
    if got.shape != exp.shape:
        rec["reason"] = f"{name}: shape {got.shape} != expected {exp.shape}"
        return rec
    err = np.abs(got - exp)
    err = np.where(np.isnan(err), np.inf, err)
    allowed = atol + rtol * np.abs(exp)
    scale = float(np.max(np.abs(exp))) if exp.size else 0.0
    rec["max_abs"] = float(np.max(err)) if err.size else 0.0
    rec["max_rel"] = rec["max_abs"] / scale if scale else (0.0 if rec["max_abs"] == 0 else np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(err == 0, 0.0, err / allowed)
    rec["ratio"] = float(np.max(ratios)) if ratios.size else 0.0
    rec["ok"] = bool(np.all(within(got, exp, atol, rtol)))
    if not rec["ok"]:
        bad = int(np.sum(~within(got, exp, atol, rtol)))
        nan = " (NaN)" if np.isnan(got).any() else ""
        rec["reason"] = (f"{name}: {bad}/{exp.size} elements outside tolerance{nan}, "
                         f"max err {rec['max_abs']:.3g} = {rec['ratio']:.3g}x allowed")
    return rec


def check_case(backend: str, case, got: Mapping, outputs: Optional[Sequence[str]] = None) -> Result:
    """Compare an adapter's outputs with the case's expectations (``outputs``: the names to
    compare, default all of ``case.outputs``; the others are reported as not covered)."""
    outputs = tuple(case.outputs if outputs is None else outputs)
    recs = [compare_output(n, got.get(n), case.expected[n], case.tolerance[n]["atol"],
                           case.tolerance[n]["rtol"]) for n in outputs]

    def key(r):
        return np.inf if r["ratio"] is None else r["ratio"]

    worst = max(recs, key=key)
    failed = [r for r in recs if not r["ok"]]
    return Result(backend=backend, case=case.name, status="FAIL" if failed else "PASS",
                  reason="; ".join(r["reason"] for r in failed[:3])
                  + (f"; and {len(failed) - 3} more" if len(failed) > 3 else ""),
                  worst=worst["name"], max_abs=worst["max_abs"], max_rel=worst["max_rel"],
                  atol=worst["atol"], rtol=worst["rtol"], outputs=recs,
                  not_covered=[n for n in case.outputs if n not in outputs])


def run_case(backend: str, adapter, case) -> Result:
    """Run one case (SKIP when the adapter lacks a requirement, or the capability of every
    output; FAIL on an exception). Outputs whose capability the adapter lacks are not compared
    and are listed in ``Result.not_covered``."""
    caps = frozenset(getattr(adapter, "capabilities", ()))
    covered, not_covered = covered_outputs(case, caps)
    missing = [r for r in case.requires if r not in caps]
    if not covered:
        missing += sorted({output_capability(n) for n in not_covered} - set(missing))
    if missing:
        them = "it" if len(missing) == 1 else "them"
        return Result(backend, case.name, "SKIP",
                      reason=f"needs {', '.join(missing)}; {backend} lacks {them}")
    skip = getattr(adapter, "skip_reason", None)
    reason = skip(case) if skip is not None else None
    if reason:
        return Result(backend, case.name, "SKIP", reason=reason)
    try:
        got = adapter.run(case)
    except Exception as e:  # the adapter's failure is the case's failure, not the suite's
        tb = traceback.format_exc(limit=-3)
        return Result(backend, case.name, "FAIL", reason=f"error: {describe_error(e)}",
                      details=tb)
    if not isinstance(got, Mapping):
        return Result(backend, case.name, "FAIL",
                      reason=f"run() must return a dict, returned {type(got).__name__}")
    result = check_case(backend, case, got, covered)
    result.paths = [str(p) for p in getattr(adapter, "paths", ())]
    return result


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def describe_error(e: BaseException) -> str:
    """"Type: message" on one line (a row of the table): terminal colours dropped, whitespace
    runs (Keras' multi-line call reports) collapsed."""
    return " ".join(_ANSI.sub("", f"{type(e).__name__}: {e}").split())


def import_failure(backend: str, cases, error: str, explicit: bool) -> List[Result]:
    """Results for an adapter that cannot be imported: FAIL when it was asked for by name,
    SKIP when it was only selected by ``all``."""
    if explicit:
        return [Result(backend, c.name, "FAIL", reason=f"adapter import failed: {error}")
                for c in cases]
    return [Result(backend, c.name, "SKIP", reason=f"adapter not importable: {error}")
            for c in cases]


def run_inprocess(backend: str, entry: AdapterEntry, cases, explicit: bool = True) -> List[Result]:
    try:
        adapter = load_adapter(entry.target, entry.args)
    except Exception as e:
        return import_failure(backend, cases, describe_error(e), explicit)
    return [run_case(backend, adapter, c) for c in cases]


def run_worker(backend: str, entry: AdapterEntry, cases, *, case_pattern: Optional[str] = None,
               fixtures_dir: Optional[Path] = None, explicit: bool = True,
               timeout: Optional[float] = None) -> List[Result]:
    """Run one backend in a subprocess (``python -m dcmha.conformance --_worker NAME``) whose
    environment adds ``entry.env``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        cmd = [sys.executable, "-m", "dcmha.conformance", "--_worker", backend,
               "--_worker-out", str(out), "--_worker-target", entry.target]
        for arg in entry.args:
            cmd += ["--_worker-arg", arg]
        if case_pattern:
            cmd += ["--case", case_pattern]
        if fixtures_dir is not None:
            cmd += ["--fixtures", str(fixtures_dir)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, **entry.env})
        except subprocess.TimeoutExpired:
            return [Result(backend, c.name, "FAIL", reason=f"worker timed out after {timeout}s")
                    for c in cases]
        if not out.is_file():
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            return [Result(backend, c.name, "FAIL",
                           reason=f"worker exited with code {proc.returncode} without results: {tail}")
                    for c in cases]
        data = json.loads(out.read_text())
    if "import_error" in data:
        return import_failure(backend, cases, data["import_error"], explicit)
    by_name = {r["case"]: Result.from_dict(r) for r in data["results"]}
    return [by_name.get(c.name) or Result(backend, c.name, "FAIL", reason="worker gave no result")
            for c in cases]


def worker_main(backend: str, out_path: Path, target: str, args: Sequence[str],
                case_pattern: Optional[str], fixtures_dir: Optional[Path]) -> int:
    """The subprocess side of ``run_worker``: results (or the import error) as JSON."""
    from dcmha.conformance.cases import load_cases

    cases = load_cases(case_pattern, fixtures_dir)
    try:
        adapter = load_adapter(target, args)
    except Exception as e:
        payload = {"import_error": describe_error(e)}
    else:
        payload = {"results": [run_case(backend, adapter, c).to_dict() for c in cases]}
    Path(out_path).write_text(json.dumps(payload))
    return 0


def run_backend(backend: str, entry: AdapterEntry, cases, *, case_pattern: Optional[str] = None,
                fixtures_dir: Optional[Path] = None, explicit: bool = True,
                timeout: Optional[float] = None) -> List[Result]:
    """The reference adapter in this process, every other one in its own subprocess; an
    adapter that cannot run on this machine fails (named explicitly) or skips (``all``)."""
    if entry.unavailable is not None:
        if explicit:
            return [Result(backend, c.name, "FAIL", reason=f"cannot run here: {entry.unavailable}")
                    for c in cases]
        return [Result(backend, c.name, "SKIP", reason=f"cannot run here: {entry.unavailable}")
                for c in cases]
    if entry.target == REFERENCE_TARGET:
        return run_inprocess(backend, entry, cases, explicit)
    return run_worker(backend, entry, cases, case_pattern=case_pattern,
                      fixtures_dir=fixtures_dir, explicit=explicit, timeout=timeout)


__all__ = ["Result", "AdapterEntry", "ENTRY_POINT_GROUP", "ADAPTERS_ENV", "REFERENCE_TARGET",
           "IMPL_PREFIX", "IMPL_TARGET", "ALIASES", "discover_adapters", "implementation_entries",
           "resolve_alias", "parse_adapter_specs", "load_adapter", "compare_output", "check_case",
           "run_case", "run_inprocess", "run_worker", "run_backend", "worker_main"]
