"""python -m dcmha.conformance: run the conformance cases on one or more backends.

    python -m dcmha.conformance --backend reference
    python -m dcmha.conformance --backend keras-jax,keras-torch --case 'grad_*' --json out.json
    python -m dcmha.conformance --backend all
    python -m dcmha.conformance --list

One row per (backend, case): backend, case, max abs error, max rel error (max|err| /
max|expected|) and tolerance of the limiting output, and PASS / FAIL / SKIP with the reason;
then the line "N passed, M failed, K skipped". Exit code 0 when nothing failed, 1 when
something failed (or the fixtures are corrupt), 2 for a usage error (unknown backend, bad
--adapter, no case matching --case).

A backend named explicitly that cannot be imported fails all its cases (you asked for it);
with --backend all it is skipped with the import error as the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List

from dcmha.conformance.cases import load_cases
from dcmha.conformance.runner import Result, discover_adapters, run_backend, worker_main
from dcmha.spec.reference import SPEC_VERSION


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def format_row(r: Result, wb: int, wc: int) -> str:
    tolerance = "-" if r.atol is None else f"atol={r.atol:.2e} rtol={r.rtol:.2e}"
    if r.status == "PASS":
        result = f"PASS ({r.worst})" if r.worst else "PASS"
    else:
        result = f"{r.status} ({r.reason})"
    return (f"{r.backend:<{wb}}  {r.case:<{wc}}  {_fmt(r.max_abs):>9}  {_fmt(r.max_rel):>9}  "
            f"{tolerance:<27}  {result}")


def summary_line(results: List[Result]) -> str:
    n = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    return f"{n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} skipped"


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
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        registry = discover_adapters(args.adapter)
    except ValueError as e:
        ap.error(str(e))
    if args._worker:
        return worker_main(args._worker, Path(args._worker_out), args.case, args.fixtures,
                           args.adapter)
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
        return 0

    if args.backend.strip() == "all":
        backends, explicit = list(registry), False
    else:
        backends = [b.strip() for b in args.backend.split(",") if b.strip()]
        explicit = True
        unknown = [b for b in backends if b not in registry]
        if unknown or not backends:
            ap.error(f"unknown backend {', '.join(map(repr, unknown)) or repr(args.backend)}; "
                     f"known backends: {', '.join(registry)}")

    wb = max(len("backend"), *(len(b) for b in backends))
    wc = max(len("case"), *(len(c.name) for c in cases))
    print(f"{'backend':<{wb}}  {'case':<{wc}}  {'max_abs':>9}  {'max_rel':>9}  "
          f"{'tolerance':<27}  result", flush=True)
    results: List[Result] = []
    for b in backends:
        rows = run_backend(b, registry[b], cases, case_pattern=args.case,
                           fixtures_dir=args.fixtures, extra_adapters=args.adapter,
                           explicit=explicit, timeout=args.timeout)
        for r in rows:
            print(format_row(r, wb, wc), flush=True)
        results += rows
    line = summary_line(results)
    if args.json is not None:
        n = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
        args.json.write_text(json.dumps({
            "spec_version": SPEC_VERSION, "backends": backends,
            "summary": {"passed": n["PASS"], "failed": n["FAIL"], "skipped": n["SKIP"]},
            "results": [r.to_dict() for r in results]}, indent=1, default=float) + "\n")
    print(line)
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
