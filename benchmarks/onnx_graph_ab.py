"""onnxruntime on two exports of the same models, side by side in one process (an A/B of an
exporter change).

    python benchmarks/onnx_graph_ab.py export DIR            # the current code's graphs
    python benchmarks/onnx_graph_ab.py compare DIR_A DIR_B [--rounds 40] [--cases ...]

``export`` writes the graphs of ``onnx_latency.py``'s models (B=1, D=256, N=8, 2 blocks;
the same seed) to DIR as ``<layer|stack>_<prefill|decode>_<float32|float16>.onnx``, with the
exporter of the checkout it runs in: export at commit A into one directory, at commit B into
another, then ``compare`` them. ``compare`` loads both graphs of each case in sessions of
``dcmha.export.session`` (the current custom-op library: it defines every op of older
graphs too), feeds both the same inputs (prefill: T=512; decode: one token at position 511
of a 512-position cache), and times one call of each alternately, ``--rounds`` rounds for
prefill and ten times as many steps for decode. Printed per case: each side's median, A/B
(above 1: B is faster), the median of the per-round ratios (``pairwise``, less sensitive to
the host's slow and fast stretches) and the largest absolute difference of the outputs.

Timings belong here, never in tests; see benchmarks/RESULTS.md for the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

CASES = [f"{c}_{m}_{d}" for c in ("layer", "stack") for m in ("prefill", "decode")
         for d in ("float32", "float16")]
LENGTH = 512


def export(directory: str) -> None:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import keras
    from onnx_latency import build_models

    from dcmha.export import to_onnx
    os.makedirs(directory, exist_ok=True)
    for dtype in ("float32", "float16"):
        keras.utils.set_random_seed(0)
        models = build_models(256, 8, 2, dtype=dtype)
        for case in ("layer", "stack"):
            for mode in ("prefill", "decode"):
                to_onnx(models[case], os.path.join(directory, f"{case}_{mode}_{dtype}.onnx"),
                        dtype=dtype, decode=mode == "decode")
    print("exported to", directory)


def _feeds(session, decode: bool, dtype) -> dict:
    rng = np.random.default_rng(0)
    feeds = {}
    for i in session.get_inputs():
        if i.name == "cache_update_index":
            feeds[i.name] = np.array(LENGTH - 1, np.int64)
            continue
        shape = [1 if d == "batch" else 1 if decode and d == "sequence_length"
                 else LENGTH if isinstance(d, str) or d is None else d for d in i.shape]
        feeds[i.name] = (rng.standard_normal(shape) * 0.5).astype(dtype)
    return feeds


def compare(dirs, rounds: int, cases) -> None:
    from dcmha.export import core
    for case in cases:
        sessions = [core.session(os.path.join(d, case + ".onnx")) for d in dirs]
        decode = "decode" in case
        feeds = _feeds(sessions[0], decode, np.float16 if "float16" in case else np.float32)
        outs = [s.run(None, feeds) for s in sessions]
        diff = max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                   for a, b in zip(*outs))
        for _ in range(3):
            for s in sessions:
                s.run(None, feeds)
        times = [[], []]
        for r in range(rounds * (10 if decode else 1)):
            for k in ((0, 1) if r % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                sessions[k].run(None, feeds)
                times[k].append(time.perf_counter() - t0)
        a, b = (float(np.median(t)) * 1e3 for t in times)
        pairwise = float(np.median(np.array(times[0]) / np.array(times[1])))
        print(f"{case:24s} A {a:8.3f} ms  B {b:8.3f} ms  A/B {a / b:5.3f}  pairwise "
              f"{pairwise:5.3f}  max |A - B| {diff:.2e}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write the current code's graphs to DIR")
    ex.add_argument("directory")
    cmp_ = sub.add_parser("compare", help="time DIR_A's and DIR_B's graphs side by side")
    cmp_.add_argument("dir_a")
    cmp_.add_argument("dir_b")
    cmp_.add_argument("--rounds", type=int, default=40)
    cmp_.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args(argv)
    if args.command == "export":
        export(args.directory)
    else:
        cases = [c for c in args.cases.split(",") if c]
        unknown = sorted(set(cases) - set(CASES))
        if unknown:
            ap.error(f"unknown cases {unknown}; expected some of {CASES}")
        compare([args.dir_a, args.dir_b], args.rounds, cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
