"""Finite-difference checks of the hand-written NumPy backward (spec/reference_grad.py).

Every check compares an analytic gradient with a central difference of the
forward in ``spec/reference.py``, in float64.

Tolerance: with step h = 1e-6 the central difference has a truncation error
~ h^2 |f'''| ~ 1e-12 and a rounding error ~ 1e-16 |L| / h ~ 1e-10 |L|, so a
correct gradient agrees to about 1e-9 relative to the loss and gradient scale;
we allow |fd - analytic| <= RTOL * (|analytic| + scale) with RTOL = 1e-6 and
scale the typical size of the gradient. A wrong term (missing, transposed, wrong
sign or reduction) errs by the size of the term itself, >= 1e-2 relative here
since the composition weights are drawn far from the identity.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import numpy as np
import pytest

from dcmha.spec import reference as ref
from dcmha.spec import reference_grad as rg

H = 1e-6
RTOL = 1e-6


def _assert_close(fd, an, scale, what):
    err = abs(fd - an)
    assert err <= RTOL * (abs(an) + scale), (
        f"{what}: finite difference {fd!r} vs analytic {an!r} (error {err:.3e}, scale {scale:.3e})")


def _fd_at(loss, x, flat_index):
    x0 = x.flat[flat_index]
    x.flat[flat_index] = x0 + H
    lp = loss()
    x.flat[flat_index] = x0 - H
    lm = loss()
    x.flat[flat_index] = x0
    return (lp - lm) / (2 * H)


def check_grad(loss, x, g, what, rng=None, n_points=None):
    """Compare g = dloss/dx (x is perturbed in place) with central differences.

    All elements when ``n_points`` is None; otherwise one random direction
    (which involves every element) plus ``n_points`` random elements.
    """
    assert g.shape == x.shape, (what, g.shape, x.shape)
    assert np.all(np.isfinite(g)), what
    scale = float(np.max(np.abs(g))) + 1e-3
    if n_points is None:
        idx = range(x.size)
    else:
        v = rng.standard_normal(x.shape)
        x0 = x.copy()
        x[...] = x0 + H * v
        lp = loss()
        x[...] = x0 - H * v
        lm = loss()
        x[...] = x0
        _assert_close((lp - lm) / (2 * H), float(np.sum(g * v)),
                      scale * math.sqrt(x.size), f"{what} (random direction)")
        idx = rng.choice(x.size, size=min(n_points, x.size), replace=False)
    for i in idx:
        _assert_close(_fd_at(loss, x, int(i)), float(g.flat[int(i)]), scale,
                      f"{what}[{np.unravel_index(int(i), x.shape)}]")


# ---------------------------------------------------------------------------
# Primitives
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("approximate", [True, False])
def test_gelu_backward(approximate):
    rng = np.random.default_rng(1)
    x = np.concatenate([np.linspace(-4, 4, 17), rng.standard_normal(8)])
    g = rng.standard_normal(x.shape)
    an = rg.gelu_backward(x, g, approximate)
    # elementwise, so one vectorised central difference gives every entry
    fd = (ref.gelu(x + H, approximate) - ref.gelu(x - H, approximate)) / (2 * H) * g
    np.testing.assert_allclose(an, fd, rtol=RTOL, atol=RTOL)


@pytest.mark.parametrize("axis", [-1, 1])
def test_rms_normalize_backward(axis):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 4))
    x[0, 0] *= 1e-3                              # small rows: eps matters
    g = rng.standard_normal(x.shape)
    an = rg.rms_normalize_backward(x, g, 1e-6, axis=axis)
    check_grad(lambda: np.sum(ref.rms_normalize(x, 1e-6, axis=axis) * g), x, an, "x")


def test_rope_backward():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 2, 4))
    pos = np.arange(3) + 5
    g = rng.standard_normal(x.shape)
    an = rg.rope_backward(g, pos, 100.0)
    check_grad(lambda: np.sum(ref.rope(x, pos, 100.0) * g), x, an, "x")


@pytest.mark.parametrize("projection,gating", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("approximate", [True, False])
def test_dynamic_weights_backward(projection, gating, approximate):
    rng = np.random.default_rng(4)
    B, L, D, G, M, R, K = 2, 3, 5, 2, 2, 2, 5
    names = ("pre_query", "post_query", "post_key")
    C = len(names)
    x = rng.standard_normal((B, L, D))
    dw1 = rng.normal(0, 0.6, (D, G, C, K)) if projection else None
    qkw = rng.normal(0, 0.5, (G, C, K, 2 * R, M)) if projection else None
    dd = rng.normal(0, 0.6, (D, G, C * M)) if gating else None
    grads = {}
    for s in names[:2]:                          # "post_key": no gradient at all
        grads[s] = {}
        if projection:
            grads[s]["w1"] = rng.standard_normal((B, L, G, R, M))
            if s == "pre_query":                 # a missing entry is a zero gradient
                grads[s]["w2"] = rng.standard_normal((B, L, G, R, M))
        if gating:
            grads[s]["dd"] = rng.standard_normal((B, L, G, M))

    def loss():
        out = ref.dynamic_weights(x, dw1, qkw, dd, names, R, approximate)
        return sum(np.sum(out[s][e] * g) for s, ge in grads.items() for e, g in ge.items())

    g_x, g_dw1, g_qkw, g_dd = rg.dynamic_weights_backward(x, dw1, qkw, dd, names, R,
                                                          approximate, grads)
    assert (g_dw1 is None, g_qkw is None, g_dd is None) == (dw1 is None, qkw is None, dd is None)
    check_grad(loss, x, g_x, "x")
    for name, p, g in (("dw1", dw1, g_dw1), ("qkw", qkw, g_qkw), ("dd", dd, g_dd)):
        if p is not None:
            check_grad(loss, p, g, name)


COMPOSE_TERMS = [("static",), ("qw1", "qw2"), ("kw1", "kw2"), ("qdd",), ("kdd",),
                 ("static", "qw1", "qw2", "kw1", "kw2", "qdd", "kdd")]


@pytest.mark.parametrize("terms", COMPOSE_TERMS, ids=lambda t: "+".join(t))
def test_compose_backward(terms):
    rng = np.random.default_rng(5)
    B, N, T, S, G, R = 2, 4, 3, 5, 2, 2
    M = N // G
    shapes = {"qw1": (B, T, G, R, M), "qw2": (B, T, G, R, M), "kw1": (B, S, G, R, M),
              "kw2": (B, S, G, R, M), "qdd": (B, T, G, M), "kdd": (B, S, G, M),
              "static": (G, M, M)}
    kw = {n: rng.normal(0, 0.7, shapes[n]) for n in terms}
    a = rng.standard_normal((B, N, T, S))
    g_out = rng.standard_normal(a.shape)
    loss = lambda: np.sum(ref.compose(a, G, **kw) * g_out)
    g_a, g_terms = rg.compose_backward(a, g_out, G, **kw)
    assert set(g_terms) == set(terms)
    check_grad(loss, a, g_a, "a")
    for n in terms:
        check_grad(loss, kw[n], g_terms[n], n)
    # compose is W_ts^T a per (b,t,s), so the input gradient is W_ts g
    W = ref.compose_matrices(G, T, S, B, N, **kw)
    np.testing.assert_allclose(g_a, np.einsum("btsmn,bnts->bmts", W, g_out), rtol=1e-12,
                               atol=1e-12)


def test_masked_softmax_backward():
    rng = np.random.default_rng(6)
    B, N, T, S = 2, 3, 4, 5
    a = 3 * rng.standard_normal((B, N, T, S))
    mask = rng.random((B, T, S)) < 0.6
    mask[0, 1] = False                           # fully masked row
    mask[1, 2] = True
    g_p = rng.standard_normal(a.shape)
    p = ref.masked_softmax(a, mask)
    g_a = rg.masked_softmax_backward(p, g_p, mask)
    check_grad(lambda: np.sum(ref.masked_softmax(a, mask) * g_p), a, g_a, "a")
    assert np.all(g_a[np.broadcast_to(~mask[:, None], a.shape)] == 0.0)
    assert np.all(g_a[0, :, 1] == 0.0)


# ---------------------------------------------------------------------------
# The whole layer
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    cfg: dict
    call: str = "self"          # "self": (query); "value": (query, value); "kv": (query, key, value)
    B: int = 2
    T: int = 4
    S: int = 4                  # ignored for "self"
    Dq: int = 6
    Dkv: int = 6
    Dout: int = None
    mask: bool = False          # a random mask with a fully masked row
    causal: bool = False


_BASE = dict(num_heads=4, key_dim=4, num_groups=2, rank=2)
_ALL = dict(static_compose=True, qk_norm=True, rope_max_wavelength=50.0, use_bias=True,
            num_key_value_heads=2, value_dim=3, sliding_window=3, gelu_approximate=False)

CASES = [
    Case("default", {}),
    Case("no_compose", dict(pre_compose=False, post_compose=False)),
    Case("pre_only", dict(post_compose=False)),
    Case("post_only", dict(pre_compose=False)),
    Case("query_wise_only", dict(key_wise=False, dynamic_gating=False)),
    Case("key_wise_only", dict(query_wise=False, dynamic_gating=False)),
    Case("query_wise_only_gating", dict(key_wise=False)),
    Case("key_wise_only_gating", dict(query_wise=False)),
    Case("projection_only", dict(dynamic_gating=False)),
    Case("gating_only", dict(dynamic_projection=False)),
    Case("static_only", dict(static_compose=True, dynamic_projection=False, dynamic_gating=False)),
    Case("static_and_dynamic", dict(static_compose=True)),
    Case("one_group_rank1", dict(num_groups=1, rank=1)),
    Case("four_groups", dict(num_groups=4), B=1),
    Case("rank3_hidden5", dict(rank=3, dynamic_hidden_dim=5), B=1),
    Case("gqa", dict(num_key_value_heads=2)),
    Case("mqa_value_dim", dict(num_key_value_heads=1, value_dim=3)),
    Case("qk_norm", dict(qk_norm=True)),
    Case("rope", dict(rope_max_wavelength=50.0)),
    Case("bias", dict(use_bias=True)),
    Case("qk_norm_rope_bias", dict(qk_norm=True, rope_max_wavelength=50.0, use_bias=True)),
    Case("gelu_exact", dict(gelu_approximate=False)),
    Case("causal", {}, causal=True),
    Case("window", dict(sliding_window=2), T=5),
    Case("causal_window", dict(sliding_window=2), T=5, causal=True),
    Case("mask_full_row", {}, mask=True),
    Case("chunked", dict(query_chunk_size=2), T=5, causal=True),
    Case("self_separate_key_value", {}, call="kv", T=3, S=5),
    Case("self_value_only", {}, call="value", T=3, S=5),
    Case("cross", dict(cross_attention=True), call="kv", T=3, S=5, Dq=5, Dkv=6, Dout=3),
    Case("cross_value_only", dict(cross_attention=True), call="value", T=3, S=5, Dq=5),
    Case("cross_key_wise_only", dict(cross_attention=True, query_wise=False), call="kv",
         T=3, S=4, Dq=5),
    Case("cross_query_wise_only_gqa", dict(cross_attention=True, key_wise=False,
                                           num_key_value_heads=2), call="kv", T=3, S=4, Dq=5),
    Case("all_self", dict(_ALL, query_chunk_size=2), T=5, mask=True, causal=True),
    Case("all_self_kv", _ALL, call="kv", T=4, S=5, mask=True),
    Case("all_cross", dict(_ALL, cross_attention=True, gelu_approximate=True), call="kv",
         T=4, S=5, Dq=5, Dkv=6, Dout=3, mask=True, causal=True),
]


def _cases():
    return [c.values[0] if hasattr(c, "values") else c for c in CASES]


def make_params(cfg, Dq, Dkv, Dout, rng):
    """Canonical params with composition weights far from the identity.

    ``init_params(scale=...)`` multiplies every composition weight by one factor,
    but its base standard deviations differ by ~100x between dw1, qkw and dd, so
    no single factor puts all of them where compose mixes strongly without
    saturating GELU/tanh. We keep init_params' names and shapes and redraw those
    weights at fixed standard deviations; biases and norm scales are made
    non-trivial too so that their gradients are exercised.
    """
    params = ref.init_params(cfg, Dq, Dkv, Dout, rng=rng, scale=1.0)
    std = {"dw1": 0.6, "qkw": 0.4, "dd": 0.6, "static": 0.4, "bias": 0.2}
    for name, p in params.items():
        kind = next((k for k in std if name.endswith(k) or name.startswith(k)), None)
        if kind is not None:
            params[name] = rng.normal(0.0, std[kind], p.shape)
        elif name.endswith("norm_scale"):
            params[name] = 1.0 + 0.3 * rng.standard_normal(p.shape)
    return params


def setup_case(case):
    cfg = ref.Config(**{**_BASE, **case.cfg}).validate()
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    S = case.T if case.call == "self" else case.S
    Dkv = case.Dq if case.call == "self" else case.Dkv
    params = make_params(cfg, case.Dq, Dkv, case.Dout, rng)
    inputs = {"query": rng.standard_normal((case.B, case.T, case.Dq))}
    if case.call in ("value", "kv"):
        inputs["value"] = rng.standard_normal((case.B, S, Dkv))
    if case.call == "kv":
        inputs["key"] = rng.standard_normal((case.B, S, Dkv))
    mask = None
    if case.mask:
        mask = rng.random((case.B, case.T, S)) < 0.7
        mask[0, 1] = False                       # a fully masked query row
        mask[-1, 0, 0] = True
    d_out = rng.standard_normal((case.B, case.T, case.Dout or case.Dq))
    kwargs = dict(attention_mask=mask, use_causal_mask=case.causal)
    return cfg, params, inputs, kwargs, d_out, rng


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_attention_grads(case):
    cfg, params, inputs, kwargs, d_out, rng = setup_case(case)

    def loss():
        return float(np.sum(ref.attention(params, cfg, **inputs, **kwargs) * d_out))

    grads = rg.attention_grads(params, cfg, **inputs, **kwargs, d_output=d_out)
    assert set(grads) == set(inputs) | set(params)
    for name, g in grads.items():
        assert np.all(np.isfinite(g)), name

    # The composition really mixes heads, so a wrong compose gradient shows.
    _, inter = ref.attention(params, cfg, **inputs, **kwargs, return_intermediates=True)
    if cfg.pre_compose:
        assert np.max(np.abs(inter["pre_composed"] - inter["scores"])) > 1e-2
    if cfg.post_compose:
        assert np.max(np.abs(inter["post_composed"] - inter["probs"])) > 1e-2

    for name, x in list(inputs.items()) + list(params.items()):
        check_grad(loss, x, grads[name], name, rng, n_points=8)


def test_fully_masked_row_has_zero_query_gradient():
    case = next(c for c in _cases() if c.name == "all_cross")
    cfg, params, inputs, kwargs, d_out, _ = setup_case(case)
    grads = rg.attention_grads(params, cfg, **inputs, **kwargs, d_output=d_out)
    # Row (b=0, t=1) attends to nothing: its output is the output bias alone,
    # so in cross-attention its query gets exactly zero gradient, not NaN.
    assert np.all(grads["query"][0, 1] == 0.0)
    assert all(np.all(np.isfinite(g)) for g in grads.values())


@pytest.mark.parametrize("name", ["all_self", "default"])
def test_self_attention_gradient_is_sum_of_paths(name):
    case = next(c for c in _cases() if c.name == name)
    cfg, params, inputs, kwargs, d_out, _ = setup_case(case)
    x = inputs["query"]
    total = rg.attention_grads(params, cfg, x, **kwargs, d_output=d_out)
    parts = rg.attention_grads(params, cfg, x, x.copy(), x.copy(), **kwargs, d_output=d_out)
    np.testing.assert_allclose(total["query"], parts["query"] + parts["key"] + parts["value"],
                               rtol=1e-12, atol=1e-12)
    for p in params:
        np.testing.assert_allclose(total[p], parts[p], rtol=1e-12, atol=1e-12)


def test_gradient_does_not_depend_on_query_chunk_size():
    case = next(c for c in _cases() if c.name == "all_self")
    cfg, params, inputs, kwargs, d_out, _ = setup_case(case)
    a = rg.attention_grads(params, cfg, **inputs, **kwargs, d_output=d_out)
    b = rg.attention_grads(params, dataclasses.replace(cfg, query_chunk_size=None), **inputs,
                           **kwargs, d_output=d_out)
    for n in a:
        np.testing.assert_allclose(a[n], b[n], rtol=1e-12, atol=1e-12)
