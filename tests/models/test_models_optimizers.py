"""dcmha.optimizers: a smaller learning rate for DCMHA's composition weights."""

import numpy as np
import pytest

import keras

from dcmha.models import DCFormerLM
from dcmha.optimizers import (COMPOSITION_WEIGHTS, composition_scaled_class,
                              with_composition_learning_rate)

pytestmark = pytest.mark.skipif(keras.backend.backend() == "numpy",
                                reason="training needs gradients")


def _model():
    return DCFormerLM(vocab_size=32, num_layers=1, hidden_dim=16, num_heads=2, seed=0)


def _first_step_moves(optimizer):
    """{variable path: largest change} after one training step from a seeded start."""
    keras.utils.set_random_seed(0)            # the embedding's initializer: the same start
    model = _model()
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).integers(0, 32, size=(4, 8))
    model.build((None, None))
    before = {v.path: keras.ops.convert_to_numpy(v) for v in model.trainable_variables}
    model.train_on_batch(x, x)
    # Paths without the model's (uniquified) name.
    return {v.path.split("/", 1)[1]:
            float(np.abs(keras.ops.convert_to_numpy(v) - before[v.path]).max())
            for v in model.trainable_variables}


def test_scale_reaches_only_the_composition_weights():
    plain = _first_step_moves(with_composition_learning_rate(keras.optimizers.Adam(1e-2), 1.0))
    scaled = _first_step_moves(with_composition_learning_rate(keras.optimizers.Adam(1e-2), 0.25))
    assert plain.keys() == scaled.keys()
    composition = [p for p in plain if p.split("/")[-1] in COMPOSITION_WEIGHTS]
    assert len(composition) == 3
    # Adam's first step is the learning rate times the gradient's sign (up to epsilon), so
    # the same start and batch give each composition weight a quarter of the plain step
    # and every other weight the same step.
    # (The embedding is left out: TensorFlow steps it through sparse updates whose size
    # depends on the order repeated tokens are applied in.)
    for path in (p for p in plain if not p.startswith("tok_embeddings")):
        expected = 0.25 if path in composition else 1.0
        np.testing.assert_allclose(scaled[path] / plain[path], expected, rtol=1e-3,
                                   err_msg=path)


def test_config_round_trip_and_registration():
    schedule = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=10)
    base = keras.optimizers.AdamW(schedule, weight_decay=0.05, global_clipnorm=1.0)
    scaled = with_composition_learning_rate(base, scale=0.2)
    assert isinstance(scaled, keras.optimizers.AdamW)
    assert type(scaled).__name__ == "CompositionScaledAdamW"
    assert scaled.composition_lr_scale == 0.2 and scaled.weight_decay == 0.05
    again = keras.optimizers.deserialize(keras.optimizers.serialize(scaled))
    assert type(again) is type(scaled) and again.composition_lr_scale == 0.2
    # Scaling a scaled optimizer replaces its scale; one class per base class.
    assert type(with_composition_learning_rate(scaled, 0.5)) is type(scaled)
    assert composition_scaled_class(type(base)) is type(scaled)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"`composition_lr_scale` must be a positive number\. "
                                         r"Received: composition_lr_scale=0"):
        with_composition_learning_rate("adam", scale=0)
    with pytest.raises(TypeError, match=r"`optimizer` must be a keras\.optimizers\.Optimizer "
                                        r"or its name\. Received: optimizer=int"):
        with_composition_learning_rate(3)
