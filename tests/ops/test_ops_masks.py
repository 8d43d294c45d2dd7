"""The masks of the functional core (``dcmha.ops.core``) against the spec.

Every mask here is compared with the spec's position rule (SPEC.md, "Masks"), written out
in NumPy below one query and key at a time, independently of ``dcmha.spec.terms.visible``
(which ``block_mask`` and the spec's ``reference.make_mask`` both apply): query t sits at
absolute position pos(t) = query_offset + t, key s at s; causal keeps s <= pos(t), a window
W keeps |pos(t) - s| < W; a caller's mask (True = attend) is and-ed in. The spec's own
``make_mask`` is checked against the same rule. Masks are booleans, compared exactly.

Runs on the Keras backend of the process (KERAS_BACKEND=jax|torch|tensorflow|numpy); the
checks of the spec's own mask and of ``key_range`` with integer offsets touch no Keras
tensor (marked ``backend_independent``: tools/test_all.py runs them once, in keras-numpy).
"""

import itertools

import numpy as np
import pytest

import keras
from keras import ops

from dcmha.ops import core
from dcmha.spec import reference
from dcmha.spec import terms as spec_terms

T, S = 7, 9
#: (t0, t1, s0, s1): whole, a query block, a key block, one query, an inner block.
BLOCKS = [(0, T, 0, S), (2, 5, 0, S), (0, T, 3, 8), (4, 5, 0, S), (1, 6, 2, 7)]
RULES = [dict(use_causal_mask=c, sliding_window=w, query_offset=o)
         for c, w, o in itertools.product([False, True], [None, 1, 3], [0, 2])
         if c or w is not None]


def np_(x):
    return None if x is None else ops.convert_to_numpy(x)


def expected(B, rule, block, attention_mask=None):
    """The (B, t, s) mask of ``block`` by the spec's rule, one query and key at a time."""
    t0, t1, s0, s1 = block
    out = np.ones((B, T, S), bool)
    if attention_mask is not None:
        out &= np.broadcast_to(attention_mask, (B, T, S))
    W = rule["sliding_window"]
    for t in range(T):
        pos = rule["query_offset"] + t
        for s in range(S):
            if rule["use_causal_mask"] and not s <= pos:
                out[:, t, s] = False
            if W is not None and not abs(pos - s) < W:
                out[:, t, s] = False
    return out[:, t0:t1, s0:s1]


@pytest.mark.backend_independent
@pytest.mark.parametrize("rule", RULES)
def test_the_spec_mask_is_the_rule(rule, rng):
    m = rng.random((2, T, S)) < 0.6
    np.testing.assert_array_equal(reference.make_mask(2, T, S, attention_mask=m, **rule),
                                  expected(2, rule, BLOCKS[0], m))


# ---------------------------------------------------------------------------
# block_mask
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("rule", RULES, ids=lambda r: "-".join(f"{k[:6]}{v}" for k, v in
                                                               r.items()))
def test_block_mask_follows_the_position_rule(rule, block):
    got = np_(core.block_mask(None, *block, **rule))
    want = expected(1, rule, block)
    assert got.dtype == bool
    assert got.shape == want.shape == (1, block[1] - block[0], block[3] - block[2])
    np.testing.assert_array_equal(got, want)


@pytest.mark.backend_independent
def test_block_mask_without_a_rule_or_a_mask_is_none():
    assert core.block_mask(None, 0, T, 0, S, use_causal_mask=False, sliding_window=None,
                            query_offset=3) is None


@pytest.mark.parametrize("block", BLOCKS[:3])
def test_block_mask_takes_a_tensor_offset(block):
    rule = dict(use_causal_mask=True, sliding_window=3, query_offset=2)
    got = np_(core.block_mask(None, *block, **{**rule, "query_offset":
                                                 ops.convert_to_tensor(2, "int32")}))
    np.testing.assert_array_equal(got, expected(1, rule, block))


@pytest.mark.parametrize("shape", [(2, T, S), (1, T, S), (2, 1, S), (2, T, 1), (1, 1, 1)])
@pytest.mark.parametrize("rule", [dict(use_causal_mask=False, sliding_window=None,
                                       query_offset=0), RULES[-1]], ids=["mask", "mask+rule"])
@pytest.mark.parametrize("block", [BLOCKS[0], BLOCKS[4]])
def test_block_mask_joins_a_shared_mask(shape, rule, block, rng):
    m = rng.random(shape) < 0.6
    got = np_(core.block_mask(core.standardize_mask(ops.convert_to_tensor(m)), *block,
                               **rule))
    want = expected(2, rule, block, attention_mask=m)
    # Broadcast (size-1) axes of the caller's mask stay size 1.
    t, s = block[1] - block[0], block[3] - block[2]
    rule_on = rule["use_causal_mask"] or rule["sliding_window"] is not None
    assert got.shape == (shape[0], t if rule_on or shape[1] != 1 else 1,
                         s if rule_on or shape[2] != 1 else 1)
    np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


@pytest.mark.parametrize("rule", [dict(use_causal_mask=False, sliding_window=None,
                                       query_offset=0), RULES[-1]], ids=["mask", "mask+rule"])
@pytest.mark.parametrize("block", [BLOCKS[0], BLOCKS[4]])
def test_block_mask_joins_a_per_head_mask(rule, block, rng):
    B, N = 2, 3
    m = rng.random((B, N, T, S)) < 0.6
    got = np_(core.block_mask(core.standardize_mask(ops.convert_to_tensor(m)), *block,
                               **rule))
    t0, t1, s0, s1 = block
    assert got.shape == (B, N, t1 - t0, s1 - s0)
    for n in range(N):
        np.testing.assert_array_equal(got[:, n], expected(B, rule, block, m[:, n]))


# ---------------------------------------------------------------------------
# standardize_mask and the layouts of the core
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape, out", [
    ((S,), (1, 1, S)), ((T, S), (1, T, S)), ((2, T, S), (2, T, S)),
    ((2, 1, T, S), (2, T, S)), ((2, 3, T, S), (2, 3, T, S)), ((1, 3, 1, S), (1, 3, 1, S))])
@pytest.mark.parametrize("dtype", ["bool", "int32"])
def test_standardize_mask(shape, out, dtype, rng):
    m = (rng.random(shape) < 0.5).astype(dtype) * (3 if dtype == "int32" else 1)
    got = core.standardize_mask(ops.convert_to_tensor(m))
    assert keras.backend.standardize_dtype(got.dtype) == "bool"
    assert tuple(got.shape) == out
    np.testing.assert_array_equal(np_(got), (m != 0).reshape(out))


def test_standardize_mask_of_none_is_none():
    assert core.standardize_mask(None) is None


@pytest.mark.parametrize("shape", [(2, 5, T, S), (2, 5, 1, S), (2, 1, T, 1)])
def test_slice_mask_cuts_only_full_axes(shape, rng):
    m = rng.random(shape) < 0.5
    got = np_(core._slice_mask(ops.convert_to_tensor(m), 1, 4, 2, 6))
    rows = slice(1, 4) if shape[-2] != 1 else slice(None)
    cols = slice(2, 6) if shape[-1] != 1 else slice(None)
    np.testing.assert_array_equal(got, m[..., rows, cols])


@pytest.mark.parametrize("shape", [(2, T, S), (2, 6, T, S)])
def test_mask5_is_the_query_major_layout(shape, rng):
    G = 2
    m = rng.random(shape) < 0.5
    got = np_(core._mask5(ops.convert_to_tensor(m), G))
    if len(shape) == 3:
        want = m[:, :, None, None, :]                                  # (B, t, 1, 1, s)
    else:
        B, N = shape[:2]                                               # (B, t, G, M, s)
        want = m.reshape(B, G, N // G, T, S).transpose(0, 3, 1, 2, 4)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape", [(2, T, S), (2, 3, T, S)])
def test_visible_rows(shape, rng):
    m = rng.random(shape) < 0.2
    m[..., 1, :] = False                                  # a row that sees nothing
    got = np_(core._visible_rows(ops.convert_to_tensor(m)))
    rows = m.any(axis=-1).astype(np.float32)
    want = rows[:, :, None] if len(shape) == 3 else rows.transpose(0, 2, 1)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------
# key_range
# ---------------------------------------------------------------------------

@pytest.mark.backend_independent
@pytest.mark.parametrize("block", [b[:2] for b in BLOCKS])
@pytest.mark.parametrize("rule", RULES + [dict(use_causal_mask=False, sliding_window=None,
                                                query_offset=0)])
def test_key_range_holds_exactly_the_visible_keys(rule, block):
    t0, t1 = block
    s0, s1 = core.key_range(t0, t1, S, **rule)
    seen = np.flatnonzero(expected(1, rule, (t0, t1, 0, S))[0].any(axis=0))
    if seen.size:
        assert (s0, s1) == (seen[0], seen[-1] + 1)
    else:
        assert s1 <= s0
    assert (s0, s1) == spec_terms.key_range(t0, t1, S, causal=rule["use_causal_mask"],
                                            window=rule["sliding_window"],
                                            offset=rule["query_offset"])


def test_key_range_with_a_tensor_offset_is_every_key():
    assert core.key_range(2, 5, S, use_causal_mask=True, sliding_window=2,
                           query_offset=ops.convert_to_tensor(3, "int32")) == (0, S)
