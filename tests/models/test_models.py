"""DCFormerLM: forward against a NumPy reference, configuration, presets, saving, generation.

Runs on every Keras backend (one process each); training-only checks skip on numpy.
"""

import dataclasses

import numpy as np
import pytest

import keras
from keras import ops

from dcmha.models import (PRESETS, DCFormerBlock, DCFormerLM, RMSNorm, SwiGLU,
                          count_parameters, default_intermediate_dim,
                          official_intermediate_size)
from dcmha.spec import reference

BACKEND = keras.backend.backend()
CONFIG_FIELDS = {f.name for f in dataclasses.fields(reference.Config)}

TINY = dict(vocab_size=37, num_layers=3, hidden_dim=32, num_heads=4, intermediate_dim=48,
            sliding_window=3, window_pattern="LG", rope_max_wavelength=10000)


def np_(x):
    return np.asarray(ops.convert_to_numpy(x), dtype=np.float64)


def rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def reference_logits(model, ids):
    """Independent float64 forward of a DCFormerLM from its weights (reference.attention)."""
    x = np_(model.tok_embeddings.embeddings)[ids]
    for block in model.blocks:
        # The configuration the model means to give the layer (not read back from it).
        opts = {k: v for k, v in block.attention_options.items() if k in CONFIG_FIELDS}
        cfg = reference.Config(num_heads=block.num_heads,
                               key_dim=block.key_dim or model.hidden_dim // block.num_heads,
                               **opts)
        h = rms(x, np_(block.attention_norm.scale), block.norm_eps)
        x = x + reference.attention(block.attention.spec_weights(), cfg, h, use_causal_mask=True)
        h = rms(x, np_(block.ffn_norm.scale), block.norm_eps)
        ff = block.feed_forward
        g = h @ np_(ff.w1.kernel)
        x = x + (g / (1 + np.exp(-g)) * (h @ np_(ff.w3.kernel))) @ np_(ff.w2.kernel)
    x = rms(x, np_(model.norm.scale), model.norm_eps)
    if model.output_projection is None:
        return x @ np_(model.tok_embeddings.embeddings).T
    return x @ np_(model.output_projection.kernel)


def perturb(model, seed=0, scale=0.3):
    """Push every composition weight away from its near-identity initialisation
    (and norms away from 1) so that a wrong composition or norm shows up. Builds an
    unbuilt model first (it has no weights before)."""
    if not model.built:
        model.build((None, None))
    rng = np.random.default_rng(seed)
    perturbed = 0
    for v in model.weights:
        name = v.path.split("/")[-1]
        if name in ("dw1", "qkw", "dd") or "scale" in name:
            base = 1.0 if "scale" in name else 0.0
            v.assign((base + scale * rng.standard_normal(v.shape)).astype(v.dtype))
            perturbed += 1
    assert perturbed or model.attention == "mha", "perturb changed no weight"
    return model


def tokens(shape, vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype("int32")


# ---------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------

def test_rmsnorm_is_keras_layer_with_official_formula():
    layer = RMSNorm(epsilon=1e-5)
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype("float32")
    layer.build(x.shape)
    layer.scale.assign(np.linspace(0.5, 1.5, 8).astype("float32"))
    np.testing.assert_allclose(np_(layer(x)), rms(x.astype(np.float64), np.linspace(0.5, 1.5, 8),
                                                   1e-5), rtol=1e-5, atol=1e-6)


def test_swiglu_formula():
    layer = SwiGLU(6)
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype("float32")
    y = np_(layer(x))
    xd = x.astype(np.float64)
    g = xd @ np_(layer.w1.kernel)
    expected = (g / (1 + np.exp(-g)) * (xd @ np_(layer.w3.kernel))) @ np_(layer.w2.kernel)
    assert y.shape == (2, 3, 4) and layer.w1.kernel.shape == (4, 6)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_intermediate_dim_rules():
    assert official_intermediate_size(2560) == 6912
    assert official_intermediate_size(1024) == 2816
    assert default_intermediate_dim(1024) == 2816
    assert default_intermediate_dim(128) == 352     # multiple of 32 below D = 512
    assert default_intermediate_dim(64) == 192


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("options", [
    dict(),
    dict(attention="mha"),
    dict(num_key_value_heads=2, num_groups=2, qk_norm=True, tie_embeddings=True),
    dict(window_pattern="LGLL", num_layers=4, rank=1, gelu_approximate=False, seed=3),
    dict(dcmha_layers=2),
    dict(dcmha_layers=[0], pre_compose=False, qk_norm=True),
], ids=["dcmha", "mha", "gqa-groups-qknorm-tied", "lgll-rank1-erf-seeded", "every-2nd",
        "layer0-post-only"])
def test_logits_match_numpy_reference(options):
    model = perturb(DCFormerLM(**{**TINY, **options}))
    ids = tokens((2, 7), TINY["vocab_size"])
    got = np_(model(ids))
    want = reference_logits(model, ids)
    assert got.shape == (2, 7, TINY["vocab_size"])
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_causal():
    model = perturb(DCFormerLM(**TINY))
    ids = tokens((2, 7), TINY["vocab_size"])
    other = ids.copy()
    other[:, 5:] = (other[:, 5:] + 1) % TINY["vocab_size"]
    a, b = np_(model(ids)), np_(model(other))
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    assert np.abs(a[:, 5:] - b[:, 5:]).max() > 1e-4


def test_window_pattern():
    kw = dict(TINY, num_layers=6)
    assert DCFormerLM(**kw).layer_sliding_windows() == [3, None, 3, None, 3, None]
    assert DCFormerLM(**dict(kw, window_pattern="LGLL")).layer_sliding_windows() == [
        3, None, 3, 3, 3, None]
    assert DCFormerLM(**dict(kw, window_pattern="GGGL")).layer_sliding_windows() == [
        None, None, None, 3, None, None]
    assert DCFormerLM(**dict(kw, sliding_window=None)).layer_sliding_windows() == [None] * 6


def test_seeded_layers_differ():
    model = DCFormerLM(**TINY, seed=5, kernel_initializer=keras.initializers.GlorotUniform(1))
    model.build((None, None))
    a, b = model.blocks[0], model.blocks[1]
    assert model.blocks[1].attention.seed == 1005
    assert not np.allclose(np_(a.attention.query_kernel), np_(b.attention.query_kernel))
    assert not np.allclose(np_(a.feed_forward.w1.kernel), np_(b.feed_forward.w1.kernel))
    assert not np.allclose(np_(a.feed_forward.w1.kernel), np_(a.feed_forward.w3.kernel))
    again = DCFormerLM(**TINY, seed=5, kernel_initializer=keras.initializers.GlorotUniform(1))
    again.build((None, None))
    np.testing.assert_array_equal(np_(again.blocks[1].attention.query_kernel),
                                  np_(b.attention.query_kernel))
    np.testing.assert_array_equal(np_(again.blocks[1].feed_forward.w2.kernel),
                                  np_(b.feed_forward.w2.kernel))


def test_seeded_variants_share_initial_weights():
    # What the demo and the ablation rely on: variants differ only by composition.
    weights = {}
    for name, options in (("dcmha", {}), ("mha", dict(attention="mha")),
                          ("rank1", dict(rank=1, static_compose=True))):
        keras.utils.set_random_seed(3)                      # the embedding's initializer
        m = DCFormerLM(**TINY, **options, seed=3,
                       kernel_initializer=keras.initializers.GlorotUniform(3))
        m.build((None, None))
        weights[name] = {v.path.split("/", 1)[1]: np_(v) for v in m.weights}
    shared = set(weights["dcmha"]) & set(weights["mha"]) & set(weights["rank1"])
    assert shared == set(weights["mha"])
    for path in shared:
        np.testing.assert_array_equal(weights["dcmha"][path], weights["mha"][path], err_msg=path)
        np.testing.assert_array_equal(weights["rank1"][path], weights["mha"][path], err_msg=path)


def test_mha_has_no_composition_weights():
    model = DCFormerLM(**TINY, attention="mha")
    model.build((None, None))
    names = {v.path.split("/")[-1] for v in model.weights}
    assert not names & {"dw1", "qkw", "dd"}
    dc = DCFormerLM(**TINY)
    dc.build((None, None))
    assert {"dw1", "qkw", "dd"} <= {v.path.split("/")[-1] for v in dc.weights}
    assert all(b.attention_options["pre_compose"] is False for b in model.blocks)


@pytest.mark.parametrize("options", [
    dict(), dict(attention="mha"), dict(tie_embeddings=True, qk_norm=True),
    dict(num_key_value_heads=2, num_groups=2, rank=1, dynamic_hidden_dim=5),
    dict(static_compose=True, dynamic_projection=False, dynamic_gating=False),
    dict(pre_compose=False, query_wise=False), dict(intermediate_dim=None, head_dim=12),
    dict(dcmha_layers=2), dict(dcmha_layers=[0, 2], pre_compose=False, static_compose=True)])
def test_count_parameters_matches_built_model(options):
    model = DCFormerLM(**{**TINY, **options})
    model.build((None, None))
    assert model.count_params() == count_parameters(**{**TINY, **options})


def test_presets():
    # The figures documented in DCFormerLM.from_preset.
    assert count_parameters(**PRESETS["dcformer_tiny"]) == 967_808
    assert count_parameters(**PRESETS["dcformer_405m"]) == 419_873_792
    assert count_parameters(**PRESETS["dcformer_405m"], attention="mha") == 411_616_256
    assert count_parameters(**PRESETS["dcformer_2.8b"]) == 2_850_463_232
    assert count_parameters(**PRESETS["dcformer_2.8b"], attention="mha") == 2_795_937_280
    model = DCFormerLM.from_preset("dcformer_tiny", num_layers=2, attention="mha")
    assert model.num_layers == 2 and model.attention == "mha"
    model.build((None, None))
    assert model.count_params() == count_parameters(**{**PRESETS["dcformer_tiny"],
                                                       "num_layers": 2, "attention": "mha"})
    with pytest.raises(ValueError, match=r"Unknown preset 'nope'\. Available: \['dcformer_2.8b'"):
        DCFormerLM.from_preset("nope")


@pytest.mark.parametrize("name,base", [("dcformer_post_tiny", "dcformer_tiny"),
                                       ("dcformer_post_405m", "dcformer_405m")])
def test_post_only_presets(name, base):
    """The post-only presets are their base preset with the scores' composition off."""
    assert PRESETS[name] == {**PRESETS[base], "pre_compose": False, "post_compose": True}
    # What DCMHA adds is halved: two of the four dynamic-weight slots.
    added = (count_parameters(**PRESETS[base])
             - count_parameters(**PRESETS[base], attention="mha"))
    assert (count_parameters(**PRESETS[name])
            - count_parameters(**PRESETS[base], attention="mha")) * 2 == added
    if name == "dcformer_post_tiny":
        model = DCFormerLM.from_preset(name, num_layers=2)
        model.build((None, None))
        assert model.count_params() == count_parameters(**{**PRESETS[name], "num_layers": 2})
        config = model.blocks[0].attention.get_config()
        assert (config["pre_compose"], config["post_compose"]) == (False, True)
        dw1 = [v for v in model.blocks[0].attention.weights if v.path.endswith("/dw1")]
        assert [tuple(v.shape)[2] for v in dw1] == [2]        # C = 2 slots


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_heads=0), "`num_heads` must be a positive integer. Received: num_heads=0"),
    (dict(window_pattern="LX"), "`window_pattern` must be a non-empty string of 'L' (local) and "
                                "'G' (global). Received: window_pattern='LX'"),
    (dict(attention="linear"), "`attention` must be 'dcmha' or 'mha'. Received: "
                               "attention='linear'"),
    (dict(hidden_dim=30), "`hidden_dim` must be divisible by `num_heads` when `head_dim` is None. "
                          "Received: hidden_dim=30, num_heads=4"),
    (dict(sliding_window=0), "`sliding_window` must be None or a positive integer. Received: "
                             "sliding_window=0"),
    (dict(attention="mha", pre_compose=True), "attention='mha' switches composition off; it "
                                              "cannot be combined with ['pre_compose']=True."),
    (dict(key_dim=8), "['key_dim'] are set by DCFormerLM itself"),
    (dict(ranks=2), "Unknown DCFormerLM arguments: ['ranks']"),
])
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError) as e:
        DCFormerLM(**{**TINY, **kwargs})
    assert message in str(e.value)


def test_block_call_shapes():
    block = DCFormerBlock(4, intermediate_dim=48, attention_options=dict(rope_max_wavelength=100))
    x = np.random.default_rng(0).standard_normal((2, 7, 32)).astype("float32")
    assert tuple(block(x).shape) == (2, 7, 32)
    assert block.attention.key_dim == 8 and block.feed_forward.w2.kernel.shape == (48, 32)
    with pytest.raises(ValueError, match=r"`attention_options` may not set \['key_dim'\]"):
        DCFormerBlock(4, attention_options=dict(key_dim=3))


# ---------------------------------------------------------------------------
# Placement: DCMHA in some layers only
# ---------------------------------------------------------------------------

def built(model):
    model.build((None, None))
    return model


def composing_layers(model):
    """The indices of the blocks whose attention layer has composition weights."""
    return [i for i, b in enumerate(model.blocks)
            if {v.path.split("/")[-1] for v in b.attention.weights} & {"dw1", "qkw", "dd"}]


@pytest.mark.parametrize("dcmha_layers,num_layers,expected", [
    (None, 4, [0, 1, 2, 3]), ("all", 4, [0, 1, 2, 3]), (1, 4, [0, 1, 2, 3]), (2, 4, [1, 3]),
    (4, 8, [3, 7]), (3, 4, [2]), ([2, 0], 4, [0, 2]), ((3,), 4, [3]), (np.int64(2), 4, [1, 3])])
def test_dcmha_layers_places_dcmha(dcmha_layers, num_layers, expected):
    model = built(DCFormerLM(**dict(TINY, num_layers=num_layers), dcmha_layers=dcmha_layers))
    assert composing_layers(model) == expected
    for i, block in enumerate(model.blocks):
        config = block.attention.get_config()
        assert (config["pre_compose"], config["post_compose"]) == ((i in expected,) * 2)


def _copy_block(source, target):
    for s, t in zip(source.weights, target.weights):
        assert s.path.split("/", 1)[1] == t.path.split("/", 1)[1]
        t.assign(s)


def test_mixed_layers_equal_mha_and_dcmha_models_layers():
    """Given the same weights, a mixed model's plain layers compute what an
    attention="mha" model's layers compute, and its DCMHA layers what an all-DCMHA
    model's layers compute; the whole mixed model is then their composition."""
    kw = dict(TINY, num_layers=4, seed=2)
    mixed = built(DCFormerLM(**kw, dcmha_layers=[0, 3]))
    mha = built(DCFormerLM(**kw, attention="mha"))
    dcmha = perturb(built(DCFormerLM(**kw)), seed=4)
    ids = tokens((2, 6), TINY["vocab_size"], seed=1)
    for i, block in enumerate(mixed.blocks):
        source = (dcmha if i in (0, 3) else mha).blocks[i]
        _copy_block(source, block)
        cfg, want = block.attention.get_config(), source.attention.get_config()
        assert {k: v for k, v in cfg.items() if k != "name"} == {
            k: v for k, v in want.items() if k != "name"}
        x = np.random.default_rng(i).standard_normal((2, 6, TINY["hidden_dim"]))
        x = x.astype("float32")
        got, expected = np_(block(x)), np_(source(x))
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
    # The mixed model against the float64 reference of its own layers.
    want = reference_logits(mixed, ids)
    np.testing.assert_allclose(np_(mixed(ids)), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(dcmha_layers=0), ValueError,
     "`dcmha_layers` must be None, 'all', a positive integer k (every k-th layer) or a list of "
     "layer indices. Received: dcmha_layers=0"),
    (dict(dcmha_layers=-2), ValueError,
     "`dcmha_layers` must be None, 'all', a positive integer k (every k-th layer) or a list of "
     "layer indices. Received: dcmha_layers=-2"),
    (dict(dcmha_layers=4), ValueError,
     "`dcmha_layers`=4 (every 4-th layer) places DCMHA in none of the 3 layers; use "
     "attention='mha' for none. Received: dcmha_layers=4, num_layers=3"),
    (dict(dcmha_layers="some"), ValueError,
     "`dcmha_layers` must be None, 'all', a positive integer k (every k-th layer) or a list of "
     "layer indices. Received: dcmha_layers='some'"),
    (dict(dcmha_layers=2.0), TypeError,
     "`dcmha_layers` must be None, 'all', a positive integer k (every k-th layer) or a list of "
     "layer indices. Received: dcmha_layers=2.0 of type float"),
    (dict(dcmha_layers=True), TypeError,
     "`dcmha_layers` must be None, 'all', a positive integer k (every k-th layer) or a list of "
     "layer indices. Received: dcmha_layers=True of type bool"),
    (dict(dcmha_layers=[0, "1"]), TypeError,
     "`dcmha_layers` must list layer indices (integers). Received: dcmha_layers=[0, '1']"),
    (dict(dcmha_layers=[0, 3]), ValueError,
     "`dcmha_layers` must be layer indices in [0, 3) (num_layers=3). Received: "
     "dcmha_layers=[0, 3]"),
    (dict(dcmha_layers=[-1]), ValueError,
     "`dcmha_layers` must be layer indices in [0, 3) (num_layers=3). Received: "
     "dcmha_layers=[-1]"),
    (dict(dcmha_layers=[2, 0, 2]), ValueError,
     "`dcmha_layers` lists layers [2] more than once. Received: dcmha_layers=[2, 0, 2]"),
    (dict(dcmha_layers=[]), ValueError,
     "`dcmha_layers` lists no layer; use attention='mha' for none. Received: dcmha_layers=[]"),
    (dict(dcmha_layers=2, attention="mha"), ValueError,
     "attention='mha' switches composition off in every layer; it cannot be combined with "
     "`dcmha_layers`. Received: dcmha_layers=2"),
], ids=["k=0", "k<0", "k>layers", "string", "float", "bool", "item-type", "out-of-range",
        "negative", "duplicate", "empty", "with-mha"])
def test_invalid_dcmha_layers(kwargs, error, message):
    with pytest.raises(error) as e:
        DCFormerLM(**{**TINY, **kwargs})
    assert str(e.value) == message
    with pytest.raises(error) as e:
        count_parameters(**{**TINY, **kwargs})
    assert str(e.value) == message


def test_dcmha_layers_config_and_keras_file_round_trip(tmp_path):
    for placement in (2, [2, 0], "all"):
        model = DCFormerLM(**TINY, dcmha_layers=placement)
        config = model.get_config()
        clone = DCFormerLM.from_config(config)
        assert clone.get_config() == config
        assert composing_layers(built(clone)) == composing_layers(built(model))
    assert config["dcmha_layers"] == "all"
    assert DCFormerLM(**TINY, dcmha_layers=(2, 0)).get_config()["dcmha_layers"] == [0, 2]
    model = perturb(built(DCFormerLM(**TINY, dcmha_layers=[1], pre_compose=False)))
    ids = tokens((2, 6), TINY["vocab_size"])
    want = np_(model(ids))
    model.save(str(tmp_path / "mixed.keras"))
    loaded = keras.saving.load_model(str(tmp_path / "mixed.keras"))
    assert loaded.dcmha_layers == [1] and composing_layers(loaded) == [1]
    np.testing.assert_allclose(np_(loaded(ids)), want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Serialization
# ---------------------------------------------------------------------------

def test_config_round_trip():
    model = DCFormerLM(**TINY, qk_norm=True, rank=1, name="lm")
    config = model.get_config()
    clone = DCFormerLM.from_config(config)
    assert clone.get_config() == config
    assert config["rank"] == 1 and config["qk_norm"] is True and config["name"] == "lm"


def test_keras_file_save_load(tmp_path):
    model = perturb(DCFormerLM(**TINY, tie_embeddings=True, qk_norm=True))
    ids = tokens((2, 6), TINY["vocab_size"])
    want = np_(model(ids))
    path = str(tmp_path / "lm.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, DCFormerLM)
    np.testing.assert_allclose(np_(loaded(ids)), want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Generation with a cache
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("options", [dict(), dict(num_key_value_heads=2, qk_norm=True,
                                                  attention="mha"),
                                     dict(dcmha_layers=[1], num_key_value_heads=2)],
                         ids=["dcmha", "mha-gqa", "mixed-gqa"])
def test_cached_logits_match_full_forward(options):
    model = perturb(DCFormerLM(**{**TINY, **options}))
    ids = tokens((2, 7), TINY["vocab_size"], seed=3)
    full = np_(model(ids))
    cache = model.init_cache(2, 7)
    logits, cache = model.call_with_cache(ids[:, :3], cache, 0)       # prefill
    steps = [np_(logits)]
    for t in range(3, 7):     # one token at a time; the index as a tensor (fixed shapes)
        logits, cache = model.call_with_cache(ids[:, t:t + 1], cache,
                                              ops.convert_to_tensor(np.int32(t)))
        steps.append(np_(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-4,
                               atol=1e-4 * np.abs(full).max())


@pytest.fixture(scope="module")
def gen_model():
    return perturb(DCFormerLM(**TINY), scale=0.5)


def test_greedy_generation_equals_argmax_of_full_forward(gen_model):
    prompt = tokens((2, 3), TINY["vocab_size"], seed=5)
    out = gen_model.generate(prompt, max_new_tokens=4)
    assert out.shape == (2, 7) and out.dtype == np.int32
    np.testing.assert_array_equal(out[:, :3], prompt)
    full = np_(gen_model(out))
    np.testing.assert_array_equal(out[:, 3:], full[:, 2:-1].argmax(-1))


def test_sampling_is_seeded(gen_model):
    prompt = tokens((2, 3), TINY["vocab_size"])
    a = gen_model.generate(prompt, 4, temperature=1.0, seed=7)
    b = gen_model.generate(prompt, 4, temperature=1.0, seed=7)
    assert a.shape == (2, 7)
    np.testing.assert_array_equal(a, b)
    assert ((a >= 0) & (a < TINY["vocab_size"])).all()
    np.testing.assert_array_equal(gen_model.generate(prompt, 0), prompt)
    with pytest.raises(ValueError, match=r"`temperature` must be a finite number >= 0. Received: temperature=-1"):
        gen_model.generate(prompt, 2, temperature=-1)
    with pytest.raises(ValueError, match=r"`token_ids` must be an integer array of shape \(B, T\)"):
        gen_model.generate(np.zeros((2,), "int32"), 2)
    with pytest.raises(ValueError, match=r"`max_new_tokens` must be a non-negative integer"):
        gen_model.generate(prompt, -1)


def test_greedy_generation_with_mixed_layers():
    model = perturb(built(DCFormerLM(**TINY, dcmha_layers=2)), scale=0.5)
    prompt = tokens((2, 3), TINY["vocab_size"], seed=6)
    out = model.generate(prompt, max_new_tokens=4)
    np.testing.assert_array_equal(out[:, :3], prompt)
    np.testing.assert_array_equal(out[:, 3:], np_(model(out))[:, 2:-1].argmax(-1))


def test_as_functional_shares_weights(gen_model):
    functional = gen_model.as_functional()
    ids = tokens((2, 7), TINY["vocab_size"])
    np.testing.assert_allclose(np_(functional(ids)), np_(gen_model(ids)), rtol=1e-5, atol=1e-5)
    assert functional.count_params() == gen_model.count_params()


def test_mixed_layers_as_functional_and_onnx(tmp_path):
    """A model with DCMHA in some layers: its functional twin shares its weights and
    outputs, and (on jax) `dcmha.export.to_onnx` exports it exactly."""
    model = perturb(built(DCFormerLM(**TINY, dcmha_layers=[1])), scale=0.5)
    ids = tokens((2, 7), TINY["vocab_size"], seed=2)
    functional = model.as_functional()
    np.testing.assert_allclose(np_(functional(ids)), np_(model(ids)), rtol=1e-5, atol=1e-5)
    assert functional.count_params() == model.count_params()
    if BACKEND != "jax":
        return              # the export runs in tests/export/test_export_keras.py per backend
    pytest.importorskip("onnxruntime")
    from dcmha.export import to_onnx, verify
    to_onnx(model, tmp_path / "mixed.onnx")
    assert verify(tmp_path / "mixed.onnx", model, ids)["max_rel"] < 1e-5


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------

@pytest.mark.skipif(BACKEND == "numpy", reason="the numpy backend cannot train")
def test_fit_reduces_loss():
    keras.utils.set_random_seed(0)
    model = DCFormerLM(**TINY)
    # XLA compilation costs TensorFlow more time than these few steps take.
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False if BACKEND == "tensorflow" else "auto")
    ids = np.tile(np.arange(8, dtype="int32") % 5, (2, 1))            # a learnable pattern
    first = model.evaluate(ids[:, :-1], ids[:, 1:], verbose=0)
    model.fit(ids[:, :-1], ids[:, 1:], epochs=10, batch_size=2, verbose=0)
    assert model.evaluate(ids[:, :-1], ids[:, 1:], verbose=0) < 0.5 * first
