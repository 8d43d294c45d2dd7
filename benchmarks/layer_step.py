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

        xt = torch.tensor(x, requires_grad=True)

        def step():
            for v in layer.trainable_variables:
                v.value.grad = None
            xt.grad = None
            y = layer(xt, xt, use_causal_mask=True)
            loss = torch.mean(torch.square(y.float()))
            loss.backward()
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

        xt = torch.tensor(x)

        def run():
            with torch.no_grad():
                layer(xt, xt, use_causal_mask=True)
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
    args = parser.parse_args(argv)
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
        "dcmha_all_ms": [1e3 * t for t in times["dcmha"]],
        "mha_all_ms": [1e3 * t for t in times["mha"]],
    }
    print(f"{result['backend']}: B={B} T={T} D={D} N={N} causal float32 train step "
          f"(implementation={args.implementation}): "
          f"DCMHA {result['dcmha_ms']:.1f} ms, MHA {result['mha_ms']:.1f} ms, "
          f"ratio {result['ratio']:.2f}x (median of {args.repeats}; CPU time ratio "
          f"{result['cpu_ratio']:.2f}x)")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
