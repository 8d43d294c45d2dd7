"""Peak memory of a long causal forward of one DCMHA layer, per Keras backend.

The long-context target: B=1, T=16384, D=1024, N=16 (key_dim 64), causal,
float32, on a 2-core 24 GB machine, peak RSS <= 3 GiB (the unchunked scores
alone would be 16 heads x 16384^2 x 4 bytes = 17 GB).

Each measurement runs in a fresh child process with KERAS_BACKEND set, so one
backend's import never inflates another's figure; the child reports its
``VmHWM`` (peak resident set) before and after the call, and the call's wall
time. The layer runs with its defaults (``implementation="auto"``), or the
``--implementation`` and ``--query-chunk-size`` given.

    python benchmarks/long_context.py                          # torch, jax, tensorflow
    python benchmarks/long_context.py --backends torch --length 4096
    python benchmarks/long_context.py --json long_context.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _vm_hwm_gib() -> float:
    """Peak resident set of this process (VmHWM), GiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2 ** 20
    raise RuntimeError("VmHWM not found in /proc/self/status")


def child(args) -> None:
    """Build the layer, run one causal forward, print a JSON line."""
    import numpy as np
    import keras
    import dcmha

    T, D, N = args.length, args.hidden_dim, args.heads
    layer = dcmha.DCMHA(num_heads=N, key_dim=D // N, implementation=args.implementation,
                        query_chunk_size=args.query_chunk_size, seed=0)
    x = np.random.default_rng(0).standard_normal((1, T, D)).astype("float32")
    layer.build((1, T, D), (1, T, D))
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        fn = jax.jit(lambda tv, ntv, inp: layer.stateless_call(tv, ntv, inp, inp,
                                                               use_causal_mask=True)[0])
        tv = [v.value for v in layer.trainable_variables]
        ntv = [v.value for v in layer.non_trainable_variables]

        def run():
            return np.asarray(jax.block_until_ready(fn(tv, ntv, x)))
    elif backend == "torch":
        import torch

        def run():
            with torch.no_grad():
                return keras.ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    else:
        def run():
            return keras.ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    before = _vm_hwm_gib()
    t0 = time.perf_counter()
    y = run()
    seconds = time.perf_counter() - t0
    print(json.dumps({"backend": backend, "T": T, "D": D, "N": N,
                      "implementation": args.implementation,
                      "query_chunk_size": args.query_chunk_size,
                      "rss_before_call_gib": round(before, 3),
                      "peak_rss_gib": round(_vm_hwm_gib(), 3),
                      "seconds": round(seconds, 1), "finite": bool(np.isfinite(y).all()),
                      "output_shape": list(y.shape)}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="torch,jax,tensorflow")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--hidden-dim", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--implementation", default="auto")
    ap.add_argument("--query-chunk-size", type=int, default=None)
    ap.add_argument("--target-gib", type=float, default=3.0)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        child(args)
        return 0
    rows, ok = [], True
    print(f"causal forward of one DCMHA layer: B=1 T={args.length} D={args.hidden_dim} "
          f"N={args.heads} float32, implementation={args.implementation}, "
          f"query_chunk_size={args.query_chunk_size}")
    print(f"{'backend':<11} {'peak RSS':>9} {'before':>8} {'seconds':>8}  target")
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        cmd = [sys.executable, os.path.abspath(__file__), "--_child",
               "--length", str(args.length), "--hidden-dim", str(args.hidden_dim),
               "--heads", str(args.heads), "--implementation", args.implementation]
        if args.query_chunk_size is not None:
            cmd += ["--query-chunk-size", str(args.query_chunk_size)]
        env = dict(os.environ, KERAS_BACKEND=backend)
        out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                             timeout=args.timeout)
        if out.returncode != 0:
            print(f"{backend:<11} failed (exit {out.returncode}): {out.stderr[-2000:]}")
            ok = False
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        met = row["peak_rss_gib"] <= args.target_gib and row["finite"]
        ok &= met
        rows.append(dict(row, target_gib=args.target_gib, met=met))
        print(f"{backend:<11} {row['peak_rss_gib']:>7.2f}Gi {row['rss_before_call_gib']:>6.2f}Gi "
              f"{row['seconds']:>8.1f}  <= {args.target_gib} GiB {'met' if met else 'NOT met'}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
