"""The fused DCMHA core against the vendor's flash attention, forward + backward, on a GPU.

For the Keras backend's framework (``--backend torch``: the Triton kernels against PyTorch
SDPA with the flash / cuDNN kernels; ``--backend jax``: the Pallas kernels against
``jax.nn.dot_product_attention(implementation="cudnn")``) times one forward + backward
(gradients w.r.t. q, k, v and, for DCMHA, every compose term) at the paper's shapes:
B*T = 8k and 32k tokens, N = 16 and 32 heads, d = 128, bfloat16, causal and causal with a
sliding window. DCMHA runs every compose term in both stages, R = 2, groups of M = 8 heads.
Each figure is the median of ``--repeats`` timed steps after one untimed (compiling) step;
throughput counts the FLOPs of the plain attention (forward 4 * B * N * T * K * d with K
the mean number of visible keys, forward + backward 3.5x that), so DCMHA's ratio to the
vendor is its share of the vendor's throughput at equal attention work.

    python benchmarks/gpu_timings.py --backend torch --json core_torch.json
    python benchmarks/gpu_timings.py --backend jax --dry-run      # CPU: interpreters, tiny

``--dry-run`` runs the same code on the CPU at tiny shapes (Triton's interpreter, Pallas
interpret mode, the vendors' CPU attention), to show the script works before GPU time is
spent; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

#: (B, T, N): 8k and 32k tokens, 16 and 32 heads.
PAPER_SHAPES = ((2, 4096, 16), (2, 4096, 32), (8, 4096, 16), (8, 4096, 32))
DRY_SHAPES = ((1, 32, 4),)
WINDOW, DRY_WINDOW = 1024, 8
GROUP_HEADS, RANK, HEAD_DIM = 8, 2, 128


def flops(B, T, N, d, window) -> float:
    """Forward + backward FLOPs of causal attention (with a window: W keys at most)."""
    keys = sum(min(t + 1, window or T) for t in range(T)) / T
    return 3.5 * 4 * B * N * T * keys * d


def _median_ms(step, sync, repeats) -> float:
    step()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _term_shapes(B, T, G, M, R):
    return dict(qw1=(B, T, G, R, M), qw2=(B, T, G, R, M), kw1=(B, T, G, R, M),
                kw2=(B, T, G, R, M), qdd=(B, T, G, M), kdd=(B, T, G, M), static=(G, M, M))


def torch_rows(shapes, d, window, repeats, dry):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dcmha.backends.triton import dcmha_triton

    dev = "cpu" if dry else "cuda"
    sync = (lambda: None) if dry else torch.cuda.synchronize
    dt = torch.bfloat16
    rows = []
    for B, T, N in shapes:
        M = min(GROUP_HEADS, N)
        G = N // M
        gen = torch.Generator(device=dev).manual_seed(0)

        def rand(*shape, scale=1.0):
            x = torch.randn(shape, generator=gen, device=dev, dtype=torch.float32) * scale
            return x.to(dt).requires_grad_(True)

        q, k, v, do = rand(B, T, N, d), rand(B, T, N, d), rand(B, T, N, d), rand(B, T, N, d)
        stages = [{n: rand(*s, scale=0.3) for n, s in _term_shapes(B, T, G, M, RANK).items()}
                  for _ in range(2)]
        leaves = [q, k, v] + [x for st in stages for x in st.values()]
        for w in (None, window):
            def dcmha():
                o = dcmha_triton.dcmha_attention(q, k, v, num_groups=G, pre=stages[0],
                                                 post=stages[1], causal=True, sliding_window=w)
                torch.autograd.grad(o, leaves, do)

            qh, kh, vh, doh = (x.detach().transpose(1, 2).requires_grad_(True)
                               for x in (q, k, v, do))
            band = None
            if w is not None:
                t = torch.arange(T, device=dev)
                band = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < w)
            backends = ([SDPBackend.MATH] if dry else
                        [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION] if band is None
                        else [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])

            def vendor():
                with sdpa_kernel(backends):
                    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=band,
                                                       is_causal=band is None)
                torch.autograd.grad(o, (qh, kh, vh), doh)

            rows.append(_row("torch", B, T, N, d, w, G,
                             _median_ms(dcmha, sync, repeats), _median_ms(vendor, sync, repeats),
                             "sdpa " + "/".join(b.name.lower() for b in backends)))
            print(_text(rows[-1]), flush=True)
    return rows


def jax_rows(shapes, d, window, repeats, dry):
    import jax
    import jax.numpy as jnp

    from dcmha.backends import pallas as pb

    rows = []
    for B, T, N in shapes:
        M = min(GROUP_HEADS, N)
        G = N // M
        keys = iter(jax.random.split(jax.random.key(0), 20))

        def rand(*shape, scale=1.0):
            return (jax.random.normal(next(keys), shape) * scale).astype(jnp.bfloat16)

        q, k, v, do = rand(B, T, N, d), rand(B, T, N, d), rand(B, T, N, d), rand(B, T, N, d)
        stages = [{n: rand(*s, scale=0.3) for n, s in _term_shapes(B, T, G, M, RANK).items()}
                  for _ in range(2)]
        for w in (None, window):
            def dcmha_loss(q, k, v, pre, post, w=w):
                o = pb.dcmha_attention(q, k, v, num_groups=G, pre=pre, post=post, causal=True,
                                       sliding_window=w, interpret=dry)
                return jnp.sum(o.astype(jnp.float32) * do)

            def vendor_loss(q, k, v, w=w):
                o = jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, implementation="xla" if dry else "cudnn",
                    local_window_size=None if w is None else (w - 1, 0))
                return jnp.sum(o.astype(jnp.float32) * do)

            f = jax.jit(jax.grad(dcmha_loss, argnums=(0, 1, 2, 3, 4)))
            g = jax.jit(jax.grad(vendor_loss, argnums=(0, 1, 2)))
            out = {}

            def dcmha():
                out["x"] = f(q, k, v, stages[0], stages[1])

            def vendor():
                out["x"] = g(q, k, v)

            def sync():
                jax.block_until_ready(out["x"])

            rows.append(_row("jax", B, T, N, d, w, G, _median_ms(dcmha, sync, repeats),
                             _median_ms(vendor, sync, repeats),
                             "jax.nn.dot_product_attention " + ("xla" if dry else "cudnn")))
            print(_text(rows[-1]), flush=True)
    return rows


def _row(backend, B, T, N, d, window, G, dcmha_ms, vendor_ms, vendor):
    f = flops(B, T, N, d, window)
    return dict(backend=backend, B=B, T=T, N=N, d=d, G=G, window=window, dtype="bfloat16",
                dcmha_ms=round(dcmha_ms, 3), vendor_ms=round(vendor_ms, 3), vendor=vendor,
                dcmha_tflops=round(f / dcmha_ms / 1e9, 2),
                vendor_tflops=round(f / vendor_ms / 1e9, 2),
                ratio=round(vendor_ms / dcmha_ms, 3))


def _text(r) -> str:
    return (f"{r['backend']:5s} B={r['B']} T={r['T']} N={r['N']} d={r['d']} "
            f"window={r['window']}: dcmha {r['dcmha_ms']:.2f} ms ({r['dcmha_tflops']} TFLOP/s), "
            f"{r['vendor']} {r['vendor_ms']:.2f} ms ({r['vendor_tflops']} TFLOP/s), "
            f"dcmha / vendor throughput {r['ratio']:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("torch", "jax"), required=True)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, interpreters, tiny shapes (the timings mean nothing)")
    ap.add_argument("--shapes", default=None,
                    help="B:T:N,... (default: the paper's shapes, or tiny with --dry-run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.dry_run and args.backend == "torch":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before Triton is first imported
    shapes = (tuple(tuple(int(x) for x in s.split(":")) for s in args.shapes.split(","))
              if args.shapes else DRY_SHAPES if args.dry_run else PAPER_SHAPES)
    d = 16 if args.dry_run else HEAD_DIM
    window = DRY_WINDOW if args.dry_run else WINDOW
    run = torch_rows if args.backend == "torch" else jax_rows
    rows = run(shapes, d, window, 1 if args.dry_run else args.repeats, args.dry_run)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(section="core", dry_run=args.dry_run, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
