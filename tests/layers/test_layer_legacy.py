"""Files saved by dcmha 0.1.0 still load, and compute what 0.1.0 computed.

dcmha 0.1.0 held the projection kernels as the DCMHA layer's own variables; they are
now MultiHeadAttention's EinsumDense sublayers. The fixtures in tests/fixtures/legacy
(made by make_legacy.py with the 0.1.0 code on jax) hold a functional model with two
DCMHA layers, a tiny DCFormerLM, and the outputs 0.1.0 computed for fixed inputs.
Runs on the Keras backend of the process.
"""

import zipfile
from pathlib import Path

import numpy as np
import pytest

import keras

import dcmha  # noqa: F401  (registers the classes, as a user's `import dcmha` does)

HERE = Path(__file__).resolve().parents[1] / "fixtures" / "legacy"
EXPECTED = np.load(HERE / "legacy_0_1_0.npz")
# Outputs computed on jax's CPU; float32 on another backend differs in rounding only.
TOL = dict(rtol=2e-5, atol=2e-5)


def _functional_inputs():
    return [EXPECTED["functional_x"], EXPECTED["functional_y"]]


def test_functional_model_of_0_1_0_loads(tmp_path):
    model = keras.saving.load_model(HERE / "functional_0_1_0.keras")
    got = model.predict(_functional_inputs(), verbose=0)
    np.testing.assert_allclose(got, EXPECTED["functional_out"], **TOL)
    layer = model.get_layer("self_attention")
    assert isinstance(layer, dcmha.DCMHA)
    assert layer.query_dense.kernel.path == "self_attention/query/kernel"
    # Saved before the composition weights' parametrisation: its variables are the weights.
    assert layer.composition_lr_scale == 1.0
    # Saved again, the file has the new layout and still computes the same.
    model.save(tmp_path / "again.keras")
    again = keras.saving.load_model(tmp_path / "again.keras")
    np.testing.assert_allclose(again.predict(_functional_inputs(), verbose=0),
                               EXPECTED["functional_out"], **TOL)


def test_weights_file_of_0_1_0_loads(tmp_path):
    """``load_weights`` of a 0.1.0 ``.weights.h5`` (the weights inside the .keras file)."""
    with zipfile.ZipFile(HERE / "functional_0_1_0.keras") as archive:
        (tmp_path / "legacy.weights.h5").write_bytes(archive.read("model.weights.h5"))
    model = keras.saving.load_model(HERE / "functional_0_1_0.keras")
    fresh = keras.Model.from_config(model.get_config())
    before = fresh.predict(_functional_inputs(), verbose=0)
    assert np.abs(before - EXPECTED["functional_out"]).max() > 1e-3   # other random weights
    fresh.load_weights(tmp_path / "legacy.weights.h5")
    np.testing.assert_allclose(fresh.predict(_functional_inputs(), verbose=0),
                               EXPECTED["functional_out"], **TOL)


def test_dcformer_lm_of_0_1_0_loads():
    lm = keras.saving.load_model(HERE / "dcformer_lm_0_1_0.keras")
    assert [b.attention.composition_lr_scale for b in lm.blocks] == [1.0] * len(lm.blocks)
    np.testing.assert_allclose(lm.predict(EXPECTED["lm_tokens"], verbose=0), EXPECTED["lm_logits"],
                               **TOL)


def test_a_wrong_weights_file_still_fails():
    """The 0.1.0 reader takes only the 0.1.0 layout: other counts fail as Keras fails them."""
    layer = dcmha.DCMHA(num_heads=2, key_dim=2, name="att")
    layer.build((1, 2, 4), (1, 2, 4))
    with pytest.raises(ValueError, match="expected 0 variables, but received 3 variables"):
        layer.load_own_variables({str(i): np.zeros((4, 2, 2), "float32") for i in range(3)})
