"""The compiled-kernel CPU paths of jax and tensorflow (dcmha.backends.jax_cpu, tf_cpu).

Both run ``dcmha.backends.cpu_blocks``: blocks in ``keras.ops`` whose composes are the C
kernel (jax: through ``jax.ffi``; tensorflow: as TensorFlow ops). Forward and gradients of
``dcmha_attention`` (w.r.t. q, k, v and every compose term) against the float64 NumPy spec,
with the conformance tolerance policy (``tests/kernel_cases.py``); the plain reference
beside it against the spec too; then the Keras fast path ("jax_cpu" / "tf_cpu" in
``dcmha.registry``): its dispatch rules and ``DCMHA(implementation=...)`` against
``implementation="ops"``.

Runs with KERAS_BACKEND=jax or tensorflow (skipped on the others) and needs the compiled
kernel (a C and a C++ compiler; ``test_kernel_builds_where_compilers_exist`` fails if they
exist and the build does not).
"""

import importlib
import shutil

import numpy as np
import pytest

from tests import kernel_cases

BACKEND, PATH, core = kernel_cases.cpu_path_or_skip()

from dcmha import DCMHA  # noqa: E402
from dcmha.call import describe  # noqa: E402
from dcmha import registry  # noqa: E402
from tests.kernel_cases import assert_close, make_problem, spec_result  # noqa: E402
from keras import ops  # noqa: E402

path_core = importlib.import_module(f"dcmha.backends.{PATH}.core")

HAVE_COMPILERS = (any(shutil.which(c) for c in ("cc", "gcc", "clang"))
                  and any(shutil.which(c) for c in ("c++", "g++", "clang++")))
needs_kernel = pytest.mark.skipif(not core.load(), reason=f"kernel: {core.unavailable_reason()}")


def _vjp(f, args, ct):
    """(f(*args), gradients of sum(f * ct) w.r.t. args), compiled the backend's way."""
    if BACKEND == "jax":
        import jax

        @jax.jit
        def go(*a):
            out, vjp = jax.vjp(f, *a)
            return out, vjp(ct)
        return go(*args)
    import tensorflow as tf

    @tf.function
    def go(*a):
        leaves = tf.nest.flatten(a)         # absent stages are None leaves
        present = [x for x in leaves if x is not None]
        with tf.GradientTape() as tape:
            tape.watch(present)
            out = f(*a)
        grads = iter(tape.gradient(out, present, output_gradients=ct))
        return out, tf.nest.pack_sequence_as(
            a, [None if x is None else next(grads) for x in leaves])
    return go(*args)


def run(fn, p, kwargs):
    """fn's output and gradients of sum(o * dO) as float64 NumPy, keyed like spec_result."""
    f32 = lambda a: ops.convert_to_tensor(np.asarray(a, np.float32))  # noqa: E731
    args = (f32(p["q"]), f32(p["k"]), f32(p["v"]),
            None if p["pre"] is None else {n: f32(a) for n, a in p["pre"].items()},
            None if p["post"] is None else {n: f32(a) for n, a in p["post"].items()})
    o, (gq, gk, gv, gpre, gpost) = _vjp(
        lambda q, k, v, pre, post: fn(q, k, v, num_groups=p["G"], pre=pre, post=post,
                                      **kwargs), args, f32(p["do"]))
    res = {"output": o, "grad/q": gq, "grad/k": gk, "grad/v": gv}
    for stage, g in (("pre", gpre), ("post", gpost)):
        res.update({f"grad/{stage}/{n}": x for n, x in (g or {}).items()})
    return {n: np.asarray(ops.convert_to_numpy(x), np.float64) for n, x in res.items()}


def check(p, *, mask=None, causal=False, sliding_window=None, query_offset=0, block_q=4,
          against_reference=False):
    full = kernel_cases.full_mask(p, mask=mask, causal=causal, sliding_window=sliding_window,
                                  query_offset=query_offset)
    expected, sigma = spec_result(p, full, scores=False)
    kwargs = dict(causal=causal, sliding_window=sliding_window, query_offset=query_offset,
                  mask=None if mask is None else ops.convert_to_tensor(mask))
    got = run(core.dcmha_attention, p, dict(kwargs, block_q=block_q))
    assert_close(got, expected, "float32", sigma, f"{PATH} vs spec")
    if against_reference:
        assert_close(run(core.dcmha_attention_reference, p, kwargs), expected, "float32",
                     sigma, "reference vs spec")


@pytest.mark.skipif(not HAVE_COMPILERS, reason="no C / C++ compiler on this machine")
def test_kernel_builds_where_compilers_exist(monkeypatch):
    assert core.load(), core.unavailable_reason()
    assert core.unavailable_reason() is None
    monkeypatch.setenv("DCMHA_CPU_KERNEL", "0")
    assert not core.load()
    assert core.unavailable_reason() == "disabled by DCMHA_CPU_KERNEL"
    assert path_core.unsupported(_call(64, 128)) == (
        "the compiled CPU kernel is unavailable: disabled by DCMHA_CPU_KERNEL")


@needs_kernel
@pytest.mark.parametrize("stage", ["pre", "post"])
@pytest.mark.parametrize("term", ["qw", "kw", "qdd", "kdd", "static"])
def test_each_term_alone(stage, term):
    names = ("qw1", "qw2") if term == "qw" else ("kw1", "kw2") if term == "kw" else (term,)
    p = make_problem(3, **{stage: names, ("post" if stage == "pre" else "pre"): None})
    check(p, causal=True)


@needs_kernel
def test_all_terms_two_groups_gqa_and_the_reference():
    p = make_problem(5, N=8, N_kv=2, G=2)
    check(p, causal=True, against_reference=True)
    check(p, block_q=3)


@needs_kernel
@pytest.mark.parametrize("causal,window,offset", [(True, None, 0), (False, 3, 0), (True, 4, 2),
                                                  (False, 1, 0), (True, None, 5)])
def test_causal_window_and_offset(causal, window, offset):
    p = make_problem(7, T=7, S=12)
    check(p, causal=causal, sliding_window=window, query_offset=offset, block_q=3)


@needs_kernel
def test_mask_with_fully_masked_rows():
    p = make_problem(11, B=2, T=6, S=9)
    mask = np.random.default_rng(0).random((2, 6, 9)) < 0.6
    mask[0, 2] = False
    mask[1, :, 4] = False
    check(p, mask=mask, block_q=2, against_reference=True)
    check(p, mask=mask[:1, :1], causal=True)            # broadcast (1, 1, S) mask


@needs_kernel
@pytest.mark.parametrize("N,G,R,S", [(8, 1, 2, 40), (8, 2, 1, 35), (16, 1, 4, 33),
                                     (4, 4, 1, 20), (6, 2, 3, 20)])
def test_vectorised_kernel_sizes(N, G, R, S):
    """At least 16 visible keys per block: the kernel's vectorised loops (M = N / G in 1, 2,
    4, 8, 16 with R in 1, 2, 4) and its generic ones (M = 3)."""
    p = make_problem(20 + N + G + R + S, B=1, T=6, S=S, N=N, N_kv=N // 2, d=4, d_v=3, G=G, R=R)
    check(p, causal=True, query_offset=S - 6, block_q=4)
    check(p, block_q=8)


# ---------------------------------------------------------------------------
# The Keras fast path
# ---------------------------------------------------------------------------

def _call(T, S, **extra):
    """A validated core call (zeros of the given sizes), with ``extra`` overriding."""
    k = ops.zeros((2, S, 4, 8))
    call = dict(q=ops.zeros((2, T, 4, 8)), k=k, v=k, num_groups=1, use_causal_mask=True)
    call.update(extra)
    q, k, v = call.pop("q"), call.pop("k"), call.pop("v")
    return describe(q, k, v, **call)


@needs_kernel
def test_auto_dispatch_rules():
    # From T * S >= the package's MIN_LENGTH_PRODUCT (RESULTS.md, "Dispatch thresholds").
    threshold = importlib.import_module(f"dcmha.backends.{PATH}").MIN_LENGTH_PRODUCT
    assert registry.select("auto", _call(64, 128))[0] == PATH
    assert registry.select("auto", _call(threshold // 16, 16))[0] == PATH
    assert registry.select("auto", _call(threshold // 16 - 1, 16))[0] == "ops"   # small
    # What the registration declares it lacks: refused by dcmha.registry.
    for extra, reason in [
            (dict(return_attention_scores=True),
             "the call needs the attention scores (return_attention_scores=True), which it "
             "does not return"),
            (dict(training=True, dropout_rate=0.1),
             "the call needs attention dropout (dropout_rate=0.1 in training), which it does "
             "not do"),
            (dict(query_offset=ops.convert_to_tensor(3, "int32")),
             "the call needs a query_offset that is a tensor (e.g. a cache_update_index inside "
             "a traced function), which it takes only as an int"),
            # ... and what only the path's own module can tell.
            (dict(query_chunk_size=8, q=ops.zeros((2, 8 * 65, 4, 8))),
             "more than 64 query blocks (65); the 'ops' core loops over them")]:
        call = _call(64, 128, **extra)
        assert registry.select("auto", call)[0] == "ops"      # eager: no "xla"
        with pytest.raises(ValueError) as e:
            registry.select(PATH, call)
        assert str(e.value) == f"`implementation={PATH!r}` cannot run this call: {reason}"
        assert (PATH, reason) in registry.explain(call)


@needs_kernel
def test_auto_falls_back_when_the_kernel_is_off(monkeypatch):
    monkeypatch.setenv("DCMHA_CPU_KERNEL", "0")
    assert registry.select("auto", _call(64, 128))[0] == "ops"


@needs_kernel
@pytest.mark.skipif(BACKEND != "tensorflow", reason="XLA clusters are TensorFlow's")
def test_tf_cpu_leaves_xla_clusters_to_the_xla_path():
    import tensorflow as tf

    seen = {}

    @tf.function(jit_compile=True)
    def traced(q):
        call = _call(64, 128, q=q)
        seen["reason"] = path_core.unsupported(call)
        seen["auto"] = registry.select("auto", call)[0]
        return q

    traced(ops.zeros((2, 64, 4, 8)))
    assert seen == {"reason": "the call is traced for XLA (jit_compile=True), which cannot "
                              "compile the kernel's ops; the 'xla' path runs there",
                    "auto": "xla"}


def _layer_result(layer, x):
    """[output, d loss / d x, d loss / d each trainable variable] of a causal self-attention
    call, loss = sum(y * cos(index)), compiled the backend's way."""
    layer.build(x.shape, x.shape)
    if BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        ntv = [v.value for v in layer.non_trainable_variables]

        def loss(tv, inp):
            y, _ = layer.stateless_call(tv, ntv, inp, inp, use_causal_mask=True)
            return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y

        (_, out), (g_tv, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            [v.value for v in layer.trainable_variables], x)
        return [out, g_x, *g_tv]
    import tensorflow as tf

    @tf.function
    def step(inp):
        with tf.GradientTape() as tape:
            tape.watch(inp)
            y = layer(inp, inp, use_causal_mask=True)
            weights = tf.cos(tf.reshape(tf.range(tf.size(y), dtype=y.dtype), tf.shape(y)))
            loss = tf.reduce_sum(y * weights)
        return [y, *tape.gradient(loss, [inp] + list(layer.trainable_variables))]
    return step(x)


def _assert_layer_matches_ops(x, **layer_kwargs):
    """DCMHA(implementation=PATH, **layer_kwargs) and "ops" on x: output and every gradient."""
    results = {}
    for impl in (PATH, "ops"):
        layer = DCMHA(implementation=impl, seed=3, **layer_kwargs)
        results[impl] = [np.asarray(ops.convert_to_numpy(a), np.float64)
                         for a in _layer_result(layer, x)]
    assert len(results[PATH]) == len(results["ops"]) > 2
    for got, want in zip(results[PATH], results["ops"]):
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * scale)


@needs_kernel
@pytest.mark.parametrize("layer_kwargs", [{}, dict(num_groups=2, num_key_value_heads=2,
                                                   static_compose=True, sliding_window=5)])
def test_layer_matches_ops(layer_kwargs):
    """DCMHA(implementation=PATH) and "ops": output and every gradient."""
    x = ops.convert_to_tensor(np.random.default_rng(1).normal(size=(2, 16, 16)), "float32")
    _assert_layer_matches_ops(x, num_heads=4, key_dim=8, query_chunk_size=8, **layer_kwargs)


@needs_kernel
def test_split_call_matches_ops():
    """Blocks that the compose handlers split over their thread pool (x (3, 5, 2, 40, 40):
    2 chunks on 2 threads, ``test_cpu_kernel_split.test_chunk_counts``; B G = 15 slices,
    so a chunk ends inside a batch row): every term's forward and gradients against the
    spec, and the layer against "ops"."""
    p = make_problem(31, B=3, T=40, S=40, N=10, N_kv=5, G=5, R=2)
    check(p, block_q=40)
    check(p, causal=True, block_q=40, against_reference=True)
    x = ops.convert_to_tensor(np.random.default_rng(2).normal(size=(3, 40, 20)), "float32")
    _assert_layer_matches_ops(x, num_heads=10, key_dim=4, num_groups=5,
                              query_chunk_size=40)
