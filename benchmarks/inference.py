"""Inference speed: cached decoding per token (DCMHA vs composition off) and onnxruntime vs Keras.

    python benchmarks/inference.py [--section decode|onnx|all] [--backends jax,torch,tensorflow]
        [--cases lm1024,lm256,layer2560] [--repeats 5] [--json out.json]

Section "decode", one process per Keras backend (the
script re-invokes itself with KERAS_BACKEND set; float32, CPU, batch 1):

- "lm1024" / "lm256": ``DCFormerLM`` with 4 layers, D=1024 N=16 (64-token
  prompt, 64 new tokens) / D=256 N=8 (64-token prompt, 128 new tokens), vocab
  256, DCMHA against the same model with ``attention="mha"`` (which is
  ``pre_compose=False, post_compose=False``: composition off, no dynamic
  weights). Per token: one step of ``generate``'s loop (greedy pick, host
  copy of the token, the compiled cached step), A and B alternating step by
  step at the same cache positions, every step of ``repeats`` generations;
  also the wall time of whole ``generate`` calls (prefill included).
- "layer<D>" (e.g. "layer2560", N = D / 80, i.e. N=32 at D=2560; "layer256",
  "layer1024" use the LM sizes' heads): one ``DCMHA`` layer's cached step (one
  token at position 96 of a 128-position cache, causal, RoPE), compiled as
  ``generate`` compiles it (``jax.jit`` of ``stateless_call`` with the cache donated, a
  ``tf.function`` called through ``flat_calls``, eager under ``torch.no_grad()``), against
  the same layer with ``pre_compose=False, post_compose=False``, 50 alternating steps per
  repeat.

Each repeat runs A (DCMHA) then B (composition off) in the same process, after
warm-up; the medians and the spread (the quartiles of the ratios of the
pairs) are reported. The 1-minute load average is printed with the figures: on a shared
machine ratios are only as good as the load allows.

Section "onnx" runs ``benchmarks/onnx_latency.py`` with ``--backends`` and
``--repeats`` (onnxruntime vs Keras, prefill and decode; it prints its own
table) and stores its JSON result under "onnx".

OMP_WAIT_POLICY=PASSIVE is set unless the environment sets it (as in
layer_step.py: eager PyTorch's many small ops otherwise wait on descheduled
spinning threads on a shared machine); ``--omp-wait-policy keep`` leaves it
alone (OpenMP's default: what a user gets), ``--omp-wait-policy ACTIVE`` sets
that. The torch figures depend on it: with PASSIVE every op that enters an
OpenMP parallel region (PyTorch's bmm and softmax do at any size) wakes the
sleeping worker threads, 50-100 us each. Each row records the policy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BACKENDS = ("jax", "torch", "tensorflow")
#: name -> (layers, D, N, prompt, new tokens)
LM_CASES = {"lm1024": (4, 1024, 16, 64, 64), "lm256": (4, 256, 8, 64, 128)}
LAYER_HEADS = {256: 8, 1024: 16}
CACHE_LENGTH, STEP_INDEX = 128, 96
LAYER_STEPS = 50          # alternating steps per repeat in the layer cases


def _load():
    return os.getloadavg()[0]


def _summary(a, b):
    """Medians (ms) of A and B, the ratio of the medians and the spread: the quartiles of
    the ratios of the pairs (A, B) run back to back."""
    q1, _, q3 = np.percentile([x / y for x, y in zip(a, b)], [25, 50, 75])
    return {"dcmha_ms": 1e3 * statistics.median(a), "off_ms": 1e3 * statistics.median(b),
            "ratio": statistics.median(a) / statistics.median(b),
            "ratio_q1": float(q1), "ratio_q3": float(q3), "samples": len(a)}


def _alternate(run_a, run_b, repeats, warmup=2):
    for _ in range(warmup):
        run_a()
        run_b()
    a, b = [], []
    for _ in range(repeats):
        a.append(run_a())
        b.append(run_b())
    return a, b


# ---------------------------------------------------------------------------
# Worker side (one Keras backend per process)
# ---------------------------------------------------------------------------

def _lm_case(name, repeats):
    import keras
    from dcmha.models import DCFormerLM

    layers, D, N, prompt, new = LM_CASES[name]
    ids = np.random.default_rng(0).integers(0, 256, size=(1, prompt)).astype("int32")

    def model(attention):
        keras.utils.set_random_seed(0)
        lm = DCFormerLM(vocab_size=256, num_layers=layers, hidden_dim=D, num_heads=N,
                        attention=attention)
        lm.build((1, None))
        return lm

    lms = {"dcmha": model("dcmha"), "mha": model("mha")}

    def decoder(lm):
        """generate's loop, one step per call: (seconds of the step, including the greedy
        pick and the host copy of the token, as in generate)."""
        from keras import ops

        step = lm._decode_function()
        state = {}

        def index(i):                        # as generate passes it
            return i if keras.backend.backend() == "torch" else ops.convert_to_tensor(
                np.int32(i))

        def restart():
            cache = lm.init_cache(1, prompt + new)
            last, cache = step(ops.convert_to_tensor(ids), cache, index(0))
            state.update(last=last, cache=cache, i=0)

        def run():
            if state.get("i", new) >= new - 1:
                restart()
            t0 = time.perf_counter()
            tok = ops.expand_dims(ops.cast(ops.argmax(state["last"], axis=-1), "int32"), -1)
            tok = np.asarray(ops.convert_to_numpy(tok), dtype="int32")
            state["last"], state["cache"] = step(ops.convert_to_tensor(tok), state["cache"],
                                                 index(prompt + state["i"]))
            ops.convert_to_numpy(state["last"][0, 0])
            state["i"] += 1
            return time.perf_counter() - t0
        return run

    def whole(lm):
        def run():
            t0 = time.perf_counter()
            lm.generate(ids, new)
            return time.perf_counter() - t0
        return run

    # Every step of a generation, alternating A and B at the same cache positions.
    a, b = _alternate(decoder(lms["dcmha"]), decoder(lms["mha"]), repeats * (new - 1),
                      warmup=new)
    ga, gb = _alternate(whole(lms["dcmha"]), whole(lms["mha"]), max(1, repeats // 2), warmup=0)
    return dict(_summary(a, b), case=name, layers=layers, width=D, heads=N, prompt=prompt,
                new_tokens=new, vocab=256, generate_dcmha_s=statistics.median(ga),
                generate_off_s=statistics.median(gb),
                what="DCFormerLM decode step (generate's loop); B = attention='mha'")


def _layer_step(layer, D):
    """A zero-argument callable: one cached step of ``layer``, blocking; returns seconds."""
    import keras

    cache = layer.init_cache(1, CACHE_LENGTH)
    x = np.random.default_rng(1).normal(size=(1, 1, D)).astype("float32")
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        def fn(trainable, non_trainable, x, cache, index):
            out, _ = layer.stateless_call(trainable, non_trainable, x, x, use_causal_mask=True,
                                          cache=cache, cache_update_index=index)
            return out

        step = jax.jit(fn, donate_argnums=(3,))          # as generate: the cache is donated
        tv = [v.value for v in layer.trainable_variables]
        ntv = [v.value for v in layer.non_trainable_variables]
        xi, index = jax.numpy.asarray(x), jax.numpy.int32(STEP_INDEX)
        state = {"cache": cache}

        def run():
            t0 = time.perf_counter()
            y, state["cache"] = step(tv, ntv, xi, state["cache"], index)
            jax.block_until_ready(y)
            return time.perf_counter() - t0
    elif backend == "tensorflow":
        import tensorflow as tf

        from dcmha.framework.tensorflow import flat_calls

        @flat_calls                           # as generate calls its step
        @tf.function(reduce_retracing=True, autograph=False)
        def step(x, cache, index):
            return layer(x, x, use_causal_mask=True, cache=cache, cache_update_index=index)

        xi, index = tf.constant(x), tf.constant(STEP_INDEX, tf.int32)

        def run():
            t0 = time.perf_counter()
            y, _ = step(xi, cache, index)
            y.numpy()
            return time.perf_counter() - t0
    else:
        import torch

        xi, index = torch.tensor(x), torch.tensor(STEP_INDEX, dtype=torch.int32)

        def run():
            t0 = time.perf_counter()
            with torch.no_grad():
                layer(xi, xi, use_causal_mask=True, cache=cache, cache_update_index=index)
            return time.perf_counter() - t0
    return run


def _layer_case(name, repeats):
    import keras
    from dcmha.layers import DCMHA

    D = int(name[len("layer"):])
    N = LAYER_HEADS.get(D, max(1, D // 80))

    def layer(**options):
        keras.utils.set_random_seed(0)
        lay = DCMHA(N, D // N, rope_max_wavelength=10000, **options)
        lay.build((1, None, D), (1, None, D))
        return _layer_step(lay, D)

    a, b = _alternate(layer(), layer(pre_compose=False, post_compose=False),
                      repeats * LAYER_STEPS, warmup=5)
    return dict(_summary(a, b), case=name, width=D, heads=N, cache_length=CACHE_LENGTH,
                index=STEP_INDEX, what="one layer's cached step; B = composition off")


def worker(cases, repeats):
    import keras

    rows = []
    for name in cases:
        load = _load()
        row = (_lm_case if name in LM_CASES else _layer_case)(name, repeats)
        row.update(backend=keras.backend.backend(), load_before=load, load_after=_load(),
                   omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ---------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------

def _run_backend(backend, argv_tail, tmp, omp_wait_policy):
    out = os.path.join(tmp, f"{backend}.json")
    env = dict(os.environ, KERAS_BACKEND=backend)
    if omp_wait_policy != "keep":
        env.setdefault("OMP_WAIT_POLICY", omp_wait_policy)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--json", out] + argv_tail
    proc = subprocess.run(cmd, env=env)
    if proc.returncode or not os.path.exists(out):
        print(f"[{backend}] worker failed (exit {proc.returncode})", file=sys.stderr)
        return []
    with open(out) as f:
        return json.load(f)


def decode_table(rows):
    print(f"{'backend':<11} {'case':<10} {'DCMHA ms':>9} {'off ms':>8} {'ratio':>6} "
          f"{'spread':>11} {'load':>5}  what (spread: quartiles of the paired ratios)")
    for r in rows:
        print(f"{r['backend']:<11} {r['case']:<10} {r['dcmha_ms']:>9.3f} {r['off_ms']:>8.3f} "
              f"{r['ratio']:>6.2f} {r['ratio_q1']:>5.2f}-{r['ratio_q3']:<5.2f} "
              f"{r['load_before']:>5.1f}  {r['what']}")


def onnx_section(backends, repeats, tmp):
    """benchmarks/onnx_latency.py (its own process, which runs one worker per runtime and
    alternates them) for ``backends``: its result dict, or None when it failed."""
    out = os.path.join(tmp, "onnx.json")
    cmd = [sys.executable, os.path.join(HERE, "onnx_latency.py"), "--backends",
           ",".join(backends), "--repeats", str(repeats), "--json", out]
    proc = subprocess.run(cmd)
    if proc.returncode or not os.path.exists(out):
        print(f"[onnx] onnx_latency.py failed (exit {proc.returncode})", file=sys.stderr)
        return None
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", choices=("decode", "onnx", "all"), default="decode")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--cases", default="lm1024,lm256,layer2560",
                    help="decode cases: lm1024, lm256, layer<D> (e.g. layer2560, layer256)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write every row here")
    ap.add_argument("--omp-wait-policy", default="PASSIVE", choices=("PASSIVE", "ACTIVE", "keep"),
                    help="OMP_WAIT_POLICY for the workers if the environment does not set it: "
                         "PASSIVE (default), ACTIVE, or keep (leave it unset)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        if c not in LM_CASES and not (c.startswith("layer") and c[5:].isdigit()):
            ap.error(f"unknown case {c!r}: use lm1024, lm256 or layer<D>")
    if args.repeats < 1:
        ap.error(f"--repeats must be a positive integer, got {args.repeats}")
    if args.worker:
        rows = worker(cases, args.repeats)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = sorted(set(backends) - set(BACKENDS))
    if bad:
        ap.error(f"unknown backends {bad}: use {','.join(BACKENDS)}")
    result = {"load_start": _load()}
    with tempfile.TemporaryDirectory() as tmp:
        if args.section in ("decode", "all"):
            tail = ["--cases", ",".join(cases), "--repeats", str(args.repeats)]
            result["decode"] = [r for b in backends
                                for r in _run_backend(b, tail, tmp, args.omp_wait_policy)]
            decode_table(result["decode"])
        if args.section in ("onnx", "all"):
            result["onnx"] = onnx_section(backends, args.repeats, tmp)
    result["load_end"] = _load()
    print(f"load average (1 min): {result['load_start']:.1f} at start, "
          f"{result['load_end']:.1f} at end; OMP_WAIT_POLICY of the workers: "
          f"{os.environ.get('OMP_WAIT_POLICY') or (None if args.omp_wait_policy == 'keep' else args.omp_wait_policy)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
