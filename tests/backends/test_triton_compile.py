"""Which calls share a compiled Triton kernel (no GPU, nothing compiled).

The Triton kernels compile once per tile configuration, dtype and set of compose terms:
lengths, offsets, window sizes and head counts are runtime values. Checked in a child
process with Triton loaded compiled (``TRITON_INTERPRET`` unset) under
``dcmha.backends.triton.offline.compile_only`` (an sm_90 target), with Triton's
``jit_cache_hook`` recording each launch's cache key and skipping the compile.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the Triton backend needs PyTorch")
pytest.importorskip("triton", reason="the Triton backend needs Triton")

_CHILD = r"""
import json, sys
import torch
import triton
from dcmha.backends import torch_common
from dcmha.backends.triton import dcmha_triton, offline

keys = []

def hook(*, key, fn, **_):
    keys.append((fn.name, str(key)))
    return True                        # skip the compile: the key is all this test needs

triton.knobs.runtime.jit_cache_hook = hook

def launch_keys(T, S, *, N=4, G=2, R=2, window=5, offset=0, blocks=(16, 16)):
    del keys[:]
    B, d, M = 1, 32, N // G
    x = lambda *s: torch.zeros(s, requires_grad=True)
    terms = dict(qw1=x(B, T, G, R, M), qw2=x(B, T, G, R, M), kw1=x(B, S, G, R, M),
                 kw2=x(B, S, G, R, M), qdd=x(B, T, G, M), kdd=x(B, S, G, M), static=x(G, M, M))
    call = torch_common.check_call(x(B, T, N, d), x(B, S, N, d), x(B, S, N, d), num_groups=G,
                                   pre=terms, post=terms, causal=True, sliding_window=window,
                                   query_offset=offset)
    with offline.compile_only():
        o = dcmha_triton.dcmha_attention_call(call, block_sizes=dcmha_triton.BlockSizes(*blocks))
        o.backward(torch.zeros_like(o))
    return list(keys)

print(json.dumps(dict(
    base=launch_keys(48, 48),
    other_lengths=launch_keys(300, 333, window=7, offset=33),
    other_heads=launch_keys(48, 48, N=2, G=1),
    other_tiles=launch_keys(48, 48, blocks=(32, 16)),
)))
"""


def test_one_compiled_kernel_per_tile_configuration():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KERAS_BACKEND")}
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    keys = json.loads(out.stdout.strip().splitlines()[-1])
    names = [name for name, _ in keys["base"]]
    assert names == ["_fwd_kernel", "_bwd_query_kernel", "_bwd_key_kernel"], names
    # Other lengths, window size and offset; other head counts and groups (the same padded
    # M): the same three kernels, so the first call's compiles serve them.
    assert keys["other_lengths"] == keys["base"]
    assert keys["other_heads"] == keys["base"]
    # Other tiles: three other kernels.
    other = keys["other_tiles"]
    assert [name for name, _ in other] == names
    assert all(a != b for a, b in zip(other, keys["base"]))
