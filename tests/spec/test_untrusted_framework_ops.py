"""Crafted calls of the compiled ops of XLA (jax.ffi handlers, xla_ffi.cc) and
TensorFlow (tf_op.cc) (the compose, a block's probabilities, a stage's query factor):
arrays whose sizes do not fit x or the attributes, as a hand-built call could pass them. Each must fail with the op's own error, never read past a buffer; each
framework runs in a child process, so that a crash shows as a failed case.
"""

import json
import os
import subprocess
import sys

import pytest

#: (name, op, {argument: shape}, attributes, the message the refusal must contain). x is
#: (B, G, M, t, s) = (1, 2, 2, 3, 4): wq (B, t, G, M, M) = 24 floats, kw1 / kw2 (B, G, R, M, s)
#: = 16 R, kdd (B, G, M, s) = 16.
COMPOSE = [
    ("wq_short", {"x": (1, 2, 2, 3, 4), "wq": (5,), "kw1": (1,), "kw2": (1,), "kdd": (1,)},
     1, "wq must be (B, t, G, M, M)"),
    ("kw_short", {"x": (1, 2, 2, 3, 4), "wq": (1,), "kw1": (1, 2, 1, 2, 3),
                  "kw2": (1, 2, 1, 2, 3), "kdd": (1,)}, 2, "kw1 and kw2 must be"),
    ("kw2_short", {"x": (1, 2, 2, 3, 4), "wq": (1,), "kw1": (1, 2, 1, 2, 4), "kw2": (4,),
                   "kdd": (1,)}, 2, "kw1 and kw2 must be"),
    ("kdd_short", {"x": (1, 2, 2, 3, 4), "wq": (1,), "kw1": (1,), "kw2": (1,), "kdd": (3,)},
     4, "kdd must be (B, G, M, s)"),
    ("x_rank", {"x": (2, 3, 4), "wq": (1,), "kw1": (1,), "kw2": (1,), "kdd": (1,)}, 0,
     "(B, G, M, t, s)"),
]

#: Both children: run a call, print whether it ran or was refused (and the message).
REPORT = r"""
import json

def report(name, fn):
    try:
        fn()
        row = {"case": name, "status": "ran", "message": ""}
    except Exception as err:
        row = {"case": name, "status": "refused", "message": str(err)[:2000]}
    print(json.dumps(row), flush=True)
"""

JAX_CHILD = REPORT + r"""
import json, sys
import jax, jax.numpy as jnp, jaxlib, numpy as np
from dcmha.backends import cpu_kernel

lib, why = cpu_kernel.build_library(cpu_kernel.ffi_recipe(jax.ffi.include_dir(),
                                                          jaxlib.__version__))
if lib is None:
    print(json.dumps({"skip": why}))
    sys.exit(0)
for n, fn in (("probe_forward", lib.DcmhaComposeForward), ("probe_probs", lib.DcmhaDecodeProbs),
              ("probe_block", lib.DcmhaBlockProbsForward),
              ("probe_block_backward", lib.DcmhaBlockProbsBackward),
              ("probe_query", lib.DcmhaQueryMatrix),
              ("probe_query_backward", lib.DcmhaQueryMatrixBackward)):
    jax.ffi.register_ffi_target(n, jax.ffi.pycapsule(fn), platform="cpu")
cases = json.loads(sys.argv[1])

z = lambda shape: jnp.zeros(shape, jnp.float32)
for name, arrays, flags, _ in cases:
    out = jax.ShapeDtypeStruct(tuple(arrays["x"]), jnp.float32)
    call = jax.ffi.ffi_call("probe_forward", out)
    report(name, lambda: jax.block_until_ready(call(
        *(z(arrays[k]) for k in ("x", "wq", "kw1", "kw2", "kdd")), flags=np.int64(flags))))
# the result declared smaller than x
report("out_short", lambda: jax.block_until_ready(jax.ffi.ffi_call(
    "probe_forward", jax.ShapeDtypeStruct((2,), jnp.float32))(
        z((1, 2, 2, 3, 4)), z((24,)), z((1,)), z((1,)), z((1,)), flags=np.int64(1))))
# DecodeProbs: x (B, G, M, S) = (1, 2, 2, 5); the pre stage's qw1, qw2 (rank 3) need 24 floats
# kw stacks kw1, kw2 of each stage with them (B, S, 2 per stage, G, R, M); kd (B, S, n, G, M)
def probs(query, kw, mask, pre_flags, has_mask=0, kd=(1,), post_flags=0):
    out = jax.ShapeDtypeStruct((1, 2, 2, 5), jnp.float32)
    return jax.block_until_ready(jax.ffi.ffi_call("probe_probs", out)(
        z((1, 2, 2, 5)), jnp.ones(mask, bool), z(query), z(kw), z(kd),
        pre_flags=np.int64(pre_flags), post_flags=np.int64(post_flags), pre_rank=np.int64(3),
        post_rank=np.int64(1), has_mask=np.int64(has_mask), masked=np.float32(-1e30)))
report("probs_query_short", lambda: probs((10,), (1,), (1,), 8))
report("probs_kw_short", lambda: probs((1,), (1, 5, 2, 2, 1, 1), (1,), 2))
# room for one stage's kw1 and kw2 where both stages have them
report("probs_kw_one_stage", lambda: probs((1,), (1, 5, 2, 2, 1, 2), (1,), 2, post_flags=2))
report("probs_kd_short", lambda: probs((1,), (1,), (1,), 4, kd=(1, 5, 1, 2, 1)))
report("probs_mask_shape", lambda: probs((1,), (1,), (1, 7, 5), 0, has_mask=1))
# BlockProbs: x (B, G, M, t, s) = (1, 2, 2, 3, 4); the pre stage's wq is 24 floats
X = (1, 2, 2, 3, 4)
def block(pre_wq, post_flags, vis, has_vis, pre_flags=1, outs=(X, X)):
    d = z((1,))
    shapes = tuple(jax.ShapeDtypeStruct(o, jnp.float32) for o in outs)
    return jax.block_until_ready(jax.ffi.ffi_call("probe_block", shapes)(
        z(X), z(pre_wq), d, d, d, z((5,)), d, d, d, jnp.ones(vis, bool),
        pre_flags=np.int64(pre_flags), post_flags=np.int64(post_flags),
        has_vis=np.int64(has_vis), masked=np.float32(-1e30)))
report("block_no_stage", lambda: block((24,), 0, (1,), 0, pre_flags=0))
report("block_pre_wq_short", lambda: block((23,), 0, (1,), 0))
report("block_post_wq_short", lambda: block((24,), 1, (1,), 0))
report("block_vis_shape", lambda: block((24,), 0, (1, 3, 5), 1))
report("block_p_short", lambda: block((24,), 0, (1,), 0, outs=(X, (7,))))
def block_backward(dpre_wq):
    d = z((1,))
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32)
              for s in (X, dpre_wq, (1,), (1,), (1,), (1,), (1,), (1,), (1,))]
    return jax.block_until_ready(jax.ffi.ffi_call("probe_block_backward", shapes)(
        z(X), z(X), z(X), z((24,)), d, d, d, d, d, d, d, jnp.ones((1,), bool),
        pre_flags=np.int64(1), post_flags=np.int64(0), has_vis=np.int64(0),
        masked=np.float32(-1e30)))
report("block_grad_short", lambda: block_backward((3,)))
# QueryMatrix: wq (B, T, G, M, M) = (1, 3, 2, 2, 2); qw1, qw2 (B, T, G, R, M) = 12 R floats
def query(qw1, qdd, flags, wq=(1, 3, 2, 2, 2)):
    return jax.block_until_ready(jax.ffi.ffi_call(
        "probe_query", jax.ShapeDtypeStruct(wq, jnp.float32))(
            z(qw1), z(qw1), z(qdd), z((1,)), flags=np.int64(flags)))
report("query_qw_short", lambda: query((1, 3, 2, 2, 1), (1,), 8))
report("query_qdd_short", lambda: query((1,), (5,), 16))
report("query_wq_not_square", lambda: query((1,), (12,), 16, wq=(1, 3, 2, 2, 3)))
report("query_grad_short", lambda: jax.block_until_ready(jax.ffi.ffi_call(
    "probe_query_backward", [jax.ShapeDtypeStruct(s, jnp.float32)
                             for s in ((1,), (1,), (3,), (1,))])(
        z((1,)), z((1,)), z((1, 3, 2, 2)), z((1,)), z((1, 3, 2, 2, 2)), flags=np.int64(16))))
"""

JAX_EXTRA = {"out_short": "the result and g must have x's shape",
             "probs_query_short": "query-side terms are shorter",
             "probs_kw_short": "kw must be (B, S, 2 per stage with kw1, G, R, M)",
             "probs_kw_one_stage": "kw must be (B, S, 2 per stage with kw1, G, R, M)",
             "probs_kd_short": "kd must be (B, S, 1 per stage with kdd, G, M)",
             "probs_mask_shape": "mask must be (B|1, N|1, S|1)",
             "block_no_stage": "at least one stage must have a term",
             "block_pre_wq_short": "wq must be (B, t, G, M, M)",
             "block_post_wq_short": "wq must be (B, t, G, M, M)",
             "block_vis_shape": "vis must be (1|B, t, s)",
             "block_p_short": "the result and g must have x's shape",
             "block_grad_short": "each term's gradient must have the term's shape",
             "query_qw_short": "qw1 and qw2 must be (B, T, G, R, M)",
             "query_qdd_short": "qdd must be (B, T, G, M)",
             "query_wq_not_square": "wq must be (B, T, G, M, M)",
             "query_grad_short": "each term's gradient must have the term's shape"}

TF_CHILD = REPORT + r"""
import json, sys
import numpy as np
import tensorflow as tf
from dcmha.backends import cpu_kernel

recipe = cpu_kernel.tf_recipe(tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags(),
                              tf.__version__)
path, why = cpu_kernel.build_library(recipe, load=False)
if path is None:
    print(json.dumps({"skip": why}))
    sys.exit(0)
module = tf.load_op_library(path)
cases = json.loads(sys.argv[1])

z = lambda shape: tf.zeros(shape, tf.float32)
for name, arrays, flags, _ in cases:
    report(name, lambda: module.dcmha_compose_forward(
        *(z(arrays[k]) for k in ("x", "wq", "kw1", "kw2", "kdd")), flags=flags))
report("backward_g_short", lambda: module.dcmha_compose_backward(
    z((1, 2, 2, 3, 4)), z((3,)), z((24,)), z((1,)), z((1,)), z((1,)), flags=1))
dyn = dict(c=1, gc=2, k=3, rank=1, m=2, has_projection=1, has_gating=1, gelu_approximate=0,
           eps=1e-6)
report("dynamic_dw1_short", lambda: module.dcmha_dynamic_weights(
    z((2, 4)), z((5,)), z((2, 3, 2, 1, 2)), z((4, 4)), **dyn))
report("dynamic_dd_short", lambda: module.dcmha_dynamic_weights(
    z((2, 4)), z((4, 6)), z((2, 3, 2, 1, 2)), z((3,)), **dyn))
report("dynamic_attrs_huge", lambda: module.dcmha_dynamic_weights(
    z((2, 4)), z((4, 6)), z((2, 3, 2, 1, 2)), z((4, 4)), **{**dyn, "k": 2**40}))
# BlockProbs: x (B, G, M, t, s) = (1, 2, 2, 3, 4); the pre stage's wq is 24 floats
X = (1, 2, 2, 3, 4)
block_attrs = lambda pre, post, has_vis: dict(pre_flags=pre, post_flags=post, has_vis=has_vis,
                                              masked=-1e30)
def block(pre_wq, post_flags, vis, has_vis, pre_flags=1):
    d = z((1,))
    return module.dcmha_block_probs_forward(z(X), z(pre_wq), d, d, d, z((5,)), d, d, d,
                                            tf.ones(vis, tf.bool),
                                            **block_attrs(pre_flags, post_flags, has_vis))
report("block_no_stage", lambda: block((24,), 0, (1,), 0, pre_flags=0))
report("block_pre_wq_short", lambda: block((23,), 0, (1,), 0))
report("block_post_wq_short", lambda: block((24,), 1, (1,), 0))
report("block_vis_shape", lambda: block((24,), 0, (1, 3, 5), 1))
report("block_backward_g_short", lambda: module.dcmha_block_probs_backward(
    z(X), z(X), z((7,)), z((24,)), *(z((1,)),) * 7, tf.ones((1,), tf.bool),
    **block_attrs(1, 0, 0)))
# QueryMatrix: wq (B, T, G, M, M) = (1, 3, 2, 2, 2); qw1, qw2 (B, T, G, R, M) = 12 R floats
def query(qw1, qdd, flags, shape=(1, 3, 2, 2, 2)):
    return module.dcmha_query_matrix(z(qw1), z(qw1), z(qdd), z((1,)), flags=flags,
                                     shape=list(shape))
report("query_qw_short", lambda: query((1, 3, 2, 2, 1), (1,), 8))
report("query_qdd_short", lambda: query((1,), (5,), 16))
report("query_wq_not_square", lambda: query((1,), (12,), 16, shape=(1, 3, 2, 2, 3)))
"""

TF_EXTRA = {"backward_g_short": "g must have x's shape",
            "dynamic_dw1_short": "dcmha dynamic weights: need",
            "dynamic_dd_short": "dcmha dynamic weights: need",
            "dynamic_attrs_huge": "dcmha dynamic weights: need",
            "block_no_stage": "at least one stage must have a term",
            "block_pre_wq_short": "wq must be (B, t, G, M, M)",
            "block_post_wq_short": "wq must be (B, t, G, M, M)",
            "block_vis_shape": "vis must be (1|B, t, s)",
            "block_backward_g_short": "the result and g must have x's shape",
            "query_qw_short": "qw1 and qw2 must be (B, T, G, R, M)",
            "query_qdd_short": "qdd must be (B, T, G, M)",
            "query_wq_not_square": "wq must be (B, T, G, M, M)"}


def _run(child, framework):
    pytest.importorskip(framework)
    proc = subprocess.run([sys.executable, "-c", child, json.dumps(COMPOSE)],
                          capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"})
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if rows and "skip" in rows[0]:
        pytest.skip(f"the {framework} ops cannot be built here: {rows[0]['skip']}")
    return proc, {r["case"]: r for r in rows}


@pytest.fixture(scope="module")
def jax_results():
    return _run(JAX_CHILD, "jax")


@pytest.fixture(scope="module")
def tf_results():
    return _run(TF_CHILD, "tensorflow")


def _check(results, name, message):
    proc, found = results
    assert name in found, (f"the child died before {name} (return code {proc.returncode}, a "
                           f"negative one is the signal): {proc.stderr[-3000:]}")
    assert found[name]["status"] == "refused", found[name]
    assert message in found[name]["message"], found[name]


EXPECTED = {name: message for name, _, _, message in COMPOSE}


@pytest.mark.parametrize("name", sorted({**EXPECTED, **JAX_EXTRA}))
def test_xla_ffi_call_with_misfit_arrays_fails(jax_results, name):
    _check(jax_results, name, {**EXPECTED, **JAX_EXTRA}[name])


@pytest.mark.parametrize("name", sorted({**EXPECTED, **TF_EXTRA}))
def test_tensorflow_op_with_misfit_arrays_fails(tf_results, name):
    _check(tf_results, name, {**EXPECTED, **TF_EXTRA}[name])


def test_children_exit_cleanly(jax_results, tf_results):
    for proc, _ in (jax_results, tf_results):
        assert proc.returncode == 0, proc.stderr[-3000:]
