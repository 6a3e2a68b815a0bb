"""The DVC / Ray Tune / MLflow pipeline.

Fast tests check params validation and fail-fast paths (no Ray). Slow tests run the real
stages on tiny params in a temporary git repo: ``dvc repro`` end to end, and a sweep
interrupted after some trials finished, then resumed.
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
import yaml

from pipeline import tracking
from pipeline.config import ParamsError, grid_cells, validate_params
from pipeline.errors import SweepError
from pipeline.ray_setup import check_ray_address
from pipeline.stages import TIMINGS
from tests.pipeline.harness import TINY, env, make_repo, mlflow_runs, run, start_sweep, tiny
from tests.support import MNIST_DIR, REPO, needs_mnist

# --------------------------------------------------------------------------- fast: params


def test_tiny_params_are_valid(tiny):
    validate_params(tiny())
    cells = grid_cells(tiny(), "gmm")
    assert [c.name for c in cells] == ["gmm/apg/K2/L3/seed0", "gmm/rws-mlp/K2/L3/seed0"]


def test_budget_grid_expands_to_pairs(tiny):
    params = tiny(
        **{"gmm.grid": [{"methods": ["apg"], "budget": {"total": 20, "sweeps": [2, 5]}, "seeds": [0, 1]}]}
    )
    assert sorted((c.sweeps, c.particles, c.seed) for c in grid_cells(params, "gmm")) == [
        (2, 10, 0),
        (2, 10, 1),
        (5, 4, 0),
        (5, 4, 1),
    ]


def test_cell_id_changes_with_any_option(tiny):
    base = grid_cells(tiny(), "gmm")[0].cell_id("data")
    assert grid_cells(tiny(), "gmm")[0].cell_id("data") == base
    assert grid_cells(tiny(**{"gmm.train.iterations": 7}), "gmm")[0].cell_id("data") != base
    assert grid_cells(tiny(), "gmm")[0].cell_id("other data") != base


def test_axes_cross_any_key_with_methods_and_seeds(tiny):
    entry = {
        "methods": ["apg"],
        "pairs": [[2, 3]],
        "seeds": [0, 1],
        "axes": {"network.hidden": [8, 16], "train.lr": [0.01, 0.003]},
    }
    cells = grid_cells(tiny(**{"gmm.grid": [TINY["gmm"]["grid"][0], entry]}), "gmm")
    swept = [c for c in cells if c.axes]
    # hidden 8 with lr 0.01 at seed 0 is the first entry's cell: trained once, under its name
    assert len(cells) == 2 + 2 * 4 - 1 and len(swept) == 2 * 4 - 1
    by_setting = {(c.train.network["hidden"], c.train.lr, c.seed): c for c in cells if c.method == "apg"}
    assert len(by_setting) == 8
    assert by_setting[(8, 0.01, 0)].name == "gmm/apg/K2/L3/seed0"
    one = by_setting[(16, 0.003, 1)]
    assert one.name == "gmm/apg/K2/L3/seed1/network.hidden=16,train.lr=0.003"
    assert one.axes == (("network.hidden", 16), ("train.lr", 0.003))
    assert len({c.name for c in cells}) == len({c.cell_id("d") for c in cells}) == len(cells)


def test_an_entry_sets_its_methods_own_network_and_rate(tiny):
    """A baseline at its own searched width and rate keeps its method's name (the claims
    read cells by method); the other entries keep the task's network."""
    apg = {"methods": ["apg"], "pairs": [[2, 3]], "seeds": [0]}
    mlp = {**apg, "methods": ["rws-mlp"], "network": {"hidden": 16}, "train": {"lr": 0.003}}
    cells = {c.method: c for c in grid_cells(tiny(**{"gmm.grid": [apg, mlp]}), "gmm")}
    assert cells["rws-mlp"].name == "gmm/rws-mlp/K2/L3/seed0" and not cells["rws-mlp"].axes
    assert cells["rws-mlp"].train.network["hidden"] == 16 and cells["rws-mlp"].train.lr == 0.003
    assert cells["apg"].train.network == TINY["gmm"]["network"]
    default = {c.method: c for c in grid_cells(tiny(), "gmm")}["rws-mlp"]
    assert cells["rws-mlp"].cell_id("d") != default.cell_id("d")
    validate_params(tiny(**{"gmm.grid": [apg, mlp]}))
    with pytest.raises(ParamsError, match=r"gmm.grid\[1\].network: must be dict"):
        validate_params(tiny(**{"gmm.grid": [apg, {**mlp, "network": 16}]}))
    with pytest.raises(ParamsError, match=r"gmm.grid \(gmm/rws-mlp/K2/L3/seed0\): .*widht"):
        validate_params(tiny(**{"gmm.grid": [apg, {**mlp, "network": {"widht": 16}}]}))


@pytest.mark.parametrize(
    "axes, expected",
    [
        ({"netwrk.hidden": [8]}, "gmm.grid[0].axes.netwrk.hidden: axes are <section>.<key>"),
        ({"train.lr_final": [0.1]}, "gmm.grid[0].axes.train.lr_final: unknown training key; did you mean"),
        ({"train.lr": []}, "gmm.grid[0].axes.train.lr: must be a non-empty list"),
        ({"train.lr": ["fast"]}, "gmm.grid[0].axes.train.lr[0]: wrong type for train.lr"),
        ({"train.lr": [-0.1]}, "gmm.grid[0].axes.train.lr: lr must be a positive number"),
        ({"network.hiden": [8]}, "gmm.grid (gmm/apg/K2/L3/seed0/network.hiden=8): "),
        ({"model.nu_0": [0.3]}, "gmm.grid (gmm/apg/K2/L3/seed0/model.nu_0=0.3): "),
    ],
)
def test_bad_axes_name_the_key(axes, expected, tiny):
    with pytest.raises(ParamsError) as info:
        validate_params(tiny(**{"gmm.grid.0.axes": axes}))
    assert "\n" not in str(info.value) and str(info.value).startswith(expected), str(info.value)


def test_trials_start_longest_first(tiny):
    # The rings' hmc-rws cell (a leapfrog per transition) once ran alone for 22 minutes at the
    # end of the sweep; ordered by estimated cost it starts first, gibbs (nothing to train) last.
    from pipeline.sweep import estimated_cost

    grid = [{"methods": ["rws-mlp", "gibbs", "apg", "hmc-rws"], "pairs": [[2, 3]]}]
    cells = grid_cells(tiny(**{"gmm.grid": grid}), "gmm")
    order = [c.method for c in sorted(cells, key=lambda c: -estimated_cost(c))]
    assert order[0] == "hmc-rws" and order.index("apg") < order.index("rws-mlp")
    iterations = tiny(**{"gmm.train.iterations": 12, "gmm.grid": grid})
    assert estimated_cost(grid_cells(iterations, "gmm")[0]) == 2 * estimated_cost(cells[0])


def test_the_evaluation_runs_on_its_own_thread_count(tmp_path, monkeypatch, tiny):
    # The evaluate stage runs alone after the sweep, so it may use every core; without the key
    # it keeps a trial's count. A count below one is refused by name.
    import torch

    from pipeline import evaluate

    with pytest.raises(ParamsError, match=r"^gmm.evaluate.threads: too small \(0\)$"):
        validate_params(tiny(**{"gmm.evaluate.threads": 0}))
    seen = []
    monkeypatch.setattr(
        evaluate, "evaluate_task", lambda *a: seen.append(torch.get_num_threads()) or {"cells": {}}
    )
    monkeypatch.setattr(evaluate, "record_stage_time", lambda *a: None)
    before = torch.get_num_threads()
    try:
        for params, expected in ((tiny(**{"gmm.evaluate.threads": 2}), 2), (tiny(), 1)):
            path = tmp_path / "params.yaml"
            path.write_text(yaml.safe_dump(params))
            evaluate.main(["--task", "gmm", "--params", str(path), "--out", str(tmp_path / "out")])
            assert seen[-1] == expected
        assert seen == [2, 1]
    finally:
        torch.set_num_threads(before)


def test_the_printed_mlflow_address_opens_the_runs_table():
    assert (
        tracking.ui_url("http://host:5000/", "7")
        == "http://host:5000/#/experiments/7?workflowType=machine_learning"
    )
    assert tracking.browse_hint("http://u:secret@host:5000", "7").endswith(
        "http://***@host:5000/#/experiments/7?workflowType=machine_learning"
    )
    local = tracking.browse_hint("sqlite:////tmp/x/mlflow.db", "1")
    assert (
        "mlflow ui --backend-store-uri sqlite:////tmp/x/mlflow.db" in local
        and "127.0.0.1:5000/#/experiments/1?" in local
    )


def test_two_experiments_under_one_name_are_an_error(tiny):
    entry = {"methods": ["apg"], "pairs": [[2, 3]], "train": {"iterations": 9}}
    with pytest.raises(ParamsError, match="two entries train gmm/apg/K2/L3/seed0 with different settings"):
        grid_cells(tiny(**{"gmm.grid": [TINY["gmm"]["grid"][0], entry]}), "gmm")


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"gmm.trian": {}}, "gmm.trian: unknown key; did you mean 'train'?"),
        ({"sweep.cpus_per_trail": 1}, "sweep.cpus_per_trail: unknown key; did you mean 'cpus_per_trial'?"),
        ({"gmm.grid.0.methods": ["apg", "vae"]}, "gmm.grid[0].methods[1]: unknown method 'vae'"),
        ({"tasks": ["gmm", "nope"]}, "tasks[1]: unknown task 'nope'"),
        ({"gmm.grid.0.pairs": [[0, 3]]}, "gmm.grid[0].pairs[0]: K must be >= 1"),
        ({"gmm.grid.0.pairs": [[2, 1]]}, "gmm.grid[0].pairs[0]: L must be >= 2"),
        ({"gmm.evaluate.pairs": [[2, 1]]}, "gmm.evaluate.pairs[0]: L must be >= 2"),
        (
            {"gmm.grid.0.budget": {"total": 4, "sweeps": [5]}},
            "gmm.grid[0].budget.total: budget 4 is smaller than K=5",
        ),
        (
            {"gmm.evaluate.budget": {"total": 4, "sweeps": [5]}},
            "gmm.evaluate.budget.total: budget 4 is smaller than K=5",
        ),
        ({"gmm.train.lr": -0.1}, "gmm.train.lr: lr must be a positive number"),
        ({"gmm.train.iterations": "many"}, "gmm.train.iterations: must be int"),
        ({"gmm.model": {"nu_0": 0.3}}, "gmm.model: "),
        ({"gmm.network": {"hiden": 8}}, "gmm.network: "),
        ({"sweep.gpus_per_trial": -1}, "sweep.gpus_per_trial: must be >= 0"),
        ({"gmm.evaluate.imputation": {"methods": []}}, "gmm.evaluate.imputation.methods: list the methods"),
        (
            {"gmm.evaluate.imputation": {"methods": ["apg"], "fill": "zeros"}},
            "gmm.evaluate.imputation.fill: sample (draw from p(x | z)) or mean",
        ),
        (
            {"gmm.evaluate.imputation": {"methods": ["apg"], "iterations": 3, "burn_in": 3}},
            "gmm.evaluate.imputation.burn_in: must be below iterations",
        ),
        (
            {"gmm.evaluate.imputation": {"methods": ["apg"], "test_set": "nope"}},
            "gmm.evaluate.imputation.test_set: 'nope' is not a test set",
        ),
        (
            {"gmm.evaluate.imputation": {"methods": ["apg"], "occlusions": [{"frames": 0}]}},
            "gmm.evaluate.imputation.occlusions[0]: bad bounds",
        ),
        (
            {
                "gmm.evaluate.imputation": {
                    "methods": ["apg"],
                    "occlusions": [{"rows": [5, 2], "cols": [0, 3]}],
                }
            },
            "gmm.evaluate.imputation.occlusions[0]: bad bounds",
        ),
        (
            {"gmm.evaluate.imputation": {"methods": ["apg"], "mask": 1}},
            "gmm.evaluate.imputation.mask: unknown key",
        ),
        (
            {"gmm.data.train": {"num_datasets": 4, "seed": 0, "sizes": {"num_points": -3}}},
            "gmm.data.train.sizes.num_points: must be positive, got -3",
        ),
        (
            {"gmm.data.test": {"num_datasets": 4, "seed": 0, "sizes": {"num_points": 0}}},
            "gmm.data.test.sizes.num_points: must be positive, got 0",
        ),
    ],
)
def test_bad_params_name_the_key(changes, expected, tiny):
    with pytest.raises(ParamsError) as info:
        validate_params(tiny(**changes))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(expected), message


def test_sweep_stage_fails_before_ray_starts(tmp_path, capsys, tiny):
    import ray

    from pipeline.sweep import main

    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(tiny(**{"gmm.grid.0.pairs": [[2, 1]]})))
    with pytest.raises(SystemExit) as info:
        main(["--task", "gmm", "--params", str(path)])
    assert info.value.code == 2
    assert (
        capsys.readouterr().err.strip() == "apg-pipeline: error: gmm.grid[0].pairs[0]: L must be >= 2, got 1"
    )
    assert not ray.is_initialized()


def test_committed_params_file_is_valid():
    from pipeline.config import load_params

    params = load_params(REPO / "params.yaml")  # the profiles: tests/pipeline/test_config_overlays.py
    assert all(grid_cells(params, task) for task in params["tasks"])


def test_unreachable_services_fail_fast():
    start = time.perf_counter()
    with pytest.raises(tracking.TrackingError, match="http://127.0.0.1:9"):
        tracking.check_reachable("http://127.0.0.1:9")
    with pytest.raises(SweepError, match="127.0.0.1:9"):
        check_ray_address("127.0.0.1:9")
    assert time.perf_counter() - start < 15


# --------------------------------------------------------------------------- slow: real stages


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

    resumed = run([sys.executable, "-m", "pipeline.sweep", "--task", "gmm"], root)
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
        [sys.executable, "-m", "pipeline.sweep", "--task", "gmm"],
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


def test_reused_cells_keep_the_mlflow_run_that_trained_them(tmp_path):
    # A sweep whose grid changed gets a new parent run; its cells trained by the earlier
    # sweep are reused, and the report must still trace them to their training runs.
    from pipeline.evaluate_mlflow import mlflow_run_ids

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


def test_run_ids_of_a_sweep_run_in_a_moved_project(tmp_path, monkeypatch):
    # The sweep ran in a copy of the project whose store is gone (its mlflow.db copied into
    # this one): the lookup must use this project's store, not create an empty one there.
    from pipeline import evaluate_mlflow

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
    from pipeline import sweep

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
    from pipeline import provenance

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
    assert f"; {n} for their numerics fingerprint" in provenance.retraining(tmp_path, params, recorded)
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
    from pipeline import sweep

    return sweep


def test_sweep_progress_counts_cells_and_estimates_the_time_left(capsys):
    from pipeline.sweep import SweepProgress

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


def test_smoke_profile_mirrors_the_defaults():
    # The smoke profile is only worth running if it exercises what params.yaml runs.
    from pipeline.profiles import resolve

    full, smoke = yaml.safe_load((REPO / "params.yaml").read_text()), resolve("smoke")
    assert smoke["tasks"] == full["tasks"]
    assert set(smoke["sweep"]) == set(full["sweep"])
    for task in full["tasks"]:
        assert set(smoke[task]) == set(full[task]), task
        assert set(smoke[task]["train"]) == set(full[task]["train"]), task
        methods = [[sorted(e["methods"]), sorted(e)] for e in full[task]["grid"]]
        assert [[sorted(e["methods"]), sorted(e)] for e in smoke[task]["grid"]] == methods, task
        assert set(smoke[task]["evaluate"]) == set(full[task]["evaluate"]), task


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


@pytest.mark.slow
@needs_mnist
def test_smoke_profile_runs_every_stage_of_every_task_from_scratch(tmp_path):
    box = tmp_path / "smoke"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "smoke", "--dir", str(box)],
        cwd=REPO,
        # relative to where the command is typed, as the README writes it (the stages run in the sandbox)
        env={**env(), "APG_MNIST_DIR": os.path.relpath(MNIST_DIR, REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from pipeline.profiles import resolve

    tasks = resolve("smoke")["tasks"]
    for task in tasks:
        for stage in ("generate", "sweep", "evaluate"):
            assert f"`{stage}@{task}`" in proc.stdout, (stage, task)
        assert f"sweep {task}: " in proc.stdout  # progress lines
    assert "| `report` |" in proc.stdout  # the report stage is in the stage table too
    assert "smoke run of smoke: dvc repro from scratch in" in proc.stdout
    report = (box / "reports" / "README.md").read_text()
    assert "Claims of the paper" in report
    from pipeline import provenance

    assert provenance.check(box)[0]  # the record matches the sandbox's code and params
