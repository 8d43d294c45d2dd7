"""Bad input to every public entry point fails early with a precise ValueError/TypeError.

Entry points: ``DCMHA.__init__`` / ``build`` / ``call`` / ``load_spec_weights``,
``dcmha.ops``, the conformance loader (``dcmha.conformance.cases``), the ONNX
exporter (``dcmha.export.to_onnx``) and the checkpoint converter
(``dcmha.checkpoints.from_official_state_dict``). Every message names the
argument and states the expected and the received value; each test asserts the
whole message. Runs on the Keras backend of the process
(KERAS_BACKEND=jax|torch|tensorflow).

Keras wraps an exception raised inside ``call`` in a longer text ("Exception
encountered when calling ..."); traceback filtering is switched off here so
the layer's own message can be matched exactly.
"""

import hashlib
import json
import re
import shutil

import numpy as np
import pytest

import keras
from keras import ops

from dcmha import ops as dops
from dcmha.layers import DCMHA

#: The implementation names the layer and dcmha.ops accept, as their error lists them.
IMPLEMENTATION_NAMES = "['auto', 'jax_cpu', 'jax_decode', 'ops', 'pallas', 'tf_cpu', 'tf_decode', 'torch', 'torch_decode', 'triton', 'xla']"

BACKEND = keras.backend.backend()


@pytest.fixture(autouse=True, scope="module")
def _plain_keras_errors():
    was = keras.config.is_traceback_filtering_enabled()
    keras.config.disable_traceback_filtering()
    yield
    if was:
        keras.config.enable_traceback_filtering()


def raises(error, message):
    """pytest.raises for exactly this type and this whole message."""
    return pytest.raises(error, match="^" + re.escape(message) + "$")


def f32(*shape):
    return np.zeros(shape, "float32")


@pytest.fixture(scope="module")
def layer():
    """A built DCMHA(4 heads, key_dim 8) for 16-wide inputs."""
    lay = DCMHA(num_heads=4, key_dim=8, name="att")
    lay.build((2, 3, 16), (2, 3, 16))
    return lay


# ---------------------------------------------------------------------------
# DCMHA.__init__
# ---------------------------------------------------------------------------

INIT_ERRORS = [
    (dict(num_heads=0),
     "Received an invalid value for argument `num_heads`, expected a positive integer. "
     "Received: num_heads=0"),
    (dict(num_heads=None),
     "Received an invalid value for argument `num_heads`, expected a positive integer. "
     "Received: num_heads=None"),
    (dict(num_heads=True),
     "Received an invalid value for argument `num_heads`, expected a positive integer. "
     "Received: num_heads=True"),
    (dict(key_dim=2.5),
     "Received an invalid value for argument `key_dim`, expected a positive integer. "
     "Received: key_dim=2.5"),
    (dict(num_groups=0), "`num_groups` must be a positive integer. Received: num_groups=0"),
    (dict(rank=-2), "`rank` must be a positive integer. Received: rank=-2"),
    (dict(value_dim=0),
     "Received an invalid value for argument `value_dim`, expected a positive integer or "
     "`None`. Received: value_dim=0"),
    (dict(num_key_value_heads=0), "`num_key_value_heads` must be None or a positive integer. "
                                  "Received: num_key_value_heads=0"),
    (dict(dynamic_hidden_dim=1.5), "`dynamic_hidden_dim` must be None or a positive integer. "
                                   "Received: dynamic_hidden_dim=1.5"),
    (dict(sliding_window=0), "`sliding_window` must be None or a positive integer. "
                             "Received: sliding_window=0"),
    (dict(query_chunk_size=-1), "`query_chunk_size` must be None or a positive integer. "
                                "Received: query_chunk_size=-1"),
    (dict(num_groups=3), "`num_heads` must be divisible by `num_groups`. "
                         "Received: num_heads=4, num_groups=3"),
    (dict(num_key_value_heads=3), "`num_heads` must be divisible by `num_key_value_heads`. "
                                  "Received: num_heads=4, num_key_value_heads=3"),
    (dict(dropout=1.0), "`dropout` must be a float in [0, 1). Received: dropout=1.0"),
    (dict(dropout=-0.5), "`dropout` must be a float in [0, 1). Received: dropout=-0.5"),
    (dict(dropout=float("nan")), "`dropout` must be a float in [0, 1). Received: dropout=nan"),
    (dict(dropout="0.1"), "`dropout` must be a float in [0, 1). Received: dropout='0.1'"),
    (dict(rope_max_wavelength=0.0),
     "`rope_max_wavelength` must be None or positive. Received: rope_max_wavelength=0.0"),
    (dict(rope_max_wavelength=float("inf")),
     "`rope_max_wavelength` must be finite. Received: rope_max_wavelength=inf"),
    (dict(rope_max_wavelength=float("nan")),
     "`rope_max_wavelength` must be finite. Received: rope_max_wavelength=nan"),
    (dict(key_dim=5, rope_max_wavelength=1e4), "RoPE needs an even `key_dim`. Received: key_dim=5"),
    (dict(qk_norm=None), "`qk_norm` must be a boolean. Received: qk_norm=None"),
    (dict(output_shape=-3),
     "Invalid `output_shape`: it must be None, a positive integer or a tuple of positive "
     "integers. Received: output_shape=-3"),
    (dict(implementation="flash"), "`implementation` must be one of "
                                   f"{IMPLEMENTATION_NAMES}. Received: implementation='flash'"),
    (dict(seed=1.5), "`seed` must be None or an integer. Received: seed=1.5"),
]


@pytest.mark.parametrize("kwargs, message", INIT_ERRORS,
                         ids=[f"{next(iter(k))}={next(iter(k.values()))!r}"
                              for k, _ in INIT_ERRORS])
def test_init(kwargs, message):
    with raises(ValueError, message):
        DCMHA(**{**dict(num_heads=4, key_dim=8), **kwargs})


# ---------------------------------------------------------------------------
# DCMHA.build
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("shapes, message", [
    (((2, 16), (2, 3, 16)), "DCMHA expects `query` of shape (B, L, D) with a known D. "
                            "Received: query_shape=(2, 16)"),
    (((2, 3, None), (2, 3, 16)), "DCMHA expects `query` of shape (B, L, D) with a known D. "
                                 "Received: query_shape=(2, 3, None)"),
    (((2, 3, 16), (2, 3, 0)), "`value` must have a positive last dimension D. "
                              "Received: value_shape=(2, 3, 0)"),
    (((2, 3, 16), (2, 4, 16), (2, 5, 16)), "All dimensions of `value` and `key`, except the "
                                           "last one, must be equal. Received: "
                                           "value_shape=(2, 4, 16) and key_shape=(2, 5, 16)"),
    (((2, 3, 16), (2, 3, 12)), "Self-attention dynamic weights share one projection, so "
                               "`query` and `key` must have the same width. Received: query "
                               "width 16, key width 12; use cross_attention=True for separate "
                               "projections."),
])
def test_build(shapes, message):
    with raises(ValueError, message):
        DCMHA(num_heads=4, key_dim=8).build(*shapes)


# ---------------------------------------------------------------------------
# DCMHA.call
# ---------------------------------------------------------------------------

def test_call_rank_after_build(layer):
    with raises(ValueError, "`query` must have rank 3 (B, L, D). Received: query.shape=(3, 16)"):
        layer(f32(3, 16), f32(2, 3, 16))


def test_call_width_after_build(layer):
    with raises(ValueError, "`value` must have last dimension 16 (the layer was built for it). "
                            "Received: value.shape=(2, 3, 12)"):
        layer(f32(2, 3, 16), f32(2, 3, 12))


def test_call_key_value_lengths(layer):
    with raises(ValueError, "All dimensions of `value` and `key`, except the last one, must be "
                            "equal. Received: value.shape=(2, 3, 16) and key.shape=(2, 4, 16)"):
        layer(f32(2, 3, 16), f32(2, 3, 16), f32(2, 4, 16))


def test_call_batch_sizes(layer):
    with raises(ValueError, "`query`, `value` and `key` must have the same batch size. "
                            "Received: query.shape=(2, 3, 16), value.shape=(3, 3, 16), "
                            "key.shape=(3, 3, 16)"):
        layer(f32(2, 3, 16), f32(3, 3, 16))


@pytest.mark.parametrize("shape, message", [
    ((2, 3, 4), "`attention_mask` must broadcast to (B, T, S) = (2, 3, 3). "
                "Received: attention_mask.shape=(2, 3, 4)"),
    ((2, 5, 3), "`attention_mask` must broadcast to (B, T, S) = (2, 3, 3). "
                "Received: attention_mask.shape=(2, 5, 3)"),
    ((3, 3, 3), "`attention_mask` must broadcast to (B, T, S) = (2, 3, 3). "
                "Received: attention_mask.shape=(3, 3, 3)"),
    ((2, 1, 1, 3, 3), "`attention_mask` must broadcast to (B, T, S) = (2, 3, 3). "
                      "Received: attention_mask.shape=(2, 1, 1, 3, 3)"),
    ((2, 3, 3, 3), "A rank-4 `attention_mask` must have a head axis of size 1 (shared by "
                   "all heads) or N=4 (one mask per head). "
                   "Received: attention_mask.shape=(2, 3, 3, 3)"),
])
def test_call_mask_shape(layer, shape, message):
    with raises(ValueError, message):
        layer(f32(2, 3, 16), f32(2, 3, 16), attention_mask=np.ones(shape, bool))


def test_call_mask_dtype(layer):
    # Float masks attend where non-zero, as in MultiHeadAttention; other dtypes are refused.
    with raises(TypeError, "`attention_mask` must be boolean, integer or float (non-zero = "
                           "attend). Received: attention_mask.dtype=complex64"):
        layer(f32(2, 3, 16), f32(2, 3, 16), attention_mask=np.ones((2, 3, 3), "complex64"))


def test_call_accepts_integer_and_broadcast_masks(layer):
    x = np.random.default_rng(0).standard_normal((2, 3, 16)).astype("float32")
    m = np.array([[1, 1, 0], [1, 0, 1], [0, 1, 1]])
    y_bool = layer(x, x, attention_mask=m.astype(bool))
    for mask in (m.astype("int32"), m.astype("uint8"), m[None].astype(bool), m[None, None] > 0):
        np.testing.assert_array_equal(ops.convert_to_numpy(layer(x, x, attention_mask=mask)),
                                      ops.convert_to_numpy(y_bool))


@pytest.mark.parametrize("name", ["use_causal_mask", "return_attention_scores"])
def test_call_flags(layer, name):
    with raises(ValueError, f"`{name}` must be a boolean. Received: {name}='yes'"):
        layer(f32(2, 3, 16), f32(2, 3, 16), **{name: "yes"})


@pytest.mark.parametrize("index, error, message", [
    (2, ValueError, "`cache_update_index` + the new length must be at most the cache length 4. "
                    "Received: cache_update_index=2, new length 3"),
    (-1, ValueError, "`cache_update_index` must be a non-negative integer. "
                     "Received: cache_update_index=-1"),
    (1.5, TypeError, "`cache_update_index` must be None, an integer or an integer scalar "
                     "tensor. Received: cache_update_index=1.5"),
    # NumPy values are converted to tensors by Keras before `call`.
    (np.float32(1), TypeError, "`cache_update_index` must be None, an integer or an integer "
                               "scalar tensor. Received: cache_update_index of dtype float32"),
    (np.array([1, 2]), TypeError, "`cache_update_index` must be None, an integer or an integer "
                                  "scalar tensor. Received: cache_update_index of shape (2,)"),
])
def test_call_cache_index(layer, index, error, message):
    cache = layer.init_cache(2, 4)
    with raises(error, message):
        layer(f32(2, 3, 16), f32(2, 3, 16), cache=cache, cache_update_index=index)


def test_call_cache_index_tensor_dtype(layer):
    cache = layer.init_cache(2, 4)
    with raises(TypeError, "`cache_update_index` must be None, an integer or an integer "
                           "scalar tensor. Received: cache_update_index of dtype float32"):
        layer(f32(2, 1, 16), f32(2, 1, 16), cache=cache,
              cache_update_index=ops.convert_to_tensor(np.float32(1)))


def test_call_cache_batch(layer):
    with raises(ValueError, "`cache` must have the batch size of `query`, 2. "
                            "Received: cache['key'].shape=(3, 4, 4, 8)"):
        layer(f32(2, 1, 16), f32(2, 1, 16), cache=layer.init_cache(3, 4), cache_update_index=0)


def test_call_cache_lengths(layer):
    cache = dict(layer.init_cache(2, 4), value=ops.zeros((2, 5, 4, 8)))
    with raises(ValueError, "Every `cache` entry must have the length S_max of cache['key'], 4. "
                            "Received: cache['value'].shape=(2, 5, 4, 8)"):
        layer(f32(2, 1, 16), f32(2, 1, 16), cache=cache, cache_update_index=0)


def test_call_cache_entry_shape(layer):
    cache = dict(layer.init_cache(2, 4), key=ops.zeros((2, 4, 4, 5)))
    with raises(ValueError, "`cache['key']` must have shape (B, S_max) + (4, 8). "
                            "Received: shape=(2, 4, 4, 5)"):
        layer(f32(2, 1, 16), f32(2, 1, 16), cache=cache, cache_update_index=0)


def test_call_cache_keys(layer):
    with raises(ValueError, "`cache` must be a dict with keys ['key', 'key_dd', 'key_w', "
                            "'value'] (see `init_cache`). Received: list"):
        layer(f32(2, 1, 16), f32(2, 1, 16), cache=[], cache_update_index=0)


# ---------------------------------------------------------------------------
# DCMHA.load_spec_weights
# ---------------------------------------------------------------------------

def test_load_spec_weights_not_a_mapping(layer):
    with raises(TypeError, "`weights` must be a mapping {canonical name: array}. "
                           "Received: list"):
        layer.load_spec_weights([("query_kernel", f32(16, 4, 8))])


def test_load_spec_weights_non_numeric(layer):
    weights = dict(layer.spec_weights(), dd=np.full((16, 1, 16), "x"))
    with raises(TypeError, "Weight 'dd' must be a real-valued array. Received: dtype <U1"):
        layer.load_spec_weights(weights)


def test_load_spec_weights_unknown_missing_misshaped(layer):
    good = layer.spec_weights()
    names = "['dd', 'dw1', 'key_kernel', 'output_kernel', 'qkw', 'query_kernel', 'value_kernel']"
    with raises(ValueError, "Unknown weight names for DCMHA layer 'att': ['static_pre']. "
                            f"Expected names: {names}"):
        layer.load_spec_weights(dict(good, static_pre=f32(1, 4, 4)))
    with raises(ValueError, f"Missing weights for DCMHA layer 'att': ['qkw']. "
                            f"Expected names: {names}"):
        layer.load_spec_weights({n: w for n, w in good.items() if n != "qkw"})
    with raises(ValueError, "Wrong shape for weight 'dw1': expected (16, 1, 4, 16), "
                            "received (16, 1, 4, 8)."):
        layer.load_spec_weights(dict(good, dw1=f32(16, 1, 4, 8)))


def test_load_spec_weights_unbuilt_needs_kernels():
    with raises(ValueError, "DCMHA layer 'fresh' is not built and cannot be built from these "
                            "weights: missing ['key_kernel', 'value_kernel']."):
        DCMHA(4, 8, name="fresh").load_spec_weights({"query_kernel": f32(16, 4, 8)})


# ---------------------------------------------------------------------------
# dcmha.ops
# ---------------------------------------------------------------------------

Q, K, V = f32(2, 3, 4, 8), f32(2, 5, 2, 8), f32(2, 5, 2, 6)


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((Q[0], K, V), {}, ValueError,
     "`q` must have rank 4 (B, T, N, d). Received: q.shape=(3, 4, 8)"),
    ((Q, K[0], V), {}, ValueError,
     "`k` must have rank 4 (B, S, N_kv, d). Received: k.shape=(5, 2, 8)"),
    ((Q, K, V[..., 0]), {}, ValueError,
     "`v` must have rank 4 (B, S, N_kv, d_v). Received: v.shape=(2, 5, 2)"),
    ((Q, K[..., :4], V), {}, ValueError,
     "`q` and `k` must have the same head size d. Received: q.shape=(2, 3, 4, 8), "
     "k.shape=(2, 5, 2, 4)"),
    ((Q, K, V[:, :4]), {}, ValueError,
     "`k` and `v` must have the same batch, length and heads (B, S, N_kv). Received: "
     "k.shape=(2, 5, 2, 8), v.shape=(2, 4, 2, 6)"),
    ((Q[:1], K, V), {}, ValueError,
     "`q` and `k` must have the same batch size. Received: q.shape=(1, 3, 4, 8), "
     "k.shape=(2, 5, 2, 8)"),
    ((Q, f32(2, 5, 3, 8), f32(2, 5, 3, 6)), {}, ValueError,
     "The heads of `q` (N=4) must be a multiple of the heads of `k` (N_kv=3). Received: "
     "q.shape=(2, 3, 4, 8), k.shape=(2, 5, 3, 8)"),
    ((Q, K, V), dict(num_groups=0), ValueError,
     "`num_groups` must be a positive integer. Received: num_groups=0"),
    ((Q, K, V), dict(num_groups=3), ValueError,
     "`num_groups` must divide the number of heads N=4. Received: num_groups=3"),
    ((Q, K, V), dict(dropout_rate=1.5), ValueError,
     "`dropout_rate` must be a float in [0, 1). Received: dropout_rate=1.5"),
    ((Q, K, V), dict(sliding_window=0), ValueError,
     "`sliding_window` must be None or a positive integer. Received: sliding_window=0"),
    ((Q, K, V), dict(query_chunk_size=0), ValueError,
     "`query_chunk_size` must be None or a positive integer. Received: query_chunk_size=0"),
    ((Q, K, V), dict(query_offset=-2), ValueError,
     "`query_offset` must be a non-negative integer. Received: query_offset=-2"),
    ((Q, K, V), dict(attention_mask=np.ones((2, 3, 4), bool)), ValueError,
     "`attention_mask` must broadcast to (B, T, S) = (2, 3, 5). "
     "Received: attention_mask.shape=(2, 3, 4)"),
    ((Q, K, V), dict(attention_mask=np.ones((2, 3, 5), "float32")), TypeError,
     "`attention_mask` must be boolean (True = attend) or integer (1 = attend). "
     "Received: attention_mask.dtype=float32"),
    ((Q, K, V), dict(pre={"foo": 1}), ValueError,
     "`pre` has unknown compose terms ['foo']. Expected a subset of "
     "['kdd', 'kw1', 'kw2', 'qdd', 'qw1', 'qw2', 'static']"),
    ((Q, K, V), dict(post={"qw1": f32(2, 3, 1, 2, 4)}), ValueError,
     "`post` must have both 'qw1' and 'qw2' or neither. Received: ['qw1']"),
    ((Q, K, V), dict(pre={"qw1": f32(2, 3, 1, 2, 3), "qw2": f32(2, 3, 1, 2, 3)}), ValueError,
     "`pre['qw1']` must have shape (B, T, G, R, M) = (2, 3, 1, R, 4). "
     "Received: pre['qw1'].shape=(2, 3, 1, 2, 3)"),
    ((Q, K, V), dict(pre={"qw1": f32(2, 3, 1, 2, 4), "qw2": f32(2, 3, 1, 1, 4)}), ValueError,
     "`pre['qw2']` must have shape (B, T, G, R, M) = (2, 3, 1, 2, 4). "
     "Received: pre['qw2'].shape=(2, 3, 1, 1, 4)"),
    ((Q, K, V), dict(pre={"kdd": f32(2, 3, 1, 4)}), ValueError,
     "`pre['kdd']` must have shape (B, S, G, M) = (2, 5, 1, 4). "
     "Received: pre['kdd'].shape=(2, 3, 1, 4)"),
    ((Q, K, V), dict(num_groups=2, post={"static": f32(1, 4, 4)}), ValueError,
     "`post['static']` must have shape (G, M, M) = (2, 2, 2). "
     "Received: post['static'].shape=(1, 4, 4)"),
    ((Q, K, V), dict(implementation="fast"), ValueError,
     f"`implementation` must be one of {IMPLEMENTATION_NAMES}. "
     "Received: implementation='fast'"),
])
def test_ops_dcmha_attention(args, kwargs, error, message):
    with raises(error, message):
        dops.dcmha_attention(*args, **kwargs)


@pytest.mark.parametrize("args, kwargs, message", [
    ((f32(4, 3, 3), 1), {}, "`a` must have rank 4 (B, N, T, S). Received: a.shape=(4, 3, 3)"),
    ((f32(2, 4, 3, 3), 3), {}, "`num_groups` must divide the number of heads N=4. "
                               "Received: num_groups=3"),
    ((f32(2, 4, 3, 3), 2), dict(qdd=f32(2, 3, 2, 4)),
     "`qdd` must have shape (B, T, G, M) = (2, 3, 2, 2). Received: qdd.shape=(2, 3, 2, 4)"),
])
def test_ops_compose(args, kwargs, message):
    with raises(ValueError, message):
        dops.compose(*args, **kwargs)


SLOTS = ("pre_query", "pre_key", "post_query", "post_key")


@pytest.mark.parametrize("args, kwargs, message", [
    ((f32(3, 16), f32(16, 1, 4, 8), f32(1, 4, 8, 4, 4)), dict(slots=SLOTS, rank=2),
     "`x` must have rank 3 (B, L, D). Received: x.shape=(3, 16)"),
    ((f32(2, 3, 16), f32(16, 1, 4, 8), None), dict(slots=SLOTS, rank=2),
     "`dw1` and `qkw` must be given together. Received: dw1.shape=(16, 1, 4, 8), qkw=None"),
    ((f32(2, 3, 16), f32(12, 1, 4, 8), f32(1, 4, 8, 4, 4)), dict(slots=SLOTS, rank=2),
     "`dw1` must have shape (D, G, C, K) = (16, G, 4, K) (D: the width of `x`, C: the number "
     "of slots). Received: dw1.shape=(12, 1, 4, 8)"),
    ((f32(2, 3, 16), f32(16, 1, 4, 8), f32(1, 4, 8, 4, 4)), dict(slots=SLOTS[:1], rank=2),
     "`dw1` must have shape (D, G, C, K) = (16, G, 1, K) (D: the width of `x`, C: the number "
     "of slots). Received: dw1.shape=(16, 1, 4, 8)"),
    ((f32(2, 3, 16), f32(16, 1, 4, 8), f32(1, 4, 8, 4, 4)), dict(slots=SLOTS, rank=3),
     "`qkw` must have shape (G, C, K, 2R, M) = (1, 4, 8, 6, M). "
     "Received: qkw.shape=(1, 4, 8, 4, 4)"),
    ((f32(2, 3, 16), None, None, f32(16, 1, 6)), dict(slots=SLOTS, rank=2),
     "`dd` must have shape (D, G, C*M) = (16, G, 4*M). Received: dd.shape=(16, 1, 6)"),
    ((f32(2, 3, 16), None, None, f32(16, 1, 8)), dict(slots=("pre_value",), rank=2),
     "`slots` must be a sequence of slot names from ('pre_query', 'pre_key', 'post_query', "
     "'post_key'). Received: slots=('pre_value',)"),
    ((f32(2, 3, 16), None, None, f32(16, 1, 8)), dict(slots=SLOTS, rank=0),
     "`rank` must be a positive integer. Received: rank=0"),
])
def test_ops_dynamic_weights(args, kwargs, message):
    with raises(ValueError, message):
        dops.dynamic_weights(*args, **kwargs)


def test_ops_rope():
    with raises(ValueError, "`x` must have rank 4 (B, L, H, d) with an even d. "
                            "Received: x.shape=(2, 3, 4, 5)"):
        dops.rope(f32(2, 3, 4, 5), np.arange(3), 100.0)
    with raises(ValueError, "`positions` must have shape (L,) = (3,). "
                            "Received: positions.shape=(4,)"):
        dops.rope(f32(2, 3, 4, 6), np.arange(4), 100.0)


# ---------------------------------------------------------------------------
# The conformance loader
# ---------------------------------------------------------------------------

@pytest.fixture
def fixtures(tmp_path):
    """A copy of one packaged case ("causal") with its own manifest; rehash(name) re-signs."""
    from dcmha.conformance import cases

    root = tmp_path / "fixtures"
    root.mkdir()
    manifest = json.loads((cases.FIXTURES_DIR / cases.MANIFEST_NAME).read_text())
    for f in ("causal.json", "causal.npz"):
        shutil.copy(cases.FIXTURES_DIR / f, root / f)
    manifest["files"] = {f: manifest["files"][f] for f in ("causal.json", "causal.npz")}
    (root / cases.MANIFEST_NAME).write_text(json.dumps(manifest))

    def rehash():
        m = json.loads((root / cases.MANIFEST_NAME).read_text())
        m["files"] = {f: hashlib.sha256((root / f).read_bytes()).hexdigest() for f in m["files"]}
        (root / cases.MANIFEST_NAME).write_text(json.dumps(m))

    return root, rehash


def _edit_json(path, fn):
    meta = json.loads(path.read_text())
    fn(meta)
    path.write_text(json.dumps(meta))


def _edit_npz(path, fn):
    with np.load(path) as z:
        arrays = dict(z)
    fn(arrays)
    np.savez(path, **arrays)


def test_loader_accepts_the_copy(fixtures):
    from dcmha.conformance import cases

    root, _ = fixtures
    assert [c.name for c in cases.load_cases(fixtures_dir=root)] == ["causal"]


def test_loader_flipped_byte(fixtures):
    from dcmha.conformance import cases

    root, _ = fixtures
    data = bytearray((root / "causal.npz").read_bytes())
    data[200] ^= 0xFF
    (root / "causal.npz").write_bytes(bytes(data))
    want = json.loads((root / "MANIFEST.json").read_text())["files"]["causal.npz"]
    got = hashlib.sha256(bytes(data)).hexdigest()
    with raises(ValueError, f"Fixture file {root / 'causal.npz'} does not match MANIFEST.json: "
                            f"expected sha256 {want}, received {got}. Restore it or regenerate "
                            "the fixtures with `python -m dcmha.conformance.generate`."):
        cases.load_cases(fixtures_dir=root)


def test_loader_manifest_not_json(fixtures):
    from dcmha.conformance import cases

    root, _ = fixtures
    (root / "MANIFEST.json").write_text("{broken")
    with raises(ValueError, f"{root / 'MANIFEST.json'} is not a valid manifest (a JSON object "
                            "with 'spec_version' and 'files'). Regenerate the fixtures with "
                            "`python -m dcmha.conformance.generate`."):
        cases.load_cases(fixtures_dir=root)


def test_loader_listed_file_missing(fixtures):
    from dcmha.conformance import cases

    root, _ = fixtures
    (root / "causal.npz").unlink()
    with raises(ValueError, f"Fixture file {root / 'causal.npz'} is listed in MANIFEST.json but "
                            "does not exist."):
        cases.load_cases(fixtures_dir=root)


def test_loader_case_json_not_json(fixtures):
    from dcmha.conformance import cases

    root, rehash = fixtures
    (root / "causal.json").write_text("{not json")
    rehash()
    with raises(ValueError, f"Fixture file {root / 'causal.json'} is not a valid case: "
                            "not a JSON object."):
        cases.load_cases(fixtures_dir=root)


def test_loader_case_json_missing_keys(fixtures):
    from dcmha.conformance import cases

    root, rehash = fixtures
    _edit_json(root / "causal.json", lambda m: (m.pop("tolerance"), m.pop("dims")))
    rehash()
    with raises(ValueError, f"Fixture file {root / 'causal.json'} is not a valid case: "
                            "missing keys ['dims', 'tolerance']."):
        cases.load_cases(fixtures_dir=root)


def test_loader_npz_not_an_archive(fixtures):
    from dcmha.conformance import cases

    root, rehash = fixtures
    (root / "causal.npz").write_bytes((root / "causal.npz").read_bytes()[:300])
    rehash()
    with raises(ValueError, f"Fixture file {root / 'causal.npz'} is not a readable .npz "
                            "archive: not a zip archive."):
        cases.load_cases(fixtures_dir=root)


def test_loader_params_do_not_match_config(fixtures):
    from dcmha.conformance import cases

    root, rehash = fixtures
    _edit_npz(root / "causal.npz", lambda a: a.pop("param/qkw"))
    rehash()
    with raises(ValueError, f"Fixture file {root / 'causal.npz'} does not fit its case: "
                            "missing arrays ['param/qkw']."):
        cases.load_cases(fixtures_dir=root)


def test_loader_param_shape_mismatch(fixtures):
    from dcmha.conformance import cases

    root, rehash = fixtures
    with np.load(root / "causal.npz") as z:
        shape = z["param/dw1"].shape
    _edit_npz(root / "causal.npz",
              lambda a: a.update({"param/dw1": a["param/dw1"][:, :, :3]}))
    rehash()
    short = shape[:2] + (3,) + shape[3:]
    with raises(ValueError, f"Fixture file {root / 'causal.npz'} does not fit its case: "
                            f"'param/dw1' has shape {short}, expected {shape}."):
        cases.load_cases(fixtures_dir=root)


def test_loader_expected_output_missing(fixtures):
    from dcmha.conformance import cases

    root, rehash = fixtures
    _edit_npz(root / "causal.npz", lambda a: a.pop("expected/output"))
    rehash()
    with raises(ValueError, f"Fixture file {root / 'causal.npz'} does not fit its case: "
                            "missing arrays ['expected/output']."):
        cases.load_cases(fixtures_dir=root)


def test_loader_bad_config(fixtures):
    from dcmha.conformance import cases

    root, rehash = fixtures
    _edit_json(root / "causal.json", lambda m: m["config"].update(num_heads=0))
    rehash()
    with raises(ValueError, f"Fixture file {root / 'causal.json'} is not a valid case: `config` "
                            "is not dcmha.spec.reference.Config's arguments (`num_heads` must be "
                            "a positive integer. Received: num_heads=0)."):
        cases.load_cases(fixtures_dir=root)


# ---------------------------------------------------------------------------
# The ONNX exporter
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, message", [
    (dict(opset="18"), ValueError, "`opset` must be an integer in [18, {top}]. "
                                   "Received: opset='18'"),
    (dict(dtype="bfloat16"), ValueError, "`dtype` must be one of ['float16', 'float32']; "
                                         "onnxruntime has no CPU kernels for other dtypes. "
                                         "Received: dtype='bfloat16'"),
    (dict(decode="yes"), ValueError, "`decode` must be a boolean. Received: decode='yes'"),
    (dict(dynamic=1), ValueError, "`dynamic` must be a boolean. Received: dynamic=1"),
    (dict(attention_mask=None), ValueError,
     "`attention_mask` must be a boolean. Received: attention_mask=None"),
    (dict(batch_size=0), ValueError, "`batch_size` must be a positive integer. "
                                     "Received: batch_size=0"),
    (dict(cache_length=-1), ValueError, "`cache_length` must be None or a positive integer. "
                                        "Received: cache_length=-1"),
    (dict(input_shapes=[(1, 3, 16)]), TypeError,
     "`input_shapes` must be None or a dict {input name: shape}. Received: list"),
    (dict(dynamic=False, input_shapes={"qury": (1, 3, 16)}), ValueError,
     "`input_shapes` names unknown inputs ['qury']. The inputs are ['query']."),
    (dict(dynamic=False, input_shapes={"query": (1, -3, 16)}), ValueError,
     "`input_shapes['query']` must hold positive integers or None. Received: (1, -3, 16)"),
    (dict(dynamic=False, input_shapes={"query": (1, 3, 12)}), ValueError,
     "`input_shapes['query']` must agree with the known shape (None, None, 16). "
     "Received: (1, 3, 12)"),
    (dict(decode=True, dynamic=False, input_shapes={"query": (1, 3, 16)}, cache_length=2),
     ValueError, "`cache_length` must be at least the query length 3. Received: cache_length=2"),
])
def test_exporter_options(layer, tmp_path, kwargs, error, message):
    import onnx

    from dcmha.export import to_onnx

    path = tmp_path / "m.onnx"
    with raises(error, message.replace("{top}", str(onnx.defs.onnx_opset_version()))):
        to_onnx(layer, path, **kwargs)
    assert not path.exists()


def test_exporter_path(layer, tmp_path):
    from dcmha.export import to_onnx

    with raises(TypeError, "`path` must be a str or os.PathLike. Received: NoneType"):
        to_onnx(layer, None)
    with raises(ValueError, f"`path` must be a file path, not a directory. Received: "
                            f"path={str(tmp_path)!r}"):
        to_onnx(layer, tmp_path)


def test_exporter_target(tmp_path):
    from dcmha.export import to_onnx

    with raises(ValueError, "DCMHA layer 'unbuilt' is not built yet: call it on inputs first."):
        to_onnx(DCMHA(4, 8, name="unbuilt"), tmp_path / "m.onnx")
    with raises(ValueError, "to_onnx exports a dcmha.DCMHA layer or a Keras model (functional "
                            "or Sequential). Received: builtins.str"):
        to_onnx("model", tmp_path / "m.onnx")


# ---------------------------------------------------------------------------
# The checkpoint converter
# ---------------------------------------------------------------------------

CKPT_CONFIG = dict(vocab_size=32, n_layer=1, n_head=4, dim=16, intermediate_size=32,
                   window_size=None)


@pytest.fixture(scope="module")
def state_dict():
    from dcmha import checkpoints
    from dcmha.models import DCFormerLM

    model = DCFormerLM(vocab_size=32, num_layers=1, hidden_dim=16, num_heads=4,
                       intermediate_dim=32, sliding_window=None)
    model.build((None, None))
    return checkpoints.to_official_state_dict(model)


@pytest.mark.parametrize("config, error, message", [
    (None, TypeError, "`config` must be a dict or an object with attributes (e.g. a "
                      "transformers config). Received: NoneType"),
    (dict(n_head=0), ValueError, "Config key 'n_head' must be a positive integer. Received: 0"),
    (dict(n_layer=1.0), ValueError,
     "Config key 'n_layer' must be a positive integer. Received: 1.0"),
    (dict(intermediate_size="32"), ValueError,
     "Config key 'intermediate_size' must be None or a positive integer. Received: '32'"),
    (dict(window_size=0), ValueError,
     "Config key 'window_size' must be None or a positive integer. Received: 0"),
    (dict(rope_base="x"), ValueError,
     "Config key 'rope_base' must be a positive number. Received: 'x'"),
    (dict(norm_eps=-1.0), ValueError,
     "Config key 'norm_eps' must be a positive number. Received: -1.0"),
    (dict(n_local_heads=3), ValueError,
     "Config 'n_local_heads' (3) must be -1 or divide 'n_head' (4)."),
])
def test_checkpoint_config(state_dict, config, error, message):
    from dcmha import checkpoints

    config = None if config is None else dict(CKPT_CONFIG, **config)
    with raises(error, message):
        checkpoints.from_official_state_dict(state_dict, config)


def test_checkpoint_state_dict_type():
    from dcmha import checkpoints

    with raises(TypeError, "`state_dict` must be a mapping {name: array or tensor}. "
                           "Received: list"):
        checkpoints.from_official_state_dict([], CKPT_CONFIG)


@pytest.mark.parametrize("edit, error, message", [
    (lambda sd: sd.pop("norm.weight"), ValueError,
     "Missing state_dict entry 'norm.weight' (expected shape (16,))."),
    (lambda sd: sd.update({"layers.0.attention.extra": f32(2)}), ValueError,
     "Unexpected state_dict entries (not part of the official DCFormer layout for this "
     "config): ['layers.0.attention.extra']"),
    (lambda sd: sd.update({"norm.weight": f32(15)}), ValueError,
     "state_dict['norm.weight'] has shape (15,); expected (16,) for this config."),
    (lambda sd: sd.update({"norm.weight": np.full(16, "a")}), TypeError,
     "state_dict['norm.weight'] must be a real-valued array or tensor. Received: dtype <U1"),
    (lambda sd: sd.update({"layers.0.attention.dyn_w_proj.dw1": f32(16, 3, 4, 8)}), ValueError,
     "state_dict['layers.0.attention.dyn_w_proj.dw1'] has shape (16, 3, 4, 8); expected "
     "(D, G, 4, K) with G dividing n_head=4."),
])
def test_checkpoint_entries(state_dict, edit, error, message):
    from dcmha import checkpoints

    sd = dict(state_dict)
    edit(sd)
    with raises(error, message):
        checkpoints.from_official_state_dict(sd, CKPT_CONFIG)
