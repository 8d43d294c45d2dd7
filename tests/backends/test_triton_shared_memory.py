"""The Triton path's shared-memory rule (no GPU needed).

A program of the fused kernels holds the tiles of all heads of a composition group, so at
many heads per group and large head dims a kernel asks for more shared memory per block
than a GPU gives (``benchmarks/RESULTS.md``, "The kernels on paper"), and Triton would
refuse the launch. ``dcmha_triton.shared_memory`` compiles the kernels a call launches
and reads what each asks for; ``over_shared_memory`` says why they cannot launch under a
limit, and the registry's rule (``core.unsupported``) applies it on a GPU so that "auto"
passes over Triton there. Checked in a child process with Triton loaded compiled under
``dcmha.backends.triton.offline.compile_only`` (an sm_90 target).
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the Triton backend needs PyTorch")
pytest.importorskip("triton", reason="the Triton backend needs Triton")

_CHILD = r"""
import dataclasses, json, types
import torch
from dcmha.backends import torch_common
from dcmha.backends.triton import core, dcmha_triton, offline

B, T, S, N, G, R, d = 1, 40, 40, 4, 2, 2, 32
M = N // G
x = lambda *s: torch.zeros(s, requires_grad=True)
pre = dict(qw1=x(B, T, G, R, M), qw2=x(B, T, G, R, M), kdd=x(B, S, G, M), static=x(G, M, M))
call = torch_common.check_call(x(B, T, N, d), x(B, S, N, d), x(B, S, N, d), num_groups=G,
                               pre=pre, post=dict(qdd=x(B, T, G, M)), causal=True)
with offline.compile_only() as log:
    fwd = dcmha_triton.shared_memory(call, backward=False)
    both = dcmha_triton.shared_memory(call, backward=True)
    o = dcmha_triton.dcmha_attention_call(call)
    o.backward(torch.zeros_like(o))
    cached = [hit for _, _, hit in log]
    limit = min(both.values()) - 1
    over = dcmha_triton.over_shared_memory(call, limit, backward=True)
    fits = dcmha_triton.over_shared_memory(call, max(both.values()), backward=True)
    # The registry's rule for the same call with q on a GPU (the limit the GPU's).
    core._shared_memory_limit = lambda device: limit
    gpu_q = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float32,
                                  requires_grad=True)
    rule = core.unsupported(dataclasses.replace(call, q=gpu_q))
    with torch.no_grad():
        rule_no_grad = core.unsupported(dataclasses.replace(call, q=gpu_q))
print(json.dumps(dict(fwd=fwd, both=both, cached=cached, limit=limit, over=over, fits=fits,
                      rule=rule, rule_no_grad=rule_no_grad)))
"""


@pytest.fixture(scope="module")
def child():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KERAS_BACKEND")}
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_shared_memory_of_each_kernel_a_call_launches(child):
    kernels = ["_fwd_kernel", "_bwd_query_kernel", "_bwd_key_kernel"]
    assert list(child["fwd"]) == kernels[:1]
    assert list(child["both"]) == kernels
    assert child["fwd"]["_fwd_kernel"] == child["both"]["_fwd_kernel"]
    assert all(n > 0 for n in child["both"].values())
    # The call's own launches found every kernel the check compiled: nothing twice.
    assert child["cached"] == [True, True, True]


def test_over_shared_memory_names_each_kernel_over_the_limit(child):
    asks = ", ".join(f"{name} {n}" for name, n in child["both"].items())
    expected = (f"its kernels ask for more shared memory per block (bytes: {asks}) than the "
                f"GPU gives one ({child['limit']}): a program holds the tiles of all M = 2 "
                "heads of a composition group at head dims 32 / 32")
    assert child["over"] == expected
    assert child["fits"] is None


def test_registry_rule_on_a_gpu_checks_the_kernels_that_will_run(child):
    assert child["rule"] == child["over"]
    # Without autograd recording only the forward runs; it asks for more than the limit.
    n = child["both"]["_fwd_kernel"]
    assert child["rule_no_grad"] == (
        f"its kernels ask for more shared memory per block (bytes: _fwd_kernel {n}) than the "
        f"GPU gives one ({child['limit']}): a program holds the tiles of all M = 2 heads of a "
        "composition group at head dims 32 / 32")
