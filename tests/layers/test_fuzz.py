"""Property-based fuzzing: the Keras DCMHA layer against the NumPy spec.

Hypothesis draws a configuration (every switch, G, R, K, N_kv, d, d_v, RoPE,
window, chunking, biases, cross-attention), sizes (B, T, S, widths), a mask
(none, full or broadcast, with or without the causal mask), a dtype
(float32 / float16 / bfloat16, run under the matching Keras dtype policy with
inputs and parameters exactly representable in it) and inputs. The layer of the
process's Keras backend must match ``dcmha.spec.reference`` (float64) within
the spec's tolerance policy (``dcmha.spec.tolerance``), on the output and on the
returned attention scores; a second property does the same for cached decoding.

Profiles (``DCMHA_FUZZ_PROFILE``):

* ``ci`` (default): 100 examples of the forward property (30 of decoding),
  derandomized so every run draws the same examples; tiny shapes.
* ``long``: 2000 examples (600 of decoding), random. Run it per backend with

      DCMHA_FUZZ_PROFILE=long KERAS_BACKEND=jax pytest -q tests/layers/test_fuzz.py

  (and torch, tensorflow). A failure prints the shrunk example and a
  ``@reproduce_failure`` blob.
"""

import contextlib
import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keras
from keras import ops

from dcmha.layers import DCMHA
from dcmha.spec import reference, tolerance

BACKEND = keras.backend.backend()

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=100, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=2000, **_COMMON)
PROFILE_NAME = os.environ.get("DCMHA_FUZZ_PROFILE", "ci")
if PROFILE_NAME not in ("ci", "long"):
    raise ValueError("DCMHA_FUZZ_PROFILE must be 'ci' or 'long'. "
                     f"Received: DCMHA_FUZZ_PROFILE={PROFILE_NAME!r}")
PROFILE = settings.get_profile(PROFILE_NAME)
# Decoding examples cost more (one call per segment): fewer of them.
DECODE_PROFILE = settings(PROFILE, max_examples=max(1, PROFILE.max_examples * 3 // 10))

POLICIES = {"float32": "float32", "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}
BOOLS = ("pre_compose", "post_compose", "query_wise", "key_wise", "dynamic_projection",
         "dynamic_gating", "static_compose", "gelu_approximate", "qk_norm", "use_bias")


# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------

@st.composite
def configs(draw, cross=None):
    """A valid ``reference.Config`` with tiny sizes (N <= 4, d <= 4)."""
    N = draw(st.sampled_from([1, 2, 4]))
    divisors = [g for g in (1, 2, 4) if N % g == 0]
    d = draw(st.sampled_from([2, 4]))
    kw = {n: draw(st.booleans()) for n in BOOLS}
    kw.update(
        num_heads=N, key_dim=d, num_groups=draw(st.sampled_from(divisors)),
        num_key_value_heads=draw(st.sampled_from([None] + divisors)),
        value_dim=draw(st.sampled_from([None, 2, 3])), rank=draw(st.sampled_from([1, 2])),
        dynamic_hidden_dim=draw(st.sampled_from([None, 1, 3])),
        rope_max_wavelength=draw(st.sampled_from([None, 10.0, 1e4])),
        sliding_window=draw(st.sampled_from([None, 1, 2])),
        query_chunk_size=draw(st.sampled_from([None, 1, 2])),
        cross_attention=draw(st.booleans()) if cross is None else cross)
    return reference.Config(**kw).validate()


@st.composite
def mask_shapes(draw, B, T, S):
    """None or a shape that broadcasts to (B, T, S)."""
    return draw(st.sampled_from([None, (B, T, S), (1, T, S), (B, 1, S), (T, S)]))


@st.composite
def forward_cases(draw):
    cfg = draw(configs())
    B = draw(st.integers(1, 2))
    T = draw(st.integers(1, 3))
    cross = cfg.cross_attention or draw(st.booleans())   # separate key/value inputs
    S = draw(st.integers(1, 3)) if cross else T
    D_q = draw(st.sampled_from([3, 4]))
    D_kv = draw(st.sampled_from([3, 4])) if cfg.cross_attention else D_q
    return dict(
        cfg=cfg, B=B, T=T, S=S, D_q=D_q, D_kv=D_kv, D_out=draw(st.sampled_from([None, 2])),
        cross=cross, mask_shape=draw(mask_shapes(B, T, S)), causal=draw(st.booleans()),
        dtype=draw(st.sampled_from(sorted(POLICIES))),
        scale=draw(st.sampled_from([1.0, 20.0])), input_scale=draw(st.sampled_from([1.0, 4.0])),
        seed=draw(st.integers(0, 2 ** 31 - 1)))


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

class _NumpyZeros(keras.initializers.Initializer):
    """Zeros from NumPy: no backend kernel is compiled per new shape.

    Every weight is overwritten by ``load_spec_weights`` at once; the default
    random initialisers would compile one random kernel per new shape on jax
    (seconds each on a small CPU), which would dominate the fuzzing time.
    """

    def __call__(self, shape, dtype=None):
        return np.zeros(shape, dtype=keras.backend.standardize_dtype(dtype or "float32"))


@contextlib.contextmanager
def _cheap_initializers():
    saved = keras.initializers.RandomNormal
    keras.initializers.RandomNormal = lambda *a, **k: _NumpyZeros()
    try:
        yield
    finally:
        keras.initializers.RandomNormal = saved


_LAYERS = {}


def make_layer(cfg, dtype, D_q, D_kv, D_out, params):
    """A built layer holding ``params``; layers are reused across examples."""
    key = (cfg, dtype, D_q, D_kv, D_out)
    layer = _LAYERS.get(key)
    if layer is None:
        with _cheap_initializers():
            layer = DCMHA(**cfg.to_dict(), output_shape=D_out, dtype=POLICIES[dtype],
                          kernel_initializer=_NumpyZeros(), bias_initializer=_NumpyZeros())
            layer.build((None, None, D_q), (None, None, D_kv), (None, None, D_kv))
        _LAYERS[key] = layer
    layer.load_spec_weights(params)
    return layer


_JITTED = {}


def call_layer(layer, *args, **kwargs):
    """``layer(*args, **kwargs)``; on jax as one jitted program.

    Eager jax compiles every primitive for every new shape (seconds per new
    configuration on a small CPU); one XLA program per configuration is several
    times cheaper. The variables are passed in, so new weights need no retrace.
    Array arguments (inputs, mask, cache, cache_update_index) are traced, the
    Python flags are static.
    """
    if BACKEND != "jax":
        return layer(*args, **kwargs)
    import jax

    arrays = {k: v for k, v in kwargs.items()
              if k in ("attention_mask", "cache", "cache_update_index") and v is not None}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
    key = (id(layer), static, tuple(sorted(arrays)), len(args))
    fn = _JITTED.get(key)
    if fn is None:
        variables = layer.trainable_variables + layer.non_trainable_variables

        def run(values, args, arrays):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return layer(*args, **arrays, **dict(static))

        fn = _JITTED[key] = jax.jit(run)
    values = [v.value for v in layer.trainable_variables + layer.non_trainable_variables]
    if "cache_update_index" in arrays:
        arrays["cache_update_index"] = np.int32(arrays["cache_update_index"])
    return fn(values, args, arrays)


def np64(x):
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")), np.float64)


def draw_data(case):
    """Parameters and inputs (float32 arrays exactly representable in the case's dtype)."""
    cfg, dtype = case["cfg"], case["dtype"]
    rng = np.random.default_rng(case["seed"])
    params = reference.init_params(cfg, case["D_q"], case["D_kv"], case["D_out"], rng=rng,
                                   scale=case["scale"])
    if cfg.use_bias:    # non-zero biases (the spec initialises them to 0)
        params.update({n: rng.normal(0, 0.5, p.shape) for n, p in params.items()
                       if n.endswith("bias")})
    if cfg.qk_norm:
        params.update({n: rng.uniform(0.5, 1.5, p.shape) for n, p in params.items()
                       if n.endswith("norm_scale")})
    params = {n: tolerance.round_to_dtype(p, dtype) for n, p in params.items()}
    B, T, S = case["B"], case["T"], case["S"]
    s = case["input_scale"]
    x = {"query": rng.standard_normal((B, T, case["D_q"])) * s}
    if case["cross"]:
        x["key"] = rng.standard_normal((B, S, case["D_kv"])) * s
        x["value"] = rng.standard_normal((B, S, case["D_kv"])) * s
    x = {n: tolerance.round_to_dtype(a, dtype) for n, a in x.items()}
    mask = None
    if case["mask_shape"] is not None:
        mask = rng.random(case["mask_shape"]) > 0.3
    return params, x, mask


def check(name, got, expected, tol):
    got = np64(got)
    assert got.shape == expected.shape, (name, got.shape, expected.shape)
    ok = tolerance.within(got, expected, **tol)
    if not ok.all():
        err = np.abs(got - expected)
        raise AssertionError(
            f"{name}: {int((~ok).sum())} of {ok.size} elements outside atol={tol['atol']:.3g}, "
            f"rtol={tol['rtol']:.3g}; max |error| {np.nanmax(err):.3g} "
            f"(NaN: {bool(np.isnan(got).any())})")


def tolerances(expected, mask, pre_composed, dtype):
    sigma = tolerance.score_scale(pre_composed, mask)
    return tolerance.case_tolerances(expected, list(expected), dtype, sigma)


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------

@PROFILE
@given(case=forward_cases())
def test_layer_matches_reference(case):
    cfg, dtype = case["cfg"], case["dtype"]
    params, x, mask = draw_data(case)
    key, value = (x["key"], x["value"]) if case["cross"] else (None, None)
    y_ref, inter = reference.attention(params, cfg, x["query"], key, value,
                                       attention_mask=mask, use_causal_mask=case["causal"],
                                       return_intermediates=True)
    expected = {"output": y_ref, "attention_scores": inter["post_composed"]}
    tol = tolerances(expected, inter["mask"], inter["pre_composed"], dtype)

    layer = make_layer(cfg, dtype, case["D_q"], case["D_kv"], case["D_out"], params)
    args = (x["query"], x["value"], x["key"]) if case["cross"] else (x["query"], x["query"])
    y, scores = call_layer(layer, *args, attention_mask=mask, use_causal_mask=case["causal"],
                           return_attention_scores=True)
    assert keras.backend.standardize_dtype(y.dtype) == dtype
    check("output", y, expected["output"], tol["output"])
    check("attention_scores", scores, expected["attention_scores"], tol["attention_scores"])


@st.composite
def decode_cases(draw):
    cfg = draw(configs(cross=False))
    T = draw(st.integers(2, 4))
    # Segments: a prefill then steps; their lengths add up to T.
    cuts = sorted(draw(st.sets(st.integers(1, T - 1), max_size=2)))
    segments = [b - a for a, b in zip([0] + cuts, cuts + [T])]
    return dict(cfg=cfg, B=draw(st.integers(1, 2)), T=T, S=T, D_q=4, D_kv=4, D_out=None,
                cross=False, segments=segments, extra=draw(st.integers(0, 1)),
                mask_shape=None, dtype=draw(st.sampled_from(sorted(POLICIES))),
                scale=draw(st.sampled_from([1.0, 20.0])), input_scale=1.0,
                seed=draw(st.integers(0, 2 ** 31 - 1)))


@DECODE_PROFILE
@given(case=decode_cases())
def test_cached_decoding_matches_reference(case):
    """Prefill + steps through the cache equal the causal reference over the whole sequence."""
    cfg, dtype = case["cfg"], case["dtype"]
    params, x, _ = draw_data(case)
    q = x["query"]
    B, T = case["B"], case["T"]
    S_max = T + case["extra"]           # positions past the last written one are never read
    y_ref, inter = reference.attention(params, cfg, q, use_causal_mask=True,
                                       return_intermediates=True)
    tol = tolerances({"output": y_ref}, inter["mask"], inter["pre_composed"], dtype)

    layer = make_layer(cfg, dtype, 4, 4, None, params)
    cache = layer.init_cache(B, S_max)
    outs, t0 = [], 0
    for n in case["segments"]:
        y, cache = call_layer(layer, q[:, t0:t0 + n], q[:, t0:t0 + n], use_causal_mask=True,
                              cache=cache, cache_update_index=t0)
        outs.append(np64(y))
        t0 += n
    check("output", np.concatenate(outs, axis=1), y_ref, tol["output"])
