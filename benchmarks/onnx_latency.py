"""onnxruntime (CPU) latency of an exported DCMHA layer / small stack vs Keras predict.

    KERAS_BACKEND=jax python benchmarks/onnx_latency.py [--batch 1] [--length 512]
        [--width 256] [--heads 8] [--layers 2] [--repeats 10] [--threads N] [--fp16]
        [--json out.json]

Cases: "layer" (one causal DCMHA self-attention, all compositions on, RoPE) and
"stack" (--layers pre-norm blocks: RMSNorm, DCMHA, residual, RMSNorm, gelu MLP,
residual). Both sides get the same float32 input; Keras runs
``model.predict_on_batch`` (compiled on jax / tensorflow), onnxruntime the
exported graph with ORT_ENABLE_ALL. After warm-up the two are timed in
alternation, ``--repeats`` times each, and the medians are reported with the
max relative difference of their outputs. Run once per Keras backend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np


def build_models(width: int, heads: int, layers: int):
    import keras
    from dcmha.layers import DCMHA

    key_dim = width // heads

    def attention(name):
        return DCMHA(heads, key_dim, rope_max_wavelength=10000.0, name=name)

    x = keras.Input((None, width), name="x")
    single = keras.Model(x, attention("attention")(x, x, use_causal_mask=True), name="layer")
    h = x
    for i in range(layers):
        a = keras.layers.RMSNormalization(name=f"attention_norm_{i}")(h)
        h = keras.layers.Add(name=f"attention_residual_{i}")(
            [h, attention(f"attention_{i}")(a, a, use_causal_mask=True)])
        f = keras.layers.RMSNormalization(name=f"ffn_norm_{i}")(h)
        f = keras.layers.Dense(4 * width, activation="gelu", name=f"up_{i}")(f)
        h = keras.layers.Add(name=f"ffn_residual_{i}")([h, keras.layers.Dense(width, name=f"down_{i}")(f)])
    stack = keras.Model(x, h, name="stack")
    return {"layer": single, "stack": stack}


def bench(model, path, x, repeats: int, dtype: str, threads):
    import keras
    from dcmha.export import core, to_onnx

    to_onnx(model, path, dtype=dtype)
    sess = core.session(path, threads=threads)
    feed = {sess.get_inputs()[0].name: x.astype(core.NP_DTYPES[dtype])}
    run_ort = lambda: sess.run(None, feed)[0]                      # noqa: E731
    run_keras = lambda: keras.ops.convert_to_numpy(model.predict_on_batch(x))  # noqa: E731
    for _ in range(2):
        got, want = run_ort(), run_keras()
    err = float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))
    t_ort, t_keras = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_ort()
        t_ort.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        run_keras()
        t_keras.append(time.perf_counter() - t0)
    return float(np.median(t_ort)), float(np.median(t_keras)), err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2, help="blocks in the stack case")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    ap.add_argument("--fp16", action="store_true", help="float16 onnxruntime graph (Keras stays float32)")
    ap.add_argument("--cases", default="layer,stack")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import keras
    import onnxruntime

    keras.utils.set_random_seed(0)
    models = build_models(args.width, args.heads, args.layers)
    x = np.random.default_rng(0).normal(size=(args.batch, args.length, args.width)).astype("float32")
    dtype = "float16" if args.fp16 else "float32"
    backend = keras.backend.backend()
    print(f"keras {keras.__version__} ({backend}), onnxruntime {onnxruntime.__version__} CPU, "
          f"B={args.batch} T={args.length} D={args.width} N={args.heads}, onnx dtype {dtype}, "
          f"median of {args.repeats} alternating runs")
    print(f"{'case':<8} {'onnxruntime ms':>15} {'keras ' + backend + ' ms':>18} {'keras/ort':>10} "
          f"{'max rel diff':>13}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
            t_ort, t_keras, err = bench(models[case], os.path.join(tmp, f"{case}.onnx"), x,
                                        args.repeats, dtype, args.threads)
            rows.append({"case": case, "backend": backend, "onnxruntime_ms": 1e3 * t_ort,
                         "keras_ms": 1e3 * t_keras, "max_rel_diff": err, "batch": args.batch,
                         "length": args.length, "width": args.width, "heads": args.heads,
                         "dtype": dtype})
            print(f"{case:<8} {1e3 * t_ort:>15.1f} {1e3 * t_keras:>18.1f} {t_keras / t_ort:>10.2f} "
                  f"{err:>13.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
