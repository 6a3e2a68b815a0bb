"""The report stage's statistics: cluster recovery (ARI), the per-cell plateau test, the
claims table and its intervals, and which cells feed which table.

All fast: synthetic frames shaped like ``results/eval/<task>/`` (pipeline.evaluate's
columns), except a few tiny untrained models for the evaluate-side helpers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from scipy import stats

from apg.metrics import adjusted_rand_index, highest_weight_particle
from pipeline import report
from pipeline.evaluate import COLUMNS
from pipeline.report.claims import _est
from tests.support import REPO

# --------------------------------------------------------------------------- ARI


def test_highest_weight_particle_takes_each_datasets_own_best():
    # (L=3, B=2): dataset 0's best is particle 2, dataset 1's is particle 0.
    log_w = torch.tensor([[-1.0, 5.0], [0.0, -2.0], [3.0, 1.0]])
    z = {"mu": torch.arange(3 * 2 * 4.0).reshape(3, 2, 4), "c": torch.tensor([[7, 8], [9, 10], [11, 12]])}
    chosen = highest_weight_particle(z, log_w)
    assert torch.equal(chosen["mu"], torch.stack([z["mu"][2, 0], z["mu"][0, 1]]))
    assert torch.equal(chosen["c"], torch.tensor([11, 8]))


def test_ari_is_one_for_the_same_partition_under_any_relabeling():
    true = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    for perm in ([1, 2, 0], [2, 0, 1], [0, 2, 1]):
        pred = torch.tensor(perm)[true] + 5  # relabelled, and labels need not start at 0
        assert adjusted_rand_index(true, pred).item() == pytest.approx(1.0)


def test_ari_hand_computed_examples():
    # [0,0,0,1,1,1] vs [0,0,1,1,2,2]: pairs together in both 2, row pairs 3+3=6, column pairs
    # 1+1+1=3, all pairs C(6,2)=15: expected 6*3/15=1.2, max (6+3)/2=4.5 -> (2-1.2)/(4.5-1.2).
    a = torch.tensor([0, 0, 0, 1, 1, 1])
    b = torch.tensor([0, 0, 1, 1, 2, 2])
    assert adjusted_rand_index(a, b).item() == pytest.approx(0.8 / 3.3)
    assert adjusted_rand_index(b, a).item() == pytest.approx(0.8 / 3.3)  # symmetric
    # [0,0,1,1] vs [0,1,0,1]: no pair together in both; expected 2*2/6 -> (0-2/3)/(2-2/3) = -1/2.
    assert adjusted_rand_index(
        torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1])
    ).item() == pytest.approx(-0.5)
    # One cluster against all singletons: the index is 0 = its expectation.
    assert adjusted_rand_index(torch.zeros(4, dtype=torch.long), torch.arange(4)).item() == pytest.approx(0.0)
    # Both trivial and equal: defined as 1 (the 0/0 case).
    assert (
        adjusted_rand_index(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)).item() == 1.0
    )


def test_ari_is_batched_per_dataset():
    true = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0], [0, 1, 2, 0, 1, 2]])
    pred = torch.tensor([[0, 0, 1, 1, 2, 2], [1, 1, 0, 0, 1, 1], [0, 1, 2, 0, 1, 2]])
    got = adjusted_rand_index(true, pred)
    assert got.shape == (3,)
    singles = torch.stack([adjusted_rand_index(t, p) for t, p in zip(true, pred, strict=True)])
    torch.testing.assert_close(got, singles)
    assert got[1].item() == pytest.approx(1.0) and got[2].item() == pytest.approx(1.0)


def test_ari_matches_scikit_learn_on_random_partitions():
    metrics = pytest.importorskip("sklearn.metrics")
    gen = torch.Generator().manual_seed(0)
    true = torch.randint(3, (20, 40), generator=gen)
    pred = torch.where(
        torch.rand(20, 40, generator=gen) < 0.7, true, torch.randint(4, (20, 40), generator=gen)
    )
    want = [metrics.adjusted_rand_score(t.numpy(), p.numpy()) for t, p in zip(true, pred, strict=True)]
    np.testing.assert_allclose(adjusted_rand_index(true, pred).numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "true, pred, message",
    [
        (torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.long), "shaped alike"),
        (torch.zeros(3), torch.zeros(3), "integers"),
        (torch.tensor([0, -1]), torch.tensor([0, 1]), "non-negative"),
    ],
)
def test_ari_rejects_bad_labels(true, pred, message):
    with pytest.raises(ValueError, match=message):
        adjusted_rand_index(true, pred)


# --------------------------------------------------------------------------- evaluate side


def test_gmm_ceiling_recovers_well_separated_clusters():
    from apg.tasks.gmm import bayes_assignments
    from pipeline.evaluate_particles import ari_scores

    gen = torch.Generator().manual_seed(1)
    c = torch.randint(3, (2, 50), generator=gen)
    mu = torch.tensor([[[-10.0, 0.0], [0.0, 10.0], [10.0, 0.0]]]).expand(2, -1, -1).double()
    tau = torch.full((2, 3, 2), 4.0, dtype=torch.float64)
    x = mu.gather(1, c.unsqueeze(-1).expand(-1, -1, 2)) + 0.5 * torch.randn(2, 50, 2, generator=gen).double()
    arrays = {"x": x.numpy(), "mu": mu.numpy(), "tau": tau.numpy(), "c": c.numpy()}
    best = bayes_assignments(arrays)
    assert best.shape == (2, 50)
    np.testing.assert_array_equal(best, c.numpy())
    np.testing.assert_allclose(ari_scores(c.numpy(), best), [1.0, 1.0])
    assert np.isnan(ari_scores(c.numpy(), None)).all()


@pytest.mark.parametrize("method", ["apg", "rws-mlp", "reparam"])
def test_final_particle_of_every_gmm_method(method):
    # The continuous-view baselines draw c from its exact conditional, so they have one too.
    from apg.tasks import get_task
    from apg.training import TrainConfig, build
    from pipeline.evaluate_particles import final_particle

    torch.manual_seed(0)
    cfg = TrainConfig(task="gmm", method=method, sweeps=2, particles=3, network={"hidden": 8}).validate()
    model, proposals = build(cfg)
    x = get_task("gmm").simulate(model, 5, torch.Generator().manual_seed(0), num_points=12)["x"].float()
    particle = final_particle(cfg, model, proposals, x, 2, 3, batch_size=2, resample_mode="block")
    c = particle["c"]
    assert c.shape == (5, 12) and c.dtype == np.int64 and ((c >= 0) & (c < 3)).all()
    assert particle["mu"].shape == (5, 3, 2)


def test_particle_scores_of_the_true_rings_beat_shuffled_ones():
    # The true latents score best on all three decoder-free measures; relabelling the rings
    # changes none of them, moving the centres or the assignments worsens each.
    from apg.tasks.dgmm import simulate_rings
    from pipeline.evaluate_particles import particle_scores

    data = {k: v.numpy() for k, v in simulate_rings(4, 100, torch.Generator().manual_seed(1)).items()}
    truth = {"arrays": data, "c": data["c"], "ari_ceiling": None}
    sizes = {"radius": 2.0}
    exact = particle_scores("dgmm", truth, {"c": data["c"], "mu": data["mu"]}, {}, sizes)
    relabel = np.array([2, 0, 3, 1])
    permuted = particle_scores(
        "dgmm", truth, {"c": relabel[data["c"]], "mu": data["mu"][:, np.argsort(relabel)]}, {}, sizes
    )
    for name in ("ari", "centre_err", "log_joint_true"):
        np.testing.assert_allclose(permuted[name], exact[name], atol=1e-9)
    np.testing.assert_allclose(exact["ari"], 1.0)
    np.testing.assert_allclose(exact["centre_err"], 0.0, atol=1e-12)
    moved = particle_scores("dgmm", truth, {"c": data["c"], "mu": data["mu"] + 0.5}, {}, sizes)
    np.testing.assert_allclose(moved["centre_err"], 0.5 * np.sqrt(2), rtol=1e-9)
    assert (moved["log_joint_true"] < exact["log_joint_true"] - 50).all()
    scrambled = particle_scores(
        "dgmm", truth, {"c": np.roll(data["c"], 1, axis=1), "mu": data["mu"]}, {}, sizes
    )
    assert (scrambled["ari"] < 0.2).all() and (
        scrambled["log_joint_true"] < exact["log_joint_true"] - 100
    ).all()
    none = particle_scores("dgmm", truth, None, {}, sizes)
    assert all(np.isnan(none[name]).all() for name in ("ari", "centre_err", "log_joint_true"))


def test_cell_roles_split_pairs_from_budget_entries(tiny):
    from pipeline.evaluate import cell_pairs, cell_roles

    params = tiny(
        **{
            "gmm.grid": [
                {"methods": ["apg", "rws-mlp"], "pairs": [[2, 3]], "seeds": [0]},
                {"methods": ["apg"], "budget": {"total": 6, "sweeps": [2, 3]}, "seeds": [0]},
            ]
        }
    )
    roles = cell_roles(params, "gmm")
    assert roles == {
        "gmm/apg/K2/L3/seed0": ["budget", "main"],
        "gmm/rws-mlp/K2/L3/seed0": ["main"],
        "gmm/apg/K3/L2/seed0": ["budget"],
    }
    everything = [(2, 3), (3, 2), (4, 3)]
    assert cell_pairs(["budget"], {"K": 3, "L": 2}, everything) == [(3, 2)]
    assert cell_pairs(["budget", "main"], {"K": 2, "L": 3}, everything) == everything


# --------------------------------------------------------------------------- plateau


def test_plateau_matches_ordinary_least_squares():
    rng = np.random.default_rng(0)
    it = np.arange(10, 1010, 10)
    value = -300 + 0.01 * it + rng.normal(0, 2.0, len(it))
    stat = report.plateau(it, value)
    window = it > 800
    t, v = it[window], value[window]
    (slope, _), cov = np.polyfit(t, v, 1, cov="unscaled")
    resid = v - np.polyval([slope, _], t)
    se_slope = math.sqrt(resid @ resid / (len(t) - 2) * cov[0, 0])
    span = t.max() - t.min()
    assert stat.points == window.sum() == 20
    assert (stat.start, stat.end) == (810, 1000)
    assert stat.final == pytest.approx(v.mean())
    assert stat.delta == pytest.approx(slope * span)
    assert stat.se == pytest.approx(se_slope * span)
    assert stat.z == pytest.approx(stat.delta / stat.se)


def test_plateau_verdicts():
    rng = np.random.default_rng(1)
    it = np.arange(1, 2001)
    flat = report.plateau(it, -280 + rng.normal(0, 1.0, len(it)))
    assert flat.plateaued is True and abs(flat.z) < 3
    rising = report.plateau(it, -280 + 0.01 * it + rng.normal(0, 1.0, len(it)))
    assert rising.plateaued is False and rising.z > 3 and rising.delta == pytest.approx(4.0, rel=0.2)
    few = report.plateau(np.array([2, 4, 6]), np.array([-3.0, -2.0, -1.0]))
    assert few.points == 1 and few.plateaued is None and math.isnan(few.z)
    four = report.plateau(np.arange(1, 21), np.arange(20.0))  # 4 points in the window
    assert four.points == 4 and four.plateaued is None
    straight = report.plateau(np.arange(1, 101), np.arange(100.0))  # no noise: a trend is a trend
    assert straight.plateaued is False and straight.z == math.inf
    assert report.plateau(np.array([]), np.array([])).points == 0


# --------------------------------------------------------------------------- synthetic results


def cell(method, k, l, seed, roles=("main",), iterations=1000):
    cid = f"{method}-K{k}-L{l}-s{seed}"
    return {
        "cell_id": cid,
        "name": f"gmm/{method}/K{k}/L{l}/seed{seed}",
        "method": method,
        "K": k,
        "L": l,
        "seed": seed,
        "iterations": iterations,
        "mean_it_per_s": 10.0,
        "checkpoint": "",
        "mlflow_run_id": None,
        "roles": list(roles),
    }


def metric_rows(c, k, l, values: dict[str, list[float]]) -> pd.DataFrame:
    """Final-sweep rows of one cell at test pair (k, l): ``{metric: per-dataset values}``."""
    frames = []
    for metric, per_dataset in values.items():
        frames.append(
            pd.DataFrame(
                {
                    "task": "gmm",
                    "method": c["method"],
                    "K": k,
                    "L": l,
                    "seed": c["seed"],
                    "train_K": c["K"],
                    "train_L": c["L"],
                    "cell_id": c["cell_id"],
                    "test_set": "test",
                    "test_sizes": "{}",
                    "dataset": np.arange(len(per_dataset)),
                    "sweep": k,
                    "metric": metric,
                    "value": np.asarray(per_dataset, dtype=float),
                }
            )
        )
    return pd.concat(frames, ignore_index=True)[COLUMNS]


def seeds_frame(method, means_by_pair, metric="log_joint", seeds=(0, 1, 2), spread=0.1, roles=("main",)):
    """Cells of ``method`` (one per seed, trained at (5, 10)) whose per-seed dataset mean of
    ``metric`` at each test pair is ``means_by_pair[pair] + offset(seed)``."""
    cells, frames = [], []
    for seed in seeds:
        c = cell(method, 5, 10, seed, roles)
        cells.append(c)
        for (k, l), mean in means_by_pair.items():
            m = mean + spread * (seed - 1)
            frames.append(metric_rows(c, k, l, {metric: [m - 1.0, m, m + 1.0]}))
    return cells, pd.concat(frames, ignore_index=True)


def test_an_estimate_from_one_seed_prints_without_an_interval():
    one = report.seed_interval([5.0, float("nan")])
    assert one.mean == 5.0 and one.n == 1 and math.isnan(one.lo)
    assert _est(one) == "5.000 (interval n/a, 1 seed)"


def test_threshold_and_increasing_claims():
    cells, fin = seeds_frame(
        "apg", {(5, 10): 0.90, (10, 10): 0.96, (15, 10): 0.97}, metric="ess_c", spread=0.001
    )
    spec = {
        "id": "x",
        "claim": "c",
        "kind": "threshold",
        "metric": "ess_c",
        "method": "apg",
        "pair": [10, 10],
    }
    ok = report.check_claim({**spec, "op": ">=", "target": 0.95}, "gmm", fin, fin.iloc[:0])
    assert ok.passed is True and ok.note == "" and ok.value == pytest.approx(0.96)
    assert ok.lo < 0.96 < ok.hi and "[" in ok.ours
    assert report.check_claim({**spec, "op": ">=", "target": 0.99}, "gmm", fin, fin.iloc[:0]).passed is False
    assert report.check_claim({**spec, "op": "<=", "target": 0.99}, "gmm", fin, fin.iloc[:0]).passed is True
    missing = report.check_claim(
        {**spec, "pair": [7, 7], "op": ">=", "target": 0.9}, "gmm", fin, fin.iloc[:0]
    )
    assert missing.passed is None and report.verdict(missing) == "not run"

    inc = {**spec, "kind": "increasing", "pairs": [[5, 10], [10, 10], [15, 10]]}
    result = report.check_claim(inc, "gmm", fin, fin.iloc[:0])
    assert result.passed is True and "changes 5→10: 0.06 [" in result.ours
    dec = {**inc, "pairs": [[10, 10], [5, 10], [15, 10]]}
    result = report.check_claim(dec, "gmm", fin, fin.iloc[:0])
    assert result.passed is False and len(result.value) == 3
    # 0.90 at K=5: room to rise below a ceiling of 1 with margin 0.02, none below 0.91
    assert report.check_claim(
        {**inc, "ceiling": 1.0, "ceiling_margin": 0.02}, "gmm", fin, fin.iloc[:0]
    ).passed
    at_ceiling = report.check_claim(
        {**inc, "ceiling": 0.91, "ceiling_margin": 0.02}, "gmm", fin, fin.iloc[:0]
    )
    assert at_ceiling.passed is None and report.verdict(at_ceiling) == "at ceiling: not testable here"
    # near the ceiling but falling (0.96 -> 0.90): a failure, not an exemption
    falling = report.check_claim({**dec, "ceiling": 1.0, "ceiling_margin": 0.05}, "gmm", fin, fin.iloc[:0])
    assert falling.passed is False and falling.note == ""


def test_increasing_pairs_each_cell_with_itself():
    # Seeds far apart (wide, overlapping intervals at every K) that each gain 0.01 from K=5
    # to K=10 hold the claim; when one seed loses instead, the change's interval takes in 0
    # although the means still increase.
    cells, fin = seeds_frame("apg", {(5, 10): 0.90, (10, 10): 0.91}, metric="ess_c", spread=0.05)
    spec = {"id": "x", "claim": "c", "kind": "increasing", "metric": "ess_c", "method": "apg"}
    inc = {**spec, "pairs": [[5, 10], [10, 10]]}
    lo = report.seed_estimate(fin, "apg", "ess_c", (5, 10))
    hi = report.seed_estimate(fin, "apg", "ess_c", (10, 10))
    assert hi.lo < lo.hi
    assert report.check_claim(inc, "gmm", fin, fin.iloc[:0]).passed is True
    at_10 = (fin["K"] == 10) & (fin["seed"] == 0)
    mixed = fin.assign(value=fin["value"] - np.where(at_10, 0.02, 0.0))
    assert report.seed_estimate(mixed, "apg", "ess_c", (10, 10)).mean > lo.mean
    assert report.check_claim(inc, "gmm", mixed, mixed.iloc[:0]).passed is False


def test_comparison_claims_use_the_intervals():
    _, apg = seeds_frame("apg", {(10, 10): -275.0})
    _, near = seeds_frame("gibbs", {(10, 10): -275.05})
    _, far = seeds_frame("rws-mlp", {(10, 10): -290.0})
    fin = pd.concat([apg, near, far], ignore_index=True)
    spec = {"id": "x", "claim": "c", "metric": "log_joint", "method": "apg", "pair": [10, 10]}
    above = report.check_claim({**spec, "kind": "above", "other": "rws-mlp"}, "gmm", fin, fin.iloc[:0])
    assert above.passed is True and above.target_value["method"] == "rws-mlp"
    # Means differ by 0.05 and the seeds spread by 0.1: not "above"; equivalent within ±1 but
    # not shown within ±0.1 (the difference's 90% interval is wider than that).
    assert (
        report.check_claim({**spec, "kind": "above", "other": "gibbs"}, "gmm", fin, fin.iloc[:0]).passed
        is False
    )
    equivalent = {**spec, "kind": "equivalent", "other": "gibbs"}
    assert report.check_claim({**equivalent, "margin": 1.0}, "gmm", fin, fin.iloc[:0]).passed is True
    assert report.check_claim({**equivalent, "margin": 0.1}, "gmm", fin, fin.iloc[:0]).passed is False
    far_off = report.check_claim({**equivalent, "margin": 1.0, "other": "rws-mlp"}, "gmm", fin, fin.iloc[:0])
    assert far_off.passed is False
    assert "within ±1.0 of gibbs" in report.claim_target({**equivalent, "margin": 1.0})
    assert report.check_claim({**spec, "kind": "at_least", "other": "gibbs"}, "gmm", fin, fin.iloc[:0]).passed


def test_comparisons_test_the_difference_not_overlap():
    # Two methods 0.7 apart whose seeds spread by 0.2: their own 95% intervals overlap, yet
    # the difference's interval excludes 0 (overlap of two intervals is a much stricter test
    # than the 95% one the claim asks for). Within noise, then, it is not.
    _, apg = seeds_frame("apg", {(10, 10): -275.0}, spread=0.2)
    _, other = seeds_frame("rws-lstm", {(10, 10): -275.7}, spread=0.2)
    fin = pd.concat([apg, other], ignore_index=True)
    spec = {
        "id": "x",
        "claim": "c",
        "metric": "log_joint",
        "method": "apg",
        "pair": [10, 10],
        "other": "rws-lstm",
    }
    a = report.seed_estimate(fin, "apg", "log_joint", (10, 10))
    b = report.seed_estimate(fin, "rws-lstm", "log_joint", (10, 10))
    assert a.lo < b.hi  # the intervals overlap
    above = report.check_claim({**spec, "kind": "above"}, "gmm", fin, fin.iloc[:0])
    assert above.passed is True and "difference 0.700 [" in above.ours
    assert above.target_value["difference"][1] > 0
    assert report.check_claim({**spec, "kind": "below"}, "gmm", fin, fin.iloc[:0]).passed is False
    assert (
        report.check_claim({**spec, "kind": "equivalent", "margin": 0.5}, "gmm", fin, fin.iloc[:0]).passed
        is False
    )
    assert above.detectable == pytest.approx(
        (stats.t.ppf(0.975, 4) + stats.t.ppf(0.8, 4)) * math.sqrt(2 * 0.2**2 / 3)
    )


def test_a_metric_above_another_of_the_same_cells_is_paired():
    # Seeds spread by 0.1 in every metric alike: the blocks' ESS 0.02 and 0.3 above the sweep's
    # hold the claim although the unpaired intervals overlap; a block below it fails it.
    frames = [
        seeds_frame("apg", {(10, 10): mean}, metric=metric)[1]
        for metric, mean in (("sweep_ess", 0.40), ("ess_globals", 0.42), ("ess_c", 0.70))
    ]
    fin = pd.concat(frames, ignore_index=True)
    spec = {"id": "x", "claim": "c", "kind": "above_metric", "method": "apg", "pair": [10, 10],
            "metrics": ["ess_globals", "ess_c"], "other_metric": "sweep_ess"}  # fmt: skip
    a, b = (report.seed_estimate(fin, "apg", m, (10, 10)) for m in ("ess_globals", "sweep_ess"))
    assert a.lo < b.hi
    held = report.check_claim(spec, "gmm", fin, fin.iloc[:0])
    assert (
        held.passed is True
        and "ess_globals 0.420" in held.ours
        and held.target_value["value"] == pytest.approx(0.4)
    )
    lower = fin.assign(value=fin["value"] - np.where(fin["metric"] == "ess_c", 0.35, 0.0))
    assert report.check_claim(spec, "gmm", lower, lower.iloc[:0]).passed is False
    assert (
        report.verdict(report.check_claim({**spec, "other_metric": "nothing"}, "gmm", fin, fin.iloc[:0]))
        == "not run"
    )


def test_claims_on_fewer_than_three_seeds_get_no_verdict():
    _, apg = seeds_frame("apg", {(10, 10): -275.0}, seeds=(0,))
    _, rws = seeds_frame("rws-mlp", {(10, 10): -290.0}, seeds=(0,))
    fin = pd.concat([apg, rws], ignore_index=True)
    spec = {
        "id": "x",
        "claim": "c",
        "metric": "log_joint",
        "method": "apg",
        "pair": [10, 10],
        "other": "rws-mlp",
    }
    for kind in ("above", "below", "at_least"):
        claim = report.check_claim({**spec, "kind": kind}, "gmm", fin, fin.iloc[:0])
        assert claim.passed is None and report.verdict(claim) == "n/a (1 seed)"
    assert "interval n/a, 1 seed" in claim.ours
    threshold = {**spec, "kind": "threshold", "op": ">=", "target": -300.0}
    assert report.verdict(report.check_claim(threshold, "gmm", fin, fin.iloc[:0])) == "n/a (1 seed)"


def test_budget_claim_uses_the_retrained_cells_at_their_own_pair():
    frames, meta_cells = [], []
    for k, l, mean in ((2, 25, -285.0), (5, 10, -280.0), (10, 5, -276.0)):
        for seed in range(3):
            c = cell("apg", k, l, seed, roles=("budget",))
            meta_cells.append(c)
            m = mean + 0.1 * seed
            frames.append(metric_rows(c, k, l, {"log_joint": [m - 1, m, m + 1]}))
            # the same cell at another pair must not count
            frames.append(metric_rows(c, 1, 50, {"log_joint": [0.0, 0.0, 0.0]}))
    everything = pd.concat(frames, ignore_index=True)
    retrained = report.retrained_rows(everything, {"cells": meta_cells})
    assert set(zip(retrained["K"], retrained["L"], strict=True)) == {(2, 25), (5, 10), (10, 5)}
    spec = {"id": "x", "claim": "c", "kind": "budget_above", "metric": "log_joint", "method": "apg"}
    result = report.check_claim(spec, "gmm", retrained.iloc[:0], report.finals(retrained))
    assert result.passed is True and result.value == pytest.approx([-284.9, -279.9, -275.9])
    assert "K=2 L=25" in result.ours and "K=10 L=5" in result.ours
    empty = report.check_claim(spec, "gmm", retrained.iloc[:0], retrained.iloc[:0])
    assert report.verdict(empty) == "not run"


def test_caption_gives_each_methods_training_length():
    cells = [
        {"method": m, "iterations": n}
        for m, n in [("apg", 8000), ("apg", 8000), ("rws-mlp", 8000), ("hmc-rws", 1500), ("gibbs", 0)]
    ]
    meta = {"iterations": [0, 1500, 8000], "cells": cells}
    assert report.training_length(meta) == "8000 training iterations (hmc-rws 1500; gibbs untrained)"
    # a method whose grid entries trained for different lengths keeps both counts
    cells += [{"method": "reparam", "iterations": 3000}, {"method": "reparam", "iterations": 4500}]
    assert report.training_length(meta).endswith("(reparam 3000/4500; hmc-rws 1500; gibbs untrained)")
    assert report.training_length({"iterations": [100], "cells": cells[:1]}) == "8000 training iterations"


def test_main_rows_keep_figure2_cells_out_of_the_tables():
    main = cell("apg", 5, 10, 0, roles=("main", "budget"))
    budget_only = cell("apg", 10, 5, 0, roles=("budget",))
    only_budget_method = cell("avf", 3, 4, 0, roles=("budget",))
    old = {k: v for k, v in cell("rws-mlp", 5, 10, 0).items() if k != "roles"}
    meta = {"cells": [main, budget_only, only_budget_method, old]}
    frame = pd.concat([metric_rows(c, 10, 5, {"log_joint": [1.0]}) for c in meta["cells"]], ignore_index=True)
    kept = set(report.main_rows(frame, meta)["cell_id"])
    assert kept == {main["cell_id"], only_budget_method["cell_id"], old["cell_id"]}
    assert set(report.retrained_rows(frame, meta)["cell_id"]) == {budget_only["cell_id"]}


# --------------------------------------------------------------------------- the stage on synthetic results


def write_results(root, with_training_trend: bool):
    """A results/eval/gmm directory: APG and RWS-MLP main cells (3 seeds), APG retrained
    at (2, 25) and (10, 5), a gibbs cell with nothing to learn."""
    meta_cells, frames, histories = [], [], []
    rng = np.random.default_rng(0)
    pairs = [(5, 10), (10, 10), (15, 10), (50, 10)]
    for seed in range(3):
        specs = [
            ("apg", 5, 10, ("main", "budget"), -276.0),
            ("rws-mlp", 5, 10, ("main",), -290.0),
            ("gibbs", 5, 10, ("main",), -275.5),
            ("apg", 2, 25, ("budget",), -282.0),
            ("apg", 10, 5, ("budget",), -275.0),
        ]
        for method, k, l, roles, level in specs:
            c = cell(method, k, l, seed, roles, iterations=0 if method == "gibbs" else 1000)
            meta_cells.append(c)
            evaluated = [(k, l)] if roles == ("budget",) else pairs + [(2, 25), (10, 5)]
            for tk, tl in evaluated:
                m = level + 0.1 * tk + 0.05 * seed
                values = {
                    "log_joint": rng.normal(m, 1.0, 4),
                    "ess": rng.uniform(0.5, 0.9, 4),
                    "ari": rng.uniform(0.8, 0.9, 4),
                    "ari_ceiling": np.full(4, 0.92),
                }
                if method != "rws-mlp":
                    values |= {
                        "ess_globals": np.full(4, 0.96 + 0.001 * tk),
                        "ess_c": np.full(4, 0.8 + 0.001 * tk),
                        "kl_globals": np.full(4, 0.004),
                        "kl_c": np.full(4, 0.003),
                    }
                frames.append(metric_rows(c, tk, tl, values))
            if c["iterations"]:
                it = np.arange(10, 1010, 10)
                trend = 0.02 * it if (with_training_trend and method == "rws-mlp" and seed == 0) else 0.0
                value = level - 50 * np.exp(-it / 100) + trend + rng.normal(0, 1.0, len(it))
                histories.append(
                    pd.DataFrame({"iteration": it, "metric": "log_joint", "value": value}).assign(
                        task="gmm", method=method, K=k, L=l, seed=seed, cell_id=c["cell_id"]
                    )
                )
    out = root / "results" / "eval" / "gmm"
    out.mkdir(parents=True)
    pd.concat(frames, ignore_index=True).to_parquet(out / "metrics.parquet", index=False)
    pd.concat(histories, ignore_index=True).to_parquet(out / "training.parquet", index=False)
    np.savez(out / "samples.npz", none=np.zeros(1))
    meta = {
        "task": "gmm",
        "iterations": [0, 1000],
        "train_datasets": 100,
        "train_sizes": {},
        "test_datasets": 4,
        "test_sizes": {},
        "test_sets": [
            {"name": "test", "file": "test.npz", "num_datasets": 4, "shape": [4, 60, 2], "sizes": {}}
        ],
        "batch_size": 20,
        "lr": 0.01,
        "seeds": [0, 1, 2],
        "cells": meta_cells,
        "pairs": [list(p) for p in pairs],
        "budget": {"total": 50, "pairs": [[2, 25], [5, 10], [10, 5]]},
        "baseline": "rws-mlp",
        "figure_sets": [],
        "samples": [],
    }
    (out / "meta.json").write_text(json.dumps(meta))


@pytest.fixture
def synthetic_report(tmp_path):
    write_results(tmp_path, with_training_trend=True)
    params = {
        "tasks": ["gmm"],
        "report": {"out": "reports", "figure_format": "png", "scale": "synthetic"},
    }
    torch.set_num_threads(1)
    report.make_report(params, tmp_path)
    return tmp_path / "reports"


def test_report_opens_with_the_claims_table(synthetic_report):
    text = (synthetic_report / "README.md").read_text()
    lines = text.splitlines()
    assert lines[0] == "# Reproduction report"
    body = [line for line in lines[1:] if line and not line.startswith("<!--") and not line.startswith(">")]
    assert body[0].startswith("**Scale: synthetic.**")
    assert body[1] == "## Claims of the paper, checked"
    claims = [line for line in lines if line.startswith("| gmm |")]
    claim_ids = yaml.safe_load(report.PAPER_NUMBERS.read_text())["gmm"]["claims"]
    assert len(claims) == len(claim_ids)
    verdicts = [line.rstrip(" |").split("| ")[-1].strip() for line in claims]
    assert set(verdicts) <= {"✓", "✗", "–", "not run"}, verdicts
    lstm = next(line for line in claims if "RWS LSTM" in line)
    assert lstm.endswith("| not run |")  # no rws-lstm cells in these results
    # tasks not run: their claims are listed as not run; bmnist has none yet
    assert "| dgmm |" in text and "not run (task not in this run)" in text
    assert "Verdict rules:" in text

    metrics = json.loads((synthetic_report / "data" / report.FULL_METRICS).read_text())
    checked = metrics["claims"]
    assert checked["gmm/apg_ess_globals"]["pass"] is True
    assert checked["gmm/apg_log_joint_above_rws_mlp"]["pass"] is True
    assert checked["gmm/apg_kl_c"]["pass"] is True
    assert checked["gmm/apg_ari_vs_gibbs_stationary"]["pass"] is True  # both ARIs drawn from U(0.8, 0.9)
    budget = checked["gmm/apg_budget_more_sweeps"]
    assert len(budget["value"]) == 3 and budget["pass"] is True
    assert checked["dgmm/apg_ess_mu_with_K"]["pass"] is None


def test_metrics_json_is_a_short_headline_of_the_verdicts(synthetic_report):
    # `dvc metrics show` prints one column per number: metrics.json keeps a verdict per claim
    # and the counts, the long form sits in data/ where DVC does not read it as a metric.
    headline = json.loads((synthetic_report / "metrics.json").read_text())
    full = json.loads((synthetic_report / "data" / report.FULL_METRICS).read_text())["claims"]

    def leaves(node, prefix=""):
        for key, value in node.items():
            assert "." not in key and "/" not in key, key  # DVC joins nested keys with "."
            yield from (
                leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]
            )

    flat = dict(leaves(headline))
    assert len(flat) <= 50
    for key, claim in full.items():
        task, claim_id = key.split("/")
        assert flat[f"{task}.{claim_id}"] == (None if claim["pass"] is None else int(claim["pass"])), key
    judged = [c for c in full.values() if c["pass"] is not None]
    assert headline["claims"] == {
        "held": sum(c["pass"] for c in judged),
        "judged": len(judged),
        "total": len(full),
    }


def test_training_table_flags_cells_that_have_not_plateaued(synthetic_report):
    table = pd.read_csv(synthetic_report / "tables" / "gmm_training.csv")
    assert len(table) == 15
    verdicts = dict(zip(table["cell_id"], table["plateaued"], strict=True))
    assert verdicts["rws-mlp-K5-L10-s0"] == "no"
    assert verdicts["gibbs-K5-L10-s0"] == "not trained"
    assert verdicts["apg-K5-L10-s1"] == "yes"
    md = (synthetic_report / "tables" / "gmm_training.md").read_text()
    assert "| `gmm/rws-mlp/K5/L10/seed0` |" in md and "no †" in md

    # Rows from the not-plateaued cell carry the mark, with its footnote, and only those.
    table1 = (synthetic_report / "tables" / "gmm_table1.md").read_text()
    assert "| rws-mlp † | 10 | 10 |" in table1 and "| apg | 10 | 10 |" in table1
    assert "† not plateaued: see the training table" in table1
    methods = pd.read_csv(synthetic_report / "tables" / "gmm_methods.csv")
    assert set(methods[methods["flag"].fillna("") == "†"]["method"]) == {"rws-mlp"}
    readme = (synthetic_report / "README.md").read_text()
    claim = next(line for line in readme.splitlines() if "beats the RWS MLP" in line)
    assert "†" in claim


def test_tables_use_main_cells_and_the_budget_figure_exists(synthetic_report):
    table1 = pd.read_csv(synthetic_report / "tables" / "gmm_table1.csv")
    # the APG row at (10, 5) of Table 1's pairs is absent: (10, 5) is only a budget pair,
    # and the retrained (10, 5) cells do not enter Table 1
    assert sorted(set(zip(table1["method"], table1["K"], strict=True))) == [
        (method, k) for method in ("apg", "gibbs", "rws-mlp") for k in (5, 10, 15, 50)
    ]
    assert {"ari", "ari_ceiling"} <= set(table1.columns)
    methods = pd.read_csv(synthetic_report / "tables" / "gmm_methods.csv")
    apg = methods[(methods["method"] == "apg") & (methods["K"] == 10)]
    assert apg["cells"].str.contains("K5-L10").all() and not apg["cells"].str.contains("K10-L5").any()
    for name in ("gmm_budget.png", "gmm_training.png"):
        assert (synthetic_report / "figures" / name).stat().st_size > 10_000


# --------------------------------------------------------------------------- evaluate -> report, no Ray


def fake_sweep(root, params) -> None:
    """``results/gmm/sweep.json`` and its cells as the sweep stage writes them, trained for
    a few steps here instead of by Ray (grid_cells gives the same cells the sweep would)."""
    from apg.checkpoint import save_checkpoint
    from apg.data import load_dataset
    from apg.training import Trainer
    from pipeline.common import file_digest
    from pipeline.config import grid_cells

    train_x = torch.from_numpy(load_dataset(root / "data" / "gmm" / "train.npz")["x"])
    cells = []
    for i, c in enumerate(grid_cells(params, "gmm")):
        torch.manual_seed(i)
        trainer = Trainer(c.train, train_x)
        history = [{"iteration": trainer.iteration, **row} for row in trainer.run()]
        cell_dir = root / "cells" / f"cell{i}"
        model = save_checkpoint(cell_dir / "model.pt", c.train.to_dict(), trainer.state_dict())
        pd.DataFrame(history).to_csv(cell_dir / "history.csv", index=False)
        cells.append(
            {
                "cell_id": f"cell{i}",
                "name": c.name,
                "method": c.method,
                "K": c.sweeps,
                "L": c.particles,
                "seed": c.seed,
                "iterations": trainer.iteration,
                "mean_it_per_s": 1.0,
                "checkpoint": f"cells/cell{i}/model.pt",
                "checkpoint_sha256": file_digest(model),
                "history": f"cells/cell{i}/history.csv",
            }
        )
    (root / "results" / "gmm").mkdir(parents=True)
    (root / "results" / "gmm" / "sweep.json").write_text(json.dumps({"cells": cells}))


def test_evaluate_and_report_budget_cells_and_cluster_recovery(tmp_path, tiny):
    from pipeline.evaluate import evaluate_task
    from pipeline.generate import generate

    torch.set_num_threads(1)
    params = tiny(
        **{
            "gmm.train.iterations": 2,
            "gmm.grid": [
                {"methods": ["apg", "rws-mlp"], "pairs": [[2, 3]], "seeds": [0]},
                {"methods": ["apg"], "budget": {"total": 6, "sweeps": [2, 3]}, "seeds": [0]},
            ],
            "gmm.evaluate.sweep_resampling": True,
        }
    )
    generate("gmm", params, tmp_path / "data" / "gmm")
    fake_sweep(tmp_path, params)
    meta = evaluate_task(params, "gmm", tmp_path, tmp_path / "results" / "eval" / "gmm")

    roles = {c["name"]: c["roles"] for c in meta["cells"]}
    assert roles == {
        "gmm/apg/K2/L3/seed0": ["budget", "main"],
        "gmm/rws-mlp/K2/L3/seed0": ["main"],
        "gmm/apg/K3/L2/seed0": ["budget"],
    }
    frame = pd.read_parquet(tmp_path / "results" / "eval" / "gmm" / "metrics.parquet")
    budget_only = next(c["cell_id"] for c in meta["cells"] if c["roles"] == ["budget"])
    own = frame[frame["cell_id"] == budget_only]
    assert set(zip(own["K"], own["L"], strict=True)) == {(3, 2)}  # its own pair only
    assert budget_only not in {s["cell_id"] for s in meta["samples"]}  # pictures: main cells
    ari = frame[frame["metric"] == "ari"]
    ceiling = frame[frame["metric"] == "ari_ceiling"]
    # every (cell, pair) has one ARI per held-out dataset, at the final sweep, and finite
    per_run = ari.groupby(["cell_id", "K", "L"])
    assert (per_run["dataset"].nunique() == 3).all() and (per_run["sweep"].max() == per_run["K"].max()).all()
    assert ari["value"].between(-1, 1).all() and ari["value"].map(math.isfinite).all()
    # the ceiling depends on the data only: one value per dataset whatever the cell
    assert (ceiling.groupby("dataset")["value"].nunique() == 1).all()
    assert len(ceiling) == len(ari)
    # The per-sweep-resampling run draws as the per-block one until it first resamples: the
    # same ESS after sweep 1, and for RWS (one step, nothing to resample) at every sweep.
    ess = (
        frame[frame["metric"].isin(["ess", "sweep_ess"])]
        .pivot_table(
            index=["cell_id", "method", "K", "L", "dataset", "sweep"], columns="metric", values="value"
        )
        .reset_index()
    )
    assert len(ess) and ess["sweep_ess"].notna().all()
    first = ess[(ess["sweep"] == 1) | (ess["method"] == "rws-mlp")]
    assert np.allclose(first["ess"], first["sweep_ess"], rtol=1e-5)
    later = ess[(ess["sweep"] > 1) & (ess["method"] == "apg")]
    assert not np.allclose(later["ess"], later["sweep_ess"])

    report.make_report(params, tmp_path)
    reports = tmp_path / "reports"
    table1 = pd.read_csv(reports / "tables" / "gmm_table1.csv")
    assert table1["ari"].map(math.isfinite).all() and table1["ari_ceiling"].map(math.isfinite).all()
    # the paper's overall ESS stands beside the per-sweep one, none beside the last block's
    assert "paper_sweep_ess" in table1 and "paper_ess" not in table1
    training = pd.read_csv(reports / "tables" / "gmm_training.csv")
    assert len(training) == 3 and set(training["plateaued"]) == {"not assessable"}  # 1 logged point each
    readme = (reports / "README.md").read_text()
    assert "apg ‡" in (reports / "tables" / "gmm_table1.md").read_text()
    assert "## Claims of the paper, checked" in readme
    claims = json.loads((reports / "data" / report.FULL_METRICS).read_text())["claims"]
    assert claims["gmm/apg_ess_globals"]["pass"] is None  # no (10, 10) in these results: not run
    assert (reports / "figures" / "gmm_budget.png").is_file()


def test_below_claims_across_test_sets_and_budgets():
    # Errors: lower is better. The claim names its held-out set and the other method's pair.
    _, apg = seeds_frame("apg", {(4, 4): 2.0}, metric="pos_err")
    _, avf = seeds_frame("avf", {(1, 4): 9.0}, metric="pos_err")
    _, apg_long = seeds_frame("apg", {(4, 4): 8.0}, metric="pos_err")
    curves = pd.concat(
        [apg.assign(test_set="T5_D2"), avf.assign(test_set="T5_D2"), apg_long.assign(test_set="T20_D2")],
        ignore_index=True,
    )
    spec = {"id": "x", "claim": "c", "metric": "pos_err", "method": "apg", "pair": [4, 4]}
    below = {**spec, "kind": "below", "other": "avf", "other_pair": [1, 4], "test_set": "T5_D2"}
    result = report.check_claim(below, "bmnist", curves.iloc[:0], curves.iloc[:0], curves)
    assert result.passed is True and result.ours.startswith("T5_D2, apg K=4 L=4")
    assert "avf K=1 L=4" in result.ours and "at K=1 L=4" in result.target
    # The same comparison at the same pair finds no AVF cell there.
    same_pair = {k: v for k, v in below.items() if k != "other_pair"}
    assert (
        report.verdict(report.check_claim(same_pair, "bmnist", curves.iloc[:0], curves.iloc[:0], curves))
        == "not run"
    )
    tracks = {**spec, "kind": "threshold", "op": "<=", "target": 3}
    assert report.check_claim(
        {**tracks, "test_set": "T5_D2"}, "bmnist", curves, curves.iloc[:0], curves
    ).passed
    longer = report.check_claim({**tracks, "test_set": "T20_D2"}, "bmnist", curves, curves.iloc[:0], curves)
    assert longer.passed is False and longer.value == pytest.approx(8.0)
    absent = report.check_claim({**tracks, "test_set": "T100_D5"}, "bmnist", curves, curves.iloc[:0], curves)
    assert report.verdict(absent) == "not run"


def test_a_claim_can_take_the_method_after_an_earlier_sweep():
    # AVF's step costs what APG's first three sweeps cost: APG is compared after sweep 3
    # (worse than after its last, here), AVF after its last.
    cells, last = seeds_frame("apg", {(4, 4): 2.0}, metric="pos_err")
    third = pd.concat(
        [metric_rows(c, 4, 4, {"pos_err": [9.5, 9.6, 9.7]}).assign(sweep=3) for c in cells], ignore_index=True
    )
    _, avf = seeds_frame("avf", {(1, 4): 9.0}, metric="pos_err")
    curves = pd.concat([third, last, avf], ignore_index=True).assign(test_set="T5_D1")
    spec = {
        "id": "x",
        "claim": "c",
        "kind": "below",
        "metric": "pos_err",
        "method": "apg",
        "pair": [4, 4],
        "other": "avf",
        "other_pair": [1, 4],
        "test_set": "T5_D1",
    }
    assert report.check_claim(spec, "bmnist", curves.iloc[:0], curves.iloc[:0], curves).passed is True
    at_third = report.check_claim({**spec, "sweep": 3}, "bmnist", curves.iloc[:0], curves.iloc[:0], curves)
    assert at_third.passed is False and at_third.value == pytest.approx(9.6)
    assert "apg K=4 L=4 after sweep 3" in at_third.ours and "avf K=1 L=4" in at_third.ours
    threshold = {**spec, "kind": "threshold", "op": "<=", "target": 3, "sweep": 3}
    assert report.check_claim(threshold, "bmnist", curves.iloc[:0], curves.iloc[:0], curves).passed is False
    with pytest.raises(ValueError, match="takes no sweep"):
        report.check_claim(
            {**spec, "kind": "falls_over_sweeps", "sweep": 3}, "bmnist", curves, curves, curves
        )


def test_falls_over_sweeps_compares_the_first_and_last_sweep():
    cells, last = seeds_frame("apg", {(4, 4): 0.02}, metric="mse", spread=0.001)
    first = pd.concat(
        [metric_rows(c, 4, 4, {"mse": [0.05, 0.05, 0.05]}).assign(sweep=1) for c in cells], ignore_index=True
    )
    curves = pd.concat([first, last], ignore_index=True)
    spec = {
        "id": "x",
        "claim": "c",
        "kind": "falls_over_sweeps",
        "metric": "mse",
        "method": "apg",
        "pair": [4, 4],
    }
    falls = report.check_claim(spec, "bmnist", report.finals(curves), curves.iloc[:0], curves)
    assert falls.passed is True and falls.target_value == pytest.approx(0.05) and "sweep 1" in falls.ours
    rising = curves.assign(value=np.where(curves["sweep"] == 1, 0.01, curves["value"]))
    assert report.check_claim(spec, "bmnist", report.finals(rising), rising.iloc[:0], rising).passed is False


def test_falls_over_sweeps_pairs_each_cell_with_itself():
    # Seeds that differ a lot (wide, overlapping intervals at both sweeps) but each improve by
    # the same 0.004: the paired change is the claim, and it holds. When the seeds disagree on
    # the change's sign, it does not.
    cells, last = seeds_frame("apg", {(4, 4): 0.020}, metric="mse", spread=0.010)
    first = last.assign(sweep=1, value=last["value"] + 0.004)
    curves = pd.concat([first, last], ignore_index=True)
    spec = {
        "id": "x",
        "claim": "c",
        "kind": "falls_over_sweeps",
        "metric": "mse",
        "method": "apg",
        "pair": [4, 4],
    }
    before = report.seed_estimate(first, "apg", "mse", (4, 4))
    after = report.seed_estimate(last, "apg", "mse", (4, 4))
    assert before.lo < after.hi  # unpaired, the two intervals overlap
    falls = report.check_claim(spec, "bmnist", report.finals(curves), curves.iloc[:0], curves)
    assert falls.passed is True and "change -0.004 [" in falls.ours
    mixed = first.assign(value=first["value"] + np.where(first["seed"] == 0, -0.008, 0.0))
    curves = pd.concat([mixed, last], ignore_index=True)
    assert report.check_claim(spec, "bmnist", report.finals(curves), curves.iloc[:0], curves).passed is False
    one_seed = curves[curves["seed"] == 1]
    single = report.check_claim(spec, "bmnist", report.finals(one_seed), one_seed.iloc[:0], one_seed)
    assert single.passed is None and single.note == "n/a (1 seed)"


def convergence_curves(first_sweeps, sweeps=20, level=-100.0):
    """One APG cell per seed at (20, 10) whose dataset-mean log joint climbs from 30 nats
    below ``level`` and reaches it to within 0.5 at its seed's ``first_sweeps`` entry."""
    frames = []
    for seed, reach in enumerate(first_sweeps):
        c = cell("apg", 5, 10, seed)
        for k in range(1, sweeps + 1):
            gap = 30.0 * (reach - k) / reach + 0.5 if k < reach else -0.2 * ((k % 2) - 0.5)
            m = level - gap
            frames.append(metric_rows(c, 20, 10, {"log_joint": [m - 1.0, m, m + 1.0]}).assign(sweep=k))
    return pd.concat(frames, ignore_index=True)


def test_converges_within_reads_each_seeds_first_sweep_at_the_plateau():
    spec = {
        "id": "x",
        "claim": "c",
        "kind": "converges_within",
        "metric": "log_joint",
        "method": "apg",
        "pair": [20, 10],
        "sweeps": 12,
        "tolerance": 1.0,
        "plateau_sweeps": 5,
    }
    curves = convergence_curves([6, 7, 8, 7, 6])
    fin = report.finals(curves)
    fast = report.check_claim(spec, "gmm", fin, fin.iloc[:0], curves)
    assert fast.passed is True and fast.value == pytest.approx(6.8)
    assert "(per seed: 6, 7, 8, 7, 6)" in fast.ours and fast.hi < 12
    assert "≤ 12" in fast.target
    slow = convergence_curves([10, 14, 12, 15, 11])
    late = report.check_claim(spec, "gmm", report.finals(slow), slow.iloc[:0], slow)
    assert late.passed is False and late.value == pytest.approx(12.4)
    # with two seeds: no verdict
    two = convergence_curves([6, 7])
    assert (
        report.verdict(report.check_claim(spec, "gmm", report.finals(two), two.iloc[:0], two))
        == "n/a (2 seeds)"
    )
    assert (
        report.verdict(report.check_claim({**spec, "method": "gibbs"}, "gmm", fin, fin.iloc[:0], curves))
        == "not run"
    )


def test_stalled_seeds_count_the_runs_far_below_the_best():
    table = pd.DataFrame(
        {
            "method": ["apg"] * 3 + ["rws-mlp"] * 3 + ["gibbs"],
            "K": [5] * 7,
            "L": [10] * 7,
            "seed": [0, 1, 2, 0, 1, 2, 0],
            "final_log_joint": [-850.0, -900.0, -949.0, -1216.0, -6492.0, -1416.0, np.nan],
        }
    )
    stalled = report.stalled_seeds(table, 1000.0).set_index("method")
    assert stalled.loc["apg", "stalled"] == 0 and stalled.loc["rws-mlp", "stalled"] == 1
    assert stalled.loc["rws-mlp", "stalled_seeds"] == "1" and "gibbs" not in stalled.index
    text = report.stalled_markdown(stalled.reset_index(), 1000.0)
    assert "apg K=5 L=10: 0 of 3" in text and "rws-mlp K=5 L=10: 1 of 3 (seed 1)" in text
    assert report.stalled_markdown(report.stalled_seeds(table.iloc[:0], 1000.0), 1000.0) == ""


def test_a_clone_rebuilds_the_report_from_the_committed_rows(synthetic_report):
    # The report keeps the rows it read in reports/data/; with results/ gone (a clone that
    # trained nothing) --from-committed writes the same verdicts, tables and README, and
    # leaves the provenance record's account of what trained and evaluated as it was.
    root = synthetic_report.parent
    assert (synthetic_report / "data" / "gmm" / "metrics.parquet").is_file()
    before = {
        name: (synthetic_report / name).read_text()
        for name in ("README.md", "metrics.json", f"data/{report.FULL_METRICS}", "provenance.json")
    }
    tables = {p.name: p.read_text() for p in (synthetic_report / "tables").glob("*.csv")}
    shutil.rmtree(root / "results")
    recorded = {"commit": "abc", "code": {}, "params": {}, "fingerprints": {"gmm": {"c": {"cell_id": "c-1"}}}}
    (synthetic_report / "provenance.json").write_text(json.dumps(recorded))
    report.make_report(
        {"tasks": ["gmm"], "report": {"out": "reports", "figure_format": "png", "scale": "synthetic"}},
        root,
        from_committed=True,
    )
    for name in ("metrics.json", f"data/{report.FULL_METRICS}"):
        assert (synthetic_report / name).read_text() == before[name], name
    assert (synthetic_report / "README.md").read_text() == before["README.md"]
    assert {p.name: p.read_text() for p in (synthetic_report / "tables").glob("*.csv")} == tables
    after = json.loads((synthetic_report / "provenance.json").read_text())
    assert {k: after[k] for k in recorded} == recorded and "report_commit" in after


def files_of(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by its relative path, with its sha256 (files moved or
    replaced while it reads are left out)."""
    found = {}
    for p in sorted(folder.rglob("*")):
        try:
            if p.is_file():
                found[p.relative_to(folder).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
        except FileNotFoundError:
            continue
    return found


def differs(folder: Path, old: dict[str, str]) -> bool:
    """Whether a file under ``folder`` is not in ``old`` or not as it was there."""
    return any(old.get(name) != digest for name, digest in files_of(folder).items())


@pytest.mark.slow
def test_a_report_killed_mid_write_leaves_the_last_complete_report(synthetic_report, tiny):
    root = synthetic_report.parent
    (root / "params.yaml").write_text(yaml.safe_dump(tiny(**{"report.scale": "synthetic"})))
    rows = synthetic_report / "data" / "gmm" / "metrics.parquet"
    frame = pd.read_parquet(rows)
    frame.loc[frame["metric"] == "log_joint", "value"] += 1.0  # so the next report differs
    frame.to_parquet(rows, index=False)
    old = files_of(synthetic_report)
    staging = root / ".reports.staging"
    cmd = [sys.executable, "-m", "pipeline.report", "--from-committed"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Killed at the first changed file, wherever it is written (reports/ itself, were the
        # files written in place; long before the swap when they are staged).
        while proc.poll() is None and not (differs(staging, old) or differs(synthetic_report, old)):
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # as the machine going down would
        assert proc.wait(timeout=60) == -signal.SIGKILL, "the report finished before it could be killed"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert files_of(synthetic_report) == old  # the last complete report, every file of it

    subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True, timeout=600)
    new = files_of(synthetic_report)
    assert new.keys() == old.keys() and new["data/gmm/metrics.parquet"] == old["data/gmm/metrics.parquet"]
    assert new["README.md"] != old["README.md"] and not staging.exists()


def test_a_recorded_replication_adds_its_verdicts_and_counts_claims_holding_in_both(tmp_path):
    # The replication here is the same rows with RWS-MLP's log joint raised above APG's:
    # that claim holds in the main run and fails in the replication, so it drops out of the
    # count of claims holding in both runs.
    write_results(tmp_path, with_training_trend=False)
    run = tmp_path / "recorded" / "replicate"
    shutil.copytree(tmp_path / "results" / "eval" / "gmm", run / "eval" / "gmm")
    metrics = pd.read_parquet(run / "eval" / "gmm" / "metrics.parquet")
    raised = (metrics["method"] == "rws-mlp") & (metrics["metric"] == "log_joint")
    metrics.loc[raised, "value"] += 100.0
    metrics.to_parquet(run / "eval" / "gmm" / "metrics.parquet", index=False)
    (run / "params.yaml").write_text(
        yaml.safe_dump({"tasks": ["gmm"], "report": {"scale": "synthetic replication"}})
    )
    manifest = {
        "commit": "abc",
        "started": "s",
        "finished": "f",
        "wall_minutes_last_run": 1.0,
        "machine": "m",
        "code_digest": {},
        "profile": "replicate",
        "base": "params.yaml",
        "scale": "synthetic replication",
    }
    (run / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "README.md").write_text("# x\n\n## Results\n\n<!-- results:start -->\n<!-- results:end -->\n")
    params = {"tasks": ["gmm"], "report": {"out": "reports", "figure_format": "png", "scale": "synthetic"}}
    torch.set_num_threads(1)
    report.make_report(params, tmp_path)
    text = (tmp_path / "reports" / "README.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| task | claim"))
    assert header.endswith("| ✓/✗ [`replicate`](recorded/replicate/README.md) |")
    row = next(
        line
        for line in text.splitlines()
        if line.startswith("| gmm |") and "RWS MLP encoder at the same" in line
    )
    assert row.endswith("| ✓ | ✗ |")
    written = json.loads((tmp_path / "reports" / "data" / report.FULL_METRICS).read_text())
    main, again = written["claims"], written["replication_claims"]
    assert main["gmm/apg_log_joint_above_rws_mlp"]["pass"] is True
    assert again["gmm/apg_log_joint_above_rws_mlp"]["pass"] is False
    both = [k for k in main if main[k]["pass"] is not None and again.get(k, {}).get("pass") is not None]
    held = sum(main[k]["pass"] and again[k]["pass"] for k in both)
    headline = json.loads((tmp_path / "reports" / "metrics.json").read_text())["claims"]
    assert (headline["held_both"], headline["judged_both"]) == (held, len(both))
    readme = (tmp_path / "README.md").read_text()
    assert f"{held} of the {len(both)} claims with a verdict in both runs hold in both" in readme
    assert "](reports/recorded/replicate/README.md)" in readme


def test_every_claim_written_has_a_known_kind_and_an_unknown_kind_raises():
    # The claims of paper_numbers.yaml each name a registered kind with a rule and a target
    # text; a misspelt kind is an error, not a silently skipped claim.
    paper = yaml.safe_load(report.PAPER_NUMBERS.read_text())
    specs = [
        s
        for section in paper.values()
        for key in ("claims", "paper_scale_claims")
        for s in section.get(key) or []
    ]
    assert specs and {s["kind"] for s in specs} <= set(report.CLAIM_KINDS)
    assert all(report.claim_target(s) for s in specs)
    cells, fin = seeds_frame("apg", {(10, 10): 0.9}, metric="ess_c")
    with pytest.raises(ValueError, match="unknown kind 'treshold'"):
        report.check_claim(
            {"id": "x", "claim": "c", "kind": "treshold", "method": "apg"}, "gmm", fin, fin.iloc[:0]
        )


def test_the_evaluation_logs_each_cells_held_out_numbers_to_its_mlflow_run(tmp_path):
    from pipeline import tracking
    from pipeline.evaluate_mlflow import log_evaluation

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = tracking.client(uri)
    exp = client.create_experiment("apg")
    parent = client.create_run(exp).info.run_id
    child = client.create_run(exp).info.run_id
    summary = {"mlflow": {"tracking_uri": uri, "experiment_id": exp, "parent_run_id": parent}}
    frame = pd.DataFrame(
        {
            "cell_id": ["c1"] * 6 + ["c2"] * 2,
            "test_set": ["test"] * 8,
            "K": [5] * 8,
            "L": [10] * 8,
            "metric": ["log_joint"] * 4 + ["ari"] * 2 + ["ari"] * 2,
            "sweep": [1, 1, 5, 5, 5, 5, 5, 5],
            "value": [1.0, 2.0, 3.0, 5.0, 0.5, 0.7, 0.1, 0.2],
        }
    )
    assert log_evaluation(summary, {"c1": child}, frame) == 1  # c2 has no run: skipped
    logged = client.get_run(child).data.metrics
    assert logged == {"eval.test.K5L10.log_joint": 4.0, "eval.test.K5L10.ari": pytest.approx(0.6)}
    assert log_evaluation({}, {"c1": child}, frame) == 0  # a sweep that logged nothing


def test_the_report_stage_clears_a_stale_line_in_the_readme(tmp_path):
    # `provenance mark` left the results marked stale; the report stage then made them anew
    # from this code, so the README's stale line goes (a from-committed rebuild keeps it
    # while code that trains or evaluates differs from the record's).
    write_results(tmp_path, with_training_trend=False)
    stale = "**Stale since abc:** `apg/x.py` changed after these results were made."
    (tmp_path / "README.md").write_text(
        "# x\n\n## Results\n\n<!-- provenance:stale -->\n> " + stale + "\n<!-- /provenance:stale -->\n\n"
        "<!-- results:start -->\n<!-- results:end -->\n"
    )
    params = {"tasks": ["gmm"], "report": {"out": "reports", "figure_format": "png", "scale": "synthetic"}}
    torch.set_num_threads(1)
    report.make_report(params, tmp_path)
    readme = (tmp_path / "README.md").read_text()
    assert "provenance:stale" not in readme and stale not in readme
    assert readme.startswith("# x\n\n## Results\n\n<!-- results:start -->")


def test_the_time_table_estimates_a_from_scratch_run_from_every_cells_training():
    from pipeline.report.sections import cells_training_seconds, from_scratch_minutes, pipeline_time_markdown

    meta = {"cells": [{"iterations": 600, "mean_it_per_s": 10.0}, {"iterations": 0, "mean_it_per_s": 0.0}]}
    assert cells_training_seconds(meta) == 60.0
    # The sweep last trained one new cell (6 s); from scratch its cells take 240 s on 2 slots.
    times = {"sweep@gmm": 6.0, "evaluate@gmm": 60.0}
    training = {"sweep@gmm": 240.0}
    assert from_scratch_minutes(times, training, 2) == (120.0 + 60.0) / 60
    table = pipeline_time_markdown(times, 1, training, 2)
    assert "| `sweep@gmm` | 0.1 | 2.0 |" in table and "| `evaluate@gmm` | 1.0 | 1.0 |" in table
    assert "| **sum** | **1.1** | **3.0** |" in table and "divided by the 2 trials run at once" in table
    other = {"cpu": "Some CPU", "vector": ["avx2"], "cores": 64, "torch": "2.13.0", "python": "3.11.7"}
    named = pipeline_time_markdown(times, 1, training, 2, made_on=other)  # a rebuild: the record's machine
    assert "Machine that trained and evaluated these results" in named
    assert "trained numbers differ across CPUs): Some CPU (avx2), 64 cores; torch 2.13.0" in named
