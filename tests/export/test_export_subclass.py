"""to_onnx on subclasses of DCMHA (any Keras backend): a subclass that keeps DCMHA's attention
core exports as DCMHA does; one that overrides ``_compute_attention`` is refused by name."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("onnxruntime")

from dcmha.export import core, to_onnx, verify  # noqa: E402
from dcmha.layers import DCMHA  # noqa: E402

B, T, D = 2, 5, 8
OPTIONS = dict(num_heads=4, key_dim=4, num_key_value_heads=2, rope_max_wavelength=100.0)


class Tagged(DCMHA):
    """A DCMHA with an extra attribute and nothing else changed."""

    tag = "tagged"


class CustomCore(DCMHA):
    """A DCMHA whose attention core is replaced (as MultiHeadAttention subclasses do)."""

    def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False, use_causal_mask=False):
        output, scores = super()._compute_attention(
            query, key, value, attention_mask=attention_mask, training=training,
            return_attention_scores=return_attention_scores, use_causal_mask=use_causal_mask)
        return 2.0 * output, scores


def _built(cls, seed, name):
    keras.utils.set_random_seed(seed)
    layer = cls(**OPTIONS, name=name)
    layer.build((None, None, D), (None, None, D))
    return layer


def _refusal(layer):
    cls = type(layer)
    return (f"DCMHA layer {layer.name!r} of class {cls.__module__}.{cls.__qualname__} overrides "
            "`_compute_attention`: the ONNX exporter writes DCMHA's own attention core and "
            "cannot see the override's")


def _run(path, x):
    return core.session(path).run(None, {"query": x})[0]


def test_a_subclass_keeping_the_core_exports_as_dcmha(tmp_path):
    base = _built(DCMHA, 0, "base")
    sub = _built(Tagged, 1, "sub")
    sub.set_weights(base.get_weights())
    x = np.random.default_rng(0).normal(size=(B, T, D)).astype("float32")
    base_model = to_onnx(base, tmp_path / "base.onnx", use_causal_mask=True)
    sub_model = to_onnx(sub, tmp_path / "sub.onnx", use_causal_mask=True)
    # the same graph: the same nodes in the same functions, the same weights
    assert sub_model.graph.node == base_model.graph.node
    assert sub_model.functions == base_model.functions
    np.testing.assert_array_equal(_run(tmp_path / "sub.onnx", x), _run(tmp_path / "base.onnx", x))
    assert verify(tmp_path / "sub.onnx", sub, x)["max_rel"] < 1e-5


def test_a_subclass_keeping_the_core_exports_in_a_model(tmp_path):
    inputs = keras.Input((None, D), name="x")
    layer = Tagged(**OPTIONS, name="tagged")
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    x = np.random.default_rng(1).normal(size=(B, T, D)).astype("float32")
    proto = to_onnx(model, tmp_path / "model.onnx")
    assert [f.name for f in proto.functions][0] == core.FUNCTION_NAME
    assert verify(tmp_path / "model.onnx", model, x)["max_rel"] < 1e-5


def test_a_subclass_overriding_the_core_is_refused(tmp_path):
    layer = _built(CustomCore, 2, "custom")
    path = tmp_path / "custom.onnx"
    with pytest.raises(ValueError) as err:
        to_onnx(layer, path)
    assert str(err.value) == _refusal(layer)
    assert not path.exists()


def test_a_subclass_overriding_the_core_is_refused_in_a_model(tmp_path):
    inputs = keras.Input((None, D), name="x")
    layer = CustomCore(**OPTIONS, name="custom")
    model = keras.Model(inputs, keras.layers.Dense(D, name="head")(
        layer(inputs, inputs, use_causal_mask=True)))
    path = tmp_path / "model.onnx"
    with pytest.raises(ValueError) as err:
        to_onnx(model, path)
    assert str(err.value) == f"{_refusal(layer)} (at custom)"
    assert not path.exists()
