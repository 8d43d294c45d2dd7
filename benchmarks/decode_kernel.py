"""One call of a decoding step's probabilities kernel (both composes and the masked softmax,
``dcmha_decode_probs`` through JAX's FFI) against XLA's plain form and a plain masked
softmax, in microseconds per call.

    KERAS_BACKEND=jax python benchmarks/decode_kernel.py [--keys 192] [--heads 8] [--rank 2]

One process; each function runs ``--calls`` times in one jitted ``fori_loop`` (the loop's
carry feeds the next call, so nothing is hoisted), ``--repeats`` times, and the median per
call is printed, with the kernel's time for subsets of the terms (query side only, key side
only, the gates only). B = 1, one group of M = heads heads. Figures: benchmarks/RESULTS.md
("Cached decoding", "Where a step's time goes").
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_variants import keras_with_backend  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=192, help="S, the cache length")
    ap.add_argument("--heads", type=int, default=8, help="M (one group)")
    ap.add_argument("--rank", type=int, default=2, help="R")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    keras_with_backend(ap, "jax", "JAX's FFI call")
    import jax
    import jax.numpy as jnp

    from dcmha import ops as dops
    from dcmha.backends.jax_cpu import dcmha_jax_cpu
    if not dcmha_jax_cpu.load():
        sys.exit(f"no kernel: {dcmha_jax_cpu.unavailable_reason()}")
    S, M, R = args.keys, args.heads, args.rank
    rng = np.random.default_rng(0)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape).astype("float32"))  # noqa: E731
    x = f32(1, 1, M, S)
    mask = jnp.asarray(rng.random((1, 1, S)) < 0.7)
    terms = dict(qw1=f32(1, 1, 1, R, M), qw2=f32(1, 1, 1, R, M), qdd=f32(1, 1, 1, M),
                 kw1=f32(1, S, 1, R, M), kw2=f32(1, S, 1, R, M), kdd=f32(1, S, 1, M))

    def stage(names):
        return {n: terms[n] for n in names}

    def softmax(x):
        return jax.nn.softmax(jnp.where(mask[:, None], x, -1e30), axis=-1)

    full = tuple(terms)
    cases = {
        "kernel, all terms": lambda x: dcmha_jax_cpu.decode_probs(
            x, mask, stage(full), stage(full), M),
        "plain (XLA), all terms": lambda x: dops.one_query_probs(
            x, mask, stage(full), stage(full), M),
        "masked softmax only": softmax,
    }
    for label, names in (("query side", ("qw1", "qw2", "qdd")),
                         ("key side", ("kw1", "kw2", "kdd")), ("gates", ("qdd", "kdd"))):
        cases[f"kernel, {label} only"] = (lambda names: lambda x: dcmha_jax_cpu.decode_probs(
            x, mask, stage(names), stage(names), M))(names)
    n = args.calls
    print(f"S={S} M={M} R={R}: us per call (median of {args.repeats} loops of {n} calls; "
          f"load {os.getloadavg()[0]:.1f})")
    for label, fn in cases.items():
        loop = jax.jit(lambda x, fn=fn: jax.lax.fori_loop(
            0, n, lambda i, c: c + fn(x + c), jnp.zeros_like(x)))
        loop(x).block_until_ready()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            loop(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        print(f"{np.median(times) / n * 1e6:8.2f}  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
