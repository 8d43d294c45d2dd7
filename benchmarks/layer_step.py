"""Training-step and forward time of one DCMHA layer vs keras.layers.MultiHeadAttention.

One step = forward + backward of mean(layer(x, x, use_causal_mask=True) ** 2)
w.r.t. the input and every trainable variable, compiled the backend's default
way: ``jax.jit(jax.value_and_grad(...))`` over ``stateless_call`` under JAX,
eager autograd under PyTorch, ``tf.function`` (no XLA) under TensorFlow. The
forward alone is ``layer(x, x, use_causal_mask=True)`` compiled the same way
(``jax.jit`` of ``stateless_call``; eager under ``torch.no_grad()``;
``tf.function``). The backend is the one KERAS_BACKEND selects. The two layers
run alternately (training steps, then forwards) and the medians of wall time
(and, for information, of process CPU time) are compared.

``--implementation`` is passed to the DCMHA layer ("auto", "ops" or a fast
path of ``dcmha.ops.FAST_PATHS``, e.g. "torch"), so each path can be timed.

On a shared machine OpenMP's default active spin-waiting makes every parallel
op wait for a descheduled thread; eager PyTorch runs thousands of small ops per
DCMHA step, so the benchmark sets OMP_WAIT_POLICY=PASSIVE unless the
environment already sets it (``--omp-wait-policy keep`` leaves it alone). Both
layers run under the same setting.

    KERAS_BACKEND=torch python benchmarks/layer_step.py --repeats 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def _torch_input(x):
    """``x`` as a torch tensor on Keras's device (the GPU where there is one), so that a
    timed call does not include the copy to it."""
    import keras

    return keras.ops.convert_to_tensor(x)


def _torch_sync(xt):
    """Wait for the GPU's queued work (a CUDA call returns before it has run)."""
    import torch

    if xt.is_cuda:
        torch.cuda.synchronize()


def make_step(layer, x, tf_xla=False):
    """A zero-argument callable running one training step and blocking on it.

    ``tf_xla`` (tensorflow only): XLA-compile it, ``tf.function(jit_compile=True)``, as
    Keras's ``Model.fit`` does on TensorFlow by default (``jit_compile="auto"``).
    """
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def loss_fn(trainable, non_trainable, inp):
            y, _ = layer.stateless_call(trainable, non_trainable, inp, inp, use_causal_mask=True)
            return jnp.mean(jnp.square(y.astype("float32")))

        grad_fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 2)))
        tv = [v.value for v in layer.trainable_variables]
        ntv = [v.value for v in layer.non_trainable_variables]
        xj = jnp.asarray(x)

        def step():
            loss, grads = grad_fn(tv, ntv, xj)
            jax.block_until_ready(grads)
        return step
    if backend == "torch":
        import torch

        xt = _torch_input(x).requires_grad_()

        def step():
            for v in layer.trainable_variables:
                v.value.grad = None
            xt.grad = None
            y = layer(xt, xt, use_causal_mask=True)
            loss = torch.mean(torch.square(y.float()))
            loss.backward()
            _torch_sync(xt)
        return step
    if backend == "tensorflow":
        import tensorflow as tf

        xt = tf.constant(x)

        @tf.function(jit_compile=True if tf_xla else None)
        def grad_step(inp):
            with tf.GradientTape() as tape:
                tape.watch(inp)
                y = layer(inp, inp, use_causal_mask=True)
                loss = tf.reduce_mean(tf.square(tf.cast(y, "float32")))
            return loss, tape.gradient(loss, [inp] + list(layer.trainable_variables))

        def step():
            loss, grads = grad_step(xt)
            _ = [g.numpy() for g in grads[:1]]      # block until done
        return step
    raise SystemExit(f"unsupported backend {backend!r}")


def make_forward(layer, x, tf_xla=False):
    """A zero-argument callable running one forward (no gradient) and blocking on it
    (``tf_xla`` as for ``make_step``)."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def fwd_fn(trainable, non_trainable, inp):
            y, _ = layer.stateless_call(trainable, non_trainable, inp, inp, use_causal_mask=True)
            return y

        fwd = jax.jit(fwd_fn)
        tv = [v.value for v in layer.trainable_variables]
        ntv = [v.value for v in layer.non_trainable_variables]
        xj = jnp.asarray(x)

        def run():
            jax.block_until_ready(fwd(tv, ntv, xj))
        return run
    if backend == "torch":
        import torch

        xt = _torch_input(x)

        def run():
            with torch.no_grad():
                layer(xt, xt, use_causal_mask=True)
            _torch_sync(xt)
        return run
    if backend == "tensorflow":
        import tensorflow as tf

        xt = tf.constant(x)

        @tf.function(jit_compile=True if tf_xla else None)
        def fwd(inp):
            return layer(inp, inp, use_causal_mask=True)

        def run():
            fwd(xt).numpy()
        return run
    raise SystemExit(f"unsupported backend {backend!r}")


def conditions(layer, x):
    """What a figure depends on, recorded beside it: the machine (CPU model, cores, caches,
    transparent huge pages), the threading set-up (intra-op threads, OMP_WAIT_POLICY, the
    torch core's workers), the load average at the start, the implementation "auto" takes
    for this input and whether the compiled compose kernel loads."""
    import keras

    from dcmha import ops as dops

    def read(path):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    cpu = read("/proc/cpuinfo") or ""
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                  if ln.startswith("model name")), None)
    caches = {}
    for index in range(8):
        base = f"/sys/devices/system/cpu/cpu0/cache/index{index}/"
        level, kind, size = read(base + "level"), read(base + "type"), read(base + "size")
        if level and size:
            caches[f"L{level}{'' if kind == 'Unified' else kind[0].lower()}"] = size
    out = {"cpu_model": model, "cpu_count": os.cpu_count(), "caches_per_core_or_shared": caches,
           "transparent_hugepage": read("/sys/kernel/mm/transparent_hugepage/enabled"),
           "load_average_1min": os.getloadavg()[0],
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
           "dcmha_torch_workers": os.environ.get("DCMHA_TORCH_WORKERS")}
    q = keras.ops.convert_to_tensor(np.zeros((x.shape[0], x.shape[1], layer.num_heads,
                                              layer.key_dim), "float32"))
    explain = getattr(dops, "explain_implementation", None)      # absent in older checkouts
    out["auto_takes"] = explain(q, q, q, use_causal_mask=True)[-1][0] if explain else None
    backend = keras.backend.backend()
    if backend == "torch":
        import torch
        out["intra_op_threads"] = torch.get_num_threads()
    try:
        from dcmha.backends import cpu_kernel
        out["compose_kernel"] = ("loaded" if cpu_kernel.load()
                                 else f"unavailable: {cpu_kernel.unavailable_reason()}")
    except Exception as e:                        # noqa: BLE001 - recorded, not fatal
        out["compose_kernel"] = f"unavailable: {e}"
    return out


def _over_processes(args, argv):
    """Run this script ``args.processes`` times in fresh processes; the median and range of
    the per-process ratios (and every process's result) as the figure."""
    import subprocess
    import sys
    import tempfile

    argv = list(sys.argv[1:] if argv is None else argv)
    keep = []
    skip = False
    for a in argv:                                  # drop --processes N and --json PATH
        if skip:
            skip = False
            continue
        if a in ("--processes", "--json"):
            skip = True
            continue
        if not a.startswith(("--processes=", "--json=")):
            keep.append(a)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            out = os.path.join(tmp, f"{i}.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), *keep, "--json", out],
                           check=True)
            with open(out) as f:
                runs.append(json.load(f))
    result = {"processes": args.processes, "runs": runs}
    for key in ("ratio", "forward_ratio"):
        values = [r[key] for r in runs if key in r]
        if values:
            result[key] = {"median": statistics.median(values), "min": min(values),
                           "max": max(values), "all": values}
            print(f"{key} over {len(values)} processes: median {statistics.median(values):.2f}x, "
                  f"range {min(values):.2f}-{max(values):.2f}x "
                  f"({', '.join(f'{v:.2f}' for v in values)})")
    return _written(result, args.json)


def _written(result, path):
    """``result``, written as JSON to ``path`` first when a path is given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _alternate(runs, repeats):
    """Wall and CPU times of each callable, run alternately ``repeats`` times."""
    times = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():              # alternate A and B
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return times, cpu


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--implementation", default="auto",
                        help="DCMHA implementation: auto, ops or a fast path (e.g. torch)")
    parser.add_argument("--query-chunk-size", type=int, default=None)
    parser.add_argument("--omp-wait-policy", default="PASSIVE",
                        help="OMP_WAIT_POLICY to set if unset (before importing the backend), "
                             "or 'keep'")
    parser.add_argument("--no-forward", action="store_true",
                        help="time the training step only")
    parser.add_argument("--tf-xla", action="store_true",
                        help="tensorflow: tf.function(jit_compile=True) around the step and the "
                             "forward (what Model.fit / predict use by default)")
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--processes", type=int, default=1,
                        help="run the measurement in this many fresh processes, one after "
                             "the other, and report the spread of their ratios (one process "
                             "is not a figure: see RESULTS.md, 'What the torch ratio depends on')")
    args = parser.parse_args(argv)
    if args.processes > 1:
        return _over_processes(args, argv)
    if args.omp_wait_policy != "keep":
        os.environ.setdefault("OMP_WAIT_POLICY", args.omp_wait_policy)

    import keras
    import dcmha

    B, T, D, N = args.batch, args.length, args.dim, args.heads
    x = np.random.default_rng(0).standard_normal((B, T, D)).astype("float32")
    layers = {
        "dcmha": dcmha.DCMHA(num_heads=N, key_dim=D // N, implementation=args.implementation,
                             query_chunk_size=args.query_chunk_size, seed=0),
        "mha": keras.layers.MultiHeadAttention(num_heads=N, key_dim=D // N, use_bias=False,
                                               seed=0),
    }
    steps, forwards = {}, {}
    setup = conditions(layers["dcmha"], x)
    for name, layer in layers.items():
        layer(x[:, :8], x[:, :8])                   # build
        steps[name] = make_step(layer, x, args.tf_xla)
        if not args.no_forward:
            forwards[name] = make_forward(layer, x, args.tf_xla)
        for _ in range(args.warmup):
            steps[name]()
            if not args.no_forward:
                forwards[name]()
    times, cpu = _alternate(steps, args.repeats)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    med_cpu = {name: statistics.median(ts) for name, ts in cpu.items()}
    result = {
        "backend": keras.backend.backend(), "batch": B, "length": T, "dim": D, "heads": N,
        "repeats": args.repeats, "implementation": args.implementation,
        "query_chunk_size": args.query_chunk_size,
        "dcmha_ms": 1e3 * med["dcmha"], "mha_ms": 1e3 * med["mha"],
        "ratio": med["dcmha"] / med["mha"],
        "dcmha_cpu_ms": 1e3 * med_cpu["dcmha"], "mha_cpu_ms": 1e3 * med_cpu["mha"],
        "cpu_ratio": med_cpu["dcmha"] / med_cpu["mha"],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "cpu_count": os.cpu_count(),
        "conditions": setup,
        "dcmha_all_ms": [1e3 * t for t in times["dcmha"]],
        "mha_all_ms": [1e3 * t for t in times["mha"]],
    }
    print(f"{result['backend']}: B={B} T={T} D={D} N={N} causal float32 train step "
          f"(implementation={args.implementation}): "
          f"DCMHA {result['dcmha_ms']:.1f} ms, MHA {result['mha_ms']:.1f} ms, "
          f"ratio {result['ratio']:.2f}x (median of {args.repeats}; CPU time ratio "
          f"{result['cpu_ratio']:.2f}x)")
    print("conditions: " + ", ".join(f"{k}={v}" for k, v in setup.items()))
    if forwards:
        f_times, f_cpu = _alternate(forwards, args.repeats)
        f_med = {name: statistics.median(ts) for name, ts in f_times.items()}
        f_med_cpu = {name: statistics.median(ts) for name, ts in f_cpu.items()}
        result.update({
            "forward_dcmha_ms": 1e3 * f_med["dcmha"], "forward_mha_ms": 1e3 * f_med["mha"],
            "forward_ratio": f_med["dcmha"] / f_med["mha"],
            "forward_cpu_ratio": f_med_cpu["dcmha"] / f_med_cpu["mha"],
            "forward_dcmha_all_ms": [1e3 * t for t in f_times["dcmha"]],
            "forward_mha_all_ms": [1e3 * t for t in f_times["mha"]],
        })
        print(f"{result['backend']}: B={B} T={T} D={D} N={N} causal float32 forward "
              f"(implementation={args.implementation}): "
              f"DCMHA {result['forward_dcmha_ms']:.1f} ms, MHA {result['forward_mha_ms']:.1f} ms, "
              f"ratio {result['forward_ratio']:.2f}x (median of {args.repeats}; CPU time ratio "
              f"{result['forward_cpu_ratio']:.2f}x)")
    return _written(result, args.json)


if __name__ == "__main__":
    main()
