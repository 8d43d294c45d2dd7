"""DCMHA layer API: argument validation, config, saving, symbolic shapes, canonical weights.

Runs on the Keras backend of the process (KERAS_BACKEND=jax|torch|tensorflow).
"""

import re

import numpy as np
import pytest

import keras
from keras import ops

import dcmha
from dcmha.layers import DCMHA, DynamicWeightProjection
from dcmha.layers.weights import is_composition_name
from dcmha.spec import reference

#: The implementation names the layer and dcmha.ops accept, as their error lists them.
IMPLEMENTATION_NAMES = "['auto', 'jax_cpu', 'jax_decode', 'ops', 'pallas', 'tf_cpu', 'tf_decode', 'torch', 'torch_decode', 'triton', 'xla']"

BACKEND = keras.backend.backend()


def np_(x):
    return np.asarray(ops.convert_to_numpy(x))


# ---------------------------------------------------------------------------
# __init__ validation
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(num_heads=0),
     "Received an invalid value for argument `num_heads`, expected a positive integer. "
     "Received: num_heads=0"),
    (dict(num_heads=4.0),
     "Received an invalid value for argument `num_heads`, expected a positive integer. "
     "Received: num_heads=4.0"),
    (dict(key_dim=-1),
     "Received an invalid value for argument `key_dim`, expected a positive integer. "
     "Received: key_dim=-1"),
    (dict(rank=0), "`rank` must be a positive integer. Received: rank=0"),
    (dict(value_dim=0),
     "Received an invalid value for argument `value_dim`, expected a positive integer or "
     "`None`. Received: value_dim=0"),
    (dict(query_chunk_size=0),
     "`query_chunk_size` must be None or a positive integer. Received: query_chunk_size=0"),
    (dict(sliding_window=True),
     "`sliding_window` must be None or a positive integer. Received: sliding_window=True"),
    (dict(num_groups=3), "`num_heads` must be divisible by `num_groups`. "
                         "Received: num_heads=4, num_groups=3"),
    (dict(num_key_value_heads=3), "`num_heads` must be divisible by `num_key_value_heads`. "
                                  "Received: num_heads=4, num_key_value_heads=3"),
    (dict(key_dim=7, rope_max_wavelength=100.0),
     "RoPE needs an even `key_dim`. Received: key_dim=7"),
    (dict(rope_max_wavelength=-1.0),
     "`rope_max_wavelength` must be None or positive. Received: rope_max_wavelength=-1.0"),
    (dict(rope_max_wavelength="big"),
     "`rope_max_wavelength` must be None or a positive number. "
     "Received: rope_max_wavelength='big'"),
    (dict(pre_compose="yes"), "`pre_compose` must be a boolean. Received: pre_compose='yes'"),
    (dict(cross_attention=1), "`cross_attention` must be a boolean. Received: cross_attention=1"),
    (dict(dropout=1.0), "`dropout` must be a float in [0, 1). Received: dropout=1.0"),
    (dict(dropout=-0.1), "`dropout` must be a float in [0, 1). Received: dropout=-0.1"),
    (dict(output_shape=(4, 0)),
     "Invalid `output_shape`: it must be None, a positive integer or a tuple of positive "
     "integers. Received: output_shape=(4, 0)"),
    (dict(output_shape=0),
     "Invalid `output_shape`: it must be None, a positive integer or a tuple of positive "
     "integers. Received: output_shape=0"),
    (dict(output_shape=8.0),
     "Invalid `output_shape`: it must be None, a positive integer or a tuple of positive "
     "integers. Received: output_shape=8.0"),
    (dict(attention_axes="1"), "`attention_axes` must be None, an integer or a tuple of "
                               "distinct integers. Received: attention_axes='1'"),
    (dict(attention_axes=(1, 1)), "`attention_axes` must be None, an integer or a tuple of "
                                  "distinct integers. Received: attention_axes=(1, 1)"),
    (dict(use_gate=1), "`use_gate` must be a boolean. Received: use_gate=1"),
    (dict(flash_attention="yes"),
     "`flash_attention` must be None or a boolean. Received: flash_attention='yes'"),
    (dict(flash_attention=True, implementation="ops"),
     "`flash_attention=True` asks for a fused attention core, which `implementation='ops'` "
     "rules out. Received: flash_attention=True, implementation='ops'"),
    (dict(flash_attention=True, dropout=0.1),
     "Dropout is not supported when flash attention is enabled. Please set dropout to 0.0 to "
     "use flash attention. Received: dropout=0.1"),
    (dict(flash_attention=False, implementation="torch"),
     "`flash_attention=False` asks for the plain 'ops' core, which `implementation='torch'` "
     "contradicts. Received: flash_attention=False, implementation='torch'"),
    (dict(implementation="cuda"), "`implementation` must be one of "
                                  f"{IMPLEMENTATION_NAMES}. Received: implementation='cuda'"),
    (dict(seed="7"), "`seed` must be None or an integer. Received: seed='7'"),
])
def test_init_rejects_bad_arguments(kwargs, message):
    args = dict(num_heads=4, key_dim=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        DCMHA(**args)


def test_init_accepts_implementations_and_output_shape_forms():
    for impl in ("auto", "ops"):
        assert DCMHA(4, 8, implementation=impl).implementation == impl
    assert DCMHA(4, 8, output_shape=(5,)).get_config()["output_shape"] == 5
    assert DCMHA(4, 8, output_shape=5).compute_output_shape((2, 3, 16), (2, 3, 16)) == (2, 3, 5)
    assert DCMHA(4, 8, output_shape=[4, 2]).get_config()["output_shape"] == (4, 2)
    assert DCMHA(4, 8, output_shape=(4, 2)).compute_output_shape(
        (2, 3, 16), (2, 3, 16)) == (2, 3, 4, 2)
    # flash_attention maps onto implementation: None keeps it, True a fused core, False "ops".
    assert DCMHA(4, 8, flash_attention=None, implementation="ops").implementation == "ops"
    assert DCMHA(4, 8, flash_attention=True).implementation == "auto"
    assert DCMHA(4, 8, flash_attention=False).implementation == "ops"


def test_dynamic_projection_rejects_bad_slots():
    with pytest.raises(ValueError, match=re.escape(
            "`slots` must be a non-empty subset of ('pre_query', 'pre_key', 'post_query', "
            "'post_key'). Received: slots=('pre_value',)")):
        DynamicWeightProjection(("pre_value",), num_heads=4)


def test_dynamic_projection_rejects_another_width_after_build():
    proj = DynamicWeightProjection(("pre_query", "pre_key"), num_heads=4)
    x = np.zeros((2, 3, 8), "float32")
    out = proj(x)
    assert tuple(out["pre_key"]["w1"].shape) == (2, 3, 1, 2, 4)
    with pytest.raises(ValueError, match=re.escape(
            "The input of DynamicWeightProjection must have shape (B, L, D) with D=8. "
            "Received: shape=(2, 3, 6)")):
        proj(np.zeros((2, 3, 6), "float32"))


# ---------------------------------------------------------------------------
# Config and saving
# ---------------------------------------------------------------------------

NON_DEFAULT = dict(num_heads=4, key_dim=6, value_dim=5, num_key_value_heads=2, num_groups=2,
                   rank=1, dynamic_hidden_dim=3, query_wise=False, static_compose=True,
                   gelu_approximate=False, qk_norm=True, rope_max_wavelength=500.0,
                   sliding_window=4, query_chunk_size=3, dropout=0.25, use_bias=True,
                   output_shape=7, implementation="ops", seed=3)


def test_get_config_round_trip():
    layer = DCMHA(**NON_DEFAULT, kernel_initializer="he_normal", name="att")
    config = layer.get_config()
    for k, v in NON_DEFAULT.items():
        assert config[k] == v, k
    clone = DCMHA.from_config(config)
    assert clone.get_config() == config
    assert clone.spec_config == layer.spec_config
    json_cfg = keras.saving.serialize_keras_object(layer)
    assert json_cfg["registered_name"] == "dcmha>DCMHA"


def test_save_and_load_keras_file_without_custom_objects(tmp_path, rng):
    """A self-attention and a cross-attention DCMHA in one model survive a .keras round trip."""
    common = dict(num_heads=4, key_dim=8, static_compose=True, qk_norm=True, use_bias=True,
                  rope_max_wavelength=100.0, num_key_value_heads=2)
    self_att = DCMHA(**common, name="self_att")
    cross_att = DCMHA(**common, cross_attention=True, name="cross_att")
    q = keras.Input((None, 16), name="q")
    kv = keras.Input((None, 12), name="kv")
    h = self_att(q, q, use_causal_mask=True)
    model = keras.Model([q, kv], cross_att(h, kv))
    # Non-trivial weights: the default init keeps composition close to the identity.
    for layer in (self_att, cross_att):
        layer.load_spec_weights({n: rng.standard_normal(w.shape).astype("float32") * 0.3
                                 for n, w in layer.spec_weights().items()})
    inputs = [rng.standard_normal((2, 5, 16)).astype("float32"),
              rng.standard_normal((2, 7, 12)).astype("float32")]
    expected = model.predict(inputs, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    got = loaded.predict(inputs, verbose=0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    for layer in (self_att, cross_att):
        loaded_layer = loaded.get_layer(layer.name)
        assert isinstance(loaded_layer, DCMHA)
        assert loaded_layer.get_config() == layer.get_config()
        for n, w in layer.spec_weights().items():
            np.testing.assert_array_equal(loaded_layer.spec_weights()[n], w)


# ---------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------

def test_symbolic_call_with_unknown_lengths():
    layer = DCMHA(num_heads=4, key_dim=8, output_shape=10)
    q = keras.Input((None, 16))
    kv = keras.Input((None, 16))
    y, scores = layer(q, kv, return_attention_scores=True)
    assert tuple(y.shape) == (None, None, 10)
    assert tuple(scores.shape) == (None, 4, None, None)
    assert scores.dtype == "float32"
    model = keras.Model([q, kv], [y, scores])
    for T, S in ((3, 5), (6, 2)):
        out, sc = model.predict([np.ones((2, T, 16), "float32"), np.ones((2, S, 16), "float32")],
                                verbose=0)
        assert tuple(out.shape) == (2, T, 10)
        assert tuple(sc.shape) == (2, 4, T, S)


def test_compute_output_shape_and_spec_with_cache():
    layer = DCMHA(num_heads=4, key_dim=8, num_key_value_heads=2)
    assert layer.compute_output_shape((3, 5, 16), (3, 7, 16)) == (3, 5, 16)
    layer.build((3, 5, 16), (3, 5, 16))
    shapes = reference.cache_shapes(layer.spec_config, 3, 9)
    cache = {n: keras.KerasTensor(s) for n, s in shapes.items()}
    q = keras.KerasTensor((3, 2, 16))
    y, scores, new_cache = layer.compute_output_spec(q, q, return_attention_scores=True,
                                                     cache=cache, cache_update_index=0)
    assert tuple(y.shape) == (3, 2, 16)
    assert tuple(scores.shape) == (3, 4, 2, 9)
    assert {n: tuple(t.shape) for n, t in new_cache.items()} == \
        reference.cache_shapes(layer.spec_config, 3, 9)


def test_call_validates_inputs_after_build():
    layer = DCMHA(num_heads=4, key_dim=8)
    x = np.zeros((2, 3, 16), "float32")
    layer(x, x)
    with pytest.raises(ValueError, match=re.escape(
            "`query` must have last dimension 16 (the layer was built for it). "
            "Received: query.shape=(2, 3, 12)")):
        layer(np.zeros((2, 3, 12), "float32"), x)
    with pytest.raises(ValueError, match=re.escape(
            "`query` must have rank 3 (B, L, D). Received: query.shape=(3, 16)")):
        layer(np.zeros((3, 16), "float32"), x)
    with pytest.raises(ValueError, match=re.escape(
            "All dimensions of `value` and `key`, except the last one, must be equal. Received: "
            "value.shape=(2, 3, 16) and key.shape=(2, 4, 16)")):
        layer(x, x, np.zeros((2, 4, 16), "float32"))


def test_self_attention_needs_equal_widths():
    layer = DCMHA(num_heads=4, key_dim=8)
    with pytest.raises(ValueError, match=re.escape(
            "Self-attention dynamic weights share one projection, so `query` and `key` must "
            "have the same width. Received: query width 16, key width 12; use "
            "cross_attention=True for separate projections.")):
        layer(np.zeros((2, 3, 16), "float32"), np.zeros((2, 4, 12), "float32"))
    # Without dynamic weights the widths may differ, as in MultiHeadAttention.
    plain = DCMHA(num_heads=4, key_dim=8, dynamic_projection=False, dynamic_gating=False)
    out = plain(np.zeros((2, 3, 16), "float32"), np.zeros((2, 4, 12), "float32"))
    assert tuple(out.shape) == (2, 3, 16)


def test_bad_cache_is_rejected():
    layer = DCMHA(num_heads=4, key_dim=8)
    x = np.zeros((1, 2, 16), "float32")
    cache = layer.init_cache(1, 4) if layer.built else None
    layer(x, x)
    cache = layer.init_cache(1, 4)
    del cache["key_dd"]
    with pytest.raises(ValueError, match=re.escape(
            "`cache` must be a dict with keys ['key', 'key_dd', 'key_w', 'value'] (see "
            "`init_cache`). Received: ['key', 'key_w', 'value']")):
        layer(x, x, cache=cache, cache_update_index=0)


# ---------------------------------------------------------------------------
# Variables and canonical weights
# ---------------------------------------------------------------------------

def test_variable_names():
    layer = DCMHA(num_heads=4, key_dim=8, static_compose=True, qk_norm=True, use_bias=True,
                  name="att")
    layer.build((2, 3, 16), (2, 3, 16))
    paths = sorted(v.path for v in layer.weights)
    # The projections are MultiHeadAttention's EinsumDense sublayers, with its names.
    assert paths == sorted([
        "att/query/kernel", "att/key/kernel", "att/value/kernel", "att/attention_output/kernel",
        "att/query/bias", "att/key/bias", "att/value/bias", "att/attention_output/bias",
        "att/static_pre", "att/static_post", "att/query_norm_scale", "att/key_norm_scale",
        "att/dynamic_projection/dw1", "att/dynamic_projection/qkw",
        "att/dynamic_projection/dd"])
    assert isinstance(layer.dynamic_projection_layer, DynamicWeightProjection)
    for dense in (layer.query_dense, layer.key_dense, layer.value_dense, layer.output_dense):
        assert isinstance(dense, keras.layers.EinsumDense)

    cross = DCMHA(num_heads=4, key_dim=8, cross_attention=True, dynamic_gating=False, name="x")
    cross.build((2, 3, 16), (2, 5, 12))
    assert sorted(v.path for v in cross.weights) == sorted([
        "x/query/kernel", "x/key/kernel", "x/value/kernel", "x/attention_output/kernel",
        "x/query_dynamic_projection/dw1", "x/query_dynamic_projection/qkw",
        "x/key_dynamic_projection/dw1", "x/key_dynamic_projection/qkw"])
    assert sorted(cross.spec_weights()) == sorted(reference.param_shapes(cross.spec_config, 16, 12))


def assert_spec_weights_equal(layer, want):
    """``layer.spec_weights()`` equal to ``want``: exactly, but for the composition weights
    under the layer's ``composition_lr_scale`` (held divided by it: one rounding into the
    variable, one out of it)."""
    for n, w in layer.spec_weights().items():
        assert w.dtype == np.float32
        scaled = layer.composition_lr_scale != 1.0 and is_composition_name(n)
        np.testing.assert_allclose(w, want[n], atol=0, err_msg=n,
                                   rtol=np.finfo(np.float32).eps if scaled else 0)


@pytest.mark.parametrize("kwargs, cross", [
    (dict(num_heads=4, key_dim=8, static_compose=True, qk_norm=True, use_bias=True,
          num_key_value_heads=2, value_dim=6), False),
    (dict(num_heads=4, key_dim=8, cross_attention=True, key_wise=False), True),
    (dict(num_heads=4, key_dim=8, dynamic_projection=False, dynamic_gating=False), False),
])
@pytest.mark.parametrize("scale", [0.1, 1.0])
def test_spec_weights_round_trip(reference_case, kwargs, cross, scale):
    case = reference_case(kwargs, D_kv=12 if cross else None, cross=cross, D_out=9)
    layer = DCMHA(**kwargs, output_shape=9, composition_lr_scale=scale)
    layer.load_spec_weights(case["params"])          # builds the layer from the shapes
    assert layer.built
    assert {n: w.shape for n, w in layer.spec_weights().items()} == reference.param_shapes(
        case["cfg"], 16, 12 if cross else 16, 9)
    assert_spec_weights_equal(layer, case["params"])


def test_load_spec_weights_errors_and_atomicity(reference_case):
    case = reference_case(dict(num_heads=4, key_dim=8))
    layer = DCMHA(num_heads=4, key_dim=8, name="att")
    layer.build((2, 6, 16), (2, 6, 16))
    before = layer.spec_weights()
    good = case["params"]

    bad = dict(good, extra=np.zeros(3), another=np.zeros(1))
    with pytest.raises(ValueError, match="^" + re.escape(
            "Unknown weight names for DCMHA layer 'att': ['another', 'extra']. Expected names: "
            "['dd', 'dw1', 'key_kernel', 'output_kernel', 'qkw', 'query_kernel', "
            "'value_kernel']") + "$"):
        layer.load_spec_weights(bad)

    missing = {n: w for n, w in good.items() if n not in ("dd", "qkw")}
    with pytest.raises(ValueError, match="^" + re.escape(
            "Missing weights for DCMHA layer 'att': ['dd', 'qkw']. Expected names: "
            "['dd', 'dw1', 'key_kernel', 'output_kernel', 'qkw', 'query_kernel', "
            "'value_kernel']") + "$"):
        layer.load_spec_weights(missing)

    # The shape error comes after the valid names were checked: nothing is half-loaded.
    wrong = dict(good, value_kernel=np.zeros((16, 4, 4), "float32"))
    with pytest.raises(ValueError, match="^" + re.escape(
            "Wrong shape for weight 'value_kernel': expected (16, 4, 8), received (16, 4, 4).")
            + "$"):
        layer.load_spec_weights(wrong)
    for n, w in layer.spec_weights().items():
        np.testing.assert_array_equal(w, before[n])

    layer.load_spec_weights(good)
    assert_spec_weights_equal(layer, good)


def test_spec_weights_needs_a_built_layer():
    with pytest.raises(ValueError, match=re.escape(
            "DCMHA layer 'att' is not built yet: call it on inputs or call `build()` first.")):
        DCMHA(4, 8, name="att").spec_weights()
    with pytest.raises(ValueError, match=re.escape(
            "DCMHA layer 'att' is not built and cannot be built from these weights: missing "
            "['key_kernel', 'value_kernel'].")):
        DCMHA(4, 8, name="att").load_spec_weights({"query_kernel": np.zeros((16, 4, 8))})


def test_init_cache_shapes_and_dtype():
    layer = DCMHA(num_heads=4, key_dim=8, num_key_value_heads=2, num_groups=2, rank=3,
                  pre_compose=False, dtype="mixed_float16")
    layer.build((2, 3, 16), (2, 3, 16))
    cache = layer.init_cache(2, 11)
    assert {n: tuple(c.shape) for n, c in cache.items()} == reference.cache_shapes(
        layer.spec_config, 2, 11)
    assert all(keras.backend.standardize_dtype(c.dtype) == "float16" for c in cache.values())
    cache32 = layer.init_cache(2, 11, dtype="float32")
    assert all(keras.backend.standardize_dtype(c.dtype) == "float32" for c in cache32.values())


# ---------------------------------------------------------------------------
# Initialisation
# ---------------------------------------------------------------------------

def test_initialisation_follows_the_spec():
    D, N = 96, 16
    layer = DCMHA(num_heads=N, key_dim=8, static_compose=True, seed=5)
    layer.build((1, 2, D), (1, 2, D))
    cfg = layer.spec_config
    M, R, K = cfg.M, cfg.R, cfg.K
    w = layer.spec_weights()
    expected_std = {
        "dw1": np.sqrt(2.0 / (D + K)),
        "qkw": np.sqrt(1.0 / K) * 2.0 / (M + R) * 0.01,
        "dd": np.sqrt(2.0 / (D + M)) * 0.005,
        "static_pre": np.sqrt(1.0 / M) * 0.1,
        "static_post": np.sqrt(1.0 / M) * 0.1,
    }
    for name, std in expected_std.items():
        # >= 256 samples per tensor: the sample std is within 20% of sigma.
        assert w[name].size >= 256, name
        assert abs(w[name].std() / std - 1.0) < 0.2, (name, w[name].std(), std)
        assert abs(w[name].mean()) < 4 * std / np.sqrt(w[name].size), name
    # Keras kernel_initializer for the projections, zero-free and distinct.
    assert not np.allclose(w["query_kernel"], w["key_kernel"][:, :, :])
    # Seeded: the same seed gives the same weights, another seed others.
    again = DCMHA(num_heads=N, key_dim=8, static_compose=True, seed=5)
    again.build((1, 2, D), (1, 2, D))
    other = DCMHA(num_heads=N, key_dim=8, static_compose=True, seed=6)
    other.build((1, 2, D), (1, 2, D))
    for n in w:
        np.testing.assert_array_equal(again.spec_weights()[n], w[n])
        assert not np.array_equal(other.spec_weights()[n], w[n]), n


def test_lazy_package_import():
    assert dcmha.DCMHA is DCMHA
    assert dcmha.ops.dcmha_attention is not None
    assert dcmha.SPEC_VERSION == reference.SPEC_VERSION


# ---------------------------------------------------------------------------
# Inputs on another device than the layer's (torch)
# ---------------------------------------------------------------------------

_OTHER_DEVICE_CHILD = """
import json, torch, dcmha
B, T, D = 2, 6, 32
out = {}
for impl in ("auto", "ops"):
    layer = dcmha.DCMHA(num_heads=4, key_dim=8, seed=0, implementation=impl)
    x, kv = torch.randn(B, T, D), torch.randn(B, 9, D)          # CPU tensors
    mask = torch.ones(B, T, T, dtype=torch.bool)
    y = layer(x, x, attention_mask=mask, use_causal_mask=True, query_mask=mask[:, 0])
    out[impl + "/self"] = [str(y.device), list(y.shape)]
    y = layer(x, kv, key=kv, value_mask=torch.ones(B, 9, dtype=torch.bool))
    out[impl + "/cross"] = [str(y.device), list(y.shape)]
    cache = {n: torch.zeros(tuple(v.shape)) for n, v in layer.init_cache(B, 8).items()}
    y, cache = layer(x[:, :1], x[:, :1], cache=cache, cache_update_index=torch.tensor(3))
    out[impl + "/decode"] = [str(y.device), list(y.shape)] + sorted(
        {str(v.device) for v in cache.values()})
print(json.dumps(out))
"""


@pytest.mark.skipif(BACKEND != "torch", reason="Keras moves tensors between devices on torch")
def test_cpu_tensors_reach_the_layers_device():
    """Keras's layers accept a CPU tensor when their weights live on another device (a GPU);
    so does DCMHA, for every tensor argument and a cache's tensors. The layer lives on
    torch's "meta" device here (``KERAS_TORCH_DEVICE``), which every machine has."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, KERAS_BACKEND="torch", KERAS_TORCH_DEVICE="meta")
    run = subprocess.run([sys.executable, "-c", _OTHER_DEVICE_CHILD], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for impl in ("auto", "ops"):
        assert got[impl + "/self"] == ["meta", [2, 6, 32]]
        assert got[impl + "/cross"] == ["meta", [2, 6, 32]]
        assert got[impl + "/decode"] == ["meta", [2, 1, 32], "meta"]
