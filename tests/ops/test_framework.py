"""The framework seam (``dcmha.framework``) on the process's Keras backend
(KERAS_BACKEND=jax|torch|tensorflow|numpy): what each of its functions returns, against
plain ``keras.ops``, NumPy and the spec; the one device probe; and how fast paths provide
their kernels to it (``provide``), before their first use on every path.

The checks of a fresh process (nothing of dcmha imported but what a path imports) run in
a subprocess on the same Keras backend.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import keras
from keras import ops

from dcmha import framework
from dcmha import ops as dops
from dcmha import registry
from dcmha.spec import reference
from dcmha.spec.tolerance import tolerance

BACKEND = keras.backend.backend()


def np_(x):
    return np.asarray(ops.convert_to_numpy(x))


def test_the_chosen_module_is_the_backends():
    assert framework.current().__name__ == f"dcmha.framework.{BACKEND}"
    common = sys.modules["dcmha.framework._common"]
    # Every backend module has every name of the contract.
    assert sorted(framework.current().__all__) == sorted(common.__all__)
    for name in common.__all__:
        assert hasattr(framework.current(), name), name


def test_reading_one_name_binds_the_chosen_modules_names():
    """After the first read every name of the contract is the package's own attribute (no
    module ``__getattr__`` on later reads), and it is the chosen module's object."""
    framework.device()
    common = sys.modules["dcmha.framework._common"]
    for name in common.__all__:
        assert vars(framework)[name] is getattr(framework.current(), name), name
    with pytest.raises(AttributeError):
        framework.no_such_name


# ---------------------------------------------------------------------------
# Each function against keras.ops / NumPy
# ---------------------------------------------------------------------------

def test_readable_value_of_an_eager_tensor():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = framework.readable_value(ops.convert_to_tensor(x))
    assert isinstance(got, np.ndarray) and np.array_equal(got, x)


def test_readable_value_is_none_where_reading_would_bake_the_value():
    x = np.ones((2, 3), np.float32)
    if BACKEND == "jax":
        import jax
        seen = []
        jax.jit(lambda a: seen.append(framework.readable_value(a)) or a)(x)
        assert seen == [None]
    elif BACKEND == "tensorflow":
        import tensorflow as tf
        seen = []
        tf.function(lambda a: seen.append(framework.readable_value(a)) or a)(tf.constant(x))
        assert seen == [None]
    elif BACKEND == "torch":
        import torch
        assert framework.readable_value(torch.ones((2, 3), device="meta")) is None
    else:
        pytest.skip("the numpy backend has no traced tensors")


@pytest.mark.parametrize("start,stop", [(0, 5), (3, 11)])
def test_arange_int32(start, stop):
    got = framework.arange_int32(start, stop)
    assert keras.backend.standardize_dtype(got.dtype) == "int32"
    assert np.array_equal(np_(got), np.arange(start, stop, dtype=np.int32))


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_stack_and_unstack(rng, axis):
    arrays = [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(4)]
    stacked = framework.stack([ops.convert_to_tensor(a) for a in arrays], axis)
    want = np.stack(arrays, axis=axis)
    assert np.array_equal(np_(stacked), want)
    parts = framework.unstack(stacked, axis, 4)
    assert len(parts) == 4
    for got, a in zip(parts, arrays):
        assert np.array_equal(np_(got), a)


def _written(entry, index, update):
    want = entry.copy()
    want[:, index:index + update.shape[1]] = update
    return want


@pytest.mark.parametrize("index", [0, 3])
def test_eager_slice_write_is_none_or_the_write(rng, index):
    entry = rng.standard_normal((2, 8, 3)).astype(np.float32)
    update = rng.standard_normal((2, 2, 3)).astype(np.float32)
    got = framework.eager_slice_write(ops.convert_to_tensor(entry), index,
                                      ops.convert_to_tensor(update))
    if got is not None:
        assert np.array_equal(np_(got), _written(entry, index, update))
    assert (got is not None) == (BACKEND == "torch")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cache_writer_is_none_or_the_write(rng, dtype):
    entry = rng.standard_normal((2, 8, 3)).astype(dtype)
    update = rng.standard_normal((2, 2, 3)).astype(np.float32)
    write = framework.cache_writer(ops.convert_to_tensor(np.int32(5)), 2, 2)
    assert (write is not None) == (BACKEND == "tensorflow")
    if write is None:
        return
    got = write(ops.convert_to_tensor(entry), ops.convert_to_tensor(update))
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    assert np.array_equal(np_(got), _written(entry, 5, update.astype(dtype)))


def test_call_sublayer_is_the_layers_call(rng):
    layer = keras.layers.Dense(4, dtype="float32")
    x = rng.standard_normal((2, 3, 5)).astype(np.float32)
    want = np_(layer(x))
    for given in (x.astype(np.float64), ops.convert_to_tensor(x)):
        assert np.allclose(np_(framework.call_sublayer(layer, given)), want, rtol=1e-6, atol=1e-6)


def test_to_layer_device_keeps_values(rng):
    x = ops.convert_to_tensor(rng.standard_normal((2, 3)).astype(np.float32))
    cache = {"k": ops.convert_to_tensor(np.zeros((1, 2), np.float32))}
    got = framework.to_layer_device((x, x, None, cache))
    assert len(got) == 4 and got[0] is got[1] and got[2] is None
    assert np.array_equal(np_(got[0]), np_(x))
    assert np.array_equal(np_(got[3]["k"]), np.zeros((1, 2), np.float32))


def test_step_index_and_whole_values():
    assert int(np_(framework.step_index(3))) == 3
    values = [ops.convert_to_tensor(np.arange(4, dtype=np.float32)), np.ones((2,), np.int32)]
    got = framework.whole_values(values)
    assert all(isinstance(g, np.ndarray) for g in got)
    assert np.array_equal(got[0], np.arange(4, dtype=np.float32))
    assert np.array_equal(got[1], np.ones((2,), np.int32))


def test_flags_are_typed():
    assert isinstance(framework.LOOPED_CHUNKS, bool) and isinstance(framework.TORCH_MODULES, bool)
    assert isinstance(framework.SHARD_MAP, bool)
    assert framework.DEMO_JIT_COMPILE in ("auto", True, False)
    assert framework.TORCH_MODULES == (BACKEND == "torch")
    assert framework.SHARD_MAP == (BACKEND == "jax")


# ---------------------------------------------------------------------------
# The device probe: one rule, read by the plain core and the registry
# ---------------------------------------------------------------------------

def test_device_is_the_one_probe():
    where = framework.device()
    assert where in ("cpu", "gpu", "tpu")
    x = ops.convert_to_tensor(np.zeros((1, 4, 2, 8), np.float32))
    assert framework.device(x) == where              # a new tensor goes to the default device
    from dcmha.call import describe
    call = describe(x, x, x)
    assert registry.current_device(call) == framework.device(x)
    if BACKEND == "torch":
        import torch
        assert framework.device(torch.zeros(1, device="meta")) == "cpu"


# ---------------------------------------------------------------------------
# Kernels fast paths provide, at the spec's numbers
# ---------------------------------------------------------------------------

SLOTS = ("pre_query", "pre_key", "post_query", "post_key")


def _dynamic_case(rng, rows=1):
    D, G, K, R, M, C = 16, 2, 4, 2, 3, len(SLOTS)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return dict(x=f32(1, rows, D), dw1=f32(D, G, C, K), qkw=f32(G, C, K, 2 * R, M),
                dd=f32(D, G, C * M), R=R)


def test_step_dynamic_weights_is_none_or_the_spec(rng):
    case = _dynamic_case(rng)
    args = [ops.convert_to_tensor(case[n]) for n in ("x", "dw1", "qkw", "dd")]
    got = framework.step_dynamic_weights(*args, C=len(SLOTS), rank=case["R"],
                                         gelu_approximate=True)
    if BACKEND in ("jax", "numpy"):
        assert got is None
    if got is None:
        return
    want = reference.dynamic_weights(case["x"], case["dw1"], case["qkw"], case["dd"],
                                     SLOTS, case["R"], True)
    assert sorted(got) == ["dd", "w1", "w2"]
    for name, arrays in got.items():
        assert len(arrays) == len(SLOTS)
        for slot, a in zip(SLOTS, arrays):
            np.testing.assert_allclose(np_(a), want[slot][name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("parts", ["both", "projection", "gating"])
def test_both_forms_of_the_dynamic_weights_are_the_spec(rng, G, parts):
    """``plain_dynamic_weights`` (stacked, for compiled programs) and
    ``slot_dynamic_weights`` (per slot, for op-by-op executors) against the reference."""
    case = _dynamic_case(rng, rows=5)
    C, R = len(SLOTS), case["R"]
    dw1, qkw, dd = case["dw1"][:, :G], case["qkw"][:G], case["dd"][:, :G]
    if parts == "gating":
        dw1 = qkw = None
    if parts == "projection":
        dd = None
    want = reference.dynamic_weights(case["x"], dw1, qkw, dd, SLOTS, R, True)
    t = lambda a: None if a is None else ops.convert_to_tensor(a)  # noqa: E731
    args = (t(case["x"]), t(dw1), t(qkw), t(dd))
    stacked = dops.plain_dynamic_weights(*args, C=C, rank=R, gelu_approximate=True)
    split = dops.slot_dynamic_weights(*args, C=C, rank=R, gelu_approximate=True)
    names = sorted(want[SLOTS[0]])
    assert sorted(stacked) == sorted(split) == names
    for name in names:
        assert len(split[name]) == C
        for c, slot in enumerate(SLOTS):
            expected = want[slot][name]      # the conformance suite's float32 tolerance
            tol = tolerance(f"dynamic/{slot}/{name}", expected, "float32", 0.0)
            np.testing.assert_allclose(np_(stacked[name])[:, :, :, c], expected, **tol)
            assert tuple(split[name][c].shape) == expected.shape
            np.testing.assert_allclose(np_(split[name][c]), expected, **tol)


@pytest.mark.parametrize("parts", ["both", "projection", "gating"])
def test_dynamic_weights_of_scaled_variables_are_those_of_the_weights(rng, parts):
    """Weights held divided by ``weight_scale`` (``composition_lr_scale``): the products
    scaled (compiled programs: ``plain_dynamic_weights``) and the weights scaled (the
    other routes ``dynamic_weights`` takes) give the weights' own numbers. With a power of
    two every product and sum scales exactly, so the numbers are equal, not only close
    (the forms against the reference: the test above)."""
    case = _dynamic_case(rng, rows=5)
    C, R, scale = len(SLOTS), case["R"], 0.125
    weights = [case["dw1"], case["qkw"], case["dd"]]
    if parts == "gating":
        weights[:2] = None, None
    if parts == "projection":
        weights[2] = None
    t = lambda a: None if a is None else ops.convert_to_tensor(a)  # noqa: E731
    x = t(case["x"])
    held = [None if w is None else t(w / np.float32(scale)) for w in weights]
    weights = [t(w) for w in weights]
    stacked = dops.plain_dynamic_weights(x, *held, C=C, rank=R, gelu_approximate=True,
                                         weight_scale=scale)
    want_stacked = dops.plain_dynamic_weights(x, *weights, C=C, rank=R, gelu_approximate=True)
    by_slot = dops.dynamic_weights(x, *held, slots=SLOTS, rank=R, weight_scale=scale)
    want_by_slot = dops.dynamic_weights(x, *weights, slots=SLOTS, rank=R)
    assert sorted(stacked) == sorted(want_stacked)
    for name in want_stacked:
        np.testing.assert_array_equal(np_(stacked[name]), np_(want_stacked[name]))
        for slot in SLOTS:
            np.testing.assert_array_equal(np_(by_slot[slot][name]),
                                          np_(want_by_slot[slot][name]))


def test_compiles_ops_picks_the_form():
    """Only TensorFlow outside a trace for XLA runs its ops one by one."""
    if BACKEND != "tensorflow":
        assert framework.compiles_ops() is True
        return
    import tensorflow as tf
    assert framework.compiles_ops() is False                     # eager
    seen = {}

    @tf.function(jit_compile=False)
    def graph():
        seen["graph"] = framework.compiles_ops()
        return tf.constant(0)

    @tf.function(jit_compile=True)
    def xla():
        seen["xla"] = framework.compiles_ops()
        return tf.constant(0)
    graph()
    xla()
    assert seen == {"graph": False, "xla": True}


def test_fused_query_projection_is_none_or_the_spec(rng):
    case = _dynamic_case(rng)
    kernel = rng.standard_normal((16, 2, 4)).astype(np.float32)
    bias = rng.standard_normal((2, 4)).astype(np.float32)
    args = [ops.convert_to_tensor(a) for a in (case["x"], kernel, bias, case["dw1"],
                                               case["qkw"], case["dd"])]
    # Twice: torch's kernel concatenates the weights at the first call with them.
    for _ in range(2):
        got = framework.fused_query_projection(*args, C=len(SLOTS), rank=case["R"],
                                               gelu_approximate=True)
    if BACKEND != "torch":
        assert got is None
    if got is None:
        return
    q, stacked = got
    np.testing.assert_allclose(np_(q), np.einsum("bld,dnh->blnh", case["x"], kernel) + bias,
                               rtol=1e-5, atol=1e-5)
    want = reference.dynamic_weights(case["x"], case["dw1"], case["qkw"], case["dd"],
                                     SLOTS, case["R"], True)
    for name, a in stacked.items():
        for c, slot in enumerate(SLOTS):
            np.testing.assert_allclose(np_(a)[:, :, :, c], want[slot][name],
                                       rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# provide / provided / set_finder
# ---------------------------------------------------------------------------

@pytest.fixture
def clean_seam(monkeypatch):
    """The seam's table of provided functions, emptied for one test and restored after."""
    monkeypatch.setattr(framework, "_loaders", {})
    monkeypatch.setattr(framework, "_loaded", {})
    monkeypatch.setattr(framework, "_finder", None)
    monkeypatch.setattr(framework, "_once", {})


def test_provide_refuses_an_unknown_name_and_a_non_callable(clean_seam):
    with pytest.raises(ValueError, match=r"^`name` must be one of \['fused_query_projection', "
                       r"'prepare_onnx_export', 'step_dynamic_weights'\]\. "
                       r"Received: name='kernel'$"):
        framework.provide("torch", "kernel", lambda: None)
    with pytest.raises(TypeError, match=r"^`load` must be callable\. Received: load=3$"):
        framework.provide("torch", "step_dynamic_weights", 3)
    with pytest.raises(TypeError, match=r"^`find` must be callable or None\. "
                       r"Received: find='x'$"):
        framework.set_finder("x")


def test_provided_loads_once_on_first_use(clean_seam):
    loads = []

    def load():
        loads.append(1)
        return len
    framework.provide("a_backend", "step_dynamic_weights", load)
    assert loads == []                                 # providing loads nothing
    assert framework.provided("a_backend", "step_dynamic_weights") is len
    assert framework.provided("a_backend", "step_dynamic_weights") is len
    assert loads == [1]
    assert framework.provided("a_backend", "fused_query_projection") is None
    assert framework.provided("other_backend", "step_dynamic_weights") is None
    framework.provide("a_backend", "step_dynamic_weights", lambda: max)   # replaced
    assert framework.provided("a_backend", "step_dynamic_weights") is max


def test_the_seams_copy_follows_provide_and_the_finder(clean_seam):
    """``_common.provided_once`` (what a step reads) gives what ``provided`` gives, and a
    later ``provide`` or ``set_finder`` is seen by it."""
    from dcmha.framework import _common
    assert _common.provided_once("a_backend", "step_dynamic_weights") is None
    framework.set_finder(lambda: framework.provide("a_backend", "step_dynamic_weights",
                                                   lambda: len))
    assert _common.provided_once("a_backend", "step_dynamic_weights") is len
    framework.provide("a_backend", "step_dynamic_weights", lambda: max)
    assert _common.provided_once("a_backend", "step_dynamic_weights") is max
    assert _common.provided_once("a_backend", "step_dynamic_weights") is framework.provided(
        "a_backend", "step_dynamic_weights")


def test_a_load_that_cannot_import_gives_none(clean_seam):
    def load():
        raise ImportError("no framework")
    framework.provide("a_backend", "prepare_onnx_export", load)
    assert framework.provided("a_backend", "prepare_onnx_export") is None


def test_the_finder_runs_once_before_the_first_lookup(clean_seam):
    runs = []

    def find():
        runs.append(1)
        framework.provide("a_backend", "step_dynamic_weights", lambda: len)
    assert framework.provided("a_backend", "step_dynamic_weights") is None   # no finder yet
    framework.set_finder(find)                 # forgets the miss: the next lookup runs it
    assert runs == []
    assert framework.provided("a_backend", "step_dynamic_weights") is len
    assert framework.provided("a_backend", "fused_query_projection") is None
    assert runs == [1]


def test_the_registry_is_the_finder():
    """Importing the registry (as ``dcmha.ops`` does) hands the seam its table's load."""
    fresh = subprocess.run(
        [sys.executable, "-c", "import dcmha.registry as r, dcmha.framework as s; "
                               "print(s._finder is r.implementations)"],
        capture_output=True, text=True, env=dict(os.environ, KERAS_BACKEND=BACKEND),
        timeout=300)
    assert fresh.stdout.split() == ["True"], fresh.stderr[-2000:]


# ---------------------------------------------------------------------------
# Registration before the first use, on every path, in a fresh process
# ---------------------------------------------------------------------------

def _run_fresh(code):
    """Run ``code`` in a fresh process on this Keras backend; its last line of stdout."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, KERAS_BACKEND=BACKEND, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


_FIRST_DYNAMIC = """
import sys
import numpy as np
import dcmha.ops as dops
from dcmha import framework
assert not any(m.startswith("dcmha.backends") for m in sys.modules), "imported early"
rng = np.random.default_rng(0)
x, dw1 = rng.standard_normal((1, 1, 8)), rng.standard_normal((8, 1, 2, 4))
qkw, dd = rng.standard_normal((1, 2, 4, 2, 2)), rng.standard_normal((8, 1, 4))
args = [a.astype(np.float32) for a in (x, dw1, qkw, dd)]
{convert}
run(*args)
fn = framework._loaded.get(({backend!r}, "step_dynamic_weights"))
print(getattr(fn, "__module__", None))
"""


@pytest.mark.skipif(BACKEND not in ("torch", "tensorflow"),
                    reason="only eager torch and tensorflow have a step kernel")
def test_the_first_dynamic_weights_find_the_provided_kernel():
    """A fresh process's first ``dcmha.ops.dynamic_weights``, with no fast path imported
    before it (eager torch; a ``tf.function`` trace on tensorflow), looks the kernel up
    and finds the fast path's."""
    if BACKEND == "torch":
        convert = """
import torch
args = [torch.tensor(a) for a in args]
run = lambda *a: dops.dynamic_weights(*a, slots=("pre_query", "post_key"), rank=1)
"""
        want = "dcmha.backends.torch_native.dynamic_weights"
    else:
        convert = """
import tensorflow as tf
args = [tf.constant(a) for a in args]
run = tf.function(lambda *a: dops.dynamic_weights(*a, slots=("pre_query", "post_key"),
                                                   rank=1))
"""
        want = "dcmha.backends.tf_cpu.dcmha_tf_cpu"
    assert _run_fresh(_FIRST_DYNAMIC.format(convert=convert, backend=BACKEND)) == want


@pytest.mark.skipif(BACKEND != "torch", reason="the ONNX preparation is the torch exporter's")
def test_the_export_preparation_finds_the_provided_function():
    """``prepare_export("onnx")`` in a fresh process that imported only the models runs
    ``torch_native``'s ``register_rms_norm``."""
    code = """
import sys
import dcmha.models
from dcmha import framework
assert "dcmha.backends.torch_native" not in sys.modules
framework.prepare_export("onnx")
fn = framework._loaded.get(("torch", "prepare_onnx_export"))
print(f"{fn.__module__}.{fn.__name__}")
"""
    assert _run_fresh(code) == "dcmha.backends.torch_native.onnx_symbolic.register_rms_norm"


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tensorflow's decoding step")
def test_flat_calls_give_the_functions_outputs():
    """``flat_calls`` runs a signature's concrete function on the flat tensors: the same
    outputs as the ``tf.function``, one concrete function per input signature, and the
    ``tf.function`` itself for arguments that are not all tensors."""
    import tensorflow as tf

    from dcmha.framework.tensorflow import flat_calls

    traced = []

    def body(x, cache, index):
        traced.append(x.shape)
        return x * 2.0, [{k: v + tf.cast(index, v.dtype) for k, v in c.items()}
                         for c in cache]

    function = tf.function(body, autograph=False)
    fast = flat_calls(function)
    assert fast.__wrapped__ is function
    rng = np.random.default_rng(0)
    for shape in ((1, 3), (2, 3), (1, 3)):
        x = tf.constant(rng.standard_normal(shape), tf.float32)
        cache = [{"key": tf.constant(rng.standard_normal((2, 4)), tf.float32),
                  "key_w": tf.constant(rng.standard_normal((2, 5)), tf.float32)},
                 {"value": tf.constant(rng.standard_normal((3,)), tf.float32)}]
        index = tf.constant(3, tf.int32)
        want = body(x, cache, index)
        got = fast(x, cache, index)
        assert isinstance(got, tuple) and len(got) == 2
        np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
        assert [sorted(c) for c in got[1]] == [sorted(c) for c in want[1]]
        for g, w in zip(got[1], want[1]):
            for k in w:
                np.testing.assert_array_equal(g[k].numpy(), w[k].numpy())
    # Traced once per input signature (the direct calls above add one entry each).
    assert traced.count(tf.TensorShape((1, 3))) == 1 + 2
    assert traced.count(tf.TensorShape((2, 3))) == 1 + 1
    np.testing.assert_array_equal(fast(np.ones((1, 3), np.float32), [], 1)[0].numpy(),
                                  2 * np.ones((1, 3), np.float32))
