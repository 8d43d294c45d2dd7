"""The compiled attention paths under a device mesh: one training step (forward and
gradients) of a tiny DCFormerLM compiled for 8 devices, under DataParallel (8-way) and
ModelParallel (2 x 4, ``dcmha.distribution.model_parallel``).

The 8 devices are XLA's virtual CPU devices (``--xla_force_host_platform_device_count=8``,
set before jax is imported): the checks run in a subprocess, this file run as a script.
For "jax_cpu" (the C kernel through ``jax.ffi``) and "pallas" (interpret mode) the
compiled step has no more collectives of any kind than the "ops" core's, the kernel's
custom call sees one device's share (B / data, G / model), the gradients equal one
device's, the per-shard forward of GQA (kv heads repeated), every compose term, a mask and
the Pallas scores equals one device's, and ``"auto"`` passes over a layout that would split
a composition group, with the reason.
"""


if __name__ == "__main__":       # the 8-device worker: before jax is imported
    import device_workers
    device_workers.worker_environment()

import json
import re
from pathlib import Path

import numpy as np
import pytest

import keras

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax",
                                reason="keras.distribution is implemented for jax only")

VOCAB, BATCH = 64, 8
#: The implementations compared, each forced, and the sequence length of their steps.
IMPLEMENTATIONS, LENGTH = ("ops", "jax_cpu", "pallas"), 32
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|"
                        r"collective-permute)(?:-start)?\(")


def _lm(implementation, num_groups=4):
    from dcmha.models import DCFormerLM

    return DCFormerLM(vocab_size=VOCAB, num_layers=1, hidden_dim=32, num_heads=8,
                      intermediate_dim=64, num_groups=num_groups, qk_norm=True,
                      rope_max_wavelength=100.0, implementation=implementation, seed=3)


def _worker():
    """Runs in the subprocess; prints one JSON line with the results."""
    import jax

    from dcmha import distribution as ddist
    from dcmha import registry

    assert len(jax.devices()) == 8, jax.devices()
    devices = keras.distribution.list_devices()
    rng = np.random.default_rng(0)

    def step(model, dist, tokens, targets):
        """(compiled HLO text, gradients as numpy) of loss(weights) -> grad."""
        def loss(trainable, non_trainable, x, y):
            logits, _ = model.stateless_call(trainable, non_trainable, x)
            return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
                y, logits, from_logits=True))

        grad = jax.jit(jax.grad(loss))
        args = ([v.value for v in model.trainable_variables],
                [v.value for v in model.non_trainable_variables], tokens, targets)
        if dist is not None:
            layout = dist.get_data_layout(tokens.shape).backend_layout
            args = args[:2] + tuple(jax.device_put(a, layout) for a in args[2:])
        hlo = grad.lower(*args).compile().as_text()
        return hlo, [np.asarray(g) for g in grad(*args)]

    def summary(hlo):
        counts = {}
        for name in COLLECTIVE.findall(hlo):
            counts[name] = counts.get(name, 0) + 1
        calls = re.findall(r"f32\[([0-9,]+)\][^\n]*custom_call_target="
                           r"\"dcmha_(?:compose|block_probs)_forward", hlo)
        return counts, sorted({c for c in calls})

    out = {}
    for impl in IMPLEMENTATIONS:
        tokens = rng.integers(0, VOCAB, (BATCH, LENGTH)).astype("int32")
        targets = rng.integers(0, VOCAB, (BATCH, LENGTH)).astype("int32")
        ref_model = _lm(impl)
        ref_model.build((None, None))
        weights = ref_model.get_weights()
        _, ref = step(ref_model, None, tokens, targets)
        meshes = {"data_parallel": keras.distribution.DataParallel(devices=devices)}
        mesh = keras.distribution.DeviceMesh((2, 4), ("data", "model"), devices)
        meshes["model_parallel"] = ddist.model_parallel(mesh, _lm(impl))
        for label, dist in meshes.items():
            with dist.scope():
                model = _lm(impl)
                model.build((None, None))
                model.set_weights(weights)
                hlo, got = step(model, dist, tokens, targets)
            counts, calls = summary(hlo)
            scale = max(float(np.abs(g).max()) for g in ref)
            out[f"{impl}/{label}"] = {
                "collectives": counts, "compose_shapes": calls,
                "grad_error": max(float(np.abs(a - b).max()) for a, b in zip(got, ref)) / scale}

    # The per-shard wrapper on its own, forward: GQA whose 2 kv heads the 4-way model axis
    # cannot split (repeated to the query heads), every term kind, a (B, 1, S) mask and,
    # on "pallas", the attention scores (B, N, T, S).
    from dcmha.backends.jax_cpu import core as cpu_core
    from dcmha.backends.pallas import core as pallas_core
    from dcmha.call import describe
    B, T, N, N_kv, G, R = BATCH, 16, 8, 2, 4, 1
    arrays = {n: rng.standard_normal(shape).astype("float32") for n, shape in (
        ("q", (B, T, N, 4)), ("k", (B, T, N_kv, 4)), ("v", (B, T, N_kv, 4)),
        ("qw1", (B, T, G, R, 2)), ("qw2", (B, T, G, R, 2)), ("kw1", (B, T, G, R, 2)),
        ("kw2", (B, T, G, R, 2)), ("qdd", (B, T, G, 2)), ("kdd", (B, T, G, 2)),
        ("static", (G, 2, 2)))}
    mask = rng.random((B, 1, T)) < 0.8

    def call_of(a, scores):
        pre = {n: a[n] for n in ("qw1", "qw2", "kw1", "kw2", "static")}
        post = {n: a[n] for n in ("qdd", "kdd")}
        return describe(a["q"], a["k"], a["v"], num_groups=G, pre=pre, post=post,
                        attention_mask=mask, use_causal_mask=True,
                        return_attention_scores=scores)

    for impl, core, scores in (("jax_cpu", cpu_core, False), ("pallas", pallas_core, True)):
        run = jax.jit(lambda a: core.attention(call_of(a, scores)))
        ref = run(arrays)
        mesh = keras.distribution.DeviceMesh((2, 4), ("data", "model"), devices)
        with ddist.model_parallel(mesh, _lm(impl)).scope():
            got = jax.jit(lambda a: core.attention(call_of(a, scores)))(arrays)
        out[f"wrapper/{impl}"] = {
            "o": float(np.abs(np.asarray(got[0]) - np.asarray(ref[0])).max()),
            "scores": float(np.abs(np.asarray(got[1]["attention_scores"])
                                   - np.asarray(ref[1]["attention_scores"])).max())
            if scores else None,
            "scale": float(np.abs(np.asarray(ref[0])).max())}

    # "auto" under a (2, 4) mesh, at T * S over its CPU threshold: it takes the
    # kernel when the 4 groups split over the 4 model devices, and passes over it (with
    # the reason) when 2 groups would straddle them.
    for groups in (4, 2):
        mesh = keras.distribution.DeviceMesh((2, 4), ("data", "model"), devices)
        with ddist.model_parallel(mesh, _lm("auto", groups)).scope():
            q = np.zeros((BATCH, 96, 8, 4), "float32")
            pre = {"static": np.zeros((groups, 8 // groups, 8 // groups), "float32")}
            call = describe(q, q, q, num_groups=groups, pre=pre)
            out[f"explain/{groups}"] = registry.explain(call)
    print("RESULT " + json.dumps(out))


@pytest.fixture(scope="module")
def partitioned():
    from tests.distribution import device_workers
    return device_workers.run(Path(__file__).resolve())


@pytest.mark.parametrize("impl", ["jax_cpu", "pallas"])
@pytest.mark.parametrize("mesh", ["data_parallel", "model_parallel"])
def test_no_more_collectives_than_ops(partitioned, impl, mesh):
    ops = partitioned[f"ops/{mesh}"]["collectives"]
    got = partitioned[f"{impl}/{mesh}"]["collectives"]
    for name in set(ops) | set(got):
        assert got.get(name, 0) <= ops.get(name, 0), (name, got, ops)
    assert got.get("all-gather", 0) == 0, got


@pytest.mark.parametrize("impl", ["ops", "jax_cpu", "pallas"])
@pytest.mark.parametrize("mesh", ["data_parallel", "model_parallel"])
def test_gradients_equal_one_device(partitioned, impl, mesh):
    assert partitioned[f"{impl}/{mesh}"]["grad_error"] < 1e-5, partitioned[f"{impl}/{mesh}"]


def test_kernel_sees_one_device_share(partitioned):
    """The kernel's custom call's block (B, G, M, t, s) is per device: B / 8 under
    DataParallel; B / 2 and G / 4 under the (2, 4) ModelParallel mesh."""
    shapes = {m: {tuple(int(x) for x in s.split(","))[:3]
                  for s in partitioned[f"jax_cpu/{m}"]["compose_shapes"]}
              for m in ("data_parallel", "model_parallel")}
    assert shapes["data_parallel"] == {(BATCH // 8, 4, 2)}, shapes
    assert shapes["model_parallel"] == {(BATCH // 2, 1, 2)}, shapes


@pytest.mark.parametrize("impl", ["jax_cpu", "pallas"])
def test_per_shard_forward_equals_one_device(partitioned, impl):
    """GQA with kv heads repeated, every compose term, a mask, and (pallas) the scores."""
    r = partitioned[f"wrapper/{impl}"]
    assert r["scale"] > 0.1, r
    assert r["o"] < 1e-5 * r["scale"], r
    if impl == "pallas":
        assert r["scores"] is not None and r["scores"] < 1e-5, r


def test_auto_passes_over_a_split_group_with_the_reason(partitioned):
    taken = dict(partitioned["explain/4"])
    assert taken["jax_cpu"] is None, taken
    reasons = dict(partitioned["explain/2"])
    assert reasons["jax_cpu"] == (
        "its 2 composition groups do not split over the 4 devices of the mesh axis 'model': "
        "a group would straddle devices and every device would compute all groups"), reasons
    assert reasons["ops"] is None


if __name__ == "__main__":
    _worker()
