"""The plain-PyTorch fused core (dcmha.backends.torch_native) against the NumPy spec.

Forward (output and attention scores) and gradients (w.r.t. q, k, v, every compose term and
the attention scores' upstream gradient) of ``dcmha_attention`` are compared with the float64
spec (``spec/reference.py`` and the hand-written backward of ``spec/reference_grad.py``) and
with ``dcmha_attention_reference`` (plain PyTorch autograd, materialising). Tolerances are the
spec's conformance policy (``dcmha.spec.tolerance``) computed from the float64 result of the
same inputs, as in tests/backends/test_triton_kernel.py. Then the Keras fast path ("torch" in
``dcmha.ops.FAST_PATHS``): its registry contract and ``DCMHA(implementation="torch")`` against
``implementation="ops"``.

Runs with KERAS_BACKEND=torch (skipped on the other Keras backends). Shapes are tiny and
blocks small (``block_q`` 2 to 4), so every test crosses block boundaries. Every test runs
twice: with the compiled compose kernel (``cpu_kernel``) and with the plain PyTorch ops it
replaces (``DCMHA_CPU_KERNEL=0``); ``test_compiled_kernel_sizes`` covers the kernel's
vectorised sizes (at least 16 visible keys per block) and its generic loops.
"""

import math
import shutil
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("the torch-native core runs on the Keras torch backend", allow_module_level=True)
torch = pytest.importorskip("torch")

from tests import kernel_cases  # noqa: E402
from dcmha.backends import cpu_kernel  # noqa: E402
from dcmha.backends import torch_native as tn  # noqa: E402
from dcmha.backends.torch_native import blocks, dcmha_torch  # noqa: E402
from dcmha.backends.torch_native import core as path_core  # noqa: E402
from tests.kernel_cases import TERMS, assert_close, spec_result  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(autouse=True, params=["c-kernel", "torch-ops"])
def compose_kernel(request, monkeypatch):
    """Run the test with the compiled compose kernel, then with the plain PyTorch ops."""
    monkeypatch.setenv("DCMHA_CPU_KERNEL", "1" if request.param == "c-kernel" else "0")
    cpu_kernel._reset()
    if request.param == "c-kernel" and cpu_kernel.load() is None:
        pytest.skip(f"compose kernel unavailable: {cpu_kernel.unavailable_reason()}")
    yield request.param
    cpu_kernel._reset()


# ---------------------------------------------------------------------------
# Problems and the float64 truth
# ---------------------------------------------------------------------------

def make_problem(seed, **kwargs):
    """A problem of ``kernel_cases`` with dScores by default (the core returns scores)."""
    return kernel_cases.make_problem(seed, **{"scores_grad": True, **kwargs})


def torch_inputs(p, dtype):
    dt = TORCH_DTYPES[dtype]

    def t(x):
        return torch.tensor(x, dtype=dt, requires_grad=True)

    leaves = {"q": t(p["q"]), "k": t(p["k"]), "v": t(p["v"])}
    stages = {}
    for st in ("pre", "post"):
        if p[st] is None:
            stages[st] = None
            continue
        stages[st] = {n: t(x) for n, x in p[st].items()}
        leaves.update({f"{st}/{n}": x for n, x in stages[st].items()})
    return leaves, stages


def run(fn, p, dtype, kwargs):
    """fn's output, attention scores and gradients (float64 NumPy), keyed like spec_result."""
    leaves, stages = torch_inputs(p, dtype)
    o, scores = fn(leaves["q"], leaves["k"], leaves["v"], num_groups=p["G"], pre=stages["pre"],
                   post=stages["post"], return_attention_scores=True, **kwargs)
    assert o.dtype == TORCH_DTYPES[dtype] and scores.dtype == TORCH_DTYPES[dtype]
    assert o.shape == leaves["q"].shape[:3] + (p["v"].shape[3],)
    names = list(leaves)
    loss = (o.float() * torch.tensor(p["do"], dtype=torch.float32)).sum()
    if p["ds"] is not None:
        loss = loss + (scores.float() * torch.tensor(p["ds"], dtype=torch.float32)).sum()
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    res = {"output": o, "attention_scores": scores}
    res.update({"grad/" + n: g for n, g in zip(names, grads)})
    for n, g in zip(names, grads):
        assert g.dtype == TORCH_DTYPES[dtype], n
    return {n: x.detach().to(torch.float64).numpy() for n, x in res.items()}


def check(p, dtype="float32", *, mask=None, causal=False, sliding_window=None, query_offset=0,
          block_q=4, against_reference=True):
    full = kernel_cases.full_mask(p, mask=mask, causal=causal, sliding_window=sliding_window,
                                  query_offset=query_offset)
    expected, sigma = spec_result(p, full)
    kwargs = dict(causal=causal, sliding_window=sliding_window, query_offset=query_offset,
                  mask=None if mask is None else torch.tensor(mask))
    got = run(tn.dcmha_attention, p, dtype, dict(kwargs, block_q=block_q))
    assert_close(got, expected, dtype, sigma, "fused vs spec")
    if against_reference:
        assert_close(run(tn.dcmha_attention_reference, p, dtype, kwargs), expected, dtype,
                     sigma, "torch reference vs spec")
    return got, full


# ---------------------------------------------------------------------------
# Compose terms, alone and together
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("stage", ["pre", "post"])
@pytest.mark.parametrize("term", ["qw", "kw", "qdd", "kdd", "static"])
def test_each_term_alone(stage, term):
    names = (term + "1", term + "2") if term in ("qw", "kw") else (term,)
    p = make_problem(1, pre=names if stage == "pre" else None,
                     post=names if stage == "post" else None)
    check(p, causal=True, against_reference=False)


@pytest.mark.parametrize("N,G,R,S", [(8, 1, 2, 40), (8, 2, 1, 35), (16, 1, 4, 33),
                                     (4, 2, 2, 48), (4, 4, 1, 20), (6, 2, 3, 20),
                                     (8, 1, 5, 17)])
def test_compiled_kernel_sizes(N, G, R, S):
    """M = N / G in 1, 2, 4, 8, 16 with R in 1, 2, 4 take the vectorised loops (16 keys a
    vector, a generic tail for S % 16); M = 3 or R = 5 the generic loops throughout."""
    p = make_problem(20 + N + G + R + S, B=1, T=6, S=S, N=N, N_kv=N // 2, d=4, d_v=3, G=G,
                     R=R)
    check(p, query_offset=S - 6, causal=True, block_q=4, against_reference=False)
    check(p, block_q=8, against_reference=False)


def test_compiled_kernel_builds_where_a_compiler_exists(monkeypatch):
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):  # what build_library looks for
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("DCMHA_CPU_KERNEL", "1")
    cpu_kernel._reset()
    assert cpu_kernel.load() is not None, cpu_kernel.unavailable_reason()
    assert cpu_kernel.unavailable_reason() is None
    monkeypatch.setenv("DCMHA_CPU_KERNEL", "0")
    cpu_kernel._reset()
    assert cpu_kernel.load() is None
    assert cpu_kernel.unavailable_reason() == "disabled by DCMHA_CPU_KERNEL"


def test_plain_attention_and_identity_compose():
    p = make_problem(2, pre=None, post=None)
    got, _ = check(p)
    q = make_problem(2, pre=(), post=())      # stages on, every term off: identity compose
    np.testing.assert_allclose(check(q)[0]["output"], got["output"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("pre,post", [(("kw1", "kw2", "kdd"), ("qw1", "qw2", "static")),
                                      (("qdd", "static"), ("kdd",))])
def test_query_side_or_key_side_only(pre, post):
    check(make_problem(3, pre=pre, post=post, G=2), causal=True)


def test_all_terms_both_stages_two_groups_gqa():
    check(make_problem(4, N=4, N_kv=2, G=2, R=2))


@pytest.mark.parametrize("G,R,N_kv", [(1, 1, 1), (2, 1, 4), (4, 2, 2), (1, 3, 4)])
def test_groups_rank_gqa(G, R, N_kv):
    check(make_problem(5, G=G, R=R, N_kv=N_kv), causal=True, against_reference=False)


# ---------------------------------------------------------------------------
# Masks, windows, decoding offsets, blocks
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal,window", [(True, None), (False, 3), (True, 4), (False, 1)])
def test_causal_and_sliding_window(causal, window):
    check(make_problem(6), causal=causal, sliding_window=window)


def test_block_ranges_and_decode_offsets():
    """Key ranges of causal and window masks across block boundaries, with query offsets."""
    p = make_problem(7, T=11, S=13, N=2, N_kv=1, d=4, d_v=4, pre=("kdd", "qw1", "qw2"),
                     post=("kw1", "kw2", "static"))
    for causal, window, offset, block in [(True, None, 0, 3), (True, None, 2, 4),
                                          (False, 1, 0, 2), (False, 2, 2, 5), (True, 3, 0, 4),
                                          (True, 4, 2, 1), (False, 6, 0, 11), (True, 5, 2, 3)]:
        check(p, causal=causal, sliding_window=window, query_offset=offset, block_q=block,
              against_reference=False)


def test_single_query_decode_step():
    p = make_problem(8, T=1, S=9)
    check(p, causal=True, query_offset=6, block_q=1)
    check(p, causal=True, sliding_window=3, query_offset=8, block_q=1)


def test_general_mask_with_fully_masked_rows():
    p = make_problem(9, G=2)
    mask = np.random.default_rng(9).random((2, 11, 9)) > 0.4
    mask[0, 3] = False
    mask[1, 9] = False
    got, full = check(p, mask=mask, causal=True)
    for name in ("output", "grad/q"):
        assert np.all(got[name][0, 3] == 0.0) and np.all(got[name][1, 9] == 0.0), name
    hidden = np.broadcast_to(~full[:, None], got["attention_scores"].shape)
    assert np.all(got["attention_scores"][hidden] == 0.0)        # exactly 0, not tiny


@pytest.mark.parametrize("shape", [(1, 1, 9), (11, 9), (2, 1, 9), (2, 11, 1), (1, 11, 9)])
def test_broadcast_masks(shape):
    p = make_problem(10)
    mask = np.random.default_rng(10).random(shape) > 0.3
    check(p, mask=mask, against_reference=False)


def test_queries_that_see_no_key_give_zeros():
    # No causal mask and T > S + W: the last queries are outside every key's window.
    p = make_problem(11, T=8, S=2, pre=("qw1", "qw2", "kdd"), post=("kw1", "kw2", "static"))
    got, _ = check(p, sliding_window=2, block_q=3)
    assert np.all(got["output"][:, 4:] == 0.0) and np.all(got["grad/q"][:, 4:] == 0.0)


@pytest.mark.parametrize("block_q", [1, 2, 5, 64])
def test_block_size_does_not_change_the_result(block_q):
    p = make_problem(12, T=10, S=10)
    mask = torch.tensor(np.random.default_rng(12).random((2, 10, 10)) > 0.3)
    leaves, stages = torch_inputs(p, "float32")
    base = tn.dcmha_attention(leaves["q"], leaves["k"], leaves["v"], num_groups=1,
                              pre=stages["pre"], post=stages["post"], mask=mask, causal=True,
                              block_q=3)
    other = tn.dcmha_attention(leaves["q"], leaves["k"], leaves["v"], num_groups=1,
                               pre=stages["pre"], post=stages["post"], mask=mask, causal=True,
                               block_q=block_q)
    # Other blocks round differently (GEMM shapes, summation order): a few float32 ulps.
    torch.testing.assert_close(other, base, rtol=1e-6, atol=1e-6 * float(base.detach().abs().max()))


def test_threads_give_the_same_result(monkeypatch):
    """Blocks run on worker threads with per-thread key-gradient accumulators."""
    p = make_problem(13, T=16, S=16)
    results = []
    for workers in (1, 3):
        monkeypatch.setattr(blocks, "_MAX_WORKERS", workers)
        previous = torch.get_num_threads()
        torch.set_num_threads(max(previous, workers, 2))
        try:
            assert blocks._workers(torch.device("cpu"), 8) == workers     # the patch applies
            results.append(run(tn.dcmha_attention, p, "float32", dict(causal=True, block_q=2)))
        finally:
            torch.set_num_threads(previous)
        assert torch.get_num_threads() == previous          # the caller's setting is restored
    for name in results[0]:
        e = results[0][name]
        np.testing.assert_allclose(results[1][name], e, rtol=1e-6,
                                   atol=1e-6 * max(1.0, float(np.abs(e).max())), err_msg=name)


def test_no_grad_and_inference_mode():
    p = make_problem(14, T=8, S=8)
    leaves, stages = torch_inputs(p, "float32")
    args = (leaves["q"], leaves["k"], leaves["v"])
    kw = dict(num_groups=1, pre=stages["pre"], post=stages["post"], causal=True, block_q=2)
    with torch.enable_grad():
        want = tn.dcmha_attention(*args, **kw).detach()
    with torch.no_grad():
        got = tn.dcmha_attention(*args, **kw)
    assert not got.requires_grad
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.inference_mode():
        inf_args = [x.detach().clone() for x in args]
        inf_stages = {n: x.detach().clone() for n, x in stages["pre"].items()}
        got = tn.dcmha_attention(*inf_args, num_groups=1, pre=inf_stages, post=None,
                                 causal=True, block_q=2)
    want = tn.dcmha_attention_reference(*[x.detach() for x in args], num_groups=1,
                                        pre={n: x.detach() for n, x in stages["pre"].items()},
                                        causal=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _in_a_new_thread(fn):
    """fn() run by a new thread (whose per-thread block buffers start empty); its result."""
    out = {}

    def target():
        try:
            out["result"] = fn()
        except BaseException as e:          # re-raised in the caller
            out["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("modes", [("inference_mode", "no_grad", "grad"),
                                   ("no_grad", "inference_mode", "grad"),
                                   ("grad", "inference_mode", "no_grad")])
def test_grad_modes_in_any_order_reuse_the_block_buffers(monkeypatch, workers, modes):
    """Every thread keeps its block buffers across calls (``_Workspace``) whatever the grad
    mode of each call: a buffer allocated under ``torch.inference_mode`` must not be an
    inference tensor, which a later call outside inference mode could not update in place
    ("Inplace update to inference tensor outside InferenceMode"). In a test run, which thread
    first allocates a buffer, in which mode, depends on the earlier tests and on which thread
    takes which block; here it is fixed: a new calling thread and a new pool, and every
    thread runs a block of the first call, so every buffer is allocated in the first mode."""
    p = make_problem(18, T=16, S=16, scores_grad=False)
    leaves, stages = torch_inputs(p, "float32")
    detached = {n: x.detach() for n, x in leaves.items()}
    kw = dict(num_groups=p["G"], block_q=2)       # 8 blocks of one size (not causal)
    do = torch.tensor(p["do"], dtype=torch.float32)

    def call(mode):
        if mode == "grad":
            o = tn.dcmha_attention(leaves["q"], leaves["k"], leaves["v"], pre=stages["pre"],
                                   post=stages["post"], **kw)
            grads = torch.autograd.grad((o * do).sum(), list(leaves.values()))
            assert all(torch.isfinite(g).all() for g in grads)
            return o.detach()
        with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
            return tn.dcmha_attention(
                detached["q"], detached["k"], detached["v"],
                pre={n: detached[f"pre/{n}"] for n in stages["pre"]},
                post={n: detached[f"post/{n}"] for n in stages["post"]}, **kw)

    barrier = threading.Barrier(workers, timeout=60)
    started = set()
    scores = dcmha_torch._scores

    def first_block_waits(*args):      # every thread runs one block of the first call
        if threading.get_ident() not in started:
            started.add(threading.get_ident())
            barrier.wait()
        return scores(*args)

    def calls():
        previous = torch.get_num_threads()
        torch.set_num_threads(max(previous, workers))
        try:
            return [call(mode) for mode in modes]
        finally:
            torch.set_num_threads(previous)

    monkeypatch.setattr(dcmha_torch, "_scores", first_block_waits)
    monkeypatch.setattr(blocks, "_MAX_WORKERS", workers)
    monkeypatch.setattr(blocks, "_POOL", None)                   # new worker threads
    try:
        results = _in_a_new_thread(calls)
    finally:
        if blocks._POOL is not None:
            blocks._POOL[1].shutdown()
    assert len(started) == workers                  # the new thread and the pool's
    for o in results[1:]:
        torch.testing.assert_close(o, results[0], rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Dtypes
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_dtypes(dtype):
    p = make_problem(15, G=2, dtype=dtype)
    check(p, dtype, causal=True)


def test_float32_compute_for_half_inputs():
    """Scores, compose and softmax run in float32: the half result is the float32 one rounded."""
    p = make_problem(16, dtype="bfloat16", scores_grad=False)
    out = {}
    for dtype in ("float32", "bfloat16"):
        leaves, stages = torch_inputs(p, dtype)
        out[dtype] = tn.dcmha_attention(leaves["q"], leaves["k"], leaves["v"], num_groups=1,
                                        pre=stages["pre"], post=stages["post"], causal=True)
    torch.testing.assert_close(out["bfloat16"], out["float32"].to(torch.bfloat16), rtol=0,
                               atol=0)


# ---------------------------------------------------------------------------
# API
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("B,T,S", [(1, 0, 3), (1, 3, 0), (0, 3, 3)])
def test_empty_sizes(B, T, S):
    """No query, key or batch: zeros of the right shapes, as the reference gives."""
    q = torch.randn(B, T, 4, 4, requires_grad=True)
    k = torch.randn(B, S, 2, 4, requires_grad=True)
    v = torch.randn(B, S, 2, 4, requires_grad=True)
    post = {"static": torch.randn(2, 2, 2, requires_grad=True),
            "kdd": torch.randn(B, S, 2, 2, requires_grad=True)}
    leaves = [q, k, v, post["static"], post["kdd"]]
    results = []
    for fn in (tn.dcmha_attention, tn.dcmha_attention_reference):
        o = fn(q, k, v, num_groups=2, post=post, causal=True)
        results.append([o] + list(torch.autograd.grad(o.sum(), leaves, allow_unused=True)))
    for got, want in zip(*results):
        want = torch.zeros_like(got) if want is None else want
        assert got.shape == want.shape and torch.equal(got, want)


def test_argument_errors():
    q, k, v = torch.zeros(1, 3, 4, 8), torch.zeros(1, 5, 2, 8), torch.zeros(1, 5, 2, 8)
    with pytest.raises(ValueError, match=r"`num_groups` must divide the number of heads N=4\. "
                                         r"Received: num_groups=3"):
        tn.dcmha_attention(q, k, v, num_groups=3)
    with pytest.raises(ValueError, match=r"`pre\['qdd'\]` must have shape \(B, T, G, M\) = "
                                         r"\(1, 3, 2, 2\)\. Received: pre\['qdd'\]\.shape="
                                         r"\(1, 3, 2\)"):
        tn.dcmha_attention(q, k, v, num_groups=2, pre={"qdd": torch.zeros(1, 3, 2)})
    with pytest.raises(ValueError, match=r"`post` must have both 'kw1' and 'kw2' or neither"):
        tn.dcmha_attention(q, k, v, num_groups=1, post={"kw1": torch.zeros(1, 5, 1, 2, 4)})
    with pytest.raises(ValueError, match=r"`pre` has unknown compose terms \['w1'\]"):
        tn.dcmha_attention(q, k, v, num_groups=1, pre={"w1": None})
    with pytest.raises(TypeError, match=r"`mask` must be boolean \(True = attend\) or integer"):
        tn.dcmha_attention(q, k, v, num_groups=1, mask=torch.ones(1, 3, 5))
    with pytest.raises(TypeError, match=r"`mask` must be None or a bool tensor \(True = attend\)\. "
                                        r"Received: mask\.dtype=torch\.int32"):
        tn.dcmha_attention(q, k, v, num_groups=1, mask=torch.ones(1, 3, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`mask` must broadcast to \(B, T, S\) = \(1, 3, 5\)\. "
                                         r"Received: mask\.shape=\(1, 3, 4\)"):
        tn.dcmha_attention(q, k, v, num_groups=1, mask=torch.ones(1, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"`mask` must broadcast to \(B, T, S\) = \(1, 3, 5\): "
                                         r"the fused kernels take one mask shared by all heads"):
        tn.dcmha_attention(q, k, v, num_groups=1, mask=torch.ones(1, 4, 3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"`q`, `k` and `v` must share one dtype"):
        tn.dcmha_attention(q.half(), k, v, num_groups=1)
    with pytest.raises(ValueError, match=r"`query_offset` must be a non-negative integer\. "
                                         r"Received: query_offset=-1"):
        tn.dcmha_attention(q, k, v, num_groups=1, query_offset=-1)
    with pytest.raises(ValueError, match=r"`block_q` must be None or a positive integer\. "
                                         r"Received: block_q=0"):
        tn.dcmha_attention(q, k, v, num_groups=1, block_q=0)
    with pytest.raises(ValueError, match=r"`sliding_window` must be None or a positive integer"):
        tn.dcmha_attention(q, k, v, num_groups=1, sliding_window=0)


def test_default_block_q():
    assert dcmha_torch.default_block_q(2, 8, 1024) == 64
    assert dcmha_torch.default_block_q(1, 16, 16384) == 16       # at least 16 queries
    assert dcmha_torch.default_block_q(1, 1, 16) == 256          # at most 256


def test_import_does_not_import_torch():
    code = ("import sys; import dcmha.backends.torch_native as t; "
            "assert 'torch' not in sys.modules, 'torch imported'; assert t.is_available()")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------
# The Keras fast path
# ---------------------------------------------------------------------------

def _call(q, k, v, **over):
    from dcmha.call import describe
    return describe(q, k, v, **over)


def test_registry_contract():
    from dcmha import registry
    impl = registry.get("torch")
    assert (impl.backend, impl.module) == ("torch", "dcmha.backends.torch_native.core")
    assert impl.auto_devices == {"cpu"} and impl.min_length_product == 16 * 16
    small = [torch.zeros(1, 8, 2, 4)] * 3
    big = [torch.zeros(1, 96, 2, 4)] * 3
    assert path_core.unsupported(_call(*small)) is None
    # Declared capabilities: refused by the registry, with the reason.
    for over, need in [(dict(return_intermediates=True), "intermediates"),
                       (dict(dropout_rate=0.1, training=True), "dropout")]:
        call = _call(*small, **over)
        assert call.needs & impl.lacks == {need}
        with pytest.raises(ValueError, match="^`implementation='torch'` cannot run this call: "
                                             "the call needs "):
            registry.select("torch", call)
    assert _call(*small, dropout_rate=0.1, training=False).needs == frozenset()
    assert path_core.unsupported(_call(*small, query_offset=torch.tensor(3))) is None
    assert path_core._offset(torch.tensor(3)) == 3
    with pytest.raises(ValueError, match=r"^`query_offset` must be an integer or an integer "
                                         r"scalar tensor\. Received: query_offset\.shape=\(\), "
                                         r"query_offset\.dtype=float32$"):
        _call(*small, query_offset=torch.tensor(1.5))
    with pytest.raises(ValueError, match="^`query_offset` must be a non-negative integer"):
        _call(*small, query_offset=1.5)
    rows = registry.explain(_call(*small))               # T * S below the threshold
    assert ("torch", "'auto' takes it from T * S >= 256; this call has T * S = 64") in rows
    assert registry.select("auto", _call(*big))[0] in ("torch", "triton")
    assert registry.select("auto", _call(*small))[0] == "ops"


def test_core_matches_ops_core():
    from dcmha import ops as dops
    rng = np.random.default_rng(17)
    B, T, N, d, G, R, M = 2, 9, 4, 8, 2, 2, 2
    t = lambda *s: torch.tensor(rng.normal(size=s), dtype=torch.float32)  # noqa: E731
    q, k, v = t(B, T, N, d), t(B, T, 2, d), t(B, T, 2, 6)
    pre = dict(qw1=t(B, T, G, R, M), qw2=t(B, T, G, R, M), kdd=t(B, T, G, M))
    post = dict(kw1=t(B, T, G, R, M), kw2=t(B, T, G, R, M), static=t(G, M, M))
    mask = torch.tensor(rng.random((B, 1, T, T)) > 0.3).to(torch.int32)   # rank 4, integer
    kw = dict(num_groups=G, pre=pre, post=post, attention_mask=mask, use_causal_mask=True,
              sliding_window=4, query_offset=0, return_attention_scores=True,
              query_chunk_size=2)
    o_ops, ex_ops = dops.dcmha_attention(q, k, v, implementation="ops", **kw)
    o_t, ex_t = dops.dcmha_attention(q, k, v, implementation="torch", **kw)
    assert o_t.dtype == torch.float32 and o_t.shape == o_ops.shape
    torch.testing.assert_close(o_t, o_ops, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ex_t["attention_scores"], ex_ops["attention_scores"], rtol=1e-5,
                               atol=1e-6)


LAYER_CONFIGS = {
    "dcmha": dict(num_heads=4, key_dim=8),
    "all_switches": dict(num_heads=4, key_dim=8, num_key_value_heads=2, num_groups=2,
                         static_compose=True, qk_norm=True, rope_max_wavelength=100.0,
                         use_bias=True, value_dim=6, sliding_window=3),
    "key_wise_rank1": dict(num_heads=4, key_dim=8, query_wise=False, rank=1),
    "post_only_gating": dict(num_heads=4, key_dim=8, pre_compose=False,
                             dynamic_projection=False),
    "mqa_groups4_query_chunks": dict(num_heads=4, key_dim=8, num_key_value_heads=1,
                                     num_groups=4, query_chunk_size=3),
}


def _layer(kwargs, implementation, params):
    from dcmha.layers import DCMHA
    layer = DCMHA(**kwargs, implementation=implementation)
    layer.load_spec_weights(params)
    return layer


def _grads(layer, x, **call_kwargs):
    """Output, scores and the gradients of sum(y * dy) + sum(scores) w.r.t. x and every weight."""
    xt = torch.tensor(x, requires_grad=True)
    y, scores = layer(xt, xt, return_attention_scores=True, **call_kwargs)
    dy = torch.tensor(np.random.default_rng(0).normal(size=tuple(y.shape)), dtype=y.dtype)
    loss = (y * dy).sum() + (scores * scores).sum()
    weights = [w.value for w in layer.trainable_weights]
    grads = torch.autograd.grad(loss, [xt] + weights)
    return [y, scores] + list(grads)


@pytest.mark.parametrize("name", sorted(LAYER_CONFIGS))
def test_layer_matches_ops(reference_case, rng, name):
    kwargs = LAYER_CONFIGS[name]
    case = reference_case(kwargs, T=7)
    mask = rng.random((2, 7, 7)) > 0.3
    mask[1, 2] = False                                  # a fully masked row
    results = [_grads(_layer(kwargs, impl, case["params"]), case["query"], attention_mask=mask,
                      use_causal_mask=True) for impl in ("ops", "torch")]
    for i, (a, b) in enumerate(zip(*results)):
        scale = max(1.0, float(a.detach().abs().max()))
        torch.testing.assert_close(b, a, rtol=1e-5, atol=2e-5 * scale, msg=f"result {i}")
    np.testing.assert_array_equal(results[1][0].detach().numpy()[1, 2], 0.0)


def test_layer_decode_with_cache_matches_ops(reference_case):
    kwargs = dict(num_heads=4, key_dim=8, num_key_value_heads=2, sliding_window=4)
    case = reference_case(kwargs, T=9)
    x = case["query"]
    outs = {}
    for impl in ("ops", "torch"):
        layer = _layer(kwargs, impl, case["params"])
        cache = layer.init_cache(2, 9)
        y0, cache = layer(x[:, :5], x[:, :5], use_causal_mask=True, cache=cache,
                          cache_update_index=0)
        steps = [y0]
        for i in range(5, 9):
            y, cache = layer(x[:, i:i + 1], x[:, i:i + 1], use_causal_mask=True, cache=cache,
                             cache_update_index=torch.tensor(i))
            steps.append(y)
        outs[impl] = torch.cat(steps, dim=1)
    torch.testing.assert_close(outs["torch"], outs["ops"], rtol=1e-5, atol=1e-5)


def test_layer_auto_takes_the_torch_path_for_large_problems(chosen):
    from dcmha.layers import DCMHA
    layer = DCMHA(num_heads=2, key_dim=4)
    x = np.random.default_rng(1).normal(size=(1, 96, 8)).astype("float32")
    layer(x, x, use_causal_mask=True)
    layer(x[:, :8], x[:, :8])
    assert chosen[-2] in ("torch", "triton") and chosen[-1] == "ops"
    # dropout while training is not supported: auto keeps the ops core
    layer = DCMHA(num_heads=2, key_dim=4, dropout=0.5, seed=1)
    layer(x, x, training=True)
    assert chosen[-1] == "ops"


def test_a_torchscript_trace_never_keeps_the_kernels_empty_buffer(chosen):
    """The compiled kernel fills a preallocated buffer through ctypes, which a trace cannot
    record. No TorchScript trace keeps that buffer: ``"auto"`` takes the "ops" core for a
    traced call (its sizes are unknown), a forced ``"torch"`` refuses it, and the block
    Function itself is one node of a trace, which runs it again eagerly. Each traced function
    on new inputs gives the eager result."""
    from dcmha import ops as dops
    rng = np.random.default_rng(19)
    B, T, N, d = 1, 128, 4, 8                   # T * S = 16384: eager "auto" takes "torch"

    def inputs():
        t = lambda *s: torch.tensor(rng.normal(size=s), dtype=torch.float32)  # noqa: E731
        return t(B, T, N, d), t(B, T, N, d), t(B, T, N, d), t(B, T, 1, N)

    def trace(fn, example):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")       # the tracer's notes on Python values
            return torch.jit.trace(fn, example, check_trace=False)

    def layer_core(implementation):
        def fn(q, k, v, kdd):
            return dops.dcmha_attention(q, k, v, num_groups=1, pre={"kdd": kdd},
                                        use_causal_mask=True, implementation=implementation)[0]
        return fn

    example, new = inputs(), inputs()
    auto = layer_core("auto")
    want = auto(*new)
    assert chosen[-1] == "torch"
    traced = trace(auto, example)
    assert chosen[-1] == "ops"
    torch.testing.assert_close(traced(*new), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="needs static sizes, which are unknown in this traced"):
        trace(layer_core("torch"), example)
    # The Function in a trace, as if its sizes were known: one node, run again eagerly.
    _, pb = dcmha_torch._check(*example[:3], 1, {"kdd": example[3]}, None, None, True, None,
                               None, 0, None)

    def core(q, k, v, kdd):
        stages = dcmha_torch._prepare_stage({"kdd": kdd}, pb) + (None,) * 4
        return dcmha_torch._DCMHAFunction.apply(pb, False, None, q, k, v, *stages)

    torch.testing.assert_close(trace(core, example)(*new), core(*new), rtol=0, atol=0)


def test_meta_tensors_give_the_plain_core_shapes():
    from dcmha import ops as dops
    q, k = torch.empty(2, 96, 4, 8, device="meta"), torch.empty(2, 96, 2, 8, device="meta")
    kw = torch.empty(2, 96, 1, 2, 4, device="meta")
    o, extras = dops.dcmha_attention(q, k, k, num_groups=1, pre={"kw1": kw, "kw2": kw},
                                     use_causal_mask=True, return_attention_scores=True,
                                     implementation="torch")
    assert tuple(o.shape) == (2, 96, 4, 8)
    assert tuple(extras["attention_scores"].shape) == (2, 4, 96, 96)
