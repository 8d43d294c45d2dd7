"""Where one cached decoding step of a DCMHA layer spends its time on PyTorch (eager).

One token at position 96 of a 128-position cache (B=1, float32), the DCMHA layer
(every composition) and the same layer with ``pre_compose=False,
post_compose=False`` ("off") run alternately, as ``benchmarks/inference.py``'s
layer cases do. Each section of the step is timed from outside by wrapping the
function that computes it: the sublayers (by class: the four ``EinsumDense``
projections, ``DynamicWeightProjection``), the attention core
(``dcmha.ops.dcmha_attention``), the cache writes (``dcmha.ops.write_slice``) and
the smaller pieces of ``DCMHA._forward``. The sums are per step (mean over the
repeats); "total" is the whole ``layer(...)`` call.

``--torch-compile`` times instead both layers' steps wrapped in ``torch.compile``
(the default Inductor backend; the compile time of each is printed): what a
compiled step would give, against the eager step.

    python benchmarks/decode_sections.py --dim 1024 --heads 16 --repeats 300
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")


def _layers(dim, heads, implementation):
    import keras
    import numpy as np

    import dcmha
    x = np.random.default_rng(0).standard_normal((1, 128, dim)).astype("float32")
    out = {}
    for name, compose in (("dcmha", True), ("off", False)):
        layer = dcmha.DCMHA(num_heads=heads, key_dim=dim // heads, seed=0,
                            pre_compose=compose, post_compose=compose,
                            implementation=implementation)
        cache = layer.init_cache(1, 128)
        _, cache = layer(x[:, :96], x[:, :96], use_causal_mask=True, cache=cache,
                         cache_update_index=0)
        out[name] = (layer, cache)
    return out, keras.ops.convert_to_tensor(x[:, 96:97])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--implementation", default="auto")
    parser.add_argument("--torch-compile", action="store_true")
    args = parser.parse_args(argv)

    import keras
    import torch

    from dcmha import layers as dlayers
    from dcmha import ops as dops
    from dcmha.layers import cache as dlayers_cache
    from dcmha.layers import dcmha as dlayers_dcmha
    from dcmha.ops import tensors as dops_tensors
    if keras.backend.backend() != "torch":
        raise SystemExit("decode_sections.py times the eager PyTorch step: KERAS_BACKEND=torch")
    torch.set_grad_enabled(False)
    layers, tok = _layers(args.dim, args.heads, args.implementation)

    def step(layer, cache):
        return lambda: layer(tok, tok, use_causal_mask=True, cache=cache, cache_update_index=96)

    steps = {name: step(*lc) for name, lc in layers.items()}
    if args.torch_compile:
        for name in steps:
            t0 = time.perf_counter()
            steps[name] = torch.compile(steps[name])
            steps[name]()
            print(f"torch.compile {name}: first call {time.perf_counter() - t0:.1f} s")

    spent = collections.defaultdict(float)
    current = [None]

    def timed(owner, attr, label):
        inner = getattr(owner, attr)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[(current[0], label)] += time.perf_counter() - t0
        setattr(owner, attr, wrapper)
        return inner

    restore = []
    if not args.torch_compile:       # wrappers would break the compiled graphs
        for owner, attr, label in ((dops, "dcmha_attention", "attention core"),
                                   (dops, "write_slice", "cache writes"),
                                   (dops_tensors, "write_slice", "cache writes"),
                                   (dops, "dynamic_weights", "dynamic weights"),
                                   (dops, "as_dtype", "as_dtype (cache reads; also inside the writes)"),
                                   (dops_tensors, "as_dtype",
                                    "as_dtype (cache reads; also inside the writes)"),
                                   (dops, "stage_terms", "stage_terms"),
                                   (dlayers_cache, "check_cache", "cache check"),
                                   (dlayers_dcmha, "_combine_masks", "mask")):
            restore.append((owner, attr, timed(owner, attr, label)))
        layer_call = keras.layers.Layer.__call__

        def sublayer_call(self, *a, **k):
            if isinstance(self, dlayers.DCMHA):
                return layer_call(self, *a, **k)
            t0 = time.perf_counter()
            try:
                return layer_call(self, *a, **k)
            finally:
                spent[(current[0], "sublayer " + type(self).__name__)] += (
                    time.perf_counter() - t0)
        keras.layers.Layer.__call__ = sublayer_call
        restore.append((keras.layers.Layer, "__call__", layer_call))
    totals = collections.defaultdict(list)
    try:
        for i in range(args.repeats + 20):
            for name, fn in steps.items():
                current[0] = name if i >= 20 else None
                t0 = time.perf_counter()
                fn()
                if i >= 20:
                    totals[name].append(time.perf_counter() - t0)
    finally:
        for owner, attr, inner in restore:
            setattr(owner, attr, inner)
    n = args.repeats
    print(f"torch {'compiled' if args.torch_compile else 'eager'} decode step, D={args.dim}, "
          f"N={args.heads}, S=128, position 96, {n} alternating repeats (ms per step)")
    print(f"| section | DCMHA | off | difference |\n|---|---:|---:|---:|")
    labels = sorted({lab for (who, lab) in spent if who is not None})
    for lab in labels:
        a, b = spent[("dcmha", lab)] / n * 1e3, spent[("off", lab)] / n * 1e3
        print(f"| {lab} | {a:.3f} | {b:.3f} | {a - b:+.3f} |")
    a = sum(totals["dcmha"]) / n * 1e3
    b = sum(totals["off"]) / n * 1e3
    print(f"| total (mean) | {a:.3f} | {b:.3f} | {a - b:+.3f} |")
    med = {k: statistics.median(v) * 1e3 for k, v in totals.items()}
    print(f"median step: DCMHA {med['dcmha']:.3f} ms, off {med['off']:.3f} ms, "
          f"ratio {med['dcmha'] / med['off']:.2f}")


if __name__ == "__main__":
    main()
