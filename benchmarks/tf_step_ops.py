"""Where tensorflow's training step spends its time, op by op: DCMHA against MHA.

    KERAS_BACKEND=tensorflow python benchmarks/tf_step_ops.py [--shape medium] [--steps 4]
        [--variants dcmha,mha] [--top 20]

Each variant of ``model_step.py`` (the same ``DCFormerLM``, ``compile`` and ``fit``) runs
two warm-up ``fit`` calls, then one of ``--steps`` steps under ``tf.profiler``; xprof's
framework op stats of that trace give each op's self time. Printed: thread-milliseconds
per step (self time summed over the threads that ran the op), by op type for every
variant, then the ops whose time differs most between the first two variants (the input
pipeline's iterators left out), their names stripped of the model's and layer's prefixes (so the same op of every layer adds
up). Needs ``pip install xprof`` (the profile's converter); not a project dependency.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def op_stats(shape, variant, steps, logdir):
    """[(op type, op name, self microseconds over the profiled steps)] of one variant."""
    import json

    import numpy as np
    import tensorflow as tf
    from xprof.convert import raw_to_tool_data

    import model_step

    B, T = model_step.SHAPES[shape][4], model_step.SHAPES[shape][3]
    rng = np.random.default_rng(0)
    x = rng.integers(0, model_step.VOCAB, (B * steps, T))
    y = rng.integers(0, model_step.VOCAB, (B * steps, T))
    model = model_step.compiled(model_step.build(shape, variant), shape)
    for _ in range(2):
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    tf.profiler.experimental.start(logdir)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    tf.profiler.experimental.stop()
    planes = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    data, _ = raw_to_tool_data.xspace_to_tool_data(planes, "framework_op_stats", {})
    table = json.loads(data)[0]
    cols = {c["id"]: i for i, c in enumerate(table["cols"])}
    rows = [[c.get("v") if c else None for c in r["c"]] for r in table["rows"]]
    return [(r[cols["type"]], r[cols["operation"]], r[cols["total_self_time"]])
            for r in rows if r[cols["type"]] != "IDLE"]


def _op_key(name):
    """An op's name without the model and layer prefixes (layers_3_1 -> layers_X)."""
    name = re.sub(r"^.*?/(gradient_tape/)?[a-z_]+_1/", r"\1", name)
    return re.sub(r"layers_\d+_1", "layers_X", name)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="medium")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--variants", default="dcmha,mha")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    import model_step
    variants = args.variants.split(",")
    if args.shape not in model_step.SHAPES or not set(variants) <= set(model_step.VARIANTS):
        p.error(f"--shape from {sorted(model_step.SHAPES)}, --variants from "
                f"{sorted(model_step.VARIANTS)}. Received: {args.shape}, {args.variants}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1. Received: {args.steps}")
    by_type, by_op = {}, {}
    for v in variants:
        with tempfile.TemporaryDirectory() as d:
            stats = op_stats(args.shape, v, args.steps, d)
        by_type[v], by_op[v] = collections.Counter(), collections.Counter()
        for kind, name, us in stats:
            by_type[v][kind] += us / 1e3 / args.steps
            by_op[v][_op_key(name)] += us / 1e3 / args.steps
    print(f"tensorflow {args.shape}: thread-ms per step (self time summed over threads), "
          f"one fit of {args.steps} steps")
    print(f"{'total':<44}" + "".join(f"{sum(by_type[v].values()):>12.1f}" for v in variants))
    kinds = sorted(set().union(*by_type.values()), key=lambda k: -max(t[k] for t in by_type.values()))
    for k in kinds[:args.top]:
        print(f"{k[:44]:<44}" + "".join(f"{by_type[v][k]:>12.2f}" for v in variants))
    if len(variants) >= 2:
        a, b = variants[:2]
        print(f"\nlargest differences {a} - {b}, by op:")
        # the input pipeline's iterator ops vary with its warm-up, not with the model
        names = {n for n in set(by_op[a]) | set(by_op[b]) if not n.startswith("Iterator::")}
        for n in sorted(names, key=lambda n: -abs(by_op[a][n] - by_op[b][n]))[:args.top]:
            print(f"{by_op[a][n] - by_op[b][n]:>9.2f} {by_op[a][n]:>9.2f} {by_op[b][n]:>9.2f}  {n}")


if __name__ == "__main__":
    main()
