"""The paper's DCMHA ablation (Xiao et al. 2024, 405M table) at small scale.

Trains one byte-level language model per variant on the same data (the Python
standard library's sources, as in ``python -m dcmha demo``), for the same
steps, from the same seed; every variant differs from the DCMHA model only in
its composition switches. Prints a table of validation loss and perplexity
(with the paper's 405M perplexities for reference), writes results.json and a
plot to --output.

    python benchmarks/lm_ablation.py [--steps N] [--output DIR] [--backend B]
                                     [--variants mha,dcmha,...] [--seq-len L]
                                     [--batch-size B] [--seed S]

Defaults (300 steps of 16 x 64 bytes, the demo's 4 x 128 model) take about
10 minutes for all ten variants on 2 CPU cores with TensorFlow: ~35 s for MHA,
~60 s for each DCMHA variant (CPU time measured by the demo).

Every variant starts from the same initial values of the weights they share
(embedding, q/k/v/output kernels, SwiGLU, output head): the attention layers
get per-layer seeds and the other kernels a seeded initializer.

Variants (name: DCFormerLM options):
    mha              attention="mha" (Transformer++)
    talking_heads    static_compose only (Talking-Heads attention)
    dcmha            everything on, rank 2 (DCFormer++)
    pre_only         post_compose=False
    post_only        pre_compose=False
    query_wise_only  key_wise=False
    key_wise_only    query_wise=False
    projection_only  dynamic_gating=False
    gating_only      dynamic_projection=False
    rank1            rank=1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

VARIANTS = {
    "mha": ("Transformer++ (MHA)", dict(attention="mha"), 11.68),
    "talking_heads": ("Talking-Heads (static)", dict(static_compose=True,
                                                      dynamic_projection=False,
                                                      dynamic_gating=False), None),
    "dcmha": ("DCMHA (rank 2)", dict(), 10.83),
    "pre_only": ("pre-compose only", dict(post_compose=False), 11.54),
    "post_only": ("post-compose only", dict(pre_compose=False), 11.05),
    "query_wise_only": ("query-wise only", dict(key_wise=False), 10.89),
    "key_wise_only": ("key-wise only", dict(query_wise=False), 10.91),
    "projection_only": ("dynamic projection only", dict(dynamic_gating=False), 10.95),
    "gating_only": ("dynamic gating only", dict(dynamic_projection=False), 11.31),
    "rank1": ("DCMHA (rank 1)", dict(rank=1), 10.87),
}

#: The demo's model (4 x 128, 4 heads of 32, window 32 LG, bytes); see --layers etc.
MODEL = dict(vocab_size=256, num_layers=4, hidden_dim=128, num_heads=4, sliding_window=32,
             window_pattern="LG", rope_max_wavelength=10000)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--output", default="benchmarks/out/lm_ablation")
    p.add_argument("--backend", choices=("jax", "torch", "tensorflow"), default=None)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=MODEL["num_layers"])
    p.add_argument("--hidden-dim", type=int, default=MODEL["hidden_dim"])
    p.add_argument("--heads", type=int, default=MODEL["num_heads"])
    p.add_argument("--eval-points", type=int, default=6)
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    args.variants = names
    return args


def plot(records, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, r in enumerate(records):
        a.plot(r["steps"], r["val_loss"], "-o", ms=3, color=f"C{i % 10}", label=r["label"])
    a.set_xlabel("training step")
    a.set_ylabel("validation loss (nats / byte)")
    a.grid(alpha=0.3)
    a.legend(fontsize=7)
    labels = [r["label"] for r in records]
    vals = [r["final_val_loss"] for r in records]
    b.barh(range(len(vals)), vals, color=[f"C{i % 10}" for i in range(len(vals))])
    b.set_yticks(range(len(vals)), labels, fontsize=8)
    b.invert_yaxis()
    lo, hi = min(vals), max(vals)
    b.set_xlim(lo - 0.1 * (hi - lo + 1e-3) - 0.01, hi + 0.1 * (hi - lo + 1e-3) + 0.01)
    b.set_xlabel("final validation loss")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse(argv)
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend     # before Keras is imported
    import keras

    from dcmha import demo

    os.makedirs(args.output, exist_ok=True)
    train, val, files = demo.load_corpus()
    data = (demo.training_windows(train, args.steps * args.batch_size, args.seq_len, args.seed),
            demo.validation_windows(val, args.val_windows, args.seq_len))
    model = dict(MODEL, num_layers=args.layers, hidden_dim=args.hidden_dim,
                 num_heads=args.heads, sliding_window=min(MODEL["sliding_window"], args.seq_len))
    print(f"Keras {keras.__version__} ({keras.backend.backend()}); {len(files)} stdlib files, "
          f"{len(train):,} / {len(val):,} bytes; model {model}; {args.steps} steps of "
          f"{args.batch_size} x {args.seq_len}")
    records = []
    start = time.perf_counter()
    for name in args.variants:
        label, options, paper = VARIANTS[name]
        _, rec = demo.train_model(name, dict(model, **options), data, steps=args.steps,
                                  batch_size=args.batch_size, eval_points=args.eval_points,
                                  learning_rate=demo.DEFAULTS["learning_rate"], seed=args.seed,
                                  verbose=0 if args.quiet else 1)
        rec.update(label=label, variant=name, options=options, paper_405m_ppl=paper)
        records.append(rec)
        print(f"   {label}: val loss {rec['final_val_loss']:.4f} "
              f"(ppl {rec['final_val_ppl']:.3f}) in {rec['seconds']:.1f} s")
    total = time.perf_counter() - start

    head = (f"{'variant':<26}{'parameters':>11}{'val loss':>10}{'val ppl':>9}"
            f"{'Δ vs MHA':>10}{'paper 405M ppl':>16}{'time (s)':>10}")
    base = next((r["final_val_loss"] for r in records if r["variant"] == "mha"), None)
    lines = [head, "-" * len(head)]
    for r in records:
        delta = "" if base is None else f"{r['final_val_loss'] - base:+.4f}"
        paper = "" if r["paper_405m_ppl"] is None else f"{r['paper_405m_ppl']:.2f}"
        lines.append(f"{r['label']:<26}{r['parameters']:>11,}{r['final_val_loss']:>10.4f}"
                     f"{r['final_val_ppl']:>9.3f}{delta:>10}{paper:>16}{r['seconds']:>10.1f}")
    table = "\n".join(lines)
    print("\n" + table + f"\n\ntotal {total:.1f} s")
    with open(os.path.join(args.output, "table.txt"), "w", encoding="utf-8") as fh:
        fh.write(table + f"\n\ntotal {total:.1f} s\n")
    plot(records, os.path.join(args.output, "lm_ablation.png"),
         f"DCMHA ablation, byte-level LM on the Python stdlib ({args.steps} steps, "
         f"{keras.backend.backend()})")
    with open(os.path.join(args.output, "results.json"), "w") as fh:
        json.dump(dict(backend=keras.backend.backend(), model=model, steps=args.steps,
                       seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
                       total_seconds=total, records=records), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
