"""Multi-device DCMHA with keras.distribution (JAX only): layouts, and equality with one device.

The layout tests run in-process on a DeviceMesh of named (not real) devices.
The numerical checks need 8 devices: they run in a subprocess (this file run as
a script) with XLA_FLAGS=--xla_force_host_platform_device_count=8, which must be
set before jax is imported. There, a tiny DCFormerLM gives the same logits and
the same weights after one SGD step on one device, under ModelParallel (a 2 x 4
data x model mesh, with composition local to a device and with a replicated
dynamic projection) and under DataParallel (8-way).
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

VOCAB, BATCH, LENGTH = 64, 8, 6


def _lm(num_groups, num_key_value_heads):
    from dcmha.models import DCFormerLM

    # 8 heads, so a 4-way model axis holds 2 heads per device.
    return DCFormerLM(vocab_size=VOCAB, num_layers=1, hidden_dim=32, num_heads=8,
                      intermediate_dim=64, num_groups=num_groups,
                      num_key_value_heads=num_key_value_heads, sliding_window=3,
                      window_pattern="L", rope_max_wavelength=100.0, qk_norm=True, seed=3)


def _fake_mesh(shape, names):
    n = int(np.prod(shape))
    return keras.distribution.DeviceMesh(shape, names, [f"cpu:{i}" for i in range(n)])


# ---------------------------------------------------------------------------
# Layouts (in-process)
# ---------------------------------------------------------------------------

def _axes(lm, path):
    layout = lm[path]
    return None if layout is None else layout.axes


@pytest.mark.parametrize("groups, kv, local", [(4, 4, True), (8, 8, True), (2, 2, False),
                                               (1, 8, False), (4, 2, True)])
def test_layout_map_shards_heads_by_group(groups, kv, local):
    from dcmha import distribution as ddist

    mesh = _fake_mesh((2, 4), ("data", "model"))
    lm = ddist.layout_map(mesh, _lm(groups, kv))
    p = "dc_former_lm/layers_0/attention/"
    assert _axes(lm, p + "query/kernel") == (None, "model", None)
    assert _axes(lm, p + "attention_output/kernel") == ("model", None, None)
    kv_axes = (None, "model", None) if kv % 4 == 0 else (None, None, None)
    assert _axes(lm, p + "key/kernel") == kv_axes
    assert _axes(lm, p + "value/kernel") == kv_axes
    g = "model" if local else None
    assert _axes(lm, p + "dynamic_projection/dw1") == (None, g, None, None)
    assert _axes(lm, p + "dynamic_projection/qkw") == (g, None, None, None, None)
    assert _axes(lm, p + "dynamic_projection/dd") == (None, g, None)
    assert _axes(lm, p + "query_norm_scale") is None       # replicated
    assert _axes(lm, "dc_former_lm/layers_0/feed_forward/w1/kernel") == (None, "model")
    assert _axes(lm, "dc_former_lm/layers_0/feed_forward/w2/kernel") == ("model", None)
    assert _axes(lm, "dc_former_lm/tok_embeddings/embeddings") == ("model", None)
    assert _axes(lm, "dc_former_lm/output/kernel") == (None, "model")
    assert _axes(lm, "dc_former_lm/norm/scale") is None


def test_sharding_plan_replicates_what_does_not_divide():
    from dcmha.distribution import sharding_plan

    plan = sharding_plan(num_heads=6, num_key_value_heads=3, num_groups=3, model_size=4)
    assert set(plan.values()) == {None}
    plan = sharding_plan(num_heads=8, num_key_value_heads=1, num_groups=8, model_size=4)
    assert plan["query_kernel"] == 1 and plan["qkw"] == 0 and plan["static_pre"] == 0
    assert plan["key_kernel"] is None and plan["value_bias"] is None      # MQA: one kv head
    assert None not in sharding_plan(num_heads=4, model_size=1).values()


def test_layout_map_for_a_layer_and_a_functional_model():
    from dcmha import DCMHA
    from dcmha import distribution as ddist

    mesh = _fake_mesh((4, 2), ("data", "model"))
    layer = DCMHA(num_heads=4, key_dim=8, num_groups=2, static_compose=True, use_bias=True,
                  cross_attention=True, name="att")
    lm = ddist.layout_map(mesh, layer)
    assert _axes(lm, "att/query_dynamic_projection/dw1") == (None, "model", None, None)
    assert _axes(lm, "att/key_dynamic_projection/dd") == (None, "model", None)
    assert _axes(lm, "att/static_post") == ("model", None, None)
    assert _axes(lm, "att/query/bias") == ("model", None)
    assert _axes(lm, "att/attention_output/bias") is None

    # Two layers of different sizes in one model: matched by path.
    x = keras.Input((None, 16))
    a = DCMHA(num_heads=4, key_dim=4, num_groups=2, name="a")
    b = DCMHA(num_heads=4, key_dim=4, num_groups=1, name="b")
    model = keras.Model(x, b(a(x, x), a(x, x)))
    lm = ddist.layout_map(mesh, model)
    assert _axes(lm, "a/dynamic_projection/dw1") == (None, "model", None, None)
    assert _axes(lm, "b/dynamic_projection/dw1") == (None, None, None, None)
    assert _axes(lm, "b/query/kernel") == (None, "model", None)

    dist = ddist.model_parallel(mesh, layer)
    assert isinstance(dist, keras.distribution.ModelParallel)
    assert dist.batch_dim_name == "data"


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(mesh="mesh"), TypeError,
     "`mesh` must be a keras.distribution.DeviceMesh. Received: str"),
    (dict(model_axis="heads"), ValueError,
     "`model_axis` must be an axis of the mesh ('data', 'model'). Received: model_axis='heads'"),
    (dict(data_axis="batch"), ValueError,
     "`data_axis` must be None or an axis of the mesh ('data', 'model'). "
     "Received: data_axis='batch'"),
    (dict(data_axis="model"), ValueError,
     "`data_axis` and `model_axis` must differ. Received: both 'model'"),
    (dict(target=keras.layers.Dense(3)), TypeError,
     "`target` must be a dcmha.DCMHA layer, a dcmha.models.DCFormerLM or a keras.Model "
     "containing DCMHA layers. Received: Dense"),
    (dict(base={}), TypeError, "`base` must be None or a keras.distribution.LayoutMap. "
                               "Received: dict"),
])
def test_layout_map_validates_arguments(kwargs, error, message):
    from dcmha import distribution as ddist

    args = dict(mesh=_fake_mesh((2, 4), ("data", "model")), target=_lm(4, 4))
    args.update(kwargs)
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        ddist.layout_map(args.pop("mesh"), args.pop("target"), **args)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_heads=0), "`num_heads` must be a positive integer. Received: num_heads=0"),
    (dict(num_groups=3), "`num_heads` must be divisible by `num_groups`. "
                         "Received: num_heads=8, num_groups=3"),
    (dict(num_key_value_heads=3), "`num_heads` must be divisible by `num_key_value_heads`. "
                                  "Received: num_heads=8, num_key_value_heads=3"),
    (dict(model_size=2.0), "`model_size` must be a positive integer. Received: model_size=2.0"),
])
def test_sharding_plan_validates_arguments(kwargs, message):
    from dcmha.distribution import sharding_plan

    args = dict(num_heads=8, num_key_value_heads=None, num_groups=2, model_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        sharding_plan(**args)


# ---------------------------------------------------------------------------
# 8 simulated devices (subprocess)
# ---------------------------------------------------------------------------

def _worker():
    """Runs in the subprocess; prints one JSON line with the results."""
    import jax

    from dcmha import distribution as ddist

    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (BATCH, LENGTH)).astype("int32")
    targets = rng.integers(0, VOCAB, (BATCH, LENGTH)).astype("int32")
    devices = keras.distribution.list_devices()

    def run(model, weights=None):
        model.build((None, None))
        if weights is not None:
            model.set_weights(weights)
        start = [np.asarray(w) for w in model.get_weights()]
        model.compile(optimizer=keras.optimizers.SGD(0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        logits = np.asarray(model.predict_on_batch(tokens))      # jitted, as in training
        loss = float(model.train_on_batch(tokens, targets))
        return start, logits, loss, [np.asarray(w) for w in model.get_weights()]

    def compare(ref, got):
        _, logits_ref, loss_ref, after_ref = ref
        _, logits, loss, after = got
        scale = max(1.0, float(np.abs(logits_ref).max()))
        step = max(float(np.abs(a - b).max()) for a, b in zip(after_ref, ref[0]))
        return {"logits": float(np.abs(logits - logits_ref).max()) / scale,
                "loss": abs(loss - loss_ref),
                "weights": max(float(np.abs(a - b).max()) for a, b in zip(after, after_ref)),
                "step_size": step}

    def specs(model):
        """{path without the model name: the PartitionSpec as a list}."""
        return {v.path.split("/", 1)[1]: [a for a in v.value.sharding.spec]
                for v in model.weights}

    out = {}
    for label, groups, kv in (("local", 4, 4), ("replicated", 2, 2)):
        ref = run(_lm(groups, kv))
        mesh = keras.distribution.DeviceMesh((2, 4), ("data", "model"), devices)
        model = _lm(groups, kv)
        with ddist.model_parallel(mesh, model).scope():
            got = run(model, ref[0])
            out[f"model_parallel_{label}"] = dict(compare(ref, got), specs=specs(model))
        if label == "local":
            model = _lm(groups, kv)
            with keras.distribution.DataParallel(devices=devices).scope():
                got = run(model, ref[0])
                out["data_parallel"] = dict(compare(ref, got), specs=specs(model))
    print("RESULT " + json.dumps(out))


@pytest.fixture(scope="module")
def eight_devices():
    from tests.distribution import device_workers
    return device_workers.run(Path(__file__).resolve())


@pytest.mark.parametrize("name", ["model_parallel_local", "model_parallel_replicated",
                                  "data_parallel"])
def test_eight_devices_equal_one_device(eight_devices, name):
    r = eight_devices[name]
    assert r["step_size"] > 1e-3            # the step moved the weights
    assert r["logits"] < 1e-5, r
    assert r["loss"] < 1e-5, r
    assert r["weights"] < 1e-5 * max(1.0, r["step_size"]), r


def test_eight_devices_shardings(eight_devices):
    """The variables live where the layout map says (after set_weights and a step)."""
    from dcmha import distribution as ddist

    mesh = _fake_mesh((2, 4), ("data", "model"))
    for label, groups, kv in (("local", 4, 4), ("replicated", 2, 2)):
        specs = eight_devices[f"model_parallel_{label}"]["specs"]
        lm = ddist.layout_map(mesh, _lm(groups, kv))
        for path, spec in specs.items():
            want = _axes(lm, "dc_former_lm/" + path)
            want = [None] * len(spec) if want is None else list(want)
            # jax may drop trailing None axes of a PartitionSpec
            assert spec + [None] * (len(want) - len(spec)) == want, (label, path, spec)
        assert specs["layers_0/attention/query/kernel"] == [None, "model", None]
    assert eight_devices["model_parallel_local"]["specs"][
        "layers_0/attention/dynamic_projection/dw1"] == [None, "model", None, None]
    assert all(a is None for spec in eight_devices["data_parallel"]["specs"].values()
               for a in spec)


if __name__ == "__main__":
    _worker()
