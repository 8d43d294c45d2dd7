"""DCMHA numerics against the NumPy spec: configs, masks, chunking, decoding, dtype
policies, and the edge cases (numerical hardening, also of the ONNX export).

Runs on the Keras backend of the process (KERAS_BACKEND=jax|torch|tensorflow|numpy).

* Configs, masks, chunking, decoding: float32 results are compared with rtol 1e-5 and an atol
  of 2e-5 times the largest expected magnitude (``assert_close``; composition weights are
  scaled up 20x, so compose is far from the identity). On jax the calls are jitted with the
  ``call_layer`` fixture (flags and Python ints static).
* Edge cases, with the spec's tolerance policy (``dcmha.spec.tolerance``, ``assert_within``):
  a fully masked query row gives exactly zero attention and zero output (plus the output
  bias), in every path: plain, chunked, windowed, cached decoding, and in the ONNX graph
  from ``dcmha.export.to_onnx`` run by onnxruntime; an inf or NaN in one batch element never
  changes another element's output; float16 inputs whose scores exceed float16's range
  (~1e5 > 65504) keep a finite, correct softmax (scores are float32); bfloat16 end to end
  (``mixed_bfloat16``) is within the policy. On jax these calls are jitted by ``call``
  (below), which also traces the cache index.

Reference values come from ``dcmha.spec.reference`` (float64).
"""

import numpy as np
import pytest

import keras
from keras import ops

from dcmha import ops as dops
from dcmha.layers import DCMHA
from dcmha.spec import reference, tolerance

BACKEND = keras.backend.backend()


def np_(x):
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")), dtype=np.float64)


def assert_close(got, expected, rtol=1e-5, atol_rel=2e-5):
    got, expected = np_(got), np.asarray(expected, np.float64)
    assert got.shape == expected.shape
    assert np.all(np.isfinite(got))
    atol = atol_rel * max(1.0, np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)


def run_layer(call, case, layer_kwargs=None, **call_kwargs):
    cfg = case["cfg"]
    layer = DCMHA(**{**cfg.to_dict(), **(layer_kwargs or {})})
    layer.load_spec_weights(case["params"])
    args = (case["query"], case["value"], case["key"]) if case["cross"] else (
        case["query"], case["query"])
    return layer, call(layer, *args, return_attention_scores=True, **call_kwargs)


def reference_forward(case, **kwargs):
    key = case["key"] if case["cross"] else None
    value = case["value"] if case["cross"] else None
    return reference.attention(case["params"], case["cfg"], case["query"], key, value,
                               return_intermediates=True, **kwargs)


CONFIGS = {
    "dcmha": dict(num_heads=4, key_dim=8),
    "all_switches": dict(num_heads=4, key_dim=8, num_key_value_heads=2, num_groups=2,
                         static_compose=True, qk_norm=True, rope_max_wavelength=100.0,
                         use_bias=True, value_dim=6, sliding_window=3),
    "mha": dict(num_heads=4, key_dim=8, dynamic_projection=False, dynamic_gating=False),
    "talking_heads": dict(num_heads=4, key_dim=8, dynamic_projection=False,
                          dynamic_gating=False, static_compose=True),
    "key_wise_rank1_erf": dict(num_heads=4, key_dim=8, query_wise=False, rank=1,
                               gelu_approximate=False),
    "post_only_gating": dict(num_heads=4, key_dim=8, pre_compose=False,
                             dynamic_projection=False),
    "mqa_groups4": dict(num_heads=4, key_dim=8, num_key_value_heads=1, num_groups=4,
                        dynamic_hidden_dim=3),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_self_attention_matches_reference(reference_case, rng, name, call_layer):
    case = reference_case(CONFIGS[name], T=7)
    mask = rng.random((2, 7, 7)) > 0.3
    mask[1, 2] = False                                  # a fully masked row
    y_ref, inter = reference_forward(case, attention_mask=mask, use_causal_mask=True)
    _, (y, scores) = run_layer(call_layer, case, attention_mask=mask, use_causal_mask=True)
    assert_close(y, y_ref)
    assert_close(scores, inter["post_composed"])
    s = np_(scores)
    allowed = np.broadcast_to(inter["mask"][:, None], s.shape)
    assert np.all(s[~allowed] == 0.0)                   # masked probabilities exactly 0
    np.testing.assert_array_equal(np_(y)[1, 2], 0.0)    # fully masked row: zeros (no bias)


@pytest.mark.parametrize("kwargs", [
    dict(num_heads=4, key_dim=8, cross_attention=True),
    dict(num_heads=4, key_dim=8, cross_attention=True, num_key_value_heads=2,
         static_compose=True, query_wise=False, output_shape=5),
])
def test_cross_attention_matches_reference(reference_case, rng, kwargs, call_layer):
    kwargs = dict(kwargs)
    out = kwargs.pop("output_shape", None)
    case = reference_case(kwargs, T=5, S=9, D_kv=12, D_out=out, cross=True)
    mask = rng.random((2, 5, 9)) > 0.4
    y_ref, inter = reference_forward(case, attention_mask=mask)
    _, (y, scores) = run_layer(call_layer, case, dict(output_shape=out), attention_mask=mask)
    assert_close(y, y_ref)
    assert_close(scores, inter["post_composed"])


@pytest.mark.parametrize("shape", [(6, 6), (1, 6, 6), (2, 1, 6), (2, 6, 1), (2, 1, 6, 6)])
def test_attention_mask_broadcasts(reference_case, rng, shape, call_layer):
    case = reference_case(dict(num_heads=4, key_dim=8), T=6)
    mask = rng.random(shape) > 0.3
    full = np.broadcast_to(mask[:, 0] if mask.ndim == 4 else mask, (2, 6, 6))
    y_ref, _ = reference_forward(case, attention_mask=full)
    _, (y, _) = run_layer(call_layer, case, attention_mask=mask)
    assert_close(y, y_ref)
    if len(shape) == 3:                                 # broadcast axes under chunking
        _, (y, _) = run_layer(call_layer, case, dict(query_chunk_size=4), attention_mask=mask,
                              use_causal_mask=True)
        y_ref, _ = reference_forward(case, attention_mask=full, use_causal_mask=True)
        assert_close(y, y_ref)


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("window", [None, 2])
def test_query_chunking_gives_the_same_result(reference_case, rng, chunk, window, call_layer):
    kwargs = dict(num_heads=4, key_dim=8, static_compose=True, sliding_window=window)
    case = reference_case(kwargs, T=9)
    mask = rng.random((2, 9, 9)) > 0.2
    _, (y0, s0) = run_layer(call_layer, case, dict(implementation="ops"), attention_mask=mask,
                            use_causal_mask=True)
    _, (y1, s1) = run_layer(call_layer, case, dict(query_chunk_size=chunk), attention_mask=mask,
                            use_causal_mask=True)
    # Other block shapes round differently: a few float32 ulps of the largest value.
    assert_close(y1, np_(y0), rtol=1e-6, atol_rel=1e-6)
    assert_close(s1, np_(s0), rtol=1e-6, atol_rel=1e-6)
    y_ref, _ = reference_forward(case, attention_mask=mask, use_causal_mask=True)
    assert_close(y1, y_ref)


def test_bidirectional_window_and_key_length(reference_case, call_layer):
    kwargs = dict(num_heads=4, key_dim=8, sliding_window=2, query_chunk_size=2,
                  cross_attention=True)
    case = reference_case(kwargs, T=5, S=8, D_kv=16, cross=True)
    y_ref, inter = reference_forward(case)
    _, (y, scores) = run_layer(call_layer, case)
    assert_close(y, y_ref)
    assert_close(scores, inter["post_composed"])


@pytest.mark.parametrize("kwargs", [
    dict(num_heads=4, key_dim=8, num_key_value_heads=2, rope_max_wavelength=50.0, qk_norm=True,
         static_compose=True, use_bias=True),
    dict(num_heads=4, key_dim=8, sliding_window=3, num_groups=2, query_wise=False),
])
def test_decode_with_cache_matches_full_forward(reference_case, kwargs, call_layer):
    case = reference_case(kwargs, T=8)
    cfg, x = case["cfg"], case["query"]
    full = reference.attention(case["params"], cfg, x, use_causal_mask=True)
    layer = DCMHA(**kwargs)
    layer.load_spec_weights(case["params"])
    cache = layer.init_cache(2, 10)                     # longer than the sequence
    ref_cache = reference.init_cache(cfg, 2, 10)
    outs, start = [], 0
    for n in (3, 1, 2, 1, 1):
        step = x[:, start:start + n]
        y, scores, cache = call_layer(layer, step, step, use_causal_mask=True, cache=cache,
                                      cache_update_index=start, return_attention_scores=True)
        _, ref_cache = reference.decode_step(case["params"], cfg, step, ref_cache, start)
        assert tuple(scores.shape) == (2, 4, n, 10)
        assert np.all(np_(scores)[..., start + n:] == 0.0)   # unwritten positions unread
        outs.append(np_(y))
        start += n
    assert_close(np.concatenate(outs, axis=1), full)
    for n, c in ref_cache.items():
        assert_close(cache[n], c)


def test_decode_with_traced_index_and_read_only_cache(reference_case, call_layer):
    kwargs = dict(num_heads=4, key_dim=8, rope_max_wavelength=100.0)
    case = reference_case(kwargs, T=4)
    layer = DCMHA(**kwargs)
    layer.load_spec_weights(case["params"])
    x = case["query"]
    cache = layer.init_cache(2, 4)
    y, cache = call_layer(layer, x[:, :3], x[:, :3], use_causal_mask=True, cache=cache,
                          cache_update_index=ops.convert_to_tensor(0, "int32"))
    y4, cache = call_layer(layer, x[:, 3:], x[:, 3:], use_causal_mask=True, cache=cache,
                           cache_update_index=ops.convert_to_tensor(3, "int32"))
    full = reference.attention(case["params"], case["cfg"], x, use_causal_mask=True)
    assert_close(np.concatenate([np_(y), np_(y4)], 1), full)

    # cache_update_index=None: attend to the cache as it is, without writing to it.
    kwargs = dict(num_heads=4, key_dim=8)
    case = reference_case(kwargs, T=4)
    layer = DCMHA(**kwargs)
    layer.load_spec_weights(case["params"])
    x = case["query"]
    _, cache = call_layer(layer, x, x, cache=layer.init_cache(2, 4), cache_update_index=0)
    y_ro, same = call_layer(layer, x[:, 3:], x[:, 3:], cache=cache, cache_update_index=None)
    for n in cache:
        np.testing.assert_array_equal(np_(same[n]), np_(cache[n]))
    full = reference.attention(case["params"], case["cfg"], x)   # bidirectional
    assert_close(y_ro, full[:, 3:])


@pytest.mark.parametrize("T", [1, 300])
def test_dynamic_weights_of_backend_tensors_match_reference(reference_case, T):
    # Backend tensors take eager torch's own path (dcmha.backends.torch_native.dynamic_weights): a
    # broadcast product for qkw at one token, a bmm for many (B*L*G*C*K*2RM = 2*300*4*32*32).
    case = reference_case(dict(num_heads=8, key_dim=4), T=T)
    cfg, p, x = case["cfg"], case["params"], case["query"]
    slots = reference.slots(cfg)
    t = lambda a: ops.convert_to_tensor(np.asarray(a, np.float32))          # noqa: E731
    dyn = dops.dynamic_weights(t(x), t(p["dw1"]), t(p["qkw"]), t(p["dd"]), slots=slots,
                               rank=cfg.R)
    ref_dyn = reference.dynamic_weights(x, p["dw1"], p["qkw"], p["dd"], slots, cfg.R)
    for s in slots:
        for n in ("w1", "w2", "dd"):
            assert tuple(dyn[s][n].shape) == ref_dyn[s][n].shape
            assert_close(dyn[s][n], ref_dyn[s][n])


def test_functional_ops_match_reference(reference_case, rng):
    case = reference_case(dict(num_heads=4, key_dim=8, num_groups=2, static_compose=True), T=5)
    cfg, p, x = case["cfg"], case["params"], case["query"]
    slots = reference.slots(cfg)
    dyn = dops.dynamic_weights(x, p["dw1"], p["qkw"], p["dd"], slots=slots, rank=cfg.R)
    ref_dyn = reference.dynamic_weights(x, p["dw1"], p["qkw"], p["dd"], slots, cfg.R)
    for s in slots:
        for n in ("w1", "w2", "dd"):
            assert_close(dyn[s][n], ref_dyn[s][n])
    qdyn = {s: ref_dyn[s] for s in reference.side_slots(cfg, "query")}
    kdyn = {s: ref_dyn[s] for s in reference.side_slots(cfg, "key")}
    a = rng.standard_normal((2, 4, 5, 5))
    terms = reference.compose_terms(cfg, "pre", qdyn, kdyn, p)
    assert_close(dops.compose(a.astype("float32"), 2, **terms), reference.compose(a, 2, **terms))
    # The attention core on projected heads, with intermediates.
    q, k, v = reference.project_qkv(p, cfg, x, x, x, np.arange(5), np.arange(5))
    mask = reference.make_mask(2, 5, 5, use_causal_mask=True)
    o_ref, inter = reference.attend(cfg, p, q, k, v, qdyn, kdyn, mask)
    pre = dops.stage_terms("pre", qdyn, kdyn, p["static_pre"])
    post = dops.stage_terms("post", qdyn, kdyn, p["static_post"])
    cast = lambda t: {n: w.astype("float32") for n, w in t.items()}
    o, extras = dops.dcmha_attention(q.astype("float32"), k.astype("float32"),
                                     v.astype("float32"), num_groups=2, pre=cast(pre),
                                     post=cast(post), use_causal_mask=True,
                                     return_intermediates=True, return_attention_scores=True)
    assert_close(o, o_ref)
    assert_close(extras["attention_scores"], inter["post_composed"])
    for n in ("scores", "pre_composed", "probs"):
        assert_close(extras[n], inter[n])
    with pytest.raises(ValueError, match="implementation"):
        dops.dcmha_attention(q, k, v, implementation="fast")


def test_switched_off_stages_are_skipped(reference_case, call_layer):
    """Every composition switch off: exactly multi-head attention (no compose pass)."""
    case = reference_case(dict(num_heads=4, key_dim=8, pre_compose=False, post_compose=False),
                          T=5)
    layer, (y, scores) = run_layer(call_layer, case, use_causal_mask=True)
    assert layer.dynamic_projection_layer is None
    mha = dict(case, cfg=reference.Config(num_heads=4, key_dim=8, dynamic_projection=False,
                                          dynamic_gating=False))
    y_ref, _ = reference_forward(mha, use_causal_mask=True)
    assert_close(y, y_ref)


# ===========================================================================
# Edge cases, with the spec's tolerance policy
# ===========================================================================

_JITTED = {}


def call(layer, *args, **kwargs):
    """``layer(*args, **kwargs)``; on jax as one jitted program per layer and call kind.

    Eager jax compiles each primitive for each new shape, which costs more than
    the whole file's checks; one XLA program per call is several times cheaper
    (the eager path is covered by the other test modules). Variables are passed in;
    arrays (inputs, mask, cache, index) are traced, flags static: unlike the
    ``call_layer`` fixture, a cache index is traced, as in a compiled decoding loop.
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


def assert_within(name, got, expected, tol):
    got = np_(got)
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
    y, scores = np_(y), np_(scores)
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
    y = np_(call(layer, x, x, attention_mask=pad, use_causal_mask=True))
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
        outs.append(np_(out))
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
        return np_(y), np_(s)

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
    assert np.all(np.isfinite(np_(y))) and np.all(np.isfinite(np_(scores)))
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


@pytest.mark.parametrize("policy, rtol", [("mixed_float16", 2e-2), ("mixed_bfloat16", 8e-2)])
def test_mixed_precision_keeps_scores_in_float32(reference_case, policy, rtol, call_layer):
    """Scores of ~1e5 overflow float16 (max 65504): they must stay finite and right."""
    kwargs = dict(num_heads=4, key_dim=8, static_compose=True)
    case = reference_case(kwargs, T=6, scale=1.0)
    half = "float16" if policy == "mixed_float16" else "bfloat16"
    params = dict(case["params"])
    # Large but exactly representable projections: q.k / sqrt(d) ~ 1e5.
    params["query_kernel"] = np.round(params["query_kernel"] * 64) * 4.0
    params["key_kernel"] = np.round(params["key_kernel"] * 64) * 4.0
    x = np.round(case["query"] * 4) / 4
    layer = DCMHA(**kwargs, dtype=policy)
    layer.load_spec_weights(params)
    y, scores = call_layer(layer, ops.cast(x, half), ops.cast(x, half),
                           return_attention_scores=True, use_causal_mask=True)
    assert keras.backend.standardize_dtype(y.dtype) == half
    assert keras.backend.standardize_dtype(scores.dtype) == "float32"
    _, inter = reference.attention(params, case["cfg"], x, use_causal_mask=True,
                                   return_intermediates=True)
    assert np.abs(inter["scores"]).max() > 7e4          # float16 scores would be inf
    y_ref = reference.attention(params, case["cfg"], x, use_causal_mask=True)
    got = np_(y)
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(np_(scores)))
    np.testing.assert_allclose(got, y_ref, rtol=rtol, atol=rtol * np.abs(y_ref).max())


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
        outs.append(np_(y))
    y_ref, inter = reference.attention(params, cfg, x, use_causal_mask=True,
                                       return_intermediates=True)
    tol = spec_tolerances({"output": y_ref}, inter, "bfloat16")
    assert_within("decoded output", np.concatenate(outs, axis=1), y_ref, tol["output"])
