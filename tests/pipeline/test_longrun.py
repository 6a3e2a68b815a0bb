"""The long Bouncing MNIST run: its videos made when read, and a run continued in parts
that is the run made in one."""

import csv
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from apg.checkpoint import load_checkpoint
from apg.tasks.bmnist.simulator import VideoRows, row_seed
from pipeline.report.data import PAPER_NUMBERS
from pipeline.runs.compact import compact, expand
from pipeline.runs.execute import advance, score
from pipeline.runs.grid import new_run
from pipeline.runs.spec import EVALS, FULL_STATE, HISTORY, RUN, SEGMENTS, STATE, held_out, training_rows
from tests.support import needs_mnist


@needs_mnist
def test_video_rows_are_each_a_function_of_their_index(mnist_env):
    rows = VideoRows(50, seed=3, num_frames=4, num_digits=2)
    batch = rows[torch.tensor([7, 2, 7])]
    assert batch.shape == (3, 4, 96, 96) and batch.dtype == torch.get_default_dtype()
    assert 0.0 <= batch.min() and batch.max() <= 1.0 and batch.sum() > 0
    assert torch.equal(batch[0], batch[2])  # the same row, read twice in one batch
    assert torch.equal(batch[1], rows[torch.tensor([2])][0])  # and alone, later
    assert not torch.equal(batch[0], batch[1])
    other = VideoRows(50, seed=4, num_frames=4, num_digits=2)
    assert not torch.equal(other[torch.tensor([7])][0], batch[0])
    assert len(rows) == 50 and row_seed(3, 7) != row_seed(7, 3)
    with pytest.raises(IndexError):
        rows[torch.tensor([50])]


def tiny_run(method: str = "apg") -> dict:
    """The paper profile's run (of ``method``) at a few videos, frames and particles."""
    run = new_run("paper", eval_videos=4, every={"log": 2, "checkpoint": 2, "eval": 4}, method=method)
    run["train"].update(sweeps=2, particles=2, batch_size=2, network={"num_digits": 1})
    run["rows"]["num_datasets"] = 20
    run["rows"]["sizes"].update(num_frames=3, num_digits=1)
    run["eval"]["sizes"] = {**run["eval"]["sizes"], "num_frames": 3, "num_digits": 1}
    return run


def table(path: Path, drop: tuple[str, ...] = ()) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if k not in drop} for row in csv.DictReader(f)]


@pytest.mark.slow
@needs_mnist
def test_a_run_continued_in_parts_is_the_run_made_at_once(tmp_path, mnist_env):
    run = tiny_run()
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    advance(tmp_path, whole, steps=8, new=run)
    first = advance(tmp_path, parts, steps=2, new=run)
    assert (first["from_iteration"], first["to_iteration"]) == (0, 2)
    # a sitting killed after writing its tables but before its state: rows past the state go
    with open(parts / HISTORY, "a") as f:
        f.write(",".join(["99"] + ["0"] * (len(table(parts / HISTORY)[0]) - 1)) + "\n")
    advance(tmp_path, parts, steps=6)
    with pytest.raises(ValueError, match="continue it without --start"):
        advance(tmp_path, parts, steps=1, new=run)
    a, b = load_checkpoint(whole / FULL_STATE)[1], load_checkpoint(parts / FULL_STATE)[1]
    assert a["iteration"] == b["iteration"] == 8
    for group in ("model", "proposals"):
        for name, tensor in a[group].items():
            assert torch.equal(tensor, b[group][name]), (group, name)
    timing = ("it_per_s", "step_seconds", "seconds")
    assert table(whole / HISTORY, timing) == table(parts / HISTORY, timing)
    assert [r["iteration"] for r in table(parts / HISTORY)] == ["2", "4", "6", "8"]
    evals = table(parts / EVALS, timing)
    assert evals == table(whole / EVALS, timing) and [r["iteration"] for r in evals] == ["0", "4", "8"]
    assert all(np.isfinite(float(r["pos_err"])) and float(r["pos_err"]) > 0 for r in evals)
    segments = table(parts / SEGMENTS)
    assert [(s["from_iteration"], s["to_iteration"]) for s in segments] == [("0", "2"), ("2", "8")]
    assert all(s["device"] and s["commit"] for s in segments)
    # a CPU's seconds per step depend on its threads: the device names them
    assert all(s["device"].endswith(f"; {torch.get_num_threads()} torch threads") for s in segments)


def test_the_run_is_the_papers_configuration():
    run = new_run("paper")
    train = run["train"]
    assert (train["task"], train["method"], train["sweeps"], train["particles"]) == ("bmnist", "apg", 5, 10)
    assert (
        train["batch_size"] == 10 and train["iterations"] == 200_000 and train["network"]["num_digits"] == 3
    )
    assert run["rows"]["num_datasets"] == 60_000 and run["rows"]["made"] == "per-row"
    assert (run["rows"]["sizes"]["num_frames"], run["rows"]["sizes"]["num_digits"]) == (10, 3)
    assert run["eval"]["name"] == "T10_D3" and run["eval"]["num_datasets"] == 100
    with pytest.raises(ValueError, match="not a multiple"):
        new_run("paper", every={"log": 25, "eval": 30})


def test_long_run_says_what_is_missing(tmp_path, capsys):
    from pipeline.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["long-run"])
    assert stop.value.code == 2 and "--minutes or --steps" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="no run there"):
        advance(tmp_path, tmp_path / "none", steps=1)
    assert not (tmp_path / "none" / RUN).exists()


def test_the_compact_state_keeps_what_it_promises():
    torch.manual_seed(1)
    w = {"w": torch.randn(300, 70) * 0.1, "b": torch.randn(70), "n": torch.tensor(3)}
    v = torch.randn(300, 70).pow(2) * 1e-4
    v[0, :5] = 0.0  # parameters without gradient so far
    v[1, :5] = 1e-44  # subnormal: far below Adam's eps
    m = torch.randn(300, 70) * 1e-3
    state = {
        "model": w,
        "proposals": {"p": torch.randn(5000)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": m, "exp_avg_sq": v}},
            "param_groups": [],
        },
        "iteration": 7,
        "order": torch.randperm(1000),
        "cursor": 20,
        "rng": torch.get_rng_state(),
    }
    back = expand(compact(state))
    assert torch.equal(back["order"], state["order"]) and torch.equal(back["rng"], state["rng"])
    assert (back["iteration"], back["cursor"]) == (7, 20) and torch.equal(back["model"]["n"], w["n"])
    for name, t in w.items():
        if t.is_floating_point():
            assert back["model"][name].dtype == torch.float32
            assert torch.allclose(back["model"][name], t, rtol=2**-11, atol=1e-7)
    moments = back["optimizer"]["state"][0]
    assert (moments["exp_avg"] - m).abs().max() <= m.abs().max() / 254 * 1.0001
    assert torch.equal(moments["exp_avg_sq"] == 0, v == 0)
    kept = v.sqrt() > 1e-8 / 16
    ratio = moments["exp_avg_sq"][kept].sqrt() / v[kept].sqrt()
    # half a code step of the block's log range (floor to its largest root), as the module says
    half_step = (torch.log2(v.max().sqrt()) - np.log2(1e-8 / 16)) / 254 / 2
    assert (ratio.log2().abs() <= half_step * 1.0001).all()
    with pytest.raises(ValueError, match="not a compact trainer state"):
        expand(state)


@needs_mnist
def test_float16_weights_score_as_the_float32_ones(tmp_path, mnist_env):
    from apg.training import TrainConfig, Trainer

    run = tiny_run()
    run["eval"]["num_datasets"] = 30
    trainer = Trainer(TrainConfig.from_dict(run["train"]), training_rows(run))
    for _ in range(4):
        trainer.step()
    x, truth = held_out(run)
    before = score(trainer, x, truth, run)
    trainer.load_state_dict(expand(compact(trainer.state_dict())))
    after = score(trainer, x, truth, run)
    # the same held-out stream: float16 weights move the error by much less than its noise
    assert abs(after["pos_err"] - before["pos_err"]) <= 0.5 * before["pos_err_sem"], (before, after)


def test_the_report_draws_the_curve_and_extrapolates_a_power_law(tmp_path):
    import pandas as pd

    from pipeline.report.longrun import _hours, long_run_markdown, power_law_fit, steps_to_reach
    from pipeline.runs.spec import LONG_RUN_DIR as RUN_DIR

    steps = np.array([0, 250, 500, 1000, 2000, 4000])
    errors = 40.0 * np.maximum(steps, 1) ** -0.25  # 10 px at 256 steps, 3 px at ~31,600
    fit = power_law_fit(steps, errors)
    assert fit is not None and fit[1] == pytest.approx(-0.25)
    assert steps_to_reach(fit, 3.0) == pytest.approx((40 / 3) ** 4, rel=1e-6)
    assert power_law_fit(steps[:3], errors[:3]) is None  # two points after step 0: no trend
    assert steps_to_reach((1.0, 0.1), 3.0) == float("inf")
    run_dir = tmp_path / RUN_DIR
    run_dir.mkdir(parents=True)
    run = new_run("paper")
    (run_dir / RUN).write_text(__import__("json").dumps(run))
    cpu = "a CPU"
    pd.DataFrame(
        {
            "iteration": steps,
            "pos_err": errors,
            "pos_err_sem": 0.1,
            "tracked": 0.5,
            "seconds": steps * 4.0,
            "device": cpu,
        }
    ).to_csv(run_dir / EVALS, index=False)
    pd.DataFrame(
        [
            {
                "from_iteration": 0,
                "to_iteration": 4000,
                "seconds": 16000.0,
                "device": cpu,
                "compiled": False,
                "commit": "abc",
            }
        ]
    ).to_csv(run_dir / SEGMENTS, index=False)
    text = long_run_markdown(tmp_path, tmp_path / "reports", "png")
    assert (tmp_path / "reports" / "recorded" / "bmnist-long" / "curve.png").is_file()
    assert "At step 4,000 of 200,000" in text and "| a CPU | 4,000 | 4.44 | 4.00 |" in text
    assert "reaches 3 px at step 31,605, within the paper's 200,000 steps" in text
    assert "31 more hours on a CPU" in text
    # a GPU's remaining hours are fractions of one: not rounded to 0
    assert (_hours(15.4), _hours(4.24), _hours(0.0897)) == ("15", "4.2", "0.09")
    # With the run's history the rate is the median window's: a paused window (a stopped
    # process) does not count as training time; the wall hours stay as they were.
    rates = [0.5] * 9 + [0.01]  # 2 s per step, and one window of 100 s per step
    pd.DataFrame({"iteration": np.arange(1, 11) * 400, "it_per_s": rates, "device": cpu}).to_csv(
        run_dir / HISTORY, index=False
    )
    text = long_run_markdown(tmp_path, tmp_path / "reports", "png")
    assert "| a CPU | 4,000 | 4.44 | 2.00 |" in text and "15 more hours on a CPU" in text
    assert long_run_markdown(tmp_path / "elsewhere", tmp_path / "reports", "png") == ""


@pytest.mark.slow
@needs_mnist
def test_the_grid_scores_the_state_on_each_set_and_the_report_draws_figures_3_and_4(
    tmp_path, mnist_env, monkeypatch
):
    import shutil

    from pipeline.report.longrun_grid import grid_markdown
    from pipeline.runs import grid as longrun_grid

    run = tiny_run()
    advance(tmp_path, tmp_path / "r", steps=1, new=run)
    shutil.copy(tmp_path / "r" / STATE, tmp_path / "step1.pt")  # as git history keeps it
    advance(tmp_path, tmp_path / "r", steps=1)
    sets = [
        {
            "name": f"T{t}_D{d}",
            "num_datasets": 3,
            "seed": 50 + t + d,
            "sizes": {"num_frames": t, "num_digits": d, "split": "test"},
            "network": {"num_digits": d},
        }
        for t, d in ((3, 1), (4, 2))
    ]
    monkeypatch.setattr(longrun_grid, "grid_sets", lambda run: sets)
    path = longrun_grid.evaluate_grid(tmp_path, tmp_path / "r", videos=2)
    grid = table(path)
    # a row per set, sweep and video, of the state's step
    assert [(r["iteration"], r["set"], r["sweep"], r["video"]) for r in grid] == [
        ("2", name, sweep, video) for name in ("T3_D1", "T4_D2") for sweep in "12" for video in "01"
    ]
    assert all(
        float(r["pos_err"]) >= 0 and 0 <= float(r["tracked"]) <= 1 and float(r["mse"]) > 0 for r in grid
    )
    again = table(longrun_grid.evaluate_grid(tmp_path, tmp_path / "r", videos=2))
    assert again == grid  # scoring draws from its own stream: the same state, the same table
    trail = (tmp_path / "r" / longrun_grid.TRAIL).read_bytes()
    with np.load(tmp_path / "r" / longrun_grid.TRAIL) as npz:
        assert npz["frames"].shape == (4, 96, 96) and npz["frames"].dtype == np.uint8
        assert npz["found_z_where"].shape == npz["true_z_where"].shape == (1, 4, 2, 2)
        assert json.loads(str(npz["meta"]))["iteration"] == 2  # the step whose state drew it
    # an earlier state adds its step's rows and keeps the latest's (and Figure 3's trail)
    both = table(longrun_grid.evaluate_grid(tmp_path, tmp_path / "r", videos=2, state=tmp_path / "step1.pt"))
    assert [r for r in both if r["iteration"] == "2"] == grid
    assert len([r for r in both if r["iteration"] == "1"]) == len(grid)
    assert (tmp_path / "r" / longrun_grid.TRAIL).read_bytes() == trail
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        longrun_grid.evaluate_grid(tmp_path, tmp_path / "r", state=tmp_path / "missing.pt")
    # one set again on more videos: its rows of the step replaced, the other set's kept; the
    # profile's last set not scored, so Figure 3's trail stays
    more = table(longrun_grid.evaluate_grid(tmp_path, tmp_path / "r", videos=3, sets=["T3_D1"]))
    assert [r for r in more if r["set"] == "T4_D2"] == [r for r in both if r["set"] == "T4_D2"]
    assert [r for r in more if r["set"] == "T3_D1" and r["iteration"] == "1"] == [
        r for r in both if r["set"] == "T3_D1" and r["iteration"] == "1"
    ]
    latest = [r for r in more if r["set"] == "T3_D1" and r["iteration"] == "2"]
    assert sorted({r["video"] for r in latest}) == ["0", "1", "2"]
    assert (tmp_path / "r" / longrun_grid.TRAIL).read_bytes() == trail
    with pytest.raises(ValueError, match="unknown set.*T9_D9.*the profile has T3_D1, T4_D2"):
        longrun_grid.evaluate_grid(tmp_path, tmp_path / "r", sets=["T9_D9"])

    # the report: APG's grid with its claims; a baseline compared at the step both scored
    baseline = tmp_path / "rws"
    baseline.mkdir()
    rows = pd.DataFrame(both)
    # one row per video, as AVF reports only its last inference iteration, at the run's K
    rows = rows[(rows["iteration"] == "1") & (rows["sweep"] == "2")].assign(sweep=1)
    rows.assign(pos_err=rows["pos_err"].astype(float) + 50).to_csv(baseline / longrun_grid.GRID, index=False)
    (baseline / RUN).write_text(json.dumps({**run, "train": {**run["train"], "method": "rws-mlp"}}))
    paper = yaml.safe_load(PAPER_NUMBERS.read_text())["bmnist"]
    for spec in paper["long_run_claims"] + paper["long_run_every_set"]:
        assert spec["pair"] == [5, 10]  # the paper's K and L; this tiny run's are 2 and 2
        spec["pair"] = [2, 2]
    paper["long_run_claims"][0]["test_set"] = "T3_D1"
    text = grid_markdown(
        tmp_path / "r",
        tmp_path / "out",
        "recorded/r",
        "png",
        others={"rws-mlp": baseline, "avf": tmp_path / "no"},
        paper=paper,
    )
    assert "### The paper's held-out grid at step 2" in text and "| T4_D2 | 2 |" in text
    assert "APG − rws-mlp (px)" in text and "(step 1: " in text and "APG − avf (px)" in text
    line = next(x for x in text.splitlines() if x.startswith("| T3_D1 |"))
    assert line.endswith("| – | – |")  # no avf grid: no comparison
    assert "n/a (2 videos)" in line  # two videos are too few for a verdict, as two seeds are
    assert "| ≤ 3 |" in line  # T3_D1 given the first claim's target
    assert (tmp_path / "out" / "figure4.png").is_file() and (tmp_path / "out" / "figure3.png").is_file()
    # reports/metrics.json's entry: the same verdicts by claim id, and the reach per target set
    from pipeline.report.longrun_grid import long_run_metrics

    metrics = long_run_metrics(tmp_path / "r", {"rws-mlp": baseline, "avf": tmp_path / "no"}, paper)
    assert metrics["claims"]["long_tracks_T10_D3"] == 0  # set to T3_D1 above: its table row's verdict
    assert set(metrics["claims"]) >= {"long_mse_falls_T4_D2", "long_below_rws_T4_D2", "long_below_avf_T4_D2"}
    assert metrics["reach"] == {"T3_D1": "too few steps"}
    assert long_run_metrics(tmp_path / "no", {}, paper) == {}
    # a baseline's own section: its grid alone
    alone = grid_markdown(baseline, tmp_path / "out-rws", "recorded/rws", "png")
    assert "### The paper's held-out grid at step 1 (rws-mlp)" in alone and "APG −" not in alone


@needs_mnist
def test_the_grid_of_a_method_that_reports_one_sweep_has_a_row_per_video(tmp_path, mnist_env, monkeypatch):
    from pipeline.runs import grid as longrun_grid

    advance(tmp_path, tmp_path / "avf", steps=1, new=tiny_run("avf"))
    sets = [{"name": "T3_D1", "num_datasets": 2, "seed": 9, "sizes": {"num_frames": 3, "num_digits": 1}}]
    monkeypatch.setattr(longrun_grid, "grid_sets", lambda run: sets)
    grid = table(longrun_grid.evaluate_grid(tmp_path, tmp_path / "avf"))
    assert [(r["sweep"], r["video"]) for r in grid] == [("1", "0"), ("1", "1")]  # AVF's last iteration
    with np.load(tmp_path / "avf" / longrun_grid.TRAIL) as npz:  # its inferred paths as well
        assert npz["found_z_where"].shape == npz["true_z_where"].shape == (1, 3, 1, 2)


def test_a_baseline_run_is_the_same_training_with_the_baselines_cell():
    from pipeline.runs.spec import LONG_RUN_DIR as RUN_DIR
    from pipeline.runs.spec import long_run_dir as run_dir_of

    apg, rws = new_run("paper"), new_run("paper", method="rws-mlp")
    assert rws["train"]["method"] == "rws-mlp" and apg["train"]["method"] == "apg"
    different = {k for k in apg["train"] if apg["train"][k] != rws["train"][k]}
    assert different <= {"method", "network", "method_options"}, different
    assert (rws["rows"], rws["eval"], rws["every"], rws["seed"]) == (
        apg["rows"],
        apg["eval"],
        apg["every"],
        apg["seed"],
    )
    assert run_dir_of("apg") == RUN_DIR and run_dir_of("rws-mlp") == RUN_DIR.with_name("bmnist-long-rws-mlp")
    with pytest.raises(ValueError, match="trains no bmnist cell gibbs"):
        new_run("paper", method="gibbs")


def test_the_cli_keeps_a_runs_method(tmp_path, monkeypatch, capsys):
    from pipeline.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("pipeline.common.project_root", lambda: tmp_path)
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / RUN).write_text(__import__("json").dumps(new_run("paper")))
    with pytest.raises(SystemExit) as stop:
        main(["long-run", "--dir", str(run_dir), "--method", "rws-mlp", "--steps", "1"])
    assert stop.value.code == 2 and "is a apg run, not rws-mlp" in capsys.readouterr().err


def test_the_report_sets_the_baselines_runs_beside_apgs_step_for_step(tmp_path):
    import pandas as pd

    from pipeline.report.longrun import long_run_markdown
    from pipeline.runs.spec import long_run_dir as run_dir_of

    scored = {"apg": [0, 250, 500, 750], "rws-mlp": [0, 250], "avf": [0, 500]}
    for method, scale in (("apg", 1.0), ("rws-mlp", 2.0), ("avf", 3.0)):
        run_dir = tmp_path / run_dir_of(method)
        run_dir.mkdir(parents=True)
        (run_dir / RUN).write_text(__import__("json").dumps(new_run("paper", method=method)))
        steps = scored[method]
        pd.DataFrame(
            {
                "iteration": steps,
                "pos_err": [scale * (10 - s / 100) for s in steps],
                "pos_err_sem": 0.1,
                "tracked": 0.5,
                "seconds": 1.0,
                "device": "a CPU",
            }
        ).to_csv(run_dir / EVALS, index=False)
        pd.DataFrame(
            [
                {
                    "from_iteration": 0,
                    "to_iteration": steps[-1],
                    "seconds": 10.0,
                    "device": "a CPU",
                    "compiled": False,
                    "commit": "abc",
                }
            ]
        ).to_csv(run_dir / SEGMENTS, index=False)
    text = long_run_markdown(tmp_path, tmp_path / "reports", "png")
    assert "### Baselines trained the same way" in text
    assert "| step | apg (px) | rws-mlp (px) | avf (px) |" in text
    # the steps APG and a baseline scored, "–" where a baseline did not
    assert "| 250 | 7.50 ± 0.10 | 15.00 ± 0.10 | – |\n| 500 | 5.00 ± 0.10 | – | 15.00 ± 0.10 |\n\n" in text
    assert "`rws-mlp`: step 250, 15.00 px" in text
    assert (tmp_path / "reports" / "recorded" / "bmnist-long" / "methods.png").is_file()
