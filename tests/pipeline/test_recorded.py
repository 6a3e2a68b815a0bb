"""Recorded runs (``apg-pipeline record``): profiles of the paper's params (overlays in
``profiles/``), the resumable sandbox, what is kept, and the report's section."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from pipeline.config import profiles
from pipeline.config.params import grid_cells
from pipeline.provenance import record as provenance
from pipeline.provenance import stages
from pipeline.recorded import record as recorded
from tests.support import REPO

RECORDED_PROFILES = sorted(set(profiles.profile_names()) - {"smoke", "paper"})
TABLE1_METHODS = ("apg", "rws-mlp", "rws-lstm")  # section 5.1: the methods the paper compares


def load_paper() -> dict:
    return profiles.resolve("paper")


def cell_keys(params: dict, task: str) -> set[tuple]:
    return {(c.method, c.sweeps, c.particles) for c in grid_cells(params, task)}


@pytest.mark.parametrize(
    "profile",
    sorted(
        set(RECORDED_PROFILES)
        - {"gpu-bmnist", "gpu-bmnist-3d", "gpu-bmnist-compiled", "gpu-gmm", "paper-gmm-std", "replicate"}
    ),
)
def test_profiles_keep_the_papers_per_step_sizes(profile):
    paper = load_paper()
    derived = recorded.derive(profile)
    for task in derived["tasks"]:
        ours, theirs = derived[task], paper[task]
        for key in ("model", "network"):
            assert ours[key] == theirs[key], (task, key)
        assert ours["train"]["batch_size"] == theirs["train"]["batch_size"]
        assert ours["train"]["lr"] == theirs["train"]["lr"]
        assert ours["data"]["train"]["sizes"] == theirs["data"]["train"]["sizes"]
        for key in ("test", "tests"):
            if key in theirs["data"]:
                sets = lambda d: d if isinstance(d, list) else [d]  # noqa: E731
                assert [s["sizes"] for s in sets(ours["data"][key])] == [
                    s["sizes"] for s in sets(theirs["data"][key])
                ]
        assert ours["evaluate"] == theirs["evaluate"]
        assert cell_keys(derived, task) <= cell_keys(paper, task)


def test_paper_check_runs_every_cell_of_the_paper_for_a_few_steps():
    paper, check = load_paper(), recorded.derive("paper-check")
    assert check["tasks"] == paper["tasks"]
    for task in paper["tasks"]:
        assert cell_keys(check, task) == cell_keys(paper, task)
        assert all(c.train.iterations <= recorded.CHECK_ITERATIONS for c in grid_cells(check, task))
        assert check[task]["data"]["train"]["num_datasets"] == paper[task]["train"]["batch_size"]


def test_paper_gmm_is_table_1_at_the_papers_training_length():
    paper, run = load_paper(), recorded.derive("paper-gmm")
    cells = {c.method: c for c in grid_cells(run, "gmm")}
    assert set(cells) == {"apg", "rws-mlp", "rws-lstm", "gibbs"}
    for method in TABLE1_METHODS:
        assert (cells[method].sweeps, cells[method].particles) == (10, 10)
        assert cells[method].train.iterations == paper["gmm"]["train"]["iterations"] == 200_000
        assert cells[method].seed == 0
    assert cells["gibbs"].train.iterations == 0
    assert run["gmm"]["data"]["train"]["num_datasets"] == 20_000
    assert run["sweep"]["torch_threads"] == 1 and run["sweep"]["gpus_per_trial"] == 0


def test_paper_gmm_std_is_paper_gmms_apg_on_standardized_offsets():
    narrow, std = recorded.derive("paper-gmm"), recorded.derive("paper-gmm-std")
    assert std["gmm"]["network"] == {**narrow["gmm"]["network"], "c_inputs": "standardized"}
    cells = {c.method: c for c in grid_cells(std, "gmm")}
    apg = {c.method: c for c in grid_cells(narrow, "gmm")}["apg"]
    assert set(cells) == {"apg", "gibbs"}
    assert (cells["apg"].sweeps, cells["apg"].particles, cells["apg"].seed) == (
        apg.sweeps,
        apg.particles,
        apg.seed,
    )
    same = ("iterations", "batch_size", "lr", "lr_schedule", "resample_mode")
    assert [getattr(cells["apg"].train, k) for k in same] == [getattr(apg.train, k) for k in same]
    assert cells["apg"].train.network == {"hidden": 32, "c_inputs": "standardized"}
    for key in ("model", "data", "evaluate"):
        assert std["gmm"][key] == narrow["gmm"][key]
    assert "standardized" in std["report"]["scale"]


def test_gpu_gmm_is_table_1_compiled_four_trials_to_a_gpu():
    paper, std, run = load_paper(), recorded.derive("paper-gmm-std"), recorded.derive("gpu-gmm")
    cells = grid_cells(run, "gmm")
    trained = [c for c in cells if c.method != "gibbs"]
    assert sorted((c.method, c.seed) for c in trained) == [
        ("apg", 0),
        ("apg", 1),
        ("rws-lstm", 0),
        ("rws-mlp", 0),
    ]
    # the paper's per-step sizes and data; paper-gmm-std's networks
    assert {(c.sweeps, c.particles, c.train.batch_size) for c in cells} == {(10, 10, 20)}
    assert run["gmm"]["network"] == std["gmm"]["network"] and run["gmm"]["data"] == paper["gmm"]["data"]
    assert run["gmm"]["evaluate"] == paper["gmm"]["evaluate"]
    # four trials to a GPU, every step compiled where the method allows it
    assert run["sweep"]["gpus_per_trial"] == 0.25 and len(trained) == 4
    assert {c.method for c in trained if c.train.compile} == {"apg", "rws-mlp"}
    # a tenth of the paper's iterations, at params.yaml's gmm schedule
    default = yaml.safe_load((REPO / "params.yaml").read_text())["gmm"]["train"]
    schedule = {k: default[k] for k in ("lr", "lr_schedule", "lr_final_factor", "lr_hold_fraction")}
    for c in trained:
        assert c.train.iterations == 20_000
        assert {k: getattr(c.train, k) for k in schedule} == schedule
    assert [c.train.iterations for c in cells if c.method == "gibbs"] == [0]
    assert "compiled" in run["report"]["scale"]


def test_gpu_bmnist_keeps_the_papers_budgets_and_test_sets_and_trains_on_one_digit():
    paper, run = load_paper(), recorded.derive("gpu-bmnist")
    ours, theirs = run["bmnist"], paper["bmnist"]
    assert run["tasks"] == ["bmnist"]
    assert (
        cell_keys(run, "bmnist")
        == cell_keys(paper, "bmnist")
        == {("apg", 5, 10), ("rws-mlp", 5, 10), ("avf", 5, 10)}
    )
    assert (
        ours["model"] == theirs["model"]
        and ours["train"]["batch_size"] == theirs["train"]["batch_size"] == 10
    )
    # The curriculum's first step: one digit in training; the paper's T=10 videos.
    assert ours["network"]["num_digits"] == ours["data"]["train"]["sizes"]["num_digits"] == 1
    assert (
        ours["data"]["train"]["sizes"]["num_frames"] == theirs["data"]["train"]["sizes"]["num_frames"] == 10
    )
    # Every held-out set of the paper (T in {10, 20, 100} x D in {3, 4, 5}), fewer videos each.
    assert [t["sizes"] for t in ours["data"]["tests"]] == [t["sizes"] for t in theirs["data"]["tests"]]
    assert [t["network"] for t in ours["data"]["tests"]] == [t["network"] for t in theirs["data"]["tests"]]
    assert all(0 < t["num_datasets"] <= 20 for t in ours["data"]["tests"])
    assert ours["evaluate"]["pairs"] == [[5, 10]]
    check = recorded.derive("gpu-bmnist", check=True)
    assert all(c.train.iterations <= recorded.CHECK_ITERATIONS for c in grid_cells(check, "bmnist"))
    assert len(check["bmnist"]["data"]["tests"]) == 1


def test_gpu_bmnist_3d_trains_the_papers_three_digit_videos_from_gpu_bmnists_cells():
    paper, first, run = load_paper(), recorded.derive("gpu-bmnist"), recorded.derive("gpu-bmnist-3d")
    ours, theirs = run["bmnist"], paper["bmnist"]
    assert recorded.STARTS_FROM["gpu-bmnist-3d"] == "gpu-bmnist"
    # The paper's training videos and networks (three digits), its K, L, B and test sets.
    assert ours["network"] == theirs["network"] and ours["network"]["num_digits"] == 3
    assert ours["data"]["train"]["sizes"] == theirs["data"]["train"]["sizes"]
    assert ours["model"] == theirs["model"] and ours["train"]["batch_size"] == theirs["train"]["batch_size"]
    assert [t["sizes"] for t in ours["data"]["tests"]] == [t["sizes"] for t in theirs["data"]["tests"]]
    # Every cell has one in the first step to start from.
    assert cell_keys(run, "bmnist") == cell_keys(first, "bmnist")
    assert {c.seed for c in grid_cells(run, "bmnist")} == {c.seed for c in grid_cells(first, "bmnist")}
    assert ours["train"]["lr"] < first["bmnist"]["train"]["lr"]


def test_gpu_bmnist_compiled_is_gpu_bmnist_with_every_step_that_compiles_compiled():
    from apg.baselines import METHODS

    first, run = recorded.derive("gpu-bmnist"), recorded.derive("gpu-bmnist-compiled")
    compiled = {c.method: c.train.compile for c in grid_cells(run, "bmnist")}
    assert compiled == {"apg": True, "rws-mlp": True, "avf": False}
    # eager exactly where the method cannot compile (the overlay states it; the methods know it)
    assert {m: not METHODS[m].not_compiled_because for m in compiled} == compiled
    assert not any(c.train.compile for c in grid_cells(first, "bmnist"))
    # Otherwise the same run: data, networks, schedule and cells.
    for key in ("data", "network", "model", "evaluate"):
        assert run["bmnist"][key] == first["bmnist"][key]
    assert {k: v for k, v in run["bmnist"]["train"].items() if k != "compile"} == first["bmnist"]["train"]
    assert cell_keys(run, "bmnist") == cell_keys(first, "bmnist")


def test_an_unknown_profile_is_a_one_line_error():
    with pytest.raises(ValueError, match="unknown profile 'nope'; known: gpu-bmnist, gpu-bmnist-3d"):
        recorded.derive("nope")


def test_a_sandbox_is_resumed_only_under_the_params_that_made_it(tmp_path):
    box = tmp_path / "box"
    _, first = recorded.sandbox_for("paper-gmm", None, box, fresh=False)
    assert first["code_digest"] == {"gmm": stages.code_digest("sweep", "gmm", stages.package_root())}
    assert first["base"] == "profiles/paper.yaml"
    _, again = recorded.sandbox_for("paper-gmm", None, box, fresh=False)
    assert again["resumed"] == 1 and again["started"] == first["started"]
    assert again["commits"] == [first["commit"]]
    with pytest.raises(ValueError, match="started with other params"):
        recorded.sandbox_for("paper-gmm", "smoke", box, fresh=False)


def test_a_sandbox_resumed_under_other_code_takes_this_code_and_keeps_its_results(tmp_path):
    # Which finished cells stay is the sweep's plan's business (their numerics fingerprints);
    # the sandbox must run this code, keep what it made, and name both commits.
    box = tmp_path / "box"
    _, first = recorded.sandbox_for("paper-gmm", None, box, fresh=False)
    stale = box / "apg" / "training.py"
    stale.write_text(stale.read_text() + "\n# older code\n")
    (box / "apg" / "gone.py").write_text("")
    (box / "results").mkdir()
    (box / "results" / "kept.txt").write_text("a finished cell")
    marker = box / recorded.SANDBOX_INFO
    info = json.loads(marker.read_text())
    marker.write_text(json.dumps({**info, "commit": "0" * 10, "code_digest": {"gmm": "older"}}))
    _, again = recorded.sandbox_for("paper-gmm", None, box, fresh=False)
    src = stages.package_root()
    assert stale.read_text() == (src / "apg" / "training.py").read_text()
    assert not (box / "apg" / "gone.py").exists()
    assert (box / "results" / "kept.txt").read_text() == "a finished cell"
    assert again["code_digest"] == first["code_digest"] and again["started"] == first["started"]
    assert again["commits"] == ["0" * 10, first["commit"]] and again["resumed"] == 1
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ValueError, match="not a recorded run's sandbox"):
        recorded.sandbox_for("paper-gmm", None, other, fresh=False)


@pytest.mark.slow
def test_record_keeps_a_run_that_the_report_shows_without_retraining(tmp_path):
    # paper-gmm derived from the smoke profile: the same code path in under a minute.
    env = {
        **os.environ,
        "APG_PROJECT_ROOT": str(tmp_path),
        "RAY_AUTH_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "record",
        "paper-gmm",
        "--params",
        "smoke",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kept = tmp_path / "recorded" / "paper-gmm"
    manifest = json.loads((kept / "manifest.json").read_text())
    assert manifest["commit"] == provenance.git_commit(REPO)
    assert manifest["cells"] == {"gmm": 4}
    for name in recorded.EVAL_FILES + ("sweep.json",):
        assert (kept / "eval" / "gmm" / name).is_file(), name
    sweep = json.loads((kept / "eval" / "gmm" / "sweep.json").read_text())
    for cell in sweep["cells"]:
        assert (tmp_path / cell["checkpoint"]).is_file()  # paths point into recorded/
    first = {c["cell_id"]: c["checkpoint_sha256"] for c in sweep["cells"]}

    # Run again: the sandbox is resumed and nothing is retrained.
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = json.loads((kept / "eval" / "gmm" / "sweep.json").read_text())
    assert {c["cell_id"]: c["checkpoint_sha256"] for c in again["cells"]} == first
    assert json.loads((kept / "manifest.json").read_text())["resumed"] == 1

    # The sandbox gone, one task re-recorded from the recorded cells: none trains again.
    import shutil

    shutil.rmtree(tmp_path / "runs" / "paper-gmm")
    proc = subprocess.run(
        [*cmd, "--tasks", "gmm"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished cells put back from recorded/paper-gmm: {'gmm': 4}" in proc.stdout
    last = json.loads(
        (tmp_path / "runs" / "paper-gmm" / "results" / "sweeps" / "gmm" / "last_run.json").read_text()
    )
    assert last["trained"] == [] and sorted(last["skipped"]) == sorted(first)
    again = json.loads((kept / "eval" / "gmm" / "sweep.json").read_text())
    assert {c["cell_id"]: c["checkpoint_sha256"] for c in again["cells"]} == first
    rerecorded = json.loads((kept / "manifest.json").read_text())
    assert rerecorded["started"] == manifest["started"] and rerecorded["cells"] == {"gmm": 4}
    assert rerecorded["rerecorded"]["gmm"]["commit"] == manifest["commit"]
    assert yaml.safe_load((kept / "params.yaml").read_text()) == recorded.derive("paper-gmm", under="smoke")

    from pipeline import report

    paper_all = yaml.safe_load(report.PAPER_NUMBERS.read_text())
    md = report.recorded_markdown(tmp_path, tmp_path / "reports", paper_all, "png")
    assert "### [`paper-gmm`](recorded/paper-gmm/README.md): paper scale" in md
    assert f"Trained by commit `{manifest['commit']}`" in md and "Training code today: the same" in md
    assert f"Re-recorded since: gmm by commit `{manifest['commit']}`" in md
    assert "Table 1, gmm" in md and "| apg" in md
    page = (tmp_path / "reports" / "recorded" / "paper-gmm" / "README.md").read_text()
    assert "at the paper's scale, APG {c} ESS/L at or above the paper's" in page  # paper-scale claims
    assert (tmp_path / "reports" / "recorded" / "paper-gmm" / "figures" / "gmm_training.png").is_file()


def test_re_recording_some_tasks_keeps_the_others_and_names_its_commit():
    old = {
        "commit": "a" * 10,
        "started": "t0",
        "code_digest": {"gmm": "g0", "dgmm": "d0"},
        "stage_minutes": {"sweep@gmm": 70.0, "sweep@dgmm": 17.0, "report": 1.0},
        "cells": {"gmm": 33, "dgmm": 17},
    }
    new = {
        "commit": "b" * 10,
        "started": "t1",
        "finished": "t2",
        "machine": "cpu",
        "code_digest": {"gmm": "g1"},
        "stage_minutes": {"sweep@gmm": 15.0, "report": 2.0},
        "cells": {"gmm": 33},
    }
    merged = recorded.merged_manifest(old, new, {"tasks": ["gmm", "dgmm"]}, ["gmm"])
    assert merged["commit"] == "a" * 10 and merged["started"] == "t0"
    assert merged["commits"] == ["a" * 10, "b" * 10]
    assert merged["code_digest"] == {"gmm": "g1", "dgmm": "d0"}
    assert merged["stage_minutes"] == {"sweep@dgmm": 17.0, "report": 1.0, "sweep@gmm": 15.0}
    assert merged["rerecorded"] == {"gmm": {"commit": "b" * 10, "finished": "t2", "machine": "cpu"}}


def test_tasks_are_re_recorded_only_for_a_recorded_run_with_dvc(tmp_path):
    with pytest.raises(ValueError, match="not with --direct"):
        recorded._check_tasks("replicate", ["gmm"], None, False, True, REPO)
    with pytest.raises(ValueError, match="recorded/replicate, which has no manifest.json"):
        recorded._check_tasks("replicate", ["gmm"], None, False, False, tmp_path)
    with pytest.raises(ValueError, match="rings not among profile replicate's tasks"):
        recorded._check_tasks("replicate", ["rings"], None, False, False, REPO)


def test_the_report_has_no_recorded_section_without_recorded_runs(tmp_path):
    from pipeline import report

    assert report.recorded_markdown(tmp_path, tmp_path / "reports", {}, "png") == ""


def test_the_replicate_profile_moves_every_seed_and_its_check_keeps_the_imputed_set():
    assert profiles.extends("replicate") == "params.yaml"
    defaults = yaml.safe_load((REPO / "params.yaml").read_text())
    params = recorded.derive("replicate")
    for task in defaults["tasks"]:
        for entry, moved in zip(defaults[task]["grid"], params[task]["grid"], strict=True):
            assert moved["seeds"] == [s + 100 for s in entry["seeds"]]
            assert {**moved, "seeds": entry["seeds"]} == entry  # the grid restated, seeds apart
        assert params[task]["data"] == defaults[task]["data"]  # the same data and held-out sets
    assert {k: v for k, v in params.items() if k not in defaults["tasks"] + ["report"]} == {
        k: v for k, v in defaults.items() if k not in defaults["tasks"] + ["report"]
    }
    checked = recorded.derive("replicate", check=True)
    names = [t["name"] for t in checked["bmnist"]["data"]["tests"]]
    assert names == ["T5_D1", defaults["bmnist"]["evaluate"]["imputation"]["test_set"]]
