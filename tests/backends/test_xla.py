"""The TensorFlow/XLA attention core (dcmha.backends.xla) against the NumPy spec.

Forward (output and attention scores) and gradients (w.r.t. q, k, v and every compose
term) of ``dcmha_attention`` are compared with the spec's NumPy pieces (compose,
masked_softmax and their backwards, in float64) and with ``dcmha_attention_reference``
(plain TensorFlow). Shapes are tiny: this is about the math, not speed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from dcmha.backends import xla  # noqa: E402
from dcmha.backends.xla import dcmha_xla  # noqa: E402
from dcmha.spec import reference as ref  # noqa: E402
from dcmha.spec import reference_grad as ref_grad  # noqa: E402
from dcmha.spec import terms as spec_terms  # noqa: E402

TERMS = {"qw": ("qw1", "qw2"), "kw": ("kw1", "kw2"), "qdd": ("qdd",), "kdd": ("kdd",),
         "static": ("static",)}
ALL = tuple(TERMS)


# ---------------------------------------------------------------------------
# Problem construction and the NumPy truth
# ---------------------------------------------------------------------------

def make_problem(seed=0, B=2, T=6, S=7, N=4, N_kv=4, G=1, R=2, d=8, d_v=6, pre=ALL, post=ALL,
                 mask=None):
    """Random q, k, v, compose terms (float64) and an optional (B, T, S) mask."""
    rng = np.random.default_rng(seed)
    M = N // G
    sizes = dict(B=B, T=T, S=S, G=G, R=R, M=M)

    def stage(terms):
        if terms is None:
            return None
        return {n: rng.normal(size=spec_terms.term_shape(n, sizes)) * 0.4
                for t in terms for n in TERMS[t]}

    p = dict(q=rng.normal(size=(B, T, N, d)), k=rng.normal(size=(B, S, N_kv, d)),
             v=rng.normal(size=(B, S, N_kv, d_v)), pre=stage(pre), post=stage(post),
             do=rng.normal(size=(B, T, N, d_v)), G=G)
    if mask == "random":
        m = rng.random((B, T, S)) < 0.6
        m[0, 1] = False            # a fully masked row
        m[1, T - 1] = False
        p["mask"] = m
    else:
        p["mask"] = None
    return p


def spec_core(p, causal=False, window=None):
    """NumPy float64 forward and backward of the core, from the spec's pieces."""
    q, k, v, G = p["q"], p["k"], p["v"], p["G"]
    B, T, N, d = q.shape
    S = k.shape[1]
    rep = N // k.shape[2]
    mask = ref.make_mask(B, T, S, attention_mask=p["mask"], use_causal_mask=causal,
                         sliding_window=window)
    k_h, v_h = np.repeat(k, rep, 2), np.repeat(v, rep, 2)
    scores = np.einsum("btnh,bsnh->bnts", q, k_h) / math.sqrt(d)
    pre, post = p["pre"], p["post"]
    a = scores if pre is None else ref.compose(scores, G, **pre)
    probs = ref.masked_softmax(a, mask)
    pc = probs if post is None else ref.compose(probs, G, **post)
    pc = np.where(mask[:, None], pc, 0.0)
    o = np.einsum("bnts,bsnh->btnh", pc, v_h)

    do = p["do"]
    g_p = np.where(mask[:, None], np.einsum("btnh,bsnh->bnts", do, v_h), 0.0)
    g_v = np.einsum("bnts,btnh->bsnh", pc, do)
    grads = {}
    if post is not None:
        g_p, g_post = ref_grad.compose_backward(probs, g_p, G, **post)
        grads.update({"post/" + n: g for n, g in g_post.items()})
    g_a = ref_grad.masked_softmax_backward(probs, g_p, mask)
    if pre is not None:
        g_a, g_pre = ref_grad.compose_backward(scores, g_a, G, **pre)
        grads.update({"pre/" + n: g for n, g in g_pre.items()})
    g_s = g_a / math.sqrt(d)
    grads["q"] = np.einsum("bnts,bsnh->btnh", g_s, k_h)
    fold = lambda g: g.reshape(g.shape[:2] + (-1, rep) + g.shape[3:]).sum(3)  # noqa: E731
    grads["k"] = fold(np.einsum("bnts,btnh->bsnh", g_s, q))
    grads["v"] = fold(g_v)
    return o, pc, grads


def run_tf(fn, p, dtype=tf.float32, **kw):
    """(o, scores, grads) of fn (dcmha_attention or the reference) with tf.GradientTape."""
    c = lambda x: tf.constant(x, dtype)  # noqa: E731
    leaves = {"q": c(p["q"]), "k": c(p["k"]), "v": c(p["v"])}
    for stage in ("pre", "post"):
        if p[stage] is not None:
            leaves.update({f"{stage}/{n}": c(x) for n, x in p[stage].items()})
    stage = lambda s: None if p[s] is None else {  # noqa: E731
        n: leaves[f"{s}/{n}"] for n in p[s]}
    mask = None if p["mask"] is None else tf.constant(p["mask"])
    with tf.GradientTape() as tape:
        tape.watch(leaves)
        o, scores = fn(leaves["q"], leaves["k"], leaves["v"], num_groups=p["G"],
                       pre=stage("pre"), post=stage("post"), mask=mask,
                       return_attention_scores=True, **kw)
        loss = tf.reduce_sum(tf.cast(o, tf.float32) * tf.constant(p["do"], tf.float32))
    grads = tape.gradient(loss, leaves)
    return o, scores, grads


def assert_close(got, want, rtol, name):
    got = np.asarray(tf.cast(got, tf.float32) if tf.is_tensor(got) else got, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{name}: not finite"
    scale = max(float(np.max(np.abs(want))), 1e-3)
    err = float(np.max(np.abs(got - want)))
    assert err <= rtol * scale, f"{name}: max abs error {err:.3g} > {rtol:.1g} * {scale:.3g}"


# ---------------------------------------------------------------------------
# Forward and gradients vs the spec and the TF reference
# ---------------------------------------------------------------------------

CASES = {
    # name: (make_problem kwargs, core kwargs); at most 3 chunks (XLA compile time)
    "all_terms_causal_chunked": (dict(), dict(causal=True, query_chunk_size=4)),
    "causal_window_chunked": (dict(T=8, S=8), dict(causal=True, sliding_window=3,
                                                   query_chunk_size=4)),
    "bidirectional_window_chunked": (dict(T=8, S=6), dict(sliding_window=2, query_chunk_size=4)),
    "mask_fully_masked_rows": (dict(mask="random"), dict(query_chunk_size=4)),
    "mask_causal_window_chunk_1": (dict(T=3, S=5, mask="random", G=2),
                                   dict(causal=True, sliding_window=2, query_chunk_size=1)),
    "gqa_groups_2_scale": (dict(N_kv=2, G=2), dict(causal=True, scale=0.3)),
    "mqa_groups_2_rank_1_identity_pre": (dict(N_kv=1, G=2, R=1, pre=()), dict()),
    "groups_4_rank_2": (dict(N=8, N_kv=4, G=4), dict(causal=True, query_chunk_size=5)),
    "no_compose": (dict(pre=None, post=None), dict(causal=True)),
}
# every term alone in each stage (paired with a different term alone in the other stage)
CASES.update({f"pre_{a}_post_{b}": (dict(pre=(a,), post=(b,)), dict(causal=True))
              for a, b in zip(ALL, ALL[1:] + ALL[:1])})


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_gradients_match_spec(name):
    prob_kw, core_kw = CASES[name]
    p = make_problem(seed=sorted(CASES).index(name), **prob_kw)
    scale = core_kw.get("scale")
    if scale is not None:   # the spec scales by 1/sqrt(d): fold the difference into q
        p_spec = dict(p, q=p["q"] * scale * math.sqrt(p["q"].shape[-1]))
    else:
        p_spec = p
    o_np, pc_np, g_np = spec_core(p_spec, causal=core_kw.get("causal", False),
                                  window=core_kw.get("sliding_window"))
    if scale is not None:
        g_np["q"] = g_np["q"] * scale * math.sqrt(p["q"].shape[-1])
    o, scores, grads = run_tf(xla.dcmha_attention, p, **core_kw)
    assert o.dtype == tf.float32 and scores.dtype == tf.float32
    assert_close(o, o_np, 1e-5, "o")
    assert_close(scores, pc_np, 1e-5, "scores")
    assert set(grads) == set(g_np)
    for n, g in g_np.items():
        assert_close(grads[n], g, 2e-5, "grad " + n)
    # the plain-TF reference agrees too (forward and autodiff gradients)
    o_r, scores_r, grads_r = run_tf(xla.dcmha_attention_reference, p, **core_kw)
    assert_close(o_r, o_np, 1e-5, "reference o")
    assert_close(scores_r, pc_np, 1e-5, "reference scores")
    for n, g in g_np.items():
        assert_close(grads_r[n], g, 2e-5, "reference grad " + n)


def test_chunks_in_xla_loops_match_spec(monkeypatch):
    # With MAX_GROUPS=1 all chunks run in one tf.map_fn (an XLA while loop).
    monkeypatch.setattr(dcmha_xla, "MAX_GROUPS", 1)
    dcmha_xla._COMPILED.clear()
    core_kw = dict(causal=True, sliding_window=4, query_chunk_size=2)  # 4 chunks, T padded to 8
    p = make_problem(seed=12, T=7, S=8, mask="random", G=2)
    o_np, pc_np, g_np = spec_core(p, causal=core_kw.get("causal", False),
                                  window=core_kw.get("sliding_window"))
    o, scores, grads = run_tf(xla.dcmha_attention, p, **core_kw)   # eager tape
    assert_close(o, o_np, 1e-5, "o")
    assert_close(scores, pc_np, 1e-5, "scores")
    for n, g in g_np.items():
        assert_close(grads[n], g, 2e-5, "grad " + n)
    # traced inline into a jitted step: XLA differentiates the loops itself
    o, scores, grads = tf.function(
        lambda: run_tf(xla.dcmha_attention, p, **core_kw), jit_compile=True)()
    assert_close(o, o_np, 1e-5, "jitted o")
    for n, g in g_np.items():
        assert_close(grads[n], g, 2e-5, "jitted grad " + n)
    dcmha_xla._COMPILED.clear()


def test_masked_probabilities_exactly_zero_and_fully_masked_rows_zero():
    # (gradients with fully masked rows: case "mask_fully_masked_rows" above)
    p = make_problem(seed=3, mask="random")
    c = lambda x: tf.constant(x, tf.float32)  # noqa: E731
    o, scores = xla.dcmha_attention(
        c(p["q"]), c(p["k"]), c(p["v"]), num_groups=1, causal=True, query_chunk_size=3,
        pre={n: c(x) for n, x in p["pre"].items()}, post={n: c(x) for n, x in p["post"].items()},
        mask=tf.constant(p["mask"]), return_attention_scores=True)
    mask = ref.make_mask(2, 6, 7, attention_mask=p["mask"], use_causal_mask=True)
    s = scores.numpy()
    assert np.all(s[np.broadcast_to(~mask[:, None], s.shape)] == 0.0)
    rows = ~mask.any(-1)                         # (B, T) fully masked
    assert rows.any()
    assert np.all(o.numpy()[rows] == 0.0)


def test_chunk_size_does_not_change_the_result():
    p = make_problem(seed=4, T=9, S=9, mask="random")
    c = lambda x: tf.constant(x, tf.float32)  # noqa: E731
    outs = [xla.dcmha_attention(
        c(p["q"]), c(p["k"]), c(p["v"]), num_groups=1, causal=True, sliding_window=4,
        pre={n: c(x) for n, x in p["pre"].items()}, post={n: c(x) for n, x in p["post"].items()},
        mask=tf.constant(p["mask"]), query_chunk_size=size, return_attention_scores=True)
        for size in (None, 2, 100)]   # 100 >= T: the same compiled function as None
    for o, s in outs[1:]:
        np.testing.assert_allclose(o.numpy(), outs[0][0].numpy(), rtol=0, atol=2e-6)
        np.testing.assert_allclose(s.numpy(), outs[0][1].numpy(), rtol=0, atol=2e-6)


def test_queries_beyond_the_window_of_every_key_give_zeros():
    # T > S + W without the causal mask: the second chunk sees no key at all.
    p = make_problem(seed=5, T=8, S=2, pre=("qw", "kdd"), post=("kw", "static"))
    o_np, pc_np, g_np = spec_core(p, window=2)
    o, scores, grads = run_tf(xla.dcmha_attention, p, sliding_window=2, query_chunk_size=4)
    assert np.all(o.numpy()[:, 4:] == 0.0)
    assert_close(o, o_np, 1e-5, "o")
    assert_close(scores, pc_np, 1e-5, "scores")
    for n, g in g_np.items():
        assert_close(grads[n], g, 2e-5, "grad " + n)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_inputs(dtype):
    dt = tf.as_dtype(dtype)
    p = make_problem(seed=6, N_kv=2, G=2)
    # the truth is computed from the inputs rounded to the dtype
    rounded = {n: (None if p[n] is None else
                   ({k: tf.cast(tf.cast(x, dt), tf.float64).numpy() for k, x in p[n].items()}
                    if isinstance(p[n], dict) else tf.cast(tf.cast(p[n], dt), tf.float64).numpy()))
               for n in ("q", "k", "v", "pre", "post")}
    o_np, pc_np, g_np = spec_core(dict(p, **rounded), causal=True)
    o, scores, grads = run_tf(xla.dcmha_attention, p, dtype=dt, causal=True)
    assert o.dtype == dt and scores.dtype == tf.float32
    tol = {"float16": 4e-3, "bfloat16": 3e-2}[dtype]
    assert_close(o, o_np, tol, "o")
    assert_close(scores, pc_np, 1e-5, "scores")    # float32 inside, from the same inputs
    for n, g in g_np.items():
        assert grads[n].dtype == dt
        assert_close(grads[n], g, 4 * tol, "grad " + n)


# ---------------------------------------------------------------------------
# Calling contexts
# ---------------------------------------------------------------------------

def _leaves(p):
    c = lambda x: tf.constant(x, tf.float32)  # noqa: E731
    return c(p["q"]), c(p["k"]), c(p["v"]), {n: c(x) for n, x in p["pre"].items()}


def test_inside_jitted_and_plain_tf_functions():
    p = make_problem(seed=7, post=None)
    q, k, v, pre = _leaves(p)
    do = tf.constant(p["do"], tf.float32)

    def step(q, k, v, pre):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v, pre])
            o = xla.dcmha_attention(q, k, v, num_groups=1, pre=pre, causal=True)
            loss = tf.reduce_sum(o * do)
        return o, tape.gradient(loss, [q, k, v, pre])

    eager = step(q, k, v, pre)
    jitted = tf.function(step, jit_compile=True)       # the core is traced inline
    graph = tf.function(step)                          # the core is a nested XLA call
    for other in (jitted(q, k, v, pre), graph(q, k, v, pre)):
        for a, b in zip(tf.nest.flatten(eager), tf.nest.flatten(other)):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-5)
    # the jitted step takes its inputs as arguments: new values give new results
    o2 = jitted(q * 2.0, k, v, pre)[0]
    assert float(tf.reduce_max(tf.abs(o2 - eager[0]))) > 1e-3


def test_unknown_lengths_and_batch():
    p = make_problem(seed=8, mask="random", post=("kw", "qdd"))
    q, k, v, pre = _leaves(p)
    post = {n: tf.constant(x, tf.float32) for n, x in p["post"].items()}
    mask = tf.constant(p["mask"])
    # batch and lengths unknown; head axes (and G, R, M of the terms) static
    spec = lambda x, n: tf.TensorSpec([None] * n + x.shape[n:], x.dtype)  # noqa: E731
    terms = lambda t: {n: spec(x, 2 if n != "static" else 0) for n, x in t.items()}  # noqa
    sig = [spec(q, 2), spec(k, 2), spec(v, 2), terms(pre), terms(post), spec(mask, 3)]
    fn = tf.function(lambda q, k, v, pre, post, mask: xla.dcmha_attention(
        q, k, v, num_groups=1, pre=pre, post=post, mask=mask, causal=True, sliding_window=3),
        input_signature=sig)
    o = fn(q, k, v, pre, post, mask)
    o_np, _, _ = spec_core(p, causal=True, window=3)
    assert_close(o, o_np, 1e-5, "o")


def test_compiled_function_cache():
    p = make_problem(seed=9, pre=("kdd",), post=None)
    q, k, v, pre = _leaves(p)
    dcmha_xla._COMPILED.clear()
    for _ in range(2):
        xla.dcmha_attention(q, k, v, num_groups=1, pre=pre, causal=True)
    xla.dcmha_attention(q, k, v, num_groups=1, pre=pre, causal=False)
    assert len(dcmha_xla._COMPILED) == 2


def test_compiled_function_cache_is_bounded(monkeypatch):
    """The least recently used configuration is evicted past COMPILE_CACHE_SIZE."""
    p = make_problem(seed=9, pre=("kdd",), post=None)
    q, k, v, pre = _leaves(p)
    monkeypatch.setattr(dcmha_xla, "COMPILE_CACHE_SIZE", 2)
    dcmha_xla._COMPILED.clear()
    for window in (None, 2, None, 3):        # None is used again before 3 arrives
        xla.dcmha_attention(q, k, v, num_groups=1, pre=pre, causal=True, sliding_window=window)
    assert len(dcmha_xla._COMPILED) == 2
    windows = [key[5] for key in dcmha_xla._COMPILED]
    assert windows == [None, 3]


def test_default_query_chunk_size():
    d = xla.default_query_chunk_size
    assert d(2, 8, 1024, 1024) == 64
    assert d(1, 16, 16384, 16384) == 16           # never below MIN_DEFAULT_CHUNK
    assert d(2, 4, 8, 8) is None                  # small: one chunk
    assert d(None, 8, 4096, 4096) == 32           # unknown batch counts as 1
    assert d(2, 8, None, 1024) is None


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------

def _args(**over):
    p = make_problem(seed=10, pre=("qw",), post=None)
    q, k, v, pre = _leaves(p)
    kw = dict(q=q, k=k, v=v, num_groups=1, pre=pre)
    kw.update(over)
    return kw


@pytest.mark.parametrize("fn", [xla.dcmha_attention, xla.dcmha_attention_reference])
@pytest.mark.parametrize("over,exc,msg", [
    (dict(q=tf.zeros([2, 6, 4])), ValueError,
     "`q` must have rank 4 (B, T, N, d). Received: q.shape=(2, 6, 4)"),
    (dict(k=tf.zeros([2, 7, 4, 5])), ValueError,
     "`q` and `k` must have the same head size d. Received: q.shape=(2, 6, 4, 8), "
     "k.shape=(2, 7, 4, 5)"),
    (dict(v=tf.zeros([2, 5, 4, 6])), ValueError,
     "`k` and `v` must have the same batch, length and heads (B, S, N_kv). "
     "Received: k.shape=(2, 7, 4, 8), v.shape=(2, 5, 4, 6)"),
    (dict(k=tf.zeros([2, 7, 3, 8]), v=tf.zeros([2, 7, 3, 6])), ValueError,
     "The heads of `q` (N=4) must be a multiple of the heads of `k` (N_kv=3). "
     "Received: q.shape=(2, 6, 4, 8), k.shape=(2, 7, 3, 8)"),
    (dict(num_groups=3), ValueError,
     "`num_groups` must divide the number of heads N=4. Received: num_groups=3"),
    (dict(num_groups=0), ValueError,
     "`num_groups` must be a positive integer. Received: num_groups=0"),
    (dict(sliding_window=0), ValueError,
     "`sliding_window` must be None or a positive integer. Received: sliding_window=0"),
    (dict(query_chunk_size=2.5), ValueError,
     "`query_chunk_size` must be None or a positive integer. Received: query_chunk_size=2.5"),
    (dict(scale=float("nan")), ValueError,
     "`scale` must be None or a finite number. Received: scale=nan"),
    (dict(pre={"qw3": tf.zeros([1])}), ValueError,
     "`pre` has unknown compose terms ['qw3']. Expected a subset of "
     "['kdd', 'kw1', 'kw2', 'qdd', 'qw1', 'qw2', 'static']"),
    (dict(post={"kw1": tf.zeros([2, 7, 1, 2, 4])}), ValueError,
     "`post` must have both 'kw1' and 'kw2' or neither. Received: ['kw1']"),
    (dict(pre={"qdd": tf.zeros([2, 7, 1, 4])}), ValueError,
     "`pre['qdd']` must have shape (B, T, G, M) = (2, 6, 1, 4). "
     "Received: pre['qdd'].shape=(2, 7, 1, 4)"),
    (dict(pre={"static": tf.zeros([1, 4, 3])}), ValueError,
     "`pre['static']` must have shape (G, M, M) = (1, 4, 4). "
     "Received: pre['static'].shape=(1, 4, 3)"),
    (dict(pre={"kw1": tf.zeros([2, 7, 1, 2, 4]), "kw2": tf.zeros([2, 7, 1, 3, 4])}), ValueError,
     "`pre['kw2']` must have shape (B, S, G, R, M) = (2, 7, 1, 2, 4). "
     "Received: pre['kw2'].shape=(2, 7, 1, 3, 4)"),
    (dict(pre=[1]), TypeError, "`pre` must be None or a dict of compose terms. Received: list"),
    (dict(mask=tf.ones([2, 6, 7], tf.float32)), TypeError,
     "`mask` must be boolean (True = attend) or integer (1 = attend). "
     "Received: mask.dtype=float32"),
    (dict(mask=tf.ones([2, 6, 7], tf.int32)), TypeError,
     "`mask` must be boolean (True = attend). Received: dtype=int32"),
    (dict(mask=tf.ones([2, 6, 5], tf.bool)), ValueError,
     "`mask` must broadcast to (B, T, S) = (2, 6, 7). Received: mask.shape=(2, 6, 5)"),
    (dict(q=tf.zeros([2, 6, 4, 8], tf.int32)), TypeError,
     "`q` must be a floating tensor. Received: dtype=int32"),
])
def test_bad_arguments(fn, over, exc, msg):
    with pytest.raises(exc) as info:
        fn(**_args(**over))
    assert str(info.value) == msg


@pytest.mark.parametrize("shape", [(1, 6, 7), (2, 1, 7), (2, 6, 1)])
def test_mask_broadcasts(shape):
    p = make_problem(seed=11, pre=("qw", "kdd"), post=("kw",))
    rng = np.random.default_rng(1)
    mask = rng.random(shape) < 0.7
    mask.flat[0] = True
    c = lambda x: tf.constant(x, tf.float32)  # noqa: E731
    o = xla.dcmha_attention(c(p["q"]), c(p["k"]), c(p["v"]), num_groups=1, causal=True,
                            pre={n: c(x) for n, x in p["pre"].items()},
                            post={n: c(x) for n, x in p["post"].items()},
                            mask=tf.constant(mask), query_chunk_size=3)
    o_np, _, _ = spec_core(dict(p, mask=np.broadcast_to(mask, (2, 6, 7))), causal=True)
    assert_close(o, o_np, 1e-5, "o")


# ---------------------------------------------------------------------------
# Packaging (the conformance suite runs this path as "impl-xla")
# ---------------------------------------------------------------------------

def test_import_does_not_import_tensorflow():
    code = ("import sys, dcmha, dcmha.backends.xla; "
            "print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    assert xla.is_available()
