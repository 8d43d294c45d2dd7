"""DCMHA in training: dropout through a SeedGenerator, model.fit, gradients.

Runs on the Keras backend of the process (KERAS_BACKEND=jax|torch|tensorflow).
"""

import numpy as np
import pytest

import keras
from keras import ops

from dcmha.layers import DCMHA

BACKEND = keras.backend.backend()
needs_autodiff = pytest.mark.skipif(BACKEND == "numpy", reason="the numpy backend cannot train")


def np_(x):
    return np.asarray(ops.convert_to_numpy(x))


def _layer(seed, dropout=0.5, weights=None):
    """A built layer; ``weights``: another layer's variables (``get_weights()``), copied
    exactly (``spec_weights()`` would round the composition weights held under
    ``composition_lr_scale`` once more)."""
    layer = DCMHA(num_heads=4, key_dim=8, dropout=dropout, seed=seed)
    layer.build((2, 6, 16), (2, 6, 16))
    if weights is not None:
        layer.set_weights(weights)
    return layer


def test_dropout_is_seeded_and_only_in_training(rng, call_layer):
    x = rng.standard_normal((2, 6, 16)).astype("float32")
    a = _layer(seed=7)
    w = a.get_weights()
    b = _layer(seed=7, weights=w)
    c = _layer(seed=8, weights=w)
    plain = _layer(seed=7, dropout=0.0, weights=w)

    def run(layer, training):
        y, scores = call_layer(layer, x, x, training=training, return_attention_scores=True)
        return np_(y), np_(scores)

    (ya, sa), (yb, _), (yc, _) = (run(layer, True) for layer in (a, b, c))
    np.testing.assert_array_equal(ya, yb)               # same seed: same dropout
    assert not np.allclose(ya, yc)                      # another seed: another mask
    y_inf, s_inf = run(a, False)
    np.testing.assert_allclose(y_inf, run(plain, False)[0], rtol=1e-6, atol=1e-6)
    assert not np.allclose(ya, y_inf)
    # The generator advances: a second training call draws a new mask.
    assert not np.allclose(run(a, True)[0], ya)
    # The scores are returned before dropout, as in MultiHeadAttention.
    np.testing.assert_allclose(sa, s_inf, rtol=1e-6, atol=1e-6)


@needs_autodiff
def test_fit_reduces_the_loss(rng):
    keras.utils.set_random_seed(0)
    q = keras.Input((8, 16))
    y = DCMHA(num_heads=4, key_dim=8, dropout=0.1, rope_max_wavelength=100.0,
              query_chunk_size=4, seed=1)(q, q, use_causal_mask=True)
    model = keras.Model(q, keras.layers.Dense(1)(y))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")   # default jit_compile
    x = rng.standard_normal((16, 8, 16)).astype("float32")
    # A target that needs attention: the running mean of the first feature.
    target = (np.cumsum(x[..., :1], axis=1) / np.arange(1, 9)[None, :, None]).astype("float32")
    history = model.fit(x, target, batch_size=8, epochs=6, verbose=0, shuffle=False)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses


@needs_autodiff
def test_gradients_are_finite_with_fully_masked_rows(rng):
    """Masked rows give zero output and finite (zero) gradients, never NaN."""
    layer = DCMHA(num_heads=4, key_dim=8, static_compose=True, qk_norm=True)
    x = rng.standard_normal((2, 5, 16)).astype("float32")
    mask = rng.random((2, 5, 5)) > 0.3
    mask[0, 1] = False
    layer.build(x.shape, x.shape)
    grads = _gradients(layer, x, mask)
    for g in grads:
        assert np.all(np.isfinite(g))
    assert np.any(grads[0] != 0)


def _gradients(layer, x, mask, causal=False):
    """Gradients of sum(output) w.r.t. the input and the trainable variables."""
    if BACKEND == "jax":
        import jax

        tv = [v.value for v in layer.trainable_variables]
        ntv = [v.value for v in layer.non_trainable_variables]

        def loss(tv, x):
            y, _ = layer.stateless_call(tv, ntv, x, x, attention_mask=mask,
                                        use_causal_mask=causal)
            return y.sum()
        g_tv, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(tv, x)
        return [np.asarray(g_x)] + [np.asarray(g) for g in g_tv]
    if BACKEND == "torch":
        import torch

        xt = torch.tensor(x, requires_grad=True)
        layer(xt, xt, attention_mask=torch.tensor(mask), use_causal_mask=causal).sum().backward()
        return [xt.grad.numpy()] + [v.value.grad.numpy() for v in layer.trainable_variables]
    import tensorflow as tf

    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        loss = tf.reduce_sum(layer(xt, xt, attention_mask=mask, use_causal_mask=causal))
    grads = tape.gradient(loss, [xt] + list(layer.trainable_variables))
    return [g.numpy() for g in grads]


@pytest.mark.parametrize("kwargs", [dict(), dict(num_groups=2, static_compose=True,
                                                 num_key_value_heads=2, sliding_window=4)])
def test_looped_chunks_match_unrolled(rng, monkeypatch, kwargs):
    """Many query chunks run as ops.map loops (jax, tensorflow): same output and gradients."""
    from dcmha import framework
    from dcmha.ops import core

    x = rng.standard_normal((2, 23, 16)).astype("float32")
    mask = rng.random((2, 23, 23)) > 0.2
    mask[1, 3] = False                                    # one fully masked row
    layers = [DCMHA(num_heads=4, key_dim=8, seed=3, **kwargs, **extra)
              for extra in (dict(implementation="ops"),
                            dict(implementation="ops", query_chunk_size=2))]
    for layer in layers:
        layer.build(x.shape, x.shape)
    weights = {n: w * (5.0 if n in ("qkw", "dd") else 1.0)
               for n, w in layers[0].spec_weights().items()}
    for layer in layers:
        layer.load_spec_weights(weights)
    monkeypatch.setattr(core, "MAX_UNROLLED_CHUNKS", 3)   # 12 chunks: looped on jax / tf
    looped, inner = [], core._attention_looped
    monkeypatch.setattr(core, "_attention_looped",
                        lambda *a, **k: looped.append(1) or inner(*a, **k))
    y0, y1 = (np_(layer(x, x, attention_mask=mask, use_causal_mask=True)) for layer in layers)
    assert bool(looped) == framework.LOOPED_CHUNKS        # the chunked layer took the looped path
    atol = 2e-6 * max(1.0, np.abs(y0).max())
    np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=atol)
    if BACKEND == "numpy":
        return
    g0, g1 = (_gradients(layer, x, mask, causal=True) for layer in layers)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(b).max()))
