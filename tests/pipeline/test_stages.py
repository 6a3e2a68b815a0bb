"""The DVC / Ray Tune / MLflow stages for real, on tiny params in a temporary git repo (slow):
``dvc repro`` end to end, a sweep interrupted after some trials finished and resumed, reused
cells and their MLflow runs, the progress line, the smoke profile from scratch.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

from pipeline import tracking
from pipeline.provenance.stages import TIMINGS
from tests.pipeline.harness import TINY, env, make_repo, mlflow_runs, run, start_sweep, tiny
from tests.support import MNIST_DIR, REPO, needs_mnist


@pytest.mark.slow
def test_dvc_repro_end_to_end(tmp_path, tiny):
    # A second entry sweeps the proposals' width: 8 is the task's own (the first entry's cell).
    axis = {"methods": ["apg"], "pairs": [[2, 3]], "seeds": [0], "axes": {"network.hidden": [4, 8]}}
    root = make_repo(tmp_path, tiny(**{"gmm.grid": [TINY["gmm"]["grid"][0], axis]}))
    first = run(["dvc", "repro"], root)
    for stage in ("generate@gmm", "sweep@gmm", "evaluate@gmm", "report"):
        assert f"Running stage '{stage}'" in first.stdout

    # MLflow: one parent per sweep, one child per trial, with step metrics; the experiment
    # opens in the runs table; the swept key is a param under its grid name.
    client, runs = mlflow_runs(root, "apg-test")
    kind = client.get_experiment_by_name("apg-test").tags.get("mlflow.experimentKind")
    assert kind == "custom_model_development"
    parents = [r for r in runs if tracking.TAG_SWEEP in r.data.tags]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get(tracking.TAG_PARENT) == parents[0].info.run_id]
    assert sorted(r.info.run_name for r in children) == [
        "gmm/apg/K2/L3/seed0",
        "gmm/apg/K2/L3/seed0/network.hidden=4",
        "gmm/rws-mlp/K2/L3/seed0",
    ]
    assert {
        r.info.run_name: r.data.params["network.hidden"] for r in children if "apg" in r.info.run_name
    } == {
        "gmm/apg/K2/L3/seed0": "8",
        "gmm/apg/K2/L3/seed0/network.hidden=4": "4",
    }
    for child in children:
        assert child.info.status == "FINISHED"
        history = client.get_metric_history(child.info.run_id, "log_joint")
        assert [m.step for m in history] == [2, 4, 6]
        assert all(math.isfinite(m.value) for m in history)
        assert "it_per_s" in child.data.metrics
    # each cell's trained model, logged in MLflow's PyTorch format, loads with its weights
    import mlflow.pytorch

    from apg.checkpoint import load_checkpoint

    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    for child in children:
        logged = mlflow.pytorch.load_model(f"runs:/{child.info.run_id}/model", map_location="cpu")
        cell = child.data.tags[tracking.TAG_CELL]
        weights = load_checkpoint(root / "results" / "sweeps" / "gmm" / "cells" / cell / "model.pt")[1]
        for part in ("model", "proposals"):
            mine = getattr(logged, part).state_dict()
            assert mine.keys() == weights[part].keys()
            assert all(torch.equal(mine[k], v) for k, v in weights[part].items()), (cell, part)

    # Report: files exist, every (method, K, L) cell of Table 1 has finite numbers.
    reports = root / "reports"
    for name in (
        "README.md",
        "metrics.json",
        "data/metrics-full.json",
        "tables/gmm_table1.md",
        "figures/gmm_budget.png",
        "figures/gmm_sweeps.png",
        "figures/gmm_training.png",
        "figures/gmm_samples.png",
    ):
        assert (reports / name).is_file(), name
    table = pd.read_csv(reports / "tables" / "gmm_table1.csv")
    assert sorted(zip(table["method"], table["K"], table["L"], strict=True)) == [
        ("apg", 2, 3),
        ("apg", 3, 3),
        ("apg [network.hidden=4]", 2, 3),
        ("apg [network.hidden=4]", 3, 3),
        ("rws-mlp", 2, 3),
        ("rws-mlp", 3, 3),
    ]
    # The swept key's figure and table: APG at width 4 (the swept cell) and 8 (the task's cell).
    assert (reports / "figures" / "gmm_axis_network_hidden.png").is_file()
    axis_table = pd.read_csv(reports / "tables" / "gmm_axis_network_hidden.csv")
    lj = axis_table[axis_table["metric"] == "log_joint"]
    assert (
        sorted(lj["value"]) == [4, 8] and set(lj["method"]) == {"apg"} and lj["mean"].map(math.isfinite).all()
    )
    assert "#### `network.hidden`" in (reports / "README.md").read_text()
    for column in ("log_joint", "d_log_joint", "ess", "log_evidence"):
        assert table[column].map(math.isfinite).all(), column
    apg = table[table["method"] == "apg"]
    for column in ("ess_globals", "ess_c", "kl_globals", "kl_c"):
        assert apg[column].map(math.isfinite).all(), column
    assert "tiny test" in (reports / "README.md").read_text()
    metrics = json.loads((reports / "data" / "metrics-full.json").read_text())
    assert set(metrics["gmm"]) == {
        "apg/K2/L3",
        "apg/K3/L3",
        "apg [network.hidden=4]/K2/L3",
        "apg [network.hidden=4]/K3/L3",
        "rws-mlp/K2/L3",
        "rws-mlp/K3/L3",
    }

    second = run(["dvc", "repro"], root)
    assert "Running stage" not in second.stdout
    assert "Data and pipelines are up to date" in second.stdout

    # A refactor that keeps the numbers (here: a comment) reruns the stages that read the code
    # and trains nothing: every cell keeps its id, and the Time table the training's wall time.
    summary, timing = (root / "results" / "gmm" / "sweep.json").read_text(), root / TIMINGS / "sweep@gmm.json"
    trained_in = timing.read_text()
    with open(root / "apg" / "training.py", "a") as f:
        f.write("# a comment: no number changes\n")
    third = run(["dvc", "repro"], root)
    assert "Running stage 'sweep@gmm'" in third.stdout and "0 to train" in third.stdout
    assert (root / "results" / "gmm" / "sweep.json").read_text() == summary
    assert timing.read_text() == trained_in


@pytest.mark.slow
def test_interrupted_sweep_resumes_without_rerunning_finished_cells(tmp_path, tiny):
    params = tiny(
        **{
            "sweep.max_concurrent": 1,  # cells finish one after another, so we can stop between them
            "gmm.train.iterations": 40,
            "gmm.grid": [{"methods": ["rws-mlp", "apg", "rws-lstm"], "pairs": [[2, 3]], "seeds": [0]}],
        }
    )
    root = make_repo(tmp_path, params)
    cells = root / "results" / "sweeps" / "gmm" / "cells"
    proc = start_sweep(root)
    try:
        deadline = time.time() + 400
        while not list(cells.glob("*/done.json")) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)  # Tune stops trials and saves its state; the driver shuts Ray down
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    finished = {p.parent.name: p.stat().st_mtime_ns for p in cells.glob("*/done.json")}
    assert 1 <= len(finished) < 3, finished
    assert not (root / "results" / "gmm" / "sweep.json").exists()

    resumed = run([sys.executable, "-m", "pipeline.sweep.stage", "--task", "gmm"], root)
    summary = json.loads((root / "results" / "gmm" / "sweep.json").read_text())
    assert len(summary["cells"]) == 3
    # Ray Train's line per checkpoint is silenced in the trials (the progress line says it all)
    assert "Checkpoint successfully created" not in resumed.stdout + resumed.stderr
    last_run = json.loads((root / "results" / "sweeps" / "gmm" / "last_run.json").read_text())
    assert sorted(last_run["skipped"]) == sorted(finished)
    assert len(last_run["trained"]) == 3 - len(finished)
    for cell_id, mtime in finished.items():  # finished cells were not touched again
        assert (cells / cell_id / "done.json").stat().st_mtime_ns == mtime
    assert all(c["iterations"] == 40 for c in summary["cells"])

    # One child run per cell even across the interruption.
    _, runs = mlflow_runs(root, "apg-test")
    names = sorted(r.info.run_name for r in runs if tracking.TAG_PARENT in r.data.tags)
    assert names == ["gmm/apg/K2/L3/seed0", "gmm/rws-lstm/K2/L3/seed0", "gmm/rws-mlp/K2/L3/seed0"]


@pytest.mark.slow
def test_unsatisfiable_gpu_request_fails_before_trials(tmp_path, tiny):
    root = make_repo(tmp_path, tiny(**{"sweep.gpus_per_trial": 1}))
    run([sys.executable, "-m", "pipeline.generate", "--task", "gmm"], root)
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.sweep.stage", "--task", "gmm"],
        cwd=root,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "apg-pipeline: error: sweep.gpus_per_trial=1 but the Ray cluster has 0 GPUs"
    )
    assert not (root / "results" / "sweeps" / "gmm" / "cells").exists()


@pytest.mark.slow
def test_reused_cells_keep_the_mlflow_run_that_trained_them(tmp_path):
    # A sweep whose grid changed gets a new parent run; its cells trained by the earlier
    # sweep are reused, and the report must still trace them to their training runs.
    from pipeline.evaluate.logged import mlflow_run_ids

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = tracking.client(uri)
    exp = tracking.experiment_id(client, "apg-test", None)
    old_parent = tracking.open_parent(client, exp, "grid-1", "gmm sweep", {})
    trained = tracking.open_child(client, exp, old_parent, "apg-K2-L3-s0-abc", "gmm/apg", {})
    new_parent = tracking.open_parent(client, exp, "grid-2", "gmm sweep", {})
    fresh = tracking.open_child(client, exp, new_parent, "rws-K2-L3-s0-def", "gmm/rws", {})
    summary = {
        "mlflow": {"tracking_uri": uri, "experiment_id": exp, "parent_run_id": new_parent},
        "cells": [{"cell_id": "apg-K2-L3-s0-abc"}, {"cell_id": "rws-K2-L3-s0-def"}, {"cell_id": "none"}],
    }
    assert mlflow_run_ids(summary) == {"apg-K2-L3-s0-abc": trained, "rws-K2-L3-s0-def": fresh}


@pytest.mark.slow
def test_run_ids_of_a_sweep_run_in_a_moved_project(tmp_path, monkeypatch):
    # The sweep ran in a copy of the project whose store is gone (its mlflow.db copied into
    # this one): the lookup must use this project's store, not create an empty one there.
    from pipeline.evaluate import logged as evaluate_mlflow

    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(evaluate_mlflow, "project_root", lambda: project)
    client = tracking.client(tracking.tracking_uri(project))
    exp = tracking.experiment_id(client, "apg-test", None)
    parent = tracking.open_parent(client, exp, "grid-1", "gmm sweep", {})
    child = tracking.open_child(client, exp, parent, "apg-K2-L3-s0-abc", "gmm/apg", {})
    gone = tmp_path / "old-copy" / "mlflow.db"
    summary = {
        "mlflow": {"tracking_uri": f"sqlite:///{gone}", "experiment_id": exp, "parent_run_id": parent},
        "cells": [{"cell_id": "apg-K2-L3-s0-abc"}],
    }
    assert evaluate_mlflow.mlflow_run_ids(summary) == {"apg-K2-L3-s0-abc": child}
    assert not gone.parent.exists()


def _planned(tmp_path, monkeypatch, code: str, reuse: bool = False):
    from apg.data import save_dataset
    from apg.tasks import get_task
    from pipeline.sweep import stage as sweep

    data = tmp_path / "data" / "gmm" / "train.npz"
    if not data.is_file():
        task = get_task("gmm")
        arrays = task.simulate(task.build_model(), 4, __import__("torch").Generator().manual_seed(0))
        save_dataset(data, {k: v.numpy() for k, v in arrays.items()})
    monkeypatch.setattr(sweep, "fingerprint", lambda *args, **kwargs: code)
    return sweep.plan(tiny(**{"sweep.reuse_across_code": reuse}), "gmm", tmp_path)


def test_cells_trained_by_other_code_are_new_cells_unless_reuse_is_asked_for(tmp_path, monkeypatch):
    cells, _, sweep_dir = _planned(tmp_path, monkeypatch, "code-1")
    assert all(cell.fingerprint == "code-1" for cell in cells.values())
    old_id = next(cid for cid, cell in cells.items() if cell.method == "apg")
    (sweep_dir / "cells" / old_id).mkdir(parents=True)
    key = cells[old_id].config_key
    (sweep_dir / "cells" / old_id / "done.json").write_text(
        json.dumps({"config_key": key, "fingerprint": "code-1"})
    )

    changed, _, _ = _planned(tmp_path, monkeypatch, "code-2")
    assert old_id not in changed  # other code: the finished cell is not reused
    assert {c.config_key for c in changed.values()} == {c.config_key for c in cells.values()}

    reused, _, _ = _planned(tmp_path, monkeypatch, "code-2", reuse=True)
    assert old_id in reused and reused[old_id].fingerprint == "code-2"  # flagged by summarize
    assert len(reused) == len(cells)


def test_provenance_says_which_recorded_cells_a_repro_would_retrain(tmp_path, monkeypatch, tiny):
    from pipeline.provenance import record as provenance

    cells, _, _ = _planned(tmp_path, monkeypatch, "numbers-1")
    params = tiny()
    recorded = {
        "fingerprints": {
            "gmm": {
                cell.name: {"cell_id": cid, "fingerprint": cell.fingerprint} for cid, cell in cells.items()
            }
        }
    }
    n = len(cells)
    line = provenance.retraining(tmp_path, params, recorded)
    assert (
        line
        == f"Training: 0 of {n} recorded cells would retrain: every cell id, fingerprint included, is unchanged."
    )
    monkeypatch.setattr(sweep_module(), "fingerprint", lambda *args, **kwargs: "numbers-2")
    assert provenance.retraining(tmp_path, params, recorded).startswith(
        f"Training: {n} of {n} recorded cells would retrain"
    )
    line = provenance.retraining(tmp_path, params, recorded)
    first = sorted(cell.name for cell in cells.values())[0]
    assert f"; {n} for their numerics fingerprint ({first}, " in line  # named, not only counted
    monkeypatch.setattr(sweep_module(), "fingerprint", lambda *args, **kwargs: "numbers-1")
    longer = tiny(**{"gmm.train.iterations": 7})  # a params edit the fingerprint cannot see
    assert "; 0 for their numerics fingerprint, the rest for their config" in provenance.retraining(
        tmp_path, longer, recorded
    )
    recorded["fingerprints"]["dgmm"] = {"dgmm/apg/K2/L3/seed0": {"cell_id": "x", "fingerprint": "y"}}
    assert "; not checked for dgmm (not in params.yaml's tasks)." in provenance.retraining(
        tmp_path, params, recorded
    )
    (tmp_path / "data" / "gmm" / "train.npz").unlink()
    assert "not checked for gmm (no training data" in provenance.retraining(tmp_path, params, recorded)


def sweep_module():
    from pipeline.sweep import stage as sweep

    return sweep


def test_sweep_progress_counts_cells_and_estimates_the_time_left(capsys):
    from pipeline.sweep.stage import SweepProgress

    configs = [
        {"cell_id": "a", "train": {"iterations": 100, "method": "apg"}},
        {"cell_id": "b", "train": {"iterations": 100, "method": "apg"}},
        {"cell_id": "c", "train": {"iterations": 50, "method": "rws-mlp"}},
    ]
    progress = SweepProgress("gmm", configs, done_before=1, parallel=2, every=1e9)
    assert progress.eta_seconds() is None
    progress.started["a"] = (progress.start - 10.0, 0)  # a ran 50 iterations in 10 s
    progress.result("a", 50)
    # left: a 50 + b 100 + c 50 iterations at 0.2 s (c's method unseen: the mean), 2 at once
    assert progress.eta_seconds() == pytest.approx(200 * 0.2 / 2, rel=0.01)
    progress.complete("a")
    assert "gmm: 2/4 cells done" in capsys.readouterr().out


def test_a_sandbox_replaces_only_a_sandbox(tmp_path):
    from pipeline.smoke import MARKER, make_sandbox

    params = REPO / "params.yaml"
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("precious")
    with pytest.raises(ValueError, match="is not empty and is not a sandbox"):
        make_sandbox(kept, params, init_repo=False)
    assert (kept / "notes.txt").read_text() == "precious"
    for holder in (REPO, REPO.parent):
        with pytest.raises(ValueError, match="holds this project"):
            make_sandbox(holder, params, init_repo=False)
    box = make_sandbox(tmp_path / "box", params, init_repo=False)  # new
    (box / "left-over").write_text("x")
    box = make_sandbox(box, params, init_repo=False)  # a sandbox: remade
    assert (box / MARKER).is_file() and not (box / "left-over").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (make_sandbox(empty, params, init_repo=False) / "params.yaml").is_file()


# What Ray 2.60, Tune and DVC 3.67 print, as their sources write it, that smoke keeps out:
# Ray's token-auth warnings (on or off), Tune's status tables (new and old output) and its
# results-folder and TensorBoard lines, DVC's "git add" / auto-staging / "dvc push" hints.
QUIETED = (
    "Token authentication is",
    "Trial status:",
    "== Status ==",
    "View detailed results here",
    "tensorboard --logdir",
    "To track the changes with git",
    "git add",
    "dvc config core.autostage",
    "dvc push",
)


@pytest.mark.slow
@needs_mnist
def test_smoke_profile_runs_every_stage_of_every_task_from_scratch(tmp_path):
    box = tmp_path / "smoke"
    # MNIST relative to where the command is typed, as the README writes it (the stages run in
    # the sandbox); RAY_AUTH_MODE unset, as in a user's shell: the sweep's own setting must
    # keep Ray's token warning out.
    smoke_env = {**env(), "APG_MNIST_DIR": os.path.relpath(MNIST_DIR, REPO)}
    smoke_env.pop("RAY_AUTH_MODE")
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "smoke", "--dir", str(box)],
        cwd=REPO,
        env=smoke_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    for hint in QUIETED:
        assert hint not in output, (hint, output[-3000:])
    from pipeline.config.profiles import resolve

    tasks = resolve("smoke")["tasks"]
    for task in tasks:
        for stage in ("generate", "sweep", "evaluate"):
            assert f"`{stage}@{task}`" in proc.stdout, (stage, task)
        assert f"sweep {task}: " in proc.stdout  # progress lines
    assert "| `report` |" in proc.stdout  # the report stage is in the stage table too
    assert "browse the claims: mlflow ui --backend-store-uri sqlite:///" in proc.stdout  # the claims run
    assert "smoke run of smoke: dvc repro from scratch in" in proc.stdout
    report = (box / "reports" / "README.md").read_text()
    assert "Claims of the paper" in report
    from pipeline.provenance import record as provenance

    assert provenance.check(box)[0]  # the record matches the sandbox's code and params
