"""Discover adapters, run cases on them and compare against the fixtures.

The reference adapter runs in this process; every other adapter runs in a subprocess of its
own (``python -m dcmha.conformance --_worker NAME``) that writes its results as JSON, so
Keras backends, TensorFlow and Triton never share a process.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from importlib.metadata import entry_points
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from dcmha.spec.tolerance import within

ENTRY_POINT_GROUP = "dcmha.conformance.adapters"
#: Extra adapters, "name=module:Class" separated by commas (tests, out-of-tree backends).
ADAPTERS_ENV = "DCMHA_CONFORMANCE_ADAPTERS"
REFERENCE_TARGET = "dcmha.conformance.adapters.reference:ReferenceAdapter"


@dataclasses.dataclass
class Result:
    """The outcome of one (backend, case).

    ``max_abs`` / ``max_rel`` / ``atol`` / ``rtol`` are those of the limiting output ``worst``
    (the one closest to or furthest past its tolerance); ``max_rel`` is max|err| / max|expected|.
    ``outputs`` has one dict per compared output.
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


def discover_adapters(extra: Sequence[str] = ()) -> Dict[str, str]:
    """Registered adapters {name: "module:Class"}: entry points of the group
    ``dcmha.conformance.adapters``, then ``$DCMHA_CONFORMANCE_ADAPTERS``, then ``extra``
    (later ones override)."""
    found = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    found.update(parse_adapter_specs(os.environ.get(ADAPTERS_ENV, "").split(",")))
    found.update(parse_adapter_specs(extra))
    return dict(sorted(found.items(), key=lambda kv: (kv[0] != "reference", kv[0])))


def load_adapter(target: str):
    """Import "module:Class" and instantiate it."""
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj()


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


def check_case(backend: str, case, got: Mapping) -> Result:
    """Compare an adapter's outputs with the case's expectations."""
    recs = [compare_output(n, got.get(n), case.expected[n], case.tolerance[n]["atol"],
                           case.tolerance[n]["rtol"]) for n in case.outputs]

    def key(r):
        return np.inf if r["ratio"] is None else r["ratio"]

    worst = max(recs, key=key)
    failed = [r for r in recs if not r["ok"]]
    return Result(backend=backend, case=case.name, status="FAIL" if failed else "PASS",
                  reason="; ".join(r["reason"] for r in failed[:3])
                  + (f"; and {len(failed) - 3} more" if len(failed) > 3 else ""),
                  worst=worst["name"], max_abs=worst["max_abs"], max_rel=worst["max_rel"],
                  atol=worst["atol"], rtol=worst["rtol"], outputs=recs)


def run_case(backend: str, adapter, case) -> Result:
    """Run one case (SKIP when the adapter lacks a requirement; FAIL on an exception)."""
    caps = frozenset(getattr(adapter, "capabilities", ()))
    missing = [r for r in case.requires if r not in caps]
    if missing:
        them = "it" if len(missing) == 1 else "them"
        return Result(backend, case.name, "SKIP",
                      reason=f"needs {', '.join(missing)}; {backend} lacks {them}")
    try:
        got = adapter.run(case)
    except Exception as e:  # the adapter's failure is the case's failure, not the suite's
        tb = traceback.format_exc(limit=-3)
        return Result(backend, case.name, "FAIL", reason=f"error: {type(e).__name__}: {e}",
                      details=tb)
    if not isinstance(got, Mapping):
        return Result(backend, case.name, "FAIL",
                      reason=f"run() must return a dict, returned {type(got).__name__}")
    return check_case(backend, case, got)


def import_failure(backend: str, cases, error: str, explicit: bool) -> List[Result]:
    """Results for an adapter that cannot be imported: FAIL when it was asked for by name,
    SKIP when it was only selected by ``all``."""
    if explicit:
        return [Result(backend, c.name, "FAIL", reason=f"adapter import failed: {error}")
                for c in cases]
    return [Result(backend, c.name, "SKIP", reason=f"adapter not importable: {error}")
            for c in cases]


def run_inprocess(backend: str, target: str, cases, explicit: bool = True) -> List[Result]:
    try:
        adapter = load_adapter(target)
    except Exception as e:
        return import_failure(backend, cases, f"{type(e).__name__}: {e}", explicit)
    return [run_case(backend, adapter, c) for c in cases]


def run_worker(backend: str, cases, *, case_pattern: Optional[str] = None,
               fixtures_dir: Optional[Path] = None, extra_adapters: Sequence[str] = (),
               explicit: bool = True, timeout: Optional[float] = None) -> List[Result]:
    """Run one backend in a subprocess (``python -m dcmha.conformance --_worker NAME``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        cmd = [sys.executable, "-m", "dcmha.conformance", "--_worker", backend,
               "--_worker-out", str(out)]
        if case_pattern:
            cmd += ["--case", case_pattern]
        if fixtures_dir is not None:
            cmd += ["--fixtures", str(fixtures_dir)]
        for spec in extra_adapters:
            cmd += ["--adapter", spec]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
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


def worker_main(backend: str, out_path: Path, case_pattern: Optional[str],
                fixtures_dir: Optional[Path], extra_adapters: Sequence[str]) -> int:
    """The subprocess side of ``run_worker``: results (or the import error) as JSON."""
    from dcmha.conformance.cases import load_cases

    target = discover_adapters(extra_adapters)[backend]
    cases = load_cases(case_pattern, fixtures_dir)
    try:
        adapter = load_adapter(target)
    except Exception as e:
        payload = {"import_error": f"{type(e).__name__}: {e}"}
    else:
        payload = {"results": [run_case(backend, adapter, c).to_dict() for c in cases]}
    Path(out_path).write_text(json.dumps(payload))
    return 0


def run_backend(backend: str, target: str, cases, *, case_pattern: Optional[str] = None,
                fixtures_dir: Optional[Path] = None, extra_adapters: Sequence[str] = (),
                explicit: bool = True, timeout: Optional[float] = None) -> List[Result]:
    """The reference adapter in this process, every other one in its own subprocess."""
    if target == REFERENCE_TARGET:
        return run_inprocess(backend, target, cases, explicit)
    return run_worker(backend, cases, case_pattern=case_pattern, fixtures_dir=fixtures_dir,
                      extra_adapters=extra_adapters, explicit=explicit, timeout=timeout)


__all__ = ["Result", "ENTRY_POINT_GROUP", "ADAPTERS_ENV", "REFERENCE_TARGET", "discover_adapters",
           "parse_adapter_specs", "load_adapter", "compare_output", "check_case", "run_case",
           "run_inprocess", "run_worker", "run_backend", "worker_main"]
