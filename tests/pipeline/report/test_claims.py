"""The claims table's statistics on synthetic frames: each claim kind's rule and interval, the
seed count a verdict needs, the stalled seeds (the plateau test: test_plateau.py).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats

from pipeline import report
from pipeline.report.claims import _est
from tests.pipeline.report.synthetic import cell, metric_rows, seeds_frame

# --------------------------------------------------------------------------- claims


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


MSE_FALLS = {
    "id": "x",
    "claim": "c",
    "kind": "falls_over_sweeps",
    "metric": "mse",
    "method": "apg",
    "pair": [4, 4],
}


def test_falls_over_sweeps_compares_the_first_and_last_sweep():
    cells, last = seeds_frame("apg", {(4, 4): 0.02}, metric="mse", spread=0.001)
    first = pd.concat(
        [metric_rows(c, 4, 4, {"mse": [0.05, 0.05, 0.05]}).assign(sweep=1) for c in cells], ignore_index=True
    )
    curves = pd.concat([first, last], ignore_index=True)
    spec = MSE_FALLS
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
    spec = MSE_FALLS
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
