"""A tensorflow training step's dynamic weights: the forward and backward of
``dcmha.ops.slot_dynamic_weights`` (the form of TensorFlow's graphs without XLA, where ops
run one by one) against the same function at another revision.

    python benchmarks/dynamic_weights_step.py --against REV [--shapes small,medium]
        [--calls 300]

One process, Keras on TensorFlow. ``--against`` reads ``dcmha_core/ops/composition.py`` at
git revision REV and runs its ``slot_dynamic_weights`` in this package's namespace; the two
(a ``tf.function`` each) alternate call by call, and the medians of ``--calls`` calls are
printed with their ratio, after the largest difference of their gradients. The loss is the
sum of the squared weights; the gradients are w.r.t. x, dw1, qkw and dd. Shapes are
``model_step.py``'s (B, T, D and heads, in one group), R = 2, the four slots. Figures:
benchmarks/RESULTS.md ("A model's training step").
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from model_step import SHAPES  # noqa: E402

C, G, R = 4, 1, 2


def revision_function(rev):
    """``slot_dynamic_weights`` as ``composition.py`` defines it at git revision ``rev``,
    run in the current module's namespace."""
    from dcmha.ops import composition
    src = subprocess.run(["git", "show", f"{rev}:dcmha_core/ops/composition.py"],
                         cwd=os.path.dirname(HERE), check=True, capture_output=True,
                         text=True).stdout
    found = re.search(r"^def slot_dynamic_weights\(.*?(?=^\S)", src, re.S | re.M)
    if found is None:
        raise SystemExit(f"no slot_dynamic_weights in composition.py at {rev}")
    namespace = dict(composition.__dict__)
    exec(found.group(0), namespace)                               # noqa: S102 - our own file
    return namespace["slot_dynamic_weights"]


def step(fn, arrays):
    """A ``tf.function`` computing fn's weights and their gradients."""
    import tensorflow as tf
    from keras import ops
    variables = [tf.Variable(a) for a in arrays]

    @tf.function
    def call():
        with tf.GradientTape() as tape:
            out = fn(*variables, C=C, rank=R, gelu_approximate=True)
            value = sum(ops.sum(a * a) for parts in out.values() for a in parts)
        return tape.gradient(value, variables)
    return call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="git revision to compare with")
    ap.add_argument("--shapes", default="small,medium", help=f"from {sorted(SHAPES)}")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    if not set(shapes) <= set(SHAPES) or args.calls < 1:
        ap.error(f"--shapes from {sorted(SHAPES)}, --calls >= 1. Received: {args.shapes}, "
                 f"{args.calls}")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    from dcmha.ops import composition
    if keras.backend.backend() != "tensorflow":
        ap.error("runs on Keras's tensorflow backend (KERAS_BACKEND). Received: "
                 f"{keras.backend.backend()}")
    other = revision_function(args.against)
    for shape in shapes:
        _, D, M, T, B = SHAPES[shape]          # layers, width, heads, T, B
        K = 2 * R * M
        rng = np.random.default_rng(0)
        arrays = [rng.normal(size=s).astype("float32") * f for s, f in (
            ((B, T, D), 1.0), ((D, G, C, K), 0.1), ((G, C, K, 2 * R, M), 0.1),
            ((D, G, C * M), 0.1))]
        calls = {"against": step(other, arrays),
                 "current": step(composition.slot_dynamic_weights, arrays)}
        grads = {n: [np.asarray(g) for g in call()] for n, call in calls.items()}
        diff = max(float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(a)))))
                   for a, b in zip(grads["against"], grads["current"]))
        for _ in range(20):
            for call in calls.values():
                call()
        times = {n: [] for n in calls}
        for _ in range(args.calls):
            for n, call in calls.items():
                t = time.perf_counter()
                call()
                times[n].append(time.perf_counter() - t)
        med = {n: float(np.median(t)) * 1e3 for n, t in times.items()}
        print(f"{shape} (B, T, D) = {(B, T, D)}: {args.against} "
              f"{med['against']:.3f} ms, current {med['current']:.3f} ms, "
              f"current / {args.against} {med['current'] / med['against']:.3f}; "
              f"largest gradient difference "
              f"{diff:.1e} (relative to the largest gradient)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
