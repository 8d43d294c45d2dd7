"""The dispatch table of docs/fast-paths.md, rendered from the registry.

Usage: python tools/dispatch_table.py [--write PAGE | --check PAGE]

Without arguments it prints the markdown table of dcmha's own registered
implementations (``dcmha.registry.implementations()``, those whose module is
part of dcmha): name, Keras backend, devices, where ``"auto"`` may take it, the
capabilities it lacks, the compose terms it computes, and its declared
preference (priority, size threshold, one-query calls). ``--write PAGE``
replaces the table between the page's two marker comments; ``--check PAGE``
exits 1, printing both tables, when the page's table differs from the
registry's. The per-call rules an implementation's module adds (``preferred``,
``unsupported``) need the framework and are described in the page's prose.

The registry's declarations are data and do not depend on the Keras backend, so
the script imports Keras on the numpy backend when none is set (the quickest).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

BEGIN = ("<!-- dispatch-table:begin (generated from dcmha.registry by "
         "tools/dispatch_table.py; do not edit by hand) -->")
END = "<!-- dispatch-table:end -->"

#: Row order: by Keras backend as README lists them, "any" (the plain core) last.
_BACKEND_ORDER = ("jax", "torch", "tensorflow", "numpy", "any")


def _names(values) -> str:
    return ", ".join(f"`{v}`" for v in sorted(values)) or "—"


def _devices(impl) -> str:
    text = ", ".join(sorted(impl.devices))
    if impl.cpu_env:
        env = " ".join(f"{k}={v}" for k, v in sorted(impl.cpu_env.items()))
        text += f"; cpu with `{env}`"
    return text


def _preference(impl) -> str:
    if impl.name == "ops":
        return "the fallback: `auto` takes it when no other path does"
    parts = [f"priority {impl.priority}"]
    if impl.min_length_product:
        parts.append(f"T·S ≥ {impl.min_length_product}")
    if impl.one_query_only:
        parts.append("one-query calls (T = 1); other calls run the plain core")
    if impl.graph_only:
        parts.append("calls traced into a graph")
    return "; ".join(parts)


def rows(table=None) -> list:
    """dcmha's own implementations in table order: by backend, then priority (highest
    first), then name."""
    if table is None:
        from dcmha import registry
        table = registry.implementations()
    own = [i for i in table.values() if i.module.startswith("dcmha.")]
    return sorted(own, key=lambda i: (_BACKEND_ORDER.index(i.backend), -i.priority, i.name))


def render(table=None) -> str:
    """The markdown table, between the two marker lines (no trailing newline)."""
    from dcmha.spec import terms as spec_terms
    all_terms = frozenset(spec_terms.TERM_NAMES)
    lines = [BEGIN,
             "| name | Keras backend | devices | `auto` on | lacks | terms | preference |",
             "|---|---|---|---|---|---|---|"]
    for impl in rows(table):
        terms = "all" if impl.terms == all_terms else _names(impl.terms)
        auto = ", ".join(sorted(impl.auto_devices)) or "—"
        lines.append(f"| `{impl.name}` | {impl.backend} | {_devices(impl)} | {auto} | "
                     f"{_names(impl.lacks)} | {terms} | {_preference(impl)} |")
    lines.append(END)
    return "\n".join(lines)


def page_table(text: str, page: str = "the page") -> str:
    """The marked block of a page's text, markers included (ValueError if absent)."""
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < start:
        raise ValueError(f"{page} must hold the dispatch table between the lines {BEGIN!r} "
                         f"and {END!r}. Received: a page without them")
    return text[start:stop + len(END)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PAGE", help="replace the table in PAGE")
    group.add_argument("--check", metavar="PAGE", help="exit 1 if PAGE's table is stale")
    args = parser.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "numpy")
    table = render()
    page = args.write or args.check
    if page is None:
        print(table)
        return 0
    try:
        text = Path(page).read_text(encoding="utf-8")
        current = page_table(text, page)
    except (OSError, ValueError) as e:
        print(f"dispatch_table: {e}", file=sys.stderr)
        return 2
    if args.check:
        if current == table:
            return 0
        print(f"{page}: the dispatch table differs from the registry's; run "
              f"python tools/dispatch_table.py --write {page}\n--- page\n{current}\n"
              f"--- registry\n{table}", file=sys.stderr)
        return 1
    Path(page).write_text(text.replace(current, table), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
