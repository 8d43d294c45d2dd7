"""dcmha.hub: DCFormer through keras-hub's contracts, from a release-layout directory.

Run in its own pytest process per backend (tools/test_all.py steps hub-jax,
hub-torch, hub-tensorflow): keras-hub imports TensorFlow, after which Triton
aborts a process.
"""

import os

import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")
pytest.importorskip("tokenizers")

import keras  # noqa: E402

from tests.checkpoints import checkpoint_dir_cases as cases  # noqa: E402
from dcmha.checkpoints import from_official_state_dict  # noqa: E402
from dcmha.hub import (DCFormerBackbone, DCFormerCausalLM,  # noqa: E402
                       DCFormerCausalLMPreprocessor, DCFormerTokenizer)

PROMPT = "the quick"
IDS = {"token_ids": np.array([[1, 5, 17, 40, 64, 9, 33]], "int32"),
       "padding_mask": np.ones((1, 7), "int32")}


def _np(x):
    return np.asarray(keras.ops.convert_to_numpy(x), np.float64)


@pytest.fixture(scope="module")
def state_dict():
    return cases.tiny_state_dict()


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory, state_dict):
    return cases.write_release_dir(tmp_path_factory.mktemp("release") / "bin", state_dict,
                                   format="bin", dtype="float32")


@pytest.fixture(scope="module")
def direct(state_dict):
    return from_official_state_dict(state_dict, cases.TINY_CONFIG)


def test_logits_equal_direct_conversion(tmp_path, state_dict, release_dir, direct):
    want = _np(direct(IDS["token_ids"]))
    sharded = cases.write_release_dir(tmp_path / "st", state_dict, format="safetensors",
                                      num_shards=2)
    for directory in (release_dir, sharded):
        lm = DCFormerCausalLM.from_preset(directory, sequence_length=12)
        assert isinstance(lm.backbone, DCFormerBackbone)
        assert isinstance(lm.preprocessor, DCFormerCausalLMPreprocessor)
        np.testing.assert_allclose(_np(lm(IDS)), want, rtol=1e-4,
                                   atol=1e-4 * np.abs(want).max())


def test_tokenizer_from_release_dir(release_dir):
    tok = DCFormerTokenizer.from_preset(release_dir)
    hf = cases.tiny_tokenizer()
    assert tok.vocabulary_size() == hf.get_vocab_size()
    assert (tok.start_token_id, tok.end_token_id) == (1, 2)
    np.testing.assert_array_equal(tok(PROMPT), hf.encode(PROMPT).ids)
    assert tok.detokenize(tok(PROMPT)) == hf.decode(hf.encode(PROMPT).ids)
    assert tok([PROMPT, "a dog"]) == [hf.encode(PROMPT).ids, hf.encode("a dog").ids]
    with pytest.raises(ValueError, match=r"`pad_token_id` must differ from `end_token_id`. "
                                         r"Received: pad_token_id=2, end_token_id=2"):
        DCFormerTokenizer(end_token_id=2, pad_token_id=2)


def test_greedy_generate_equals_dcformer_lm(release_dir, direct):
    lm = DCFormerCausalLM.from_preset(release_dir)
    lm.compile(sampler="greedy")
    x = lm.preprocessor.generate_preprocess([PROMPT, "a dog and the"], sequence_length=12)
    lm.preprocessor = None        # token ids in, token ids out
    out = lm.generate(x, stop_token_ids=None)
    mask = np.asarray(keras.ops.convert_to_numpy(x["padding_mask"]))
    ids = np.asarray(keras.ops.convert_to_numpy(x["token_ids"]))
    for row in range(2):
        n = int(mask[row].sum())
        want = direct.generate(ids[row:row + 1, :n], 12 - n)
        np.testing.assert_array_equal(out["token_ids"][row], want[0])


@pytest.mark.parametrize("sampler", ["greedy", "top_k", "top_p", "beam"])
def test_generate_strings_with_each_sampler(release_dir, sampler):
    lm = DCFormerCausalLM.from_preset(release_dir)
    lm.compile(sampler=sampler)
    one = lm.generate(PROMPT, max_length=10, stop_token_ids=None)
    batch = lm.generate([PROMPT, "a dog"], max_length=10, stop_token_ids=None)
    assert isinstance(one, str) and one.startswith(PROMPT) and len(one) > len(PROMPT)
    assert len(batch) == 2 and batch[0].startswith(PROMPT) and batch[1].startswith("a dog")
    if sampler == "greedy":
        assert one == batch[0]


def test_lora_fine_tunes_only_the_adapters(release_dir, tmp_path):
    lm = DCFormerCausalLM.from_preset(release_dir, sequence_length=16)
    lm.backbone.enable_lora(2)
    trainable = sorted(v.path for v in lm.trainable_variables)
    assert trainable == sorted(f"layers_{i}/attention/{p}/lora_kernel_{ab}" for i in range(2)
                               for p in ("query", "value") for ab in "ab")
    frozen = {v.path: _np(v) for v in lm.non_trainable_variables}
    before = {v.path: _np(v) for v in lm.trainable_variables}
    lm.compile(optimizer=keras.optimizers.Adam(1e-2), sampler="greedy")
    history = lm.fit(cases.CORPUS.split(". ")[:8], batch_size=4, epochs=2, verbose=0)
    losses = history.history["loss"]
    assert len(losses) == 2 and np.isfinite(losses).all() and losses[1] < losses[0]
    assert all(np.array_equal(_np(v), frozen[v.path]) for v in lm.non_trainable_variables)
    assert any(not np.array_equal(_np(v), before[v.path]) for v in lm.trainable_variables)
    # The adapters round-trip through keras-hub's LoRA file.
    lm.backbone.save_lora_weights(str(tmp_path / "a.lora.h5"))
    fresh = DCFormerCausalLM.from_preset(release_dir, sequence_length=16)
    fresh.backbone.load_lora_weights(str(tmp_path / "a.lora.h5"))
    np.testing.assert_allclose(_np(fresh(IDS)), _np(lm(IDS)), rtol=1e-5, atol=1e-5)


def test_int8_quantization(release_dir):
    lm = DCFormerCausalLM.from_preset(release_dir)
    want = _np(lm(IDS))
    lm.quantize("int8")
    int8 = {v.path for v in lm.weights if keras.backend.standardize_dtype(v.dtype) == "int8"}
    for i in range(2):
        for name in ("attention/query", "attention/key", "attention/value",
                     "attention/attention_output", "feed_forward/w1", "feed_forward/w2",
                     "feed_forward/w3"):
            assert f"layers_{i}/{name}/kernel" in int8
    got = _np(lm(IDS))
    # Per-channel abs-max int8 weights: a small error relative to the logits' scale.
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
    lm.compile(sampler="top_k")
    assert lm.generate(PROMPT, max_length=10).startswith(PROMPT)


def test_preset_round_trip(release_dir, tmp_path):
    lm = DCFormerCausalLM.from_preset(release_dir, sequence_length=12)
    lm.save_to_preset(str(tmp_path / "preset"))
    assert {"config.json", "model.weights.h5", "task.json", "preprocessor.json",
            "tokenizer.json"} <= set(os.listdir(tmp_path / "preset"))
    back = DCFormerCausalLM.from_preset(str(tmp_path / "preset"))
    np.testing.assert_array_equal(_np(back(IDS)), _np(lm(IDS)))
    assert back.preprocessor.sequence_length == 12
    assert back.backbone.get_config() == lm.backbone.get_config()
    tok = back.preprocessor.tokenizer
    np.testing.assert_array_equal(tok(PROMPT), lm.preprocessor.tokenizer(PROMPT))
    # The base classes find the DCFormer classes from the preset's config.
    assert isinstance(keras_hub.models.CausalLM.from_preset(str(tmp_path / "preset")),
                      DCFormerCausalLM)
    assert isinstance(keras_hub.models.Backbone.from_preset(str(tmp_path / "preset")),
                      DCFormerBackbone)


def test_readme_example(release_dir, tmp_path):
    """README's worked example, on a tiny directory: load, LoRA fine-tune on a text
    file, generate, export to ONNX."""
    pytest.importorskip("onnxruntime")
    import dcmha.export

    text_file = tmp_path / "train.txt"
    text_file.write_text(cases.CORPUS.replace(". ", ".\n"))

    causal_lm = DCFormerCausalLM.from_preset(release_dir, sequence_length=16)
    causal_lm.backbone.enable_lora(rank=4)
    causal_lm.compile(optimizer=keras.optimizers.Adam(1e-3), sampler="top_p")
    lines = [line for line in text_file.read_text().splitlines() if line.strip()]
    causal_lm.fit(lines, batch_size=4, epochs=1, verbose=0)
    text = causal_lm.generate("the quick", max_length=12)
    assert text.startswith("the quick")

    lm = causal_lm.backbone.to_dcformer_lm()          # LoRA merged into the kernels
    np.testing.assert_allclose(_np(lm(IDS["token_ids"])), _np(causal_lm(IDS)), rtol=1e-4,
                               atol=1e-4 * np.abs(_np(causal_lm(IDS))).max())
    dcmha.export.to_onnx(lm, str(tmp_path / "lm.onnx"))
    report = dcmha.export.verify(str(tmp_path / "lm.onnx"), lm, {"token_ids": IDS["token_ids"]})
    assert report["max_rel"] < 1e-5, report


def test_from_preset_takes_preprocessor_and_backbone(release_dir, tmp_path):
    """`preprocessor=` (None included) and `backbone=` replace the preset's, as on
    keras-hub's own tasks, for a release-layout directory and a keras-hub preset."""
    lm = DCFormerCausalLM.from_preset(release_dir, preprocessor=None)
    assert lm.preprocessor is None
    want = _np(lm(IDS))
    lm.save_to_preset(str(tmp_path / "preset"))
    for preset in (release_dir, str(tmp_path / "preset")):
        bare = DCFormerCausalLM.from_preset(preset, preprocessor=None)
        assert bare.preprocessor is None
        np.testing.assert_array_equal(_np(bare(IDS)), want)
        backbone = DCFormerBackbone.from_preset(release_dir, load_weights=False)
        mine = DCFormerCausalLM.from_preset(preset, backbone=backbone)
        assert mine.backbone is backbone
    preprocessor = DCFormerCausalLMPreprocessor.from_preset(release_dir, sequence_length=9)
    lm = DCFormerCausalLM.from_preset(release_dir, preprocessor=preprocessor)
    assert lm.preprocessor is preprocessor
    with pytest.raises(ValueError, match=r"\['query_chunk_size'\] override the preset's "
                                         r"backbone, which the given `backbone` replaces"):
        DCFormerCausalLM.from_preset(release_dir, backbone=backbone, query_chunk_size=4)


def test_backbone_takes_dcformer_lm_arguments():
    """The backbone takes DCFormerLM's arguments (placement included), round-trips them
    through its config, and `to_dcformer_lm` gives the same logits layer for layer."""
    import inspect

    from dcmha.models import DCFormerLM

    lm_params = list(inspect.signature(DCFormerLM).parameters)
    assert list(inspect.signature(DCFormerBackbone).parameters) == (
        lm_params[:-1] + ["dtype", "dcmha_options"])
    keras.utils.set_random_seed(5)
    backbone = DCFormerBackbone(vocab_size=128, num_layers=3, hidden_dim=16, num_heads=4,
                                dcmha_layers=[1], pre_compose=False, sliding_window=3, seed=1)
    config = backbone.get_config()
    assert config["dcmha_layers"] == [1] and config["pre_compose"] is False
    assert DCFormerBackbone.from_config(config).get_config() == config
    composing = [i for i, b in enumerate(backbone.transformer_layers)
                 if b.attention.get_config()["post_compose"]]
    assert composing == [1]
    for v in backbone.weights:       # composition weights away from their initial values
        if v.path.split("/")[-1] in ("dw1", "qkw", "dd"):
            v.assign(0.3 * np.random.default_rng(0).standard_normal(v.shape).astype(v.dtype))
    lm = DCFormerCausalLM(backbone)
    want = _np(lm(IDS))
    got = _np(backbone.to_dcformer_lm()(IDS["token_ids"]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match=r"`dcmha_layers` lists layers \[1\] more than once"):
        DCFormerBackbone(vocab_size=128, num_layers=3, hidden_dim=16, num_heads=4,
                         dcmha_layers=[1, 1])
