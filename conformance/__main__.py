"""python -m dcmha.conformance: run the conformance cases on one or more backends.

    python -m dcmha.conformance --backend reference
    python -m dcmha.conformance --backend keras-jax,keras-torch --case 'grad_*' --json out.json
    python -m dcmha.conformance --backend impl-torch,impl-triton
    python -m dcmha.conformance --backend all
    python -m dcmha.conformance --list

Backends: the reference, keras-<backend> (the layer, implementation="auto"), impl-<name> for
every registered implementation but "ops" (the layer forced onto it, on the CPU), onnxruntime,
and any adapter an installed package registers; --list names them. Former names
triton-interpret, pallas-interpret and tf-xla stand for impl-triton, impl-pallas, impl-xla.

One row per (backend, case): backend, case, max abs error, max rel error (max|err| /
max|expected|) and tolerance of the limiting output, and PASS / FAIL / SKIP with the reason
(a PASS also names the outputs not covered and the implementation the layer ran); then the
line "N passed, M failed, K skipped". Exit code 0 when nothing failed, 1 when something failed
(or the fixtures are corrupt), 2 for a usage error (unknown backend, bad --adapter, no case
matching --case, a --json path whose directory does not exist; checked before the run).

A backend named explicitly that cannot be imported, or cannot run on this machine, fails all
its cases (you asked for it); with --backend all it is skipped with the reason. The command
never imports Keras, so it needs no configured Keras backend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

from dcmha.conformance.cases import load_cases
from dcmha.conformance.runner import (ALIASES, Result, discover_adapters,
                                      resolve_alias, run_backend, worker_main)
from dcmha.spec.reference import SPEC_VERSION


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def format_row(r: Result, wb: int, wc: int) -> str:
    tolerance = "-" if r.atol is None else f"atol={r.atol:.2e} rtol={r.rtol:.2e}"
    if r.status == "PASS":
        notes = [r.worst] if r.worst else []
        if r.not_covered:
            notes.append(f"not covered: {', '.join(r.not_covered)}")
        if r.paths:
            notes.append(f"via {', '.join(r.paths)}")
        result = f"PASS ({'; '.join(notes)})" if notes else "PASS"
    else:
        result = f"{r.status} ({r.reason})"
    return (f"{r.backend:<{wb}}  {r.case:<{wc}}  {_fmt(r.max_abs):>9}  {_fmt(r.max_rel):>9}  "
            f"{tolerance:<27}  {result}")


def summary_line(results: List[Result]) -> str:
    n = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    return f"{n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} skipped"


def report_path_problem(path: Optional[Path]) -> Optional[str]:
    """Why the ``--json`` report cannot be written to ``path`` (None: it can, or no report)."""
    if path is None:
        return None
    received = f"Received: --json {path}"
    if path.is_dir():
        return f"`--json` must name a file, not a directory. {received}"
    parent = path.parent
    if not parent.is_dir():
        return f"`--json` must be in an existing directory; {str(parent)!r} does not exist. {received}"
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"`--json` must be writable; permission denied. {received}"
    return None


def write_report(path: Path, report: dict) -> None:
    """Write the JSON report through a temporary file in the same directory (never half-written)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(report, indent=1, default=float) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dcmha.conformance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="reference",
                    help="NAME[,NAME...] or 'all' (default: reference)")
    ap.add_argument("--case", default=None, help="glob over case names (comma-separated globs)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    ap.add_argument("--list", action="store_true", help="list the cases and backends, run nothing")
    ap.add_argument("--adapter", action="append", default=[], metavar="NAME=MODULE:CLASS",
                    help="register an extra adapter (repeatable; also $DCMHA_CONFORMANCE_ADAPTERS)")
    ap.add_argument("--fixtures", type=Path, default=None,
                    help="fixtures directory (default: the packaged fixtures)")
    ap.add_argument("--timeout", type=float, default=3600.0,
                    help="seconds allowed to one backend's worker process (default 3600)")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_worker-out", dest="_worker_out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_worker-target", dest="_worker_target", default=None,
                    help=argparse.SUPPRESS)
    ap.add_argument("--_worker-arg", dest="_worker_args", action="append", default=[],
                    help=argparse.SUPPRESS)
    return ap


def _needs_implementations(args, plain) -> bool:
    """Whether the selection reads the implementation registry (it costs a subprocess):
    ``--list``, ``all``, or a name that is not among the ``plain`` adapters."""
    names = [b.strip() for b in args.backend.split(",")]
    return args.list or names == ["all"] or any(n not in plain for n in names)


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args._worker:
        return worker_main(args._worker, Path(args._worker_out), args._worker_target,
                           args._worker_args, args.case, args.fixtures)
    try:
        registry = discover_adapters(args.adapter, implementations=False)
    except ValueError as e:
        ap.error(str(e))
    if _needs_implementations(args, registry):
        try:
            registry = discover_adapters(args.adapter)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    problem = report_path_problem(args.json)
    if problem is not None:     # checked before the run: a run's report is never lost
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        cases = load_cases(args.case, args.fixtures)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not cases:
        ap.error(f"no case matches --case {args.case!r}")

    if args.list:
        w = max(len(c.name) for c in cases)
        for c in cases:
            print(f"{c.name:<{w}}  {c.kind:<9}  {c.dtype:<8}  [{', '.join(c.requires)}]  "
                  f"{c.description}")
        print(f"{len(cases)} cases; backends: {', '.join(registry)}")
        print("former names: " + ", ".join(f"{a} = {b}" for a, b in ALIASES.items()))
        return 0

    if args.backend.strip() == "all":
        backends, explicit = list(registry), False
    else:
        backends = [b.strip() for b in args.backend.split(",") if b.strip()]
        explicit = True
        unknown = [b for b in backends if resolve_alias(b, registry) is None]
        if unknown or not backends:
            ap.error(f"unknown backend {', '.join(map(repr, unknown)) or repr(args.backend)}; "
                     f"known backends: {', '.join(registry)}")

    wb = max(len("backend"), *(len(b) for b in backends))
    wc = max(len("case"), *(len(c.name) for c in cases))
    print(f"{'backend':<{wb}}  {'case':<{wc}}  {'max_abs':>9}  {'max_rel':>9}  "
          f"{'tolerance':<27}  result", flush=True)
    results: List[Result] = []
    for b in backends:
        rows = run_backend(b, resolve_alias(b, registry), cases, case_pattern=args.case,
                           fixtures_dir=args.fixtures, explicit=explicit, timeout=args.timeout)
        for r in rows:
            print(format_row(r, wb, wc), flush=True)
        results += rows
    line = summary_line(results)
    if args.json is not None:
        n = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
        write_report(args.json, {
            "spec_version": SPEC_VERSION, "backends": backends,
            "summary": {"passed": n["PASS"], "failed": n["FAIL"], "skipped": n["SKIP"],
                        "passed_with_outputs_not_covered": sum(
                            r.status == "PASS" and bool(r.not_covered) for r in results)},
            "results": [r.to_dict() for r in results]})
    print(line)
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
