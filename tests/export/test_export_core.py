"""The framework-free ONNX writer (dcmha.export.core) against spec/reference.py.

Nothing here touches the Keras backend: tools/test_all.py runs the module once (keras-numpy).
"""

import os

import numpy as np
import onnx
import pytest

from dcmha.export import core
from tests.export.export_cases import CONFIGS, close
from dcmha.spec import reference as ref

pytestmark = pytest.mark.backend_independent

D, B, T = 8, 2, 5

def _params(cfg, D_q=D, D_kv=D, D_out=7, seed=0):
    # scale > 1 takes composition far from the identity, so a wrong term shows
    p = ref.init_params(cfg, D_q, D_kv, D_out, rng=np.random.default_rng(seed), scale=30.0)
    if cfg.use_bias:
        p = {n: (v + 0.1 if n.endswith("bias") else v) for n, v in p.items()}
    return {n: v.astype(np.float32) for n, v in p.items()}


def _run(model, feeds):
    sess = core.session(model)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


_close = close


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_reference(name, causal):
    cfg = ref.Config(**CONFIGS[name])
    p = _params(cfg)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    call = core.CallSpec(use_causal_mask=causal, return_attention_scores=True)
    model = core.export_layer(cfg, p, call)
    core.check_model(model)
    out = _run(model, {"query": x})
    y, inter = ref.attention(p, cfg, x, use_causal_mask=causal, return_intermediates=True)
    assert out["output"].shape == (B, T, 7) and out["output"].dtype == np.float32
    _close(out["output"], y, 1e-5)
    _close(out["attention_scores"], inter["post_composed"], 1e-5)


@pytest.mark.parametrize("cross", [True, False])
def test_separate_key_value_and_mask(cross):
    cfg = ref.Config(num_heads=4, key_dim=4, cross_attention=cross, rope_max_wavelength=20.0,
                     num_key_value_heads=2)
    S, D_kv = 3, (6 if cross else D)
    p = _params(cfg, D, D_kv)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    value = rng.normal(size=(B, S, D_kv)).astype(np.float32)
    key = rng.normal(size=(B, S, D_kv)).astype(np.float32)
    mask = rng.random((B, T, S)) > 0.4
    mask[0, 1] = False                                        # a fully masked row
    call = core.CallSpec(self_attention=False, attention_mask=True, return_attention_scores=True)
    model = core.export_layer(cfg, p, call)
    assert [i.name for i in model.graph.input] == ["query", "value", "key", "attention_mask"]
    out = _run(model, {"query": x, "value": value, "key": key, "attention_mask": mask})
    y, inter = ref.attention(p, cfg, x, key, value, attention_mask=mask, return_intermediates=True)
    _close(out["output"], y, 1e-5)
    _close(out["attention_scores"], inter["post_composed"], 1e-5)
    assert np.all(out["output"][0, 1] == 0.0)               # fully masked -> exactly zero
    assert np.all(np.where(mask[:, None], 0.0, out["attention_scores"]) == 0.0)


def test_fully_masked_rows_window_and_causal():
    cfg = ref.Config(num_heads=4, key_dim=4, sliding_window=2, use_bias=True)
    p = _params(cfg)
    x = np.random.default_rng(3).normal(size=(B, T, D)).astype(np.float32)
    mask = np.ones((B, T, T), bool)
    mask[1, :, :] = False                                     # every row of batch 1 masked
    mask[0, 3, 3] = False                                     # row 3: window+causal leaves keys 2,3
    model = core.export_layer(cfg, p, core.CallSpec(use_causal_mask=True, attention_mask=True,
                                                    return_attention_scores=True))
    out = _run(model, {"query": x, "attention_mask": mask})
    y = ref.attention(p, cfg, x, attention_mask=mask, use_causal_mask=True)
    _close(out["output"], y, 1e-5)
    np.testing.assert_array_equal(out["output"][1], np.broadcast_to(p["output_bias"], (T, 7)))
    np.testing.assert_array_equal(out["attention_scores"][1], 0.0)


def test_float16_graph():
    cfg = ref.Config(num_heads=4, key_dim=4, qk_norm=True, rope_max_wavelength=50.0,
                     sliding_window=3)
    p = _params(cfg)
    p16 = {n: v.astype(np.float16).astype(np.float32) for n, v in p.items()}
    x = np.random.default_rng(4).normal(size=(B, T, D)).astype(np.float16)
    model = core.export_layer(cfg, p, core.CallSpec(use_causal_mask=True, return_attention_scores=True),
                              dtype="float16")
    core.check_model(model)
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert model.graph.initializer[0].data_type == onnx.TensorProto.FLOAT16
    body = model.functions[0].node
    softmax = [n for n in body if n.op_type == "Softmax"]
    assert len(softmax) == 1
    # the softmax input is produced in float32: a Where/Mul of float32 scores (cast before the QK matmul)
    casts = [n for n in body if n.op_type == "Cast"]
    assert any(a.i == onnx.TensorProto.FLOAT for n in casts for a in n.attribute if a.name == "to")
    out = _run(model, {"query": x})
    assert out["output"].dtype == np.float16 and out["attention_scores"].dtype == np.float32
    y, inter = ref.attention(p16, cfg, x.astype(np.float64), use_causal_mask=True,
                             return_intermediates=True)
    _close(out["output"], y, 1e-2)
    _close(out["attention_scores"], inter["post_composed"], 1e-2)


@pytest.mark.parametrize("compose_nodes", [True, False])
def test_graph_structure_and_dynamic_axes(compose_nodes):
    cfg = ref.Config(num_heads=4, key_dim=4)
    model = core.export_layer(cfg, _params(cfg), core.CallSpec(use_causal_mask=True),
                              compose_nodes=compose_nodes)
    nodes = model.graph.node
    dcmha_nodes = [n for n in nodes if n.domain == core.DOMAIN]
    assert len(dcmha_nodes) == 1 and dcmha_nodes[0].op_type == core.FUNCTION_NAME
    fn, *composes = model.functions
    assert (fn.domain, fn.name) == ("dcmha", "DCMHA")
    assert list(fn.input)[:1] == ["query"] and list(fn.output) == ["output"]
    assert list(fn.input)[1:] == list(ref.param_shapes(cfg, D, D, 7))
    if compose_nodes:   # a chunk's probabilities (in the chunk Loop) one ProbsQKD_QKD node,
        # the per-query matrices (made once, outside the Loop) QueryMatrixWD nodes
        assert sorted((f.domain, f.name) for f in composes) == [
            ("dcmha", "ComposeQKD"), ("dcmha", "ProbsQKD_QKD"), ("dcmha", "QueryMatrixWD")]
        bodies = {f.name: {(n.domain, n.op_type if n.domain else "") for n in f.node}
                  for f in composes}
        assert bodies == {"ComposeQKD": {("", "")}, "QueryMatrixWD": {("", "")},   # plain ops
                          "ProbsQKD_QKD": {("", ""), ("dcmha", "ComposeQKD")}}
        assert core.kernel_ops_used(fn.node) == ["ProbsQKD_QKD", "QueryMatrixWD"]
        assert [n.op_type for n in fn.node if n.domain == "dcmha"] == ["QueryMatrixWD"] * 2
        loop = [n for n in fn.node if n.op_type == "Loop"][0]
        assert [n.op_type for n in loop.attribute[0].g.node if n.domain == "dcmha"] == [
            "ProbsQKD_QKD"]
    else:
        assert composes == []
        assert {n.domain for n in fn.node} == {""}            # a plain-op body
    shape = [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim[:2]]
    assert shape == ["batch", "query_length"]
    sess = core.session(model)
    for b, t in [(1, 1), (3, 7)]:
        (y,) = sess.run(None, {"query": np.ones((b, t, D), np.float32)})
        assert y.shape == (b, t, 7)


def test_static_shapes():
    cfg = ref.Config(num_heads=4, key_dim=4)
    model = core.export_layer(cfg, _params(cfg), dynamic=False, dims={"batch": 1, "query_length": 6})
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 6, D]
    with pytest.raises(ValueError, match=r"dynamic=False needs concrete sizes for \['query_length'\]"):
        core.export_layer(cfg, _params(cfg), dynamic=False, dims={"batch": 1})


@pytest.mark.parametrize("name", ["dcmha", "all_switches", "projection_only_key_wise", "mha"])
def test_decode_matches_reference(name):
    cfg = ref.Config(**CONFIGS[name])
    p = _params(cfg, D_out=D)
    steps, S_max = (3, 1, 2, 1), 9
    rng = np.random.default_rng(5)
    x = rng.normal(size=(B, sum(steps), D)).astype(np.float32)
    model = core.export_layer(cfg, p, core.CallSpec(decode=True))
    core.check_model(model)
    names = core.decode_names(cfg)
    assert [i.name for i in model.graph.input] == ["query", "cache_update_index"] + [
        "past_" + n for n in names]
    assert [o.name for o in model.graph.output] == ["output"] + ["present_" + n for n in names]
    sess = core.session(model)
    cache = ref.init_cache(cfg, B, S_max)
    ours = {n: c.astype(np.float32) for n, c in cache.items()}
    i = 0
    for n in steps:
        feeds = {"query": x[:, i:i + n], "cache_update_index": np.array(i, np.int64)}
        feeds.update({"past_" + c: ours[c] for c in names})
        res = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        y, cache = ref.decode_step(p, cfg, x[:, i:i + n], cache, i)
        _close(res["output"], y, 1e-5)
        ours = {c: res["present_" + c] for c in names}
        for c in names:
            assert ours[c].shape == cache[c].shape
            _close(ours[c], cache[c], 1e-5)
        i += n


def test_intermediates():
    cfg = ref.Config(num_heads=4, key_dim=4, num_groups=2)
    p = _params(cfg)
    x = np.random.default_rng(6).normal(size=(B, T, D)).astype(np.float32)
    model = core.export_layer(cfg, p, core.CallSpec(use_causal_mask=True, intermediates=True))
    out = _run(model, {"query": x})
    _, inter = ref.attention(p, cfg, x, use_causal_mask=True, return_intermediates=True)
    for n in ("scores", "pre_composed", "probs"):
        _close(out[n], inter[n], 1e-5)
    _close(out["dynamic/post_key/w1"], inter["key_dynamic"]["post_key"]["w1"], 1e-5)
    _close(out["dynamic/pre_query/dd"], inter["query_dynamic"]["pre_query"]["dd"], 1e-5)


def test_layers_share_a_function_per_configuration():
    cfg = ref.Config(num_heads=4, key_dim=4)
    other = ref.Config(num_heads=4, key_dim=4, sliding_window=2)
    b = core.ModelBuilder()
    x = b.add_input("x", onnx.TensorProto.FLOAT, ["batch", "length", D])
    h = x
    for i, c in enumerate([cfg, other, cfg]):
        h = b.add_dcmha(c, _params(c, D_out=D, seed=i), core.CallSpec(use_causal_mask=True),
                        query=h, prefix=f"l{i}/", name=f"l{i}")["output"]
    b.add_output(h, "y", onnx.TensorProto.FLOAT, ["batch", "length", D])
    model = b.build()
    core.check_model(model)
    # one function per kernel op for all three calls
    assert sorted(f.name for f in model.functions) == ["ComposeQKD", "DCMHA", "DCMHA_2",
                                                       "ProbsQKD_QKD", "QueryMatrixWD"]
    assert [n.op_type for n in model.graph.node if n.domain == "dcmha"] == ["DCMHA", "DCMHA_2", "DCMHA"]
    x_np = np.random.default_rng(7).normal(size=(1, 4, D)).astype(np.float32)
    want = x_np
    for i, c in enumerate([cfg, other, cfg]):
        want = ref.attention(_params(c, D_out=D, seed=i), c, want, use_causal_mask=True)
    _close(_run(model, {"x": x_np})["y"], want, 1e-5)


@pytest.mark.parametrize("opset", [18, 21, onnx.defs.onnx_opset_version()])
def test_opsets(opset):
    cfg = ref.Config(num_heads=4, key_dim=4, qk_norm=True, rope_max_wavelength=10.0)
    p = _params(cfg)
    model = core.export_layer(cfg, p, core.CallSpec(use_causal_mask=True), opset=opset)
    core.check_model(model)
    x = np.random.default_rng(8).normal(size=(1, 3, D)).astype(np.float32)
    _close(_run(model, {"query": x})["output"], ref.attention(p, cfg, x, use_causal_mask=True), 1e-5)


def test_bad_input_errors():
    cfg = ref.Config(num_heads=4, key_dim=4)
    p = _params(cfg)
    with pytest.raises(ValueError, match=r"`dtype` must be one of \['float16', 'float32'\]; .* "
                                         r"Received: dtype='bfloat16'"):
        core.export_layer(cfg, p, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"`opset` must be an integer in \[18, \d+\]. Received: opset=13"):
        core.export_layer(cfg, p, opset=13)
    cross = ref.Config(num_heads=4, key_dim=4, cross_attention=True)
    with pytest.raises(ValueError, match="decode=True needs a self-attention layer; this layer has "
                                         "cross_attention=True"):
        core.export_layer(cross, _params(cross), core.CallSpec(decode=True, self_attention=False))
    with pytest.raises(ValueError, match="export it with self_attention=False"):
        core.export_layer(cross, _params(cross))
    bad = dict(p, qkw=p["qkw"][:, :1])
    with pytest.raises(ValueError, match=r"DCMHA parameter `qkw` must have shape \(1, 4, 16, 4, 4\). "
                                         r"Received: \(1, 1, 16, 4, 4\)"):
        core.export_layer(cfg, bad)
    with pytest.raises(ValueError, match=r"Missing: \['dd'\]; unexpected: \['static_pre'\]"):
        core.export_layer(cfg, {**{n: v for n, v in p.items() if n != "dd"},
                                "static_pre": np.zeros((1, 4, 4), np.float32)})


def test_save_is_atomic(tmp_path):
    cfg = ref.Config(num_heads=4, key_dim=4)
    good = core.export_layer(cfg, _params(cfg))
    path = tmp_path / "layer.onnx"
    core.save_model(good, path)
    before = path.read_bytes()
    assert onnx.load(str(path)).functions[0].name == "DCMHA"
    broken = onnx.ModelProto()
    broken.CopyFrom(good)
    broken.graph.node[0].input[0] = "no_such_value"           # the checker rejects this
    with pytest.raises(onnx.checker.ValidationError):
        core.save_model(broken, path)
    assert path.read_bytes() == before                        # untouched
    assert sorted(os.listdir(tmp_path)) == ["layer.onnx"]      # no temp file left behind
    with pytest.raises(onnx.checker.ValidationError):
        core.save_model(broken, tmp_path / "new.onnx")
    assert sorted(os.listdir(tmp_path)) == ["layer.onnx"]


# ---------------------------------------------------------------------------
# The deployed graph form: query chunks, each on its visible keys (no (B,N,T,S) output)
# ---------------------------------------------------------------------------

def _loops(model):
    return [n for f in model.functions for n in f.node if n.op_type == "Loop"]


@pytest.mark.parametrize("name", ["dcmha", "all_switches", "gqa_mqa_window"])
@pytest.mark.parametrize("chunk", [1, 3, None])
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_forward_matches_reference(name, chunk, causal):
    cfg = ref.Config(**CONFIGS[name], query_chunk_size=chunk)
    p = _params(cfg)
    t = 7                                    # not a multiple of the chunk: a shorter last chunk
    x = np.random.default_rng(9).normal(size=(B, t, D)).astype(np.float32)
    model = core.export_layer(cfg, p, core.CallSpec(use_causal_mask=causal))
    core.check_model(model)
    # one Loop over the chunks exactly where a query cannot see every key
    assert len(_loops(model)) == int(causal or cfg.sliding_window is not None)
    _close(_run(model, {"query": x})["output"],
           ref.attention(p, cfg, x, use_causal_mask=causal), 1e-5)


@pytest.mark.parametrize("compose_nodes, chunk", [(True, core.KERNEL_CHUNK), (False, core.CHUNK)])
def test_chunked_default_size_spans_several_chunks(compose_nodes, chunk):
    cfg = ref.Config(num_heads=4, key_dim=4, rope_max_wavelength=100.0)
    p = _params(cfg)
    t = chunk + 3
    x = np.random.default_rng(10).normal(size=(1, t, D)).astype(np.float32)
    model = core.export_layer(cfg, p, core.CallSpec(use_causal_mask=True),
                              compose_nodes=compose_nodes)
    _close(_run(model, {"query": x})["output"], ref.attention(p, cfg, x, use_causal_mask=True), 1e-5)


def test_chunked_fully_masked_rows_output_zero():
    cfg = ref.Config(num_heads=4, key_dim=4, query_chunk_size=2)
    p = _params(cfg)
    x = np.random.default_rng(11).normal(size=(B, T, D)).astype(np.float32)
    mask = np.random.default_rng(12).random((B, T, T)) > 0.3
    mask[0, 1] = False                                        # a row with no visible key
    mask[1, :, :] = False                                     # a batch with none
    model = core.export_layer(cfg, p, core.CallSpec(use_causal_mask=True, attention_mask=True))
    assert len(_loops(model)) == 1
    out = _run(model, {"query": x, "attention_mask": mask})["output"]
    _close(out, ref.attention(p, cfg, x, attention_mask=mask, use_causal_mask=True), 1e-5)
    np.testing.assert_array_equal(out[0, 1], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_chunked_decode_with_mask_and_longer_cache(dtype):
    # a 5-token prefill, then single tokens; the cache is longer than the sequence, so each
    # step reads only the keys written so far (one block: a step is never split in chunks)
    cfg = ref.Config(**CONFIGS["all_switches"], query_chunk_size=2)
    p = _params(cfg, D_out=D)
    steps, S_max = (5, 1, 1), 11
    rng = np.random.default_rng(13)
    x = rng.normal(size=(B, sum(steps), D)).astype(np.float32)
    mask = rng.random((B, sum(steps), S_max)) > 0.2
    model = core.export_layer(cfg, p, core.CallSpec(decode=True, attention_mask=True), dtype=dtype)
    core.check_model(model)
    assert len(_loops(model)) == 0
    np_dtype = core.NP_DTYPES[dtype]
    if dtype == "float16":   # the reference gets the float16-rounded weights and inputs
        p = {n: v.astype(np.float16).astype(np.float32) for n, v in p.items()}
        x = x.astype(np.float16).astype(np.float32)
    sess = core.session(model)
    names = core.decode_names(cfg)
    cache = ref.init_cache(cfg, B, S_max)
    ours = {n: c.astype(np_dtype) for n, c in cache.items()}
    i = 0
    for n in steps:
        feeds = {"query": x[:, i:i + n].astype(np_dtype), "cache_update_index": np.array(i, np.int64),
                 "attention_mask": mask[:, i:i + n]}
        feeds.update({"past_" + c: ours[c] for c in names})
        res = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        y, cache = ref.decode_step(p, cfg, x[:, i:i + n], cache, i, attention_mask=mask[:, i:i + n])
        _close(res["output"], y, 1e-5 if dtype == "float32" else 1e-2)
        ours = {c: res["present_" + c] for c in names}
        i += n


def test_chunked_window_over_shorter_keys_rows_without_keys():
    # cross-attention with a window: queries past the last key + window see no key (an
    # all-masked block of their chunk), and output 0, never NaN
    cfg = ref.Config(num_heads=4, key_dim=4, sliding_window=2, query_chunk_size=2, use_bias=True)
    p = _params(cfg)
    rng = np.random.default_rng(14)
    x = rng.normal(size=(B, 9, D)).astype(np.float32)
    kv = rng.normal(size=(B, 3, D)).astype(np.float32)
    model = core.export_layer(cfg, p, core.CallSpec(self_attention=False))
    assert len(_loops(model)) == 1
    out = _run(model, {"query": x, "value": kv, "key": kv})["output"]
    _close(out, ref.attention(p, cfg, x, kv, kv), 1e-5)
    np.testing.assert_array_equal(out[:, 4:], np.broadcast_to(p["output_bias"], (B, 5, 7)))


def test_decode_graph_binds_outputs_without_copies_and_session_defaults():
    cfg = ref.Config(num_heads=4, key_dim=4)
    decode = core.export_layer(cfg, _params(cfg, D_out=D), core.CallSpec(decode=True))
    forward = core.export_layer(cfg, _params(cfg), core.CallSpec(use_causal_mask=True))
    # an Identity into a graph output is a copy in onnxruntime (a whole cache per step)
    for model in (decode, forward):
        assert [n.op_type for f in model.functions for n in f.node].count("Identity") == 0
        assert [n.op_type for n in model.graph.node].count("Identity") == 0
    dec, fwd = core.session(decode).get_session_options(), core.session(forward).get_session_options()
    assert (dec.intra_op_num_threads, fwd.intra_op_num_threads) == (1, 0)
    for so in (dec, fwd):
        assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    spin = core.session(forward, threads=2, spinning=True).get_session_options()
    assert spin.intra_op_num_threads == 2
    assert spin.get_session_config_entry("session.intra_op.allow_spinning") == "1"


def test_a_compose_term_the_exporter_does_not_translate_is_refused(monkeypatch):
    """A term added to the spec (here: a second query-side gate read from the same dynamic
    weight as qdd) makes export fail with the term named, never a graph without it."""
    from dcmha.spec import terms as spec_terms

    extra = spec_terms.Term("qdd_trial", "query", ("B", "T", "G", "M"), "dd", None, "query",
                            "btgn,nm->btgnm")
    monkeypatch.setattr(spec_terms, "COMPOSE_TERMS", spec_terms.COMPOSE_TERMS + (extra,))
    cfg = ref.Config(**CONFIGS[sorted(CONFIGS)[0]])
    assert cfg.pre_compose or cfg.post_compose
    stage = "pre" if cfg.pre_compose else "post"
    with pytest.raises(NotImplementedError, match=(
            rf"^The ONNX exporter does not translate the compose terms \['qdd_trial'\] of the "
            rf"{stage} stage \(it translates \['kdd', 'kw1', 'kw2', 'qdd', 'qw1', 'qw2', "
            r"'static'\]\)\.$")):
        core.export_layer(cfg, _params(cfg), core.CallSpec())
