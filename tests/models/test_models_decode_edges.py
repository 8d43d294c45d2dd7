"""Decoding indices and token ids at their edges (issue 14, item 2), on every Keras backend.

Known values are checked: an out-of-range ``cache_update_index`` (a Python int, or a tensor
in an eager call), a token id outside [0, vocab_size) in an eager call or ``generate``, and a
NaN, infinite or negative temperature are ValueErrors with exact messages. Traced values
(``jax.jit``, ``tf.function``, a TorchScript trace) cannot be checked; there the behaviour
is the documented one: the call runs with the index clamped to [0, S_max - T] and returns a
NaN output; an out-of-range token id gives NaN logits at its position.
"""

import re
import warnings

import numpy as np
import pytest

keras = pytest.importorskip("keras")
from keras import ops  # noqa: E402

from dcmha.layers import DCMHA  # noqa: E402
from dcmha.models import DCFormerLM  # noqa: E402

BACKEND = keras.backend.backend()
D, S_MAX, VOCAB = 8, 4, 16


def _x(B=1, T=1, seed=0):
    return np.random.default_rng(seed).normal(size=(B, T, D)).astype("float32")


def _int32(i):
    return ops.convert_to_tensor(np.int32(i))


def _np(x):
    return np.asarray(ops.convert_to_numpy(x))


def _trace(fn, module, example_args):
    """``fn`` traced so that its array arguments are unknown while it is built.

    jax.jit, a tf.function, or on torch a TorchScript trace of ``module`` (the
    Keras layer or model, a torch Module) around ``fn``; the numpy backend
    cannot trace.
    """
    if BACKEND == "jax":
        import jax
        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf
        return tf.function(fn, autograph=False)
    if BACKEND == "torch":
        import torch

        class Traced(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = module     # registers the Keras variables as parameters

            def forward(self, *args):
                return fn(*args)

        with torch.no_grad(), warnings.catch_warnings():
            # The tracer's notes on Python values read from tensors (shapes) are expected.
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.simplefilter("ignore", DeprecationWarning)    # torch.jit.trace's own
            return torch.jit.trace(Traced(), tuple(example_args), check_trace=False,
                                   strict=False)
    pytest.skip(f"the {BACKEND} backend has no tracing: every value is checked eagerly")


@pytest.fixture(scope="module")
def layer():
    keras.utils.set_random_seed(0)
    layer = DCMHA(2, 4, rope_max_wavelength=100.0)
    layer.build((None, None, D), (None, None, D))
    return layer


@pytest.fixture(scope="module")
def filled_cache(layer):
    """A cache whose every slot holds something (a clamped write then shows where it went)."""
    _, cache = layer(_x(T=S_MAX, seed=5), _x(T=S_MAX, seed=5), cache=layer.init_cache(1, S_MAX),
                     cache_update_index=0, use_causal_mask=True)
    return cache


_TOO_FAR = ("`cache_update_index` + the new length must be at most the cache length 4. "
            "Received: cache_update_index={}, new length {}")
_NEGATIVE = "`cache_update_index` must be a non-negative integer. Received: cache_update_index={}"

OUT_OF_RANGE = [
    pytest.param(10, 1, _TOO_FAR.format(10, 1), id="10-of-4"),
    pytest.param(4, 1, _TOO_FAR.format(4, 1), id="4-of-4"),
    pytest.param(3, 2, _TOO_FAR.format(3, 2), id="3+2-of-4"),
    pytest.param(-3, 1, _NEGATIVE.format(-3), id="negative"),
]


@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
@pytest.mark.parametrize("index,T,message", OUT_OF_RANGE)
def test_out_of_range_index_is_a_value_error(layer, index, T, message, as_tensor):
    before = {n: _np(v) for n, v in layer.init_cache(1, S_MAX).items()}
    cache = {n: ops.convert_to_tensor(v) for n, v in before.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        layer(_x(T=T), _x(T=T), cache=cache, cache_update_index=_int32(index) if as_tensor
              else index)
    for n, v in cache.items():          # nothing half-written
        np.testing.assert_array_equal(_np(v), before[n])


def test_index_bound_counts_the_written_keys():
    # Cross-attention: 3 new keys for 1 query; index 3 + 3 keys overflow a 4-slot cache.
    layer = DCMHA(2, 4, cross_attention=True)
    layer.build((None, None, D), (None, None, D))
    with pytest.raises(ValueError, match=re.escape(_TOO_FAR.format(3, 3))):
        layer(_x(T=1), _x(T=3), cache=layer.init_cache(1, S_MAX), cache_update_index=3)


@pytest.mark.parametrize("index,clamped", [(10, 3), (4, 3), (-3, 0)])
def test_traced_out_of_range_index_runs_clamped_and_returns_nan(layer, filled_cache, index,
                                                                 clamped):
    names = sorted(filled_cache)

    def step(x, i, *entries):
        y, cache = layer(x, x, cache=dict(zip(names, entries)), cache_update_index=i,
                         use_causal_mask=True)
        return (y,) + tuple(cache[n] for n in names)

    x = ops.convert_to_tensor(_x(seed=1))
    entries = [filled_cache[n] for n in names]
    traced = _trace(step, layer, [x, _int32(0)] + entries)
    bad = [_np(a) for a in traced(x, _int32(index), *entries)]
    good = [_np(a) for a in traced(x, _int32(clamped), *entries)]
    assert np.isnan(bad[0]).all()
    assert np.isfinite(good[0]).all()
    for n, b, g in zip(names, bad[1:], good[1:]):   # the cache: exactly the clamped call's
        np.testing.assert_array_equal(b, g, err_msg=n)
    # An in-range traced call is the eager call (the guard changes nothing there).
    y, cache = layer(x, x, cache=filled_cache, cache_update_index=clamped, use_causal_mask=True)
    np.testing.assert_allclose(good[0], _np(y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(good[1 + names.index("key")], _np(cache["key"]),
                               rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- token ids

@pytest.fixture(scope="module")
def lm():
    keras.utils.set_random_seed(0)
    model = DCFormerLM(vocab_size=VOCAB, num_layers=1, hidden_dim=D, num_heads=2)
    model.build((None, None))
    return model


def _range_message(ids):
    return (f"`token_ids` must be in [0, vocab_size) = [0, {VOCAB}). "
            f"Received: token_ids with min={ids.min()}, max={ids.max()}")


@pytest.mark.parametrize("bad", [VOCAB, 1000, -1], ids=["vocab_size", "far", "negative"])
def test_token_ids_out_of_range_are_a_value_error(lm, bad):
    ids = np.array([[1, bad, 2]], dtype="int32")
    message = re.escape(_range_message(ids))
    with pytest.raises(ValueError, match=message):
        lm(ids)
    with pytest.raises(ValueError, match=message):
        lm(ops.convert_to_tensor(ids))
    with pytest.raises(ValueError, match=message):
        lm.call_with_cache(ids, lm.init_cache(1, S_MAX), 0)
    with pytest.raises(ValueError, match=message):
        lm.generate(ids, max_new_tokens=2)


def test_traced_out_of_range_token_ids_give_nan_logits(lm):
    ids = np.array([[1, 2, 3, 4], [5, VOCAB, 7, -2]], dtype="int32")
    logits = _np(_trace(lambda t: lm(t), lm, [ops.convert_to_tensor(ids)])(
        ops.convert_to_tensor(ids)))
    assert np.isnan(logits[1, 1]).all() and np.isnan(logits[1, 3]).all()
    # The other sequence is untouched: the eager logits.
    np.testing.assert_allclose(logits[0], _np(lm(ids[:1]))[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [float("nan"), -1.0, -1e-9, float("inf"), None, "1",
                                         True], ids=repr)
def test_bad_temperature_is_refused(lm, temperature):
    message = ("`temperature` must be a finite number >= 0. "
               f"Received: temperature={temperature!r}")
    with pytest.raises(ValueError, match=re.escape(message)):
        lm.generate(np.array([[1, 2]]), max_new_tokens=1, temperature=temperature)


@pytest.mark.parametrize("form", ["int", "tensor"])
@pytest.mark.parametrize("B,T,index", [(1, 1, 3), (2, 3, 1), (3, 2, 0)])
def test_cache_writer_writes_every_entry_at_the_index(B, T, index, form):
    """``dcmha.ops.cache_writer`` (the layer's cache writes: TensorFlow's scatter on
    positions built once per call, ``write_slice`` elsewhere) writes each entry's rows
    [:, index:index + T], casts to the entry's dtype and leaves the rest; for a Python int
    index, and for an int32 tensor index: traced while unknown (jax.jit, tf.function),
    eager on torch and numpy. Expected values are numpy's slice assignment."""
    from dcmha import ops as dops
    rng = np.random.default_rng(B * 10 + T)
    entries = [rng.normal(size=(B, 5, 2, 3)).astype("float32"),
               rng.normal(size=(B, 5, 4)).astype("float16")]
    updates = [rng.normal(size=(B, T) + e.shape[2:]).astype("float32") for e in entries]

    def write(i, *arrays):
        writer = dops.cache_writer(i, T, B)
        return [writer(e, u) for e, u in zip(arrays[:2], arrays[2:])]

    args = [ops.convert_to_tensor(a) for a in entries + updates]
    if form == "int":
        got = write(index, *args)
    elif BACKEND in ("jax", "tensorflow"):
        got = _trace(write, None, None)(_int32(index), *args)
    else:
        got = write(_int32(index), *args)
    for e, u, g in zip(entries, updates, got):
        want = e.copy()
        want[:, index:index + T] = u.astype(e.dtype)
        assert keras.backend.standardize_dtype(g.dtype) == str(e.dtype)
        np.testing.assert_array_equal(_np(g), want)
