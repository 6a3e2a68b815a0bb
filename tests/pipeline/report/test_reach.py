"""A run's reach: its target from the paper numbers, and a power law per target set over the
steps its grid was scored at."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml

from pipeline.report.data import PAPER_NUMBERS
from pipeline.report.reach import curve_target, reach, reach_markdown, trend_points
from pipeline.runs.spec import new_run

RULE = {"limit_steps": 200_000, "confidence": 0.95, "min_steps": 3}


def grid_rows(steps, errors_per_step, name="T20_D4", sweeps=2):
    """grid.csv rows: per step, the final sweep's position errors of its videos (sweep 1: 2x)."""
    rows = []
    for step, errors in zip(steps, errors_per_step, strict=True):
        for video, err in enumerate(errors):
            for sweep in range(1, sweeps + 1):
                value = err if sweep == sweeps else 2 * err
                rows.append(
                    {"iteration": step, "set": name, "video": video, "sweep": sweep, "pos_err": value}
                )
    return pd.DataFrame(rows)


def points(steps, errors):
    return pd.DataFrame({"iteration": steps, "pos_err": errors, "sem": 0.0})


def test_the_rule_is_written_in_paper_numbers():
    rule = yaml.safe_load(PAPER_NUMBERS.read_text())["bmnist"]["long_run_reach"]
    assert rule == RULE


def test_a_runs_target_is_the_paper_numbers_threshold_on_its_held_out_score():
    paper = yaml.safe_load(PAPER_NUMBERS.read_text())
    bmnist = new_run("paper", "bmnist", "rws-mlp", 5, 10, 0)  # any method: the task's target
    spec = curve_target(paper["bmnist"], bmnist, ["pos_err"])
    assert spec is not None and (spec["test_set"], spec["target"], spec["pair"]) == ("T10_D3", 3, [5, 10])
    assert curve_target(paper["bmnist"], bmnist, ["mse"]) is None  # no threshold on that score
    # the rings: no threshold on a score its runs are scored on (ARI, log joints, ESS/L)
    rings = new_run("paper", "dgmm", "apg", 10, 10, 0)
    assert curve_target(paper["dgmm"], rings, ["log_joint_true", "ari", "log_joint", "ess"]) is None


def test_an_exact_power_law_meets_the_target_where_it_should_and_its_band_is_tight():
    steps = np.array([500, 1000, 2000, 4000])
    rng = np.random.default_rng(0)
    errors = 40.0 * steps**-0.25 * np.exp(rng.normal(0, 1e-4, len(steps)))  # 3 px at (40/3)^4
    r = reach(points(steps, errors), "T10_D3", 3.0, 100, RULE)
    assert r.slope == pytest.approx(-0.25, abs=1e-3)
    assert r.at == pytest.approx((40 / 3) ** 4, rel=2e-3)  # 31,605; the search grid's step is ~1e-4 in log
    assert r.earliest <= r.at <= r.latest and r.latest / r.earliest < 1.1
    assert r.verdict == "within reach"


def test_a_slow_fall_is_out_of_reach_and_a_noisy_one_undecided():
    steps = np.array([750, 1000, 1500, 2000, 3000])
    slow = 12.0 * (steps / 750) ** -0.1 * np.exp(np.array([0.01, -0.01, 0.0, 0.01, -0.01]))
    r = reach(points(steps, slow), "T20_D4", 4.0, 100, RULE)
    assert r.verdict == "out of reach" and r.earliest > RULE["limit_steps"]
    # scatter as large as the fall: the band's slope reaches 0, the latest step is never
    noisy = 12.0 * (steps / 750) ** -0.1 * np.exp(np.array([0.3, -0.3, 0.25, -0.2, 0.1]))
    r = reach(points(steps, noisy), "T20_D4", 4.0, 100, RULE)
    assert r.latest == float("inf") and r.earliest < RULE["limit_steps"] and r.verdict == "undecided"
    # a rising curve never meets it by the line; met already is "reached"
    assert reach(points(steps, slow[::-1]), "T20_D4", 4.0, 100, RULE).at == float("inf")
    assert reach(points(steps, slow / 4), "T20_D4", 4.0, 100, RULE).verdict == "reached"
    assert reach(points(steps[:2], slow[:2]), "T20_D4", 4.0, 100, RULE).verdict == "too few steps"


def test_the_trend_uses_the_steps_scored_on_as_many_videos_as_the_latest():
    # steps 750 and 2000 on 4 videos, 1000 on 2 (another draw of the set: other videos), 3000 on 4
    grid = grid_rows([750, 1000, 2000, 3000], [[8, 8, 8, 12], [9, 9], [6, 6, 6, 10], [5, 5, 5, 9]])
    found, videos = trend_points(grid, "T20_D4")
    assert videos == 4
    assert found["iteration"].tolist() == [750, 2000, 3000]  # step 1000 scored other videos
    assert found["pos_err"].tolist() == [9.0, 7.0, 6.0]  # final sweep, mean over the 4 videos
    # two videos at the latest step: the steps scored on those two only
    fewer = pd.concat([grid[grid["iteration"] < 3000], grid_rows([4000], [[4, 4]])])
    found, videos = trend_points(fewer, "T20_D4")
    assert videos == 2 and found["iteration"].tolist() == [1000, 4000]
    assert found["pos_err"].tolist() == [9.0, 4.0]


def test_the_section_has_a_row_per_target_set_and_its_figure(tmp_path):
    paper = yaml.safe_load(PAPER_NUMBERS.read_text())["bmnist"]
    steps = [750, 1000, 1500, 2000, 3000]
    grid = pd.concat(
        [
            grid_rows(steps, [[12.0 * (s / 750) ** -0.1] * 3 for s in steps], "T20_D4"),
            grid_rows(steps[:2], [[5.0] * 3, [4.0] * 3], "T10_D3"),
            grid_rows(steps, [[12.0] * 3] * 5, "T20_D3"),  # no target: no row
        ]
    )
    lines = reach_markdown(grid, paper, tmp_path, "recorded/r", "png")
    rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| T")}
    assert set(rows) == {"T20_D4", "T10_D3"}
    assert rows["T10_D3"].endswith("too few steps (a fit needs 3) |")
    assert "| -0.100 |" in rows["T20_D4"] and rows["T20_D4"].endswith("| out of reach |")
    assert (tmp_path / "reach.png").is_file() and "![reach](recorded/r/reach.png)" in lines


def test_sets_scored_at_different_steps_are_each_claimed_at_their_own_latest_step():
    from pipeline.report.grid import grid_claims, latest_per_set

    def scored(step, name, errors):
        return grid_rows([step], [errors], name, sweeps=1).assign(mse=0.01, tracked=0.5)

    five = [3.0, 3.5, 2.5, 3.2, 2.8]
    apg = pd.concat(
        [
            scored(1, "A", [9.0] * 5),
            scored(1, "B", [x + 2 for x in five]),
            scored(2, "A", [x - 1 for x in five]),
        ]
    )
    # RWS scored set B on three videos (another draw of the set): each run's videos compared
    rws = pd.concat([scored(1, "A", [x + 20 for x in five]), scored(1, "B", [x + 22 for x in five[:3]])])
    assert sorted(map(tuple, latest_per_set(apg)[["set", "iteration"]].drop_duplicates().values)) == [
        ("A", 2),
        ("B", 1),
    ]
    paper = {
        "long_run_claims": [
            {
                "id": f"t_{s}",
                "claim": "c",
                "section": "s",
                "kind": "threshold",
                "metric": "pos_err",
                "method": "apg",
                "pair": [1, 1],
                "test_set": s,
                "op": "<=",
                "target": 3,
            }
            for s in ("A", "B")
        ],
        "long_run_every_set": [
            {
                "id": "below",
                "claim": "c",
                "section": "s",
                "kind": "below",
                "metric": "pos_err",
                "method": "apg",
                "other": "rws-mlp",
                "pair": [1, 1],
            }
        ],
    }
    got = {
        spec["id"]: (result, step)
        for spec, result, step in grid_claims({"apg": (apg, (1, 1)), "rws-mlp": (rws, (1, 1))}, paper)
    }
    assert got["t_A"][1] == 2 and got["t_A"][0].passed is True  # A's latest step: 2.0 px on average
    assert got["t_B"][1] == 1 and got["t_B"][0].passed is False  # B's latest is step 1: 5.0 px
    assert got["below_A"][1] == 1 and got["below_B"][1] == 1  # the step both runs scored
    assert got["below_B"][0].value == pytest.approx(np.mean(five) + 2)  # APG's five videos
    assert got["below_B"][0].target_value["value"] == pytest.approx(np.mean(five[:3]) + 22)
    assert got["below_A"][0].value == pytest.approx(9.0)  # step 1's five videos
