"""Compile time of the fused GPU kernels, measured on a CPU (no GPU needed).

Compiles every Triton kernel (the PyTorch path, ``dcmha.backends.triton``) and every Pallas
kernel (the JAX path, ``dcmha.backends.pallas``) that the GPU test cases launch
(``tests/kernel_cases.GPU_CASES``: forward with the attention scores, then the backward) to
an sm_90 cubin with the ``triton`` package, and prints the seconds per kernel and case with
the conditions (CPU, cores, load, versions).

* Triton: the host code of the call runs on CPU tensors of the case's shapes and each launch
  goes through the kernel's own ``warmup`` (the compile a first launch does) under a
  stand-in driver that answers "CUDA, sm_90" (``dcmha.backends.triton.offline``): the same
  specialisation, cache key and compile pipeline as on a GPU. A kernel the in-process cache
  already holds costs nothing and shows as ``cached``.
* Pallas: the forward and backward are exported for CUDA (``jax.export``), which traces the
  kernels and lowers each to Triton IR; each IR is then compiled to a cubin with
  ``triton.compile`` (num_warps / num_stages as the kernels ask). A kernel's time is its
  tracing + lowering + cubin compile. On a GPU jaxlib hands the same IR to XLA's Triton.

Each case and path runs in a fresh process with Triton's on-disk cache in a fresh temporary
directory, so nothing is reused between cases or runs; a case past ``--timeout`` seconds is
reported as not done, with the CPU time it used. Seconds are wall time; ``cpu_s`` is the CPU
time (the process's own plus its children's, e.g. ptxas), which other load on the machine
disturbs less: on an idle machine the two agree, as the compiles run one at a time.

    python benchmarks/compile_time.py                       # both paths, every case
    python benchmarks/compile_time.py --paths triton --cases d128 --json out.json
    python benchmarks/compile_time.py --shapes paper        # the benchmark shapes instead
    python benchmarks/compile_time.py --shapes heads        # M = 16 and 32 heads per group

Every compiled kernel's row also carries what ptxas reports for it (``ptxas -v``, which
Triton runs for every cubin: registers per thread, spill stores / loads and stack bytes),
the shared memory Triton allots it and its warps; ``benchmarks/gpu_kernel_resources.py``
derives occupancy and arithmetic bounds from them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

#: The compile target: an H100 / H200 (sm_90), 32 threads per warp.
ARCH = 90

#: The shapes of ``--shapes``, besides the test cases: name -> [(case id, sizes, call
#: arguments)], bfloat16, every compose term in both stages, the kernels' default tiles.
#: "paper": d = 128, benchmarks/gpu_timings.py's (N = 16 heads in G = 2 groups, M = 8);
#: "heads": d = 128 and the paper's heads per group, M = 16 and 32 (one group; N = M), causal;
#: "d64": head dim 64 (the paper's 405M model: 16 heads of 64), M = 8 and 16, causal.
SHAPES = {
    "paper": [(f"paper_{name}", dict(B=2, T=4096, S=4096, N=16, N_kv=16, d=128, d_v=128,
                                     G=2, R=2), call)
              for name, call in (("causal", dict(causal=True)),
                                 ("window", dict(causal=True, sliding_window=256)))],
    "heads": [(f"heads_m{M}", dict(B=2, T=4096, S=4096, N=M, N_kv=M, d=128, d_v=128, G=1,
                                   R=2), dict(causal=True))
              for M in (16, 32)],
    "d64": [(f"d64_m{M}", dict(B=2, T=4096, S=4096, N=M, N_kv=M, d=64, d_v=64, G=1, R=2),
             dict(causal=True))
            for M in (8, 16)],
}


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Clock:
    """Wall and CPU seconds of a block: ``with Clock() as c: ...; c.wall, c.cpu``."""

    def __enter__(self):
        self._wall, self._cpu = time.perf_counter(), _cpu_seconds()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self._wall
        self.cpu = _cpu_seconds() - self._cpu


def conditions() -> dict:
    import importlib.metadata as md

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    versions = {}
    for name in ("triton", "torch", "jax", "jaxlib"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[name] = md.version(name)
    return dict(cpu=cpu, cores=os.cpu_count(), load_1min=round(os.getloadavg()[0], 2),
                python=platform.python_version(), target=f"cuda sm_{ARCH}", **versions)


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_FUNCTION = re.compile(r"Function properties for (\S+)")
_PTXAS_FIELDS = {
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "registers": re.compile(r"Used (\d+) registers"),
    "ptxas_smem": re.compile(r"(\d+) bytes smem"),
}


def parse_ptxas(text: str) -> dict:
    """{entry function: {registers, spill_stores, spill_loads, stack_bytes, ptxas_smem}} from
    the output of ``ptxas -v`` (one or more entry functions; a field ptxas leaves out is 0).
    ``ptxas_smem`` is the static shared memory only (Triton allots it dynamically)."""
    out, name = {}, None
    for line in text.splitlines():
        entry = _PTXAS_ENTRY.search(line)
        if entry:
            name = entry.group(1)
            out[name] = dict.fromkeys(_PTXAS_FIELDS, 0)
            continue
        function = _PTXAS_FUNCTION.search(line)
        if function:   # the lines after it are of that function: an entry or a callee
            name = function.group(1) if function.group(1) in out else None
            continue
        if name is None:
            continue
        for field, pattern in _PTXAS_FIELDS.items():
            found = pattern.search(line)
            if found:
                out[name][field] = int(found.group(1))
    return out


class Compiles(Clock):
    """``Clock`` that also keeps what ptxas reports for the kernels compiled in the block
    (``.ptxas``: ``parse_ptxas`` of it). Triton prints the ptxas log while its
    ``dump_ptxas_log`` knob is on; the block turns it on and keeps the printed text."""

    def __enter__(self):
        import triton

        self._knob = triton.knobs.nvidia.dump_ptxas_log
        triton.knobs.nvidia.dump_ptxas_log = True
        self._text = io.StringIO()
        self._redirect = contextlib.redirect_stdout(self._text)
        self._redirect.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        import triton

        super().__exit__(*exc)
        self._redirect.__exit__(*exc)
        triton.knobs.nvidia.dump_ptxas_log = self._knob
        text = self._text.getvalue()
        if exc[0] is not None:   # what Triton printed about the failure
            sys.stderr.write(text)
        self.ptxas = parse_ptxas(text)


def resources(compiled, ptxas: dict) -> dict:
    """The row fields of one compiled kernel (a ``triton.compiler.CompiledKernel``): its
    warps, stages and shared memory, and what ptxas reported for it."""
    md = compiled.metadata
    return dict(num_warps=md.num_warps, num_stages=md.num_stages, shared=md.shared,
                **ptxas.get(md.name, {}))


def cases(which: str, select):
    """(id, problem sizes, call arguments, tiles, dtype, mask shape or None, pre, post)."""
    import kernel_cases

    out = []
    if which == "tests":
        for cid, problem, mask, call, tiles in kernel_cases.GPU_CASES:
            sizes = {**kernel_cases.GPU_SIZES, **problem}
            sizes.pop("seed")
            out.append(dict(id=cid, sizes=sizes, call=call, tiles=tiles,
                            dtype=sizes.pop("dtype", "float32"),
                            mask=None if mask is None else mask.shape,
                            pre=sizes.pop("pre", kernel_cases.TERMS),
                            post=sizes.pop("post", kernel_cases.TERMS)))
    else:
        for cid, sizes, call in SHAPES[which]:
            out.append(dict(id=cid, sizes=dict(sizes), call=call, tiles=None,
                            dtype="bfloat16", mask=None, pre=kernel_cases.TERMS,
                            post=kernel_cases.TERMS))
    return [c for c in out if not select or any(s in c["id"] for s in select)]


# ---------------------------------------------------------------------------
# Triton (PyTorch)
# ---------------------------------------------------------------------------

def _triton_compile_case(case, torch):
    """Drive one forward (with scores) and backward of the case through the Triton host code
    on CPU tensors of its shapes, every launch compiling only; returns the launch log."""
    from dcmha.backends import torch_common
    from dcmha.backends.triton import dcmha_triton, offline
    from dcmha.spec import terms as spec_terms

    z = case["sizes"]
    dt = {"float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16}[case["dtype"]]
    B, T, S, N, N_kv, d, d_v, G, R = (z[k] for k in ("B", "T", "S", "N", "N_kv", "d", "d_v",
                                                     "G", "R"))
    sizes = dict(B=B, T=T, S=S, G=G, R=R, M=N // G)

    def zeros(*shape, dtype=dt):
        return torch.zeros(shape, dtype=dtype, requires_grad=dtype != torch.bool)

    def stage(names):
        return None if names is None else {
            n: zeros(*spec_terms.term_shape(n, sizes)) for n in names}

    q, k, v = zeros(B, T, N, d), zeros(B, S, N_kv, d), zeros(B, S, N_kv, d_v)
    mask = None if case["mask"] is None else zeros(*case["mask"], dtype=torch.bool)
    call = torch_common.check_call(q, k, v, num_groups=G, pre=stage(case["pre"]),
                                   post=stage(case["post"]), mask=mask,
                                   return_attention_scores=True, **case["call"])
    tiles = case["tiles"]
    blocks = None if tiles is None else dcmha_triton.BlockSizes(tiles[0], tiles[1])
    with offline.compile_only(ARCH, measure=Compiles) as log:
        o, _ = dcmha_triton.dcmha_attention_call(call, block_sizes=blocks)
        o.backward(torch.zeros_like(o))
    # The compiled kernels, per kernel in the order of their compiles (the launches not
    # cached), from the kernels' in-process caches.
    compiled = {fn.__name__: list(fn.device_caches[0][0].values())
                for fn in (dcmha_triton._fwd_kernel, dcmha_triton._bwd_query_kernel,
                           dcmha_triton._bwd_key_kernel)}
    return [(name, c, cached, None if cached else compiled[name].pop(0))
            for name, c, cached in log]


def triton_rows(selected):
    import torch

    rows = []
    for case in selected:
        for kernel, c, cached, kern in _triton_compile_case(case, torch):
            rows.append(dict(path="triton", case=case["id"], kernel=kernel,
                             seconds=round(c.wall, 2), cpu_s=round(c.cpu, 2), cached=cached,
                             **({} if kern is None else resources(kern, c.ptxas))))
            print(_row_text(rows[-1]), flush=True)
    return rows


# ---------------------------------------------------------------------------
# Pallas (JAX)
# ---------------------------------------------------------------------------

def pallas_rows(selected):
    import jax
    import jax.numpy as jnp
    import triton
    from jax import export
    from jax._src.pallas.triton import lowering
    from jax.experimental import pallas as pl_module
    from triton.backends.compiler import GPUTarget

    from dcmha.backends import pallas as pb

    rows = []
    for case in selected:
        z = case["sizes"]
        B, T, S, N, N_kv, d, d_v, G, R = (z[k] for k in ("B", "T", "S", "N", "N_kv", "d", "d_v",
                                                         "G", "R"))
        M = N // G
        dt = jnp.dtype(case["dtype"])

        def sd(*shape, dtype=dt):
            return jax.ShapeDtypeStruct(shape, dtype)

        shapes = dict(qw1=sd(B, T, G, R, M), qw2=sd(B, T, G, R, M), kw1=sd(B, S, G, R, M),
                      kw2=sd(B, S, G, R, M), qdd=sd(B, T, G, M), kdd=sd(B, S, G, M),
                      static=sd(G, M, M))

        def stage(names):
            return None if names is None else {n: shapes[n] for n in names}

        tiles = case["tiles"]
        blocks = pb.BlockSizes() if tiles is None else pb.BlockSizes(*tiles)
        has_mask = case["mask"] is not None

        def f(q, k, v, pre, post, mask, do, dsc):
            def attn(q, k, v, pre, post):
                return pb.dcmha_attention(q, k, v, num_groups=G, pre=pre, post=post,
                                          mask=mask if has_mask else None,
                                          return_attention_scores=True, block_sizes=blocks,
                                          interpret=False, **case["call"])
            out, vjp = jax.vjp(attn, q, k, v, pre, post)
            return out, vjp((do, dsc))

        # Per kernel: its tracing (the pallas_call), its lowering to Triton IR, its cubin.
        traced, lowered = [], []
        real_call, real_lower = pl_module.pallas_call, lowering.lower_jaxpr_to_triton_module

        def timed_call(*args, name=None, compiler_params=None, **kwargs):
            inner = real_call(*args, name=name, compiler_params=compiler_params, **kwargs)

            def run(*a):
                with Clock() as c:
                    out = inner(*a)
                traced.append((name, c, compiler_params))
                return out
            return run

        def timed_lower(*args, **kwargs):
            with Clock() as c:
                result = real_lower(*args, **kwargs)
            lowered.append((c, result.module.operation.get_asm(enable_debug_info=False)))
            return result

        pl_module.pallas_call, lowering.lower_jaxpr_to_triton_module = timed_call, timed_lower
        try:
            mask_sd = sd(B, T, S, dtype=jnp.bool_) if has_mask else sd(1, dtype=jnp.bool_)
            export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
                export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
                sd(B, T, N, d), sd(B, S, N_kv, d), sd(B, S, N_kv, d_v), stage(case["pre"]),
                stage(case["post"]), mask_sd, sd(B, T, N, d_v), sd(B, N, T, S))
        finally:
            pl_module.pallas_call, lowering.lower_jaxpr_to_triton_module = real_call, real_lower
        if len(traced) != len(lowered):
            raise RuntimeError(f"{len(traced)} pallas_calls traced but {len(lowered)} lowered")
        with tempfile.TemporaryDirectory() as tmp:
            for i, ((name, trace, params), (lower, text)) in enumerate(zip(traced, lowered)):
                path = os.path.join(tmp, f"kernel{i}.ttir")
                with open(path, "w") as fh:
                    fh.write(text)
                options = dict(num_warps=getattr(params, "num_warps", None) or 4,
                               num_stages=getattr(params, "num_stages", None) or 3)
                with Compiles() as c:
                    kern = triton.compile(path, target=GPUTarget("cuda", ARCH, 32),
                                          options=options)
                rows.append(dict(path="pallas", case=case["id"], kernel=name,
                                 seconds=round(trace.wall + lower.wall + c.wall, 2),
                                 cpu_s=round(trace.cpu + lower.cpu + c.cpu, 2),
                                 trace_s=round(trace.wall, 2), lower_s=round(lower.wall, 2),
                                 cubin_s=round(c.wall, 2), cached=False,
                                 **resources(kern, c.ptxas)))
                print(_row_text(rows[-1]), flush=True)
    return rows


# ---------------------------------------------------------------------------

def _row_text(r) -> str:
    what = "cached (compiled earlier in this run)" if r["cached"] else (
        f"{r['seconds']:7.2f} s  cpu {r['cpu_s']:7.2f} s")
    parts = "".join(f"  {k[:-2]} {r[k]:.2f}" for k in ("trace_s", "lower_s", "cubin_s")
                    if k in r)
    if "registers" in r:
        parts += (f"  regs {r['registers']} spill {r['spill_stores']}/{r['spill_loads']} B"
                  f"  smem {r['shared']} B  warps {r['num_warps']}")
    return f"{r['path']:7s} {r['case']:40s} {r['kernel']:22s} {what}{parts}"


def _worker(path: str, case_id: str, shapes: str, timeout: float) -> list:
    """Rows of one case on one path, compiled in a fresh process with a fresh Triton cache;
    a case past ``timeout`` seconds gives one row with ``timed_out``."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, JAX_PLATFORMS="cpu")
        env.pop("TRITON_INTERPRET", None)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, "--shapes", shapes,
               "--cases", case_id]
        rows, t0 = [], time.perf_counter()
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        kids0 = kids.ru_utime + kids.ru_stime
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as proc:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                kids = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = kids.ru_utime + kids.ru_stime - kids0
                print(f"{path:7s} {case_id:40s} not done after {timeout:.0f} s "
                      f"(cpu {cpu:.1f} s, all its kernels)", flush=True)
                return [dict(path=path, case=case_id, kernel="(all)", timed_out=True,
                             seconds=round(time.perf_counter() - t0, 1), cpu_s=round(cpu, 1),
                             cached=False)]
        for line in out.splitlines():
            if line.startswith("ROWS "):
                rows = json.loads(line[5:])
            else:
                print(line, flush=True)
        if proc.returncode:
            raise RuntimeError(f"{path} {case_id}: worker failed (rc={proc.returncode})")
        return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="triton,pallas", help="triton, pallas or both")
    ap.add_argument("--cases", default="", help="comma-separated substrings of case ids")
    ap.add_argument("--shapes", choices=("tests", *SHAPES), default="tests")
    ap.add_argument("--timeout", type=float, default=600,
                    help="seconds per case and path before it is reported as not done")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    selected = cases(args.shapes, [s for s in args.cases.split(",") if s])
    if not selected:
        ap.error(f"--cases {args.cases!r} selects no case")
    if args.worker:
        selected = [c for c in selected if c["id"] == args.cases]
        rows = (triton_rows if args.worker == "triton" else pallas_rows)(selected)
        print("ROWS " + json.dumps(rows))
        return 0
    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - {"triton", "pallas"}
    if unknown:
        ap.error(f"--paths takes triton and/or pallas. Received: {sorted(unknown)}")
    cond = conditions()
    print("conditions:", json.dumps(cond), flush=True)
    rows = []
    for path in paths:
        for case in selected:
            rows += _worker(path, case["id"], args.shapes, args.timeout)
    compiled = [r for r in rows if not r["cached"] and not r.get("timed_out")]
    late = [r for r in rows if r.get("timed_out")]
    if compiled:
        worst = max(compiled, key=lambda r: r["seconds"])
        print(f"slowest: {worst['path']} {worst['case']} {worst['kernel']} {worst['seconds']} s "
              f"(cpu {worst['cpu_s']} s); kernels compiled: {len(compiled)}")
    for r in late:
        print(f"not done within {args.timeout:.0f} s: {r['path']} {r['case']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(conditions=cond, timeout_s=args.timeout, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
