"""DCMHA as a drop-in for keras.layers.MultiHeadAttention.

With composition off (pre_compose=False, post_compose=False) and MultiHeadAttention's
weights, DCMHA must compute what MultiHeadAttention computes (to 1e-5) for every
argument users rely on: masks of every kind (explicit, implicit Keras masks, float,
per head, lists), attention_axes, output_shape, causal, scores, gates, dropout at
inference, LoRA, quantization. ``DCMHA.from_mha`` must give MultiHeadAttention's
output with the composition on. Runs on the Keras backend of the process.
"""

import re
import warnings

import numpy as np
import pytest

import keras
from keras import ops
# Keras has no public reader of the mask it attaches to eager tensors.
from keras.src.backend.common.masking import get_keras_mask

from dcmha.layers import DCMHA

BACKEND = keras.backend.backend()
TRAINABLE = BACKEND != "numpy"
OFF = dict(pre_compose=False, post_compose=False)
TOL = dict(rtol=1e-5, atol=1e-5)


def np_(x):
    return np.asarray(ops.convert_to_numpy(x))


def f32(rng, *shape):
    return rng.standard_normal(shape).astype("float32")


def random_mask(rng, shape, key_axes=1):
    """A boolean mask whose every query row keeps a key (no fully masked row)."""
    m = rng.random(shape) < 0.6
    m[(...,) + (0,) * key_axes] = True
    return m


def twin(mha, inputs, **options):
    """A DCMHA built from ``mha.get_config()`` (plus options) holding ``mha``'s weights."""
    layer = DCMHA(**{**mha.get_config(), "name": None, **options})
    layer.build(*(tuple(x.shape) for x in inputs))
    # Composition off: the same sublayers in the same order as MultiHeadAttention.
    layer.set_weights(mha.get_weights())
    return layer


def built_mha(inputs, **kwargs):
    mha = keras.layers.MultiHeadAttention(**{**dict(num_heads=4, key_dim=4), **kwargs})
    mha.build(*(tuple(x.shape) for x in inputs))
    # Non-zero biases, so that a missing bias shows.
    mha.set_weights([w + 0.1 for w in mha.get_weights()])
    return mha


# ---------------------------------------------------------------------------
# Composition off: equal to MultiHeadAttention
# ---------------------------------------------------------------------------

def _cases():
    B, T, S, D = 2, 5, 3, 16
    rng = np.random.default_rng(7)
    q, kv, k = f32(rng, B, T, D), f32(rng, B, S, 12), f32(rng, B, S, 12)
    x = f32(rng, B, T, D)
    mask = random_mask(rng, (B, T, S))
    self_mask = random_mask(rng, (B, T, T))
    per_head = random_mask(rng, (B, 4, T, S))
    q4, v4 = f32(rng, B, 3, 4, 8), f32(rng, B, 3, 2, 8)
    q5, v5 = f32(rng, B, 5, 3, 4, 8), f32(rng, B, 5, 3, 2, 8)
    m4 = random_mask(rng, (B, 3, 4, 3, 2), key_axes=2)
    return {
        "self": ((x, x), {}, {}),
        "cross_with_key": ((q, kv, k), {}, {}),
        "bool_mask": ((q, kv), {}, dict(attention_mask=mask)),
        "int_mask": ((q, kv), {}, dict(attention_mask=mask.astype("int32"))),
        "float_mask": ((q, kv), {}, dict(attention_mask=mask * np.float32(0.3))),
        "rank2_mask": ((q, kv), {}, dict(attention_mask=mask[0])),
        "head_axis_1": ((q, kv), {}, dict(attention_mask=mask[:, None])),
        "per_head_mask": ((q, kv), {}, dict(attention_mask=per_head)),
        "causal": ((x, x), {}, dict(use_causal_mask=True)),
        "causal_cross": ((q, kv), {}, dict(use_causal_mask=True)),
        "causal_and_mask": ((x, x), {}, dict(use_causal_mask=True, attention_mask=self_mask)),
        "sliding_window": ((x, x), dict(sliding_window=2), dict(use_causal_mask=True)),
        "scores": ((q, kv), {}, dict(attention_mask=mask, return_attention_scores=True)),
        "output_shape_int": ((x, x), dict(output_shape=6), {}),
        "output_shape_tuple": ((x, x), dict(output_shape=(4, 2)), {}),
        # (MultiHeadAttention's fused path on jax needs value_dim == key_dim; scores avoid it.)
        "value_dim_no_bias": ((q, kv), dict(value_dim=3, use_bias=False),
                              dict(return_attention_scores=True)),
        "gate": ((q, kv), dict(use_gate=True), dict(attention_mask=mask)),
        "dropout_at_inference": ((x, x), dict(dropout=0.5), dict(training=False)),
        "axes_2_of_4d": ((q4, v4), dict(attention_axes=(2,)), dict(return_attention_scores=True)),
        "axes_negative": ((q4, v4), dict(attention_axes=-2), {}),
        "axes_1_2_of_4d_mask": ((q4, v4), dict(attention_axes=(1, 2)),
                                dict(attention_mask=m4, return_attention_scores=True)),
        "axes_2_3_of_5d_gate": ((q5, v5), dict(attention_axes=(2, 3), use_gate=True,
                                               output_shape=(2, 3)), {}),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_composition_off_equals_multi_head_attention(name, call_layer):
    inputs, init, call = CASES[name]
    mha = built_mha(inputs, **init)
    layer = twin(mha, inputs, **OFF)
    want = call_layer(mha, *inputs, **call)
    got = call_layer(layer, *inputs, **call)
    if call.get("return_attention_scores"):
        assert tuple(got[1].shape) == tuple(want[1].shape)
        np.testing.assert_allclose(np_(got[1]), np_(want[1]), **TOL)
        want, got = want[0], got[0]
    assert tuple(got.shape) == tuple(want.shape)
    np.testing.assert_allclose(np_(got), np_(want), **TOL)


def test_list_attention_mask():
    rng = np.random.default_rng(1)
    x = f32(rng, 2, 4, 16)
    mask = random_mask(rng, (2, 4, 4))
    layer = DCMHA(num_heads=4, key_dim=4)
    want = np_(layer(x, x, attention_mask=mask))
    np.testing.assert_array_equal(np_(layer(x, x, attention_mask=mask.tolist())), want)
    with pytest.raises(TypeError, match=re.escape(
            "`attention_mask` must be a tensor, an array or a nested list of booleans or numbers "
            "of one shape. Received: a list NumPy cannot read as such")):
        layer(x, x, attention_mask=[[True, False], [True]])
    with pytest.raises(TypeError, match=re.escape(
            "`attention_mask` must be a tensor, an array or a nested list of booleans or numbers "
            "of one shape. Received: a list NumPy cannot read as such (dtype <U3)")):
        layer(x, x, attention_mask=[["yes"] * 4] * 4)


def test_truthy_causal_flags():
    rng = np.random.default_rng(2)
    x = f32(rng, 2, 4, 16)
    layer = DCMHA(num_heads=4, key_dim=4)
    causal, full = np_(layer(x, x, use_causal_mask=True)), np_(layer(x, x))
    assert np.abs(causal - full).max() > 1e-3
    # NumPy values reach `call` as tensors (Keras converts them first).
    for flag, want in ((1, causal), (0, full), (np.bool_(True), causal),
                       (np.bool_(False), full), (ops.convert_to_tensor(True), causal),
                       (ops.convert_to_tensor(np.int32(0)), full)):
        np.testing.assert_allclose(np_(layer(x, x, use_causal_mask=flag)), want, **TOL)
    _, scores = layer(x, x, return_attention_scores=1)
    assert tuple(scores.shape) == (2, 4, 4, 4)
    with pytest.raises(ValueError, match=re.escape(
            "`use_causal_mask` must be a boolean or a boolean scalar tensor. Received: "
            "use_causal_mask of shape (2,) and dtype bool")):
        layer(x, x, use_causal_mask=np.array([True, False]))


def test_traced_causal_flag():
    """A flag that is a traced tensor (inside jax.jit or a tf.function) is applied as a mask."""
    if BACKEND not in ("jax", "tensorflow"):
        pytest.skip("tracing a call with a tensor flag: jax and tensorflow")
    rng = np.random.default_rng(3)
    x = f32(rng, 2, 4, 16)
    layer = DCMHA(num_heads=4, key_dim=4, num_groups=2)
    want = {flag: np_(layer(x, x, use_causal_mask=flag)) for flag in (True, False)}
    if BACKEND == "jax":
        import jax

        def run(flag):
            return layer.stateless_call([v.value for v in layer.trainable_variables], [],
                                        x, x, use_causal_mask=flag)[0]
        run = jax.jit(run)
    else:
        import tensorflow as tf
        run = tf.function(lambda flag: layer(x, x, use_causal_mask=flag))
    for flag in (True, False):
        np.testing.assert_allclose(np_(run(np.bool_(flag))), want[flag], **TOL)


def test_flash_attention_refuses_scores():
    rng = np.random.default_rng(4)
    x = f32(rng, 2, 3, 8)
    layer = DCMHA(num_heads=2, key_dim=4, flash_attention=True)
    with pytest.raises(ValueError, match=re.escape(
            "Returning attention scores is not supported when flash attention is enabled. "
            "Please disable flash attention to access attention scores.")):
        layer(x, x, return_attention_scores=True)


@pytest.mark.parametrize("query_shape, value_shape, key_shape", [
    ((2, 4, 8), (2, 2, 7), (2,)),
    ((2, 4, 8), (2, 2, 8), (2, 1, 7)),
    ((2, 4, 2, 3, 8), (2, 1, 1, 5, 8), (2, 1, 15, 5, 2)),
])
def test_key_value_shape_check_as_multi_head_attention(query_shape, value_shape, key_shape):
    """Keras's test_shape_mismatch_error: `value` and `key` must agree on every axis but
    the last; `compute_output_shape` and a call raise MultiHeadAttention's ValueError."""
    options = dict(num_heads=4, key_dim=2, value_dim=2)
    mha = keras.layers.MultiHeadAttention(**options)
    with pytest.raises(ValueError) as want:
        mha.compute_output_shape(query_shape, value_shape, key_shape)
    layer = DCMHA(**options, **OFF)
    with pytest.raises(ValueError, match="^" + re.escape(str(want.value)) + "$"):
        layer.compute_output_shape(query_shape, value_shape, key_shape)
    with pytest.raises(ValueError, match=re.escape(str(want.value))):
        layer(*(np.ones(s, "float32") for s in (query_shape, value_shape, key_shape)))


def test_multi_head_attention_private_names():
    """`_sliding_window` and `_flash_attention`, MultiHeadAttention's private names of the
    arguments, read the arguments (also after a config round trip)."""
    layer = DCMHA.from_config(DCMHA(num_heads=2, key_dim=4, sliding_window=5,
                                    flash_attention=True).get_config())
    assert layer._sliding_window == 5 and layer.sliding_window == 5
    assert layer._flash_attention is True


def test_fully_masked_rows_are_zero():
    """A query row that sees no key gives the output bias (zero attention), never NaN."""
    rng = np.random.default_rng(5)
    x = f32(rng, 2, 4, 16)
    mask = random_mask(rng, (2, 4, 4))
    mask[0, 1] = False
    layer = DCMHA(num_heads=4, key_dim=4, use_bias=True, bias_initializer="ones")
    y, scores = layer(x, x, attention_mask=mask, return_attention_scores=True)
    assert np.all(np_(scores)[0, :, 1] == 0.0)
    np.testing.assert_array_equal(np_(y)[0, 1], np_(layer.output_dense.bias))


# ---------------------------------------------------------------------------
# Implicit (Keras) masks
# ---------------------------------------------------------------------------

QUERY_IDS = np.array([[1, 2, 3, 0, 0], [3, 3, 1, 1, 2], [1, 0, 0, 0, 0]])
VALUE_IDS = np.array([[5, 4, 0], [3, 0, 0], [2, 1, 1]])


def _embedded():
    keras.utils.set_random_seed(0)
    q = keras.layers.Embedding(4, 8, mask_zero=True)(QUERY_IDS)
    v = keras.layers.Embedding(6, 8, mask_zero=True)(VALUE_IDS)
    return q, v


@pytest.mark.parametrize("causal", [False, True])
def test_keras_masks_equal_the_explicit_mask(causal):
    """Embedding(mask_zero=True) masks on query and value act as MultiHeadAttention's."""
    q, v = _embedded()
    q_mask, v_mask = QUERY_IDS != 0, VALUE_IDS != 0
    layer = DCMHA(num_heads=2, key_dim=4, num_groups=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no "does not support masking" warning
        implicit = layer(q, v, use_causal_mask=causal)
    assert get_keras_mask(q) is not None      # the caller's tensors keep masks
    np.testing.assert_array_equal(np_(get_keras_mask(implicit)), q_mask)
    explicit = q_mask[:, :, None] & v_mask[:, None, :]
    plain_q, plain_v = ops.convert_to_tensor(np_(q)), ops.convert_to_tensor(np_(v))
    want = layer(plain_q, plain_v, attention_mask=explicit, use_causal_mask=causal)
    np.testing.assert_allclose(np_(implicit), np_(want), **TOL)
    # The same masks passed by name, and a key mask, combine the same way.
    by_name = layer(plain_q, plain_v, plain_v, query_mask=q_mask, value_mask=v_mask,
                    key_mask=np.ones_like(v_mask), use_causal_mask=causal)
    np.testing.assert_allclose(np_(by_name), np_(want), **TOL)


def test_keras_masks_in_a_functional_model_match_multi_head_attention():
    q_ids, v_ids = keras.Input((None,), dtype="int32"), keras.Input((None,), dtype="int32")
    q = keras.layers.Embedding(4, 8, mask_zero=True)(q_ids)
    v = keras.layers.Embedding(6, 8, mask_zero=True)(v_ids)
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    mha_model = keras.Model([q_ids, v_ids], mha(q, v, use_causal_mask=True))
    mha.set_weights([w + 0.1 for w in mha.get_weights()])
    layer = DCMHA(**{**mha.get_config(), "name": None}, **OFF)
    out = layer(q, v, use_causal_mask=True)
    assert out._keras_mask is not None                    # symbolic: the query's mask
    model = keras.Model([q_ids, v_ids], out)
    layer.set_weights(mha.get_weights())
    got, want = model.predict([QUERY_IDS, VALUE_IDS], verbose=0), mha_model.predict(
        [QUERY_IDS, VALUE_IDS], verbose=0)
    rows = QUERY_IDS != 0        # masked query rows: MHA's fused path averages, ours is 0
    np.testing.assert_allclose(got[rows], want[rows], **TOL)


def test_masking_layer_and_mask_propagation():
    rng = np.random.default_rng(6)
    data = f32(rng, 2, 5, 8)
    data[0, 3:] = 0.0
    data[1, 4:] = 0.0
    inputs = keras.Input((5, 8))
    masked = keras.layers.Masking(0.0)(inputs)
    layer = DCMHA(num_heads=2, key_dim=4)
    h = layer(masked, masked)
    pooled = keras.layers.GlobalAveragePooling1D()(h)     # averages unmasked steps only
    model = keras.Model(inputs, [h, pooled])
    h_val, pooled_val = model.predict(data, verbose=0)
    keep = np.any(data != 0.0, axis=-1)
    want = np_(layer(data, data, attention_mask=keep[:, :, None] & keep[:, None, :]))
    np.testing.assert_allclose(h_val[keep], want[keep], **TOL)
    np.testing.assert_allclose(pooled_val, [want[b][keep[b]].mean(0) for b in range(2)], **TOL)


@pytest.mark.parametrize("kwargs, message", [
    (dict(value_mask=np.ones((1, 2), bool), cache=True),
     "`value_mask` cannot be combined with a `cache`: the keys are the cache's S_max "
     "positions; pass an `attention_mask` over them."),
    (dict(query_mask=np.ones((1, 3), bool)),
     "`query_mask` must have the shape of `query` without its last axis, (1, 2). "
     "Received: query_mask.shape=(1, 3)"),
    (dict(query_mask=np.ones((1, 2), bool), attention_mask=np.ones((1, 2, 3), bool)),
     "`attention_mask` must broadcast to (B, T, S) = (1, 2, 2). "
     "Received: attention_mask.shape=(1, 2, 3)"),
    (dict(value_mask=np.ones((1, 2), bool), attention_mask=np.ones((1, 3, 2, 2), bool)),
     "`attention_mask` must broadcast to (B, T, S) = (1, 2, 2) or (B, N, T, S) = "
     "(1, 2, 2, 2). Received: attention_mask.shape=(1, 3, 2, 2)"),
])
def test_call_refuses_bad_masks(kwargs, message):
    layer = DCMHA(num_heads=2, key_dim=4)
    x = np.zeros((1, 2, 8), "float32")
    layer(x, x)
    if kwargs.pop("cache", False):
        kwargs.update(cache=layer.init_cache(1, 4), cache_update_index=0)
    with pytest.raises(ValueError, match=re.escape(message)):
        layer(x, x, **kwargs)


# ---------------------------------------------------------------------------
# Keras machinery on the projections
# ---------------------------------------------------------------------------

def test_lora_as_on_multi_head_attention(tmp_path):
    rng = np.random.default_rng(8)
    x = f32(rng, 2, 3, 8)
    mha = built_mha((x, x), num_heads=3, key_dim=4, use_bias=False)
    layer = twin(mha, (x, x), **OFF)
    for m in (mha.query_dense, mha.value_dense):
        m.enable_lora(2)
    layer.enable_lora(2)                                  # query and value, by default
    assert len(layer.trainable_variables) == len(mha.trainable_variables) == 6
    assert len(layer.non_trainable_variables) == len(mha.non_trainable_variables) == 2
    for ours, theirs in ((layer.query_dense, mha.query_dense),
                         (layer.value_dense, mha.value_dense)):
        for name in ("lora_kernel_a", "lora_kernel_b"):
            value = rng.standard_normal(getattr(theirs, name).shape).astype("float32") * 0.3
            getattr(theirs, name).assign(value)
            getattr(ours, name).assign(value)
    want = np_(mha(x, x))
    np.testing.assert_allclose(np_(layer(x, x)), want, **TOL)
    # The spec weights are what the layer computes with (LoRA merged).
    np.testing.assert_allclose(layer.spec_weights()["query_kernel"],
                               np_(mha.query_dense.kernel), **TOL)
    inputs = keras.Input((3, 8))
    model = keras.Model(inputs, layer(inputs, inputs))
    model.save(tmp_path / "lora.keras")
    np.testing.assert_allclose(keras.saving.load_model(tmp_path / "lora.keras").predict(
        x, verbose=0), want, **TOL)
    with pytest.raises(ValueError, match=re.escape(
            "`projections` must name sublayers among ['attention_output', 'key', 'query', "
            "'value']. Received: projections=('gate',)")):
        layer.enable_lora(2, projections=("gate",))


@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
def test_quantize_as_on_multi_head_attention(mode, call_layer):
    rng = np.random.default_rng(9)
    x = f32(rng, 2, 5, 16)
    mha = built_mha((x, x), use_bias=False, use_gate=True)
    layer = twin(mha, (x, x), **OFF)
    for sub in (mha.query_dense, mha.key_dense, mha.value_dense, mha.output_dense,
                mha._gate_dense):
        sub.quantize(mode)
    layer.quantize(mode)
    for sub in (layer.query_dense, layer.gate_dense, layer.output_dense):
        assert sub.quantization_mode == mode
    np.testing.assert_allclose(np_(call_layer(layer, x, x)), np_(call_layer(mha, x, x)), **TOL)


def test_quantized_model_keeps_composition_float32():
    rng = np.random.default_rng(10)
    x = f32(rng, 2, 5, 16)
    inputs = keras.Input((5, 16))
    layer = DCMHA(num_heads=4, key_dim=4, static_compose=True)
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    before = model.predict(x, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # "DynamicWeightProjection has no quantize"
        model.quantize("int8")
    for sub in (layer.query_dense, layer.key_dense, layer.value_dense, layer.output_dense):
        assert keras.backend.standardize_dtype(sub._kernel.dtype) == "int8"
    for name in ("dw1", "qkw", "dd"):
        var = getattr(layer.dynamic_projection_layer, name)
        assert keras.backend.standardize_dtype(var.dtype) == "float32", name
    assert keras.backend.standardize_dtype(layer.static_pre.dtype) == "float32"
    after = model.predict(x, verbose=0)
    # int8 weights and activations: a few percent of the output's scale.
    assert np.abs(after - before).max() < 0.05 * np.abs(before).max()
    with pytest.raises(ValueError, match=re.escape(
            f"DCMHA layer '{layer.name}' has quantized projections (['int8']); spec_weights() "
            "needs their float weights.")):
        layer.spec_weights()


def test_dtype_policy_map_reaches_the_projections():
    policy_map = keras.dtype_policies.DTypePolicyMap()
    quantized = keras.dtype_policies.QuantizedDTypePolicy("int8", "float32")
    for name in ("query", "key", "value"):
        policy_map[f"att/{name}"] = quantized
    layer = DCMHA(num_heads=2, key_dim=4, dtype=policy_map, name="att")
    layer.build((2, 3, 8), (2, 3, 8))
    for sub in (layer.query_dense, layer.key_dense, layer.value_dense):
        assert keras.backend.standardize_dtype(sub._kernel.dtype) == "int8"
    assert keras.backend.standardize_dtype(layer.output_dense._kernel.dtype) == "float32"
    assert keras.backend.standardize_dtype(layer.dynamic_projection_layer.qkw.dtype) == "float32"


def test_regularizers_constraints_and_initializers():
    rng = np.random.default_rng(11)
    x = f32(rng, 2, 3, 8)
    options = dict(num_heads=2, key_dim=4, use_gate=True, kernel_regularizer="l2",
                   bias_regularizer="l1", activity_regularizer="l2",
                   kernel_constraint="non_neg", bias_constraint="non_neg",
                   bias_initializer="ones")
    mha = keras.layers.MultiHeadAttention(**options)
    mha.build(x.shape, x.shape)
    layer = twin(mha, (x, x), **OFF)
    for sub in (layer.query_dense, layer.key_dense, layer.value_dense, layer.gate_dense,
                layer.output_dense):
        assert isinstance(sub.kernel.constraint, keras.constraints.NonNeg)
        assert isinstance(sub.bias.constraint, keras.constraints.NonNeg)
    # Same weights: the same regularization losses (weights and activities), after one call.
    mha(x, x)
    layer(x, x)
    np.testing.assert_allclose(sorted(float(np_(v)) for v in layer.losses),
                               sorted(float(np_(v)) for v in mha.losses), rtol=1e-5)
    assert len(layer.losses) == len(mha.losses) == 15           # 5 projections x 3
    fresh = DCMHA(**options, use_bias=True)
    fresh.build((2, 3, 8), (2, 3, 8))
    w = fresh.spec_weights()
    assert not np.allclose(w["query_kernel"], w["key_kernel"])
    np.testing.assert_array_equal(w["query_bias"], np.ones((2, 4), "float32"))


# ---------------------------------------------------------------------------
# Config, saving, from_mha
# ---------------------------------------------------------------------------

def test_config_from_multi_head_attention_round_trip(tmp_path):
    mha = keras.layers.MultiHeadAttention(
        num_heads=2, key_dim=4, value_dim=3, dropout=0.1, output_shape=(3, 2),
        attention_axes=(2,), use_gate=True, kernel_regularizer="l2",
        bias_constraint="non_neg", seed=4)
    layer = DCMHA(**mha.get_config())
    config = layer.get_config()
    assert config["pre_compose"] and config["post_compose"]        # composition defaults
    for key, value in mha.get_config().items():
        if key not in ("name", "output_shape"):
            assert config[key] == value, key
    assert config["output_shape"] == (3, 2)
    assert DCMHA.from_config(config).get_config() == config
    rng = np.random.default_rng(12)
    x = f32(rng, 2, 3, 4, 8)
    inputs = keras.Input((3, 4, 8))
    model = keras.Model(inputs, DCMHA(**{**config, "name": "att"})(inputs, inputs))
    want = model.predict(x, verbose=0)
    assert want.shape == (2, 3, 4, 3, 2)
    model.save(tmp_path / "m.keras")
    np.testing.assert_allclose(keras.saving.load_model(tmp_path / "m.keras").predict(
        x, verbose=0), want, **TOL)


@pytest.mark.parametrize("options", [
    dict(),
    dict(num_groups=2, static_compose=True, qk_norm=False, rank=1),
    dict(cross_attention=True, query_wise=False),
])
def test_from_mha_starts_at_mha(options, call_layer):
    rng = np.random.default_rng(13)
    x = f32(rng, 2, 5, 16)
    mha = built_mha((x, x), use_gate=True)
    layer = DCMHA.from_mha(mha, **options)
    assert layer.pre_compose and layer.post_compose
    mask = random_mask(rng, (2, 5, 5))
    want = call_layer(mha, x, x, attention_mask=mask, use_causal_mask=True)
    got = call_layer(layer, x, x, attention_mask=mask, use_causal_mask=True)
    np.testing.assert_allclose(np_(got), np_(want), **TOL)
    x4 = f32(rng, 2, 3, 4, 8)
    mha4 = built_mha((x4, x4), attention_axes=(1, 2), output_shape=5)
    np.testing.assert_allclose(np_(call_layer(DCMHA.from_mha(mha4, **options), x4, x4)),
                               np_(call_layer(mha4, x4, x4)), **TOL)


def test_from_mha_composition_learns():
    """The identity start is not a dead point: the first SGD step moves the w2 half of qkw,
    dd and the static mixes; the w1 half and dw1 follow from the second (as LoRA's A)."""
    if not TRAINABLE:
        pytest.skip("numpy backend has no training")
    rng = np.random.default_rng(14)
    x = f32(rng, 4, 6, 16)
    mha = built_mha((x, x))
    layer = DCMHA.from_mha(mha, static_compose=True)
    inputs = keras.Input((6, 16))
    model = keras.Model(inputs, layer(inputs, inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    target = f32(rng, 4, 6, 16)
    R = layer.rank
    w2_half, w1_half = np.s_[:, :, :, R:], np.s_[:, :, :, :R]
    for moving in ((("qkw", w2_half), ("dd", np.s_[:]), ("static_pre", np.s_[:]),
                    ("static_post", np.s_[:])),
                   (("qkw", w1_half), ("dw1", np.s_[:]))):
        before = layer.spec_weights()
        model.train_on_batch(x, target)
        after = layer.spec_weights()
        for name, part in moving:
            assert np.abs(after[name][part] - before[name][part]).max() > 0, name


def test_from_mha_refuses():
    with pytest.raises(TypeError, match=re.escape(
            "`mha` must be a keras.layers.MultiHeadAttention layer. Received: Dense")):
        DCMHA.from_mha(keras.layers.Dense(2))
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=2, name="m")
    with pytest.raises(ValueError, match=re.escape(
            "`mha` must be built (call it on inputs first). Received: the unbuilt layer 'm'")):
        DCMHA.from_mha(mha)
    mha.build((1, 2, 4), (1, 2, 4))
    with pytest.raises(ValueError, match=re.escape(
            "`from_mha` takes ['key_dim', 'num_heads'] from the MultiHeadAttention layer. "
            "Received: key_dim=4, num_heads=4")):
        DCMHA.from_mha(mha, num_heads=4, key_dim=4)


def test_symbolic_scores_shape_matches_eager():
    for shape, axes in (((2, 3, 8), None), ((2, 3, 4, 8), (1, 2))):
        layer = DCMHA(num_heads=2, key_dim=4, attention_axes=axes)
        x = keras.Input(batch_shape=shape)
        sym = layer(x, x, return_attention_scores=True)
        data = np.ones(shape, "float32")
        out = layer(data, data, return_attention_scores=True)
        assert tuple(sym[0].shape) == tuple(out[0].shape) == shape
        assert tuple(sym[1].shape) == tuple(out[1].shape)


def test_attention_axes_errors():
    layer = DCMHA(num_heads=2, key_dim=4, attention_axes=(3,))
    with pytest.raises(ValueError, match=re.escape(
            "`attention_axes` must name distinct axes of the inputs other than the batch axis "
            "and the last axis: for inputs of rank 4, axes in [1, 2] or [-3, -2]. "
            "Received: attention_axes=(3,)")):
        layer.build((2, 3, 4, 8), (2, 3, 4, 8))
    layer = DCMHA(num_heads=2, key_dim=4, attention_axes=(2,))
    with pytest.raises(ValueError, match=re.escape(
            "`query` and `value` must have the same sizes on the axes outside `attention_axes` "
            "(2,). Received: query.shape=(2, 3, 4, 8), value.shape=(2, 5, 4, 8)")):
        layer.build((2, 3, 4, 8), (2, 5, 4, 8))
    layer = DCMHA(num_heads=2, key_dim=4, attention_axes=(1, 2))
    x = np.zeros((2, 3, 4, 8), "float32")
    layer(x, x)
    with pytest.raises(ValueError, match=re.escape(
            "A decoding `cache` needs inputs of rank 3 (B, L, D). Received: "
            "query.shape=(2, 3, 4, 8)")):
        layer(x, x, cache={}, cache_update_index=0)


# ---------------------------------------------------------------------------
# The override point: `_compute_attention`, as on MultiHeadAttention
# ---------------------------------------------------------------------------

class _RecordingCore(DCMHA):
    """Overrides the core with MultiHeadAttention's previous signature (no
    `use_causal_mask`) and runs DCMHA's own core through `super()`."""

    seen = []

    def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False):
        type(self).seen.append(attention_mask)
        return super()._compute_attention(query, key, value, attention_mask, training,
                                          return_attention_scores)


class _PlainSoftmaxCore(DCMHA):
    """Replaces the core with plain softmax attention on keras.ops (GQA by repetition)."""

    def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False):
        rep = query.shape[2] // key.shape[2]
        key, value = (ops.repeat(x, rep, axis=2) for x in (key, value))
        scores = ops.einsum("btnd,bsnd->bnts", query, key) / np.sqrt(query.shape[-1])
        if attention_mask is not None:
            mask = attention_mask if len(attention_mask.shape) == 4 else attention_mask[:, None]
            scores = ops.where(mask, scores, -1e9)
        probs = ops.softmax(scores, axis=-1)
        return ops.einsum("bnts,bsnd->btnd", probs, value), probs


def _same_weights(layer, like, x):
    layer(x, x)
    layer.set_weights(like.get_weights())
    return layer


def test_subclass_core_sees_the_causal_mask():
    """Keras's test_causal_only_skipped_for_subclass: an override receives the causal
    mask (and the window) folded into `attention_mask`, never None; through `super()`
    it computes DCMHA's composed output."""
    rng = np.random.default_rng(3)
    x = f32(rng, 2, 5, 8)
    options = dict(num_heads=2, key_dim=4, sliding_window=3, seed=1)
    base = DCMHA(**options)
    want = np_(base(x, x, use_causal_mask=True))
    _RecordingCore.seen = []
    sub = _same_weights(_RecordingCore(**options), base, x)
    _RecordingCore.seen = []
    got = np_(sub(x, x, use_causal_mask=True))
    (mask,) = _RecordingCore.seen
    t, s = np.arange(5)[:, None], np.arange(5)[None, :]
    assert_mask = np.broadcast_to((s <= t) & (t - s < 3), (1, 5, 5))
    np.testing.assert_array_equal(np_(mask), assert_mask)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("return_attention_scores", [False, True])
def test_compute_attention_combines_causal_and_explicit_mask(return_attention_scores):
    """Keras's test of the same name: called directly with `use_causal_mask=True` and an
    explicit mask, `_compute_attention` applies both, and gives MultiHeadAttention's
    result on the same projected heads."""
    t = 5
    layer = DCMHA(num_heads=2, key_dim=4, **OFF)
    layer.build((1, t, 8), (1, t, 8))
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    mha.build((1, t, 8), (1, t, 8))
    rng = np.random.RandomState(0)
    query, key, value = (rng.randn(1, t, 2, 4).astype("float32") for _ in range(3))
    extra = np.ones((1, t, t), dtype="bool")
    extra[:, 3, 1] = False
    merged = extra & np.tril(np.ones((t, t), dtype="bool"))[None]
    both, scores = layer._compute_attention(query, key, value, attention_mask=extra,
                                            use_causal_mask=True,
                                            return_attention_scores=return_attention_scores)
    only, _ = layer._compute_attention(query, key, value, attention_mask=merged,
                                       return_attention_scores=return_attention_scores)
    want, want_scores = mha._compute_attention(query, key, value, attention_mask=merged,
                                               return_attention_scores=True)
    np.testing.assert_allclose(np_(both), np_(only), **TOL)
    np.testing.assert_allclose(np_(both), np_(want), **TOL)
    if return_attention_scores:
        np.testing.assert_allclose(np_(scores), np_(want_scores), **TOL)


def test_causal_with_other_mask_equals_the_merged_mask():
    """Keras's test_causal_only_with_other_mask_falls_back on DCMHA (composition on)."""
    layer = DCMHA(num_heads=2, key_dim=4, seed=2)
    x = np.random.RandomState(0).randn(2, 5, 8).astype("float32")
    extra = np.ones((2, 5, 5), dtype="bool")
    extra[:, 2, 3] = False
    merged = extra & np.tril(np.ones((5, 5), dtype="bool"))
    out1 = layer(x, x, attention_mask=extra, use_causal_mask=True)
    out2 = layer(x, x, attention_mask=merged, use_causal_mask=False)
    assert tuple(out1.shape) == (2, 5, 8)
    np.testing.assert_allclose(np_(out1), np_(out2), **TOL)


def test_subclass_core_keeps_projections_masks_and_cache():
    """A replaced core gets DCMHA's projections (GQA heads, QK-norm, RoPE), masks and
    decoding cache: plain softmax attention as the core of a composition-off layer gives
    the layer's own output, in one call and by prefill + cached steps."""
    rng = np.random.default_rng(5)
    B, T, D = 2, 6, 16
    x = f32(rng, B, T, D)
    options = dict(num_heads=4, key_dim=4, num_key_value_heads=2, qk_norm=True,
                   rope_max_wavelength=100, seed=4, **OFF)
    base = DCMHA(**options)
    want = np_(base(x, x, use_causal_mask=True))
    sub = _same_weights(_PlainSoftmaxCore(**options), base, x)
    np.testing.assert_allclose(np_(sub(x, x, use_causal_mask=True)), want, **TOL)
    cache = sub.init_cache(B, T)
    y, cache = sub(x[:, :4], x[:, :4], use_causal_mask=True, cache=cache,
                   cache_update_index=0)
    steps = [np_(y)]
    for i in (4, 5):
        y, cache = sub(x[:, i:i + 1], x[:, i:i + 1], use_causal_mask=True, cache=cache,
                       cache_update_index=i)
        steps.append(np_(y))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), want, **TOL)
    y, scores = sub(x, x, return_attention_scores=True)
    assert tuple(scores.shape) == (B, 4, T, T)


def test_subclass_core_refusals():
    rng = np.random.default_rng(6)
    x = f32(rng, 1, 3, 8)
    layer = DCMHA(num_heads=2, key_dim=4, name="dyn")
    layer(x, x)
    q = f32(rng, 1, 3, 2, 4)
    with pytest.raises(ValueError, match=re.escape(
            "`_compute_attention` was called outside `call` on DCMHA layer 'dyn', whose "
            "composition needs dynamic weights computed from the unprojected inputs, which "
            "only `call` has.")):
        layer._compute_attention(q, q, q)
    sub = _PlainSoftmaxCore(num_heads=2, key_dim=4)
    with pytest.raises(ValueError, match=re.escape(
            "_PlainSoftmaxCore overrides `_compute_attention`, so the intermediates of "
            "DCMHA's own core are not computed.")):
        sub.compute_intermediates(x, x)


def test_direct_core_call_with_static_composition():
    """Without dynamic weights (static mixes only) a direct call composes like `call`."""
    rng = np.random.default_rng(8)
    x = f32(rng, 1, 4, 8)
    layer = DCMHA(num_heads=4, key_dim=2, query_wise=False, key_wise=False,
                  static_compose=True, seed=3)
    layer(x, x)
    parts = layer.compute_intermediates(x, x)
    o, scores = layer._compute_attention(parts["q"], parts["k"], parts["v"],
                                         return_attention_scores=True)
    np.testing.assert_allclose(np_(scores), np_(parts["attention_scores"]), **TOL)
