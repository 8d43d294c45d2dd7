"""Determinism: the same seeds give bit-identical results in two fresh processes.

This file run as a script (on the backend of KERAS_BACKEND) seeds Keras
(``keras.utils.set_random_seed``) and the layers (``seed=``), then prints the
sha256 of: a DCMHA layer's initial weights, its output and its output with
dropout in training mode, a DCFormerLM's loss and weights after one training
step (dropout on) and a sampled generation. The test runs it twice, each in a new process,
and requires identical digests; the layer run with another seed must differ.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def _digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _worker(seed):
    import keras
    from keras import ops

    from dcmha.layers import DCMHA
    from dcmha.models import DCFormerLM

    def np_(x):
        return np.asarray(ops.convert_to_numpy(x))

    keras.utils.set_random_seed(seed)
    out = {}
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype("float32")
    layer = DCMHA(num_heads=4, key_dim=8, num_groups=2, static_compose=True, dropout=0.3,
                  seed=seed)
    y = layer(x, x, use_causal_mask=True)
    out["layer_weights"] = _digest(*[np_(w.value) for w in layer.weights])
    out["layer_output"] = _digest(np_(y))
    out["layer_dropout"] = _digest(np_(layer(x, x, training=True)))
    other = DCMHA(num_heads=4, key_dim=8, num_groups=2, static_compose=True, dropout=0.3,
                  seed=seed + 1)
    out["layer_output_other_seed"] = _digest(np_(other(x, x, use_causal_mask=True)))

    model = DCFormerLM(vocab_size=32, num_layers=1, hidden_dim=16, num_heads=4,
                       intermediate_dim=32, sliding_window=3, dropout=0.2, seed=seed)
    tokens = np.random.default_rng(1).integers(0, 32, (2, 6)).astype("int32")
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    loss = model.train_on_batch(tokens, np.roll(tokens, -1, axis=1))
    out["lm_train_step"] = _digest(np.float32(loss), *[np_(w) for w in model.get_weights()])
    out["lm_generate"] = _digest(model.generate(tokens[:, :2], 3, temperature=1.0, seed=seed))
    return out


def _run_twice(seed):
    """The worker's results from two fresh processes (run side by side)."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(seed)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, stdout[-3000:] + stderr[-3000:]
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def test_same_seed_is_bit_identical_across_processes():
    import keras

    backend = keras.backend.backend()
    if backend == "numpy":
        import pytest

        pytest.skip("the numpy backend has no training")
    first, second = _run_twice(7)
    assert first["backend"] == second["backend"] == backend
    assert first == second
    assert first["layer_output_other_seed"] != first["layer_output"]


if __name__ == "__main__":
    result = _worker(int(sys.argv[1]))
    import keras

    result["backend"] = keras.backend.backend()
    print("RESULT " + json.dumps(result))
