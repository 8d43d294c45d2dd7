"""A whole model's training step as users train it: DCFormerLM against the same model
with ``attention="mha"`` (Transformer++), through ``compile`` + ``fit``.

Each model is compiled with Keras's defaults (``jit_compile="auto"``: XLA on jax,
eager on torch, ``tf.function`` on tensorflow, with XLA there only where Keras turns
it on, i.e. with a GPU), AdamW and sparse cross-entropy on logits, then ``fit`` runs
``--steps`` steps of random token windows per round. The models alternate round by
round in one process (``--repeats`` rounds after two warm-up rounds each); a figure
is the median time per step over the rounds, with the range of the rounds, and the
median process CPU time per step (all threads), which other load disturbs less. A round
is timed from the call to ``fit`` to its ``on_train_end``: after that TensorFlow tears
down the call's data iterator, which takes 2 ms or, at random, 120-300 ms with either
model, a cost per ``fit`` call that an epoch of many steps does not pay per step. After
the warm-up every Python object is moved out of the garbage collector's reach
(``gc.freeze``): a full collection scans both models' objects and would land in one
round of either model at random.

Beside each measured ratio stands the analytic FLOP ratio of the two models, the
floor a step could reach: every token-wise product (projections, dynamic weights,
SwiGLU, output head) at 2 FLOPs per weight per token, the attention core at
4·B·N·T·S·d, and DCMHA's compositions at 2·B·T·S·N·M per stage and side (the
(M x M) product of each (t, s) with the query-side and with the key-side factor),
all dense (T·S), forward x 3 for a training step. Elementwise work (softmax, norms,
masks, the optimizer) is not counted.

``--breakdown`` adds variants to the alternation, each the same DCFormerLM with some
of DCMHA switched off, and the forward alone (``predict_on_batch``) of each variant,
so that the extra time splits into: gating only (``gating``: the dd projection and
the diagonal terms of both stages and sides), post-composition only (``post_only``),
full DCMHA (adding the low-rank projection and the pre stage), and forward against
backward + optimizer. (``attention="mha"`` is DCMHA's own layer with both stages off,
so the layer's projections and core are the same in every variant.)

``--step-times`` also times each step (a batch-end callback; jax then waits for each step)
and reports each variant's median, 90th-percentile and slowest single step, the spread
within a round that the rounds' range hides.

One process per Keras backend (Keras fixes its backend at import); ``--backends``
starts them in turn. Run it on a quiet machine.

    python benchmarks/model_step.py --backends jax,torch,tensorflow --repeats 5
    python benchmarks/model_step.py --backends torch --shapes small --breakdown
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

#: name -> (layers, width, heads, T, batch). ``paper_d``: the paper's head size, d = 128.
SHAPES = {
    "small": (2, 64, 8, 64, 16),          # the quality study's shape
    "medium": (4, 256, 8, 256, 8),
    "large": (4, 512, 8, 512, 4),
    "paper_d": (4, 512, 4, 512, 4),
}
#: variant -> DCFormerLM options (``--breakdown`` times all; otherwise mha and dcmha).
VARIANTS = {
    "mha": dict(attention="mha"),
    "gating": dict(dynamic_projection=False),
    "post_only": dict(pre_compose=False),
    "dcmha": dict(),
}
VOCAB = 256
#: ``--jit-compile`` -> ``compile(jit_compile=...)``.
JIT_COMPILE = {"auto": "auto", "true": True, "false": False}


def build(shape, variant, seed=0):
    import keras

    from dcmha.models import DCFormerLM

    layers, width, heads, _, _ = SHAPES[shape]
    name, _, implementation = variant.partition(":")
    options = dict(VARIANTS[name], **({"implementation": implementation} if implementation
                                      else {}))
    keras.utils.set_random_seed(seed)
    return DCFormerLM(vocab_size=VOCAB, num_layers=layers, hidden_dim=width, num_heads=heads,
                      name=name, **options)


def compiled(model, shape, jit_compile="auto"):
    import keras

    T, B = SHAPES[shape][3:]
    model.build((B, T))
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    return model


def flops(model, shape):
    """Analytic FLOPs of one training step (forward x 3), dense attention; see the module
    docstring for what is counted."""
    from dcmha.layers import DCMHA

    layers, width, heads, T, B = SHAPES[shape]
    tokens = B * T
    token_wise = 0
    for v in model.trainable_variables:
        path = v.path
        if len(v.shape) < 2 or "static" in path or "w_static" in path:
            continue
        if "embedding" in path and not getattr(model, "tie_embeddings", False):
            continue                                   # a lookup, not a product
        size = 1
        for n in v.shape:
            size *= int(n)
        token_wise += size
    total = 2 * tokens * token_wise
    for layer in model._flatten_layers():
        if not isinstance(layer, DCMHA):
            continue
        N, d = layer.num_heads, layer.key_dim
        total += 4 * B * N * T * T * d                 # q k^T and p v
        M = N // layer.num_groups
        c = layer.get_config()
        sides = int(c["query_wise"]) + int(c["key_wise"])
        if c["dynamic_gating"] and not c["key_wise"]:
            sides += 1                                 # kdd alone still needs the key side
        stages = int(c["pre_compose"]) + int(c["post_compose"])
        if c["dynamic_projection"] or c["dynamic_gating"] or c["static_compose"]:
            total += stages * max(sides, 1) * 2 * B * T * T * N * M
    return 3 * total


def _fit_seconds(model, x, y, batch, steps=None):
    """(wall, process CPU) seconds of one ``fit`` over x, y, from the call to its
    ``on_train_end``: what ``fit`` does after it (TensorFlow tears down its data iterator
    there, 120-300 ms of a call at random for either model) is not a training step's.
    ``steps``: a list that gets each step's wall seconds (a batch-end callback, which
    makes jax wait for each step's results; off by default)."""
    import keras

    end = {}

    class _End(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            end["wall"], end["cpu"] = time.perf_counter(), time.process_time()

    marks = []

    class _Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            marks.append(time.perf_counter())

    callbacks = [_End()] + ([_Steps()] if steps is not None else [])
    t0, c0 = time.perf_counter(), time.process_time()
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    if steps is not None:
        steps.extend(b - a for a, b in zip([t0] + marks, marks))
    return end["wall"] - t0, end["cpu"] - c0


def _forward_seconds(model, x):
    t0 = time.perf_counter()
    model.predict_on_batch(x)
    return time.perf_counter() - t0


def run_shape(shape, variants, repeats, steps, forward, jit_compile="auto", step_times=False):
    import numpy as np

    T, B = SHAPES[shape][3:]
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (steps * B, T), dtype="int32")
    y = rng.integers(0, VOCAB, (steps * B, T), dtype="int32")
    models = {v: compiled(build(shape, v), shape, jit_compile) for v in variants}
    for m in models.values():                          # compile and warm up
        _fit_seconds(m, x, y, B)
        _fit_seconds(m, x, y, B)
        if forward:
            _forward_seconds(m, x[:B])
            _forward_seconds(m, x[:B])
    # Both models' objects (their traced graphs above all) to the permanent generation:
    # a full collection of the process's objects, which would otherwise land in one round
    # of either model at random (200-300 ms in a tensorflow 4 x 512 round), belongs to
    # neither model's step.
    gc.collect()
    gc.freeze()
    step = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    fwd = {v: [] for v in variants}
    each = {v: [] for v in variants}
    for _ in range(repeats):
        for v, m in models.items():
            wall, used = _fit_seconds(m, x, y, B, each[v] if step_times else None)
            step[v].append(wall / steps)
            cpu[v].append(used / steps)
            if forward:
                fwd[v].append(min(_forward_seconds(m, x[:B]) for _ in range(3)))
    out = {}
    for v in variants:
        s = sorted(step[v])
        row = dict(step_ms=1e3 * float(np.median(s)), step_range_ms=[1e3 * s[0], 1e3 * s[-1]],
                   cpu_ms=1e3 * float(np.median(cpu[v])),
                   flops=flops(models[v], shape),
                   parameters=int(sum(np.prod(w.shape) for w in models[v].trainable_variables)))
        if forward:
            row["forward_ms"] = 1e3 * float(np.median(fwd[v]))
        if step_times:        # single steps: median, 90th percentile and slowest
            row["single_step_ms"] = [1e3 * float(np.percentile(each[v], q))
                                     for q in (50, 90, 100)]
        out[v] = row
    base = out["mha"]
    for v, row in out.items():
        row["ratio"] = row["step_ms"] / base["step_ms"]
        row["cpu_ratio"] = row["cpu_ms"] / base["cpu_ms"]
        row["flop_ratio"] = row["flops"] / base["flops"]
        # The spread of this variant's rounds about their median (the issue's +-15% rule).
        row["spread"] = max(abs(r / row["step_ms"] - 1) for r in row["step_range_ms"])
    return out


def conditions(jit_compile):
    import keras

    return dict(backend=keras.backend.backend(), keras=keras.__version__, jit_compile=jit_compile,
                load=os.getloadavg(), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))


def child(args):
    shapes = args.shapes.split(",")
    variants = (args.variants.split(",") if args.variants else
                list(VARIANTS) if args.breakdown else ["mha", "dcmha"])
    jit_compile = JIT_COMPILE[args.jit_compile]
    result = dict(conditions=conditions(jit_compile), shapes={})
    for shape in shapes:
        result["shapes"][shape] = run_shape(shape, variants, args.repeats, args.steps,
                                            args.breakdown, jit_compile, args.step_times)
        print(json.dumps({"shape": shape, **result["shapes"][shape]}), file=sys.stderr,
              flush=True)
    result["conditions"]["load_after"] = os.getloadavg()
    print("RESULT " + json.dumps(result))


def render(results):
    lines = ["| backend | shape (L x D, heads, T, B) | variant | step ms (range) | ratio | "
             "CPU-time ratio | FLOP ratio | forward ms | spread |",
             "|---|---|---|---|---|---|---|---|---|"]
    for backend, res in results.items():
        for shape, rows in res["shapes"].items():
            L, D, N, T, B = SHAPES[shape]
            for v, r in rows.items():
                if v == "mha" and len(rows) == 2:
                    continue
                fwd = f"{r['forward_ms']:.1f}" if "forward_ms" in r else "-"
                lines.append(
                    f"| {backend} | {shape}: {L} x {D}, {N}, {T}, {B} | {v} | "
                    f"{r['step_ms']:.1f} ({r['step_range_ms'][0]:.1f}-"
                    f"{r['step_range_ms'][1]:.1f}) | {r['ratio']:.2f}x | "
                    f"{r['cpu_ratio']:.2f}x | {r['flop_ratio']:.2f}x | {fwd} | "
                    f"±{100 * r['spread']:.0f}% |")
                if "single_step_ms" in r:
                    lines[-1] += " single steps {:.1f} / {:.1f} / {:.1f} ms;".format(
                        *r["single_step_ms"])
            if len(rows) == 2:
                m = rows["mha"]
                lines[-1] += f" mha {m['step_ms']:.1f} ms ({m['step_range_ms'][0]:.1f}-" \
                             f"{m['step_range_ms'][1]:.1f}, ±{100 * m['spread']:.0f}%)"
                if "single_step_ms" in m:
                    lines[-1] += ", single steps {:.1f} / {:.1f} / {:.1f} ms".format(
                        *m["single_step_ms"])
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default=None,
                   help="comma-separated Keras backends, each in its own process "
                        "(default: KERAS_BACKEND's, in this process)")
    p.add_argument("--shapes", default="small,medium,large,paper_d",
                   help=f"comma-separated, from {list(SHAPES)}")
    p.add_argument("--repeats", type=int, default=5, help="alternating rounds (>= 1)")
    p.add_argument("--steps", type=int, default=10, help="training steps per round (>= 1)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the partial variants and each variant's forward")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated, from {list(VARIANTS)} (mha first), each optionally "
                        "with ':IMPLEMENTATION' (e.g. dcmha:ops) to force DCMHA's path")
    p.add_argument("--jit-compile", default="auto", choices=list(JIT_COMPILE),
                   help="compile()'s jit_compile (default: Keras's own, 'auto'); 'true' on "
                        "tensorflow runs fit under XLA as Keras does with a GPU")
    p.add_argument("--step-times", action="store_true",
                   help="also time each step (a batch-end callback) and report the median, "
                        "90th percentile and slowest single step of each variant")
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        p.error(f"--shapes: unknown {unknown}; choose from {list(SHAPES)}")
    if args.repeats < 1 or args.steps < 1:
        p.error(f"--repeats and --steps must be >= 1. Received: {args.repeats}, {args.steps}")
    if args.backends is None:
        child(args)
        return
    results = {}
    for backend in args.backends.split(","):
        cmd = [sys.executable, __file__, "--shapes", args.shapes, "--repeats",
               str(args.repeats), "--steps", str(args.steps)] + \
            (["--breakdown"] if args.breakdown else []) + \
            (["--variants", args.variants] if args.variants else []) + \
            (["--step-times"] if args.step_times else []) + \
            ["--jit-compile", args.jit_compile]
        env = dict(os.environ, KERAS_BACKEND=backend)
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            raise SystemExit(f"{backend}: the benchmark process failed (exit {proc.returncode})")
        results[backend] = json.loads(line[-1][len("RESULT "):])
    print(render(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
