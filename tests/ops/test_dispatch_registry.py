"""The implementation registry (``dcmha.registry``): where implementations come from, what
a registration may declare, how "auto" chooses and explains itself, and how it fails.

Runs on CPU on the Keras backend of the process (KERAS_BACKEND=jax|torch|tensorflow|numpy;
also in the triton-interpret step, so nothing here imports TensorFlow or Triton). Toy
implementations live in a fake module put in ``sys.modules`` for one test; their
``attention(call)`` runs the plain core (``dcmha.ops.attention``). Calls are tiny except the
"large" one (T = S = 96, over the CPU paths' T * S threshold), which is only described and
explained, never run.
"""

import importlib
import importlib.metadata
import importlib.util
import logging
import re
import sys
import types
import warnings

import numpy as np
import pytest

import keras
from keras import ops

import dcmha.call
from dcmha.call import AttentionCall
from dcmha import ops as dops
from dcmha import registry
from dcmha.layers import DCMHA
from dcmha.spec import terms as spec_terms

BACKEND = keras.backend.backend()
OTHER_BACKEND = "torch" if BACKEND == "jax" else "jax"
TOY_MODULE = "dcmha_test_toy_path"

#: The entry points of dcmha's own implementations (pyproject.toml).
BUILT_INS = {
    "ops": "dcmha.ops:IMPLEMENTATION",
    "torch": "dcmha.backends.torch_native:IMPLEMENTATION",
    "torch_decode": "dcmha.backends.torch_native:DECODE_IMPLEMENTATION",
    "triton": "dcmha.backends.triton:IMPLEMENTATION",
    "pallas": "dcmha.backends.pallas:IMPLEMENTATION",
    "jax_cpu": "dcmha.backends.jax_cpu:IMPLEMENTATION",
    "tf_cpu": "dcmha.backends.tf_cpu:IMPLEMENTATION",
    "xla": "dcmha.backends.xla:IMPLEMENTATION",
    "tf_decode": "dcmha.backends.xla:DECODE_IMPLEMENTATION",
    "jax_decode": "dcmha.backends.jax_cpu:DECODE_IMPLEMENTATION",
}
#: Where each built-in runs and how "auto" takes it: (backend, devices, auto_devices,
#: priority, min_length_product). What each lacks is pinned by its own tests (and dropout
#: and intermediates for all of them by test_dispatch.py).
DECLARED = {
    "ops": ("any", {"cpu", "gpu", "tpu"}, set(), 0, 0),
    "torch": ("torch", {"cpu", "gpu"}, {"cpu"}, 10, 256),
    "torch_decode": ("torch", {"cpu", "gpu"}, {"cpu"}, 15, 0),
    "triton": ("torch", {"gpu"}, {"gpu"}, 20, 0),
    "pallas": ("jax", {"cpu", "gpu", "tpu"}, {"gpu"}, 20, 0),
    "jax_cpu": ("jax", {"cpu"}, {"cpu"}, 10, 256),
    "tf_cpu": ("tensorflow", {"cpu"}, {"cpu"}, 20, 4096),
    "xla": ("tensorflow", {"cpu", "gpu"}, {"cpu", "gpu"}, 10, 0),
    "tf_decode": ("tensorflow", {"cpu", "gpu"}, {"cpu"}, 25, 0),
    "jax_decode": ("jax", {"cpu"}, {"cpu"}, 15, 0),
}
CAPABILITIES = ["attention_scores", "dropout", "head_masks", "intermediates", "query_offset",
                "symbolic_shapes", "traced_offset"]

AUTO_GPU_ONLY = "'auto' takes it on gpu, not on cpu"
AUTO_SMALL = "'auto' takes it from T * S >= {}; this call has T * S = {}"
AUTO_ONE_QUERY = "'auto' takes it for one-query calls (T = 1); this call has T = {}"
AUTO_GRAPH_ONLY = "'auto' takes it for calls traced into a graph; this call runs eagerly"
SMALL, LARGE = 6, 96                       # T = S: T * S = 36 and 9216


def describe(T=SMALL, **kwargs):
    """An ``AttentionCall`` on zeros: B=1, T=S, N=N_kv=2, d=d_v=4."""
    x = ops.convert_to_tensor(np.zeros((1, T, 2, 4), np.float32))
    return dcmha.call.describe(x, x, x, **kwargs)


def exact(message):
    return "^" + re.escape(message) + "$"


@pytest.fixture
def toy(monkeypatch):
    """``(register, module)``: ``register(name, **fields)`` registers an Implementation whose
    module is a fake ``TOY_MODULE`` (backend: this one unless given); it is unregistered
    after the test. ``module.seen`` lists ("attention" | "preferred" | "unsupported", name)
    in call order; ``module.answers`` sets what preferred / unsupported return."""
    module = types.ModuleType(TOY_MODULE)
    module.seen, module.answers = [], {"preferred": True, "unsupported": None}

    def attention(call):
        module.seen.append(("attention", call))
        return dops.attention(call)

    def preferred(call):
        module.seen.append(("preferred", call.T))
        return module.answers["preferred"]

    def unsupported(call):
        # Here a real path would build or compile its kernel: "auto" must not get here
        # for a call its declared facts already rule out.
        module.seen.append(("unsupported", call.T))
        return module.answers["unsupported"]

    module.attention, module.preferred, module.unsupported = attention, preferred, unsupported
    monkeypatch.setitem(sys.modules, TOY_MODULE, module)
    names = []

    def register(name="toy", **fields):
        fields.setdefault("backend", BACKEND)
        fields.setdefault("module", TOY_MODULE)
        impl = registry.register(registry.Implementation(name=name, **fields))
        names.append(name)
        return impl

    yield register, module
    for name in names:
        registry.unregister(name)


# ---------------------------------------------------------------------------
# Where implementations come from
# ---------------------------------------------------------------------------

def reload_with(monkeypatch, name, value):
    """Make the registry load its table again on next use, from the installed entry points
    plus ``name = value`` (listed first); the table and its errors are restored after the
    test."""
    extra = importlib.metadata.EntryPoint(name=name, value=value,
                                          group=registry.ENTRY_POINT_GROUP)
    real = list(registry._entry_points())
    monkeypatch.setattr(registry, "_entry_points", lambda: [extra] + real)
    monkeypatch.setattr(registry, "_table", None)
    monkeypatch.setattr(registry, "_errors", {})


def test_built_ins_come_from_the_entry_point_group():
    assert registry.ENTRY_POINT_GROUP == "dcmha.implementations"
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="dcmha.implementations")}
    assert {name: eps[name].value for name in BUILT_INS if name in eps} == BUILT_INS
    table = registry.implementations()
    assert not set(BUILT_INS) & set(registry.load_errors())
    for name in BUILT_INS:
        impl = table[name]
        assert impl is eps[name].load() is registry.get(name)
        assert impl.name == name
        # The module holding attention(call) is found without importing a framework.
        assert importlib.util.find_spec(impl.module) is not None, impl.module
    assert {name: (i.backend, set(i.devices), set(i.auto_devices), i.priority,
                   i.min_length_product) for name, i in table.items() if name in BUILT_INS} \
        == DECLARED
    # The plain core runs every call.
    assert table["ops"] is dops.IMPLEMENTATION and table["ops"].module == "dcmha.ops"
    assert table["ops"].lacks == frozenset()
    assert sorted(registry.CAPABILITIES) == CAPABILITIES
    with pytest.raises(KeyError):
        registry.get("toy")


def test_an_entry_point_that_fails_to_load_warns_once_and_is_listed(monkeypatch):
    reload_with(monkeypatch, name="broken", value="dcmha_test_no_such_package:IMPLEMENTATION")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = registry.implementations()
        registry.implementations()                  # loaded once: no second warning
        errors = registry.load_errors()
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert [str(w.message) for w in runtime] == [
        "dcmha: the implementation entry point 'broken' "
        "(dcmha_test_no_such_package:IMPLEMENTATION) could not be loaded: No module named "
        "'dcmha_test_no_such_package'"]
    assert errors == {"broken": "ModuleNotFoundError: No module named "
                                "'dcmha_test_no_such_package'"}
    # The rest of the table is whole, and "auto" works.
    assert set(BUILT_INS) <= set(table) and "broken" not in table
    assert registry.select("auto", describe())[0] in table


@pytest.mark.parametrize("case", ["wrong_object", "shadows_ops", "third_party"])
def test_entry_points_are_checked(monkeypatch, toy, case):
    _, module = toy
    module.IMPLEMENTATION = registry.Implementation(
        name="ops" if case == "shadows_ops" else "toy_ep", backend=BACKEND, module=TOY_MODULE)
    name, value = {"wrong_object": ("other", "dcmha.ops:IMPLEMENTATION"),
                   "shadows_ops": ("ops", f"{TOY_MODULE}:IMPLEMENTATION"),
                   "third_party": ("toy_ep", f"{TOY_MODULE}:IMPLEMENTATION")}[case]
    reload_with(monkeypatch, name=name, value=value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = registry.implementations()
    runtime = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if case == "third_party":
        # Registered the way a package registers: usable by name, no warning.
        assert runtime == [] and registry.load_errors() == {}
        assert table["toy_ep"] is module.IMPLEMENTATION
        assert DCMHA(4, 8, implementation="toy_ep").get_config()["implementation"] == "toy_ep"
        return
    reason = {"wrong_object": "entry point dcmha.ops:IMPLEMENTATION must load a "
                              f"dcmha.registry.Implementation named 'other'; got "
                              f"{dops.IMPLEMENTATION!r}",
              "shadows_ops": f"{TOY_MODULE}:IMPLEMENTATION repeats the name 'ops'; ignored"}[case]
    assert runtime == [f"dcmha: {reason}"]
    assert registry.load_errors() == {name: reason}
    # dcmha's own "ops" is loaded first and cannot be shadowed.
    assert table["ops"] is dops.IMPLEMENTATION and "other" not in table


# ---------------------------------------------------------------------------
# Registrations
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("fields,message", [
    (dict(name=""), "`name` must be a non-empty string other than 'auto'. Received: name=''"),
    (dict(name="auto"),
     "`name` must be a non-empty string other than 'auto'. Received: name='auto'"),
    (dict(name=3), "`name` must be a non-empty string other than 'auto'. Received: name=3"),
    (dict(devices={"npu"}),
     "`devices` of implementation 'toy' must be a subset of ['cpu', 'gpu', 'tpu']. "
     "Received: ['npu']"),
    (dict(backend="cuda"),
     "`backend` of implementation 'toy' must be one of ['any', 'jax', 'torch', 'tensorflow', "
     "'numpy']. Received: backend='cuda'"),
    (dict(module=""),
     "`module` of implementation 'toy' must be a module name. Received: module=''"),
    (dict(priority=1.5),
     "`priority` of implementation 'toy' must be an integer. Received: priority=1.5"),
    (dict(min_length_product=-1),
     "`min_length_product` of implementation 'toy' must be a non-negative integer. "
     "Received: min_length_product=-1"),
    (dict(cpu_env={"X": 1}),
     "`cpu_env` of implementation 'toy' must map variable names to strings. "
     "Received: cpu_env={'X': 1}"),
    (dict(one_query_only=1),
     "`one_query_only` of implementation 'toy' must be a bool. Received: one_query_only=1"),
    (dict(graph_only="yes"),
     "`graph_only` of implementation 'toy' must be a bool. Received: graph_only='yes'"),
    (dict(devices={"cpu"}, auto_devices={"gpu"}),
     "`auto_devices` of implementation 'toy' must be a subset of ['cpu']. Received: ['gpu']"),
    (dict(lacks={"dropout", "flash"}),
     f"`lacks` of implementation 'toy' must be a subset of {CAPABILITIES}. "
     "Received: ['dropout', 'flash']"),
    (dict(terms={"qw1", "qw3"}),
     f"`terms` of implementation 'toy' must be a subset of {sorted(spec_terms.TERM_NAMES)}. "
     "Received: ['qw1', 'qw3']"),
])
def test_bad_implementation_fields_are_refused(fields, message):
    fields = {"name": "toy", "backend": BACKEND, "module": TOY_MODULE, **fields}
    with pytest.raises(ValueError, match=exact(message)):
        registry.Implementation(**fields)


def test_register_refuses_other_objects_and_taken_names(toy):
    register, _ = toy
    with pytest.raises(TypeError, match=exact(
            "`impl` must be a dcmha.registry.Implementation. Received: 'toy'")):
        registry.register("toy")
    with pytest.raises(ValueError, match=exact(
            "An implementation named 'ops' is already registered; pass replace=True to "
            "replace it.")):
        registry.register(registry.Implementation(name="ops", backend="any", module="dcmha.ops"))
    first = register("toy")
    with pytest.raises(ValueError, match=exact(
            "An implementation named 'toy' is already registered; pass replace=True to "
            "replace it.")):
        register("toy")
    second = registry.Implementation(name="toy", backend=BACKEND, module=TOY_MODULE, priority=5)
    assert registry.register(second, replace=True) is second
    assert registry.get("toy") is second is not first
    # unregister removes only in-process registrations.
    registry.unregister("ops")
    assert registry.get("ops") is dops.IMPLEMENTATION


@pytest.mark.parametrize("backend", ["any", "active"])
def test_a_registered_implementation_runs_in_the_layer(toy, reference_case, call_layer,
                                                       backend):
    register, module = toy
    register("toy", backend=BACKEND if backend == "active" else "any")
    names = ["auto"] + sorted(registry.implementations())
    assert "toy" in names and registry.resolve("toy") == "toy"
    case = reference_case(dict(num_heads=4, key_dim=8, num_groups=2, static_compose=True),
                          B=1, T=5)
    out = {}
    for name in ("ops", "toy"):
        layer = DCMHA(**{**case["cfg"].to_dict(), "implementation": name})
        layer.load_spec_weights(case["params"])
        out[name] = call_layer(layer, case["query"], case["query"], use_causal_mask=True,
                               return_attention_scores=True)
    # One call, through the toy (its own rule asked first), with the layer's validated call.
    assert [kind for kind, _ in module.seen] == ["unsupported", "attention"]
    call = module.seen[1][1]
    assert isinstance(call, AttentionCall)
    assert (call.B, call.T, call.S, call.N, call.G, call.use_causal_mask,
            call.return_attention_scores) == (1, 5, 5, 4, 2, True, True)
    for got, want in zip(out["toy"], out["ops"]):
        np.testing.assert_array_equal(ops.convert_to_numpy(got), ops.convert_to_numpy(want))
    registry.unregister("toy")
    message = (f"`implementation` must be one of {[n for n in names if n != 'toy']}. "
               "Received: implementation='toy'")
    with pytest.raises(ValueError, match=exact(message)):
        DCMHA(4, 8, implementation="toy")
    with pytest.raises(ValueError, match=exact(message)):
        registry.select("toy", describe())


# ---------------------------------------------------------------------------
# Forced names
# ---------------------------------------------------------------------------

def test_a_forced_name_on_another_backend_is_refused(toy):
    register, module = toy
    register("toy_elsewhere", backend=OTHER_BACKEND)
    message = (f"`implementation='toy_elsewhere'` runs on the {OTHER_BACKEND!r} Keras backend. "
               f"Received: the active Keras backend is {BACKEND!r}")
    with pytest.raises(ValueError, match=exact(message)):
        registry.select("toy_elsewhere", describe())
    x = np.zeros((1, SMALL, 2, 4), np.float32)
    with pytest.raises(ValueError, match=exact(message)):
        dops.dcmha_attention(x, x, x, implementation="toy_elsewhere")
    # "auto" never considers it.
    assert "toy_elsewhere" not in dict(registry.explain(describe()))
    assert module.seen == []


def test_a_forced_name_is_refused_for_its_device_and_capabilities(toy, monkeypatch):
    register, module = toy
    monkeypatch.delenv("DCMHA_TEST_TOY_ON_CPU", raising=False)
    register("toy_gpu", devices={"gpu"}, lacks={"head_masks", "attention_scores"},
             cpu_env={"DCMHA_TEST_TOY_ON_CPU": "1"})
    with pytest.raises(ValueError, match=exact(
            "`implementation='toy_gpu'` cannot run this call: runs on gpu, not on cpu (on CPU "
            "set DCMHA_TEST_TOY_ON_CPU=1 before the framework is imported)")):
        registry.select("toy_gpu", describe())
    monkeypatch.setenv("DCMHA_TEST_TOY_ON_CPU", "1")
    mask = ops.convert_to_tensor(np.ones((1, 2, SMALL, SMALL), bool))
    with pytest.raises(ValueError, match=exact(
            "`implementation='toy_gpu'` cannot run this call: the call needs the attention "
            "scores (return_attention_scores=True), which it does not return; a per-head "
            "(B, N, T, S) attention mask, which it does not take")):
        registry.select("toy_gpu", describe(attention_mask=mask,
                                            return_attention_scores=True))
    assert module.seen == []                         # refused before the module runs
    # The module's own rule comes last, word for word.
    module.answers["unsupported"] = "needs a toy"
    with pytest.raises(ValueError, match=exact(
            "`implementation='toy_gpu'` cannot run this call: needs a toy")):
        registry.select("toy_gpu", describe())
    module.answers["unsupported"] = None
    assert registry.select("toy_gpu", describe()) == ("toy_gpu", module.attention)
    # A forced name does not ask preferred(): that is for "auto".
    assert [kind for kind, _ in module.seen] == ["unsupported", "unsupported"]


def test_an_implementation_is_refused_a_compose_term_it_does_not_declare(toy):
    """A term the spec gained after a path was written never reaches that path: "auto"
    passes over it and a forced name is refused, both before its module runs."""
    register, module = toy
    assert register("toy_default").terms == spec_terms.BASE_TERMS
    assert registry.get("ops").terms == frozenset(spec_terms.TERM_NAMES)
    register("toy_nostatic", terms=spec_terms.BASE_TERMS - {"static"}, auto_devices={"cpu"},
             priority=999)
    static = ops.convert_to_tensor(np.zeros((1, 2, 2), np.float32))
    call = describe(pre={"static": static}, post={"static": static})
    assert call.terms == frozenset({"static"})
    reason = ("the call uses the compose term ['static'], which it does not compute (it "
              "declares ['kdd', 'kw1', 'kw2', 'qdd', 'qw1', 'qw2'])")
    with pytest.raises(ValueError, match=exact(
            f"`implementation='toy_nostatic'` cannot run this call: {reason}")):
        registry.select("toy_nostatic", call)
    assert ("toy_nostatic", reason) in registry.explain(call)
    assert module.seen == []
    # Without the term it is the first choice.
    assert registry.select("auto", describe())[0] == "toy_nostatic"


def test_a_forced_name_whose_module_does_not_import_is_refused(toy):
    register, _ = toy
    register("toy_missing", module="dcmha_test_no_such_module")
    with pytest.raises(ValueError, match=exact(
            "`implementation='toy_missing'` is not available here: No module named "
            "'dcmha_test_no_such_module'")):
        registry.select("toy_missing", describe())
    register("toy_missing_auto", module="dcmha_test_no_such_module", auto_devices={"cpu"},
             priority=1000)
    assert registry.explain(describe())[0] == (
        "toy_missing_auto", "cannot be imported: No module named 'dcmha_test_no_such_module'")


# ---------------------------------------------------------------------------
# "auto": explain, and no side effects for calls the declared rules rule out
# ---------------------------------------------------------------------------

def _kernel_row(name):
    """The row of a compiled-kernel CPU path for a call it takes: None, or why the kernel is
    unavailable here (no compiler, DCMHA_CPU_KERNEL=0)."""
    core = importlib.import_module(f"dcmha.backends.{name}.dcmha_{name}")
    return None if core.load() else ("the compiled CPU kernel is unavailable: "
                                     f"{core.unavailable_reason()}")


def _small(name, size):
    """Why "auto" passes over the built-in ``name`` for ``describe(T=size)``: too short."""
    return AUTO_SMALL.format(DECLARED[name][4], size * size)


def expected_rows(size):
    """explain's rows for ``describe(T=size)``, eager, on CPU."""
    small = size == SMALL
    if BACKEND == "jax":
        rows = [("pallas", AUTO_GPU_ONLY), ("jax_decode", AUTO_ONE_QUERY.format(size)),
                ("jax_cpu", _small("jax_cpu", size) if small else _kernel_row("jax_cpu"))]
    elif BACKEND == "torch":
        rows = [("triton", AUTO_GPU_ONLY), ("torch_decode", AUTO_ONE_QUERY.format(size)),
                ("torch", _small("torch", size) if small else None)]
    elif BACKEND == "tensorflow":
        rows = [("tf_decode", AUTO_ONE_QUERY.format(size)),
                ("tf_cpu", _small("tf_cpu", size) if small else _kernel_row("tf_cpu"))]
        if rows[-1][1] is not None:       # eager: "xla" only when TensorFlow traces a graph
            rows.append(("xla", AUTO_GRAPH_ONLY))
    else:
        rows = []
    if not rows or rows[-1][1] is not None:
        rows.append(("ops", None))
    return rows


@pytest.mark.parametrize("size", [SMALL, LARGE])
def test_explain_lists_each_candidate_with_its_reason(size):
    call = describe(T=size)
    rows = registry.explain(call)
    assert rows == expected_rows(size)
    # select takes the row explain ends on; explain_implementation describes the call itself.
    assert registry.select("auto", call)[0] == rows[-1][0]
    x = ops.convert_to_tensor(np.zeros((1, size, 2, 4), np.float32))
    assert dops.explain_implementation(x, x, x) == rows


def test_select_logs_its_choice(caplog):
    with caplog.at_level(logging.DEBUG, logger="dcmha.dispatch"):
        registry.select("auto", describe())
    got = [r.getMessage() for r in caplog.records if r.name == "dcmha.dispatch"]
    assert got == [f"dcmha: 'auto' passes over {name!r}: {reason}"
                   for name, reason in expected_rows(SMALL)[:-1]]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a rule of the tensorflow backend")
def test_explain_in_a_traced_tensorflow_function():
    import tensorflow as tf

    rows = []
    x = np.zeros((1, SMALL, 2, 4), np.float32)
    tf.function(lambda a: rows.append(dops.explain_implementation(a, a, a)) or a)(x)
    assert rows == [[("tf_decode", AUTO_ONE_QUERY.format(SMALL)),
                     ("tf_cpu", _small("tf_cpu", SMALL)), ("xla", None)]]
    # One query (a decoding step) traced into a graph: the compiled one-query step.
    rows.clear()
    q = np.zeros((1, 1, 2, 4), np.float32)
    tf.function(lambda a, b: rows.append(dops.explain_implementation(a, b, b)) or a)(q, x)
    assert rows == [[("tf_decode", None)]]


def test_graph_only_paths_take_graph_calls_with_known_lengths(toy):
    """A path declared ``graph_only``: eager calls pass it over before its module is asked;
    in a TensorFlow graph it takes the calls whose lengths are known."""
    register, module = toy
    register("toy", auto_devices={"cpu"}, priority=1000, graph_only=True)
    large = describe(T=LARGE)
    assert registry.explain(large)[0] == ("toy", AUTO_GRAPH_ONLY)
    assert module.seen == []
    if BACKEND != "tensorflow":
        return
    import tensorflow as tf
    x = np.zeros((1, LARGE, 2, 4), np.float32)
    rows = []
    tf.function(lambda a: rows.append(dops.explain_implementation(a, a, a)) or a)(x)
    assert rows[0][0] == ("toy", None)
    rows.clear()
    spec = tf.TensorSpec((1, None, 2, 4), tf.float32)
    tf.function(lambda a: rows.append(dops.explain_implementation(a, a, a)) or a,
                input_signature=[spec]).get_concrete_function()
    assert rows[0][0] == ("toy", "'auto' takes it for calls whose lengths are known; this "
                                 "call has T = None, S = None")


def test_auto_checks_the_declared_rules_before_the_module(toy):
    register, module = toy
    register("toy", devices={"cpu", "gpu"}, auto_devices={"cpu"}, lacks={"dropout"},
             priority=1000, min_length_product=64 * 128)
    register("toy_gpu", devices={"cpu", "gpu"}, auto_devices={"gpu"}, priority=999)
    # Ruled out by the declared facts: the module is never asked (a real path would build
    # its kernel in unsupported()), neither by select nor by explain nor by the layer.
    small, dropout = describe(), describe(T=LARGE, training=True, dropout_rate=0.5)
    assert registry.select("auto", small)[0] != "toy"
    assert registry.explain(small)[:2] == [("toy", AUTO_SMALL.format(64 * 128, SMALL * SMALL)),
                                           ("toy_gpu", AUTO_GPU_ONLY)]
    assert registry.explain(dropout)[0] == (
        "toy", "the call needs attention dropout (dropout_rate=0.5 in training), which it "
               "does not do")
    x = np.zeros((1, SMALL, 2, 4), np.float32)
    dops.dcmha_attention(x, x, x)
    assert module.seen == []
    # A large call reaches the module: preferred first, then unsupported, then attention.
    large = describe(T=LARGE)
    module.answers.update(preferred=False)
    assert registry.explain(large)[0] == ("toy", "not preferred for this call")
    assert module.seen == [("preferred", LARGE)]
    module.seen.clear()
    module.answers.update(preferred=True, unsupported="the toy kernel does not build")
    assert registry.explain(large)[0] == ("toy", "the toy kernel does not build")
    assert module.seen == [("preferred", LARGE), ("unsupported", LARGE)]
    module.seen.clear()
    module.answers.update(unsupported=None)
    assert registry.explain(large) == [("toy", None)]
    assert registry.select("auto", large) == ("toy", module.attention)
    assert module.seen == [("preferred", LARGE), ("unsupported", LARGE)] * 2
