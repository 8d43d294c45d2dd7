"""The one-query (decoding step) path of the "ops" core against the NumPy spec (issue 15).

A call with T = 1 and no (B, N, T, S) extras runs ``dcmha.ops.core._attention_one_query``:
composes on the (B, G, M, S) view, key-side terms applied in low-rank form from the
(B, S, G, R, M) weights. It is checked against ``dcmha.spec.reference`` (the functional core
and the layer's cached steps, with an int and a tensor index), against the block path for
per-head masks (which the reference does not take), and spied on so that the tests fail if
the path is not the one that runs. Tolerances as in test_layer_numerics.py.
"""

import numpy as np
import pytest

import keras
from keras import ops

from dcmha import ops as dops
from dcmha.layers import DCMHA
from dcmha.ops import core
from dcmha.spec import reference

from tests.layers.test_layer_numerics import assert_close, np_

BACKEND = keras.backend.backend()
#: The implementations with a one-query path on this backend (forced by name).
IMPLEMENTATIONS = ["ops"] + {"torch": ["torch_decode"], "tensorflow": ["tf_decode"],
                             "jax": ["jax_decode"]}.get(BACKEND, [])


@pytest.fixture
def one_query_calls(monkeypatch):
    """The number of calls of the one-query path (a list to read after the calls)."""
    calls, depth = [], [0]
    # The one-query paths: the "ops" core's, and the "torch_decode" / "tf_decode"
    # implementations' (which "auto" takes for T = 1 on torch, and in a traced graph on
    # tensorflow). tf_decode compiles the "ops" one-query path: a call counts once.
    paths = [(core, "_attention_one_query")]
    if BACKEND == "torch":
        from dcmha.backends.torch_native import decode
        paths.append((decode, "_one_query"))
    elif BACKEND == "tensorflow":
        from dcmha.backends.xla import decode
        paths.append((decode, "_one_query"))

    def spy(inner):
        def run(*args, **kwargs):
            if not depth[0]:
                calls.append(1)
            depth[0] += 1
            try:
                return inner(*args, **kwargs)
            finally:
                depth[0] -= 1
        return run

    for module, name in paths:
        monkeypatch.setattr(module, name, spy(getattr(module, name)))
    return calls


CONFIGS = {
    "dcmha": dict(num_heads=4, key_dim=8),
    "gqa_groups_static_window": dict(num_heads=4, key_dim=8, num_key_value_heads=2,
                                     num_groups=2, static_compose=True, value_dim=6,
                                     sliding_window=3),
    "key_wise_only_rank1": dict(num_heads=4, key_dim=8, query_wise=False, rank=1),
    "query_wise_only_gating": dict(num_heads=4, key_dim=8, key_wise=False,
                                   dynamic_projection=False),
    "mqa_pre_only": dict(num_heads=4, key_dim=8, num_key_value_heads=1, num_groups=4,
                         post_compose=False),
    "off": dict(num_heads=4, key_dim=8, pre_compose=False, post_compose=False),
    "static_only": dict(num_heads=4, key_dim=8, num_groups=2, query_wise=False, key_wise=False,
                        static_compose=True),
}


def _core_case(reference_case, kwargs, t, S=7):
    """Reference inputs of the core for the query at position t against S keys."""
    case = reference_case(kwargs, T=S)
    cfg, p, x = case["cfg"], case["params"], case["query"]
    pos = np.arange(S)
    q, k, v = reference.project_qkv(p, cfg, x, x, x, pos, pos)
    qdyn, kdyn = reference.dynamic_weights_both_sides(p, cfg, x, x)
    qdyn1 = {s: {n: w[:, t:t + 1] for n, w in ws.items()} for s, ws in qdyn.items()}
    terms = {st: reference.compose_terms(cfg, st, qdyn1, kdyn, p)
             for st in ("pre", "post") if getattr(cfg, st + "_compose")}
    f32 = lambda a: np.asarray(a, np.float32)                             # noqa: E731
    terms = {st: {n: f32(w) for n, w in tm.items()} for st, tm in terms.items()}
    return cfg, p, q[:, t:t + 1], k, v, qdyn1, kdyn, terms, f32


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name, tensor_offset", [(n, False) for n in sorted(CONFIGS)] + [
    ("dcmha", True), ("gqa_groups_static_window", True)])
def test_one_query_core_matches_reference(reference_case, one_query_calls, name,
                                          tensor_offset, implementation):
    t, S = 4, 7
    cfg, p, q, k, v, qdyn, kdyn, terms, f32 = _core_case(reference_case, CONFIGS[name], t, S)
    mask = reference.make_mask(q.shape[0], 1, S, use_causal_mask=True,
                               sliding_window=cfg.sliding_window, query_offset=t)
    o_ref, _ = reference.attend(cfg, p, q, k, v, qdyn, kdyn, mask)
    offset = ops.convert_to_tensor(np.int32(t)) if tensor_offset else t
    o = dops.dcmha_attention(f32(q), f32(k), f32(v), num_groups=cfg.G, pre=terms.get("pre"),
                             post=terms.get("post"), use_causal_mask=True,
                             sliding_window=cfg.sliding_window, query_offset=offset,
                             implementation=implementation)
    assert_close(o, o_ref)
    assert len(one_query_calls) == 1


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_one_query_core_masks(reference_case, one_query_calls, implementation):
    """A padding mask with a fully masked row (zeros, never NaN), and a per-head mask
    (checked against the block path, which ``return_attention_scores`` selects)."""
    t, S = 5, 7
    kwargs = dict(num_heads=4, key_dim=8, num_groups=2, static_compose=True)
    cfg, p, q, k, v, qdyn, kdyn, terms, f32 = _core_case(reference_case, kwargs, t, S)
    B = q.shape[0]
    pad = np.ones((B, 1, S), bool)
    pad[0, 0, [1, 3]] = False
    pad[1] = False                                        # batch row 1 sees no key
    mask = reference.make_mask(B, 1, S, attention_mask=pad, use_causal_mask=True,
                               query_offset=t)
    o_ref, _ = reference.attend(cfg, p, q, k, v, qdyn, kdyn, mask)
    args = (f32(q), f32(k), f32(v))
    kw = dict(num_groups=cfg.G, pre=terms["pre"], post=terms["post"], use_causal_mask=True,
              query_offset=t, implementation=implementation)
    o = dops.dcmha_attention(*args, attention_mask=pad, **kw)
    assert_close(o, o_ref)
    np.testing.assert_array_equal(np_(o)[1], 0.0)

    heads = np.random.default_rng(3).random((B, 4, 1, S)) < 0.6
    heads[:, 2] = False                                   # head 2 sees no key
    o = dops.dcmha_attention(*args, attention_mask=heads, **kw)
    assert len(one_query_calls) == 2
    o_blocks, _ = dops.dcmha_attention(*args, attention_mask=heads, return_attention_scores=True,
                                       **kw)
    assert len(one_query_calls) == 2                       # the scores need the block path
    assert_close(o, o_blocks)
    np.testing.assert_array_equal(np_(o)[:, 0, 2], 0.0)

    # A per-head mask broadcast over the keys (no causal mask: it stays (B, N, 1, 1)).
    kw["use_causal_mask"] = False
    per_head = np.ones((B, 4, 1, 1), bool)
    per_head[0, 1] = False
    o = dops.dcmha_attention(*args, attention_mask=per_head, **kw)
    o_blocks, _ = dops.dcmha_attention(*args, attention_mask=per_head,
                                       return_attention_scores=True, **kw)
    assert len(one_query_calls) == 3
    assert_close(o, o_blocks)
    np.testing.assert_array_equal(np_(o)[0, 0, 1], 0.0)


@pytest.mark.parametrize("name", ["gqa_groups_static_window", "key_wise_only_rank1"])
def test_layer_steps_match_reference(reference_case, one_query_calls, call_layer, name):
    """Prefill 3 tokens, then one-token steps with an int and a tensor index: outputs and
    cache as the spec's decode_step (eager calls read a tensor index and use it as an int;
    under jax the call is jitted, the tensor index traced)."""
    kwargs = dict(CONFIGS[name], rope_max_wavelength=100.0, qk_norm=True)
    case = reference_case(kwargs, T=6)
    cfg, x = case["cfg"], case["query"]
    layer = DCMHA(**kwargs)
    layer.load_spec_weights(case["params"])
    cache, ref_cache = layer.init_cache(2, 8), reference.init_cache(cfg, 2, 8)
    for i, (start, n) in enumerate(((0, 3), (3, 1), (4, 1), (5, 1))):
        step = x[:, start:start + n]
        index = ops.convert_to_tensor(np.int32(start)) if i % 2 else start
        y, cache = call_layer(layer, step, step, use_causal_mask=True, cache=cache,
                              cache_update_index=index)
        y_ref, ref_cache = reference.decode_step(case["params"], cfg, step, ref_cache, start)
        assert_close(y, y_ref)
    for n, c in ref_cache.items():
        assert_close(cache[n], c)
    # Three one-token steps; under jax the two with a tensor index share one trace.
    assert len(one_query_calls) == (2 if BACKEND == "jax" else 3)


def _prefilled(reference_case, kwargs):
    """(case, layer, cache, reference cache) of a 5-token case whose first 4 tokens the
    layer and the spec have prefilled into caches of 6 positions."""
    case = reference_case(kwargs, T=5)
    x = case["query"]
    layer = DCMHA(**kwargs)
    layer.load_spec_weights(case["params"])
    _, cache = layer(x[:, :4], x[:, :4], use_causal_mask=True, cache=layer.init_cache(2, 6),
                     cache_update_index=0)
    _, ref_cache = reference.decode_step(case["params"], case["cfg"], x[:, :4],
                                         reference.init_cache(case["cfg"], 2, 6), 0)
    return case, layer, cache, ref_cache


def test_traced_layer_step_matches_reference(reference_case, one_query_calls):
    """One step compiled as generate compiles it (jax.jit / tf.function; torch eager),
    with the index a tensor: the one-query path runs inside the trace."""
    case, layer, cache, ref_cache = _prefilled(
        reference_case, dict(num_heads=4, key_dim=8, rope_max_wavelength=100.0))
    cfg, x = case["cfg"], case["query"]

    def step(tok, cache, index):
        return layer(tok, tok, use_causal_mask=True, cache=cache, cache_update_index=index)

    if BACKEND == "jax":
        import jax
        step = jax.jit(step)
    elif BACKEND == "tensorflow":
        import tensorflow as tf
        step = tf.function(step, autograph=False)
    y, _ = step(ops.convert_to_tensor(x[:, 4:]), cache, ops.convert_to_tensor(np.int32(4)))
    y_ref, _ = reference.decode_step(case["params"], cfg, x[:, 4:], ref_cache, 4)
    assert_close(y, y_ref)
    assert len(one_query_calls) == 1


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf_decode's compiled step")
@pytest.mark.parametrize("name, stacked", [("dcmha", [True, True]),
                                           ("mqa_pre_only", [True, True]),
                                           ("key_wise_only_rank1", [True, True]),
                                           ("query_wise_only_gating", [False, False])])
def test_tf_step_takes_the_stacked_cache_entries(reference_case, monkeypatch, name, stacked):
    """In a traced step, "tf_decode" gives its compiled core the cache's stacked key-side
    entries (``spec.terms.KEY_CACHE``) that the layer unstacked, and slices them there; the
    step's output and cache are the spec's."""
    from dcmha.backends.xla import decode
    seen = []
    inner = decode._stacked_entries

    def spy(pre, post):
        out = inner(pre, post)
        seen.append([e is not None for e in out[2]])
        return out
    monkeypatch.setattr(decode, "_stacked_entries", spy)
    import tensorflow as tf
    case, layer, cache, ref_cache = _prefilled(
        reference_case, dict(CONFIGS[name], rope_max_wavelength=100.0))
    cfg, x = case["cfg"], case["query"]
    step = tf.function(lambda tok, cache, index: layer(
        tok, tok, use_causal_mask=True, cache=cache, cache_update_index=index), autograph=False)
    y, cache = step(ops.convert_to_tensor(x[:, 4:]), cache, ops.convert_to_tensor(np.int32(4)))
    y_ref, ref_cache = reference.decode_step(case["params"], cfg, x[:, 4:], ref_cache, 4)
    assert_close(y, y_ref)
    for n, c in ref_cache.items():
        assert_close(cache[n], c)
    assert seen == [stacked]


def _kernel_spy(monkeypatch):
    """(implementation, calls): the one-query path of this backend that runs its composes in
    the compiled kernel, and the list its kernel calls append to; a skip without one."""
    from dcmha.backends import cpu_kernel
    ran = []
    if BACKEND == "jax":
        from dcmha.backends.jax_cpu import dcmha_jax_cpu as module
        name, implementation = "_probs_ffi", "jax_decode"
    elif BACKEND == "torch":
        module, name, implementation = cpu_kernel, "decode_probs", "torch_decode"
    else:
        pytest.skip("no compiled one-query compose on this backend")
    if not cpu_kernel.load() or (BACKEND == "jax" and not module.load()):
        pytest.skip(f"no compiled kernel: {cpu_kernel.unavailable_reason()}")
    inner = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: ran.append(1) or inner(*a))
    return implementation, ran


@pytest.mark.parametrize("name", ["dcmha", "gqa_groups_static_window", "key_wise_only_rank1",
                                  "query_wise_only_gating", "mqa_pre_only", "static_only"])
def test_decode_composes_in_the_kernel(reference_case, monkeypatch, name):
    """"jax_decode" / "torch_decode" run the step's composes and masked softmax as one call
    of the compiled kernel (jax: eager and jitted), at the spec's numbers."""
    implementation, ran = _kernel_spy(monkeypatch)
    t, S = 4, 7
    cfg, p, q, k, v, qdyn, kdyn, terms, f32 = _core_case(reference_case, CONFIGS[name], t, S)
    mask = reference.make_mask(q.shape[0], 1, S, use_causal_mask=True,
                               sliding_window=cfg.sliding_window, query_offset=t)
    o_ref, _ = reference.attend(cfg, p, q, k, v, qdyn, kdyn, mask)

    def attend(q, k, v, index):
        return dops.dcmha_attention(q, k, v, num_groups=cfg.G, pre=terms.get("pre"),
                                    post=terms.get("post"), use_causal_mask=True,
                                    sliding_window=cfg.sliding_window, query_offset=index,
                                    implementation=implementation)
    assert_close(attend(f32(q), f32(k), f32(v), t), o_ref)
    assert len(ran) == 1
    if BACKEND == "jax":
        import jax
        assert_close(jax.jit(attend)(f32(q), f32(k), f32(v), np.int32(t)), o_ref)
        assert len(ran) == 2


def _jax_kernel():
    """The JAX CPU kernel module, or a skip when it does not build here."""
    from dcmha.backends.jax_cpu import dcmha_jax_cpu
    if not dcmha_jax_cpu.load():
        pytest.skip(f"no compiled kernel: {dcmha_jax_cpu.unavailable_reason()}")
    return dcmha_jax_cpu


@pytest.mark.skipif(BACKEND != "jax", reason="the jax_decode kernel (jax.ffi)")
@pytest.mark.parametrize("mask_shape", [None, (2, 1, 7), (1, 1, 1), (2, 4, 1, 7)])
def test_jax_decode_probs_and_gradient_are_the_plain_forms(reference_case, mask_shape):
    """The kernel's probabilities (both composes, the masked softmax) equal
    ``dcmha.ops.one_query_probs`` with every mask form the one-query path passes (none,
    (B, 1, S) with a fully masked row, broadcast (1, 1, 1), per head (B, N, 1, S)), and
    differentiate as it does; masked probabilities stay exactly 0 after a post compose
    without key-side terms."""
    kernel = _jax_kernel()
    import jax
    import jax.numpy as jnp
    kwargs = dict(num_heads=4, key_dim=8, num_groups=2, static_compose=True)
    *_, terms, f32 = _core_case(reference_case, kwargs, 4, 7)
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(2, 2, 2, 7)) * 3, jnp.float32)
    mask = None if mask_shape is None else rng.random(mask_shape) < 0.6
    if mask is not None and mask_shape[-1] == 7:
        mask[1] = False                                  # batch row 1 sees no key
    if mask is not None:
        mask = jnp.asarray(mask)
    stages = {st: {n: jnp.asarray(w) for n, w in tm.items()} for st, tm in terms.items()}

    def loss(probs):
        return lambda x, st: jnp.sum(jnp.sin(probs(x, mask, st["pre"], st["post"], 2)))
    got = kernel.decode_probs(x, mask, stages["pre"], stages["post"], 2)
    assert_close(got, dops.one_query_probs(x, mask, stages["pre"], stages["post"], 2))
    g_got = jax.grad(loss(kernel.decode_probs), argnums=(0, 1))(x, stages)
    g_want = jax.grad(loss(dops.one_query_probs), argnums=(0, 1))(x, stages)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
        assert_close(a, b)
    pre_only = kernel.decode_probs(x, mask, stages["pre"], None, 2)
    if mask is not None and mask_shape[-1] == 7:     # (B, 1, S) / (B, N, 1, S) -> (B, G, M, S)
        m = np.asarray(mask)
        seen = np.broadcast_to(m[:, None] if m.ndim == 3 else m.reshape(2, 2, 2, 7),
                               (2, 2, 2, 7))[0]
        np.testing.assert_array_equal(np_(pre_only)[0][~seen], 0.0)


@pytest.mark.skipif(BACKEND != "jax", reason="the jax_decode kernel (jax.ffi)")
@pytest.mark.parametrize("stages_with_keys", [("pre", "post"), ("post",)])
@pytest.mark.parametrize("heads, groups, S", [(4, 2, 7), (8, 1, 21)])
def test_jax_kernel_reads_the_stacked_cache_entries_in_place(reference_case, stages_with_keys,
                                                              heads, groups, S):
    """Compiled, the kernel's call takes the cache's stacked key-side entries themselves:
    the terms unpacked from them are stacked back in the cache's order, which XLA folds
    into the entry, so the program slices nothing; the probabilities are the plain form's,
    with one stage or both holding key-side terms. S = 21 and G R M = 16 reach the kernel's
    8 x 8 transposes of the terms and their tails."""
    kernel = _jax_kernel()
    import jax
    import jax.numpy as jnp

    from dcmha.spec import terms as spec_terms
    kwargs = dict(num_heads=heads, key_dim=8, num_groups=groups, static_compose=True)
    *_, terms, _ = _core_case(reference_case, kwargs, 4, S)
    slots = [f"{st}_key" for st in stages_with_keys]
    kdyn = {f"{st}_key": {n[1:]: jnp.asarray(w) for n, w in terms[st].items()
                          if n.startswith("k")} for st in stages_with_keys}
    entries = spec_terms.pack_key_weights(kdyn, slots, stack=jnp.stack)
    M = heads // groups
    x = jnp.asarray(np.random.default_rng(6).normal(size=(2, groups, M, S)) * 3, jnp.float32)

    def stages(entries):
        views = spec_terms.unpack_key_weights(
            entries, slots, unstack=lambda a, ax, n: [jnp.take(a, i, ax) for i in range(n)])
        return {st: {n: (views[f"{st}_key"][n[1:]] if n.startswith("k") else jnp.asarray(w))
                     for n, w in tm.items() if st in stages_with_keys or not n.startswith("k")}
                for st, tm in terms.items()}

    def probs(entries):
        st = stages(entries)
        return kernel.decode_probs(x, None, st["pre"], st["post"], M)
    compiled = jax.jit(probs).lower(entries).compile()
    hlo = compiled.as_text()
    assert "custom-call" in hlo
    assert not [line for line in hlo.splitlines() if " slice(" in line or "gather(" in line]
    st = stages(entries)
    assert_close(compiled(entries), dops.one_query_probs(x, None, st["pre"], st["post"], M))


@pytest.mark.skipif(BACKEND != "torch", reason="the torch_decode kernel call (ctypes)")
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("heads, groups, S", [(4, 2, 7), (4, 2, 21), (8, 1, 21)])
def test_torch_kernel_reads_the_stacked_cache_entries_in_place(reference_case, B, heads, groups,
                                                                S):
    """The kernel reads each slot's key-side terms as views into the cache's stacked
    entries (``cpu_kernel.decode_terms`` keeps them, ``key_row`` gives their stride): the
    probabilities are those of contiguous copies and of ``dcmha.ops.one_query_probs``.
    S = 21 and G R M = 16 reach the kernel's 8 x 8 transposes of the terms and their tails."""
    import torch

    from dcmha.backends import cpu_kernel
    from dcmha.spec import terms as spec_terms
    lib = cpu_kernel.load()
    if lib is None:
        pytest.skip(f"no compiled kernel: {cpu_kernel.unavailable_reason()}")
    kwargs = dict(num_heads=heads, key_dim=8, num_groups=groups, static_compose=True)
    *_, terms, _ = _core_case(reference_case, kwargs, 4, S)
    terms = {st: {n: w[:B] if w.ndim > 3 else w for n, w in tm.items()}     # case's B = 2
             for st, tm in terms.items()}
    kdyn = {f"{st}_key": {n[1:]: torch.as_tensor(w) for n, w in tm.items()
                          if n.startswith("k")} for st, tm in terms.items()}
    slots = list(kdyn)
    entries = spec_terms.pack_key_weights(kdyn, slots, stack=torch.stack)
    views = spec_terms.unpack_key_weights(entries, slots, unstack=lambda a, ax, n: a.unbind(ax))
    stages = {st: {n: (views[f"{st}_key"][n[1:]] if n.startswith("k") else torch.as_tensor(w))
                   for n, w in tm.items()} for st, tm in terms.items()}
    assert not stages["pre"]["kw1"].is_contiguous()
    kept = cpu_kernel.decode_terms(stages["pre"])
    assert kept["kw1"].data_ptr() == stages["pre"]["kw1"].data_ptr()          # no copy
    assert cpu_kernel.key_row(kept["kw1"]) == 4 * 2 * heads      # 2 C_k slices of (G, R, M)
    M = heads // groups
    x = torch.as_tensor(np.random.default_rng(6).normal(size=(B, groups, M, S)) * 3,
                        dtype=torch.float32)

    def probs(st):
        return cpu_kernel.decode_probs(lib, x, torch.empty_like(x), None,
                                       cpu_kernel.decode_terms(st["pre"]),
                                       cpu_kernel.decode_terms(st["post"]),
                                       spec_terms.MASKED_SCORE)
    got = probs(stages)
    copies = {st: {n: w.contiguous() for n, w in tm.items()} for st, tm in stages.items()}
    np.testing.assert_array_equal(got.numpy(), probs(copies).numpy())
    assert_close(got, dops.one_query_probs(x, None, stages["pre"], stages["post"], M))


@pytest.mark.skipif(BACKEND != "torch", reason="torch_decode's gradient rule")
def test_torch_decode_records_gradients_without_the_kernel(reference_case, monkeypatch):
    """A step whose inputs require gradients runs PyTorch's ops (the kernel records none):
    the gradient reaches the query and the terms, and the output is the kernel's."""
    import torch
    implementation, ran = _kernel_spy(monkeypatch)
    t, S = 4, 7
    cfg, p, q, k, v, qdyn, kdyn, terms, f32 = _core_case(reference_case, CONFIGS["dcmha"], t, S)
    args = [torch.tensor(f32(a), requires_grad=True) for a in (q, k, v)]
    pre = {n: torch.tensor(w, requires_grad=True) for n, w in terms["pre"].items()}
    kw = dict(num_groups=cfg.G, post=terms["post"], use_causal_mask=True, query_offset=t,
              implementation=implementation)
    o = dops.dcmha_attention(*args, pre=pre, **kw)
    assert ran == []                     # both composes' inputs depend on q (and pre)
    o.sum().backward()
    assert args[0].grad is not None and float(args[0].grad.abs().sum()) > 0
    assert all(w.grad is not None for w in pre.values())
    with torch.no_grad():
        o_kernel = dops.dcmha_attention(*args, pre=pre, **kw)
    assert len(ran) == 1
    assert_close(o.detach(), np_(o_kernel))


def _dynamic_kernel_spy(monkeypatch):
    """(rows limit, list): the backend's step kernel for dynamic weights, spied (the list
    gets one entry per step it computes); a skip where there is none."""
    from dcmha.backends import cpu_kernel
    ran = []
    if BACKEND == "torch":
        if cpu_kernel.load() is None:
            pytest.skip(f"no compiled kernel: {cpu_kernel.unavailable_reason()}")
        inner = cpu_kernel.dynamic_weights
        monkeypatch.setattr(cpu_kernel, "dynamic_weights",
                            lambda *a, **k: ran.append(1) or inner(*a, **k))
    elif BACKEND == "tensorflow":
        from dcmha.backends.tf_cpu import dcmha_tf_cpu as owner
        if not owner.load():
            pytest.skip(f"no compiled kernel: {owner.unavailable_reason()}")
        inner = owner.dynamic_weights

        def spy(*a, **k):
            out = inner(*a, **k)
            if out is not None:
                ran.append(1)
            return out
        _seam_step_kernel(monkeypatch, spy)
    else:
        pytest.skip("no step kernel for the dynamic weights on this backend")
    return cpu_kernel.DYNAMIC_ROWS, ran


@pytest.mark.parametrize("parts", ["both", "projection", "gating"])
@pytest.mark.parametrize("approximate", [True, False])
@pytest.mark.parametrize("scale", [1.0, 0.1])
def test_step_dynamic_weights_in_the_kernel(monkeypatch, parts, approximate, scale):
    """A decoding step's dynamic weights (one row) come from the compiled kernel on eager
    torch and on tensorflow, at the spec's numbers, for both GELU forms, and differentiate
    as the plain form; more than ``cpu_kernel.DYNAMIC_ROWS`` rows (and, on torch, weights that record
    gradients) take the framework's ops, at the same numbers. Weights held divided by
    ``weight_scale`` (``composition_lr_scale``, which the tensorflow op applies itself)
    give the weights' numbers, and their gradients are the plain form's."""
    rows_limit, ran = _dynamic_kernel_spy(monkeypatch)
    rng = np.random.default_rng(7)
    D, G, K, R, M = 24, 2, 6, 2, 3
    slots = ("pre_query", "pre_key", "post_query")
    C = len(slots)
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)      # noqa: E731
    dw1, qkw = (f32(D, G, C, K), f32(G, C, K, 2 * R, M)) if parts != "gating" else (None, None)
    dd = f32(D, G, C * M) if parts != "projection" else None
    held = [None if w is None else w / np.float32(scale) for w in (dw1, qkw, dd)]
    for rows in (1, rows_limit + 1):
        x = f32(1, rows, D)
        want = reference.dynamic_weights(x, dw1, qkw, dd, slots, R, approximate)
        ran.clear()
        tensors = [None if w is None else ops.convert_to_tensor(w) for w in (x, *held)]
        got = dops.dynamic_weights(*tensors, slots=slots, rank=R, gelu_approximate=approximate,
                                   weight_scale=scale)
        assert len(ran) == (1 if rows == 1 else 0)
        assert sorted(got) == sorted(want)
        for s in slots:
            assert sorted(got[s]) == sorted(want[s])
            for n in want[s]:
                assert_close(got[s][n], want[s][n])
    x = f32(1, 1, D)
    ups = {s: {n: f32(*w.shape) for n, w in ws.items()}
           for s, ws in reference.dynamic_weights(x, dw1, qkw, dd, slots, R, approximate).items()}
    grads = {}
    for kernel in (True, False):
        if not kernel:
            _no_step_kernel(monkeypatch)
        grads[kernel] = _dynamic_grads(x, *held, slots, R, approximate, ups, scale)
    assert len(ran) == (1 if BACKEND == "tensorflow" else 0)  # torch records them without it
    for a, b in zip(grads[True], grads[False]):
        assert_close(a, b)


def _no_step_kernel(monkeypatch):
    """The backend's step kernel for dynamic weights switched off (the framework's ops)."""
    if BACKEND == "torch":
        from dcmha.backends.torch_native import dynamic_weights
        monkeypatch.setattr(dynamic_weights, "_kernel_dynamic_weights", lambda *a, **k: None)
    else:
        _seam_step_kernel(monkeypatch, None)


def _seam_step_kernel(monkeypatch, fn):
    """The tensorflow seam's step kernel for dynamic weights replaced by ``fn``."""
    from dcmha import framework
    monkeypatch.setitem(framework._once, ("tensorflow", "step_dynamic_weights"), fn)


def _dynamic_grads(x, dw1, qkw, dd, slots, R, approximate, ups, scale=1.0):
    """Gradients of sum(w * ups) over every dynamic weight, for x and the present weights
    (held divided by ``scale``)."""
    inputs = [w for w in (x, dw1, qkw, dd) if w is not None]
    if BACKEND == "torch":
        import torch
        ts = [torch.tensor(w, requires_grad=True) for w in inputs]
        it = iter(ts)
        args = [next(it) if w is not None else None for w in (x, dw1, qkw, dd)]
        got = dops.dynamic_weights(*args, slots=slots, rank=R, gelu_approximate=approximate,
                                   weight_scale=scale)
        sum(torch.sum(got[s][n] * torch.tensor(u)) for s, us in ups.items()
            for n, u in us.items()).backward()
        return [t.grad.numpy() for t in ts]
    import tensorflow as tf
    ts = [tf.constant(w) for w in inputs]
    with tf.GradientTape() as tape:
        tape.watch(ts)
        it = iter(ts)
        args = [next(it) if w is not None else None for w in (x, dw1, qkw, dd)]
        got = dops.dynamic_weights(*args, slots=slots, rank=R, gelu_approximate=approximate,
                                   weight_scale=scale)
        loss = tf.add_n([tf.reduce_sum(got[s][n] * u) for s, us in ups.items()
                         for n, u in us.items()])
    return [g.numpy() for g in tape.gradient(loss, ts)]


@pytest.mark.skipif(BACKEND != "torch", reason="the fused projection is eager PyTorch's")
@pytest.mark.parametrize("name", ["dcmha", "query_wise_only_gating", "key_wise_only_rank1"])
@pytest.mark.parametrize("use_bias", [False, True])
def test_torch_fused_query_projection(reference_case, monkeypatch, name, use_bias):
    """Eager torch without gradients: from the second one-token step with unchanged
    weights, the query projection and the dynamic weights come from one matrix product
    with [kernel | dw1 | dd] (``torch_native.dynamic_weights.fused_projection``), at the spec's
    numbers. Weights assigned between steps are read again (the first step after does
    not use the old concatenation); ``FUSED_PROJECTION = False`` turns it off."""
    import torch

    from dcmha.backends import cpu_kernel
    from dcmha.backends.torch_native import dynamic_weights
    if cpu_kernel.load() is None:
        pytest.skip(f"no compiled kernel: {cpu_kernel.unavailable_reason()}")
    ran = []
    inner = cpu_kernel.dynamic_finish
    monkeypatch.setattr(cpu_kernel, "dynamic_finish",
                        lambda *a, **k: ran.append(1) or inner(*a, **k))
    monkeypatch.setattr(dynamic_weights, "FUSED_PROJECTION", True)
    kwargs = dict(CONFIGS[name], rope_max_wavelength=100.0, use_bias=use_bias)
    case = reference_case(kwargs, T=5)
    cfg, x, params = case["cfg"], case["query"], case["params"]
    if use_bias:                           # the spec's initial biases are zeros
        rng = np.random.default_rng(5)
        params = {n: rng.normal(size=p.shape).astype(np.float32) if n.endswith("_bias") else p
                  for n, p in params.items()}
    layer = DCMHA(**kwargs)
    layer.load_spec_weights(params)
    cache, ref_cache = layer.init_cache(2, 8), reference.init_cache(cfg, 2, 8)
    y, cache = layer(x[:, :3], x[:, :3], use_causal_mask=True, cache=cache,
                     cache_update_index=0)
    _, ref_cache = reference.decode_step(params, cfg, x[:, :3], ref_cache, 0)
    step = x[:, 3:4]
    y_ref, _ = reference.decode_step(params, cfg, step, ref_cache, 3)
    step = ops.convert_to_tensor(step)      # one tensor as query and value: self-attention

    def run():
        with torch.no_grad():
            return layer(step, step, use_causal_mask=True, cache=cache, cache_update_index=3)[0]

    assert_close(run(), y_ref)
    assert ran == []                                   # the first step: weights seen once
    for n in (1, 2):
        assert_close(run(), y_ref)
        assert len(ran) == n
    # New weights: the next step reads them (not the old concatenation), then fuses again.
    dynamic = "dw1" if "dw1" in params else "dd"
    params2 = dict(params, query_kernel=params["query_kernel"] * 1.5,
                   **{dynamic: params[dynamic] * 0.5})
    layer.load_spec_weights(params2)
    y_ref2, _ = reference.decode_step(params2, cfg, x[:, 3:4], ref_cache, 3)
    # the cache's earlier entries came from the old weights in both
    assert np.max(np.abs(y_ref2 - y_ref)) > 1e-3
    for n in (2, 3):
        assert_close(run(), y_ref2)
        assert len(ran) == n
    monkeypatch.setattr(dynamic_weights, "FUSED_PROJECTION", False)
    assert_close(run(), y_ref2)
    assert len(ran) == 3
    # A query projection with LoRA (its B starts at zero: same numbers) is not fused.
    monkeypatch.setattr(dynamic_weights, "FUSED_PROJECTION", True)
    layer.enable_lora(2, projections=("query",))
    for _ in range(2):
        assert_close(run(), y_ref2)
    assert len(ran) == 3
