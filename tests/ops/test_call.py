"""``dcmha.call``: the frozen description of an attention call, its checks and helpers.

``describe`` reads shapes and dtype names only, so most cases use NumPy arrays (marked
``backend_independent``: tools/test_all.py runs them once, in the keras-numpy step); the
cases that read a dtype's name also run on the tensors of the process's Keras backend
(KERAS_BACKEND=jax|torch|tensorflow|numpy), whose dtype objects differ.
"""

import dataclasses
import re

import numpy as np
import pytest

from keras import ops

from dcmha.call import block_rows, check_positive_int, check_terms, describe, shape_of, shapes_agree
from dcmha.spec import terms as spec_terms

B, T, S, N, N_kv, d, d_v = 2, 3, 5, 6, 3, 4, 7


def f32(*shape):
    return np.zeros(shape, np.float32)


Q, K, V = f32(B, T, N, d), f32(B, S, N_kv, d), f32(B, S, N_kv, d_v)


def raises(error, message):
    return pytest.raises(error, match="^" + re.escape(message) + "$")


# ---------------------------------------------------------------------------
# check_positive_int
# ---------------------------------------------------------------------------

@pytest.mark.backend_independent
@pytest.mark.parametrize("value", [1, 7, np.int32(3), np.int64(2)])
def test_check_positive_int_accepts(value):
    assert check_positive_int("size", value) is None
    assert check_positive_int("size", value, allow_none=True) is None


@pytest.mark.backend_independent
def test_check_positive_int_accepts_none_when_allowed():
    assert check_positive_int("size", None, allow_none=True) is None


@pytest.mark.backend_independent
@pytest.mark.parametrize("value", [0, -3, 2.0, True, False, "4", None, np.int64(0), [2]])
def test_check_positive_int_refuses(value):
    with raises(ValueError, f"`size` must be a positive integer. Received: size={value!r}"):
        check_positive_int("size", value)
    if value is not None:
        with raises(ValueError, "`size` must be None or a positive integer. "
                                f"Received: size={value!r}"):
            check_positive_int("size", value, allow_none=True)


# ---------------------------------------------------------------------------
# shapes_agree and shape_of
# ---------------------------------------------------------------------------

@pytest.mark.backend_independent
@pytest.mark.parametrize("a, b, agree", [
    ((), (), True), ((2, 3), (2, 3), True), ((2, 3), [2, 3], True),
    ((2, None), (2, 5), True), ((None, 3), (4, None), True), ((None,), (None,), True),
    ((2, 3), (2, 4), False), ((2, 3), (2, 3, 1), False), ((2,), (), False),
    ((None, 3), (None, 4), False)])
def test_shapes_agree(a, b, agree):
    assert shapes_agree(a, b) is agree
    assert shapes_agree(b, a) is agree


@pytest.mark.backend_independent
def test_shape_of():
    assert shape_of(f32(2, 3)) == (2, 3)

    class Symbolic:
        shape = (np.int64(2), None, "L", True, 4)

    assert shape_of(Symbolic()) == (2, None, None, None, 4)


@pytest.mark.backend_independent
@pytest.mark.parametrize("batch, heads, length, block_bytes, smallest, largest", [
    (1, 1, 1, 4 * 1024, 16, 1024), (1, 1, 1, 4 * 100, 16, 1024), (2, 4, 64, 4 * 2048, 16, 1024),
    (1, 1, 1, 1, 16, 1024), (1, 1, 1, 4 * 5000, 16, None), (1, 1, 1, 4 * 5000, 16, 256),
    (1, 1, 1, 4 * 3, 1, 1024), (3, 5, 7, 4 * 3 * 5 * 7 * 40, 4, 64)])
def test_block_rows(batch, heads, length, block_bytes, smallest, largest):
    rows = block_rows(batch, heads, length, block_bytes, smallest=smallest,
                      largest=largest)
    row_bytes = 4 * batch * heads * length          # one float32 (B, N, 1, S) row
    assert rows & (rows - 1) == 0                    # a power of two
    assert smallest <= rows and (largest is None or rows <= largest)
    assert rows == smallest or rows * row_bytes <= block_bytes      # fits from below ...
    assert rows == largest or 2 * rows * row_bytes > block_bytes    # ... and is the closest


# ---------------------------------------------------------------------------
# describe: the description
# ---------------------------------------------------------------------------

@pytest.mark.backend_independent
def test_describe_sizes_and_defaults():
    call = describe(Q, K, V, num_groups=3)
    assert (call.B, call.T, call.S, call.N, call.N_kv, call.d, call.d_v) == (
        B, T, S, N, N_kv, d, d_v)
    assert (call.G, call.M, call.length_product) == (3, 2, T * S)
    assert call.ranks == () and call.mask_kind is None and call.static_offset == 0
    assert call.needs == frozenset() and call.stages == {} and call.terms == frozenset()
    assert call.pre is None and call.post is None and not call.one_query
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.T = 4


@pytest.mark.backend_independent
def test_describe_terms_and_ranks():
    G, M = 3, 2
    pre = {"qw1": f32(B, T, G, 2, M), "qw2": f32(B, T, G, 2, M), "kdd": f32(B, S, G, M)}
    post = {"kw1": f32(B, S, G, 1, M), "kw2": f32(B, S, G, 1, M), "static": f32(G, M, M)}
    call = describe(Q, K, V, num_groups=G, pre=pre, post=post)
    assert call.ranks == (1, 2)
    assert call.stages == {"pre": pre, "post": post}
    assert call.terms == frozenset(pre) | frozenset(post)
    assert check_terms("pre", pre, B, T, S, G, M) == 2
    assert check_terms("post", {"static": f32(G, M, M)}, B, T, S, G, M) is None
    assert describe(Q, K, V, pre={}, post=None).stages == {}


@pytest.mark.backend_independent
@pytest.mark.parametrize("kwargs, needs", [
    (dict(return_attention_scores=True), {"attention_scores"}),
    (dict(return_intermediates=True), {"intermediates"}),
    (dict(dropout_rate=0.1, training=True), {"dropout"}),
    (dict(dropout_rate=0.1, training=False), set()),
    (dict(attention_mask=np.ones((B, N, T, S), bool)), {"head_masks"}),
    (dict(attention_mask=np.ones((B, 1, T, S), bool)), set()),
    (dict(query_offset=2), set()),
    (dict(query_offset=2, use_causal_mask=True), {"query_offset"}),
    (dict(query_offset=2, sliding_window=2), {"query_offset"}),
    (dict(query_offset=np.array(2, np.int32), use_causal_mask=True), {"traced_offset"})])
def test_describe_needs(kwargs, needs):
    from dcmha import registry
    call = describe(Q, K, V, **kwargs)
    assert call.needs == frozenset(needs)
    assert call.needs <= registry.CAPABILITIES


@pytest.mark.backend_independent
def test_describe_unknown_sizes_need_symbolic_shapes():
    class Symbolic:
        def __init__(self, shape):
            self.shape = shape
            self.dtype = np.dtype("float32")

    call = describe(Symbolic((B, None, N, d)), K, V)
    assert call.T is None and call.length_product is None
    assert call.needs == frozenset({"symbolic_shapes"})


@pytest.mark.backend_independent
@pytest.mark.parametrize("kwargs, mask_kind, offset", [
    (dict(attention_mask=np.ones((T, S), np.int32)), "shared", 0),
    (dict(attention_mask=np.ones((B, N, T, S), bool)), "per_head", 0),
    (dict(attention_mask=np.ones((B, 1, 1, S), bool)), "shared", 0),
    (dict(query_offset=np.int64(4)), None, 4),
    (dict(query_offset=np.array(4, np.int64)), None, None)])
def test_describe_mask_kind_and_offset(kwargs, mask_kind, offset):
    call = describe(Q, K, V, **kwargs)
    assert call.mask_kind == mask_kind and call.static_offset == offset


@pytest.mark.backend_independent
def test_describe_one_query():
    q1 = f32(B, 1, N, d)
    assert describe(q1, K, V).one_query
    assert describe(q1, K, V, dropout_rate=0.5).one_query
    for kwargs in (dict(return_attention_scores=True), dict(return_intermediates=True),
                   dict(dropout_rate=0.5, training=True)):
        assert not describe(q1, K, V, **kwargs).one_query


@pytest.mark.backend_independent
def test_arguments_round_trip():
    kwargs = dict(num_groups=3, pre={"qdd": f32(B, T, 3, 2)}, post=None,
                  attention_mask=np.ones((B, T, S), bool), use_causal_mask=True,
                  sliding_window=2, query_offset=1, query_chunk_size=4, dropout_rate=0.25,
                  seed=7, training=True, return_attention_scores=True,
                  return_intermediates=False, auto_chunk=False)
    call = describe(Q, K, V, **kwargs)
    args = call.arguments()
    assert set(args) == {"q", "k", "v"} | set(kwargs)
    assert args["q"] is Q and args["k"] is K and args["v"] is V
    for name, value in kwargs.items():
        assert args[name] is value or args[name] == value, name
    assert describe(**args) == call


# ---------------------------------------------------------------------------
# describe: each bad argument's message
# ---------------------------------------------------------------------------

BAD = [
    # q, k, v
    ((list(Q.shape), K, V), {}, TypeError,
     "`q` must be an array of rank 4 (B, T, N, d). Received: list"),
    ((Q, None, V), {}, TypeError,
     "`k` must be an array of rank 4 (B, S, N_kv, d). Received: NoneType"),
    ((Q, K, 3.0), {}, TypeError,
     "`v` must be an array of rank 4 (B, S, N_kv, d_v). Received: float"),
    ((f32(B, T, N), K, V), {}, ValueError,
     f"`q` must have rank 4 (B, T, N, d). Received: q.shape={(B, T, N)}"),
    ((Q, f32(1, B, S, N_kv, d), V), {}, ValueError,
     f"`k` must have rank 4 (B, S, N_kv, d). Received: k.shape={(1, B, S, N_kv, d)}"),
    ((Q, K, f32(B, S, N_kv)), {}, ValueError,
     f"`v` must have rank 4 (B, S, N_kv, d_v). Received: v.shape={(B, S, N_kv)}"),
    ((Q, f32(B, S, N_kv, d + 1), V), {}, ValueError,
     f"`q` and `k` must have the same head size d. Received: q.shape={Q.shape}, "
     f"k.shape={(B, S, N_kv, d + 1)}"),
    ((Q, K, f32(B, S, 1, d_v)), {}, ValueError,
     "`k` and `v` must have the same batch, length and heads (B, S, N_kv). Received: "
     f"k.shape={K.shape}, v.shape={(B, S, 1, d_v)}"),
    ((f32(1, T, N, d), K, V), {}, ValueError,
     f"`q` and `k` must have the same batch size. Received: q.shape={(1, T, N, d)}, "
     f"k.shape={K.shape}"),
    ((f32(B, T, 0, d), K, V), {}, ValueError,
     f"`q` and `k` must have at least one head. Received: q.shape={(B, T, 0, d)}, "
     f"k.shape={K.shape}"),
    ((f32(B, T, 4, d), K, V), {}, ValueError,
     f"The heads of `q` (N=4) must be a multiple of the heads of `k` (N_kv={N_kv}). "
     f"Received: q.shape={(B, T, 4, d)}, k.shape={K.shape}"),
    # num_groups
    ((Q, K, V), dict(num_groups=2.0), ValueError,
     "`num_groups` must be a positive integer. Received: num_groups=2.0"),
    ((Q, K, V), dict(num_groups=4), ValueError,
     f"`num_groups` must divide the number of heads N={N}. Received: num_groups=4"),
    # flags and sizes
    ((Q, K, V), dict(dropout_rate=True), ValueError,
     "`dropout_rate` must be a float in [0, 1). Received: dropout_rate=True"),
    ((Q, K, V), dict(dropout_rate=1.0), ValueError,
     "`dropout_rate` must be a float in [0, 1). Received: dropout_rate=1.0"),
    ((Q, K, V), dict(dropout_rate="0.1"), ValueError,
     "`dropout_rate` must be a float in [0, 1). Received: dropout_rate='0.1'"),
    ((Q, K, V), dict(sliding_window=-1), ValueError,
     "`sliding_window` must be None or a positive integer. Received: sliding_window=-1"),
    ((Q, K, V), dict(query_chunk_size=2.5), ValueError,
     "`query_chunk_size` must be None or a positive integer. Received: query_chunk_size=2.5"),
    ((Q, K, V), dict(query_offset=1.0), ValueError,
     "`query_offset` must be a non-negative integer. Received: query_offset=1.0"),
    ((Q, K, V), dict(query_offset=True), ValueError,
     "`query_offset` must be a non-negative integer. Received: query_offset=True"),
    ((Q, K, V), dict(query_offset=np.array([1], np.int32)), ValueError,
     "`query_offset` must be an integer or an integer scalar tensor. Received: "
     "query_offset.shape=(1,), query_offset.dtype=int32"),
    # attention_mask
    ((Q, K, V), dict(attention_mask=[[True]]), TypeError,
     "`attention_mask` must be a boolean tensor (True = attend). Received: list"),
    ((Q, K, V), dict(attention_mask=np.ones((T, S), np.float64)), TypeError,
     "`attention_mask` must be boolean (True = attend) or integer (1 = attend). "
     "Received: attention_mask.dtype=float64"),
    ((Q, K, V), dict(attention_mask=np.ones((B, T, S + 1), bool)), ValueError,
     f"`attention_mask` must broadcast to (B, T, S) = {(B, T, S)}. "
     f"Received: attention_mask.shape={(B, T, S + 1)}"),
    ((Q, K, V), dict(attention_mask=np.ones((1, B, T, S), bool)), ValueError,
     "A rank-4 `attention_mask` must have a head axis of size 1 (shared by all heads) or "
     f"N={N} (one mask per head). Received: attention_mask.shape={(1, B, T, S)}"),
    ((Q, K, V), dict(attention_mask=np.ones((B, N, T + 1, S), bool)), ValueError,
     f"`attention_mask` must broadcast to (B, T, S) = {(B, T, S)} or (B, N, T, S) = "
     f"{(B, N, T, S)}. Received: attention_mask.shape={(B, N, T + 1, S)}"),
    ((Q, K, V), dict(attention_mask=np.ones((1, 1, 1, 1, 1), bool)), ValueError,
     f"`attention_mask` must broadcast to (B, T, S) = {(B, T, S)}. "
     "Received: attention_mask.shape=(1, 1, 1, 1, 1)"),
    # compose terms
    ((Q, K, V), dict(pre=[("qdd", f32(B, T, 1, N))]), TypeError,
     "`pre` must be None or a dict of compose terms. Received: list"),
    ((Q, K, V), dict(post={"qdd": 1.0}), TypeError,
     "`post['qdd']` must be an array. Received: float"),
    ((Q, K, V), dict(post={"kdd": f32(B, S, 1, N), "bad": 1.0}), ValueError,
     "`post` has unknown compose terms ['bad']. Expected a subset of "
     f"{sorted(spec_terms.TERM_NAMES)}"),
    ((Q, K, V), dict(pre={"kw2": f32(B, S, 1, 2, N)}), ValueError,
     "`pre` must have both 'kw1' and 'kw2' or neither. Received: ['kw2']"),
    ((Q, K, V), dict(num_groups=2, pre={"kw1": f32(B, S, 2, 2, 2), "kw2": f32(B, S, 2, 2, 3)}),
     ValueError,
     f"`pre['kw1']` must have shape (B, S, G, R, M) = ({B}, {S}, 2, R, 3). "
     f"Received: pre['kw1'].shape={(B, S, 2, 2, 2)}"),
    ((Q, K, V), dict(post={"qdd": f32(B, S, 1, N)}), ValueError,
     f"`post['qdd']` must have shape (B, T, G, M) = ({B}, {T}, 1, {N}). "
     f"Received: post['qdd'].shape={(B, S, 1, N)}"),
]


@pytest.mark.backend_independent
@pytest.mark.parametrize("args, kwargs, error, message", BAD)
def test_describe_refuses(args, kwargs, error, message):
    with raises(error, message):
        describe(*args, **kwargs)


# ---------------------------------------------------------------------------
# dtype names of this backend's tensors
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bool", "int32", "uint8"])
def test_backend_masks_are_accepted(dtype):
    mask = ops.convert_to_tensor(np.ones((B, T, S)), dtype)
    assert describe(Q, K, V, attention_mask=mask).mask_kind == "shared"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_backend_float_masks_are_refused(dtype):
    mask = ops.convert_to_tensor(np.ones((B, T, S)), dtype)
    with raises(TypeError, "`attention_mask` must be boolean (True = attend) or integer "
                           f"(1 = attend). Received: attention_mask.dtype={dtype}"):
        describe(Q, K, V, attention_mask=mask)


def test_backend_offsets():
    offset = ops.convert_to_tensor(3, "int32")
    assert describe(Q, K, V, query_offset=offset).static_offset is None
    with raises(ValueError, "`query_offset` must be an integer or an integer scalar tensor. "
                            "Received: query_offset.shape=(), query_offset.dtype=float32"):
        describe(Q, K, V, query_offset=ops.convert_to_tensor(3.0, "float32"))
