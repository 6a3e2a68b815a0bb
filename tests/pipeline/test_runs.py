"""The run layer: any cell of any profile continued a sitting at a time, in separate processes,
is the run made in one sitting."""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apg.checkpoint import load_checkpoint
from pipeline.runs import spec
from pipeline.runs.execute import advance, latest_state

TIMING = ("it_per_s", "step_seconds", "seconds")


def table(path: Path, drop: tuple[str, ...] = TIMING) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if k not in drop} for row in csv.DictReader(f)]


def cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "APG_PROJECT_ROOT": str(root), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_a_cell_continued_in_two_processes_is_the_run_made_in_one(tmp_path):
    start = ["--profile", "smoke", "--every", "log=2", "checkpoint=2", "eval=4", "--eval-size", "4"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    name = spec.run_name("smoke", "gmm", "apg", 5, 4, 1)
    for root, steps in ((whole, ["6"]), (parts, ["2", "4"])):
        first = cli(root, "continue", "--start", "gmm/apg/K5/L4/seed1", "--steps", steps[0], *start)
        assert first.returncode == 0, first.stderr
        for more in steps[1:]:
            again = cli(root, "continue", f"recorded/{name}", "--steps", more)
            assert again.returncode == 0, again.stderr
    a, b = (root / "recorded" / name for root in (whole, parts))
    full_a, full_b = (load_checkpoint(d / spec.FULL_STATE)[1] for d in (a, b))
    assert full_a["iteration"] == full_b["iteration"] == 6
    for group in ("model", "proposals"):
        for key, tensor in full_a[group].items():
            assert torch.equal(tensor, full_b[group][key]), (group, key)
    assert table(a / spec.HISTORY) == table(b / spec.HISTORY)
    assert [r["iteration"] for r in table(b / spec.HISTORY)] == ["2", "4", "6"]
    assert table(a / spec.EVALS) == table(b / spec.EVALS)
    assert [r["iteration"] for r in table(b / spec.EVALS)] == ["0", "4"]
    assert {"log_joint", "log_joint_sem", "ess", "ari", "ari_sem"} <= set(table(b / spec.EVALS)[0])
    segments = table(b / spec.SEGMENTS)
    assert [(s["from_iteration"], s["to_iteration"]) for s in segments] == [("0", "2"), ("2", "6")]
    run = json.loads((b / spec.RUN).read_text())
    assert (run["train"]["task"], run["train"]["method"], run["seed"]) == ("gmm", "apg", 1)
    assert run["rows"]["num_datasets"] == 200 and run["eval"]["num_datasets"] == 4


def test_the_paper_profiles_rings_cells_are_runs(tmp_path):
    run = spec.new_run("paper", "dgmm", "rws-lstm", 10, 10, 0)
    train = run["train"]
    assert (train["sweeps"], train["particles"], train["batch_size"], train["iterations"]) == (
        10,
        10,
        20,
        200_000,
    )
    assert train["lr"] == 1e-4 and run["rows"]["num_datasets"] == 20_000 and run["rows"]["made"] == "whole"
    assert run["eval"]["name"] == "test" and run["eval"]["num_datasets"] == 50
    assert spec.parse_cell("dgmm/rws-lstm/K10/L10/seed0") == ("dgmm", "rws-lstm", 10, 10, 0)
    with pytest.raises(ValueError, match="trains no dgmm cell"):
        spec.new_run("paper", "dgmm", "apg", 10, 10, 7)
    with pytest.raises(ValueError, match="TASK/METHOD"):
        spec.parse_cell("dgmm/apg/10/10")
    with pytest.raises(ValueError, match="not a multiple"):
        spec.new_run("paper", "dgmm", "apg", 10, 10, 0, every={"log": 25, "eval": 30})


def test_a_sitting_refuses_what_means_nothing(tmp_path):
    new = spec.new_run("smoke", "gmm", "apg", 5, 4, 0, eval_size=2)
    for bad in (0.0, -5.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--minutes: must be"):
            advance(tmp_path, tmp_path / "r", minutes=bad, new=new)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="--steps: must be at least 1"):
            advance(tmp_path, tmp_path / "r", steps=bad, new=new)
    assert not (tmp_path / "r").exists()
    with pytest.raises(FileNotFoundError, match="no run there"):
        advance(tmp_path, tmp_path / "none", steps=1)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / spec.RUN).write_bytes(b"\x89PNG\x00\xff")
    with pytest.raises(ValueError, match="junk/run.json is not UTF-8 text"):
        advance(tmp_path, tmp_path / "junk", steps=1)


def test_a_damaged_run_folder_is_one_line_naming_the_file(tmp_path):
    new = spec.new_run(
        "smoke", "gmm", "apg", 5, 4, 0, eval_size=2, every={"log": 1, "checkpoint": 2, "eval": 2}
    )
    advance(tmp_path, tmp_path / "r", steps=2, new=new)
    run = json.loads((tmp_path / "r" / spec.RUN).read_text())

    def damaged(name: str, text: str) -> Path:
        copy = tmp_path / name
        shutil.copytree(tmp_path / "r", copy)
        target = copy / (spec.HISTORY if name.startswith("history") else spec.RUN)
        target.write_text(text)
        return copy

    for name, text, said in (
        ("list", "[1, 2]", "run.json: not a run"),
        ("train", json.dumps({**run, "train": "x"}), "run.json: train must be an object"),
        ("seed", json.dumps({**run, "seed": "abc"}), "run.json: seed must be an integer"),
        ("every", json.dumps({**run, "every": {**run["every"], "log": 0}}), "every.log: must be at least 1"),
        (
            "hidden",
            json.dumps({**run, "train": {**run["train"], "network": {"hidden": -4}}}),
            "train.network.hidden: must be at least 1",
        ),
        ("history-empty", "", "history.csv: no rows up to step 2"),
        ("history-cut", 'iteration,loss\n1,"2', "history.csv: not a run's table"),
    ):
        with pytest.raises(ValueError, match=said):
            advance(tmp_path, damaged(name, text), steps=1)


def test_the_cli_says_what_a_sitting_needs(tmp_path, monkeypatch, capsys):
    from pipeline.cli import main

    monkeypatch.setenv("APG_PROJECT_ROOT", str(tmp_path))
    for args, said in (
        (["continue", "recorded/x"], "give --minutes or --steps"),
        (["continue", "--steps", "1"], "name the runs' folders"),
        (["continue", "recorded/nothing", "--steps", "1"], "no run there"),
        (
            [
                "continue",
                "--start",
                "gmm/apg/K5/L4/seed0",
                "--profile",
                "smoke",
                "--steps",
                "1",
                "--every",
                "log",
            ],
            "KEY=VALUE",
        ),
        (["continue", "--start", "gmm/apg/5/4", "--profile", "smoke", "--steps", "1"], "TASK/METHOD"),
        (["continue", "recorded/x", "--steps", "-1"], "--steps: must be at least 1"),
        (["continue", "recorded/x", "--minutes", "nan"], "--minutes: must be a finite number"),
        (["continue", "recorded/x", "--minutes", "-5"], "--minutes: must be positive"),
        (["continue", "recorded/x", "--minutes", "1", "--device", "tpu9"], "--device tpu9: unknown device"),
        (["grid", "recorded/x", "--device", "tpu9"], "--device tpu9: unknown device"),
    ):
        with pytest.raises(SystemExit) as stop:
            main(args)
        err = capsys.readouterr().err
        assert stop.value.code == 2, (args, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], (args, err)
    assert not (tmp_path / "recorded").exists()


def test_a_run_continues_from_its_committed_state_alone(tmp_path):
    new = spec.new_run(
        "smoke", "dgmm", "rws-mlp", 3, 4, 0, eval_size=2, every={"log": 1, "checkpoint": 1, "eval": 2}
    )
    run_dir = tmp_path / "r"
    advance(tmp_path, run_dir, steps=2, new=new, full_state=False)
    assert not (run_dir / spec.FULL_STATE).exists()
    assert latest_state(run_dir)["iteration"] == 2
    segment = advance(tmp_path, run_dir, steps=1)
    assert (segment["from_iteration"], segment["to_iteration"]) == (2, 3)
    assert load_checkpoint(run_dir / spec.FULL_STATE)[1]["iteration"] == 3
    evals = table(run_dir / spec.EVALS)  # the rings: scored under the simulator's model too
    assert [r["iteration"] for r in evals] == ["0", "2"]
    assert all(float(r["log_joint_true"]) < 0 and -1 <= float(r["ari"]) <= 1 for r in evals)


def test_the_report_shows_each_run_and_the_methods_at_the_step_they_share(tmp_path):
    import yaml

    from pipeline.report.data import PAPER_NUMBERS
    from pipeline.report.runs import runs_markdown

    scored = {("apg", 0): [0, 500, 1000], ("apg", 1): [0, 500], ("rws-mlp", 0): [0, 500, 1000, 1500]}
    for (method, seed), steps in scored.items():
        folder = tmp_path / spec.RUNS_DIR / spec.run_name("paper", "dgmm", method, 10, 10, seed)
        spec.write_run(folder, spec.new_run("paper", "dgmm", method, 10, 10, seed))
        rows = [f"{s},{-1000 + s / 10 + seed},{0.1 * seed},{0.5},{0.01}" for s in steps]
        (folder / spec.EVALS).write_text(
            "iteration,log_joint_true,log_joint_true_sem,ari,ess\n" + "\n".join(rows) + "\n"
        )
        (folder / spec.SEGMENTS).write_text(
            f"from_iteration,to_iteration,seconds,device\n0,{steps[-1] + 20},3600,a CPU\n"
        )
    paper = yaml.safe_load(PAPER_NUMBERS.read_text())
    text = runs_markdown(tmp_path, tmp_path / "out", paper, "png")
    assert "### dgmm, `paper` profile" in text
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("| run | method ")))
    table = [line for line in lines[start : lines.index("", start)] if not line.startswith("| ---")]
    assert len({line.count(" | ") for line in table}) == 1, table  # the header has a column for every cell
    assert (
        "| `paper-dgmm-apg-K10-L10-s1` | apg | 1 | 520 | 200,000 | 1 | 1.00 | 500 | -949 ± 0.1 | 0.5 |"
        in text
    )
    assert (
        "| `paper-dgmm-apg-K10-L10-s1` | a CPU | 520 | 1.00 | 6.92 |" in text
    )  # its rate: no target, no reach
    assert "paper ESS/L" in text and "meets the target" not in text
    assert "At step 500, the latest every run" in text  # seed 1 of APG was scored at 500 last
    assert "| apg | 2 | -949.5 [" in text and "| rws-mlp | 1 | -950 (one seed) |" in text
    assert (tmp_path / "out" / "recorded" / "runs-paper-dgmm.png").is_file()
    assert runs_markdown(tmp_path / "none", tmp_path / "out", paper, "png") == ""
