"""What ``benchmarks/compile_time.py`` reads from ptxas (no GPU needed).

A tiny Triton kernel is compiled to an sm_90 cubin in a child process (Triton loaded
compiled, ``TRITON_INTERPRET`` unset) inside ``compile_time.Compiles``, which keeps the
``ptxas -v`` log Triton prints; the registers and stack bytes ``parse_ptxas`` reads from it
are checked against ``cuobjdump --dump-resource-usage`` of the same cubin (the triton
package ships both tools), and the occupancy rule of ``benchmarks/gpu_kernel_resources.py``
against the H100 limits it names.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="needs Triton (its ptxas and cuobjdump)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

_CHILD = r"""
import json, os, re, subprocess, sys, tempfile
sys.path.insert(0, sys.argv[1])
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

import compile_time


@triton.jit
def tiny(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(y_ptr + i, tl.exp(x) * x, mask=i < n)


src = triton.compiler.ASTSource(
    fn=tiny, signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
    constexprs={"BLOCK": 256})
with compile_time.Compiles() as c:
    kern = triton.compile(src, target=GPUTarget("cuda", compile_time.ARCH, 32),
                          options=dict(num_warps=2))
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "tiny.cubin")
    with open(path, "wb") as f:
        f.write(kern.asm["cubin"])
    usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", path],
                           capture_output=True, text=True, check=True).stdout
found = dict((k, int(v)) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", usage))
print(json.dumps(dict(ptxas=c.ptxas, resources=compile_time.resources(kern, c.ptxas),
                      name=kern.metadata.name, cuobjdump=found)))
"""


def test_ptxas_report_matches_the_cubin(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KERAS_BACKEND")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")   # compiled here, not found in a cache
    child = tmp_path / "tiny_kernel.py"                  # Triton reads a kernel's source file
    child.write_text(_CHILD)
    out = subprocess.run([sys.executable, str(child), os.path.join(ROOT, "benchmarks")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(got["ptxas"]) == [got["name"]]
    report, res, cubin = got["ptxas"][got["name"]], got["resources"], got["cuobjdump"]
    assert report["registers"] == cubin["REG"] > 0
    assert report["stack_bytes"] == cubin["STACK"]
    assert report["ptxas_smem"] == cubin["SHARED"]
    assert res["num_warps"] == 2
    assert res["registers"] == report["registers"]
    assert res["spill_stores"] == report["spill_stores"]


def test_occupancy_limits():
    import gpu_kernel_resources as g

    h = g.H100
    # 255 registers round to 8192 per warp: 8 warps per SM, one block of 8 warps.
    per_warp = -(-32 * 255 // h["reg_unit"]) * h["reg_unit"]
    occ = g.occupancy(255, 8, 0)
    assert occ["blocks"] == (h["regs_per_sm"] // per_warp) // 8
    assert occ["limit"] == "registers"
    assert occ["occupancy"] == occ["blocks"] * 8 / h["warps_per_sm"]
    # More shared memory than a block may have: it does not launch.
    assert g.occupancy(32, 4, h["smem_per_block"] + 1)["blocks"] == 0
    # Shared memory as the limit.
    share = h["smem_per_sm"] // 3
    occ = g.occupancy(32, 4, share)
    assert occ["limit"] == "shared"
    assert occ["blocks"] == h["smem_per_sm"] // (share + h["smem_reserved_per_block"])
