"""Where a DCMHA layer's cached step spends its time over composition off, by switching the
layer's parts off one at a time (eager PyTorch, CPU, float32, batch 1).

    KERAS_BACKEND=torch python benchmarks/decode_variants.py [--width 2560] [--steps 100]

One process; each variant is a ``DCMHA`` layer (N = D / 80 heads, RoPE, the same seed)
whose cached step (one token at position 96 of a 128-position cache, causal, under
``torch.no_grad()``) runs in turn with the others, ``--steps`` rounds after 20 of warm-up.
Printed: each variant's median step and its ratio to composition off. Variants: all
switches (DCMHA as ``inference.py`` times it), no dynamic gating, no dynamic projection, static composition
only, composition off; and all switches with the query and dynamic projections apart
("unfused": ``torch_native.dynamic_weights.FUSED_PROJECTION`` off for its calls). Figures:
benchmarks/RESULTS.md ("Cached decoding", "Where a step's time goes").
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

VARIANTS = {
    "all switches": {},
    "all switches, unfused": {},
    "dynamic_gating=False": dict(dynamic_gating=False),
    "dynamic_projection=False": dict(dynamic_projection=False),
    "static composition only": dict(dynamic_projection=False, dynamic_gating=False,
                                    static_compose=True),
    "composition off": dict(pre_compose=False, post_compose=False),
}


def keras_with_backend(ap, backend, what):
    """Keras, on ``backend`` unless KERAS_BACKEND names another: then ``ap``'s error, naming
    ``what`` the script times (the decode benchmarks share it)."""
    os.environ.setdefault("KERAS_BACKEND", backend)
    import keras
    if keras.backend.backend() != backend:
        ap.error(f"this script times {what}; KERAS_BACKEND={keras.backend.backend()}")
    return keras


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2560)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args(argv)
    keras = keras_with_backend(ap, "torch", "eager PyTorch")
    import torch

    from dcmha.backends.torch_native import dynamic_weights
    from dcmha.layers import DCMHA
    D = args.width
    N = max(1, D // 80)
    x = torch.tensor(np.random.default_rng(1).normal(size=(1, 1, D)).astype("float32"))
    index = torch.tensor(96, dtype=torch.int32)
    layers, caches, times = {}, {}, {}
    for name, options in VARIANTS.items():
        keras.utils.set_random_seed(0)
        layers[name] = DCMHA(N, D // N, rope_max_wavelength=10000, **options)
        layers[name].build((1, None, D), (1, None, D))
        caches[name] = layers[name].init_cache(1, 128)
        times[name] = []
    with torch.no_grad():
        for r in range(20 + args.steps):
            for name, layer in layers.items():
                dynamic_weights.FUSED_PROJECTION = name != "all switches, unfused"
                t0 = time.perf_counter()
                layer(x, x, use_causal_mask=True, cache=caches[name], cache_update_index=index)
                if r >= 20:
                    times[name].append(time.perf_counter() - t0)
    off = float(np.median(times["composition off"]))
    print(f"D={D} N={N}, median of {args.steps} steps; load {os.getloadavg()[0]:.1f}")
    for name, ts in times.items():
        print(f"{name:26s} {np.median(ts) * 1e3:7.3f} ms  / off {np.median(ts) / off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
