"""Smoke test of the quality study tool (benchmarks/quality.py): a few steps, two seeds.

It checks the report's fields, that paired runs start from the same values of every weight
they share, that a stored run is reused instead of trained again, and the statistics
against independent computations. The study itself is never run here.
"""

import importlib.util
import json
import math
import os

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":
    pytest.skip("the study tool is smoke-tested once, on the jax backend",
                allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location(
        "quality", os.path.join(ROOT, "benchmarks", "quality.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = ["--steps", "4", "--layers", "1", "--hidden-dim", "16", "--heads", "2",
        "--seq-len", "8", "--window", "4", "--eval-points", "2", "--val-windows", "8",
        "--quiet"]


def test_main_table_report_fields_and_resume(quality, tmp_path, monkeypatch):
    out = str(tmp_path / "q")
    assert quality.main(["main", "--seeds", "0-1", "--output", out] + TINY) == 0
    with open(os.path.join(out, "main.json")) as fh:
        report = json.load(fh)
    assert report["missing"] == []
    assert len(report["runs"]) == 4                       # 2 variants x 2 seeds
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"mha", "dcmha"}
    for r in rows.values():
        assert r["seeds"] == [0, 1]
        assert math.isfinite(r["loss_mean"]) and math.isfinite(r["loss_sd"])
        assert r["seconds_per_step"] > 0
    dc = rows["dcmha"]
    assert dc["paired"] == 2 and 0 <= dc["wins"] <= 2
    assert math.isfinite(dc["diff_mean"]) and dc["diff_ci95"] > 0
    # The paired difference is the mean of per-seed differences of the stored runs.
    runs = {}
    for key in report["runs"]:
        with open(os.path.join(out, "runs", key + ".json")) as fh:
            rec = json.load(fh)
        runs[(rec["config"]["variant"], rec["config"]["seed"])] = rec
        assert rec["steps"] == [0, 2, 4] and len(rec["val_loss"]) == 3
    diffs = [runs[("dcmha", s)]["final_val_loss"] - runs[("mha", s)]["final_val_loss"]
             for s in (0, 1)]
    np.testing.assert_allclose(dc["diff_mean"], np.mean(diffs), rtol=1e-12)
    assert os.path.exists(os.path.join(out, "main.png"))
    assert os.path.exists(os.path.join(out, "main.md"))

    # Resumable: every run is stored, so a second call trains nothing.
    def refuse(*a, **k):
        raise AssertionError("a stored run was trained again")

    monkeypatch.setattr(quality, "train_run", refuse)
    assert quality.main(["main", "--seeds", "0-1", "--output", out] + TINY) == 0


def _config(quality, **over):
    args = quality.parse(["main"] + TINY)
    return dict(quality.base_config(args), **over)


def test_paired_models_share_initial_weights(quality):
    def weights(variant, seed):
        model = quality.build_model(_config(quality, variant=variant, seed=seed))
        model.build((None, None))
        # Paths start with the model's name (the variant): compare what follows it.
        return {v.path.split("/", 1)[1]: keras.ops.convert_to_numpy(v) for v in model.weights}

    mha, dc = weights("mha", 3), weights("dcmha", 3)
    shared = sorted(set(mha) & set(dc))
    assert len(shared) == len(mha)                # every MHA weight exists in DCMHA
    assert len(dc) > len(mha)                     # plus the composition weights
    for path in shared:
        np.testing.assert_array_equal(mha[path], dc[path], err_msg=path)
    other = weights("mha", 4)
    assert any(not np.array_equal(mha[p], other[p]) for p in shared)


def test_confidence_interval_matches_scipy(quality):
    from scipy import stats

    values = np.random.default_rng(0).normal(size=5)
    mean, sd, half = quality.mean_sd_ci(values)
    lo, hi = stats.t.interval(0.95, len(values) - 1, loc=values.mean(),
                              scale=stats.sem(values))
    np.testing.assert_allclose([mean - half, mean + half], [lo, hi], rtol=1e-10)
    np.testing.assert_allclose(sd, np.std(values, ddof=1), rtol=1e-12)


def test_multiplier_interpolates_between_budgets(quality):
    # Transformer++'s loss falls linearly in k; DCFormer++ at 1x equals it at k_true.
    def loss(k):
        return 2.0 - 0.1 * k

    def rec(variant, seed, k):
        return dict(config=dict(variant=variant, seed=seed, steps=int(100 * k)),
                    final_val_loss=loss(k))

    k_true = {0: 1.7, 1: 2.4, 2: 0.5}
    groups = {"dcmha 1x": [dict(rec("dcmha", s, k), config=dict(variant="dcmha", seed=s,
                                                                  steps=100))
                           for s, k in k_true.items()],
              "mha": [rec("mha", s, k) for s in k_true for k in quality.MULTIPLIERS]}
    out = quality.multiplier_summary(groups, 100)
    got = {e["seed"]: (e["k"], e["bound"]) for e in out["per_seed"]}
    np.testing.assert_allclose(got[0][0], k_true[0], rtol=1e-9)
    np.testing.assert_allclose(got[1][0], k_true[1], rtol=1e-9)
    # Below the smallest measured budget: counted at the edge and marked as censored.
    assert got[2] == (quality.MULTIPLIERS[0], "<=")
    assert out["censored"] == 1



def test_multiplier_budgets_follow_the_option(quality):
    args = quality.parse(["multiplier", "--multipliers", "1,0.5,0.75", "--seeds", "0"] + TINY)
    steps = sorted(cfg["steps"] for _, cfg in quality.table_runs(args, "multiplier")
                   if cfg["variant"] == "mha")
    assert steps == [2, 3, 4]             # 0.5, 0.75 and 1 x --steps 4, rounded
    default = quality.parse(["multiplier", "--seeds", "0"] + TINY)
    assert quality._multipliers(default) == list(quality.MULTIPLIERS)
    for bad in ("1", "0,1", "-1,2"):
        args = quality.parse(["multiplier", f"--multipliers={bad}"] + TINY)
        with pytest.raises(SystemExit, match="--multipliers must be two or more positive"):
            quality.table_runs(args, "multiplier")


def _records(losses):
    """Stored-run records from {(variant, seed): final loss}."""
    return [dict(config=dict(variant=v, seed=s), final_val_loss=loss)
            for (v, s), loss in losses.items()]


def test_orderings_are_paired_differences(quality):
    rng = np.random.default_rng(1)
    variants = ("mha", "post_only", "pre_only", "dcmha", "rank1")
    losses = {(v, s): float(rng.normal(1.7, 0.05)) for v in variants for s in range(4)}
    del losses[("pre_only", 3)]                    # seed 3 cannot be paired for post/pre
    rows = {(r["better"], r["worse"]): r
            for r in quality.ordering_summary({"300 steps": _records(losses)})}
    # Only the orderings whose two variants both ran.
    assert set(rows) == {("post_only", "pre_only"), ("dcmha", "rank1")}
    for (better, worse), r in rows.items():
        seeds = [s for s in range(4) if (better, s) in losses and (worse, s) in losses]
        diffs = np.array([losses[(better, s)] - losses[(worse, s)] for s in seeds])
        np.testing.assert_allclose(r["diff_mean"], diffs.mean(), rtol=1e-12)
        np.testing.assert_allclose(r["diff_sd"], diffs.std(ddof=1), rtol=1e-12)
        assert r["paired"] == len(seeds) and r["wins"] == int((diffs < 0).sum())
        assert r["paper_ppl"] == [quality.PAPER_405M_PPL[better], quality.PAPER_405M_PPL[worse]]
    assert rows[("post_only", "pre_only")]["paired"] == 3


def test_per_second_needs_a_speed_measurement_at_the_same_shape(quality, tmp_path):
    out = str(tmp_path / "q")
    args = quality.parse(["multiplier", "--output", out] + TINY)
    assert quality.read_speed(args) is None                  # nothing measured yet
    speed = dict(conditions=dict(config=dict(quality.base_config(args)), command="speed"),
                 seconds_per_step=dict(mha=0.1, dcmha=0.125),
                 range=dict(mha=[0.09, 0.11], dcmha=[0.12, 0.13]),
                 ratio_to_mha=dict(mha=1.0, dcmha=1.25))
    os.makedirs(out)
    with open(os.path.join(out, "speed.json"), "w") as fh:
        json.dump(speed, fh)
    mm = dict(k_mean=1.5, k_ci95=0.2)
    ps = quality.per_second(mm, quality.read_speed(args))
    np.testing.assert_allclose(ps["k_per_second"], 1.5 / 1.25, rtol=1e-12)
    np.testing.assert_allclose(ps["ci95"], [1.3 / 1.25, 1.7 / 1.25], rtol=1e-12)
    assert "1.20x [1.04, 1.36]" in quality.render_per_second(ps)
    # A speed measured at another shape does not convert this table's steps.
    other = quality.parse(["multiplier", "--output", out] + TINY + ["--seq-len", "16"])
    assert quality.read_speed(other) is None
    assert quality.render_per_second(None).startswith("Per CPU second: not measured")


def test_multiplier_of_another_variant_ignores_the_others(quality):
    # Transformer++ at 1x, 2x: 2.0, 1.8; every 2nd layer at 1x: 1.9 -> k = 1.5. DCFormer++'s
    # own runs (1.85) must not count as the target, nor as a Transformer++ budget.
    recs = [dict(config=dict(variant="mha", seed=0, steps=100), final_val_loss=2.0),
            dict(config=dict(variant="mha", seed=0, steps=200), final_val_loss=1.8),
            dict(config=dict(variant="dcmha", seed=0, steps=100), final_val_loss=1.85),
            dict(config=dict(variant="dcmha_every_2nd", seed=0, steps=100),
                 final_val_loss=1.9)]
    out = quality.multiplier_summary({"runs": recs}, 100, variant="dcmha_every_2nd")
    assert [(e["seed"], e["bound"]) for e in out["per_seed"]] == [(0, "=")]
    np.testing.assert_allclose(out["per_seed"][0]["k"], 1.5, rtol=1e-12)
    assert out["per_seed"][0]["mha"] == {"1": 2.0, "2": 1.8}
    speed = dict(ratio_to_mha=dict(mha=1.0, dcmha_every_2nd=1.2), seconds_per_step={},
                 range={}, conditions=dict(command="speed"))
    assert quality.per_second(out, speed, "dcmha") is None      # not measured
    np.testing.assert_allclose(quality.per_second(out, speed, "dcmha_every_2nd")[
        "k_per_second"], 1.5 / 1.2, rtol=1e-12)
