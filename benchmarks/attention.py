"""DCMHA attention per implementation vs keras.layers.MultiHeadAttention: time and memory.

For the Keras backend that KERAS_BACKEND selects, times one layer's forward and
training step (forward + backward w.r.t. the input and every weight, compiled
the backend's default way: see ``layer_step.py``, whose step functions this
script reuses) for Keras MHA and for DCMHA with each implementation that can
run here, all alternating in one process (medians), and prints the ratios to
MHA. Peak memory is measured per implementation in a fresh child process: the
resident-set high-water mark (VmHWM) gained by one call on CPU, the device's
peak allocation on CUDA.

On CUDA it also times the attention cores alone (the fused kernel of the
backend vs PyTorch SDPA with the flash kernel, or
``jax.nn.dot_product_attention(implementation="cudnn")``) at B=4, T=4096 (``--core-length``),
N=32, d=128, bfloat16, causal, for each tile size of ``--core-blocks``, and reports TFLOP/s counted as for plain causal
attention (forward 2 * 2 * B * N * T^2 * d / 2 FLOPs, forward + backward 3.5x
that), so the figures compare directly with FlashAttention's.

    KERAS_BACKEND=torch python benchmarks/attention.py --json attention_torch.json
    KERAS_BACKEND=jax python benchmarks/attention.py --implementations auto,ops
    KERAS_BACKEND=torch python benchmarks/attention.py --gpu-core-only      # on a GPU

Implementations tried by default: "auto", "ops" and the backend's fast paths
that can run here without an interpreter ("triton" and "pallas" need a GPU;
``--interpret`` adds them in interpret mode, which is only a correctness
check and slow).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from layer_step import _alternate, make_forward, make_step  # noqa: E402

FAST_PATHS = {"torch": ("triton", "torch"), "jax": ("pallas",), "tensorflow": ("xla",),
              "numpy": ()}
GPU_ONLY = ("triton", "pallas")


def _on_gpu(backend: str) -> bool:
    if backend == "torch":
        import torch
        return torch.cuda.is_available()
    if backend == "jax":
        import jax
        return jax.default_backend() == "gpu"
    if backend == "tensorflow":
        import tensorflow as tf
        return bool(tf.config.list_logical_devices("GPU"))
    return False


def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def _device_peak(backend: str):
    """Peak device bytes so far (CUDA), or None on CPU."""
    if backend == "torch":
        import torch
        return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    if backend == "jax":
        import jax
        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("peak_bytes_in_use")
    return None


def build_layer(name: str, args):
    import keras
    import dcmha

    N, D = args.heads, args.dim
    if name == "mha":
        return keras.layers.MultiHeadAttention(num_heads=N, key_dim=D // N, use_bias=False,
                                               seed=0)
    return dcmha.DCMHA(num_heads=N, key_dim=D // N, num_groups=args.groups,
                       implementation=name, seed=0)


def memory_child(args) -> None:
    """One call of one layer (forward or training step); prints the memory it took."""
    import keras

    backend = keras.backend.backend()
    x = np.random.default_rng(0).standard_normal((args.batch, args.length, args.dim))
    x = x.astype("float32")
    layer = build_layer(args._memory_child, args)
    layer(x[:, :8], x[:, :8])
    fn = (make_forward if args._mode == "forward" else make_step)(layer, x)
    before_host, before_dev = _vm_hwm_bytes(), _device_peak(backend)
    fn()
    after_host, after_dev = _vm_hwm_bytes(), _device_peak(backend)
    print(json.dumps({"host_peak_gain_mib": (after_host - before_host) / 2 ** 20,
                      "host_peak_mib": after_host / 2 ** 20,
                      "device_peak_mib": None if after_dev is None else after_dev / 2 ** 20}))


def measure_memory(name: str, mode: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_memory-child", name, "--_mode", mode,
           "--batch", str(args.batch), "--length", str(args.length), "--dim", str(args.dim),
           "--heads", str(args.heads), "--groups", str(args.groups)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else
                f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def candidates(backend: str, args) -> list:
    if args.implementations:
        return [n.strip() for n in args.implementations.split(",") if n.strip()]
    gpu = _on_gpu(backend)
    names = ["auto", "ops"]
    for name in FAST_PATHS.get(backend, ()):
        if name in GPU_ONLY and not (gpu or args.interpret):
            continue
        names.append(name)
    return names


def layer_section(args) -> dict:
    import keras

    backend = keras.backend.backend()
    B, T, D = args.batch, args.length, args.dim
    x = np.random.default_rng(0).standard_normal((B, T, D)).astype("float32")
    names = ["mha"] + candidates(backend, args)
    steps, forwards, skipped = {}, {}, {}
    for name in names:
        try:
            layer = build_layer(name, args)
            layer(x[:, :8], x[:, :8])
            steps[name], forwards[name] = make_step(layer, x), make_forward(layer, x)
            for _ in range(args.warmup):
                steps[name]()
                forwards[name]()
        except Exception as e:          # a fast path that cannot run this call here
            skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            steps.pop(name, None)
            forwards.pop(name, None)
    step_t, _ = _alternate(steps, args.repeats)
    fwd_t, _ = _alternate(forwards, args.repeats)
    rows = []
    for name in steps:
        row = {"implementation": name,
               "forward_ms": 1e3 * statistics.median(fwd_t[name]),
               "train_step_ms": 1e3 * statistics.median(step_t[name])}
        rows.append(row)
    base = {k: next(r[k] for r in rows if r["implementation"] == "mha")
            for k in ("forward_ms", "train_step_ms")}
    for row in rows:
        row["forward_ratio"] = row["forward_ms"] / base["forward_ms"]
        row["train_step_ratio"] = row["train_step_ms"] / base["train_step_ms"]
        if not args.no_memory:
            for mode in ("forward", "step"):
                row[f"{mode}_memory"] = measure_memory(row["implementation"], mode, args)
    return {"backend": backend, "batch": B, "length": T, "dim": D, "heads": args.heads,
            "groups": args.groups, "repeats": args.repeats, "rows": rows, "skipped": skipped}


def _mem(m) -> str:
    if not m:
        return "-"
    if "error" in m:
        return "error"
    if m.get("device_peak_mib") is not None:
        return f"{m['device_peak_mib']:.0f} MiB dev"
    return f"+{m['host_peak_gain_mib']:.0f} MiB"


def print_layer_section(res: dict) -> None:
    print(f"{res['backend']}: one layer, B={res['batch']} T={res['length']} D={res['dim']} "
          f"N={res['heads']} G={res['groups']}, causal, float32; medians of {res['repeats']}, "
          "alternating")
    print(f"{'implementation':<15} {'forward ms':>10} {'ratio':>6} {'step ms':>9} {'ratio':>6} "
          f"{'fwd memory':>14} {'step memory':>14}")
    for r in res["rows"]:
        print(f"{r['implementation']:<15} {r['forward_ms']:>10.1f} {r['forward_ratio']:>6.2f} "
              f"{r['train_step_ms']:>9.1f} {r['train_step_ratio']:>6.2f} "
              f"{_mem(r.get('forward_memory')):>14} {_mem(r.get('step_memory')):>14}")
    for name, why in res["skipped"].items():
        print(f"{name:<15} skipped: {why}")


def _median_time(fn, sync, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        sync(fn())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def gpu_core_section(args) -> dict:
    """Fused DCMHA core vs the vendor's flash attention, on CUDA (bfloat16, causal)."""
    import keras

    backend = keras.backend.backend()
    B, T, N, d, G, R = 4, args.core_length, 32, 128, args.groups, 2
    blocks = [tuple(int(n) for n in b.split("x")) for b in args.core_blocks.split(",")]
    M = N // G
    flops_fwd = 2 * 2 * B * N * T * T * d / 2
    rng = np.random.default_rng(0)

    def arr(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype("float32")

    host = dict(q=arr(B, T, N, d), k=arr(B, T, N, d), v=arr(B, T, N, d))
    terms = {"qw1": arr(B, T, G, R, M, scale=0.1), "qw2": arr(B, T, G, R, M, scale=0.1),
             "kw1": arr(B, T, G, R, M, scale=0.1), "kw2": arr(B, T, G, R, M, scale=0.1),
             "qdd": arr(B, T, G, M, scale=0.1), "kdd": arr(B, T, G, M, scale=0.1)}
    rows = {}
    if backend == "torch":
        import torch
        import torch.nn.functional as F
        from dcmha.backends import triton as dtriton

        dev = "cuda"
        q, k, v = (torch.tensor(host[n], device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for n in "qkv")
        pre = {n: torch.tensor(w, device=dev) for n, w in terms.items()}
        post = {n: torch.tensor(w, device=dev) for n, w in terms.items()}
        sync = lambda _: torch.cuda.synchronize()  # noqa: E731

        def fused(bq, bk):
            return lambda: dtriton.dcmha_attention(q, k, v, num_groups=G, pre=pre, post=post,
                                                   causal=True, block_q=bq, block_k=bk)

        def sdpa():
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                      v.transpose(1, 2), is_causal=True)

        def train(fn):
            def step():
                out = fn()
                out.float().square().mean().backward()
                return out
            return step
        candidates = [(f"dcmha_triton {bq}x{bk}", fused(bq, bk)) for bq, bk in blocks]
        for name, fn in candidates + [("sdpa_flash", sdpa)]:
            rows[name] = _timed_or_error(lambda fn=fn: {
                "forward_s": _median_time(fn, sync, args.repeats),
                "train_s": _median_time(train(fn), sync, args.repeats)})
    elif backend == "jax":
        import jax
        import jax.numpy as jnp
        from dcmha.backends import pallas as dpallas

        q, k, v = (jnp.asarray(host[n], dtype=jnp.bfloat16) for n in "qkv")
        pre = {n: jnp.asarray(w) for n, w in terms.items()}
        post = dict(pre)
        sync = jax.block_until_ready

        def fused(bq, bk):
            return jax.jit(lambda q, k, v: dpallas.dcmha_attention(
                q, k, v, num_groups=G, pre=pre, post=post, causal=True,
                block_sizes=dpallas.BlockSizes(bq, bk)))
        cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"))

        def grad_of(f):
            g = jax.jit(jax.grad(lambda q, k, v: jnp.mean(jnp.square(
                f(q, k, v).astype(jnp.float32))), argnums=(0, 1, 2)))
            return lambda: g(q, k, v)
        candidates = [(f"dcmha_pallas {bq}x{bk}", fused(bq, bk)) for bq, bk in blocks]
        for name, f in candidates + [("cudnn", cudnn)]:
            rows[name] = _timed_or_error(lambda f=f: {
                "forward_s": _median_time(lambda: f(q, k, v), sync, args.repeats),
                "train_s": _median_time(grad_of(f), sync, args.repeats)})
    else:
        return {"backend": backend, "skipped": "no fused CUDA kernel for this backend"}
    timed = {n: r for n, r in rows.items() if "error" not in r}
    for r in timed.values():
        r["forward_tflops"] = flops_fwd / r["forward_s"] / 1e12
        r["train_tflops"] = 3.5 * flops_fwd / r["train_s"] / 1e12
    res = {"backend": backend, "B": B, "T": T, "N": N, "d": d, "G": G, "dtype": "bfloat16",
           "rows": rows}
    vendor = list(rows)[-1]
    fused = [n for n in timed if n != vendor]
    if fused and vendor in timed:
        for key in ("forward", "train"):
            best = max(fused, key=lambda n: timed[n][f"{key}_tflops"])
            res[f"{key}_fraction_of_vendor"] = (timed[best][f"{key}_tflops"]
                                                / timed[vendor][f"{key}_tflops"])
            res[f"{key}_best_blocks"] = best
    return res


def _timed_or_error(measure) -> dict:
    """``measure()``, or {"error": ...} when a tile size does not compile or run here."""
    try:
        return measure()
    except Exception as e:      # e.g. a tile that needs more shared memory than the GPU has
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--implementations", default=None,
                    help="comma-separated DCMHA implementations (default: see the docstring)")
    ap.add_argument("--interpret", action="store_true",
                    help="also run the GPU kernels in interpret mode off-GPU")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory children")
    ap.add_argument("--gpu-core-only", action="store_true",
                    help="only the CUDA core comparison (B=4, T=--core-length, N=32, d=128, bf16)")
    ap.add_argument("--no-gpu-core", action="store_true",
                    help="on CUDA, skip the core comparison (only the layer section)")
    ap.add_argument("--core-length", type=int, default=4096,
                    help="T = S of the CUDA core comparison")
    ap.add_argument("--core-blocks", default="16x16,32x32,64x64",
                    help="tile sizes (block_q x block_k) of the fused kernel to time on CUDA")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", default=None)
    ap.add_argument("--_memory-child", dest="_memory_child", default=None,
                    help=argparse.SUPPRESS)
    ap.add_argument("--_mode", default="forward", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # as layer_step.py (see there)
    if args._memory_child:
        memory_child(args)
        return 0
    import keras

    result = {}
    if not args.gpu_core_only:
        result["layer"] = layer_section(args)
        print_layer_section(result["layer"])
    if _on_gpu(keras.backend.backend()) and not args.no_gpu_core:
        core = gpu_core_section(args)
        result["gpu_core"] = core
        for name, r in core.get("rows", {}).items():
            if "error" in r:
                print(f"{name:<20} failed: {r['error']}")
                continue
            print(f"{name:<20} forward {1e3 * r['forward_s']:8.2f} ms "
                  f"{r['forward_tflops']:6.1f} TFLOP/s   fwd+bwd {1e3 * r['train_s']:8.2f} ms "
                  f"{r['train_tflops']:6.1f} TFLOP/s")
        if "forward_fraction_of_vendor" in core:
            print(f"fused (best tiles) / vendor throughput: forward "
                  f"{core['forward_fraction_of_vendor']:.0%} ({core['forward_best_blocks']}), "
                  f"forward+backward {core['train_fraction_of_vendor']:.0%} "
                  f"({core['train_best_blocks']})")
    elif args.gpu_core_only:
        print("no GPU: the CUDA core comparison needs one")
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
