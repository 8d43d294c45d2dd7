"""Where ``implementation="auto"`` should switch from the plain core to a fast path: one
DCMHA layer's training step under ``compile`` + ``fit`` (each backend's defaults), two
implementations side by side at several (batch, length) sizes.

    KERAS_BACKEND=jax python benchmarks/dispatch_thresholds.py --implementations ops,jax_cpu
    KERAS_BACKEND=tensorflow python benchmarks/dispatch_thresholds.py \\
        --implementations ops,tf_cpu --sizes 2x16,2x64,16x64

The layer is self-attention with a causal mask, ``--dim`` wide with ``--heads`` heads,
trained with Adam on a mean-squared error (what the layer costs, not a model). Both
implementations are built and warmed up first, then alternate round by round
(``--repeats`` rounds of ``--steps`` steps each); the figures are medians per step of wall
time and of process CPU time, with the range of the rounds, and the ratio of the second
implementation to the first. The thresholds in ``dcmha.backends`` and RESULTS.md,
"Dispatch thresholds", come from this script.
"""

from __future__ import annotations

import argparse
import json
import time


def _sizes(text):
    out = []
    for part in text.split(","):
        b, _, t = part.strip().partition("x")
        if not (b.isdigit() and t.isdigit()) or int(b) < 1 or int(t) < 1:
            raise SystemExit(f"--sizes: expected BATCHxLENGTH items such as 2x64, got {part!r}")
        out.append((int(b), int(t)))
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--implementations", default="ops,auto",
                   help="two DCMHA implementations, the baseline first (default: %(default)s)")
    p.add_argument("--sizes", default="2x8,2x16,2x32,2x64,16x16,16x64",
                   help="comma-separated BATCHxLENGTH (default: %(default)s)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    args.implementations = args.implementations.split(",")
    if len(args.implementations) != 2:
        raise SystemExit(f"--implementations: expected two names, got {args.implementations}")
    args.sizes = _sizes(args.sizes)
    for name in ("dim", "heads", "repeats", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.dim % args.heads:
        raise SystemExit(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    return args


def _model(implementation, length, dim, heads):
    import keras

    from dcmha.layers import DCMHA

    inputs = keras.Input((length, dim))
    layer = DCMHA(num_heads=heads, key_dim=dim // heads, implementation=implementation)
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    model.compile(optimizer="adam", loss="mse")
    return model


def measure(args, batch, length):
    import numpy as np

    x = np.random.default_rng(0).standard_normal(
        (batch * args.steps, length, args.dim)).astype("float32")
    models = {}
    for name in args.implementations:
        models[name] = _model(name, length, args.dim, args.heads)
        for _ in range(2):
            models[name].fit(x, x, batch_size=batch, verbose=0)
    rounds = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            w0, c0 = time.perf_counter(), time.process_time()
            model.fit(x, x, batch_size=batch, verbose=0)
            rounds[name].append(((time.perf_counter() - w0) / args.steps * 1e3,
                                 (time.process_time() - c0) / args.steps * 1e3))
    out = {}
    for name, r in rounds.items():
        wall = [w for w, _ in r]
        out[name] = dict(step_ms=float(np.median(wall)), range_ms=[min(wall), max(wall)],
                         cpu_ms=float(np.median([c for _, c in r])))
    base, other = args.implementations
    out["ratio"] = out[other]["step_ms"] / out[base]["step_ms"]
    out["cpu_ratio"] = out[other]["cpu_ms"] / out[base]["cpu_ms"]
    return out


def main(argv=None):
    args = parse(argv)
    import os

    import keras

    base, other = args.implementations
    results = dict(backend=keras.backend.backend(), load=list(os.getloadavg()),
                   dim=args.dim, heads=args.heads, sizes={})
    print(f"{keras.backend.backend()}: {other} against {base}, one layer's step (ms, median "
          f"of {args.repeats} rounds of {args.steps} steps)")
    for batch, length in args.sizes:
        r = measure(args, batch, length)
        results["sizes"][f"{batch}x{length}"] = r
        print(f"B={batch:<3} T=S={length:<5} T*S={length * length:<7} "
              f"{base} {r[base]['step_ms']:8.2f} ({r[base]['range_ms'][0]:.2f}-"
              f"{r[base]['range_ms'][1]:.2f})  {other} {r[other]['step_ms']:8.2f} "
              f"({r[other]['range_ms'][0]:.2f}-{r[other]['range_ms'][1]:.2f})  "
              f"ratio {r['ratio']:.2f} (CPU {r['cpu_ratio']:.2f})", flush=True)
    results["load_after"] = list(os.getloadavg())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
