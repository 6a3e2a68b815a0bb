"""Bouncing MNIST's continuing runs at the paper's configuration: videos made when read, a
run continued in parts that is the run made in one, the compact state, the held-out grid
(``apg-pipeline grid``) and the report's reading of them."""

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
from pipeline.runs import grid as run_grid
from pipeline.runs.compact import compact, expand
from pipeline.runs.execute import advance, score
from pipeline.runs.spec import (
    EVALS,
    FULL_STATE,
    HISTORY,
    RUN,
    RUNS_DIR,
    SEGMENTS,
    STATE,
    held_out,
    new_run,
    run_name,
    training_rows,
    write_run,
)
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


def paper_run(method: str = "apg", **options) -> dict:
    """The ``paper`` profile's Bouncing MNIST cell of ``method`` (K=5, L=10, seed 0) as a run."""
    return new_run("paper", "bmnist", method, 5, 10, 0, **options)


def tiny_run(method: str = "apg") -> dict:
    """The paper profile's run (of ``method``) at a few videos, frames and particles."""
    run = paper_run(method, eval_size=4, every={"log": 2, "checkpoint": 2, "eval": 4})
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
    run = paper_run()
    train = run["train"]
    assert (train["task"], train["method"], train["sweeps"], train["particles"]) == ("bmnist", "apg", 5, 10)
    assert (
        train["batch_size"] == 10 and train["iterations"] == 200_000 and train["network"]["num_digits"] == 3
    )
    assert run["rows"]["num_datasets"] == 60_000 and run["rows"]["made"] == "per-row"
    assert (run["rows"]["sizes"]["num_frames"], run["rows"]["sizes"]["num_digits"]) == (10, 3)
    assert run["eval"]["name"] == "T10_D3" and run["eval"]["num_datasets"] == 100
    with pytest.raises(ValueError, match="not a multiple"):
        paper_run(every={"log": 25, "eval": 30})


def test_the_grid_says_what_is_missing(tmp_path, monkeypatch, capsys):
    from pipeline.cli import main

    monkeypatch.setenv("APG_PROJECT_ROOT", str(tmp_path))
    write_run(tmp_path / "rings", new_run("smoke", "dgmm", "apg", 3, 4, 0))
    for args, said in (
        (["grid", "none"], "no run there"),
        (["grid", "rings"], "a dgmm run; the grid scores tasks that track objects"),
        (["grid", "none", "--device", "tpu9"], "--device tpu9: unknown device"),
    ):
        with pytest.raises(SystemExit) as stop:
            main(args)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and said in err, (args, err)
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


def write_scored_run(root: Path, method: str, steps, errors, device: str = "a CPU", seconds=None) -> Path:
    """A Bouncing MNIST run of the paper profile under ``root/recorded/``, scored at ``steps``
    with ``errors``, trained in one sitting on ``device``."""
    run_dir = root / RUNS_DIR / run_name("paper", "bmnist", method, 5, 10, 0)
    write_run(run_dir, paper_run(method))
    steps = np.asarray(steps)
    pd.DataFrame(
        {
            "iteration": steps,
            "pos_err": errors,
            "pos_err_sem": 0.1,
            "tracked": 0.5,
            "seconds": 1.0,
            "device": device,
        }
    ).to_csv(run_dir / EVALS, index=False)
    seconds = float(steps[-1]) * 4.0 if seconds is None else seconds
    segment = {"from_iteration": 0, "to_iteration": int(steps[-1]), "seconds": seconds, "device": device}
    pd.DataFrame([{**segment, "compiled": False, "commit": "abc"}]).to_csv(run_dir / SEGMENTS, index=False)
    return run_dir


def test_the_report_draws_the_curve_and_extrapolates_a_power_law(tmp_path):
    from pipeline.report.reach import hours, power_law_fit, steps_to_reach
    from pipeline.report.runs import runs_markdown

    steps = np.array([0, 250, 500, 1000, 2000, 4000])
    errors = 40.0 * np.maximum(steps, 1) ** -0.25  # 10 px at 256 steps, 3 px at ~31,600
    fit = power_law_fit(steps, errors)
    assert fit is not None and fit[1] == pytest.approx(-0.25)
    assert steps_to_reach(fit, 3.0) == pytest.approx((40 / 3) ** 4, rel=1e-6)
    assert power_law_fit(steps[:3], errors[:3]) is None  # two points after step 0: no trend
    assert steps_to_reach((1.0, 0.1), 3.0) == float("inf")
    run_dir = write_scored_run(tmp_path, "apg", steps, errors)
    paper = yaml.safe_load(PAPER_NUMBERS.read_text())
    text = runs_markdown(tmp_path, tmp_path / "reports", paper, "png")
    assert (tmp_path / "reports" / "recorded" / "runs-paper-bmnist-reach.png").is_file()
    name = f"`{run_dir.name}`"
    assert f"| {name} | apg | 0 | 4,000 | 200,000 | 1 | 4.44 | 4,000 | 5.03 ± 0.1 |" in text
    # the target is the paper numbers' threshold on T10_D3's position error at K=5, L=10
    assert (
        f"| {name} | 3 (`apg_tracks_paper`) | 4,000 | step^-0.250 | step 31,605, within the paper's 200,000 steps |"
        in text
    )
    assert f"| {name} | a CPU | 4,000 | 4.44 | 4.00 | 31 |" in text  # hours to the target at 4 s a step
    # a GPU's remaining hours are fractions of one: not rounded to 0
    assert (hours(15.4), hours(4.24), hours(0.0897)) == ("15", "4.2", "0.09")
    # With the run's history the rate is the median window's: a paused window (a stopped
    # process) does not count as training time; the wall hours stay as they were.
    rates = [0.5] * 9 + [0.01]  # 2 s per step, and one window of 100 s per step
    pd.DataFrame({"iteration": np.arange(1, 11) * 400, "it_per_s": rates, "device": "a CPU"}).to_csv(
        run_dir / HISTORY, index=False
    )
    text = runs_markdown(tmp_path, tmp_path / "reports", paper, "png")
    assert f"| {name} | a CPU | 4,000 | 4.44 | 2.00 | 15 |" in text
    assert runs_markdown(tmp_path / "elsewhere", tmp_path / "reports", paper, "png") == ""


@pytest.mark.slow
@needs_mnist
def test_the_grid_scores_the_state_on_each_set_and_the_report_draws_figures_3_and_4(
    tmp_path, mnist_env, monkeypatch
):
    import shutil

    from pipeline.report.grid import grid_claims, grid_markdown, grid_metrics, read_grid

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
    monkeypatch.setattr(run_grid, "grid_sets", lambda run: sets)
    path = run_grid.evaluate_grid(tmp_path / "r", videos=2)
    grid = table(path)
    # a row per set, sweep and video, of the state's step
    assert [(r["iteration"], r["set"], r["sweep"], r["video"]) for r in grid] == [
        ("2", name, sweep, video) for name in ("T3_D1", "T4_D2") for sweep in "12" for video in "01"
    ]
    assert all(
        float(r["pos_err"]) >= 0 and 0 <= float(r["tracked"]) <= 1 and float(r["mse"]) > 0 for r in grid
    )
    again = table(run_grid.evaluate_grid(tmp_path / "r", videos=2))
    assert again == grid  # scoring draws from its own stream: the same state, the same table
    trail = (tmp_path / "r" / run_grid.TRAIL).read_bytes()
    with np.load(tmp_path / "r" / run_grid.TRAIL) as npz:
        assert npz["frames"].shape == (4, 96, 96) and npz["frames"].dtype == np.uint8
        assert npz["found_z_where"].shape == npz["true_z_where"].shape == (1, 4, 2, 2)
        assert json.loads(str(npz["meta"]))["iteration"] == 2  # the step whose state drew it
    # an earlier state adds its step's rows and keeps the latest's (and Figure 3's trail)
    both = table(run_grid.evaluate_grid(tmp_path / "r", videos=2, state=tmp_path / "step1.pt"))
    assert [r for r in both if r["iteration"] == "2"] == grid
    assert len([r for r in both if r["iteration"] == "1"]) == len(grid)
    assert (tmp_path / "r" / run_grid.TRAIL).read_bytes() == trail
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        run_grid.evaluate_grid(tmp_path / "r", state=tmp_path / "missing.pt")
    # one set again on more videos: its rows of the step replaced, the other set's kept; the
    # profile's last set not scored, so Figure 3's trail stays
    more = table(run_grid.evaluate_grid(tmp_path / "r", videos=3, sets=["T3_D1"]))
    assert [r for r in more if r["set"] == "T4_D2"] == [r for r in both if r["set"] == "T4_D2"]
    assert [r for r in more if r["set"] == "T3_D1" and r["iteration"] == "1"] == [
        r for r in both if r["set"] == "T3_D1" and r["iteration"] == "1"
    ]
    latest = [r for r in more if r["set"] == "T3_D1" and r["iteration"] == "2"]
    assert sorted({r["video"] for r in latest}) == ["0", "1", "2"]
    assert (tmp_path / "r" / run_grid.TRAIL).read_bytes() == trail
    with pytest.raises(ValueError, match="unknown set.*T9_D9.*the profile has T3_D1, T4_D2"):
        run_grid.evaluate_grid(tmp_path / "r", sets=["T9_D9"])

    # the report: APG's grid with its claims; a baseline compared at the step both scored
    baseline = tmp_path / "rws"
    baseline.mkdir()
    rows = pd.DataFrame(both)
    # one row per video, as AVF reports only its last inference iteration, at the run's K
    rows = rows[(rows["iteration"] == "1") & (rows["sweep"] == "2")].assign(sweep=1)
    rows.assign(pos_err=rows["pos_err"].astype(float) + 50).to_csv(baseline / run_grid.GRID, index=False)
    (baseline / RUN).write_text(json.dumps({**run, "train": {**run["train"], "method": "rws-mlp"}}))
    paper = yaml.safe_load(PAPER_NUMBERS.read_text())["bmnist"]
    for spec in paper["long_run_claims"] + paper["long_run_every_set"]:
        assert spec["pair"] == [5, 10]  # the paper's K and L; this tiny run's are 2 and 2
        spec["pair"] = [2, 2]
    paper["long_run_claims"][0]["test_set"] = "T3_D1"
    grids = {"apg": (read_grid(tmp_path / "r"), (2, 2)), "rws-mlp": (read_grid(baseline), (2, 2))}
    decided = grid_claims(grids, paper)
    text = grid_markdown(tmp_path / "r", tmp_path / "out", "recorded/r", "png", decided, paper)
    assert "#### The paper's held-out grid at step 2 (`r`, apg)" in text and "| T4_D2 | 2 |" in text
    assert "APG − rws-mlp (px)" in text and "(step 1: " in text and "APG − avf (px)" in text
    line = next(x for x in text.splitlines() if x.startswith("| T3_D1 |"))
    assert line.endswith("| – | – |")  # no avf grid: no comparison
    assert "n/a (2 videos)" in line  # two videos are too few for a verdict, as two seeds are
    assert "| ≤ 3 |" in line  # T3_D1 given the first claim's target
    assert (tmp_path / "out" / "figure4.png").is_file() and (tmp_path / "out" / "figure3.png").is_file()
    # reports/metrics.json's entry: the same verdicts by claim id, and the reach per target set
    metrics = grid_metrics(grids, paper)
    assert metrics["claims"]["long_tracks_T10_D3"] == 0  # set to T3_D1 above: its table row's verdict
    assert set(metrics["claims"]) >= {"long_mse_falls_T4_D2", "long_below_rws_T4_D2", "long_below_avf_T4_D2"}
    assert metrics["reach"] == {"T3_D1": "too few steps"}
    assert grid_metrics({"rws-mlp": grids["rws-mlp"]}, paper) == {}  # no grid of the claims' method
    # a baseline's own section: its grid alone
    alone = grid_markdown(baseline, tmp_path / "out-rws", "recorded/rws", "png")
    assert "#### The paper's held-out grid at step 1 (`rws`, rws-mlp)" in alone and "APG −" not in alone


@needs_mnist
def test_the_grid_of_a_method_that_reports_one_sweep_has_a_row_per_video(tmp_path, mnist_env, monkeypatch):

    advance(tmp_path, tmp_path / "avf", steps=1, new=tiny_run("avf"))
    sets = [{"name": "T3_D1", "num_datasets": 2, "seed": 9, "sizes": {"num_frames": 3, "num_digits": 1}}]
    monkeypatch.setattr(run_grid, "grid_sets", lambda run: sets)
    grid = table(run_grid.evaluate_grid(tmp_path / "avf"))
    assert [(r["sweep"], r["video"]) for r in grid] == [("1", "0"), ("1", "1")]  # AVF's last iteration
    with np.load(tmp_path / "avf" / run_grid.TRAIL) as npz:  # its inferred paths as well
        assert npz["found_z_where"].shape == npz["true_z_where"].shape == (1, 3, 1, 2)


def test_a_baseline_run_is_the_same_training_with_the_baselines_cell():
    apg, rws = paper_run(), paper_run("rws-mlp")
    assert rws["train"]["method"] == "rws-mlp" and apg["train"]["method"] == "apg"
    different = {k for k in apg["train"] if apg["train"][k] != rws["train"][k]}
    assert different <= {"method", "network", "method_options"}, different
    assert (rws["rows"], rws["eval"], rws["every"], rws["seed"]) == (
        apg["rows"],
        apg["eval"],
        apg["every"],
        apg["seed"],
    )
    with pytest.raises(ValueError, match="trains no bmnist cell gibbs"):
        paper_run("gibbs")


def test_the_report_reads_the_baselines_runs_as_it_reads_apgs(tmp_path):
    from pipeline.report.runs import runs_markdown

    scored = {"apg": [0, 250, 500, 750], "rws-mlp": [0, 250, 500], "avf": [0, 500]}
    for method, scale in (("apg", 1.0), ("rws-mlp", 2.0), ("avf", 3.0)):
        steps = scored[method]
        write_scored_run(tmp_path, method, steps, [scale * (10 - s / 100) for s in steps], seconds=10.0)
    paper = yaml.safe_load(PAPER_NUMBERS.read_text())
    text = runs_markdown(tmp_path, tmp_path / "reports", paper, "png")
    assert text.count("### bmnist, `paper` profile") == 1
    # the methods side by side at the latest step all three runs scored
    assert "At step 500, the latest every run of the task has been scored at:" in text
    assert "| apg | 1 | 5 (one seed) |\n| avf | 1 | 15 (one seed) |\n| rws-mlp | 1 | 10 (one seed) |" in text
    # every run read against the same target; a curve of two steps after step 0 has no fit
    rows = {m: next(x for x in text.splitlines() if f"-{m}-K5-L10-s0` | 3 (" in x) for m in scored}
    assert "step^-" in rows["apg"] and rows["avf"].endswith(
        "too few scored steps after the first (a fit needs 3) |"
    )
    assert (tmp_path / "reports" / "recorded" / "runs-paper-bmnist.png").is_file()
    assert (tmp_path / "reports" / "recorded" / "runs-paper-bmnist-reach.png").is_file()
