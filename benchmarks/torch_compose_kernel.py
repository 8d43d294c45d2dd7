"""The torch fused core with and without its compiled compose kernel, vs PyTorch SDPA.

Times ``dcmha.backends.torch_native.dcmha_attention`` (forward under no_grad, and
forward + backward of mean(o ** 2)) in three settings, alternating, medians:

* ``kernel``: every compose term (pre and post, query- and key-wise, projection and
  gating), the compose run by the compiled C kernel (``cpu_kernel``);
* ``torch-ops``: the same with ``DCMHA_CPU_KERNEL=0`` (the plain PyTorch ops);
* ``no-compose``: no compose terms (the blocked core alone);

and ``torch.nn.functional.scaled_dot_product_attention`` at the same shape.

    python benchmarks/torch_compose_kernel.py --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import torch
    from dcmha.backends import cpu_kernel
    from dcmha.backends.torch_native import dcmha_torch

    B, T, N, d, G, R = args.batch, args.length, args.heads, args.head_dim, 1, 2
    M = N // G
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).requires_grad_()

    q, k, v = (leaf(B, T, N, d) for _ in range(3))

    def stage():
        return {"qw1": leaf(B, T, G, R, M, scale=0.3), "qw2": leaf(B, T, G, R, M, scale=0.3),
                "kw1": leaf(B, T, G, R, M, scale=0.3), "kw2": leaf(B, T, G, R, M, scale=0.3),
                "qdd": leaf(B, T, G, M, scale=0.3), "kdd": leaf(B, T, G, M, scale=0.3)}

    pre, post = stage(), stage()

    def dcmha(terms):
        def run():
            return dcmha_torch.dcmha_attention(q, k, v, num_groups=G, pre=pre if terms else None,
                                               post=post if terms else None,
                                               causal=True)
        return run

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)

    settings = [("kernel", "1", dcmha(True)), ("torch-ops", "0", dcmha(True)),
                ("no-compose", "1", dcmha(False)), ("sdpa", "1", sdpa)]

    def timed(fn, grad):
        t = time.perf_counter()
        if grad:
            fn().square().mean().backward()
        else:
            with torch.no_grad():
                fn()
        return (time.perf_counter() - t) * 1e3

    times = {}
    for rep in range(args.repeats + 1):           # the first round warms up
        for name, env, fn in settings:
            os.environ["DCMHA_CPU_KERNEL"] = env
            cpu_kernel._reset()
            for what, grad in (("forward", False), ("step", True)):
                ms = timed(fn, grad)
                if rep:
                    times.setdefault((name, what), []).append(ms)
    print(f"B={B} T={T} N={N} d={d} causal float32, medians of {args.repeats} "
          f"(kernel: {cpu_kernel.unavailable_reason() or 'loaded'})")
    print(f"{'setting':<12} {'forward ms':>11} {'fwd+bwd ms':>11}")
    for name, _, _ in settings:
        f = statistics.median(times[(name, "forward")])
        s = statistics.median(times[(name, "step")])
        print(f"{name:<12} {f:>11.1f} {s:>11.1f}")


if __name__ == "__main__":
    main()
