"""Evaluate then report on tiny trained-for-nothing cells, without Ray: budget cells, cluster
recovery, and each cell's held-out numbers logged to its MLflow run.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from pipeline import report

# --------------------------------------------------------------------------- evaluate -> report, no Ray


def fake_sweep(root, params) -> None:
    """``results/gmm/sweep.json`` and its cells as the sweep stage writes them, trained for
    a few steps here instead of by Ray (grid_cells gives the same cells the sweep would)."""
    from apg.checkpoint import save_checkpoint
    from apg.data import load_dataset
    from apg.training import Trainer
    from pipeline.common import file_digest
    from pipeline.config.params import grid_cells

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
    from pipeline.evaluate.stage import evaluate_task
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


@pytest.mark.slow
def test_the_evaluation_logs_each_cells_held_out_numbers_to_its_mlflow_run(tmp_path):
    from pipeline import tracking
    from pipeline.evaluate.logged import log_evaluation

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
