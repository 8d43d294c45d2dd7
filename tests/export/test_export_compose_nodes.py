"""Compose nodes in the ONNX export: ``dcmha.Compose*`` local functions (plain-op bodies) that
onnxruntime runs as the compiled compose kernel where ``dcmha.export.ort_ops`` is registered.

Each graph runs twice: with the kernel (``core.session``'s default) and with the nodes'
plain-op bodies (``compose_kernel=False``); both against ``spec/reference.py``. Nothing
here touches the Keras backend: tools/test_all.py runs the module once (keras-numpy).
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

ort = pytest.importorskip("onnxruntime")

from dcmha.backends import cpu_kernel  # noqa: E402
from dcmha.export import core, ort_ops  # noqa: E402
from dcmha.spec import reference as ref  # noqa: E402
from tests.export.export_cases import close  # noqa: E402

pytestmark = pytest.mark.backend_independent

D, B = 8, 2

CONFIGS = {
    "dcmha": dict(num_heads=4, key_dim=4),
    "all_switches": dict(num_heads=4, key_dim=4, num_groups=2, num_key_value_heads=2, value_dim=3,
                         static_compose=True, qk_norm=True, rope_max_wavelength=50.0,
                         use_bias=True, sliding_window=3, dynamic_hidden_dim=5),
    "talking_heads": dict(num_heads=4, key_dim=4, static_compose=True, dynamic_projection=False,
                          dynamic_gating=False),
    "gating_only_post": dict(num_heads=4, key_dim=4, dynamic_projection=False, pre_compose=False),
    "projection_only_key_wise": dict(num_heads=6, key_dim=2, num_groups=3, dynamic_gating=False,
                                     query_wise=False, rank=1),
    "query_wise_pre": dict(num_heads=4, key_dim=4, key_wise=False, post_compose=False),
    "gqa_window_m16": dict(num_heads=16, key_dim=2, num_key_value_heads=4, sliding_window=2,
                           rank=4),
}

KERNEL = [pytest.param(True, id="kernel"), pytest.param(False, id="bodies")]


@pytest.fixture(scope="module", autouse=True)
def _library():
    if ort_ops.library_path() is None:
        pytest.skip(f"the compose kernel cannot be built here: {ort_ops.unavailable_reason()}")


def _params(cfg, D_out=7, seed=0):
    # scale > 1 takes composition far from the identity, so a wrong term shows
    p = ref.init_params(cfg, D, D, D_out, rng=np.random.default_rng(seed), scale=30.0)
    return {n: (v + 0.1 if n.endswith("bias") else v).astype(np.float32) for n, v in p.items()}


_close = close


def _run(model, feeds, kernel):
    sess = core.session(model, compose_kernel=kernel)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


@pytest.mark.parametrize("kernel", KERNEL)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_matches_reference(name, causal, kernel):
    cfg = ref.Config(**CONFIGS[name], query_chunk_size=3)   # 7 queries: three chunks
    p = _params(cfg)
    x = np.random.default_rng(1).normal(size=(B, 7, D)).astype(np.float32)
    model = core.export_layer(cfg, p, core.CallSpec(use_causal_mask=causal))
    core.check_model(model)
    assert core.kernel_ops_used([n for f in model.functions for n in f.node])
    _close(_run(model, {"query": x}, kernel)["output"],
           ref.attention(p, cfg, x, use_causal_mask=causal), 1e-5)


@pytest.mark.parametrize("kernel", KERNEL)
def test_forward_with_mask_and_scores(kernel):
    cfg = ref.Config(**CONFIGS["all_switches"])
    p = _params(cfg)
    x = np.random.default_rng(2).normal(size=(B, 5, D)).astype(np.float32)
    mask = np.random.default_rng(3).random((B, 5, 5)) > 0.3
    mask[0, 1] = False                                        # a row with no visible key
    model = core.export_layer(cfg, p, core.CallSpec(use_causal_mask=True, attention_mask=True,
                                                    return_attention_scores=True))
    out = _run(model, {"query": x, "attention_mask": mask}, kernel)
    want, inter = ref.attention(p, cfg, x, attention_mask=mask, use_causal_mask=True,
                                return_intermediates=True)
    _close(out["output"], want, 1e-5)
    _close(out["attention_scores"], inter["post_composed"], 1e-5)
    np.testing.assert_array_equal(out["attention_scores"][0, :, 1], 0.0)


@pytest.mark.parametrize("kernel", KERNEL)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ["dcmha", "all_switches", "projection_only_key_wise"])
def test_decode_matches_reference(name, dtype, kernel):
    cfg = ref.Config(**CONFIGS[name])
    p = _params(cfg, D_out=D)
    np_dtype = core.NP_DTYPES[dtype]
    steps, S_max = (3, 1, 2, 1), 9
    x = np.random.default_rng(5).normal(size=(B, sum(steps), D)).astype(np.float32)
    model = core.export_layer(cfg, {n: v.astype(np_dtype) for n, v in p.items()},
                              core.CallSpec(decode=True), dtype=dtype)
    sess = core.session(model, compose_kernel=kernel)
    names = core.decode_names(cfg)
    cache = ref.init_cache(cfg, B, S_max)
    ours = {n: c.astype(np_dtype) for n, c in cache.items()}
    rel = 1e-5 if dtype == "float32" else 2e-2
    i = 0
    for n in steps:
        feeds = {"query": x[:, i:i + n].astype(np_dtype),
                 "cache_update_index": np.array(i, np.int64)}
        feeds.update({"past_" + c: ours[c] for c in names})
        res = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        y, cache = ref.decode_step(p, cfg, x[:, i:i + n], cache, i)
        _close(res["output"], y, rel)
        ours = {c: res["present_" + c] for c in names}
        i += n


# ---------------------------------------------------------------------------
# One Compose node: the kernel and the body against the op's definition
# ---------------------------------------------------------------------------

def _compose_numpy(letters, x, wq=None, kw1=None, kw2=None, kdd=None):
    """The op's definition in einsums (x (B, N, T, S); see core.compose_function)."""
    Bx, N, T, S = x.shape
    G = wq.shape[1] if wq is not None else (kw1 if kw1 is not None else kdd).shape[2]
    M = N // G
    x5 = x.reshape(Bx, G, M, T, S).astype(np.float64)
    out = np.einsum("bgtnm,bgmts->bgnts", np.broadcast_to(wq, (Bx, G, T, M, M)), x5) \
        if "Q" in letters else x5.copy()
    if "K" in letters:
        out += np.einsum("bsgrn,bsgrm,bgmts->bgnts", kw2, kw1, x5)
    if "D" in letters:
        out += np.einsum("bsgn,bgnts->bgnts", kdd, x5)
    return out.reshape(Bx, N, T, S)


def _compose_model(letters, shapes):
    name = "Compose" + letters
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in shapes.items()]
    node = helper.make_node(name, list(shapes), ["out"], domain=core.DOMAIN)
    graph = helper.make_graph([node], "compose", ins,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT,
                                                             [None] * 4)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(core.DOMAIN, 1)],
                              functions=[core.compose_function(name)])
    model.ir_version = 8
    return model


def _compose_inputs(letters, Bx=2, G=2, M=4, R=2, T=3, S=37, wq_batch=True, wq_rows=True,
                    seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.normal(size=s).astype(np.float32)   # noqa: E731
    feeds = {"x": f(Bx, G * M, T, S)}
    if "Q" in letters:
        feeds["wq"] = f(Bx if wq_batch else 1, G, T if wq_rows else 1, M, M)
    if "K" in letters:
        feeds["kw1"], feeds["kw2"] = f(Bx, S, G, R, M), f(Bx, S, G, R, M)
    if "D" in letters:
        feeds["kdd"] = f(Bx, S, G, M)
    return feeds


@pytest.mark.parametrize("kernel", KERNEL)
@pytest.mark.parametrize("letters", [n[len("Compose"):] for n in core.COMPOSE_OPS])
def test_each_compose_op_matches_its_definition(letters, kernel):
    feeds = _compose_inputs(letters)
    model = _compose_model(letters, {n: v.shape for n, v in feeds.items()})
    onnx.checker.check_model(model, full_check=True)
    out = _run(model, feeds, kernel)["out"]
    np.testing.assert_allclose(out, _compose_numpy(letters, **feeds), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNEL)
@pytest.mark.parametrize("M, R", [(8, 2), (16, 4), (3, 1), (1, 1)])
@pytest.mark.parametrize("wq_batch, wq_rows", [(False, False), (True, False), (True, True)])
def test_compose_sizes_and_broadcast_wq(M, R, wq_batch, wq_rows, kernel):
    # M, R with fixed-size code paths in the kernel and ones without; S not a multiple of
    # the kernel's vector width; wq shared by the batch and / or the queries
    feeds = _compose_inputs("QKD", G=1 if M == 16 else 2, M=M, R=R, S=131,
                            wq_batch=wq_batch, wq_rows=wq_rows)
    model = _compose_model("QKD", {n: v.shape for n, v in feeds.items()})
    np.testing.assert_allclose(_run(model, feeds, kernel)["out"],
                               _compose_numpy("QKD", **feeds), rtol=1e-5, atol=1e-5)


def test_the_kernel_runs_not_the_body():
    # the body of the function replaced by Identity: right only if the kernel ran
    letters = "QKD"
    feeds = _compose_inputs(letters)
    model = _compose_model(letters, {n: v.shape for n, v in feeds.items()})
    fn = model.functions[0]
    del fn.node[:]
    fn.node.append(helper.make_node("Identity", ["x"], ["out"]))
    want = _compose_numpy(letters, **feeds)
    np.testing.assert_allclose(_run(model, feeds, True)["out"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(_run(model, feeds, False)["out"], feeds["x"])


# ---------------------------------------------------------------------------
# Probs: a block's probabilities from its scores (compose, biased softmax, compose)
# ---------------------------------------------------------------------------

def _probs_numpy(name, feeds):
    """The op's definition: Compose_post(softmax(Compose_pre(x) + bias)), in float64, with
    the terms' rows [t0, t0 + T) (a row axis of 1 broadcast) and keys [s0, s0 + S)."""
    pre, post = name[len("Probs"):].split("_")
    _, _, T, S = feeds["x"].shape
    t0, s0 = int(feeds["t0"]), int(feeds["s0"])

    def block(n, v):
        if n == "wq":
            return v if v.shape[2] == 1 else v[:, :, t0:t0 + T]
        return v[:, s0:s0 + S]

    def stage(letters, x, prefix):
        if not letters:
            return x
        return _compose_numpy(letters, x, **{n[len(prefix):]: block(n[len(prefix):], v)
                                             for n, v in feeds.items() if n.startswith(prefix)})
    y = stage(pre, feeds["x"].astype(np.float64), "pre_") + feeds["bias"]
    y = np.exp(y - y.max(-1, keepdims=True))
    return stage(post, y / y.sum(-1, keepdims=True), "post_")


def _probs_feeds(name, Bx=2, G=2, M=2, T=19, S=37, bias_batch=False, t0=0, s0=0, extra=(0, 0),
                 seed=3):
    """Scores of a (T, S) block, a causal bias (row t sees keys s <= t + S - T: every row
    one at least) and terms (``_compose_inputs``) for t0 + T + extra[0] query rows and
    s0 + S + extra[1] keys, the block at (t0, s0)."""
    pre, post = name[len("Probs"):].split("_")
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.normal(size=(Bx, G * M, T, S)).astype(np.float32)}
    visible = np.arange(S)[None, :] <= np.arange(T)[:, None] + S - T
    bias = np.where(visible, 0.0, core.MASKED_SCORE).astype(np.float32)
    feeds["bias"] = np.broadcast_to(bias, (Bx if bias_batch else 1, 1, T, S)).copy()
    feeds["t0"], feeds["s0"] = np.array(t0, np.int64), np.array(s0, np.int64)
    for prefix, letters, k in (("pre_", pre, 1), ("post_", post, 2)):
        f = _compose_inputs(letters, Bx=Bx, G=G, M=M, T=t0 + T + extra[0], S=s0 + S + extra[1],
                            seed=seed + k)
        feeds.update({prefix + n: v for n, v in f.items() if n != "x"})
    return feeds


def _probs_model(name, feeds):
    model = _one_op_model(name, TensorProto.FLOAT,
                          [(n, TensorProto.INT64 if n in ("t0", "s0") else TensorProto.FLOAT,
                            [None] * v.ndim) for n, v in feeds.items()])
    model.functions.extend(core.kernel_function(n) for n in core.kernel_ops_used(
        model.functions[0].node))   # the Compose functions its body calls
    return model


@pytest.mark.parametrize("kernel", KERNEL)
@pytest.mark.parametrize("name", core.PROBS_OPS)
def test_each_probs_op_matches_its_definition(name, kernel):
    feeds = _probs_feeds(name)
    model = _probs_model(name, feeds)
    onnx.checker.check_model(model, full_check=True)
    out = _run(model, feeds, kernel)["out"]
    # the Compose ops' tolerance (float32 against the float64 definition)
    np.testing.assert_allclose(out, _probs_numpy(name, feeds), rtol=1e-5, atol=1e-5)
    masked = np.broadcast_to(feeds["bias"] != 0, out.shape)
    assert (out[masked] == 0).all()   # masked keys: exactly 0 after both composes


@pytest.mark.parametrize("kernel", KERNEL)
@pytest.mark.parametrize("M, R, T, S, bias_batch, t0, s0, extra", [
    (8, 2, 1, 16, False, 0, 5, (0, 3)), (4, 4, 9, 160, True, 0, 0, (0, 0)),
    (3, 1, 20, 5, False, 7, 2, (4, 1)), (16, 2, 17, 33, True, 3, 0, (0, 9))])
def test_probs_sizes_and_blocks(M, R, T, S, bias_batch, t0, s0, extra, kernel):
    # one query (a decode step), rows in several blocks of the kernel, S below, at and above
    # its vector width, M and R with and without fixed-size code paths; the block inside
    # longer terms (a query chunk, a decode step's visible keys)
    feeds = _probs_feeds("ProbsQKD_QKD", G=1 if M == 16 else 2, M=M, T=T, S=S,
                         bias_batch=bias_batch, t0=t0, s0=s0, extra=extra)
    for prefix in ("pre_", "post_"):   # rank R
        rng = np.random.default_rng(R)
        for n in ("kw1", "kw2"):
            shape = feeds[prefix + n].shape
            feeds[prefix + n] = rng.normal(size=shape[:3] + (R,) + shape[4:]).astype(np.float32)
    model = _probs_model("ProbsQKD_QKD", feeds)
    np.testing.assert_allclose(_run(model, feeds, kernel)["out"],
                               _probs_numpy("ProbsQKD_QKD", feeds), rtol=1e-5, atol=1e-5)


def _without_body(model, name):
    """The model with function ``name``'s body replaced by an Identity of its first input:
    right only where the session runs the compiled op."""
    fn = next(f for f in model.functions if f.name == name)
    del fn.node[:]
    fn.node.append(helper.make_node("Identity", [fn.input[0]], [fn.output[0]]))
    return model


def test_the_kernel_runs_not_the_bodies_of_the_other_ops():
    feeds = _probs_feeds("ProbsQKD_QKD")
    model = _without_body(_probs_model("ProbsQKD_QKD", feeds), "ProbsQKD_QKD")
    np.testing.assert_allclose(_run(model, feeds, True)["out"],
                               _probs_numpy("ProbsQKD_QKD", feeds), rtol=1e-5, atol=1e-5)
    terms, dims = _query_terms("WDS")
    model = _without_body(_one_op_model("QueryMatrixWDS", TensorProto.FLOAT, [
        (n, TensorProto.FLOAT, [None] * v.ndim) for n, v in terms.items()], rank=5),
        "QueryMatrixWDS")
    np.testing.assert_allclose(_run(model, terms, True)["out"],
                               _query_matrix_definition(terms, *dims), rtol=1e-6, atol=1e-6)
    x = np.random.default_rng(5).normal(size=(1, 3, 2, 4)).astype(np.float32)
    rope = {"x": x, "positions": np.arange(3, dtype=np.int64),
            "inv_freq": 10.0 ** -np.arange(2, dtype=np.float64)}
    got = _run(_without_body(_rope_model("float32"), "Rope"), rope, True)["out"]
    np.testing.assert_allclose(got, _rope_reference(**rope), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    (dict(bias=lambda f: f["bias"][:, :, :4]),
     r"input bias must have shape (B|1, 1, T, S); received (1, 1, 4, 37"),
    (dict(t0=lambda f: np.array(3, np.int64)),
     r"input wq must have shape (B|1, G, 1 or >= t0 + T, M, M); received (2, 2, 19, 2"),
    (dict(s0=lambda f: np.array(1, np.int64)),
     r"input kw1 must have shape (B, >= s0 + S, G, R, M); received (2, 37, 2, 2"),
    (dict(s0=lambda f: np.array(-1, np.int64)), r"need t0 >= 0 and s0 >= 0; received t0=0, s0=-1"),
])
def test_probs_rejects_bad_blocks_with_the_input_named(change, message):
    feeds = _probs_feeds("ProbsQK_QK")
    sess = core.session(_probs_model("ProbsQK_QK", feeds))
    feeds.update({n: np.array(f(feeds)) for n, f in change.items()})   # contiguous, 0-d kept
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("|", r"\|").replace("+", r"\+")):
        sess.run(None, feeds)


@pytest.mark.parametrize("what, bad, message", [
    ("wq", lambda f: f["wq"][..., :3], "input wq must have shape (B|1, G, T|1, M, M)"),
    ("kw1", lambda f: f["kw1"][:, :5], "input kw1 must have shape (B, S, G, R, M)"),
    ("kdd", lambda f: f["kdd"][:1], "input kdd must have shape (B, S, G, M)"),
    ("x", lambda f: f["x"][:, :7], "7 heads in x do not split into 2 groups"),
])
def test_kernel_rejects_bad_shapes_with_the_input_named(what, bad, message):
    feeds = _compose_inputs("QKD")
    feeds[what] = np.ascontiguousarray(bad(feeds))
    model = _compose_model("QKD", {n: [None] * v.ndim for n, v in feeds.items()})
    sess = core.session(model)
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("|", r"\|")):
        sess.run(None, feeds)


def test_compose_function_names():
    assert [core.compose_function(n).input for n in ("ComposeQ", "ComposeKD")] == [
        ["x", "wq"], ["x", "kw1", "kw2", "kdd"]]
    for bad in ("Compose", "ComposeKQ", "ComposeQQ", "ComposeX", "DCMHA"):
        with pytest.raises(ValueError, match=f"Not a Compose op name: '{bad}'"):
            core.compose_function(bad)
    with pytest.raises(TypeError, match="compose_nodes must be True or False; received 'yes'"):
        core.ModelBuilder(compose_nodes="yes")


def test_plain_export_has_no_compose_nodes_and_agrees():
    cfg = ref.Config(**CONFIGS["all_switches"])
    p = _params(cfg)
    x = np.random.default_rng(4).normal(size=(B, 6, D)).astype(np.float32)
    plain = core.export_layer(cfg, p, core.CallSpec(use_causal_mask=True), compose_nodes=False)
    nodes = core.export_layer(cfg, p, core.CallSpec(use_causal_mask=True))
    assert [f.name for f in plain.functions] == ["DCMHA"]
    assert core.kernel_ops_used(plain.functions[0].node) == []
    assert [f.name for f in nodes.functions][0] == "DCMHA"
    # the kernel ops, and the Compose op that the Probs op's body calls
    assert sorted(f.name for f in nodes.functions[1:]) == [
        "ComposeQKD", "ProbsQKD_QKD", "QueryMatrixWDS", "Rope"]
    want = ref.attention(p, cfg, x, use_causal_mask=True)
    _close(_run(plain, {"query": x}, True)["output"], want, 1e-5)
    _close(_run(nodes, {"query": x}, True)["output"], want, 1e-5)


def _default_session_matches_reference(seed):
    """A causal layer's graph in ``core.session`` (with whatever kernel state) against the spec."""
    cfg = ref.Config(**CONFIGS["dcmha"])
    p = _params(cfg)
    x = np.random.default_rng(seed).normal(size=(B, 5, D)).astype(np.float32)
    model = core.export_layer(cfg, p, core.CallSpec(use_causal_mask=True))
    _close(_run(model, {"query": x}, True)["output"],
           ref.attention(p, cfg, x, use_causal_mask=True), 1e-5)


def test_without_the_kernel_sessions_run_the_bodies(monkeypatch, tmp_path):
    monkeypatch.setenv("DCMHA_CPU_KERNEL", "0")
    ort_ops._reset()
    try:
        assert ort_ops.library_path() is None
        assert ort_ops.unavailable_reason() == "disabled by DCMHA_CPU_KERNEL"
        so = ort.SessionOptions()
        assert ort_ops.register(so) is False
        _default_session_matches_reference(seed=6)
    finally:
        ort_ops._reset()


def test_library_is_cached_and_checked():
    path = ort_ops.library_path()
    assert path in cpu_kernel.LIBRARIES.values()
    ort_ops._reset()
    assert ort_ops.library_path() == path   # found again in the cache, not rebuilt


# ---------------------------------------------------------------------------
# CacheHeads: a decode step's cache range, heads first
# ---------------------------------------------------------------------------

def _one_op_model(name, ft, inputs, rank=4, outputs=("out",)):
    """A graph of one ``dcmha`` kernel op (with its function): inputs [(name, type, shape)]
    -> outputs (each of this rank, type ft)."""
    ins = [helper.make_tensor_value_info(n, t, shape) for n, t, shape in inputs]
    node = helper.make_node(name, [n for n, _, _ in inputs], list(outputs), domain=core.DOMAIN)
    graph = helper.make_graph([node], name, ins, [helper.make_tensor_value_info(o, ft, [None] * rank)
                                                  for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(core.DOMAIN, 1)],
                              functions=[core.kernel_function(name)])
    model.ir_version = 8
    return model


#: name -> (the cache's dtype, the output's)
CACHE_HEADS = {"CacheHeads": ("float32", "float32"), "CacheHeads16": ("float16", "float16"),
               core.CACHE_WIDEN_OP: ("float16", "float32")}


def _cache_heads_model(name):
    ft, out = (core.DTYPES[t] for t in CACHE_HEADS[name])
    return _one_op_model(name, out, [("cache", ft, [None] * 4), ("start", TensorProto.INT64, []),
                                     ("stop", TensorProto.INT64, [])])


@pytest.mark.parametrize("kernel", KERNEL)
@pytest.mark.parametrize("name", CACHE_HEADS)
@pytest.mark.parametrize("start, stop", [(0, 9), (0, 1), (3, 7), (8, 9)])
def test_cache_heads_is_the_range_heads_first(start, stop, name, kernel):
    dtype, out_dtype = CACHE_HEADS[name]
    cache = np.random.default_rng(7).normal(size=(2, 9, 3, 5)).astype(core.NP_DTYPES[dtype])
    cache[0, 0, 0, :4] = [np.inf, -np.inf, 6e-8, -0.0]   # exact in float16 and widened
    model = _cache_heads_model(name)
    onnx.checker.check_model(model, full_check=True)
    out = _run(model, {"cache": cache, "start": np.array(start, np.int64),
                       "stop": np.array(stop, np.int64)}, kernel)["out"]
    assert out.dtype == np.dtype(out_dtype)
    want = cache[:, start:stop].transpose(0, 2, 1, 3).astype(out_dtype)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(np.signbit(out), np.signbit(want))


@pytest.mark.parametrize("start, stop", [(-1, 3), (4, 4), (5, 3), (0, 10)])
def test_cache_heads_rejects_a_range_outside_the_cache(start, stop):
    sess = core.session(_cache_heads_model("CacheHeads"))
    cache = np.zeros((1, 9, 2, 4), np.float32)
    with pytest.raises(Exception, match=r"CacheHeads: need 0 <= start < stop <= 9 \(the cache "
                                        rf"length\); received start={start}, stop={stop}"):
        sess.run(None, {"cache": cache, "start": np.array(start, np.int64),
                        "stop": np.array(stop, np.int64)})


def test_decode_graph_reads_its_cache_through_cache_heads():
    cfg = ref.Config(**CONFIGS["dcmha"])
    for dtype in ("float32", "float16"):
        model = core.export_layer(cfg, _params(cfg, D_out=D), core.CallSpec(decode=True),
                                  dtype=dtype)
        fn = model.functions[0]
        # a float16 cache is read into float32 (the MatMuls' type) in the same copy
        op = core.CACHE_OPS["float32"] if dtype == "float32" else core.CACHE_WIDEN_OP
        assert [n.op_type for n in fn.node if n.domain == "dcmha"].count(op) == 2
        assert sorted(f.name for f in model.functions) == sorted(
            ["DCMHA", "ComposeQKD", "ProbsQKD_QKD", "QueryMatrixWD", op])


# ---------------------------------------------------------------------------
# QueryMatrix: a Compose node's per-query matrix from the spec's query-side terms
# ---------------------------------------------------------------------------

def _query_terms(letters, B=2, T=3, G=2, R=2, M=4, seed=12):
    rng = np.random.default_rng(seed)
    shapes = {"qw1": (B, T, G, R, M), "qw2": (B, T, G, R, M), "qdd": (B, T, G, M),
              "static": (G, M, M)}
    names = (["qw1", "qw2"] if "W" in letters else []) + (["qdd"] if "D" in letters else []) + (
        ["static"] if "S" in letters else [])
    return {n: rng.normal(size=shapes[n]).astype(np.float32) for n in names}, (B, T, G, M)


def _query_matrix_definition(t, B, T, G, M):
    """wq (B, G, T, M, M): [n == m] (1 + qdd[n]) + sum_r qw1[r, m] qw2[r, n] + static[g, m, n]."""
    qdd = t.get("qdd", np.zeros((B, T, G, M)))
    wq = np.eye(M) * (1.0 + qdd.transpose(0, 2, 1, 3).astype(np.float64))[..., None]
    if "qw1" in t:
        wq = wq + np.einsum("btgrm,btgrn->bgtnm", t["qw1"].astype(np.float64), t["qw2"])
    if "static" in t:
        wq = wq + t["static"].transpose(0, 2, 1)[None, :, None].astype(np.float64)
    return wq


@pytest.mark.parametrize("kernel", KERNEL)
@pytest.mark.parametrize("name", core.QUERY_OPS)
def test_query_matrix_is_the_spec_query_factor(name, kernel):
    terms, dims = _query_terms(name[len("QueryMatrix"):])
    model = _one_op_model(name, TensorProto.FLOAT, [(n, TensorProto.FLOAT, [None] * v.ndim)
                                                     for n, v in terms.items()], rank=5)
    onnx.checker.check_model(model, full_check=True)
    got = _run(model, terms, kernel)["out"]
    want = _query_matrix_definition(terms, *dims)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_query_matrix_rejects_terms_of_different_shapes():
    terms, _ = _query_terms("WD")
    terms["qdd"] = terms["qdd"][:, :2]
    model = _one_op_model("QueryMatrixWD", TensorProto.FLOAT,
                          [(n, TensorProto.FLOAT, [None] * v.ndim) for n, v in terms.items()],
                          rank=5)
    with pytest.raises(Exception, match=r"dcmha QueryMatrixWD: need qw1, qw2 \(B, T, G, R, M\), "
                                        r"qdd \(B, T, G, M\) and static \(G, M, M\) of one B, T, "
                                        r"G, M; the first term present has \(B, T, G, M\) = "
                                        r"\(2, 3, 2, 4\)"):
        core.session(model).run(None, terms)


# ---------------------------------------------------------------------------
# Rope: the rotate-half RoPE of the query and key heads
# ---------------------------------------------------------------------------

def _rope_model(dtype):
    ft = core.DTYPES[dtype]
    return _one_op_model(core.ROPE_OPS[dtype], ft, [("x", ft, [None] * 4),
                                                    ("positions", TensorProto.INT64, [None]),
                                                    ("inv_freq", TensorProto.DOUBLE, [None])])


def _rope_reference(x, positions, inv_freq):
    """The rotate-half RoPE in float64 (spec/reference.py's formula), then x's dtype."""
    half = x.shape[-1] // 2
    angle = positions[:, None].astype(np.float64) * inv_freq[None, :]
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rope_kernel_agrees_with_its_body_and_the_formula(dtype):
    """Positions in any order, repeated, past the ones seen before (the kernel's table grows),
    far beyond its table and negative; then another inv_freq (the table is rebuilt)."""
    model = _rope_model(dtype)
    onnx.checker.check_model(model, full_check=True)
    kernel, body = (core.session(model, compose_kernel=k) for k in (True, False))
    rng = np.random.default_rng(11)
    tol = 1e-6 if dtype == "float32" else 2e-3
    for positions, wavelength in [([0, 1, 2, 3, 4], 50.0), ([7, 3, 3, 0], 50.0),
                                  ([40, 41, 1 << 21, -3, 2], 50.0), ([5, 6], 10000.0)]:
        positions = np.array(positions, np.int64)
        x = rng.normal(size=(2, len(positions), 3, 6)).astype(core.NP_DTYPES[dtype])
        inv = wavelength ** (-np.arange(3, dtype=np.float64) * 2.0 / 6)
        feeds = {"x": x, "positions": positions, "inv_freq": inv}
        got, = kernel.run(None, feeds)
        plain, = body.run(None, feeds)
        assert got.dtype == x.dtype and got.shape == x.shape
        want = _rope_reference(x, positions, inv)
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
        # the body's float32 operations (a fused multiply-add may round once where it
        # rounds twice: a few ulps of the products' size); float16 rounds the result once
        scale = 4 * np.finfo(x.dtype).eps * float(np.max(np.abs(x)))
        np.testing.assert_allclose(got.astype(np.float32), plain.astype(np.float32), rtol=0,
                                   atol=scale)


def _rope_heads_model(dtype):
    ft = core.DTYPES[dtype]
    return _one_op_model(core.ROPE_HEADS_OPS[dtype], ft,
                         [("y", ft, [None] * 3), ("positions", TensorProto.INT64, [None]),
                          ("inv_freq", TensorProto.DOUBLE, [None]),
                          ("heads", TensorProto.INT64, [2])], outputs=("q", "k"))


@pytest.mark.parametrize("kernel", KERNEL)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rope_heads_rotates_a_projections_heads_heads_first(dtype, kernel):
    # y's first (N + N_kv) d columns: N query heads then N_kv key heads; the rest ignored
    B, L, N, N_kv, d, W = 2, 5, 3, 2, 6, 37
    rng = np.random.default_rng(13)
    y = rng.normal(size=(B, L, W)).astype(core.NP_DTYPES[dtype])
    positions = np.array([4, 0, 9, 2, 3], np.int64)
    inv = 50.0 ** (-np.arange(d // 2, dtype=np.float64) * 2.0 / d)
    model = _rope_heads_model(dtype)
    onnx.checker.check_model(model, full_check=True)
    out = _run(model, {"y": y, "positions": positions, "inv_freq": inv,
                       "heads": np.array([N, N_kv], np.int64)}, kernel)
    want = _rope_reference(y[:, :, :(N + N_kv) * d].reshape(B, L, N + N_kv, d), positions, inv)
    tol = 1e-6 if dtype == "float32" else 2e-3
    for name, part in (("q", want[:, :, :N]), ("k", want[:, :, N:])):
        assert out[name].dtype == y.dtype
        np.testing.assert_allclose(out[name].astype(np.float64), part.transpose(0, 2, 1, 3),
                                   rtol=tol, atol=tol)


def test_rope_heads_rejects_heads_wider_than_the_projection():
    sess = core.session(_rope_heads_model("float32"))
    with pytest.raises(Exception, match=r"dcmha RopeHeads: need positions \(L,\), inv_freq "
                                        r"\(d/2,\) and heads \(N, N_kv\), both >= 1, with "
                                        r"\(N \+ N_kv\) d <= W for x \(B, L, W\) = \(1, 2, 20\); "
                                        r"received positions \(2,\), inv_freq \(2,\), heads of 2 "
                                        r"values"):
        sess.run(None, {"y": np.zeros((1, 2, 20), np.float32),
                        "positions": np.arange(2, dtype=np.int64),
                        "inv_freq": np.ones(2, np.float64), "heads": np.array([3, 3], np.int64)})


def test_rope_rejects_an_inv_freq_of_the_wrong_length():
    sess = core.session(_rope_model("float32"))
    with pytest.raises(Exception, match=r"dcmha Rope: need positions \(L,\) and inv_freq "
                                        r"\(d/2,\) for x \(B, L, H, d\) = \(1, 2, 3, 6\) with d "
                                        r"even; received positions \(2,\), inv_freq \(4,\)"):
        sess.run(None, {"x": np.zeros((1, 2, 3, 6), np.float32),
                        "positions": np.arange(2, dtype=np.int64),
                        "inv_freq": np.ones(4, np.float64)})


def test_a_library_that_cannot_be_built_warns_once_and_sessions_run_the_bodies(monkeypatch,
                                                                                 tmp_path):
    monkeypatch.setenv("DCMHA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_kernel._reset()
    ort_ops._reset()
    try:
        with pytest.warns(cpu_kernel.KernelWarning,
                          match=r"the compiled CPU kernel \(compose_ort\) is unavailable, so "
                                r"onnxruntime runs the Compose nodes' plain-op bodies: "):
            assert ort_ops.library_path() is None
        assert "no-such-compiler" in ort_ops.unavailable_reason()
        _default_session_matches_reference(seed=8)
    finally:
        cpu_kernel._reset()
        ort_ops._reset()
