"""Where a ``DCFormerLM``'s compiled decoding step spends its time on JAX (CPU), per XLA op:
DCMHA against the same model with ``attention="mha"``.

    KERAS_BACKEND=jax python benchmarks/decode_profile_jax.py [--case lm256] [--steps 50]

One process. For each model: ``generate``'s step function (``_decode_function``: one jitted
program) runs 50 steps to warm up, then ``--steps`` steps under ``jax.profiler`` with a
Perfetto trace; the trace's op events are joined with the compiled program's HLO (op kind and
output shape, and the ``op_name`` of the Keras op). Printed per model: time per step of each
(kind, shape, op name) group, largest first, and the sum over the ops. The profiler slows every
op, so the sums are above the timed step; the split is what the script is for. Figures:
benchmarks/RESULTS.md ("Cached decoding", "Where a step's time goes").
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_variants import keras_with_backend  # noqa: E402

CASES = {"lm1024": (4, 1024, 16, 64), "lm256": (4, 256, 8, 64)}


def _ops_of(hlo_text):
    """{op name: (output shape, kind, Keras op name without the layer index)} of the HLO's
    entry computation."""
    out = {}
    entry = hlo_text[hlo_text.index("ENTRY"):]
    for line in entry.split("\n")[1:]:
        m = re.match(r"\s*%(\S+) = (\S+) ([\w-]+)\(", line)
        if m:
            name = re.search(r'op_name="([^"]*)"', line)
            name = re.sub(r"layers_\d+/", "", name.group(1)).split(")/")[-1] if name else ""
            out[m.group(1)] = (m.group(2), m.group(3), name)
    return out


def profile(attention, case, steps):
    """(sum of the ops' time per step in us, [(us per step, count per step, kind, shape,
    name)])."""
    import jax
    import keras
    from keras import ops

    from dcmha.models import DCFormerLM
    layers, D, N, prompt = CASES[case]
    keras.utils.set_random_seed(0)
    lm = DCFormerLM(vocab_size=256, num_layers=layers, hidden_dim=D, num_heads=N,
                    attention=attention)
    lm.build((1, None))
    step = lm._decode_function()
    cache = lm.init_cache(1, prompt + 128)
    _, cache = step(ops.convert_to_tensor(np.zeros((1, prompt), "int32")), cache,
                    ops.convert_to_tensor(np.int32(0)))
    tok = ops.convert_to_tensor(np.zeros((1, 1), "int32"))
    index = lambda i: ops.convert_to_tensor(np.int32(prompt + i % 100))   # noqa: E731
    for i in range(50):
        last, cache = step(tok, cache, index(i))
    variables = ([v.value for v in lm.trainable_variables],
                 [v.value for v in lm.non_trainable_variables])
    hlo = lm._jax_decode_step.lower(*variables, tok, cache, index(0)).compile().as_text()
    names = _ops_of(hlo)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        for i in range(steps):
            last, cache = step(tok, cache, index(i))
            last.block_until_ready()
        jax.profiler.stop_trace()
        trace, = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(trace) as f:
            events = json.load(f)["traceEvents"]
    runs = sum(1 for e in events if e.get("ph") == "X" and e["name"] == "ThunkExecutor::Execute")
    groups = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and e["name"] in names:
            shape, kind, name = names[e["name"]]
            g = groups[kind, shape, name]
            g[0] += e["dur"]
            g[1] += 1
    rows = sorted(((t / runs, c / runs, *k) for k, (t, c) in groups.items()), reverse=True)
    return sum(r[0] for r in rows), rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), default="lm256")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rows", type=int, default=25, help="groups printed per model")
    args = ap.parse_args(argv)
    keras_with_backend(ap, "jax", "JAX")
    for attention in ("dcmha", "mha"):
        total, rows = profile(attention, args.case, args.steps)
        print(f"\n{args.case} attention={attention}: {total:.0f} us of ops per step "
              f"(profiled; load {os.getloadavg()[0]:.1f})")
        print(f"{'us/step':>8} {'ops/step':>8}  {'kind':12} {'shape':30} op name")
        for t, c, kind, shape, name in rows[:args.rows]:
            print(f"{t:8.1f} {c:8.1f}  {kind:12} {shape[:30]:30} {name[:50]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
