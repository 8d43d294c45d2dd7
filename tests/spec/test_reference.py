"""Properties of the NumPy spec (compose, chunking, decoding, masks) and of the tolerance policy.

The tolerance tests check both directions: a correct implementation in float32 / float16 /
bfloat16 (emulated below in NumPy) passes every fixture with room to spare, and a reference with
one deliberate bug (a compose term dropped, a mask shifted by one, ...) fails the cases that
exercise it.
"""

import dataclasses
import math
import types

import numpy as np
import pytest

from dcmha.conformance import load_cases
from dcmha.conformance.adapters.reference import ReferenceAdapter
from dcmha.conformance.runner import check_case
from dcmha.spec import reference as ref
from dcmha.spec import reference_grad
from dcmha.spec import terms as spec_terms
from dcmha.spec import tolerance as tol

CASES = {c.name: c for c in load_cases()}


def _rng(seed=0):
    return np.random.default_rng(seed)


def _scaled_params(cfg, D_q, D_kv=None, D_out=None, seed=0):
    """Reference parameters with composition weights far from the identity."""
    p = ref.init_params(cfg, D_q, D_kv or D_q, D_out, rng=_rng(seed), scale=1.0)
    gains = {"dw1": 1.0, "qkw": 40.0, "dd": 60.0}
    for n in p:
        base = n.split("_")[-1]
        if base in gains:
            p[n] = p[n] * gains[base]
        elif n.startswith("static_"):
            p[n] = p[n] * 4.0
        elif n.endswith("_bias"):
            p[n] = _rng(seed + 1).normal(0, 0.5, p[n].shape)
    return p


# ---------------------------------------------------------------------------
# compose == the per-(t, s) N x N matrix formulation
# ---------------------------------------------------------------------------

TERMS = ("static", "query_projection", "key_projection", "query_gating", "key_gating")


@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("terms", [(t,) for t in TERMS] + [TERMS], ids=lambda t: "+".join(t))
def test_compose_matches_matrices(terms, G):
    B, N, T, S, R = 2, 4, 3, 5, 2
    M = N // G
    rng = _rng(G)
    a = rng.normal(size=(B, N, T, S))
    kw = {}
    if "static" in terms:
        kw["static"] = rng.normal(size=(G, M, M))
    if "query_projection" in terms:
        kw.update(qw1=rng.normal(size=(B, T, G, R, M)), qw2=rng.normal(size=(B, T, G, R, M)))
    if "key_projection" in terms:
        kw.update(kw1=rng.normal(size=(B, S, G, R, M)), kw2=rng.normal(size=(B, S, G, R, M)))
    if "query_gating" in terms:
        kw["qdd"] = rng.normal(size=(B, T, G, M))
    if "key_gating" in terms:
        kw["kdd"] = rng.normal(size=(B, S, G, M))
    got = ref.compose(a, G, **kw)
    W = ref.compose_matrices(G, T, S, B, N, **kw)
    want = np.einsum("btsmn,bmts->bnts", W, a)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # every term changes the result (the test would be vacuous otherwise)
    assert np.max(np.abs(got - a)) > 0.1
    # The declared arithmetic of the terms (spec.terms: each term's einsum into one of the two
    # small factors, which dcmha.ops computes with) gives the spec's formula.
    np.testing.assert_allclose(_compose_by_declared_factors(a, G, kw), got,
                               rtol=1e-12, atol=1e-12)


def _compose_by_declared_factors(a, G, kw):
    B, N, T, S = a.shape
    M = N // G
    x = a.reshape(B, G, M, T, S)
    wq, wk = spec_terms.compose_factors(kw, M, einsum=np.einsum, eye=np.eye)
    out = x if wq is None else (
        np.einsum("gnm,bgmts->bgnts", wq, x) if wq.ndim == 3 else
        np.einsum("btgnm,bgmts->bgnts", wq, x))
    if wk is not None:
        out = out + np.einsum("bsgnm,bgmts->bgnts", wk, x)
    return out.reshape(B, N, T, S)


def test_compose_identity_without_terms():
    a = _rng().normal(size=(1, 4, 2, 3))
    np.testing.assert_array_equal(ref.compose(a, 2), a)


# ---------------------------------------------------------------------------
# Chunking and decoding invariance
# ---------------------------------------------------------------------------

CHUNK_CONFIGS = {
    "dcmha_static_window": (dict(num_heads=4, key_dim=8, static_compose=True, sliding_window=3), True),
    "llm_layer": (dict(num_heads=4, key_dim=8, num_key_value_heads=2, qk_norm=True,
                       rope_max_wavelength=100.0, sliding_window=4, num_groups=2), True),
    "bidirectional_masked": (dict(num_heads=4, key_dim=8, rank=1), False),
}


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("name", list(CHUNK_CONFIGS))
def test_chunking_invariance(name, chunk):
    config, causal = CHUNK_CONFIGS[name]
    cfg = ref.Config(**config)
    B, T, D = 2, 7, 12
    p = _scaled_params(cfg, D)
    x = _rng(1).normal(size=(B, T, D))
    mask = _rng(2).random((B, T, T)) < 0.8
    kw = dict(attention_mask=mask, use_causal_mask=causal, return_intermediates=True)
    y0, i0 = ref.attention(p, cfg, x, **kw)
    y1, i1 = ref.attention(p, dataclasses.replace(cfg, query_chunk_size=chunk), x, **kw)
    np.testing.assert_allclose(y1, y0, rtol=0, atol=1e-12)
    for n in ("scores", "pre_composed", "probs", "post_composed"):
        np.testing.assert_allclose(i1[n], i0[n], rtol=0, atol=1e-12)


DECODE_CONFIGS = {
    "rope_window_gqa": dict(num_heads=4, key_dim=8, num_key_value_heads=2,
                            rope_max_wavelength=100.0, sliding_window=3),
    "all_switches_mqa": dict(num_heads=4, key_dim=8, num_key_value_heads=1, num_groups=2,
                             static_compose=True, qk_norm=True, rope_max_wavelength=50.0,
                             use_bias=True, sliding_window=4, gelu_approximate=False),
    "mha": dict(num_heads=2, key_dim=4, pre_compose=False, post_compose=False),
    "post_key_only": dict(num_heads=4, key_dim=8, pre_compose=False, query_wise=False,
                          dynamic_gating=False),
}


@pytest.mark.parametrize("steps,cache_len", [((1,) * 7, 7), ((3, 1, 1, 2), 7), ((4, 3), 10)],
                         ids=["single", "mixed", "longer_cache"])
@pytest.mark.parametrize("name", list(DECODE_CONFIGS))
def test_decode_matches_full_forward(name, steps, cache_len):
    cfg = ref.Config(**DECODE_CONFIGS[name])
    B, T, D = 2, sum(steps), 12
    p = _scaled_params(cfg, D)
    x = _rng(3).normal(size=(B, T, D))
    full = ref.attention(p, cfg, x, use_causal_mask=True)
    cache = ref.init_cache(cfg, B, cache_len)
    before = {n: c.copy() for n, c in cache.items()}
    outs, i = [], 0
    for n in steps:
        y, new = ref.decode_step(p, cfg, x[:, i:i + n], cache, i)
        for k in cache:                       # the input cache is not modified
            np.testing.assert_array_equal(cache[k], before[k])
        cache, before = new, {k: c.copy() for k, c in new.items()}
        outs.append(y)
        i += n
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=0, atol=1e-12)
    # the unwritten tail of a longer cache is still zero
    assert not np.any(cache["key"][:, T:])


@pytest.mark.parametrize("name", ["all_switches_mqa", "post_key_only", "mha"])
def test_decode_cache_layout(name):
    """SPEC.md section 9: key_w holds w1 then w2 of each key slot (pre_key first) along
    axis 2, key_dd each key slot's gates; positions past the last written stay zero."""
    cfg = ref.Config(**DECODE_CONFIGS[name])
    B, T, D, S_max = 2, 5, 12, 7
    p = _scaled_params(cfg, D)
    x = _rng(4).normal(size=(B, T, D))
    cache = ref.init_cache(cfg, B, S_max)
    for i in range(T):
        _, cache = ref.decode_step(p, cfg, x[:, i:i + 1], cache, i)
    _, kdyn = ref.dynamic_weights_both_sides(p, cfg, x, x)
    ks = ref.side_slots(cfg, "key")
    expected = {}
    if ks and cfg.dynamic_projection:
        expected["key_w"] = [kdyn[s][n] for s in ks for n in ("w1", "w2")]
    if ks and cfg.dynamic_gating:
        expected["key_dd"] = [kdyn[s]["dd"] for s in ks]
    assert sorted(cache) == sorted(["key", "value"] + list(expected))
    for name_, parts in expected.items():
        assert cache[name_].shape[:3] == (B, S_max, len(parts))
        for j, w in enumerate(parts):
            np.testing.assert_allclose(cache[name_][:, :T, j], w, rtol=1e-12, atol=1e-14)
        assert not np.any(cache[name_][:, T:])


# ---------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("W", [1, 2, 3, 8])
@pytest.mark.parametrize("offset", [0, 4])
def test_sliding_window_semantics(W, offset):
    T, S = 5, 10
    causal = ref.make_mask(1, T, S, use_causal_mask=True, sliding_window=W, query_offset=offset)[0]
    band = ref.make_mask(1, T, S, sliding_window=W, query_offset=offset)[0]
    for t in range(T):
        pos = offset + t
        assert set(np.flatnonzero(causal[t])) == {s for s in range(S) if pos - W < s <= pos}
        assert set(np.flatnonzero(band[t])) == {s for s in range(S) if abs(pos - s) < W}
        assert causal[t].sum() == min(W, pos + 1)      # W keys ending at pos, itself included


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 1, 3])
def test_visible_rule_on_arrays_is_the_scalar_rule(causal, window):
    # spec.terms.visible is the one position rule of every mask (reference, kernels'
    # references, decode step): on arrays it must give the scalar rule elementwise.
    t, s = np.arange(6)[:, None], np.arange(9)[None, :]
    rule = spec_terms.visible(t, s, causal=causal, window=window, offset=2)
    scalar = np.array([[spec_terms.visible(a, b, causal=causal, window=window, offset=2)
                        for b in range(9)] for a in range(6)])
    if not causal and window is None:
        assert rule is True and scalar.all()
    else:
        assert rule.dtype == bool and rule.shape == (6, 9)
        np.testing.assert_array_equal(rule, scalar)
        assert not scalar.all()


def test_sliding_window_in_attention():
    cfg = ref.Config(num_heads=4, key_dim=8, sliding_window=3)
    p = _scaled_params(cfg, 12)
    x = _rng(4).normal(size=(2, 8, 12))
    _, inter = ref.attention(p, cfg, x, use_causal_mask=True, return_intermediates=True)
    t, s = np.arange(8)[:, None], np.arange(8)[None, :]
    allowed = (t - 3 < s) & (s <= t)
    assert np.all(inter["probs"][..., allowed] > 0)
    assert np.all(inter["probs"][..., ~allowed] == 0.0)


@pytest.mark.parametrize("use_bias", [False, True])
def test_masked_probabilities_are_exactly_zero(use_bias):
    cfg = ref.Config(num_heads=4, key_dim=8, static_compose=True, use_bias=use_bias)
    p = _scaled_params(cfg, 12)
    B, T = 2, 6
    x = _rng(5).normal(size=(B, T, 12))
    mask = _rng(6).random((B, T, T)) < 0.6
    mask[0, 1] = False                                   # fully masked rows
    mask[1, 5] = False
    y, inter = ref.attention(p, cfg, x, attention_mask=mask, use_causal_mask=True,
                             return_intermediates=True)
    full = inter["mask"]
    for n in ("probs", "post_composed"):
        assert np.all(inter[n][np.broadcast_to(~full[:, None], inter[n].shape)] == 0.0)
    assert np.all(np.isfinite(y))
    rows = ~full.any(-1)
    assert rows[0, 1] and rows[1, 5]
    np.testing.assert_array_equal(inter["o"][rows], 0.0)
    want = p["output_bias"] if use_bias else 0.0
    np.testing.assert_array_equal(y[rows], np.broadcast_to(want, y[rows].shape))
    # allowed probabilities of the other rows sum to one before the post-compose
    np.testing.assert_allclose(inter["probs"].sum(-1)[np.broadcast_to(~rows[:, None], (B, 4, T))],
                               1.0, rtol=1e-12)


# ---------------------------------------------------------------------------
# The tolerance policy: formula, dtype rounding
# ---------------------------------------------------------------------------

def test_tolerance_formula():
    y = np.array([[-2.0, 0.5], [1.0, 0.0]])
    t = tol.tolerance("output", y, "float16", sigma=3.0)
    rtol = (8 + 2 * 3.0) * 2.0 ** -11
    assert t == {"atol": float(f"{rtol * 2.0:.3g}"), "rtol": float(f"{rtol:.3g}")}
    t = tol.tolerance("scores", y, "float32", sigma=100.0)     # before the softmax: no sigma
    assert t["rtol"] == float(f"{256 * 2.0 ** -24:.3g}")
    assert tol.kind_of("grad/dw1") == "gradient" and tol.kind_of("attention_scores") == "output"
    assert tol.kind_of("dynamic/pre_query/w1") == "intermediate"
    floors = tol.case_tolerances({"grad/a": np.zeros(3), "grad/b": np.full(3, 4.0)},
                                 ["grad/a", "grad/b"], "float32", 0.0)
    assert floors["grad/a"]["atol"] == pytest.approx(floors["grad/b"]["atol"] / 100, rel=1e-2)
    with pytest.raises(ValueError, match="Received: dtype='float64'"):
        tol.tolerance("output", y, "float64", 0.0)


def test_round_to_dtype():
    x = np.concatenate([_rng(7).normal(size=1000) * 10.0 ** _rng(8).integers(-6, 4, 1000),
                        [0.0, -0.0, 1.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -9, 65504.0]])
    np.testing.assert_array_equal(tol.round_to_dtype(x, "float16"),
                                  x.astype(np.float16).astype(np.float32))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    want = x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    got = tol.round_to_dtype(x, "bfloat16")
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(tol.round_to_dtype(got, "bfloat16"), got)
    assert tol.round_to_dtype(x, "float32").dtype == np.float32


# ---------------------------------------------------------------------------
# Loose enough: an emulated correct implementation passes every fixture
# ---------------------------------------------------------------------------

def emulate_forward(case, half_accumulation=False):
    """A correct mixed-precision implementation, emulated in NumPy.

    Storage in the case's dtype (q, k, v, dynamic weights, P, O, y, returned intermediates),
    arithmetic in float32: scores, compose and softmax in float32 as the spec requires. With
    ``half_accumulation`` (float16 only) the projections also accumulate in float16.
    """
    dt = case.dtype
    r = lambda a: tol.round_to_dtype(a, dt)  # noqa: E731
    cfg = case.cfg
    p = {n: r(v) for n, v in case.params.items()}
    xq = case.inputs["query"]
    xk = xv = xq
    if not case.call["self_attention"]:
        xk, xv = case.inputs["key"], case.inputs["value"]
    B, T, _ = xq.shape
    S = xk.shape[1]
    if half_accumulation and dt == "float16":
        def ein(s, a, b):
            return np.einsum(s, a.astype(np.float16), b.astype(np.float16)).astype(np.float32)
    else:
        ein = np.einsum

    def proj(x, name, pos, qk):
        y = ein("bld,dnh->blnh", x, p[name + "_kernel"])
        if cfg.use_bias:
            y = y + p[name + "_bias"]
        y = r(y)
        if qk and cfg.qk_norm:
            y = r(ref.rms_normalize(y, ref.QK_NORM_EPS) * p[name + "_norm_scale"])
        if qk and cfg.rope_max_wavelength:
            y = r(ref.rope(y, pos, cfg.rope_max_wavelength))
        return y

    q, k = proj(xq, "query", np.arange(T), True), proj(xk, "key", np.arange(S), True)
    v = proj(xv, "value", None, False)
    qd, kd = ref.dynamic_weights_both_sides(p, cfg, xq, xk)       # float32 arithmetic
    qd, kd = ({s: {n: r(w) for n, w in ws.items()} for s, ws in d.items()} for d in (qd, kd))
    mask = ref.make_mask(B, T, S, attention_mask=case.inputs.get("attention_mask"),
                         use_causal_mask=case.call["use_causal_mask"],
                         sliding_window=cfg.sliding_window)
    rep = cfg.N // cfg.N_kv
    kh, vh = np.repeat(k, rep, 2), np.repeat(v, rep, 2)
    s = np.einsum("btnh,bsnh->bnts", q, kh) / np.float32(math.sqrt(cfg.d))
    a = ref.compose(s, cfg.G, **ref.compose_terms(cfg, "pre", qd, kd, p)) if cfg.pre_compose else s
    pr = ref.masked_softmax(a, mask).astype(np.float32)
    pp = ref.compose(pr, cfg.G, **ref.compose_terms(cfg, "post", qd, kd, p)) if cfg.post_compose else pr
    pp = r(np.where(mask[:, None], pp, 0.0))
    o = r(ein("bnts,bsnh->btnh", pp, vh))
    y = ein("btnh,nho->bto", o, p["output_kernel"]) + (p["output_bias"] if cfg.use_bias else 0.0)
    out = {"output": r(y), "attention_scores": pp, "scores": r(s), "pre_composed": r(a),
           "probs": r(pr)}
    for d in (qd, kd):
        for slot, ws in d.items():
            out.update({f"dynamic/{slot}/{n}": w for n, w in ws.items()})
    return out


def _worst_ratio(case, got):
    res = check_case("emulated", case, {n: got[n] for n in case.outputs if n in got})
    return max(o["ratio"] for o in res.outputs if o["ratio"] is not None), res


@pytest.mark.parametrize("half_accumulation", [False, True])
def test_emulated_mixed_precision_passes_every_case(half_accumulation):
    ratios = {}
    for case in CASES.values():
        got = emulate_forward(case, half_accumulation)
        if case.kind == "gradients":
            case = dataclasses.replace(case, outputs=("output",))
        ratios[case.name], res = _worst_ratio(case, got)
        assert res.status == "PASS", res.reason
    worst = max(ratios, key=ratios.get)
    assert ratios[worst] < 0.25, (worst, ratios[worst])


def test_emulated_float32_gradients_pass(monkeypatch):
    """Every float64 op of the backward perturbed by a relative 4u (float32) stays within a
    quarter of the gradient tolerance: the float32 gradient tolerance leaves room for a
    correct float32 backward."""
    rng = _rng(9)

    def noisy(a):
        a = np.asarray(a)
        return a * (1 + 4 * 2.0 ** -24 * rng.uniform(-1, 1, a.shape)) if a.ndim else a

    fake_np = types.SimpleNamespace(**{n: getattr(np, n) for n in dir(np) if not n.startswith("__")})
    for f in ("einsum", "exp", "tanh", "sqrt"):
        setattr(fake_np, f, (lambda g: lambda *a, **k: noisy(g(*a, **k)))(getattr(np, f)))
    monkeypatch.setattr(reference_grad, "np", fake_np)
    monkeypatch.setattr(ref, "np", fake_np)
    worst = 0.0
    for case in CASES.values():
        if case.kind != "gradients" or case.dtype != "float32":
            continue
        i = case.inputs
        g = reference_grad.attention_grads(
            {n: noisy(v.astype(np.float64)) for n, v in case.params.items()}, case.cfg,
            noisy(i["query"].astype(np.float64)),
            None if "key" not in i else noisy(i["key"].astype(np.float64)),
            None if "value" not in i else noisy(i["value"].astype(np.float64)),
            attention_mask=i.get("attention_mask"), use_causal_mask=case.call["use_causal_mask"],
            d_output=i["d_output"])
        grads = {f"grad/{n}": v for n, v in g.items()}
        c = dataclasses.replace(case, outputs=tuple(n for n in case.outputs if n.startswith("grad/")))
        ratio, res = _worst_ratio(c, grads)
        assert res.status == "PASS", res.reason
        worst = max(worst, ratio)
    assert worst < 0.25


# ---------------------------------------------------------------------------
# Tight enough: a reference with one bug fails the cases that exercise it
# ---------------------------------------------------------------------------

def _drop(*terms):
    orig = ref.compose

    def compose(a, num_groups, **kw):
        drop = set(terms) | ({"qw2"} if "qw1" in terms else set()) | (
            {"kw2"} if "kw1" in terms else set())
        return orig(a, num_groups, **{k: v for k, v in kw.items() if k not in drop})
    return "compose", compose


def _sequential_compose():
    """Terms that read the partial sum instead of the compose input."""
    orig = ref.compose

    def compose(a, num_groups, **kw):
        for name in ("static", "qw1", "kw1", "qdd", "kdd"):
            if name in kw:
                part = {name: kw[name]}
                if name in ("qw1", "kw1"):
                    part[name[0] + "w2"] = kw[name[0] + "w2"]
                a = orig(a, num_groups, **part)
        return a
    return "compose", compose


def _window_off_by_one():
    orig = ref.make_mask

    def make_mask(B, T, S, **kw):
        if kw.get("sliding_window"):
            kw["sliding_window"] += 1
        return orig(B, T, S, **kw)
    return "make_mask", make_mask


def _causal_excludes_diagonal():
    orig = ref.make_mask

    def make_mask(B, T, S, **kw):
        m = orig(B, T, S, **kw)
        if kw.get("use_causal_mask"):
            t = kw.get("query_offset", 0) + np.arange(T)[:, None]
            m = m & (np.arange(S)[None, :] != t)[None]
        return m
    return "make_mask", make_mask


def _gqa_modulo():
    orig = ref.attend

    def attend(cfg, params, q, k, v, qdyn, kdyn, mask):
        rep = cfg.N // cfg.N_kv                  # head h reads kv head h % N_kv
        return orig(dataclasses.replace(cfg, num_key_value_heads=None), params, q,
                    np.tile(k, (1, 1, rep, 1)), np.tile(v, (1, 1, rep, 1)), qdyn, kdyn, mask)
    return "attend", attend


def _w1_unnormalised():
    orig = ref.rms_normalize
    return "rms_normalize", lambda x, eps, axis=-1: x if x.ndim == 6 else orig(x, eps, axis)


def _gelu_always_tanh():
    orig = ref.gelu
    return "gelu", lambda x, approximate=True: orig(x, True)


def _rope_interleaved():
    def rope(x, positions, max_wavelength):
        d = x.shape[-1]
        inv = max_wavelength ** (-np.arange(d // 2) * 2.0 / d)
        ang = positions[:, None] * inv[None]
        cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return out
    return "rope", rope


def _qk_norm_without_scale():
    orig = ref.project_qkv

    def project_qkv(params, cfg, *a):
        params = dict(params)
        for n in ("query_norm_scale", "key_norm_scale"):
            if n in params:
                params[n] = np.ones_like(params[n])
        return orig(params, cfg, *a)
    return "project_qkv", project_qkv


MUTATIONS = {
    "drop_static": (lambda: _drop("static"), ["talking_heads", "dcmha_static", "all_switches",
                                              "talking_heads_float16"]),
    "drop_query_projection": (lambda: _drop("qw1"), ["dcmha", "query_wise_only",
                                                     "dynamic_projection_only", "cross_attention"]),
    "drop_key_projection": (lambda: _drop("kw1"), ["dcmha", "key_wise_only", "cross_attention",
                                                   "decode_dcmha"]),
    "drop_query_gating": (lambda: _drop("qdd"), ["dcmha", "dynamic_gating_only", "dcmha_float16"]),
    "drop_key_gating": (lambda: _drop("kdd"), ["dcmha", "dynamic_gating_only", "dcmha_bfloat16"]),
    "sequential_compose": (_sequential_compose, ["dcmha_static", "dcmha", "all_switches"]),
    "window_off_by_one": (_window_off_by_one, ["sliding_window_causal",
                                               "sliding_window_bidirectional", "llm_layer",
                                               "decode_llm_layer"]),
    "causal_excludes_diagonal": (_causal_excludes_diagonal, ["causal", "decode_mha"]),
    "gqa_modulo": (_gqa_modulo, ["gqa", "llm_layer", "intermediates_gqa_window"]),
    "w1_unnormalised": (_w1_unnormalised, ["dcmha", "rank_1", "intermediates_dcmha"]),
    "gelu_always_tanh": (_gelu_always_tanh, ["gelu_exact", "grad_groups_rank"]),
    "rope_interleaved": (_rope_interleaved, ["rope", "llm_layer", "decode_llm_layer"]),
    "qk_norm_without_scale": (_qk_norm_without_scale, ["qk_norm", "all_switches"]),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutated_reference_fails(mutation, monkeypatch):
    make, names = MUTATIONS[mutation]
    adapter = ReferenceAdapter()
    for name in names:                      # the unmutated reference passes
        assert check_case("reference", CASES[name], adapter.run(CASES[name])).status == "PASS"
    attr, fn = make()
    monkeypatch.setattr(ref, attr, fn)
    for name in names:
        res = check_case("mutated", CASES[name], adapter.run(CASES[name]))
        assert res.status == "FAIL", f"{mutation} not caught by {name}: {res.worst} {res.max_rel:.3g}"
