"""Synthetic evaluation results shaped like ``results/eval/<task>/`` (pipeline.evaluate.stage's
columns), for the report tests: one cell's rows, a method's seeds, a whole task's results."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from pipeline.evaluate.stage import COLUMNS


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
