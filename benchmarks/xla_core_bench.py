"""Benchmark of the TensorFlow/XLA DCMHA core (dcmha.backends.xla) on CPU.

    python benchmarks/xla_core_bench.py                 # everything (a few minutes)
    python benchmarks/xla_core_bench.py --only core     # core vs MHA core
    python benchmarks/xla_core_bench.py --only layer    # layer vs keras.layers.MultiHeadAttention
    python benchmarks/xla_core_bench.py --only rss      # 16k-token forward, peak RSS
    python benchmarks/xla_core_bench.py --json out.json

Three measurements (the targets in brackets):

* core: the DCMHA core (pre and post compose with query-/key-wise projection and
  gating, DCFormer++'s layout: G=1, R=2) against a plain MHA core
  softmax(q k^T / sqrt(d)) v with the causal mask, both XLA-compiled, at B=2,
  T=S=1024, N=8, d=64, causal, float32. Forward, and a training step (forward +
  gradients w.r.t. every input, all in one jitted function).
* layer: one ``dcmha.DCMHA(implementation="xla")`` layer against
  ``keras.layers.MultiHeadAttention`` on the TensorFlow backend, D=512, N=8,
  key_dim=64, same shapes, causal, float32, each jitted [train step <= 1.5x MHA,
  forward <= 1.3x].
* rss: a causal forward of the layer at B=1, T=16384, D=1024, N=16 (key_dim 64),
  float32, in a fresh subprocess; peak RSS from resource.getrusage [<= 3 GiB].

A and B are timed alternately (A B, B A, ...) after a warm-up call each, and the
medians are reported with their ratio: the machine may be shared, and
alternating spreads any background load over both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402


def _tf():
    import tensorflow as tf
    return tf


def _sync(x):
    tf = _tf()
    for t in tf.nest.flatten(x):
        t.numpy()


def alternate(fa, fb, repeats):
    """Median seconds of fa() and fb(), called alternately (one warm-up call each first)."""
    _sync(fa())
    _sync(fb())
    ta, tb = [], []
    for i in range(repeats):
        order = ((fa, ta), (fb, tb)) if i % 2 == 0 else ((fb, tb), (fa, ta))
        for fn, acc in order:
            t0 = time.perf_counter()
            _sync(fn())
            acc.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def _report(rows, name, a_name, b_name, ta, tb, target=None):
    ratio = ta / tb
    line = (f"{name:<14} {a_name} {ta * 1e3:8.1f} ms   {b_name} {tb * 1e3:8.1f} ms   "
            f"ratio {ratio:5.2f}")
    if target is not None:
        line += f"   (target <= {target}: {'met' if ratio <= target else 'NOT met'})"
    print(line, flush=True)
    rows[name] = {a_name + "_ms": ta * 1e3, b_name + "_ms": tb * 1e3, "ratio": ratio,
                  "target": target}


# ---------------------------------------------------------------------------
# core vs MHA core
# ---------------------------------------------------------------------------

def bench_core(args, rows):
    tf = _tf()
    from dcmha.backends.xla import dcmha_attention

    B, T, N, d, G, R = args.batch, args.length, args.heads, args.key_dim, 1, 2
    M = N // G
    rng = np.random.default_rng(0)
    f = lambda *s, sc=1.0: tf.constant(rng.normal(size=s) * sc, tf.float32)  # noqa: E731
    q, k, v = f(B, T, N, d), f(B, T, N, d), f(B, T, N, d)
    do = f(B, T, N, d)

    def terms():
        return dict(qw1=f(B, T, G, R, M, sc=.3), qw2=f(B, T, G, R, M, sc=.3),
                    kw1=f(B, T, G, R, M, sc=.3), kw2=f(B, T, G, R, M, sc=.3),
                    qdd=f(B, T, G, M, sc=.1), kdd=f(B, T, G, M, sc=.1))
    pre, post = terms(), terms()
    chunk = args.chunk

    def mha(q, k, v):
        s = tf.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(d)
        causal = tf.range(T)[None, :] <= tf.range(T)[:, None]
        p = tf.nn.softmax(tf.where(causal, s, -1e9), axis=-1)
        return tf.einsum("bnts,bsnh->btnh", p, v)

    def dcmha(q, k, v, pre, post):
        return dcmha_attention(q, k, v, num_groups=G, pre=pre, post=post, causal=True,
                               query_chunk_size=chunk)

    mha_fwd = tf.function(mha, jit_compile=True)
    dc_fwd = tf.function(dcmha, jit_compile=True)

    @tf.function(jit_compile=True)
    def mha_train(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            loss = tf.reduce_sum(mha(q, k, v) * do)
        return tape.gradient(loss, [q, k, v])

    @tf.function(jit_compile=True)
    def dc_train(q, k, v, pre, post):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v, pre, post])
            loss = tf.reduce_sum(dcmha(q, k, v, pre, post) * do)
        return tape.gradient(loss, [q, k, v, pre, post])

    print(f"core: B={B} T=S={T} N={N} d={d} G={G} R={R} causal float32, "
          f"query_chunk_size={chunk or 'default'}", flush=True)
    ta, tb = alternate(lambda: dc_fwd(q, k, v, pre, post), lambda: mha_fwd(q, k, v), args.repeats)
    _report(rows, "core_forward", "dcmha", "mha", ta, tb)
    ta, tb = alternate(lambda: dc_train(q, k, v, pre, post), lambda: mha_train(q, k, v),
                       args.repeats)
    _report(rows, "core_train", "dcmha", "mha", ta, tb)


# ---------------------------------------------------------------------------
# layer vs keras.layers.MultiHeadAttention
# ---------------------------------------------------------------------------

def _dcmha_layer(N, d, D, chunk):
    """A built DCMHA layer (the spec's defaults) forced onto the XLA core."""
    import dcmha

    layer = dcmha.DCMHA(num_heads=N, key_dim=d, implementation="xla", query_chunk_size=chunk)
    layer.build((None, None, D), (None, None, D))
    return layer


def bench_layer(args, rows):
    tf = _tf()
    import keras

    if keras.backend.backend() != "tensorflow":
        raise RuntimeError("set KERAS_BACKEND=tensorflow for the layer benchmark")
    B, T, D, N, d = args.batch, args.length, args.width, args.heads, args.key_dim
    layer = _dcmha_layer(N, d, D, args.chunk)
    mha = keras.layers.MultiHeadAttention(num_heads=N, key_dim=d)
    x = tf.constant(np.random.default_rng(1).normal(size=(B, T, D)), tf.float32)
    mha(x, x, use_causal_mask=True)   # build
    dy = tf.constant(np.random.default_rng(2).normal(size=(B, T, D)), tf.float32)

    def dc(x):
        return layer(x, x, use_causal_mask=True)

    def km(x):
        return mha(x, x, use_causal_mask=True)

    dc_fwd = tf.function(dc, jit_compile=True)
    km_fwd = tf.function(km, jit_compile=True)

    def train_step(fn, variables):
        @tf.function(jit_compile=True)
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(fn(x) * dy)
            return tape.gradient(loss, [x] + list(variables))
        return step

    dc_train = train_step(dc, [v.value for v in layer.trainable_variables])
    km_train = train_step(km, mha.trainable_variables)
    print(f"layer: B={B} T={T} D={D} N={N} key_dim={d} causal float32 "
          f"(DCMHA defaults: G=1, R=2, pre+post, query-/key-wise, projection+gating) "
          f"vs keras.layers.MultiHeadAttention", flush=True)
    ta, tb = alternate(lambda: dc_fwd(x), lambda: km_fwd(x), args.repeats)
    _report(rows, "layer_forward", "dcmha", "keras_mha", ta, tb, target=1.3)
    ta, tb = alternate(lambda: dc_train(x), lambda: km_train(x), args.repeats)
    _report(rows, "layer_train", "dcmha", "keras_mha", ta, tb, target=1.5)


# ---------------------------------------------------------------------------
# 16k-token forward: peak RSS in a fresh process
# ---------------------------------------------------------------------------

def rss_child(T, D, N, d, chunk):
    """Runs in the subprocess: one causal forward, prints a JSON line."""
    tf = _tf()
    layer = _dcmha_layer(N, d, D, chunk)
    x = tf.constant(np.random.default_rng(1).normal(size=(1, T, D)).astype(np.float32))
    fwd = tf.function(lambda x: layer(x, x, use_causal_mask=True), jit_compile=True)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    y = fwd(x).numpy()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    fwd(x).numpy()
    second = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux
    print(json.dumps({"peak_rss_gib": peak / 2 ** 20, "rss_before_call_gib": base / 2 ** 20,
                      "vm_hwm_gib": _vm_hwm_kib() / 2 ** 20, "first_call_s": first,
                      "second_call_s": second, "finite": bool(np.isfinite(y).all())}))


def _vm_hwm_kib():
    """Peak RSS of this address space from /proc (Linux), -1 elsewhere.

    getrusage's ru_maxrss survives exec(), so a child started by a big parent
    reports at least the parent's size; VmHWM does not. main() runs the rss part
    first, while this script is still small, so both agree.
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def bench_rss(args, rows):
    T, D, N, d = args.rss_length, 1024, 16, 64
    cmd = [sys.executable, os.path.abspath(__file__), "--_rss_child",
           json.dumps([T, D, N, d, args.chunk])]
    print(f"rss: causal forward of one layer, B=1 T={T} D={D} N={N} key_dim={d} float32, "
          "fresh process", flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.rss_timeout)
    if out.returncode != 0:
        print(out.stderr[-3000:])
        raise RuntimeError(f"rss child failed with exit code {out.returncode}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    ok = res["peak_rss_gib"] <= 3.0
    print(f"rss            peak {res['peak_rss_gib']:.2f} GiB (VmHWM {res['vm_hwm_gib']:.2f} GiB; "
          f"before the call {res['rss_before_call_gib']:.2f} GiB)   first call "
          f"{res['first_call_s']:.1f} s "
          f"(with compile), second {res['second_call_s']:.1f} s   "
          f"(target <= 3 GiB: {'met' if ok else 'NOT met'})", flush=True)
    rows["rss_16k"] = dict(res, target_gib=3.0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["core", "layer", "rss"], action="append",
                    help="run only these parts (repeatable)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--key-dim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=None, help="query_chunk_size (default: auto)")
    ap.add_argument("--rss-length", type=int, default=16384)
    ap.add_argument("--rss-timeout", type=float, default=1800)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--_rss_child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._rss_child:
        rss_child(*json.loads(args._rss_child))
        return 0
    parts = args.only or ["rss", "core", "layer"]
    parts = sorted(set(parts), key=["rss", "core", "layer"].index)   # rss first: see _vm_hwm_kib
    rows = {}
    for part in parts:
        {"core": bench_core, "layer": bench_layer, "rss": bench_rss}[part](args, rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
