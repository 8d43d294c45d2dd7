"""How a TensorFlow decoding step is called: ``DCFormerLM``'s one-token ``tf.function``
called with its nested arguments (the ``tf.function`` itself) against the same function
called through ``dcmha.framework.tensorflow.flat_calls`` (the concrete function of the
signature, on the flat tensors), for DCMHA and for ``attention="mha"``.

    python benchmarks/tf_decode_call.py [--case lm256] [--steps 500]

One process (Keras on TensorFlow). Each of the four (model, call) pairs decodes from its
own cache after a 64-token prefill; one step of each in turn per round, ``--steps``
rounds after 20 of warm-up; the figures are the median seconds of a step (with the host
copy of the last logits) and the DCMHA / MHA ratio of each way of calling. Figures:
benchmarks/RESULTS.md, "Cached decoding".
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

#: name -> (layers, width, heads), as ``inference.py``'s LM cases.
CASES = {"lm256": (4, 256, 8), "lm1024": (4, 1024, 16)}
PROMPT, LENGTH, WARMUP = 64, 192, 20


def _steps(attention, case):
    """{"structured": call, "flat": call} of one model's one-token step (``generate``'s,
    ``dcmha.framework.decode_step``, and the ``tf.function`` inside it), and a cache for
    each after the prefill."""
    import keras
    import tensorflow as tf

    from dcmha import framework
    from dcmha.models import DCFormerLM

    layers, width, heads = CASES[case]
    keras.utils.set_random_seed(0)
    lm = DCFormerLM(vocab_size=256, num_layers=layers, hidden_dim=width, num_heads=heads,
                    attention=attention)
    lm.build((1, None))
    step = framework.decode_step(lm)
    caches = {}
    for way in ("structured", "flat"):
        _, caches[way] = step(tf.zeros((1, PROMPT), tf.int32), lm.init_cache(1, LENGTH),
                              tf.constant(0))
    _, flat = lm._tf_decode_step                        # (prefill, one token)
    return {"structured": flat.__wrapped__, "flat": flat}, caches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), default="lm256")
    ap.add_argument("--steps", type=int, default=500)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1. Received: {args.steps}")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    if keras.backend.backend() != "tensorflow":
        ap.error(f"needs Keras on TensorFlow (KERAS_BACKEND=tensorflow). "
                 f"Received: {keras.backend.backend()}")
    import tensorflow as tf

    calls, caches = {}, {}
    for attention in ("dcmha", "mha"):
        calls[attention], caches[attention] = _steps(attention, args.case)
    token = tf.zeros((1, 1), tf.int32)
    times = {(a, w): [] for a in calls for w in ("structured", "flat")}
    for r in range(WARMUP + args.steps):
        index = tf.constant(PROMPT + r % (LENGTH - PROMPT), tf.int32)
        for a, w in times:
            t = time.perf_counter()
            last, caches[a][w] = calls[a][w](token, caches[a][w], index)
            last.numpy()
            if r >= WARMUP:
                times[a, w].append(time.perf_counter() - t)
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    print(f"{args.case}, {args.steps} steps, load {os.getloadavg()[0]:.1f}")
    for w in ("structured", "flat"):
        print(f"{w:10s} DCMHA {ms['dcmha', w]:.3f} ms  MHA {ms['mha', w]:.3f} ms  "
              f"ratio {ms['dcmha', w] / ms['mha', w]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
