"""Dispatch of the attention core: ``implementation=`` names, the "auto" rules and each
fast path against the plain "ops" core (``dcmha.registry.select``, which
``dcmha.ops.dcmha_attention`` calls; the registry itself is tested in
test_dispatch_registry.py).

Runs on CPU on the Keras backend of the process (KERAS_BACKEND=jax|torch|tensorflow|numpy);
what does not apply to that backend is skipped with the reason. The forced-Triton
comparisons run only in the triton-interpret step (TRITON_INTERPRET=1 KERAS_BACKEND=torch,
set before the process starts). Interpreted kernels are slow: shapes are tiny (B=1, T<=8,
N<=4, d<=8).

Tolerances, as in test_layer_numerics.py: rtol 1e-5 and an atol of 2e-5 times the largest
expected magnitude (the layer's composition weights are scaled up 20x, so compose is far
from the identity and a wrong compose shows).
"""

import importlib
import os
import re
import sys
import types

import numpy as np
import pytest

import keras
from keras import ops

from dcmha.call import describe
from dcmha import ops as dops
from dcmha import registry
from dcmha.layers import DCMHA

BACKEND = keras.backend.backend()
#: Every ``implementation`` name, as the error message lists them.
NAMES = ["auto", "jax_cpu", "jax_decode", "ops", "pallas", "tf_cpu", "tf_decode", "torch",
         "torch_decode", "triton", "xla"]
#: The fast paths "auto" tries on each Keras backend, in order (higher priority first).
AUTO_ORDER = {"torch": ["triton", "torch_decode", "torch"], "jax": ["pallas", "jax_decode", "jax_cpu"],
              "tensorflow": ["tf_decode", "tf_cpu", "xla"], "numpy": []}
#: TRITON_INTERPRET as the process started (Triton reads it when first imported).
INTERPRET_STEP = (BACKEND == "torch" and os.environ.get("TRITON_INTERPRET") == "1"
                  and "tensorflow" not in sys.modules)
#: Forced Triton on CPU tensors without TRITON_INTERPRET=1: the registration's device rule.
TRITON_DEVICE_MSG = ("`implementation='triton'` cannot run this call: runs on gpu, not on cpu "
                     "(on CPU set TRITON_INTERPRET=1 before the framework is imported)")
#: The same, when the environment says interpret but Triton was loaded compiled: the
#: module's own rule (it knows how Triton was loaded).
TRITON_MSG = ("`implementation='triton'` cannot run this call: needs CUDA tensors, or "
              "TRITON_INTERPRET=1 set before triton is imported, to run on CPU. "
              "Received: q on cpu")
#: Why "auto" passes over a GPU-only fast path on CPU, and over a small call.
AUTO_GPU_ONLY = "'auto' takes it on gpu, not on cpu"
AUTO_SMALL = "'auto' takes it from T * S >= 256; this call has T * S = {}"
AUTO_ONE_QUERY = "'auto' takes it for one-query calls (T = 1); this call has T = {}"

needs_torch = pytest.mark.skipif(BACKEND != "torch", reason="a rule of the torch backend")
needs_jax = pytest.mark.skipif(BACKEND != "jax", reason="the Pallas path runs on the jax backend")
needs_tf = pytest.mark.skipif(BACKEND != "tensorflow",
                              reason="the XLA path runs on the tensorflow backend")
needs_interpret = pytest.mark.skipif(
    not INTERPRET_STEP, reason="runs in the triton-interpret step only "
    "(TRITON_INTERPRET=1 KERAS_BACKEND=torch, without TensorFlow in the process)")

# A small layer with every switch that reaches the attention core: GQA, two groups, static
# and dynamic compose terms in both stages, QK-norm, RoPE, a sliding window.
LAYER = dict(num_heads=4, key_dim=8, num_key_value_heads=2, num_groups=2, static_compose=True,
             qk_norm=True, rope_max_wavelength=100.0, use_bias=True, sliding_window=4)


def np_(x):
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")), dtype=np.float64)


def assert_close(got, expected, rtol=1e-5, atol_rel=2e-5):
    got, expected = np_(got), np.asarray(expected, np.float64)
    assert got.shape == expected.shape
    assert np.all(np.isfinite(got))
    atol = atol_rel * max(1.0, np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------
# Problems and helpers
# ---------------------------------------------------------------------------

TERM_NAMES = ("qw1", "qw2", "kw1", "kw2", "qdd", "kdd", "static")


def problem(seed=0, B=1, T=6, S=6, N=4, N_kv=2, d=8, d_v=8, G=2, R=2):
    """Random float32 q (B, T, N, d), k (B, S, N_kv, d), v (B, S, N_kv, d_v) and both
    stages' compose terms (NumPy), plus a (B, T, S) mask with a fully masked row."""
    rng = np.random.default_rng(seed)
    M = N // G

    def a(*shape, scale=1.0):
        return rng.normal(0.0, scale, size=shape).astype(np.float32)

    def stage():
        return dict(qw1=a(B, T, G, R, M, scale=0.5), qw2=a(B, T, G, R, M, scale=0.5),
                    kw1=a(B, S, G, R, M, scale=0.5), kw2=a(B, S, G, R, M, scale=0.5),
                    qdd=a(B, T, G, M, scale=0.5), kdd=a(B, S, G, M, scale=0.5),
                    static=a(G, M, M, scale=0.5))

    mask = rng.random((B, T, S)) > 0.3
    mask[0, 1] = False
    return dict(q=a(B, T, N, d), k=a(B, S, N_kv, d), v=a(B, S, N_kv, d_v), pre=stage(),
                post=stage(), mask=mask, do=a(B, T, N, d_v), G=G)


def make_call(p=None, **overrides):
    """The ``AttentionCall`` ``dcmha_attention`` hands to the cores, on backend tensors."""
    p = p or problem()
    t = ops.convert_to_tensor
    return describe(t(p["q"]), t(p["k"]), t(p["v"]), num_groups=p["G"],
                    pre={n: t(w) for n, w in p["pre"].items()},
                    post={n: t(w) for n, w in p["post"].items()}, **overrides)


def refused(name, reason, end="$"):
    """The exact (anchored) pattern of a forced implementation's refusal."""
    return "^" + re.escape(f"`implementation={name!r}` cannot run this call: {reason}") + end


def attention_kwargs(p):
    """dcmha_attention keyword arguments of a problem: mask, causal, window 3, offset 0."""
    return dict(num_groups=p["G"], attention_mask=ops.convert_to_tensor(p["mask"]),
                use_causal_mask=True, sliding_window=3, return_attention_scores=True)


def make_layers(reference_case, impl, kwargs=LAYER, T=6):
    """(case, {"ops": layer, impl: layer}) sharing the spec weights of one case."""
    case = reference_case(kwargs, B=1, T=T)
    layers = {}
    for name in ("ops", impl):
        layer = DCMHA(**{**case["cfg"].to_dict(), "implementation": name})
        layer.load_spec_weights(case["params"])
        layers[name] = layer
    return case, layers


def layer_mask(case, rng):
    """A (B, 1, T, T) mask (Keras' broadcast head axis) with a fully masked row."""
    B, T = case["query"].shape[:2]
    mask = rng.random((B, 1, T, T)) > 0.3
    mask[0, 0, 2] = False
    return mask


def fast_path(name):
    """The fast-path module, or skip when it does not import here."""
    try:
        return registry.get(name).load()
    except ImportError as e:
        pytest.skip(f"the {name!r} fast path does not import here: {e}")


#: The built-in fast paths: every registered implementation but the plain core.
FAST_PATHS = sorted(n for n in registry.implementations() if n != "ops")


def own_fast_paths():
    return [n for n in FAST_PATHS if registry.get(n).backend == BACKEND]


# ---------------------------------------------------------------------------
# Names (every backend)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["cuda", "Triton", None, 3])
def test_unknown_implementation_is_refused(bad):
    message = f"`implementation` must be one of {NAMES}. Received: implementation={bad!r}"
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        registry.resolve(bad)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        registry.select(bad, make_call())
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        DCMHA(4, 8, implementation=bad)
    p = problem()
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        dops.dcmha_attention(p["q"], p["k"], p["v"], num_groups=2, implementation=bad)


def test_every_name_is_accepted_by_the_layer():
    for name in NAMES:
        assert DCMHA(4, 8, implementation=name).get_config()["implementation"] == name


def test_registry_names_backends_and_auto_order():
    table = registry.implementations()
    assert sorted(("auto",) + tuple(table)) == NAMES
    assert {n: impl.backend for n, impl in table.items()} == {
        "ops": "any", "triton": "torch", "torch": "torch", "torch_decode": "torch", "pallas": "jax",
        "xla": "tensorflow", "jax_cpu": "jax", "jax_decode": "jax", "tf_cpu": "tensorflow", "tf_decode": "tensorflow"}
    # "auto" tries this backend's fast paths by priority, then "ops" (a small eager call
    # on CPU is taken by none of them, so explain lists them all).
    assert [name for name, _ in registry.explain(make_call())] == AUTO_ORDER[BACKEND] + ["ops"]
    for backend, order in AUTO_ORDER.items():
        assert all(table[n].backend == backend for n in order), (backend, order)
        priorities = [table[n].priority for n in order]
        assert priorities == sorted(priorities, reverse=True), (backend, priorities)


@pytest.mark.parametrize("name", FAST_PATHS)
def test_fast_path_on_another_backend_is_refused(name, reference_case, call_layer):
    needs = registry.get(name).backend
    if needs == BACKEND:
        pytest.skip(f"{name!r} runs on this backend ({BACKEND})")
    message = (f"`implementation={name!r}` runs on the {needs!r} Keras backend. "
               f"Received: the active Keras backend is {BACKEND!r}")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        registry.select(name, make_call())
    case, layers = make_layers(reference_case, name)
    with pytest.raises(ValueError, match=re.escape(message)):
        call_layer(layers[name], case["query"], case["query"])


def test_auto_takes_ops_or_a_fast_path_of_this_backend(chosen, reference_case):
    name, fn = registry.select("auto", make_call())
    assert name in ["ops"] + AUTO_ORDER[BACKEND]
    if not AUTO_ORDER[BACKEND]:                  # numpy: no fast path at all
        assert (name, fn) == ("ops", dops.attention)
    if BACKEND == "jax":     # CPU: Pallas would interpret; the call is too small for jax_cpu
        assert name == "ops"
    case, layers = make_layers(reference_case, "ops")
    layers["ops"](case["query"], case["query"])
    assert chosen == [name, "ops"]


def test_explicit_ops_is_the_plain_core():
    assert registry.select("ops", make_call()) == ("ops", dops.attention)
    call = make_call(training=True, dropout_rate=0.5, return_intermediates=True,
                     return_attention_scores=True)
    assert call.needs == {"dropout", "intermediates", "attention_scores"}
    assert registry.get("ops").lacks == frozenset()
    assert registry.select("ops", call) == ("ops", dops.attention)


@pytest.mark.parametrize("what", ["dropout", "intermediates"])
def test_own_fast_paths_refuse_dropout_and_intermediates(what, monkeypatch):
    # Every fast path declares that it lacks both; the registry refuses them with the reason
    # before the path's module is imported.
    assert all({"dropout", "intermediates"} <= registry.get(n).lacks for n in FAST_PATHS)
    names = own_fast_paths()
    if not names:
        pytest.skip(f"the {BACKEND} backend has no fast path")
    over = (dict(training=True, dropout_rate=0.25) if what == "dropout"
            else dict(return_intermediates=True))
    reason = ("the call needs attention dropout (dropout_rate=0.25 in training), which it "
              "does not do" if what == "dropout" else
              "the call needs the intermediates (return_intermediates=True), which it never "
              "materialises")
    call = make_call(**over)
    assert call.needs == {what}
    rows = dict(registry.explain(call))
    for name in names:
        impl = registry.get(name)
        # A path that runs on CPU only under an environment setting (Triton's interpreter):
        # set it, so that the capability is what refuses the call.
        for key, value in impl.cpu_env.items():
            monkeypatch.setenv(key, value)
        with pytest.raises(ValueError, match=refused(name, reason)):
            registry.select(name, call)
        # "auto" passes over it with the same reason where it would consider it (CPU).
        assert rows[name] == (reason if "cpu" in impl.auto_devices else AUTO_GPU_ONLY), name
    # The same call is fine without the option, for the rule's own part.
    if what == "dropout":
        assert make_call(training=False, dropout_rate=0.25).needs == frozenset()
        assert make_call(training=True, dropout_rate=0.0).needs == frozenset()
    # auto falls back to ops for them.
    assert registry.select("auto", call)[0] == "ops"
    assert list(rows) == AUTO_ORDER[BACKEND] + ["ops"] and rows["ops"] is None


# ---------------------------------------------------------------------------
# Triton: the rules (no Triton import needed)
# ---------------------------------------------------------------------------

def _fake_tensor(device_type):
    return types.SimpleNamespace(is_cuda=device_type == "cuda", shape=(1, 6, 4, 8),
                                 device=types.SimpleNamespace(type=device_type))


def test_importing_the_triton_path_does_not_import_triton():
    before = "triton" in sys.modules
    kc = importlib.import_module("dcmha.backends.triton.core")
    assert callable(kc.unsupported) and callable(kc.preferred) and callable(kc.attention)
    if not before:
        assert "triton" not in sys.modules


@pytest.mark.parametrize("installed", [True, False])
def test_triton_preferred_only_for_cuda_tensors_with_triton(monkeypatch, installed):
    kc = importlib.import_module("dcmha.backends.triton.core")
    monkeypatch.setattr(kc, "_triton_installed", lambda: installed)
    on = lambda device: types.SimpleNamespace(q=_fake_tensor(device))  # noqa: E731
    assert kc.preferred(on("cuda")) is installed
    assert kc.preferred(on("cpu")) is False
    assert kc.preferred(on("meta")) is False
    if BACKEND == "torch":
        assert kc.preferred(make_call()) is False          # a real CPU tensor


def _fake_call(**kwargs):
    """An ``AttentionCall`` on fake CUDA tensors (B=1, T=S=6, N=N_kv=4, d=8)."""
    q = _fake_tensor("cuda")
    return describe(q, q, q, **kwargs)


@needs_torch
def test_auto_takes_triton_for_cuda_tensors(monkeypatch):
    kc = importlib.import_module("dcmha.backends.triton.core")
    monkeypatch.setattr(kc, "_triton_installed", lambda: True)
    monkeypatch.setattr(kc, "_interpreting", lambda: False)
    # The fake call's kernels fit the GPU (the shared-memory rule itself:
    # tests/backends/test_triton_shared_memory.py).
    monkeypatch.setattr(kc, "_shared_memory_problem", lambda call: None)
    call = _fake_call()
    if "tensorflow" in sys.modules and "triton" not in sys.modules:
        pytest.skip("TensorFlow is imported in this process: Triton must not be imported")
    assert registry.current_device(call) == "gpu"
    assert kc.unsupported(call) is None
    name, fn = registry.select("auto", call)
    assert (name, fn) == ("triton", kc.attention)
    assert registry.explain(call) == [("triton", None)]
    # Triton is tried first, but a call it cannot run goes on down the order: "torch" is
    # taken by "auto" on CPU only.
    call = _fake_call(training=True, dropout_rate=0.1)
    assert registry.select("auto", call)[0] == "ops"
    assert registry.explain(call) == [
        ("triton", "the call needs attention dropout (dropout_rate=0.1 in training), which it "
                   "does not do"),
        ("torch_decode", "'auto' takes it on cpu, not on gpu"),
        ("torch", "'auto' takes it on cpu, not on gpu"), ("ops", None)]
    # Kernels over the GPU's shared memory: "auto" goes on down the order, and naming
    # Triton raises with the reason.
    too_large = "its kernels ask for more shared memory per block"
    monkeypatch.setattr(kc, "_shared_memory_problem", lambda call: too_large)
    call = _fake_call()
    assert registry.select("auto", call)[0] == "ops"
    assert registry.explain(call)[0] == ("triton", too_large)
    with pytest.raises(ValueError, match="^`implementation='triton'` cannot run this call: "
                                         "its kernels ask for more shared memory per block$"):
        registry.select("triton", call)


@needs_torch
def test_auto_never_takes_triton_for_cpu_tensors(chosen, reference_case):
    before = "triton" in sys.modules
    call = make_call()
    name, _ = registry.select("auto", call)
    # Triton is GPU-only for "auto"; "torch" takes CPU calls from T * S = 256 (this is 36).
    assert name == "ops"
    assert registry.explain(call) == [("triton", AUTO_GPU_ONLY),
                                      ("torch_decode", AUTO_ONE_QUERY.format(6)),
                                      ("torch", AUTO_SMALL.format(36)), ("ops", None)]
    case, layers = make_layers(reference_case, "ops")
    layer = DCMHA(**{**case["cfg"].to_dict(), "implementation": "auto"})
    layer.load_spec_weights(case["params"])
    y = layer(case["query"], case["query"], use_causal_mask=True)
    assert len(chosen) > 1 and "triton" not in chosen[1:]   # the layer's picks were seen
    assert_close(y, np_(layers["ops"](case["query"], case["query"], use_causal_mask=True)))
    if not before:
        assert "triton" not in sys.modules           # auto never imports Triton for CPU


@needs_torch
def test_forced_triton_on_cpu_without_interpret_is_refused(monkeypatch, reference_case):
    # The registration's device rule reads the environment: no Triton import, whatever
    # mode an earlier import of Triton in this process chose.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = "triton" in sys.modules
    with pytest.raises(ValueError, match="^" + re.escape(TRITON_DEVICE_MSG) + "$"):
        registry.select("triton", make_call())
    p = problem()
    with pytest.raises(ValueError, match="^" + re.escape(TRITON_DEVICE_MSG) + "$"):
        dops.dcmha_attention(p["q"], p["k"], p["v"], num_groups=2, implementation="triton")
    case, layers = make_layers(reference_case, "triton")
    with pytest.raises(ValueError, match=re.escape(TRITON_DEVICE_MSG)):
        layers["triton"](case["query"], case["query"])
    if not before:
        assert "triton" not in sys.modules


@needs_torch
def test_forced_triton_on_cpu_with_compiled_triton_is_refused(monkeypatch):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    kc = importlib.import_module("dcmha.backends.triton.core")
    # The environment says interpret, but Triton was loaded compiled (it fixes its mode
    # when first imported): the module's rule, which knows the loaded mode, refuses.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kc, "_interpreting", lambda: False)
    before = "triton" in sys.modules
    with pytest.raises(ValueError, match="^" + re.escape(TRITON_MSG) + "$"):
        registry.select("triton", make_call())
    if not before:
        assert "triton" not in sys.modules


@needs_torch
def test_triton_refuses_other_calls_it_cannot_run():
    kc = importlib.import_module("dcmha.backends.triton.core")
    p = problem()
    for name in ("qw1", "qw2", "kw1", "kw2"):       # the post stage at rank 1, pre at 2
        p["post"][name] = p["post"][name][:, :, :, :1]
    assert kc.unsupported(make_call(p)) == (
        "takes one rank R for every dynamic projection. Received: ranks [1, 2]")
    offset = ops.convert_to_tensor(2.0)
    with pytest.raises(ValueError, match="^" + re.escape(    # refused once, for every path
            "`query_offset` must be an integer or an integer scalar tensor. Received: "
            "query_offset.shape=(), query_offset.dtype=float32") + "$"):
        make_call(query_offset=offset)


# ---------------------------------------------------------------------------
# Triton: forced, interpreted on CPU, against "ops"
# ---------------------------------------------------------------------------

@needs_interpret
def test_forced_triton_matches_ops_in_the_layer(reference_case, rng, chosen):
    import torch

    case, layers = make_layers(reference_case, "triton")
    mask = layer_mask(case, rng)
    x = case["query"]
    with torch.no_grad():
        out = {n: layer(x, x, attention_mask=mask, use_causal_mask=True,
                        return_attention_scores=True) for n, layer in layers.items()}
    assert chosen == ["ops", "triton"]
    for got, want in zip(out["triton"], out["ops"]):
        assert_close(got, np_(want))
    assert np.all(np_(out["triton"][1])[0, :, 2] == 0.0)     # the fully masked row


@needs_interpret
def test_forced_triton_refuses_scores_while_autograd_records(reference_case):
    case, layers = make_layers(reference_case, "triton")
    message = ("`implementation='triton'` cannot run this call: returns attention scores that "
               "are not differentiable, and autograd is recording; call under torch.no_grad() "
               "or use implementation='ops'")
    with pytest.raises(ValueError, match=re.escape(message)):
        layers["triton"](case["query"], case["query"], return_attention_scores=True)


@needs_interpret
def test_forced_triton_gradients_match_ops():
    import torch

    p = problem(seed=3)
    grads = {}
    for name in ("ops", "triton"):
        leaves = {n: torch.tensor(p[n], requires_grad=True) for n in ("q", "k", "v")}
        stages = {st: {n: torch.tensor(w, requires_grad=True) for n, w in p[st].items()}
                  for st in ("pre", "post")}
        kw = attention_kwargs(p)
        kw["return_attention_scores"] = False
        o = dops.dcmha_attention(leaves["q"], leaves["k"], leaves["v"], pre=stages["pre"],
                                 post=stages["post"], implementation=name, **kw)
        (o * torch.tensor(p["do"])).sum().backward()
        grads[name] = dict(o=o.detach(), **{n: x.grad for n, x in leaves.items()},
                           **{f"{st}/{n}": w.grad for st, ws in stages.items()
                              for n, w in ws.items()})
    assert set(grads["triton"]) == set(grads["ops"])
    for n, want in grads["ops"].items():
        assert grads["triton"][n] is not None, n
        assert_close(grads["triton"][n], np_(want))


@needs_interpret
def test_forced_triton_decoding_matches_ops(reference_case, chosen):
    import torch

    case, layers = make_layers(reference_case, "triton", T=7)
    x = case["query"]
    outs = {}
    for name, layer in layers.items():
        cache, steps = layer.init_cache(1, 8), []
        with torch.no_grad():
            for start, stop, index in ((0, 4, 0), (4, 5, 4),
                                       (5, 7, ops.convert_to_tensor(5, "int32"))):
                y, s, cache = layer(x[:, start:stop], x[:, start:stop], use_causal_mask=True,
                                    cache=cache, cache_update_index=index,
                                    return_attention_scores=True)
                steps += [y, s]
        outs[name] = steps
    assert chosen == ["ops"] * 3 + ["triton"] * 3
    for got, want in zip(outs["triton"], outs["ops"]):
        assert_close(got, np_(want))


# ---------------------------------------------------------------------------
# Pallas (jax): the rules, and forced (interpreted on CPU) against "ops"
# ---------------------------------------------------------------------------

@needs_jax
@pytest.mark.parametrize("platform,expected", [
    ("gpu", True), ("cpu", False), ("tpu", False)])
def test_pallas_taken_by_auto_on_a_gpu_only(monkeypatch, platform, expected):
    import jax

    kc = fast_path("pallas")
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    call = make_call()
    assert kc.unsupported(call) is None
    assert not hasattr(kc, "preferred")              # the device rule is declared
    assert registry.get("pallas").auto_devices == {"gpu"}
    assert registry.select("auto", call)[0] == ("pallas" if expected else "ops")
    if platform == "gpu":
        assert registry.explain(call) == [("pallas", None)]
    # A concrete array offset would compile new kernels for every value: not preferred,
    # and the registration declares that it takes the offset only as an int.
    offset_call = make_call(query_offset=jax.numpy.asarray(2), use_causal_mask=True)
    assert "traced_offset" in offset_call.needs & registry.get("pallas").lacks
    if platform == "gpu":
        assert registry.explain(offset_call) == [
            ("pallas", "the call needs a query_offset that is a tensor (e.g. a "
                       "cache_update_index inside a traced function), which it takes only as "
                       "an int"),
            ("jax_decode", "'auto' takes it on cpu, not on gpu"),
            ("jax_cpu", "'auto' takes it on cpu, not on gpu"), ("ops", None)]


@needs_jax
def test_forced_pallas_matches_ops_in_the_layer(reference_case, rng, chosen, call_layer):
    case, layers = make_layers(reference_case, "pallas")
    mask = layer_mask(case, rng)
    x = case["query"]
    out = {n: call_layer(layer, x, x, attention_mask=mask, use_causal_mask=True,
                         return_attention_scores=True) for n, layer in layers.items()}
    assert chosen == ["ops", "pallas"]
    for got, want in zip(out["pallas"], out["ops"]):
        assert_close(got, np_(want))


@needs_jax
def test_forced_pallas_gradients_match_ops():
    import jax
    import jax.numpy as jnp

    p = problem(seed=3)
    kw = attention_kwargs(p)

    def loss(args, name):
        o, extras = dops.dcmha_attention(args["q"], args["k"], args["v"], pre=args["pre"],
                                         post=args["post"], implementation=name, **kw)
        s = extras["attention_scores"]
        # Both results carry gradients; weight the scores so a missing one shows.
        return jnp.sum(o * p["do"]) + jnp.sum(s * jnp.arange(s.size).reshape(s.shape) / s.size)

    args = {n: jnp.asarray(p[n]) for n in ("q", "k", "v")}
    args.update(pre={n: jnp.asarray(w) for n, w in p["pre"].items()},
                post={n: jnp.asarray(w) for n, w in p["post"].items()})
    grads = {name: jax.jit(jax.value_and_grad(lambda a, n=name: loss(a, n)))(args)
             for name in ("ops", "pallas")}
    assert_close(grads["pallas"][0], np_(grads["ops"][0]))
    flat_ops = jax.tree_util.tree_leaves_with_path(grads["ops"][1])
    flat_pl = dict(jax.tree_util.tree_leaves_with_path(grads["pallas"][1]))
    assert len(flat_ops) == 3 + 2 * len(TERM_NAMES)
    for path, want in flat_ops:
        assert_close(flat_pl[path], np_(want))


@needs_jax
def test_forced_pallas_decoding_matches_ops(reference_case, chosen, call_layer):
    case, layers = make_layers(reference_case, "pallas", T=7)
    x = case["query"]
    outs = {}
    for name, layer in layers.items():
        cache, steps = layer.init_cache(1, 8), []
        for start, stop in ((0, 4), (4, 5), (5, 7)):
            y, s, cache = call_layer(layer, x[:, start:stop], x[:, start:stop],
                                     use_causal_mask=True, cache=cache,
                                     cache_update_index=start, return_attention_scores=True)
            steps += [y, s]
        outs[name] = steps
    assert chosen == ["ops"] * 3 + ["pallas"] * 3
    for got, want in zip(outs["pallas"], outs["ops"]):
        assert_close(got, np_(want))


@needs_jax
def test_pallas_refuses_a_traced_offset_and_auto_falls_back(chosen):
    import jax

    p = problem()

    def run(offset, name):
        return dops.dcmha_attention(p["q"], p["k"], p["v"], num_groups=2, use_causal_mask=True,
                                    query_offset=offset, implementation=name)

    with pytest.raises(ValueError, match=refused(
            "pallas", "the call needs a query_offset that is a tensor (e.g. a "
                      "cache_update_index inside a traced function), which it takes only as "
                      "an int", end=r"(\n|$)")):   # jax.jit appends a note on a new line
        jax.jit(lambda i: run(i, "pallas"))(2)
    auto = jax.jit(lambda i: run(i, "auto"))(2)
    assert chosen[-1] == "ops"
    assert_close(auto, np_(run(2, "ops")))


# ---------------------------------------------------------------------------
# XLA (tensorflow): auto in traced functions, forced against "ops"
# ---------------------------------------------------------------------------

@needs_tf
def test_auto_takes_xla_when_traced_and_ops_eagerly(reference_case, rng, chosen):
    import tensorflow as tf

    case, layers = make_layers(reference_case, "ops")
    auto = DCMHA(**{**case["cfg"].to_dict(), "implementation": "auto"})
    auto.load_spec_weights(case["params"])
    mask = layer_mask(case, rng)
    x = case["query"]
    kw = dict(attention_mask=mask, use_causal_mask=True, return_attention_scores=True)
    want = layers["ops"](x, x, **kw)
    eager = auto(x, x, **kw)
    traced = tf.function(lambda a: auto(a, a, **kw))(x)
    assert chosen == ["ops", "ops", "xla"]
    for got_e, got_t, w in zip(eager, traced, want):
        assert_close(got_e, np_(w))
        assert_close(got_t, np_(w))


@needs_tf
def test_forced_xla_matches_ops_in_the_layer_with_gradients(reference_case, rng, chosen):
    import tensorflow as tf

    case, layers = make_layers(reference_case, "xla")
    mask = layer_mask(case, rng)
    x = tf.constant(case["query"])
    res = {}
    for name, layer in layers.items():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y, s = layer(x, x, attention_mask=mask, use_causal_mask=True,
                         return_attention_scores=True)
            # Both results carry gradients; weight the scores so a missing one shows.
            weights = np.linspace(0.0, 1.0, int(np.prod(s.shape)), dtype=np.float32)
            loss = tf.reduce_sum(y * y) + tf.reduce_sum(s * weights.reshape(s.shape))
        gx, *gw = tape.gradient(loss, [x] + layer.trainable_variables)
        res[name] = [y, s, gx] + gw
    assert chosen == ["ops", "xla"]
    assert len(res["xla"]) == len(res["ops"])
    for got, want in zip(res["xla"], res["ops"]):
        assert got is not None
        assert_close(got, np_(want))


@needs_tf
def test_forced_xla_with_a_decode_cache_is_refused(reference_case, chosen):
    import tensorflow as tf

    case, layers = make_layers(reference_case, "xla", T=7)
    x = case["query"]
    message = ("`implementation='xla'` cannot run this call: the call needs query_offset=4 "
               "with a causal mask or window, which it does not take")
    cache = layers["xla"].init_cache(1, 8)
    _, cache = layers["xla"](x[:, :4], x[:, :4], use_causal_mask=True, cache=cache,
                             cache_update_index=0)             # offset 0: XLA runs it
    with pytest.raises(ValueError, match=re.escape(message)):
        layers["xla"](x[:, 4:], x[:, 4:], use_causal_mask=True, cache=cache,
                      cache_update_index=4)
    # auto, traced, falls back to ops for the same step (and gives the ops result).
    auto = DCMHA(**{**case["cfg"].to_dict(), "implementation": "auto"})
    auto.load_spec_weights(case["params"])
    chosen.clear()
    step = tf.function(lambda a, c: auto(a, a, use_causal_mask=True, cache=c,
                                         cache_update_index=4))
    y_auto, _ = step(x[:, 4:], cache)
    y_ops, _ = layers["ops"](x[:, 4:], x[:, 4:], use_causal_mask=True, cache=cache,
                             cache_update_index=4)
    assert chosen == ["ops", "ops"]
    assert_close(y_auto, np_(y_ops))


@needs_tf
def test_xla_ignores_an_offset_without_causal_mask_or_window():
    kc = fast_path("xla")
    assert "query_offset" in registry.get("xla").lacks
    # A query offset matters only with a causal mask or a window.
    assert make_call(query_offset=3).needs == frozenset()
    assert make_call(query_offset=3, use_causal_mask=True).needs == {"query_offset"}
    assert make_call(query_offset=3, sliding_window=2).needs == {"query_offset"}
    assert make_call(query_offset=0, use_causal_mask=True).needs == frozenset()
    assert kc.unsupported(make_call(query_offset=3)) is None
    assert registry.select("xla", make_call(query_offset=3)) == ("xla", kc.attention)
    with pytest.raises(ValueError, match=refused(
            "xla", "the call needs query_offset=3 with a causal mask or window, which it does "
                   "not take")):
        registry.select("xla", make_call(query_offset=3, sliding_window=2))
    p = problem()
    want = dops.dcmha_attention(p["q"], p["k"], p["v"], num_groups=2, pre=p["pre"],
                                query_offset=3, implementation="ops")
    got = dops.dcmha_attention(p["q"], p["k"], p["v"], num_groups=2, pre=p["pre"],
                               query_offset=3, implementation="xla")
    assert_close(got, np_(want))
