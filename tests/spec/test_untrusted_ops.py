"""Crafted one-node graphs against the compiled onnxruntime ops (backends/csrc/ort_op.cc):
offsets and head counts chosen so that a check written as a sum (t0 + T <= rows) would
overflow int64 and pass. Each must fail with the op's own error status, never read outside
its buffers. They run in a child process, so that a crash shows as a failed case and its
return code, not as a dead test run.
"""

import json
import os
import subprocess
import sys

import pytest

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

I64_MAX = 2**63 - 1

#: name -> (op, [(input, "f32" | "f64" | "i64", value: a shape to fill, or an int64 scalar
#: or vector)], outputs, the message the refusal must contain)
CASES = {
    # a query block's rows [t0, t0 + T) of wq's rows: t0 = 2**63 - T wraps t0 + T around
    "probs_t0_wraps_small": ("ProbsQ_", [("x", "f32", (1, 4, 4, 4)), ("bias", "f32", (1, 1, 4, 4)),
                                         ("t0", "i64", 2**63 - 4), ("s0", "i64", 0),
                                         ("wq", "f32", (1, 1, 8, 4, 4))], ["out"],
                             "input wq must have shape"),
    "probs_t0_wraps_large": ("ProbsQ_", [("x", "f32", (1, 64, 4096, 1)),
                                         ("bias", "f32", (1, 1, 4096, 1)),
                                         ("t0", "i64", 2**63 - 4096), ("s0", "i64", 0),
                                         ("wq", "f32", (1, 64, 4097, 1, 1))], ["out"],
                             "input wq must have shape"),
    "probs_t0_past_rows": ("ProbsQ_", [("x", "f32", (1, 4, 4, 4)), ("bias", "f32", (1, 1, 4, 4)),
                                       ("t0", "i64", 5), ("s0", "i64", 0),
                                       ("wq", "f32", (1, 1, 8, 4, 4))], ["out"],
                           "input wq must have shape"),
    # the keys [s0, s0 + S) of kw1 / kw2's S_all: s0 = 2**63 - S
    "probs_s0_wraps": ("ProbsK_", [("x", "f32", (1, 2, 3, 4)), ("bias", "f32", (1, 1, 3, 4)),
                                   ("t0", "i64", 0), ("s0", "i64", 2**63 - 4),
                                   ("kw1", "f32", (1, 6, 1, 1, 2)),
                                   ("kw2", "f32", (1, 6, 1, 1, 2))], ["out"],
                       "input kw1 must have shape"),
    "probs_s0_wraps_post": ("Probs_D", [("x", "f32", (1, 2, 3, 4)), ("bias", "f32", (1, 1, 3, 4)),
                                        ("t0", "i64", 0), ("s0", "i64", I64_MAX),
                                        ("kdd", "f32", (1, 6, 1, 2))], ["out"],
                            "input kdd must have shape"),
    "probs_negative_t0": ("ProbsQ_", [("x", "f32", (1, 4, 4, 4)), ("bias", "f32", (1, 1, 4, 4)),
                                      ("t0", "i64", -2**63), ("s0", "i64", 0),
                                      ("wq", "f32", (1, 1, 8, 4, 4))], ["out"],
                          "need t0 >= 0 and s0 >= 0"),
    # RopeHeads' head counts: (N + N_kv) d wraps around for N_kv = 2**62 - 1, d = 4
    "rope_heads_count_wraps": ("RopeHeads", [("y", "f32", (1, 2, 16)), ("positions", "i64", [0, 1]),
                                             ("inv_freq", "f64", (2,)),
                                             ("heads", "i64", [1, 2**62 - 1])], ["q", "k"],
                               "dcmha RopeHeads: need"),
    "rope_heads_sum_wraps": ("RopeHeads", [("y", "f32", (1, 2, 16)), ("positions", "i64", [0, 1]),
                                           ("inv_freq", "f64", (2,)),
                                           ("heads", "i64", [I64_MAX, I64_MAX])], ["q", "k"],
                             "dcmha RopeHeads: need"),
    "cache_heads_stop_max": ("CacheHeads", [("cache", "f32", (1, 9, 2, 4)), ("start", "i64", 3),
                                            ("stop", "i64", I64_MAX)], ["out"],
                             "CacheHeads: need 0 <= start < stop <= 9"),
}

CHILD = r"""
import json, sys
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

library, cases = sys.argv[1], json.loads(sys.argv[2])
TYPES = {"f32": (TensorProto.FLOAT, np.float32), "f64": (TensorProto.DOUBLE, np.float64),
         "i64": (TensorProto.INT64, np.int64)}
for name, (op, inputs, outputs, _) in cases.items():
    feeds, infos = {}, []
    for n, kind, value in inputs:
        proto, dtype = TYPES[kind]
        if kind == "i64":
            feeds[n] = np.array(value, dtype)
        else:
            feeds[n] = np.random.default_rng(0).standard_normal(value).astype(dtype)
        infos.append(helper.make_tensor_value_info(n, proto, list(feeds[n].shape)))
    out_type = TensorProto.FLOAT
    node = helper.make_node(op, [n for n, _, _ in inputs], outputs, domain="dcmha")
    graph = helper.make_graph([node], name, infos,
                              [helper.make_tensor_value_info(o, out_type, None) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("dcmha", 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.register_custom_ops_library(library)
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    try:
        got = sess.run(None, feeds)
        row = {"case": name, "status": "ran", "message": str([a.shape for a in got])}
    except Exception as err:
        row = {"case": name, "status": "refused", "message": str(err)[:2000]}
    print(json.dumps(row), flush=True)
"""


@pytest.fixture(scope="module")
def results():
    from dcmha.backends import cpu_kernel

    lib, why = cpu_kernel.build_library(cpu_kernel.ort_recipe(ort.__version__))
    if lib is None:
        pytest.skip(f"the onnxruntime ops cannot be built here: {why}")
    proc = subprocess.run([sys.executable, "-c", CHILD, lib._name, json.dumps(CASES)],
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"})
    found = {}
    for line in proc.stdout.splitlines():
        row = json.loads(line)
        found[row["case"]] = row
    return proc, found


@pytest.mark.parametrize("name", sorted(CASES))
def test_crafted_graph_gets_an_error_status(results, name):
    proc, found = results
    assert name in found, (f"the child died before {name} (return code {proc.returncode}, a "
                           f"negative one is the signal): {proc.stderr[-3000:]}")
    assert found[name]["status"] == "refused", found[name]
    assert CASES[name][3] in found[name]["message"], found[name]


def test_child_exits_cleanly(results):
    proc, found = results
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(found) == sorted(CASES)
