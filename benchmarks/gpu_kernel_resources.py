"""The fused GPU kernels on paper: registers, spills, shared memory and the bounds they imply.

Compiles every Triton kernel (``dcmha.backends.triton``) and every Pallas kernel
(``dcmha.backends.pallas``) at the paper's heads per group (``compile_time.SHAPES["heads"]``:
d = 128, bfloat16, M = 16 and 32, every compose term pre and post, causal, the kernels'
default tiles) to an sm_90 cubin on this CPU, with ``compile_time.py``'s workers (a fresh
process and Triton cache per case and path), and reads per kernel what ptxas reports
(registers per thread, spill stores / loads) and the shared memory and warps Triton gives
it. From these it derives, on paper (no GPU runs):

* Occupancy on an H100 (sm_90): per SM 65536 registers, 228 KiB shared memory (at most
  227 KiB per block, 1 KiB reserved per block), 64 warps, 32 blocks; registers are
  allocated per warp in units of 256. Blocks per SM = min(
  floor(floor(65536 / (ceil(32 * regs / 256) * 256)) / warps),   (registers)
  floor(228 KiB / (shared + 1 KiB)),                               (shared memory)
  floor(64 / warps), 32); occupancy = blocks * warps / 64. A block asking for more than
  227 KiB of shared memory does not launch (0 blocks).
* An arithmetic bound per (head, query, key) element of a visited tile (``model``): the
  kernel's dot FLOPs (from its passes over the tile) on the tensor cores at peak (H100 SXM
  dense: 989.4 TFLOP/s bfloat16, 494.7 TFLOP/s TF32; the kernels' float32 dots are three
  TF32 products each, ``tiles.DOT_PRECISION``), and, for the forward, its elementwise work
  (compose, mask, softmax, the Pallas head loops' one-hot selects) as FP32 lane
  instructions on the CUDA cores at peak (132 SMs x 128 lanes x 1.98 GHz; exp on the SFUs,
  16 per SM and clock), the two overlapping perfectly. The forward's rate is counted as
  FlashAttention counts it (4 d FLOPs per element: Q.K^T and P.V once) and set against
  FlashAttention-3's ~600 TFLOP/s forward at d = 128 on an H100. Peak rates, perfect
  overlap, no memory stalls and no cost for the TF32 hi/lo splits: an upper bound.

    python benchmarks/gpu_kernel_resources.py                    # compile, then the tables
    python benchmarks/gpu_kernel_resources.py --paths triton --json out.json
    python benchmarks/gpu_kernel_resources.py --rows compile.json   # rows compile_time wrote
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import compile_time  # noqa: E402

#: An H100 SXM's streaming multiprocessor (sm_90) and its peak rates.
H100 = dict(regs_per_sm=65536, reg_unit=256, smem_per_sm=228 * 1024,
            smem_per_block=227 * 1024, smem_reserved_per_block=1024, warps_per_sm=64,
            blocks_per_sm=32, sms=132, clock_hz=1.98e9, fp32_lanes=128, sfu_lanes=16,
            bf16_flops=989.4e12, tf32_flops=494.7e12)
#: FlashAttention-3's forward at d = 128 on an H100 (bfloat16), FLOP/s as it counts them.
FA3_FORWARD = 600e12
#: TF32 products per float32 dot (``tf32x3``).
TF32_PRODUCTS = 3

#: The role of each kernel: the forward, the query-block backward, the key-block backward.
ROLES = {"_fwd_kernel": "forward", "dcmha_forward": "forward",
         "_bwd_query_kernel": "backward rows", "dcmha_backward_rows": "backward rows",
         "_bwd_key_kernel": "backward cols", "dcmha_backward_cols": "backward cols"}
#: Dot FLOPs per element of a visited tile, in units of d (d = d_v), with a post stage:
#: forward: Q.K^T in both passes, P.V once; backward rows: Q.K^T and dO.V^T in the delta
#: pass and again with dQ += dA.K; backward cols: Q.K^T, dO.V^T, dV += P'^T.dO, dK += dA^T.Q.
DOTS = {"forward": 6, "backward rows": 10, "backward cols": 8}
#: FlashAttention's dots per element in the same units: forward Q.K^T, P.V; backward five.
FA_DOTS = {"forward": 4, "backward": 10}


def occupancy(registers: int, warps: int, shared: int, gpu=H100) -> dict:
    """Blocks per SM and the limit that sets it, and occupancy (resident warps / 64)."""
    per_warp = math.ceil(32 * max(registers, 1) / gpu["reg_unit"]) * gpu["reg_unit"]
    limits = dict(registers=(gpu["regs_per_sm"] // per_warp) // warps,
                  shared=(0 if shared > gpu["smem_per_block"] else
                          gpu["smem_per_sm"] // (shared + gpu["smem_reserved_per_block"])),
                  warps=gpu["warps_per_sm"] // warps, blocks=gpu["blocks_per_sm"])
    blocks = min(limits.values())
    limit = min(limits, key=limits.get)
    return dict(blocks=blocks, limit=limit, occupancy=blocks * warps / gpu["warps_per_sm"])


def tiles(path: str, M: int, d: int, d_v: int, T: int, S: int) -> dict:
    """Tile sizes (H, rows, columns) of the forward and backward programs as the host code
    fits them from the default BlockSizes (``fitted`` / ``_fitted``), and their warps."""
    H = 1 << max(0, M - 1).bit_length()
    if path == "triton":
        from dcmha.backends.triton import dcmha_triton as kt
        b = kt.fitted(kt.BlockSizes(), M, d, d_v)
        return dict(H=H, forward=(b.block_q, b.block_k), backward=(b.block_q, b.block_k),
                    warps=(b.num_warps, b.num_warps))
    from dcmha.backends.pallas import dcmha_pallas as kp
    bs, p2 = kp.BlockSizes(), kp._next_pow2
    fit = lambda blk, L: min(blk, max(16, p2(L)))  # noqa: E731  (dcmha_attention_call's)
    bq, bk = bs.backward
    blocks, warps = kp._fitted((fit(bs.block_q, T), fit(bs.block_k, S), fit(bq, T),
                                fit(bk, S)), M, max(16, p2(d)), max(16, p2(d_v)), False)
    return dict(H=H, forward=blocks[:2], backward=blocks[2:], warps=warps)


def forward_instructions(path: str, M: int, H: int, R: int, d_v: int, cols: int,
                         static: bool = True) -> dict:
    """FP32 lane instructions and exps per element of a forward tile (pre and post stages
    with every term; an FMA, a select, a compare each count 1).

    compose: static 3 per input head (one-hot select and sum of head m, FMA), low rank 3 per
    rank and side (product, head sum, FMA), gates 1 each, the scale 1; pre in both passes,
    post in the second. Mask and softmax: pass 1 about 10 (bounds, where, max, subtract,
    sum, rescale), pass 2 about 8, one exp each. Pallas loops the dots over heads and moves
    each head in and out of the (H, ...) arrays by one-hot selects: H per element for the
    scores of each pass, H for P' of head m and H * d_v / cols for the P.V accumulator.
    ``static`` False: without the static term (DCFormer++ has none)."""
    compose = 3 * M * static + 2 * 3 * R + 2 + 1
    lanes = 2 * compose + compose + 10 + 8
    if path == "pallas":
        lanes += 2 * H + H + H * d_v / cols
    return dict(lanes=lanes, exps=2)


def model(row: dict, sizes: dict, tile: dict, gpu=H100) -> dict:
    """The arithmetic bound of one kernel (see the module docstring)."""
    role = ROLES[row["kernel"]]
    d, d_v, M, R = sizes["d"], sizes["d_v"], sizes["N"] // sizes["G"], sizes["R"]
    if d != d_v:
        raise ValueError(f"The model takes d == d_v. Received: d={d}, d_v={d_v}")
    rows, cols = tile["forward"] if role == "forward" else tile["backward"]
    elements = tile["H"] * rows * cols
    dots = DOTS[role] * d
    t_tf32 = dots * TF32_PRODUCTS / gpu["tf32_flops"]
    t_bf16 = dots / gpu["bf16_flops"]
    out = dict(role=role, tile=f"{tile['H']}x{rows}x{cols}", dot_flops_per_tile=dots * elements,
               dot_flops_per_element=dots)
    if role != "forward":
        fa = FA_DOTS["backward"] * d
        # Of the backward only the dots are modelled: their share of FlashAttention's.
        out.update(dots_vs_fa=dots / fa)
        return out
    fa_flops = FA_DOTS["forward"] * d
    for static, suffix in ((True, ""), (False, "_no_static")):
        ins = forward_instructions(row["path"], M, tile["H"], R, d_v, cols, static)
        t_lanes = ins["lanes"] / (gpu["sms"] * gpu["fp32_lanes"] * gpu["clock_hz"])
        t_sfu = ins["exps"] / (gpu["sms"] * gpu["sfu_lanes"] * gpu["clock_hz"])
        t_cuda = max(t_lanes, t_sfu)
        for name, t_dots in (("tf32x3", t_tf32), ("bf16", t_bf16)):
            rate = fa_flops / max(t_dots, t_cuda)
            key = f"bound_{name}{suffix}"
            out[f"{key}_tflops"] = rate / 1e12
            out[f"{key}_vs_fa3"] = rate / FA3_FORWARD
            out[f"{key}_by"] = "tensor cores" if t_dots >= t_cuda else "CUDA cores"
        out.update({f"lane_instructions_per_element{suffix}": ins["lanes"],
                    f"lane_instructions_per_tile{suffix}": ins["lanes"] * elements,
                    f"cuda_tflops_equiv{suffix}": fa_flops / t_cuda / 1e12})
    return out


def analyse(rows: list, shapes: str) -> list:
    """Rows with occupancy and the model added (compiled kernels only)."""
    sizes = {cid: z for cid, z, _ in compile_time.SHAPES[shapes]}
    out = []
    for r in rows:
        if r.get("cached") or r.get("timed_out") or "registers" not in r:
            out.append(dict(r))
            continue
        z = sizes[r["case"]]
        tile = tiles(r["path"], z["N"] // z["G"], z["d"], z["d_v"], z["T"], z["S"])
        out.append(dict(r, **occupancy(r["registers"], r["num_warps"], r["shared"]),
                        **model(r, z, tile)))
    return out


def markdown(rows: list) -> str:
    """One table per path: resources, occupancy, dot FLOPs and bounds."""
    lines = []
    for path in ("triton", "pallas"):
        mine = [r for r in rows if r["path"] == path]
        if not mine:
            continue
        lines += [f"{path.capitalize()}:", "",
                  "| case | kernel | tile (H×rows×cols) | warps | regs | spill st / ld (B) | "
                  "stack (B) | smem (KiB) | blocks/SM (limit) | occupancy | dot FLOP/tile | "
                  "cpu s |", "|" + "---|" * 12]
        for r in mine:
            if "registers" not in r:
                what = "not done" if r.get("timed_out") else "cached"
                lines.append(f"| {r['case']} | {r['kernel']} | {what} |" + " |" * 9
                             + f" {r.get('cpu_s', '')} |")
                continue
            lines.append(
                f"| {r['case']} | {r['kernel']} | {r['tile']} | {r['num_warps']} | "
                f"{r['registers']} | {r['spill_stores']} / {r['spill_loads']} | "
                f"{r['stack_bytes']} | {r['shared'] / 1024:.0f} | {r['blocks']} "
                f"({r['limit']}) | {r['occupancy']:.1%} | {r['dot_flops_per_tile']:.3g} | "
                f"{r['cpu_s']} |")
        lines.append("")
    fwd = [r for r in rows if r.get("role") == "forward"]
    if fwd:
        lines += ["Forward bound (per element of a visited tile; FA-counted TFLOP/s = 4d "
                  "FLOPs per element / time; FA3 ≈ 600):", "",
                  "| path | case | static | dots (FLOP/elt) | lane instr/elt | CUDA-core bound | "
                  "bound, dots tf32x3 (vs FA3) | bound, dots bf16 (vs FA3) |",
                  "|" + "---|" * 8]
        for r in fwd:
            for suffix, static in (("", "with"), ("_no_static", "without")):
                bounds = [f"{r[f'{b}_tflops']:.0f} ({r[f'{b}_vs_fa3']:.0%}, {r[f'{b}_by']})"
                          for b in (f"bound_tf32x3{suffix}", f"bound_bf16{suffix}")]
                lines.append(
                    f"| {r['path']} | {r['case']} | {static} | {r['dot_flops_per_element']} | "
                    f"{r[f'lane_instructions_per_element{suffix}']:.0f} | "
                    f"{r[f'cuda_tflops_equiv{suffix}']:.0f} | " + " | ".join(bounds) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="triton,pallas", help="triton, pallas or both")
    ap.add_argument("--cases", default="", help="comma-separated substrings of case ids")
    ap.add_argument("--shapes", choices=tuple(compile_time.SHAPES), default="heads")
    ap.add_argument("--timeout", type=float, default=1200,
                    help="seconds per case and path before it is reported as not done")
    ap.add_argument("--rows", default=None,
                    help="a --json file of compile_time.py (same --shapes): no compiling")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rows:
        with open(args.rows) as f:
            saved = json.load(f)
        cond, rows = saved["conditions"], saved["rows"]
    else:
        paths = [p for p in args.paths.split(",") if p]
        unknown = set(paths) - {"triton", "pallas"}
        if unknown:
            ap.error(f"--paths takes triton and/or pallas. Received: {sorted(unknown)}")
        selected = compile_time.cases(args.shapes, [s for s in args.cases.split(",") if s])
        if not selected:
            ap.error(f"--cases {args.cases!r} selects no case")
        cond = compile_time.conditions()
        print("conditions:", json.dumps(cond), flush=True)
        rows = [r for path in paths for case in selected
                for r in compile_time._worker(path, case["id"], args.shapes, args.timeout)]
    rows = analyse(rows, args.shapes)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(conditions=cond, gpu=H100, fa3_forward=FA3_FORWARD, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
