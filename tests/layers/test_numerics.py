"""Numerical hardening of the DCMHA layer (and its ONNX export) on edge cases.

Runs on the Keras backend of the process (KERAS_BACKEND=jax|torch|tensorflow):

* a fully masked query row gives exactly zero attention and zero output (plus
  the output bias), in every path: plain, chunked, windowed, cached decoding,
  and in the ONNX graph from ``dcmha.export.to_onnx`` run by onnxruntime;
* an inf or NaN in one batch element never changes another element's output;
* float16 inputs whose scores exceed float16's range (~1e5 > 65504) keep a
  finite, correct softmax (scores are float32);
* bfloat16 end to end (``mixed_bfloat16``) is within the spec tolerance policy.

Reference values come from ``dcmha.spec.reference`` (float64), tolerances from
``dcmha.spec.tolerance``. On jax the layer calls are jitted (see ``call``).
"""

import numpy as np
import pytest

import keras
from keras import ops

from dcmha.layers import DCMHA
from dcmha.spec import reference, tolerance

BACKEND = keras.backend.backend()


_JITTED = {}


def call(layer, *args, **kwargs):
    """``layer(*args, **kwargs)``; on jax as one jitted program per layer and call kind.

    Eager jax compiles each primitive for each new shape, which costs more than
    the whole file's checks; one XLA program per call is several times cheaper
    (the eager path is covered by tests/test_layer_numerics.py). Variables are
    passed in; arrays (inputs, mask, cache, index) are traced, flags static.
    """
    if BACKEND != "jax":
        return layer(*args, **kwargs)
    import jax

    arrays = {k: v for k, v in kwargs.items()
              if k in ("attention_mask", "cache", "cache_update_index") and v is not None}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
    key = (id(layer), static, tuple(sorted(arrays)), len(args))
    if key not in _JITTED:
        variables = layer.trainable_variables + layer.non_trainable_variables

        def run(values, args, arrays):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return layer(*args, **arrays, **dict(static))

        _JITTED[key] = (layer, jax.jit(run))     # the layer is kept alive: ids stay unique
    values = [v.value for v in layer.trainable_variables + layer.non_trainable_variables]
    if "cache_update_index" in arrays:
        arrays["cache_update_index"] = np.int32(arrays["cache_update_index"])
    return _JITTED[key][1](values, args, arrays)


def np64(x):
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")), np.float64)


def assert_within(name, got, expected, tol):
    got = np64(got)
    assert got.shape == expected.shape, (name, got.shape, expected.shape)
    ok = tolerance.within(got, expected, **tol)
    assert ok.all(), (f"{name}: {int((~ok).sum())}/{ok.size} outside {tol}; max |error| "
                      f"{np.nanmax(np.abs(got - expected)):.3g}")


def spec_tolerances(expected, inter, dtype):
    sigma = tolerance.score_scale(inter["pre_composed"], inter["mask"])
    return tolerance.case_tolerances(expected, list(expected), dtype, sigma)


def make_case(cfg_kwargs, rng, B=2, T=5, D=16, D_out=None, dtype="float32", scale=20.0):
    cfg = reference.Config(**cfg_kwargs).validate()
    params = reference.init_params(cfg, D, D, D_out, rng=rng, scale=scale)
    if cfg.use_bias:
        params = {n: (rng.normal(0, 0.5, p.shape) if n.endswith("bias") else p)
                  for n, p in params.items()}
    params = {n: tolerance.round_to_dtype(p, dtype) for n, p in params.items()}
    x = tolerance.round_to_dtype(rng.standard_normal((B, T, D)), dtype)
    policy = {"float32": "float32", "float16": "mixed_float16",
              "bfloat16": "mixed_bfloat16"}[dtype]
    layer = DCMHA(**cfg.to_dict(), output_shape=D_out, dtype=policy)
    layer.load_spec_weights(params)
    return cfg, params, x, layer


ALL_SWITCHES = dict(num_heads=4, key_dim=8, num_key_value_heads=2, num_groups=2,
                    static_compose=True, qk_norm=True, rope_max_wavelength=100.0,
                    use_bias=True, value_dim=6)


# ---------------------------------------------------------------------------
# Fully masked rows
# ---------------------------------------------------------------------------

FULLY_MASKED = {
    "plain": dict(num_heads=4, key_dim=8),
    "all_switches": ALL_SWITCHES,
    "chunked_window": dict(ALL_SWITCHES, query_chunk_size=2, sliding_window=2),
    "mha": dict(num_heads=4, key_dim=8, dynamic_projection=False, dynamic_gating=False),
}


def _masked_rows_mask(B, T, S, rng):
    mask = rng.random((B, T, S)) > 0.3
    mask[:, :, 0] = True             # every other row sees something
    mask[0, 1] = False               # one fully masked row
    mask[1, 3] = False
    mask[:, 4] = False               # a row masked in every batch element
    return mask


@pytest.mark.parametrize("name", sorted(FULLY_MASKED))
def test_fully_masked_row_gives_zeros(name, rng):
    cfg, params, x, layer = make_case(FULLY_MASKED[name], rng)
    mask = _masked_rows_mask(2, 5, 5, rng)
    y, scores = call(layer, x, x, attention_mask=mask, return_attention_scores=True)
    y, scores = np64(y), np64(scores)
    dead = ~mask.any(-1)                                          # (B, T)
    bias = params.get("output_bias", np.zeros(y.shape[-1]))
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(scores))
    # Exactly zero attention: the output is exactly the output bias.
    assert np.array_equal(scores.transpose(0, 2, 1, 3)[dead], np.zeros((dead.sum(), 4, 5)))
    assert np.array_equal(y[dead], np.broadcast_to(np.float32(bias), (dead.sum(), y.shape[-1])))
    y_ref, inter = reference.attention(params, cfg, x, attention_mask=mask,
                                       return_intermediates=True)
    expected = {"output": y_ref, "attention_scores": inter["post_composed"]}
    tol = spec_tolerances(expected, inter, "float32")
    assert_within("output", y, y_ref, tol["output"])
    assert_within("attention_scores", scores, inter["post_composed"], tol["attention_scores"])


def test_fully_masked_rows_from_window_and_causal_and_in_decoding(rng):
    """Rows masked by the combination of causal, window and padding, also through the cache."""
    cfg, params, x, layer = make_case(dict(ALL_SWITCHES, sliding_window=2, use_bias=False), rng,
                                      T=6)
    pad = np.ones((2, 6, 6), bool)
    pad[0, :, 2:4] = False           # keys 2, 3 of element 0 are padding
    # Element 0: query 3 sees keys 2 and 3 (window 2, causal), both padding.
    y = np64(call(layer, x, x, attention_mask=pad, use_causal_mask=True))
    assert np.array_equal(y[0, 3], np.zeros(16))
    y_ref = reference.attention(params, cfg, x, attention_mask=pad, use_causal_mask=True)
    _, inter = reference.attention(params, cfg, x, attention_mask=pad, use_causal_mask=True,
                                   return_intermediates=True)
    tol = spec_tolerances({"output": y_ref}, inter, "float32")
    assert_within("output", y, y_ref, tol["output"])

    cache = layer.init_cache(2, 6)
    outs = []
    for t in range(6):
        step_mask = pad[:, t:t + 1, :]
        out, cache = call(layer, x[:, t:t + 1], x[:, t:t + 1], attention_mask=step_mask,
                          use_causal_mask=True, cache=cache, cache_update_index=t)
        outs.append(np64(out))
    y_dec = np.concatenate(outs, axis=1)
    assert np.array_equal(y_dec[0, 3], np.zeros(16))
    assert_within("decoded output", y_dec, y_ref, tol["output"])


def test_fully_masked_row_in_onnx_export(tmp_path, rng):
    ort = pytest.importorskip("onnxruntime")
    from dcmha.export import to_onnx

    cfg, params, x, layer = make_case(dict(ALL_SWITCHES, use_bias=False), rng)
    mask = _masked_rows_mask(2, 5, 5, rng)
    path = tmp_path / "masked.onnx"
    to_onnx(layer, path, attention_mask=True, return_attention_scores=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y, scores = sess.run(["output", "attention_scores"],
                         {"query": x.astype(np.float32), "attention_mask": mask})
    dead = ~mask.any(-1)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(scores))
    assert np.array_equal(y[dead], np.zeros((dead.sum(), 16), np.float32))
    assert np.array_equal(scores.transpose(0, 2, 1, 3)[dead], np.zeros((dead.sum(), 4, 5)))
    y_ref, inter = reference.attention(params, cfg, x, attention_mask=mask,
                                       return_intermediates=True)
    tol = spec_tolerances({"output": y_ref}, inter, "float32")
    assert_within("onnx output", y, y_ref, tol["output"])


# ---------------------------------------------------------------------------
# Non-finite inputs stay in their batch element
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    ALL_SWITCHES,
    dict(num_heads=4, key_dim=8, num_groups=4, query_chunk_size=2, sliding_window=3),
    dict(ALL_SWITCHES, cross_attention=True),
], ids=["all_switches", "chunked", "cross"])
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_non_finite_input_does_not_leak_across_the_batch(kwargs, policy, rng):
    cross = kwargs.get("cross_attention", False)
    cfg = reference.Config(**kwargs)
    params = {n: tolerance.round_to_dtype(p, "float16") for n, p in
              reference.init_params(cfg, 16, 16, rng=rng, scale=20.0).items()}
    layer = DCMHA(**kwargs, dtype=policy)
    layer.load_spec_weights(params)
    B, T = 4, 5
    q = rng.standard_normal((B, T, 16)).astype("float32")
    kv = rng.standard_normal((B, T, 16)).astype("float32") if cross else q
    mask = rng.random((B, T, T)) > 0.2

    def run(q, kv):
        y, s = call(layer, q, kv, attention_mask=mask, use_causal_mask=not cross,
                    return_attention_scores=True)
        return np64(y), np64(s)

    y_clean, s_clean = run(q, kv)
    bad_q, bad_kv = q.copy(), kv.copy()
    bad_q[0, 2, 5] = np.inf
    bad_q[1, 0, :] = np.nan
    if cross:
        bad_kv = kv.copy()
        bad_kv[0, 1, 3] = -np.inf
        bad_kv[1, 4, 0] = np.nan
    y_bad, s_bad = run(bad_q, bad_kv)
    assert not np.all(np.isfinite(y_bad[:2]))          # the poisoned elements are poisoned
    np.testing.assert_array_equal(y_bad[2:], y_clean[2:])
    np.testing.assert_array_equal(s_bad[2:], s_clean[2:])


# ---------------------------------------------------------------------------
# float16 scores beyond float16's range
# ---------------------------------------------------------------------------

def _large_score_case(pre_compose, rng):
    """Identity q/k projections of integer inputs: q.k / sqrt(d) ~ 1e5, exact in float32.

    N = 2 heads of d = 4 read the 8 input features directly, so q and k are the
    inputs (exact in float16) and their dot products are exact float32
    integers. Keys 1 and 3 repeat keys 0 and 2, so rows have exact ties and the
    softmax is not one-hot.
    """
    kwargs = dict(num_heads=2, key_dim=4, value_dim=4, static_compose=True,
                  pre_compose=pre_compose)
    cfg = reference.Config(**kwargs)
    params = reference.init_params(cfg, 8, 8, rng=rng, scale=1.0)
    eye = np.eye(8).reshape(8, 2, 4)
    params.update(query_kernel=eye, key_kernel=eye)
    params = {n: tolerance.round_to_dtype(p, "float16") for n, p in params.items()}
    x = rng.integers(150, 320, (2, 5, 8)) * rng.choice([-1, 1], (2, 5, 8))
    x[:, 1], x[:, 3] = x[:, 0], x[:, 2]
    x = x.astype(np.float64)
    return cfg, kwargs, params, x


@pytest.mark.parametrize("pre_compose", [False, True])
def test_float16_scores_beyond_float16_range(pre_compose, rng):
    cfg, kwargs, params, x = _large_score_case(pre_compose, rng)
    layer = DCMHA(**kwargs, dtype="mixed_float16")
    layer.load_spec_weights(params)
    y, scores = call(layer, x, x, return_attention_scores=True)
    assert keras.backend.standardize_dtype(y.dtype) == "float16"
    assert keras.backend.standardize_dtype(scores.dtype) == "float32"
    y_ref, inter = reference.attention(params, cfg, x, return_intermediates=True)
    assert np.abs(inter["scores"]).max() > 1e5            # float16 would overflow to inf
    assert np.all(np.isfinite(np64(y))) and np.all(np.isfinite(np64(scores)))
    if not pre_compose:
        # Ties: duplicated keys share the probability exactly.
        assert np.any((inter["probs"] > 0.25) & (inter["probs"] < 0.75))
    # q and k are exact and the scores exact float32 integers, so the score
    # rounding that the policy's sigma term covers does not occur: the plain
    # float16 tolerance applies. (With pre_compose the composed scores round in
    # float32, but rows are then saturated: one key per row, far ahead.)
    expected = {"output": y_ref, "attention_scores": inter["post_composed"]}
    tol = tolerance.case_tolerances(expected, list(expected), "float16", sigma=0.0)
    assert_within("output", y, y_ref, tol["output"])
    assert_within("attention_scores", scores, inter["post_composed"], tol["attention_scores"])


# ---------------------------------------------------------------------------
# bfloat16 end to end
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [ALL_SWITCHES, dict(ALL_SWITCHES, cross_attention=True,
                                                       query_chunk_size=2)],
                         ids=["self", "cross_chunked"])
def test_bfloat16_end_to_end_within_spec_tolerance(kwargs, rng):
    cfg, params, x, layer = make_case(kwargs, rng, T=6, D_out=12, dtype="bfloat16")
    mask = rng.random((2, 6, 6)) > 0.3
    kv = tolerance.round_to_dtype(rng.standard_normal((2, 6, 16)), "bfloat16") \
        if cfg.cross_attention else x
    y, scores = call(layer, x, kv, attention_mask=mask, use_causal_mask=True,
                     return_attention_scores=True)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    assert keras.backend.standardize_dtype(scores.dtype) == "float32"
    assert all(keras.backend.standardize_dtype(v.dtype) == "float32" for v in layer.weights)
    key = kv if cfg.cross_attention else None
    y_ref, inter = reference.attention(params, cfg, x, key, key, attention_mask=mask,
                                       use_causal_mask=True, return_intermediates=True)
    expected = {"output": y_ref, "attention_scores": inter["post_composed"]}
    tol = spec_tolerances(expected, inter, "bfloat16")
    assert_within("output", y, y_ref, tol["output"])
    assert_within("attention_scores", scores, inter["post_composed"], tol["attention_scores"])


def test_bfloat16_cached_decoding_within_spec_tolerance(rng):
    cfg, params, x, layer = make_case(dict(ALL_SWITCHES, sliding_window=3), rng, T=6,
                                      dtype="bfloat16")
    cache = layer.init_cache(2, 7)
    assert all(keras.backend.standardize_dtype(c.dtype) == "bfloat16" for c in cache.values())
    outs = []
    for t0, t1 in ((0, 3), (3, 4), (4, 6)):
        y, cache = call(layer, x[:, t0:t1], x[:, t0:t1], use_causal_mask=True, cache=cache,
                        cache_update_index=t0)
        assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
        outs.append(np64(y))
    y_ref, inter = reference.attention(params, cfg, x, use_causal_mask=True,
                                       return_intermediates=True)
    tol = spec_tolerances({"output": y_ref}, inter, "bfloat16")
    assert_within("decoded output", np.concatenate(outs, axis=1), y_ref, tol["output"])
