"""dcmha.optimizers: a smaller learning rate for DCMHA's composition weights."""

import numpy as np
import pytest

import keras

from dcmha.models import DCFormerLM
from dcmha.optimizers import (COMPOSITION_WEIGHTS, composition_scaled_class,
                              with_composition_learning_rate)

pytestmark = pytest.mark.skipif(keras.backend.backend() == "numpy",
                                reason="training needs gradients")


def _model(composition_lr_scale=1.0):
    return DCFormerLM(vocab_size=32, num_layers=1, hidden_dim=16, num_heads=2, seed=0,
                      composition_lr_scale=composition_lr_scale)


def _first_step_moves(optimizer):
    """{variable path: largest change} after one training step from a seeded start (the
    layers' variables are their weights: ``composition_lr_scale=1.0``)."""
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


def _weights(model):
    """{name: NumPy array} of every weight as the math uses it: the attention layers'
    ``spec_weights()`` (composition weights times the layer's scale), the rest as stored."""
    out = {}
    for i, block in enumerate(model.blocks):
        out.update({f"{i}/{n}": w for n, w in block.attention.spec_weights().items()})
    attention = {id(v) for b in model.blocks for v in b.attention.weights}
    out.update({v.path.split("/", 1)[1]: keras.ops.convert_to_numpy(v)
                for v in model.trainable_variables if id(v) not in attention})
    return out


def _train(model, optimizer, steps=3):
    keras.utils.set_random_seed(0)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    for _ in range(steps):
        x = rng.integers(0, 32, size=(4, 8))
        model.train_on_batch(x, x)
    return _weights(model)


def test_default_parametrisation_trains_as_the_wrapper():
    """A model with the default ``composition_lr_scale=0.1`` and a plain AdamW takes the
    steps of the same model with its variables as its weights (1.0) and AdamW wrapped by
    ``with_composition_learning_rate(..., 0.1)``: same start, same weights after 3 steps.

    Adam's epsilon is set far below every gradient: the parametrisation divides the
    composition gradients by 10, which makes the default epsilon act 10x larger on them
    (the one difference, besides global-norm clipping, which sees those gradients scaled).
    """
    def adamw():
        return keras.optimizers.AdamW(1e-2, weight_decay=0.05, epsilon=1e-12)

    def built(scale):
        keras.utils.set_random_seed(0)        # unseeded initializers: the same draws
        model = _model(scale)
        model.build((None, None))
        return model

    default, plain = built(0.1), built(1.0)
    start = _weights(plain)
    # The same start, up to rounding: the normal draw times stddev / 0.1, then times 0.1,
    # against the draw times stddev (three float32 roundings).
    for n, w in _weights(default).items():
        np.testing.assert_allclose(w, start[n], rtol=3 * np.finfo(np.float32).eps, atol=0,
                                   err_msg=n)
    a = _train(default, adamw())
    b = _train(plain, with_composition_learning_rate(adamw(), 0.1))
    assert a.keys() == b.keys() == start.keys()
    assert len([n for n in a if n.split("/")[-1] in COMPOSITION_WEIGHTS]) == 3
    for n in a:
        moved = np.abs(b[n] - start[n]).max()
        assert moved > 0, n
        # float32 rounding of weight = 0.1 x variable, against how far training moved it.
        np.testing.assert_allclose(a[n], b[n], rtol=0, atol=1e-3 * moved, err_msg=n)


def test_wrapper_refuses_weights_their_layer_already_scales():
    model = _model(0.1)
    model.compile(optimizer=with_composition_learning_rate("adamw", 0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.zeros((2, 4), "int32")
    with pytest.raises(ValueError, match=r"with_composition_learning_rate scales the "
                                         r"composition weights' steps, and these are already "
                                         r"scaled by their layer's parametrisation"):
        model.train_on_batch(x, x)


def test_parametrised_model_saves_and_loads(tmp_path):
    """A default model (composition weights at 0.1) keeps its scale and its outputs through
    a ``.keras`` file; the same file without the key (as saved before the parametrisation)
    reads its variables as the weights themselves (1.0)."""
    import json
    import zipfile

    model = _model(0.1)
    x = np.random.default_rng(1).integers(0, 32, size=(2, 6))
    want = keras.ops.convert_to_numpy(model(x))
    model.save(tmp_path / "m.keras")
    again = keras.saving.load_model(tmp_path / "m.keras")
    assert again.blocks[0].attention.composition_lr_scale == 0.1
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(again(x)), want)
    with zipfile.ZipFile(tmp_path / "m.keras") as src, \
            zipfile.ZipFile(tmp_path / "old.keras", "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename == "config.json":
                config = json.loads(data)
                del config["config"]["composition_lr_scale"]
                data = json.dumps(config).encode()
            dst.writestr(item, data)
    old = keras.saving.load_model(tmp_path / "old.keras")
    assert old.blocks[0].attention.composition_lr_scale == 1.0
    # The same variables read as weights 10x the default model's composition weights.
    w_new, w_old = (m.blocks[0].attention.spec_weights() for m in (again, old))
    np.testing.assert_allclose(w_old["qkw"], w_new["qkw"] / 0.1, rtol=1e-6)
    np.testing.assert_array_equal(w_old["query_kernel"], w_new["query_kernel"])
