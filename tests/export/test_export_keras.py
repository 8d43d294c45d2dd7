"""dcmha.export.to_onnx / verify / the CLI on Keras layers and models (any Keras backend)."""

import json
import os

import numpy as np
import onnx
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("onnxruntime")

from dcmha.export import core, to_onnx, verify  # noqa: E402
from dcmha.layers import DCMHA  # noqa: E402
from tests.export.export_cases import functional_lm, rich_layer  # noqa: E402

B, T, D = 2, 6, 8


def _x(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _built(layer, query_width=D, value_width=None):
    # build() rather than an eager call: on jax the first eager call compiles op by op
    layer.build((None, None, query_width), (None, None, value_width or query_width))
    return layer


@pytest.fixture(scope="module")
def rich():
    """One self-attention layer with every switch on, shared by the tests (layers are slow to build)."""
    keras.utils.set_random_seed(0)
    return rich_layer(D)


@pytest.fixture(scope="module")
def cross():
    keras.utils.set_random_seed(1)
    return _built(DCMHA(4, 4, cross_attention=True, num_key_value_heads=2, output_shape=5), D, 6)


def _io(model):
    return [i.name for i in model.graph.input], [o.name for o in model.graph.output]


def _session_outputs(path, feeds):
    sess = core.session(path)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def test_layer_forward_with_mask_and_scores(tmp_path, rich):
    x, layer = _x(B, T, D), rich
    path = tmp_path / "layer.onnx"
    model = to_onnx(layer, path, use_causal_mask=True, attention_mask=True,
                    return_attention_scores=True)
    assert _io(model) == (["query", "attention_mask"], ["output", "attention_scores"])
    assert [(f.domain, f.name) for f in model.functions][0] == ("dcmha", "DCMHA")
    # the rest: the kernel ops it uses (compose, query matrix, RoPE), each a function with a
    # plain-op body
    assert sorted(f.name for f in model.functions[1:]) == ["ComposeQKD", "QueryMatrixWDS", "Rope"]
    mask = np.random.default_rng(1).random((B, T, T)) > 0.3
    mask[1, 2] = False                                   # a fully masked row
    report = verify(path, layer, {"query": x, "attention_mask": mask})
    assert set(report["outputs"]) == {"output", "attention_scores"}
    assert report["max_rel"] < 1e-5
    out = _session_outputs(path, {"query": x, "attention_mask": mask})
    np.testing.assert_array_equal(out["attention_scores"][1, :, 2], 0.0)
    np.testing.assert_array_equal(out["output"][1, 2], keras.ops.convert_to_numpy(layer.output_bias))
    meta = json.loads({p.key: p.value for p in model.metadata_props}["dcmha.export"])
    assert meta["kind"] == "layer" and meta["use_causal_mask"] is True


def test_cross_attention_layer(tmp_path, cross):
    q, kv, layer = _x(B, T, D), _x(B, 4, 6, seed=1), cross
    path = tmp_path / "cross.onnx"
    model = to_onnx(layer, path)
    assert _io(model) == (["query", "value", "key"], ["output"])
    report = verify(path, layer, {"query": q, "value": kv, "key": kv})
    assert report["max_rel"] < 1e-5


def test_float16_layer(tmp_path, rich):
    x, layer = _x(B, T, D), rich
    path = tmp_path / "fp16.onnx"
    model = to_onnx(layer, path, dtype="float16", use_causal_mask=True, return_attention_scores=True)
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.output)}
    assert types == {"query": onnx.TensorProto.FLOAT16, "output": onnx.TensorProto.FLOAT16,
                     "attention_scores": onnx.TensorProto.FLOAT}
    report = verify(path, layer, x)
    assert report["outputs"]["output"]["max_rel"] < 5e-3


def test_layer_decode(tmp_path, rich):
    x, layer = _x(B, T, D), rich
    path = tmp_path / "decode.onnx"
    model = to_onnx(layer, path, decode=True)
    names = core.decode_names(layer.spec_config)
    assert _io(model) == (["query", "cache_update_index"] + ["past_" + n for n in names],
                          ["output"] + ["present_" + n for n in names])
    for steps in ([3, 1, 1, 1], [1] * T, [T]):
        assert verify(path, layer, x, decode_steps=steps)["max_rel"] < 1e-5
    assert verify(path, layer, x, cache_length=T + 3)["max_rel"] < 1e-5


@pytest.fixture(scope="module")
def lm():
    keras.utils.set_random_seed(2)
    return functional_lm()


def test_functional_model_forward_and_decode(tmp_path, lm):
    model = lm
    ids = np.random.default_rng(2).integers(0, 20, size=(B, T)).astype("int32")
    path = tmp_path / "lm.onnx"
    proto = to_onnx(model, path)
    assert _io(proto) == (["tokens"], ["output"])
    assert sorted(f.name for f in proto.functions if f.name not in core.KERNEL_OPS) == [
        "DCMHA", "DCMHA_2"]   # two configurations
    assert [n.name for n in proto.graph.node if n.domain == "dcmha"] == ["attention_0", "attention_1"]
    assert verify(path, model, ids)["max_rel"] < 1e-5
    dpath = tmp_path / "lm_decode.onnx"
    proto = to_onnx(model, dpath, decode=True)
    inputs, outputs = _io(proto)
    assert inputs[:3] == ["tokens", "cache_update_index", "past_key.attention_0"]
    assert "present_key_dd.attention_1" in outputs and outputs[0] == "output"
    assert verify(dpath, model, ids)["max_rel"] < 1e-5


def test_sequential_with_nested_functional(tmp_path):
    x = keras.Input((None, D))
    inner = keras.Model(x, DCMHA(4, 4, name="att")(x, x, use_causal_mask=True), name="block")
    model = keras.Sequential([keras.Input((None, D)), keras.layers.Dense(D, activation="silu"),
                              inner, keras.layers.LayerNormalization()], name="seq")
    path = tmp_path / "seq.onnx"
    proto = to_onnx(model, path)
    assert [n.name for n in proto.graph.node if n.domain == "dcmha"] == ["block/att"]
    assert verify(path, model, _x(B, T, D))["max_rel"] < 1e-5


def test_static_shapes(tmp_path, rich):
    x, layer = _x(1, T, D), rich
    proto = to_onnx(layer, tmp_path / "static.onnx", dynamic=False, input_shapes={"query": (1, T, D)})
    dims = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, T, D]
    assert verify(tmp_path / "static.onnx", layer, x)["max_rel"] < 1e-5


def test_unsupported_layer_names_class_and_place(tmp_path):
    x = keras.Input((None, D), name="x")
    h = keras.layers.Conv1D(D, 3, padding="causal", name="conv")(x)
    y = DCMHA(4, 4, name="att")(h, h)
    inner = keras.Model(x, y, name="inner")
    outer = keras.Sequential([keras.Input((None, D)), inner], name="outer")
    path = tmp_path / "bad.onnx"
    with pytest.raises(ValueError, match=r"cannot write layer 'conv' of class "
                                         r"keras\.src\.layers\.convolutional\.conv1d\.Conv1D: "
                                         r"no converter .* \(at inner/conv\)"):
        to_onnx(outer, path)
    assert os.listdir(tmp_path) == []                    # nothing written, no temp file


def test_decode_needs_causal_self_attention(tmp_path):
    x = keras.Input((None, D), name="x")
    model = keras.Model(x, DCMHA(4, 4, name="att")(x, x))
    with pytest.raises(ValueError, match=r"decode=True needs every DCMHA call to be causal "
                                         r"self-attention .* layer 'att' is called with "
                                         r"self_attention=True, use_causal_mask=False \(at att\)"):
        to_onnx(model, tmp_path / "d.onnx", decode=True)
    assert os.listdir(tmp_path) == []


def test_bad_arguments(tmp_path, rich, cross):
    layer = rich
    with pytest.raises(ValueError, match=r"`dtype` must be one of \['float16', 'float32'\]"):
        to_onnx(layer, tmp_path / "a.onnx", dtype="bfloat16")
    with pytest.raises(ValueError, match=r"`opset` must be an integer in \[18, \d+\]. Received: opset=11"):
        to_onnx(layer, tmp_path / "a.onnx", opset=11)
    with pytest.raises(ValueError, match="is not built yet"):
        to_onnx(DCMHA(4, 4), tmp_path / "a.onnx")
    with pytest.raises(ValueError, match=r"to_onnx exports a dcmha.DCMHA layer or a Keras model .* "
                                         r"Received: keras.src.layers.core.dense.Dense"):
        to_onnx(keras.layers.Dense(3), tmp_path / "a.onnx")
    with pytest.raises(ValueError, match="decode=True needs a self-attention layer"):
        to_onnx(cross, tmp_path / "a.onnx", decode=True)
    assert os.listdir(tmp_path) == []


def test_cli(tmp_path, capsys, lm):
    from dcmha.export.__main__ import main

    src = tmp_path / "lm.keras"
    lm.save(src)
    out = tmp_path / "lm.onnx"
    assert main([str(src), str(out), "--decode", "--length", "5"]) == 0
    text = capsys.readouterr().out
    assert "cache_update_index           int64    ()" in text
    assert "past_key.attention_0" in text and "present_value.attention_1" in text
    err = float(text.split("max rel error ")[1].split()[0])
    assert err < 1e-5
    assert main([str(src), str(tmp_path / "x.onnx"), "--opset", "5"]) == 1
    assert "nothing written" in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()


def test_dcformer_lm(tmp_path):
    models = pytest.importorskip("dcmha.models")
    keras.utils.set_random_seed(3)
    lm = models.DCFormerLM(vocab_size=32, num_layers=2, hidden_dim=D, num_heads=4, sliding_window=3,
                           window_pattern="LG", rope_max_wavelength=100.0)
    lm.build((None, None))
    ids = np.random.default_rng(4).integers(0, 32, size=(B, T)).astype("int32")
    proto = to_onnx(lm, tmp_path / "lm.onnx")            # a subclassed model, via as_functional()
    assert [n.name for n in proto.graph.node if n.domain == "dcmha"] == ["layers_0/attention",
                                                                         "layers_1/attention"]
    assert verify(tmp_path / "lm.onnx", lm, ids)["max_rel"] < 1e-5
    to_onnx(lm, tmp_path / "lm_decode.onnx", decode=True)
    assert verify(tmp_path / "lm_decode.onnx", lm, ids, decode_steps=[2, 1, 3])["max_rel"] < 1e-5
