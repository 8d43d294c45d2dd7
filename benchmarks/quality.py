"""Does DCMHA make better models? Paired, multi-seed training runs and their statistics.

Every run trains one ``DCFormerLM`` with the loop a Keras user writes (``compile`` and
``fit``, the optimizer named on the command line) on a byte-level corpus. A seed sets
both the initial weights and the data order, and models that differ only in their
attention share the initial values of every weight they have in common (embedding,
q/k/v/output kernels, norms, SwiGLU, output head), so two variants at one seed see the
same batches from the same start: their difference is paired.

One command per table; runs are stored one JSON file each under ``OUTPUT/runs`` and
reused by every table that needs them, so an interrupted study resumes where it
stopped (and two processes can share the work: a run being trained is locked)::

    python benchmarks/quality.py main         # Transformer++ vs DCFormer++, --seeds (5)
    python benchmarks/quality.py ablation     # the paper's ten variants, 3 seeds, and its
                                              # orderings (post > pre, ...) as paired CIs;
                                              # with `placement`, each variant's multiplier
                                              # where `multiplier` stored Transformer++'s
                                              # budgets at the same options
    python benchmarks/quality.py multiplier   # Transformer++ at 1, 1.5, 2, 3x the steps
                                              # (--multipliers: other budgets, e.g. 0.5,0.75,1);
                                              # per CPU second too where `speed` has run with
                                              # the same model options and --output
    python benchmarks/quality.py lr           # learning rates x both models
    python benchmarks/quality.py heads        # head dimension at a fixed width
    python benchmarks/quality.py length       # 1x and 2x the steps, both models
    python benchmarks/quality.py composition_lr  # the composition weights' step size: their
                                              # learning rate scaled (--composition-lr-scales)
                                              # at each --learning-rates
    python benchmarks/quality.py recipe       # optimizer settings: the official code's
                                              # (beta_2 0.95, weight decay 0.1), per-variable
                                              # clipping instead of global
    python benchmarks/quality.py gradients --implementation jax_cpu   # a fast path against
                                              # ops over a real training run (same batches)
    python benchmarks/quality.py checks       # initial scales against the official code,
                                              # dtypes under mixed_bfloat16, what weight
                                              # decay and clipping touch
    python benchmarks/quality.py speed        # time per training step, alternating
    python benchmarks/quality.py report       # every table from the stored runs

``--report-only`` prints a table from what is stored without training. Each table
writes ``OUTPUT/<table>.json``, ``.md`` and ``.png`` (loss against steps, mean and
the band of one standard deviation over seeds).

The study takes CPU hours: run it in the background at low priority. Where Linux
groups processes by session for scheduling (``/proc/sys/kernel/sched_autogroup_enabled``
is 1), ``nice`` ranks a process only against its own session's: a study started with
``setsid`` (or from another terminal) takes an equal share of the CPU beside a test run
or a benchmark whatever its nice value. Lower its group as well:
``echo 19 > /proc/<pid>/autogroup``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import time

#: name: (label, DCFormerLM options).
VARIANTS = {
    "mha": ("Transformer++ (MHA)", dict(attention="mha")),
    "dcmha": ("DCFormer++ (DCMHA, rank 2)", dict()),
    "talking_heads": ("Talking-Heads (static only)",
                      dict(static_compose=True, dynamic_projection=False, dynamic_gating=False)),
    "pre_only": ("pre-compose only", dict(post_compose=False)),
    "post_only": ("post-compose only", dict(pre_compose=False)),
    "query_wise_only": ("query-wise only", dict(key_wise=False)),
    "key_wise_only": ("key-wise only", dict(query_wise=False)),
    "projection_only": ("dynamic projection only", dict(dynamic_gating=False)),
    "gating_only": ("dynamic gating only", dict(dynamic_projection=False)),
    "rank1": ("DCFormer++ rank 1", dict(rank=1)),
    # Placement: DCMHA in some layers only (``DCFormerLM(dcmha_layers=k)``: every k-th layer,
    # the others plain MHA).
    "dcmha_every_2nd": ("DCMHA in every 2nd layer", dict(dcmha_layers=2)),
    "dcmha_every_4th": ("DCMHA in every 4th layer", dict(dcmha_layers=4)),
}
#: The placement table's variants: all layers against every 2nd and every 4th (the last two
#: are placement only, not components, so the ablation leaves them out).
PLACED = ("dcmha_every_2nd", "dcmha_every_4th")
PLACEMENT = ("mha", "dcmha") + PLACED
#: The paper's 405M ablation perplexities (Transformer++ 11.68), for the ablation table.
PAPER_405M_PPL = dict(mha=11.68, dcmha=10.83, pre_only=11.54, post_only=11.05,
                      query_wise_only=10.89, key_wise_only=10.91, projection_only=10.95,
                      gating_only=11.31, rank1=10.87)
#: The paper's orderings the ablation tests (its better variant first, by the 405M
#: perplexities above): post- over pre-composition, query-wise over key-wise, dynamic
#: projection over gating, rank 2 over rank 1.
ORDERINGS = (("post_only", "pre_only"), ("query_wise_only", "key_wise_only"),
             ("projection_only", "gating_only"), ("dcmha", "rank1"))
TABLES = ("main", "ablation", "placement", "multiplier", "lr", "heads", "length", "recipe",
          "composition_lr", "gradients", "checks", "speed")
#: Tables that train stored runs (the others run in-process and store only their report).
RUN_TABLES = ("main", "ablation", "placement", "multiplier", "lr", "heads", "length",
              "recipe", "composition_lr")
#: The recipe table's groups: name -> optimizer settings that differ from the command line's.
RECIPES = {
    "command line": {},
    "beta_2 0.95, weight decay 0.1 (official)": dict(beta_2=0.95, weight_decay=0.1),
    "per-variable clipnorm 1.0": dict(clipnorm=1.0, global_clipnorm=None),
}
MULTIPLIERS = (1.0, 1.5, 2.0, 3.0)

#: Stored in every run's key: a change to any of these is a different run.
RUN_FIELDS = ("variant", "seed", "steps", "corpus", "layers", "hidden_dim", "heads",
              "seq_len", "batch_size", "window", "optimizer", "learning_rate",
              "weight_decay", "clipnorm", "global_clipnorm", "beta_2", "warmup",
              "implementation", "backend")
#: Fields added later: in a run's key only when they differ from their default, so that the
#: runs stored before they existed keep their keys.
EXTRA_FIELDS = dict(composition_lr_scale=1.0)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

def _floats(text):
    return [float(v) for v in str(text).split(",") if v.strip()]


def _ints(text):
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", choices=TABLES + ("report",))
    p.add_argument("--seeds", default=None,
                   help="e.g. 0-4 or 0,2 (default: 5 for main/multiplier, else 3; 2 for lr)")
    p.add_argument("--steps", type=int, default=300, help="the 1x step budget")
    p.add_argument("--corpus", choices=("english", "stdlib"), default="english",
                   help="english: the Python documentation's topics (pydoc_data); stdlib: "
                        "the standard library's sources (the demo's corpus)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--window", type=int, default=32, help="local layers' window (LG pattern)")
    p.add_argument("--optimizer", default="adamw", help="a keras.optimizers name: adamw, "
                   "adam, lion, sgd, ...")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clipnorm", type=float, default=None, help="per-variable clipping")
    p.add_argument("--global-clipnorm", type=float, default=1.0)
    p.add_argument("--beta-2", type=float, default=0.999)
    p.add_argument("--warmup", type=float, default=0.1, help="warmup fraction (then cosine "
                   "to 0.1x)")
    p.add_argument("--composition-lr-scale", type=float, default=1.0,
                   help="the composition weights' learning rate, relative to the others'")
    p.add_argument("--composition-lr-scales", default="0.1",
                   help="composition_lr table: the scales tried")
    p.add_argument("--implementation", default="auto", help="DCMHA's implementation")
    p.add_argument("--variants", default=None, help="override the table's variants")
    p.add_argument("--learning-rates", default="1e-3,3e-3,6e-3", help="lr table")
    p.add_argument("--head-counts", default="8,4,2", help="heads table (same width)")
    p.add_argument("--multipliers", default=",".join(f"{k:g}" for k in MULTIPLIERS),
                   help="multiplier table: Transformer++'s step budgets, in multiples of "
                        "--steps (budgets below 1 place a DCFormer++ that loses per step)")
    p.add_argument("--eval-points", type=int, default=6)
    p.add_argument("--val-windows", type=int, default=256)
    p.add_argument("--output", default="benchmarks/out/quality")
    p.add_argument("--backend", choices=("jax", "torch", "tensorflow"), default=None)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--repeats", type=int, default=7, help="speed: alternations")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def _multipliers(args):
    """The multiplier table's budgets (sorted, positive), else a SystemExit naming them."""
    ks = sorted(set(_floats(args.multipliers)))
    if len(ks) < 2 or ks[0] <= 0:
        raise SystemExit(f"--multipliers must be two or more positive numbers. Received: "
                         f"{args.multipliers!r}")
    return ks


def base_config(args):
    return dict(variant="mha", seed=0, steps=args.steps, corpus=args.corpus,
                layers=args.layers, hidden_dim=args.hidden_dim, heads=args.heads,
                seq_len=args.seq_len, batch_size=args.batch_size, window=args.window,
                optimizer=args.optimizer, learning_rate=args.learning_rate,
                weight_decay=args.weight_decay, clipnorm=args.clipnorm,
                global_clipnorm=args.global_clipnorm, beta_2=args.beta_2, warmup=args.warmup,
                implementation=args.implementation, backend=args.backend or _backend_name(),
                composition_lr_scale=args.composition_lr_scale)


def _backend_name():
    return os.environ.get("KERAS_BACKEND", "jax")


def table_runs(args, table):
    """The run configurations of one table: a list of (group label, config)."""
    base = base_config(args)
    default_seeds = {"main": "0-4", "multiplier": "0-4", "lr": "0-1"}.get(table, "0-2")
    seeds = _ints(args.seeds or default_seeds)
    names = (args.variants.split(",") if args.variants else
             [n for n in VARIANTS if n not in PLACED] if table == "ablation" else
             list(PLACEMENT) if table == "placement" else ["mha", "dcmha"])
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    runs = []

    def add(group, **over):
        for seed in seeds:
            for name in names if "variant" not in over else [over["variant"]]:
                cfg = dict(base, **dict(over, variant=over.get("variant", name), seed=seed))
                if VARIANTS[cfg["variant"]][1].get("attention") == "mha":
                    cfg["composition_lr_scale"] = 1.0     # no composition weights: one run
                runs.append((group, cfg))

    if table in ("main", "ablation", "placement"):
        add(f"{args.steps} steps")
    elif table == "multiplier":
        add("dcmha 1x", variant="dcmha")
        for k in _multipliers(args):
            add(f"mha {k:g}x", variant="mha", steps=int(round(k * args.steps)))
    elif table == "lr":
        for lr in _floats(args.learning_rates):
            add(f"lr {lr:g}", learning_rate=lr)
    elif table == "heads":
        for h in _ints(args.head_counts):
            add(f"{h} heads of {args.hidden_dim // h}", heads=h)
    elif table == "length":
        for k in (1, 2):
            add(f"{k * args.steps} steps", steps=k * args.steps)
    elif table == "composition_lr":
        for lr in _floats(args.learning_rates):
            for scale in _floats(args.composition_lr_scales):
                add(f"lr {lr:g}, composition lr x{scale:g}", learning_rate=lr,
                    composition_lr_scale=scale)
    elif table == "recipe":
        for label, over in RECIPES.items():
            add(label, **over)
    return runs


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------

def load_corpus(name):
    """(train, validation) int32 byte arrays: 90% / 10% of the corpus, in file order."""
    import numpy as np

    if name == "stdlib":
        from dcmha import demo
        train, val, _ = demo.load_corpus()
        return train, val
    import pydoc_data.topics as topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")
    data = np.frombuffer(text, dtype=np.uint8).astype("int32")
    split = int(len(data) * 0.9)
    return data[:split], data[split:]


def training_windows(train, count, seq_len, seed):
    """(x, y) (count, seq_len): windows at seeded random starts and their next bytes (the
    demo's sampling)."""
    from dcmha import demo

    return demo.training_windows(train, count, seq_len, seed)


def validation_windows(val, count, seq_len):
    """(x, y) (count, seq_len): evenly spaced windows of the validation split."""
    from dcmha import demo

    return demo.validation_windows(val, count, seq_len)


# ---------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------

def run_key(cfg):
    fields = [cfg[k] for k in RUN_FIELDS] + [[k, cfg.get(k, d)] for k, d in EXTRA_FIELDS.items()
                                             if cfg.get(k, d) != d]
    digest = hashlib.sha1(json.dumps(fields).encode()).hexdigest()[:10]
    return f"{cfg['variant']}-s{cfg['seed']}-n{cfg['steps']}-{digest}"


def build_model(cfg):
    """The DCFormerLM of one run, seeded so that variants share their common weights."""
    import keras

    from dcmha.models import DCFormerLM

    seed = cfg["seed"]
    keras.utils.set_random_seed(seed)
    options = dict(VARIANTS[cfg["variant"]][1])
    if options.get("attention") != "mha":
        options["implementation"] = cfg["implementation"]
        # The study scales the composition weights' steps with the optimizer wrapper
        # (``composition_lr_scale`` of a run is the wrapper's), so the layers keep their
        # variables equal to their weights: the stored runs were trained that way, and the
        # parametrisation DCMHA uses by default gives the same steps (tests/models/
        # test_models_optimizers.py).
        options["composition_lr_scale"] = 1.0
    window = cfg["window"] if cfg["window"] and cfg["window"] < cfg["seq_len"] else None
    return DCFormerLM(vocab_size=256, num_layers=cfg["layers"], hidden_dim=cfg["hidden_dim"],
                      num_heads=cfg["heads"], sliding_window=window, window_pattern="LG",
                      rope_max_wavelength=10000, seed=seed,
                      kernel_initializer=keras.initializers.GlorotUniform(seed),
                      name=cfg["variant"], **options)


def make_optimizer(cfg):
    """The optimizer named by ``cfg['optimizer']`` with warmup and cosine decay to 0.1x."""
    import inspect

    import keras

    steps = cfg["steps"]
    warmup = max(1, int(round(cfg["warmup"] * steps)))
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=max(1, steps - warmup), warmup_target=cfg["learning_rate"],
        warmup_steps=warmup, alpha=0.1)
    cls = type(keras.optimizers.get(cfg["optimizer"]))
    accepted = inspect.signature(cls.__init__).parameters

    kwargs = dict(learning_rate=schedule, clipnorm=cfg["clipnorm"],
                  global_clipnorm=cfg["global_clipnorm"])
    if "weight_decay" in accepted:
        kwargs["weight_decay"] = cfg["weight_decay"]
    if "beta_2" in accepted:
        kwargs["beta_2"] = cfg["beta_2"]
    optimizer = cls(**kwargs)
    scale = cfg.get("composition_lr_scale", 1.0)
    if scale != 1.0:
        from dcmha.optimizers import with_composition_learning_rate
        optimizer = with_composition_learning_rate(optimizer, scale)
    return optimizer


def train_run(cfg, corpus, verbose=0):
    """Train one configuration; returns its record (losses per evaluation point, times)."""
    import keras
    import numpy as np

    train, val = corpus
    steps, bs = cfg["steps"], cfg["batch_size"]
    x, y = training_windows(train, steps * bs, cfg["seq_len"], cfg["seed"])
    xv, yv = validation_windows(val, VAL_WINDOWS[0], cfg["seq_len"])
    keras.backend.clear_session()
    model = build_model(cfg)
    jit = False if keras.backend.backend() == "tensorflow" else "auto"
    model.compile(optimizer=make_optimizer(cfg),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit)
    model.build((None, None))
    initial_val = float(model.evaluate(xv, yv, batch_size=64, verbose=0))
    rounds = max(1, min(EVAL_POINTS[0], steps))
    bounds = np.linspace(0, steps, rounds + 1).astype(int)
    rec = dict(config=cfg, key=run_key(cfg), parameters=int(model.count_params()),
               steps=[0], val_loss=[initial_val], train_loss=[], round_seconds=[],
               round_steps=[])
    start = time.perf_counter()
    for r in range(rounds):
        lo, hi = bounds[r] * bs, bounds[r + 1] * bs
        if hi <= lo:
            continue
        t0 = time.perf_counter()
        hist = model.fit(x[lo:hi], y[lo:hi], batch_size=bs, epochs=r + 1, initial_epoch=r,
                         shuffle=False, validation_data=(xv, yv), verbose=verbose)
        rec["round_seconds"].append(time.perf_counter() - t0)
        rec["round_steps"].append(int(bounds[r + 1] - bounds[r]))
        rec["steps"].append(int(bounds[r + 1]))
        rec["train_loss"].append(float(hist.history["loss"][-1]))
        rec["val_loss"].append(float(hist.history["val_loss"][-1]))
    rec["seconds"] = time.perf_counter() - start
    later = [s / n for s, n in zip(rec["round_seconds"][1:], rec["round_steps"][1:])]
    rec["seconds_per_step"] = float(np.median(later)) if later else None
    rec["final_val_loss"] = rec["val_loss"][-1]
    rec["keras"] = keras.__version__
    return rec, model


#: Set from the command line (module-level so that train_run's signature stays small).
VAL_WINDOWS = [256]
EVAL_POINTS = [6]


@contextlib.contextmanager
def claimed(path):
    """Hold ``path + '.lock'`` while training: another process skips the run (a lock left
    by a process that no longer exists is taken over)."""
    lock = path + ".lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            with open(lock) as fh:
                pid = int(fh.read().strip() or 0)
            os.kill(pid, 0)
            yield False
            return
        except (ValueError, ProcessLookupError, FileNotFoundError):
            os.replace(lock, lock + ".stale")
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    try:
        yield True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(lock)


def ensure_runs(runs, args, train=True):
    """The stored record of every run (training the missing ones when ``train``)."""
    run_dir = os.path.join(args.output, "runs")
    os.makedirs(run_dir, exist_ok=True)
    corpus = None
    records = {}
    for i, (_, cfg) in enumerate(runs):
        key = run_key(cfg)
        path = os.path.join(run_dir, key + ".json")
        if not os.path.exists(path) and train:
            with claimed(path) as mine:
                if mine and not os.path.exists(path):
                    if corpus is None:
                        corpus = load_corpus(cfg["corpus"])
                    print(f"[{i + 1}/{len(runs)}] training {key}", flush=True)
                    rec, _ = train_run(cfg, corpus, verbose=0 if args.quiet else 2)
                    tmp = path + ".tmp"
                    with open(tmp, "w") as fh:
                        json.dump(rec, fh, indent=1)
                    os.replace(tmp, path)          # never half-written
                    print(f"    val loss {rec['final_val_loss']:.4f} in {rec['seconds']:.0f} s",
                          flush=True)
        if os.path.exists(path):
            with open(path) as fh:
                records[key] = json.load(fh)
    return records


# ---------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------

def mean_sd_ci(values, level=0.95):
    """(mean, sample sd, half-width of the t confidence interval) of ``values``."""
    import numpy as np
    from scipy import stats

    v = np.asarray(values, dtype=float)
    n = len(v)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    if n == 1:
        return float(v[0]), float("nan"), float("nan")
    sd = float(v.std(ddof=1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n))
    return float(v.mean()), sd, half


def paired_difference(recs, variant, baseline):
    """``variant`` minus ``baseline`` in final loss over the seeds both have run (paired):
    (mean, sd, 95% CI half-width, wins = seeds where ``variant`` is lower, seeds paired)."""
    base = {r["config"]["seed"]: r["final_val_loss"] for r in recs
            if r["config"]["variant"] == baseline}
    diffs = [r["final_val_loss"] - base[r["config"]["seed"]] for r in recs
             if r["config"]["variant"] == variant and r["config"]["seed"] in base]
    m, sd, ci = mean_sd_ci(diffs)
    return m, sd, ci, int(sum(d < 0 for d in diffs)), len(diffs)


def paired_summary(records_by_group):
    """Per group and variant: final loss mean ± sd, the paired difference to MHA at the
    same seed (mean, 95% CI, wins k/S), seconds per step."""
    import numpy as np

    rows = []
    for group, recs in records_by_group.items():
        for variant in dict.fromkeys(r["config"]["variant"] for r in recs):
            mine = [r for r in recs if r["config"]["variant"] == variant]
            losses = [r["final_val_loss"] for r in mine]
            m, sd, _ = mean_sd_ci(losses)
            dm = dsd = dci = wins = None
            paired = 0
            if variant != "mha":
                dm, dsd, dci, wins, paired = paired_difference(recs, variant, "mha")
            sps = [r["seconds_per_step"] for r in mine if r.get("seconds_per_step")]
            rows.append(dict(group=group, variant=variant, label=VARIANTS[variant][0],
                             seeds=sorted(r["config"]["seed"] for r in mine),
                             loss_mean=m, loss_sd=sd, diff_mean=dm, diff_sd=dsd,
                             diff_ci95=dci, wins=wins, paired=paired,
                             seconds_per_step=float(np.median(sps)) if sps else None,
                             parameters=mine[0]["parameters"]))
    return rows


def ordering_summary(records_by_group):
    """The paper's orderings among the ablation's variants (``ORDERINGS``), each as the
    paired difference of the paper's better variant minus the other: negative = the
    paper's ordering holds here; its CI says whether that is resolved."""
    recs = [r for rs in records_by_group.values() for r in rs]
    have = {r["config"]["variant"] for r in recs}
    out = []
    for better, worse in ORDERINGS:
        if better in have and worse in have:
            m, sd, ci, wins, n = paired_difference(recs, better, worse)
            out.append(dict(better=better, worse=worse, diff_mean=m, diff_sd=sd,
                            diff_ci95=ci, wins=wins, paired=n,
                            paper_ppl=[PAPER_405M_PPL[better], PAPER_405M_PPL[worse]]))
    return out


def multiplier_summary(records_by_group, steps, variant="dcmha"):
    """Per seed: the step multiple k at which Transformer++'s final loss (interpolated
    linearly in k between the measured budgets) equals ``variant``'s at 1x."""
    per_seed = {}
    for group, recs in records_by_group.items():
        for r in recs:
            cfg = r["config"]
            entry = per_seed.setdefault(cfg["seed"], {"mha": {}})
            if cfg["variant"] == variant and cfg["steps"] == steps:
                entry["dcmha"] = r["final_val_loss"]
            elif cfg["variant"] == "mha":
                entry["mha"][cfg["steps"] / steps] = r["final_val_loss"]
    ks, notes = [], []
    for seed, e in sorted(per_seed.items()):
        if "dcmha" not in e or len(e["mha"]) < 2:
            continue
        pts = sorted(e["mha"].items())
        target = e["dcmha"]
        k = None
        if target >= pts[0][1]:
            # DCFormer++ at 1x is no better than Transformer++ at the smallest budget.
            k, note = pts[0][0], "<="
        elif target <= pts[-1][1]:
            k, note = pts[-1][0], ">="
        else:
            note = "="
            for (k0, l0), (k1, l1) in zip(pts, pts[1:]):
                if l1 <= target <= l0 or l0 <= target <= l1:
                    k = k0 + (k1 - k0) * ((l0 - target) / (l0 - l1) if l0 != l1 else 0.0)
                    break
        ks.append(k)
        notes.append(dict(seed=seed, k=k, bound=note, dcmha=target,
                          mha={f"{a:g}": b for a, b in pts}))
    m, sd, ci = mean_sd_ci(ks)
    return dict(k_mean=m, k_sd=sd, k_ci95=ci, per_seed=notes,
                censored=sum(n["bound"] != "=" for n in notes))


# ---------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------

def _fmt(v, spec="+.4f"):
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _bracket(lo, hi, spec="+.4f"):
    """"[lo, hi]" in ``spec``, or "" when the interval is unknown (None or NaN)."""
    if _fmt(lo) == "" or _fmt(hi) == "":
        return ""
    return f"[{lo:{spec}}, {hi:{spec}}]"


def _with(value, interval):
    """``value`` then, when known, its interval after a space."""
    return f"{value} {interval}" if interval else value


def _interval(mean, half, spec="+.4f"):
    """``_bracket`` of mean ± half (a confidence interval's half-width)."""
    if _fmt(mean) == "" or _fmt(half) == "":
        return ""
    return _bracket(mean - half, mean + half, spec)


def render_paired(rows, table):
    head = (f"| group | variant | seeds | val loss (mean ± sd) | Δ vs MHA (paired) | 95% CI "
            f"| wins | s/step |{' paper 405M ppl |' if table == 'ablation' else ''}")
    sep = "|---" * (9 if table == "ablation" else 8) + "|"
    lines = [head, sep]
    for r in rows:
        ci = _interval(r["diff_mean"], r["diff_ci95"])
        wins = "" if r["wins"] is None else f"{r['wins']}/{r['paired']}"
        sps = _fmt(r["seconds_per_step"], ".3f")
        line = (f"| {r['group']} | {r['label']} | {len(r['seeds'])} | {r['loss_mean']:.4f} ± "
                f"{_fmt(r['loss_sd'], '.4f')} | {_fmt(r['diff_mean'])} | {ci} | {wins} | {sps} |")
        if table == "ablation":
            line += f" {_fmt(PAPER_405M_PPL.get(r['variant']), '.2f')} |"
        lines.append(line)
    return "\n".join(lines)


def render_orderings(rows):
    lines = ["The paper's orderings (better variant at 405M minus the other, paired; "
             "negative = the ordering holds here):", "",
             "| paper: better | than | Δ (paired) | 95% CI | wins | paper 405M ppl |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ci = _interval(r["diff_mean"], r["diff_ci95"])
        lines.append(f"| {VARIANTS[r['better']][0]} | {VARIANTS[r['worse']][0]} | "
                     f"{_fmt(r['diff_mean'])} | {ci} | {r['wins']}/{r['paired']} | "
                     f"{r['paper_ppl'][0]:.2f} vs {r['paper_ppl'][1]:.2f} |")
    return "\n".join(lines)


#: The fields a speed measurement must share with a table's runs to convert its steps to
#: seconds (the model's shape and where it runs).
SPEED_FIELDS = ("layers", "hidden_dim", "heads", "seq_len", "batch_size", "window",
                "implementation", "backend")


def read_speed(args):
    """``OUTPUT/speed.json`` (``quality.py speed`` with the same ``--output``) when it was
    measured at this command's model shape, else None."""
    path = os.path.join(args.output, "speed.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        speed = json.load(fh)
    measured, wanted = speed["conditions"]["config"], base_config(args)
    if any(measured.get(f) != wanted[f] for f in SPEED_FIELDS):
        return None
    return speed


def per_second(mm, speed, variant="dcmha"):
    """The multiplier per CPU second: DCFormer++'s step multiplier k divided by the time
    ratio r of a step (Transformer++ given DCFormer++'s wall-clock budget trains r times
    the steps), with k's interval over seeds divided by r (r's own spread over rounds is
    reported beside it, not folded in). None without a matching speed measurement of
    ``variant``."""
    if speed is None or variant not in speed.get("ratio_to_mha", {}):
        return None
    r = speed["ratio_to_mha"][variant]
    k, ci = mm["k_mean"], mm["k_ci95"]
    return dict(time_ratio=r, k_per_second=k / r,
                ci95=[(k - ci) / r, (k + ci) / r] if not math.isnan(ci) else None,
                seconds_per_step=speed["seconds_per_step"], range=speed["range"],
                command=speed["conditions"]["command"])


def variant_multipliers(args, by_group):
    """Per variant of an ablation or placement table: its step multiplier against the
    multiplier table's stored Transformer++ budgets (``--multipliers``, same options; none
    are trained here) and, where ``speed`` measured the variant at this shape, per CPU
    second."""
    budgets = [(g, c) for g, c in table_runs(args, "multiplier") if c["variant"] == "mha"]
    mha = list(ensure_runs(budgets, args, train=False).values())
    if len({r["config"]["steps"] for r in mha}) < 2:
        return {}
    speed = read_speed(args)
    recs = [r for rs in by_group.values() for r in rs]
    out = {}
    for variant in dict.fromkeys(r["config"]["variant"] for r in recs):
        if variant == "mha":
            continue
        mm = multiplier_summary({"runs": recs + mha}, args.steps, variant=variant)
        if mm["per_seed"]:
            out[variant] = dict(mm, per_second=per_second(mm, speed, variant))
    return out


def render_variant_multipliers(rows, args):
    if not rows:
        return ("Multipliers: no stored Transformer++ budgets at these options (run "
                "`multiplier` with the same options and --multipliers).")
    lines = ["| variant | in steps: k [95% CI] | seeds outside the budgets | time ratio | "
             "per CPU second [95% CI] |", "|---|---|---|---|---|"]
    for variant, mm in rows.items():
        ps = mm["per_second"]
        ci = _interval(mm["k_mean"], mm["k_ci95"], ".2f")
        per = ("not measured" if ps is None else
               _with(f"{ps['k_per_second']:.2f}", _bracket(*(ps["ci95"] or (None, None)), ".2f")))
        lines.append(f"| {VARIANTS[variant][0]} | {_with(format(mm['k_mean'], '.2f'), ci)} | "
                     f"{mm['censored']}/{len(mm['per_seed'])} | "
                     f"{'' if ps is None else format(ps['time_ratio'], '.2f')} | {per} |")
    return (f"Against Transformer++ at {args.multipliers} x the steps:\n\n"
            + "\n".join(lines))


def render_per_second(ps):
    if ps is None:
        return ("Per CPU second: not measured at this shape (run `quality.py speed` with the "
                "same model options and --output).")
    ci = _bracket(*(ps["ci95"] or (None, None)), ".2f")
    ms = {n: f"{ps['seconds_per_step'][n] * 1e3:.1f} ms ({ps['range'][n][0] * 1e3:.1f}-"
             f"{ps['range'][n][1] * 1e3:.1f})" for n in ps["seconds_per_step"]}
    return (f"Per CPU second: DCFormer++ ≈ Transformer++ with "
            f"{_with(format(ps['k_per_second'], '.2f') + 'x', ci)} "
            f"its time (k / {ps['time_ratio']:.2f}, the time ratio of a step: "
            + ", ".join(f"{n} {v}" for n, v in ms.items()) + f"; {ps['command']})")


def plot(records_by_group, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 5))
    i = 0
    for group, recs in records_by_group.items():
        for variant in dict.fromkeys(r["config"]["variant"] for r in recs):
            mine = [r for r in recs if r["config"]["variant"] == variant]
            curves = np.array([r["val_loss"] for r in mine if len(r["val_loss"]) ==
                               len(mine[0]["val_loss"])])
            steps = mine[0]["steps"]
            m, s = curves.mean(0), curves.std(0)
            label = f"{variant} ({group}, {len(curves)} seeds)"
            ax.plot(steps[1:], m[1:], "-o", ms=3, color=f"C{i % 10}", label=label)
            ax.fill_between(steps[1:], (m - s)[1:], (m + s)[1:], color=f"C{i % 10}", alpha=0.2)
            i += 1
    ax.set_xlabel("training step")
    ax.set_ylabel("validation loss (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def conditions(args, records, table=None):
    """What every run of ``table`` shares (a setting the table varies, such as the learning
    rate of the "lr" table, is named in its groups instead)."""
    any_rec = next(iter(records.values()), None)
    cfg = dict(base_config(args))
    configs = [c for _, c in table_runs(args, table)] if table else []
    for k in list(cfg):
        values = {repr(c.get(k)): c.get(k) for c in configs}
        if k in ("variant", "seed") or len(values) > 1:
            cfg.pop(k)
        elif values:
            cfg[k] = next(iter(values.values()))
    return dict(config=cfg, keras=any_rec and any_rec.get("keras"),
                command="python benchmarks/quality.py " + " ".join(sys.argv[1:]))


def report(args, table, records):
    runs = table_runs(args, table)
    by_group = {}
    for group, cfg in runs:
        rec = records.get(run_key(cfg))
        if rec is not None:
            by_group.setdefault(group, []).append(rec)
    out = dict(table=table, conditions=conditions(args, records, table),
               runs=[run_key(c) for _, c in runs],
               missing=[run_key(c) for _, c in runs if run_key(c) not in records])
    if table == "multiplier":
        out["multiplier"] = multiplier_summary(by_group, args.steps)
        rows = paired_summary({"final": [r for rs in by_group.values() for r in rs
                                         if r["config"]["steps"] == args.steps]})
        out["rows"] = rows
        mm = out["multiplier"]
        text = render_paired(rows, table) + (
            f"\n\nDCFormer++ at {args.steps} steps ≈ Transformer++ at k·{args.steps} steps, "
            f"k = {_fmt(mm['k_mean'], '.2f')} ± {_fmt(mm['k_ci95'], '.2f')} (95% CI over "
            f"{len(mm['per_seed'])} seeds; {mm['censored']} seed(s) outside the measured "
            f"range {min(_multipliers(args)):g}-{max(_multipliers(args)):g}x, counted at the "
            "edge)")
        out["per_second"] = per_second(mm, read_speed(args))
        text += "\n" + render_per_second(out["per_second"])
    else:
        out["rows"] = paired_summary(by_group)
        text = render_paired(out["rows"], table)
    if table == "ablation":
        out["orderings"] = ordering_summary(by_group)
        text += "\n\n" + render_orderings(out["orderings"])
    if table in ("ablation", "placement"):
        out["multipliers"] = variant_multipliers(args, by_group)
        text += "\n\n" + render_variant_multipliers(out["multipliers"], args)
    text += f"\n\ncommand: {out['conditions']['command']}\nconditions: {out['conditions']['config']}"
    if out["missing"]:
        text += f"\nmissing runs: {len(out['missing'])} of {len(runs)}"
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, f"{table}.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    with open(os.path.join(args.output, f"{table}.md"), "w") as fh:
        fh.write(text + "\n")
    if by_group:
        plot(by_group, os.path.join(args.output, f"{table}.png"),
             f"{table}: {args.layers}x{args.hidden_dim}, T={args.seq_len}, {args.corpus}")
    print(text)
    return out


# ---------------------------------------------------------------------------
# Speed: time per training step, models alternating in one process
# ---------------------------------------------------------------------------

def speed(args):
    import keras
    import numpy as np

    base = base_config(args)
    names = args.variants.split(",") if args.variants else ["mha", "dcmha"]
    corpus = load_corpus(args.corpus)
    chunk = 20
    x, y = training_windows(corpus[0], chunk * args.batch_size, args.seq_len, 0)
    models = {}
    for n in names:
        cfg = dict(base, variant=n)
        m = build_model(cfg)
        m.compile(optimizer=make_optimizer(cfg),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False if keras.backend.backend() == "tensorflow" else "auto")
        m.fit(x, y, batch_size=args.batch_size, verbose=0)      # compile and warm up
        models[n] = m
    times = {n: [] for n in names}
    for _ in range(args.repeats):
        for n in names:
            t0 = time.perf_counter()
            models[n].fit(x, y, batch_size=args.batch_size, verbose=0)
            times[n].append((time.perf_counter() - t0) / chunk)
    med = {n: float(np.median(t)) for n, t in times.items()}
    spread = {n: [float(min(t)), float(max(t))] for n, t in times.items()}
    out = dict(table="speed", conditions=conditions(args, {}), seconds_per_step=med,
               range=spread, ratio_to_mha={n: med[n] / med["mha"] for n in names}
               if "mha" in med else {})
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "speed.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    for n in names:
        print(f"{n}: {med[n] * 1e3:.1f} ms/step (range {spread[n][0] * 1e3:.1f}-"
              f"{spread[n][1] * 1e3:.1f}), x{out['ratio_to_mha'].get(n, float('nan')):.2f} "
              f"of mha")
    return out


# ---------------------------------------------------------------------------
# Checks of the composition weights' training
# ---------------------------------------------------------------------------

def _write(args, name, out, text):
    os.makedirs(args.output, exist_ok=True)
    out["conditions"] = conditions(args, {})
    with open(os.path.join(args.output, f"{name}.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    print(text)


def gradients(args):
    """A fast path against ``ops`` over a real training run: the same model, seed and
    batches, trained once with each implementation; the largest difference of the
    per-step losses and of the final weights (relative to how far training moved them)."""
    import keras
    import numpy as np

    impl = args.implementation if args.implementation not in ("auto", "ops") else None
    if impl is None:
        raise SystemExit("gradients: name the fast path with --implementation (jax_cpu, "
                         "torch, tf_cpu, xla, pallas, triton)")
    corpus = load_corpus(args.corpus)
    seed = _ints(args.seeds or "0")[0]
    cfg = dict(base_config(args), variant="dcmha", seed=seed)
    x, y = training_windows(corpus[0], cfg["steps"] * cfg["batch_size"], cfg["seq_len"], seed)
    runs = {}
    for name in ("ops", impl):
        c = dict(cfg, implementation=name)
        keras.backend.clear_session()
        model = build_model(c)
        model.compile(optimizer=make_optimizer(c),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False if keras.backend.backend() == "tensorflow" else "auto")
        model.build((None, None))
        start = [keras.ops.convert_to_numpy(v) for v in model.trainable_variables]
        losses = []
        for i in range(cfg["steps"]):
            sl = slice(i * cfg["batch_size"], (i + 1) * cfg["batch_size"])
            losses.append(float(model.train_on_batch(x[sl], y[sl])))
        runs[name] = dict(losses=np.array(losses), start=start,
                          end=[keras.ops.convert_to_numpy(v) for v in model.trainable_variables],
                          paths=[v.path.split("/", 1)[1] for v in model.trainable_variables])
    a, b = runs["ops"], runs[impl]
    moved = max(float(np.max(np.abs(e - s))) for e, s in zip(a["end"], a["start"]))
    weight_diff = {p: float(np.max(np.abs(e1 - e2)))
                   for p, e1, e2 in zip(a["paths"], a["end"], b["end"])}
    worst = max(weight_diff, key=weight_diff.get)
    out = dict(backend=keras.backend.backend(), implementation=impl, steps=cfg["steps"],
               seed=seed, max_loss_difference=float(np.max(np.abs(a["losses"] - b["losses"]))),
               final_loss_ops=float(a["losses"][-1]), final_loss_fast=float(b["losses"][-1]),
               max_weight_difference=weight_diff[worst], worst_weight=worst,
               largest_weight_change=moved)
    text = (f"{out['backend']}: {impl} against ops over {cfg['steps']} training steps: losses "
            f"differ by at most {out['max_loss_difference']:.2e} (final {out['final_loss_ops']:.4f}"
            f" / {out['final_loss_fast']:.4f}); final weights by at most "
            f"{out['max_weight_difference']:.2e} ({worst}), where training moved a weight by up "
            f"to {moved:.2e}")
    _write(args, f"gradients-{keras.backend.backend()}-{impl}", out, text)
    return out


def checks(args):
    """Initial scales against the official JAX code's formulas, the composition weights'
    dtypes under ``mixed_bfloat16``, what the optimizer's weight decay and clipping touch."""
    import keras
    import numpy as np

    cfg = dict(base_config(args), variant="dcmha", seed=0)
    D, N = cfg["hidden_dim"], cfg["heads"]
    M, R = N, 2                           # one group: M = N heads, rank 2
    K = 4 * M
    official = dict(dw1=math.sqrt(2.0 / (D + K)), qkw=math.sqrt(1.0 / K) * 2.0 / (M + R) * 0.01,
                    dd=math.sqrt(2.0 / (D + M)) * 0.005)
    model = build_model(cfg)
    model.build((None, None))
    measured = {}
    for v in model.trainable_variables:
        name = v.path.split("/")[-1]
        if name in official:
            measured.setdefault(name, []).append(float(np.std(keras.ops.convert_to_numpy(v))))
    scales = {n: dict(official=official[n], measured_mean=float(np.mean(measured[n])),
                      layers=len(measured[n])) for n in official}
    # Gradient norms by group on one batch (the global norm the clipping sees).
    corpus = load_corpus(args.corpus)
    x, y = training_windows(corpus[0], cfg["batch_size"], cfg["seq_len"], 0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = make_optimizer(cfg)
    not_decayed = [v.path.split("/", 1)[1] for v in model.trainable_variables
               if not opt._use_weight_decay(v)] if hasattr(opt, "_use_weight_decay") else None
    grads = _gradients(model, x, y, loss_fn)
    sq = {}
    for v, g in zip(model.trainable_variables, grads):
        name = v.path.split("/")[-1]
        group = name if name in official else "other"
        sq[group] = sq.get(group, 0.0) + float(np.sum(np.square(g)))
    total = sum(sq.values())
    # dtypes under mixed_bfloat16.
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        from dcmha import DCMHA
        layer = DCMHA(num_heads=N, key_dim=D // N, num_groups=1, rank=2, seed=0)
        xs = np.random.default_rng(0).normal(size=(2, 8, D)).astype("float32")
        inter = layer.compute_intermediates(xs, xs, use_causal_mask=True)
        dtypes = dict(
            variables=sorted({f"{v.path.split('/')[-1]}: {v.dtype}" for v in layer.weights
                              if v.path.split("/")[-1] in official}),
            dynamic_weights=sorted({f"{k}: {t.dtype}" for d in inter["query_dynamic"].values()
                                    for k, t in d.items()}),
            scores=str(inter["scores"].dtype), probs=str(inter["probs"].dtype),
            output=str(inter["output"].dtype))
    finally:
        keras.config.set_dtype_policy(policy)
    out = dict(initial_scales=scales,
               gradient_norm_share={g: dict(norm=math.sqrt(v), share_of_squared=v / total)
                                    for g, v in sq.items()},
               global_gradient_norm=math.sqrt(total),
               excluded_from_weight_decay=not_decayed, mixed_bfloat16=dtypes)
    lines = [f"initial std {n}: {s['measured_mean']:.3g} (official formula {s['official']:.3g})"
             for n, s in scales.items()]
    lines += [f"gradient norm {g}: {math.sqrt(v):.3g} ({100 * v / total:.1f}% of the squared "
              f"global norm {math.sqrt(total):.3g})" for g, v in sq.items()]
    lines.append(f"variables the optimizer does not decay: {not_decayed}")
    lines.append(f"mixed_bfloat16: {dtypes}")
    _write(args, "checks", out, "\n".join(lines))
    return out


def _gradients(model, x, y, loss_fn):
    """NumPy gradients of the loss on one batch, in trainable_variables order."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        tv, ntv = model.trainable_variables, model.non_trainable_variables

        def f(values):
            out, _ = model.stateless_call(values, [v.value for v in ntv], x)
            return loss_fn(y, out)

        return [keras.ops.convert_to_numpy(g) for g in jax.grad(f)([v.value for v in tv])]
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    import torch

    model.zero_grad()
    loss_fn(torch.as_tensor(y), model(x)).backward()
    return [v.value.grad.detach().cpu().numpy() for v in model.trainable_variables]


def main(argv=None):
    args = parse(argv)
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend     # before Keras is imported
    VAL_WINDOWS[0], EVAL_POINTS[0] = args.val_windows, args.eval_points
    if args.table in IN_PROCESS:
        IN_PROCESS[args.table](args)
        return 0
    tables = list(RUN_TABLES) if args.table == "report" else [args.table]
    train = not args.report_only and args.table != "report"
    for table in tables:
        runs = table_runs(args, table)
        records = ensure_runs(runs, args, train=train)
        if records:
            report(args, table, records)
    return 0


IN_PROCESS = dict(speed=speed, gradients=gradients, checks=checks)

if __name__ == "__main__":
    sys.exit(main())
