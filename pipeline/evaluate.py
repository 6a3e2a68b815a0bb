"""Stage ``evaluate``: every trained cell of a task's sweep on held-out datasets.

``python -m pipeline.evaluate --task gmm`` reads ``results/<task>/sweep.json`` and writes
``results/eval/<task>/``:

- ``metrics.parquet`` (and ``metrics.csv``): tidy long format, one row per
  ``task, method, K, L, seed, train_K, train_L, cell_id, test_set, test_sizes, dataset,
  sweep, metric, value``. ``K, L`` are the test-time budget, ``train_K, train_L`` the
  cell's training budget, ``test_set`` the held-out set's name (``test`` for
  ``data.test``, else its ``data.tests`` name; every cell runs on every set, with the
  set's ``network`` overrides), ``test_sizes`` its simulator sizes as JSON,
  ``dataset`` the index of the held-out dataset in its set, ``sweep`` 1..K for curves; metrics of
  the final particles only (``kl_<block>``) have ``sweep = K``. Every cell is evaluated at
  each test-time pair of ``<task>.evaluate.pairs`` (Table 1, convergence curves) and of
  ``<task>.evaluate.budget`` (Figure 2: ``L = total // K``, section 5.4).
- ``training.parquet``: the training curves recorded by the sweep (iteration, metric, value).
- ``samples.npz``: the highest-weight particle after selected sweeps on the figure sets,
  for Figure-1-style pictures; ``samples.json`` indexes it.
- ``meta.json``: the scale everything was made at (iterations, dataset counts, seeds),
  which the report prints under every figure.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from apg.checkpoint import CheckpointError
from apg.data import atomic_write
from apg.tasks import get_task
from apg.training import evaluate as evaluate_cell
from apg.training import make_method
from pipeline.common import (
    file_digest,
    load_task_data,
    load_trained,
    project_root,
    seed_everything,
    with_network,
)
from pipeline.config import evaluation_pairs, evaluation_sets, load_params
from pipeline.provenance import record_stage_time

COLUMNS = [
    "task",
    "method",
    "K",
    "L",
    "seed",
    "train_K",
    "train_L",
    "cell_id",
    "test_set",
    "test_sizes",
    "dataset",
    "sweep",
    "metric",
    "value",
]
# Save a figure particle's reconstruction when one dataset has at most this many numbers:
# the rings' points, and Bouncing MNIST figure videos up to ~27 frames of 96x96 (Figure 3's
# reconstruction row); longer videos are reconstructed by the report from the model.
RECON_MAX_ELEMENTS = 250_000


def tidy(metrics: dict[str, np.ndarray], ids: dict[str, Any]) -> pd.DataFrame:
    """Curves ``(K, M)`` and finals ``(M,)`` -> long rows with the ``ids`` columns."""
    frames = []
    for metric, value in metrics.items():
        curve = value if value.ndim == 2 else value[None, :]
        num_sweeps, num_datasets = curve.shape
        # Finals belong to the last sweep of the run (the particles they were computed on).
        first = 1 if value.ndim == 2 else ids["K"]
        sweeps = np.repeat(np.arange(first, first + num_sweeps), num_datasets)
        frames.append(
            pd.DataFrame(
                {
                    "dataset": np.tile(np.arange(num_datasets), num_sweeps),
                    "sweep": sweeps,
                    "metric": metric,
                    "value": curve.reshape(-1).astype(np.float64),
                }
            )
        )
    frame = pd.concat(frames, ignore_index=True)
    for key, val in ids.items():
        frame[key] = val
    return frame[COLUMNS]


def best_particles(
    cfg, model, proposals, x: torch.Tensor, sweeps: list[int], particles: int
) -> dict[int, dict[str, np.ndarray]]:
    """``{sweep: {latent: (M, ...)}}``: each dataset's highest-weight particle after each sweep.

    RWS methods run one step whatever K is, so they only have sweep 1. When the task can
    reconstruct and a dataset is small (at most ``RECON_MAX_ELEMENTS`` numbers: the
    rings' points, short videos), the particle's reconstruction is saved as ``recon``
    (``(M, ...)``, like ``x``) for the pictures; larger data are reconstructed by the
    report from the model instead (``animate``), so samples.npz stays small.
    """
    reconstruct = get_task(cfg.task).reconstruct
    keep_recon = reconstruct is not None and x[0].numel() <= RECON_MAX_ELEMENTS
    out: dict[int, dict[str, np.ndarray]] = {}

    def collect(k: int, z: dict[str, torch.Tensor], log_w: torch.Tensor) -> None:
        if k in sweeps:
            best = log_w.argmax(0)  # (B,)
            rows = torch.arange(log_w.shape[1])
            chosen = {name: t[best, rows] for name, t in z.items()}
            out[k] = {name: t.cpu().numpy() for name, t in chosen.items()}
            if keep_recon:
                recon = reconstruct(model, x, {name: t[None] for name, t in chosen.items()})[0]
                out[k]["recon"] = recon.cpu().numpy()

    with torch.no_grad():
        make_method(cfg).run(
            model, proposals, x, max(sweeps), particles, "block", cfg.resampler, collectors=[collect]
        )
    return out


def evaluate_task(params: dict[str, Any], task: str, root: Path, out_dir: Path) -> dict[str, Any]:
    summary_path = root / "results" / task / "sweep.json"
    if not summary_path.is_file():
        raise ValueError(f"sweep summary {summary_path} not found; run the sweep stage first")
    summary = json.loads(summary_path.read_text())
    section = params[task]
    ev = section.get("evaluate", {})
    plan = evaluation_pairs(params, task)
    model_hparams = section.get("model", {})
    data_dir = root / "data" / task
    # Every held-out set (Table 1 and curves: each with its own sizes and network overrides)
    # and every figure set is read once, before the cells.
    sets = evaluation_sets(section)
    for entry in sets:
        entry["x"] = load_task_data(task, data_dir / f"{entry['stem']}.npz", model_hparams)
    test_sets = [e for e in sets if e["kind"] == "test"]
    figure_sets = [e for e in sets if e["kind"] == "figure"]
    figure_sweeps = ev.get("figure_sweeps", [1])
    frames, histories, samples, index = [], [], {}, []
    unique_pairs = sorted({tuple(p) for pairs in plan.values() for p in pairs})
    started = time.monotonic()
    for done, cell in enumerate(summary["cells"]):
        if done:
            left = (time.monotonic() - started) / done * (len(summary["cells"]) - done)
            print(
                f"evaluate {task}: {done}/{len(summary['cells'])} cells done, ~{left / 60:.1f} min left",
                flush=True,
            )
        ckpt = root / cell["checkpoint"]
        if file_digest(ckpt) != cell["checkpoint_sha256"]:
            raise CheckpointError(f"checkpoint {ckpt} changed since the sweep recorded it; re-run the sweep")
        cfg, model, proposals = load_trained(ckpt)
        ids = {
            "task": task,
            "method": cell["method"],
            "seed": cell["seed"],
            "train_K": cell["K"],
            "train_L": cell["L"],
            "cell_id": cell["cell_id"],
        }
        for entry in test_sets:
            set_cfg, set_proposals = with_network(cfg, model, proposals, entry.get("network"))
            set_ids = {
                **ids,
                "test_set": entry["name"],
                "test_sizes": json.dumps(entry.get("sizes", {}), sort_keys=True),
            }
            for k, l in unique_pairs:
                # Same seed for every cell at a pair: methods see the same randomness budget.
                seed_everything(ev.get("seed", 0) + 1000 * cell["seed"])
                metrics = evaluate_cell(
                    set_cfg,
                    model,
                    set_proposals,
                    entry["x"],
                    k,
                    l,
                    ev.get("batch_size", 20),
                    ev.get("resample_mode", "block"),
                )
                frames.append(tidy(metrics, {**set_ids, "K": k, "L": l}))
        # A cell with nothing to learn (exact Gibbs, 0 iterations) has an empty history.
        history_file = root / cell["history"]
        hist = pd.read_csv(history_file) if history_file.stat().st_size else pd.DataFrame({"iteration": []})
        histories.append(
            hist.melt(id_vars="iteration", var_name="metric", value_name="value").assign(
                task=task,
                method=cell["method"],
                K=cell["K"],
                L=cell["L"],
                seed=cell["seed"],
                cell_id=cell["cell_id"],
            )
        )
        for i, entry in enumerate(figure_sets):
            stem, x = entry["stem"], entry["x"]
            samples[f"x__{stem}"] = x.numpy()
            set_cfg, set_proposals = with_network(cfg, model, proposals, entry.get("network"))
            seed_everything(ev.get("seed", 0) + i)
            best = best_particles(
                set_cfg, model, set_proposals, x, figure_sweeps, ev.get("figure_particles", 10)
            )
            for sweep, z in best.items():
                for name, arr in z.items():
                    key = f"{cell['cell_id']}__{stem}__sweep{sweep}__{name}"
                    samples[key] = arr
            index.append(
                {
                    "cell_id": cell["cell_id"],
                    "method": cell["method"],
                    "seed": cell["seed"],
                    "figure_set": stem,
                    "sweeps": sorted(best),
                }
            )
    metrics_frame = pd.concat(frames, ignore_index=True)
    run_ids = mlflow_run_ids(summary)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "metrics.parquet", lambda tmp: metrics_frame.to_parquet(tmp, index=False))
    atomic_write(out_dir / "metrics.csv", lambda tmp: metrics_frame.to_csv(tmp, index=False))
    training = pd.concat(histories, ignore_index=True)
    atomic_write(out_dir / "training.parquet", lambda tmp: training.to_parquet(tmp, index=False))
    atomic_write(out_dir / "samples.npz", lambda tmp: _savez(tmp, samples))
    first = test_sets[0]
    meta = {
        "task": task,
        "iterations": sorted({c["iterations"] for c in summary["cells"]}),
        "train_datasets": section["data"]["train"]["num_datasets"],
        "train_sizes": section["data"]["train"].get("sizes", {}),
        # The first test set: Table 1, the method table and the sweep / budget figures.
        "test_datasets": int(first["x"].shape[0]),
        "test_sizes": first.get("sizes", {}),
        "test_sets": [
            {
                "name": e["name"],
                "file": f"{e['stem']}.npz",
                "num_datasets": int(e["x"].shape[0]),
                "shape": list(e["x"].shape),
                "sizes": e.get("sizes", {}),
                "network": e.get("network", {}),
            }
            for e in test_sets
        ],
        "batch_size": section["train"].get("batch_size"),
        "lr": section["train"].get("lr"),
        "seeds": sorted({c["seed"] for c in summary["cells"]}),
        "cells": [
            {
                **{
                    k: c[k]
                    for k in (
                        "cell_id",
                        "name",
                        "method",
                        "K",
                        "L",
                        "seed",
                        "iterations",
                        "mean_it_per_s",
                        "checkpoint",
                    )
                },
                "mlflow_run_id": run_ids.get(c["cell_id"]),
            }
            for c in summary["cells"]
        ],
        "pairs": [list(p) for p in plan.get("pairs", [])],
        "budget": {"total": ev["budget"]["total"], "pairs": [list(p) for p in plan["budget"]]}
        if "budget" in plan
        else None,
        "baseline": ev.get("baseline"),
        "figure_sets": [
            {
                "name": e["stem"],
                "shape": list(e["x"].shape),
                "sizes": e.get("sizes", {}),
                "network": e.get("network", {}),
            }
            for e in figure_sets
        ],
        "samples": index,
    }
    text = json.dumps(meta, indent=2)
    atomic_write(out_dir / "meta.json", lambda tmp: tmp.write_text(text + "\n"))
    return meta


def mlflow_run_ids(summary: dict[str, Any]) -> dict[str, str]:
    """``{cell_id: MLflow child run id}`` for the sweep's cells, so that every reported
    number can be traced to its run; empty when the tracking store cannot be read (the
    cell id is also a tag, ``apg.cell_id``, on the child run)."""
    info = summary.get("mlflow") or {}
    if not info.get("parent_run_id"):
        return {}
    try:
        from pipeline import tracking

        client = tracking.client(info["tracking_uri"])
        out = {}
        for cell in summary["cells"]:
            run = tracking.find_run(
                client,
                info["experiment_id"],
                {tracking.TAG_PARENT: info["parent_run_id"], tracking.TAG_CELL: cell["cell_id"]},
            )
            if run is None:
                # A cell this sweep reused (trained by an earlier sweep, same cell id: the
                # same training config) keeps the run that trained it.
                run = tracking.find_run(client, info["experiment_id"], {tracking.TAG_CELL: cell["cell_id"]})
            if run is not None:
                out[cell["cell_id"]] = run.info.run_id
        return out
    except Exception as err:  # noqa: BLE001 - traceability is best effort; evaluation must not fail on it
        print(
            f"note: MLflow run ids not recorded ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        )
        return {}


def _savez(tmp: Path, arrays: dict[str, np.ndarray]) -> None:
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="evaluate every trained cell of a task's sweep")
    parser.add_argument("--task", required=True)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default=None, help="output directory (default results/eval/<task>)")
    args = parser.parse_args(argv)
    from pipeline.cli import run_guarded

    def work() -> None:
        params = load_params(args.params)
        root = project_root()
        torch.set_num_threads(params["sweep"].get("torch_threads", 1))
        out = Path(args.out or root / "results" / "eval" / args.task)
        start = time.monotonic()
        meta = evaluate_task(params, args.task, root, out)
        record_stage_time(root, "evaluate", args.task, time.monotonic() - start)
        print(f"wrote {out} ({len(meta['cells'])} cells)")

    run_guarded(work)


if __name__ == "__main__":
    main()
