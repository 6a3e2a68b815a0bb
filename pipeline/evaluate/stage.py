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
  the final particles only (``kl_<block>``) have ``sweep = K``. ``ess`` is the ESS/L of the
  weights since the last resampling under ``evaluate.resample_mode`` (``block``: the last
  block's); with ``evaluate.sweep_resampling`` every cell also runs resampling once per sweep
  and ``sweep_ess`` is that run's ESS/L of each whole sweep (the paper's overall ESS, Table 1). Every cell is evaluated at
  each test-time pair of ``<task>.evaluate.pairs`` (Table 1, convergence curves) and of
  ``<task>.evaluate.budget`` (Figure 2: ``L = total // K``, section 5.4). A cell that only
  a ``budget`` grid entry trains (Figure 2 retrained per budget) is evaluated at its own
  training pair only: that is the one point of the figure it stands for.
  Held-out sets that carry the true assignments ``c`` (GMM, rings) add the final metric
  ``ari``: the adjusted Rand index of the highest-weight particle's ``c`` against the
  true ``c`` (NaN for a method whose particles have no ``c``); tasks with a known
  Bayes-optimal assignment rule (the GMM: ``argmax_i p(c_n = i | x_n, mu, tau)`` at the
  true parameters) add ``ari_ceiling``, the ARI of that rule, the same for every cell.
  The same particle's centres give ``centre_err``, the mean distance to the true centres
  under the best matching (decoder-free), and for the rings ``log_joint_true``: its
  ``log p(x, mu, c)`` under the simulator's true model, angles integrated out, one model
  for every method (each cell learns its own ring shape, so ``log_joint`` scores each
  method under a different model).
  Held-out videos that carry the simulator's digit positions (Bouncing MNIST) add the
  curves ``pos_err`` (pixels between inferred and true digits, at the centres of their ink,
  after the best matching of digits), ``box_err`` (the same for the boxes' corners),
  ``pos_err_aligned`` (the motion error), ``tracked`` (fraction of frames with every
  digit within 3 px), ``pos_err_frame`` and ``tracked_frame`` (the same with each frame's
  digits matched alone) and ``swapped`` (frames whose boxes traded digits) of the
  highest-weight particle after each sweep
  (``apg.tasks.bmnist.position_errors``); their
  figure sets add ``truth__<set>__z_where`` to ``samples.npz`` for the pictures' true paths.
- ``training.parquet``: the training curves recorded by the sweep (iteration, metric, value).
- ``samples.npz``: the highest-weight particle after selected sweeps on the figure sets,
  for Figure-1-style pictures; ``samples.json`` indexes it.
- ``imputation.parquet`` and ``imputation_examples.npz`` (tasks with
  ``evaluate.imputation``): the errors of the imputations of hidden entries by the cells of
  the listed methods, and one imputed dataset per method and setting (``pipeline.evaluate.impute``).
- ``meta.json``: the scale everything was made at (iterations, dataset counts, seeds),
  which the report prints under every figure, and each cell's ``roles``: ``main`` (a
  ``pairs`` grid entry trains it: Table 1, the method tables, the claims) and/or
  ``budget`` (a ``budget`` grid entry trains it: Figure 2 retrained per budget).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from apg.checkpoint import CheckpointError
from apg.data import atomic_write, load_dataset
from apg.loading import check_task_data, load_trained, with_network
from apg.particles import best_particles, final_particle, latent_truth, particle_scores, tracking_errors
from apg.tasks import get_task
from apg.training import evaluate as evaluate_cell
from pipeline.common import file_digest, project_root, seed_everything
from pipeline.config import checks
from pipeline.config.params import (
    axis_keys,
    evaluation_pairs,
    evaluation_sets,
    grid_cells,
    load_params,
    setting_of,
)
from pipeline.evaluate.impute import check_settings as check_imputation
from pipeline.evaluate.impute import imputation_frame
from pipeline.evaluate.logged import log_evaluation, mlflow_run_ids
from pipeline.provenance.stages import record_stage_time

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


# --------------------------------------------------------------------------- which cells are what


def cell_roles(params: dict[str, Any], task: str) -> dict[str, list[str]]:
    """``{cell name: roles}``: ``main`` for cells a grid entry's ``pairs`` trains, ``budget``
    for cells its ``budget`` trains (a cell can be both: the budget's K=5 cell may be the
    main K=5 cell). Each half of each entry is expanded by ``grid_cells`` itself, so the
    names are exactly the sweep's."""
    section = params[task]
    roles: dict[str, set[str]] = {}
    for entry in section.get("grid", []):
        for role, key, other in (("main", "pairs", "budget"), ("budget", "budget", "pairs")):
            if key not in entry:
                continue
            half = {k: v for k, v in entry.items() if k != other}
            for cell in grid_cells({**params, task: {**section, "grid": [half]}}, task):
                roles.setdefault(cell.name, set()).add(role)
    return {name: sorted(r) for name, r in roles.items()}


def cell_pairs(roles: list[str], cell: dict[str, Any], pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Test-time pairs a cell is evaluated at: every pair, except that a cell trained only
    for Figure 2's retrained curve stands for one point, its own training pair (and
    evaluating it elsewhere would cost as much as the main cells' evaluation)."""
    if roles == ["budget"]:
        return [(cell["K"], cell["L"])]
    return pairs


@dataclass
class Collected:
    """What the cells' evaluation gathers, in cell order, for the stage's files."""

    frames: list[pd.DataFrame] = field(default_factory=list)  # metrics.parquet
    histories: list[pd.DataFrame] = field(default_factory=list)  # training.parquet
    samples: dict[str, np.ndarray] = field(default_factory=dict)  # samples.npz
    index: list[dict[str, Any]] = field(default_factory=list)  # meta.json "samples"
    imputations: list[pd.DataFrame] = field(default_factory=list)  # imputation.parquet
    impute_examples: dict[str, np.ndarray] = field(default_factory=dict)  # imputation_examples.npz
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # every cell's value of every swept key


def load_summary(root: Path, task: str) -> dict[str, Any]:
    """``results/<task>/sweep.json``: the sweep's cells."""
    summary_path = root / "results" / task / "sweep.json"
    if not summary_path.is_file():
        raise ValueError(f"sweep summary {summary_path} not found; run the sweep stage first")
    return checks.read_json(summary_path)


def load_sets(task: str, section: dict[str, Any], data_dir: Path) -> list[dict[str, Any]]:
    """Every held-out set (Table 1 and curves: each with its own sizes and network overrides)
    and every figure set, with its data ``x``, its tracking ``truth`` and, for test sets, its
    true ``latents``: read once, before the cells."""
    model_hparams = section.get("model", {})
    tracking = get_task(task).tracking
    sets = evaluation_sets(section)
    for entry in sets:
        path = data_dir / f"{entry['stem']}.npz"
        arrays = load_dataset(path)
        entry["x"] = torch.from_numpy(arrays["x"]).to(torch.get_default_dtype())
        check_task_data(task, entry["x"], path, model_hparams)
        entry["truth"] = None
        if tracking is not None:
            try:
                entry["truth"] = tracking.truth(arrays)
            except ValueError as err:
                raise ValueError(f"{path} {err}; run `dvc repro generate@{task}`") from None
        if entry["kind"] == "test":
            entry["latents"] = latent_truth(task, arrays)
    return sets


def imputation_set(
    task: str, section: dict[str, Any], imputing: dict[str, Any], test_sets: list[dict[str, Any]]
) -> dict[str, Any]:
    """The test set ``evaluate.imputation`` hides entries of (default: the first), checked."""
    impute_set = next(
        (e for e in test_sets if e["name"] == imputing.get("test_set", test_sets[0]["name"])), None
    )
    if impute_set is None:
        raise ValueError(f"{task}.evaluate.imputation.test_set {imputing['test_set']!r} is not a test set")
    check_imputation(task, imputing, section, impute_set)
    return impute_set


def load_cell(root: Path, cell: dict[str, Any], device: torch.device | str):
    """``(cfg, model, proposals)`` of a cell's checkpoint, the one the sweep recorded."""
    ckpt = root / cell["checkpoint"]
    if file_digest(ckpt) != cell["checkpoint_sha256"]:
        raise CheckpointError(f"checkpoint {ckpt} changed since the sweep recorded it; re-run the sweep")
    return load_trained(ckpt, device)


def held_out_frames(
    task: str,
    trained: tuple,
    entry: dict[str, Any],
    pairs: list[tuple[int, int]],
    ids: dict[str, Any],
    ev: dict[str, Any],
    model_hparams: dict[str, Any],
    device: torch.device | str,
) -> list[pd.DataFrame]:
    """One cell on one held-out set (with the set's ``network`` overrides) at each test-time
    pair: the sampler's metrics, the final particle's scores and tracking errors where the set
    holds the truth, and the per-sweep-resampling ESS (``sweep_ess_run``)."""
    cfg, model, proposals = trained
    set_cfg, set_proposals = with_network(cfg, model, proposals, entry.get("network"), device)
    set_ids = {
        **ids,
        "test_set": entry["name"],
        "test_sizes": json.dumps(entry.get("sizes", {}), sort_keys=True),
    }
    frames = []
    for k, l in pairs:
        # Same seed for every cell at a pair: methods see the same randomness budget.
        seed = ev.get("seed", 0) + 1000 * ids["seed"]
        seed_everything(seed)
        run_args = (ev.get("batch_size", 20), ev.get("resample_mode", "block"))
        metrics = evaluate_cell(set_cfg, model, set_proposals, entry["x"], k, l, *run_args)
        if entry["latents"] is not None:
            particle = final_particle(set_cfg, model, set_proposals, entry["x"], k, l, *run_args)
            metrics.update(
                particle_scores(task, entry["latents"], particle, model_hparams, entry.get("sizes", {}))
            )
        if entry["truth"] is not None:
            metrics.update(
                tracking_errors(set_cfg, model, set_proposals, entry["x"], entry["truth"], k, l, *run_args)
            )
        if ev.get("sweep_resampling") and run_args[1] != "sweep":
            metrics["sweep_ess"] = sweep_ess_run(
                set_cfg, model, set_proposals, entry["x"], k, l, run_args[0], seed
            )
        frames.append(tidy(metrics, {**set_ids, "K": k, "L": l}))
    return frames


def sweep_ess_run(
    cfg, model, proposals, x: torch.Tensor, k: int, l: int, batch_size: int, seed: int
) -> np.ndarray:
    """The paper's overall ESS (Table 1): the same sampler resampling once per sweep only,
    ``(K, M)``. Run last, and from the pair's seed, so the runs before it draw as without it."""
    seed_everything(seed)
    return evaluate_cell(cfg, model, proposals, x, k, l, batch_size, "sweep")["ess"]


def cell_history(root: Path, task: str, cell: dict[str, Any]) -> pd.DataFrame:
    """The cell's training curves recorded by the sweep, in long format."""
    # A cell with nothing to learn (exact Gibbs, 0 iterations) has an empty history.
    history_file = root / cell["history"]
    hist = checks.read_csv(history_file) if history_file.stat().st_size else pd.DataFrame({"iteration": []})
    if "iteration" not in hist.columns:
        raise ValueError(f"{history_file} is not a training history (no 'iteration' column)")
    return hist.melt(id_vars="iteration", var_name="metric", value_name="value").assign(
        task=task,
        method=cell["method"],
        K=cell["K"],
        L=cell["L"],
        seed=cell["seed"],
        cell_id=cell["cell_id"],
    )


def figure_samples(
    task: str,
    trained: tuple,
    cell: dict[str, Any],
    figure_sets: list[dict[str, Any]],
    ev: dict[str, Any],
    device: torch.device | str,
    out: Collected,
) -> None:
    """The cell's highest-weight particles after ``evaluate.figure_sweeps`` on each figure
    set, into ``out.samples`` (with the sets' data and true paths) and ``out.index``."""
    cfg, model, proposals = trained
    for i, entry in enumerate(figure_sets):
        stem, x = entry["stem"], entry["x"]
        out.samples[f"x__{stem}"] = x.numpy()
        if entry["truth"] is not None:
            for name in get_task(task).tracking.pictured:
                out.samples[f"truth__{stem}__{name}"] = entry["truth"][name]
        set_cfg, set_proposals = with_network(cfg, model, proposals, entry.get("network"), device)
        seed_everything(ev.get("seed", 0) + i)
        best = best_particles(
            set_cfg, model, set_proposals, x, ev.get("figure_sweeps", [1]), ev.get("figure_particles", 10)
        )
        for sweep, z in best.items():
            for name, arr in z.items():
                out.samples[f"{cell['cell_id']}__{stem}__sweep{sweep}__{name}"] = arr
        out.index.append(
            {
                "cell_id": cell["cell_id"],
                "method": cell["method"],
                "seed": cell["seed"],
                "figure_set": stem,
                "sweeps": sorted(best),
            }
        )


def training_ids(cell: dict[str, Any]) -> dict[str, Any]:
    """The columns naming a cell in the long tables: its method, seed, training budget, id."""
    return {
        "method": cell["method"],
        "seed": cell["seed"],
        "train_K": cell["K"],
        "train_L": cell["L"],
        "cell_id": cell["cell_id"],
    }


def _progress(task: str, done: int, total: int, started: float) -> None:
    left = (time.monotonic() - started) / done * (total - done)
    print(f"evaluate {task}: {done}/{total} cells done, ~{left / 60:.1f} min left", flush=True)


def evaluate_task(
    params: dict[str, Any], task: str, root: Path, out_dir: Path, device: torch.device | str = "cpu"
) -> dict[str, Any]:
    """Evaluate every cell of ``results/<task>/sweep.json`` on ``device`` (the networks run
    there; the held-out data stay on the host and go there a batch at a time)."""
    summary = load_summary(root, task)
    section = params[task]
    ev = section.get("evaluate", {})
    plan = evaluation_pairs(params, task)
    data_dir = root / "data" / task
    sets = load_sets(task, section, data_dir)
    test_sets = [e for e in sets if e["kind"] == "test"]
    figure_sets = [e for e in sets if e["kind"] == "figure"]
    imputing = ev.get("imputation")  # issue 22: the cells' imputations of hidden entries
    impute_set = imputation_set(task, section, imputing, test_sets) if imputing else None
    impute_arrays = load_dataset(data_dir / f"{impute_set['stem']}.npz") if impute_set else None
    unique_pairs = sorted({tuple(p) for pairs in plan.values() for p in pairs})
    roles = cell_roles(params, task)
    swept = axis_keys(params, task)
    out = Collected()
    started = time.monotonic()
    for done, cell in enumerate(summary["cells"]):
        if done:
            _progress(task, done, len(summary["cells"]), started)
        trained = load_cell(root, cell, device)
        out.settings[cell["cell_id"]] = {key: setting_of(trained[0].to_dict(), key) for key in swept}
        # Cells of an earlier grid still in the summary have no entry now: treat as main.
        cell_role = roles.get(cell["name"], ["main"])
        ids = {"task": task, **training_ids(cell)}
        for entry in test_sets:
            pairs = cell_pairs(cell_role, cell, unique_pairs)
            out.frames.extend(
                held_out_frames(task, trained, entry, pairs, ids, ev, section.get("model", {}), device)
            )
        # Figure 2's retrained cells stand for one number each, and cells of a swept axis
        # for one point of its figure; the imputations and pictures show the task's own main cells.
        own_main = "main" in cell_role and not cell.get("axes")
        if imputing and own_main and cell["method"] in imputing["methods"]:
            impute_cell(
                task, trained, cell, imputing, impute_set, impute_arrays, unique_pairs, ev, device, out
            )
        out.histories.append(cell_history(root, task, cell))
        if own_main:
            figure_samples(task, trained, cell, figure_sets, ev, device, out)
    frames = animation_frames(task, root, out.samples, out.index, summary["cells"])
    metrics_frame = pd.concat(out.frames, ignore_index=True)
    run_ids = mlflow_run_ids(summary)
    logged = log_evaluation(summary, run_ids, metrics_frame)
    if logged:
        print(
            f"evaluate {task}: held-out numbers logged to {logged} MLflow runs (metrics eval.<set>.K<K>L<L>.<metric>)"
        )
    write_outputs(out_dir, metrics_frame, out)
    if frames is not None:
        atomic_write(out_dir / ANIMATION, lambda tmp: _savez(tmp, {"frames": frames}, compressed=True))
    else:  # no pictured cell, or a task without frames: no leftover of an earlier run
        (out_dir / ANIMATION).unlink(missing_ok=True)
    meta = {
        **scale_meta(task, section, summary, test_sets),
        "cells": [cell_meta(c, run_ids, roles, out.settings) for c in summary["cells"]],
        "axes": swept,
        "pairs": [list(p) for p in plan.get("pairs", [])],
        "budget": {"total": ev["budget"]["total"], "pairs": [list(p) for p in plan["budget"]]}
        if "budget" in plan
        else None,
        "baseline": ev.get("baseline"),
        "imputation": {**imputing, "test_set": impute_set["name"]} if imputing else None,
        "figure_sets": [figure_set_meta(e) for e in figure_sets],
        "samples": out.index,
    }
    text = json.dumps(meta, indent=2)
    atomic_write(out_dir / "meta.json", lambda tmp: tmp.write_text(text + "\n"))
    return meta


ANIMATION = "animation.npz"  # the GIF's frames: the pictured cell's generative model on its sample


def animation_frames(
    task: str,
    root: Path,
    samples: dict[str, np.ndarray],
    index: list[dict[str, Any]],
    cells: list[dict[str, Any]],
) -> np.ndarray | None:
    """The frames of the report's GIF (tasks with an ``animate`` hook): the last APG sweep's
    sample on the first figure set, drawn by the generative model of the cell pictured with
    the most sweeps (the lowest seed among those), so that the report loads no model.
    ``samples``/``index``: what ``figure_samples`` collected; ``cells``: the sweep's cells."""
    spec = get_task(task)
    if spec.animate is None or not index:
        return None
    from apg.checkpoint import load_checkpoint
    from apg.training import TrainConfig

    entry = max(index, key=lambda e: (len(e["sweeps"]), -e["seed"]))
    cell = next(c for c in cells if c["cell_id"] == entry["cell_id"])
    # The generative model alone draws the frames (a recorded run may keep no proposals).
    config, state = load_checkpoint(root / cell["checkpoint"])
    model = spec.build_model(**TrainConfig.from_dict(config).model)
    model.load_state_dict(state["model"])
    model.eval()
    sweep = max(entry["sweeps"])
    prefix = f"{entry['cell_id']}__{entry['figure_set']}__sweep{sweep}__"
    z = {k[len(prefix) :]: torch.from_numpy(v[0]) for k, v in samples.items() if k.startswith(prefix)}
    x = torch.from_numpy(samples[f"x__{entry['figure_set']}"][0]).to(torch.get_default_dtype())
    if f"truth__{entry['figure_set']}__z_where" in samples:
        z["true_where"] = torch.from_numpy(samples[f"truth__{entry['figure_set']}__z_where"][0])
    return np.asarray(spec.animate(model, x, z))


def impute_cell(
    task: str,
    trained: tuple,
    cell: dict[str, Any],
    imputing: dict[str, Any],
    impute_set: dict[str, Any],
    impute_arrays: dict[str, np.ndarray],
    unique_pairs: list[tuple[int, int]],
    ev: dict[str, Any],
    device: torch.device | str,
    out: Collected,
) -> None:
    """The cell's imputations of hidden entries (``pipeline.evaluate.impute``) into ``out``."""
    cfg, model, proposals = trained
    set_cfg, set_proposals = with_network(cfg, model, proposals, impute_set.get("network"), device)
    k, l = imputing.get("pair") or unique_pairs[0]
    rows, examples = imputation_frame(
        task,
        set_cfg,
        model,
        set_proposals,
        imputing,
        impute_arrays,
        k,
        l,
        training_ids(cell),
        ev.get("resample_mode", "block"),
    )
    out.imputations.append(rows)
    for name, value in examples.items():  # the pictures show each method's first cell
        out.impute_examples.setdefault(f"{cell['method']}__{name}", value)


def write_outputs(out_dir: Path, metrics_frame: pd.DataFrame, out: Collected) -> None:
    """Every file of ``results/eval/<task>/`` but ``meta.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "metrics.parquet", lambda tmp: metrics_frame.to_parquet(tmp, index=False))
    atomic_write(out_dir / "metrics.csv", lambda tmp: metrics_frame.to_csv(tmp, index=False))
    training = pd.concat(out.histories, ignore_index=True)
    atomic_write(out_dir / "training.parquet", lambda tmp: training.to_parquet(tmp, index=False))
    atomic_write(out_dir / "samples.npz", lambda tmp: _savez(tmp, out.samples))
    if out.imputations:
        imputed = pd.concat(out.imputations, ignore_index=True)
        atomic_write(out_dir / "imputation.parquet", lambda tmp: imputed.to_parquet(tmp, index=False))
        atomic_write(out_dir / "imputation_examples.npz", lambda tmp: _savez(tmp, out.impute_examples))
    else:  # imputation no longer asked for: no leftover from an earlier run
        for name in ("imputation.parquet", "imputation_examples.npz"):
            (out_dir / name).unlink(missing_ok=True)


def scale_meta(
    task: str, section: dict[str, Any], summary: dict[str, Any], test_sets: list[dict[str, Any]]
) -> dict[str, Any]:
    """The scale everything was made at: iterations, dataset counts and sizes, seeds."""
    first = test_sets[0]
    return {
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
    }


def figure_set_meta(entry: dict[str, Any]) -> dict[str, Any]:
    """One figure set's entry of ``meta.json``."""
    return {
        "name": entry["stem"],
        "shape": list(entry["x"].shape),
        "sizes": entry.get("sizes", {}),
        "network": entry.get("network", {}),
    }


def cell_meta(
    c: dict[str, Any],
    run_ids: dict[str, str],
    roles: dict[str, list[str]],
    settings: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """One cell's entry of ``meta.json``: its training, MLflow run, roles and settings."""
    keys = ("cell_id", "name", "method", "K", "L", "seed", "iterations", "mean_it_per_s", "checkpoint")
    return {
        **{k: c[k] for k in keys},
        "mlflow_run_id": run_ids.get(c["cell_id"]),
        "roles": roles.get(c["name"], ["main"]),
        # The settings this cell's grid entry swept, and its value of every key any
        # entry sweeps (the report's figure per swept key).
        "axes": c.get("axes", {}),
        "settings": settings[c["cell_id"]],
        # Reused from other code (sweep.reuse_across_code): the report says so in bold.
        "trained_by_other_code": bool(c.get("trained_by_other_code", False)),
    }


def _savez(tmp: Path, arrays: dict[str, np.ndarray], compressed: bool = False) -> None:
    with open(tmp, "wb") as f:  # a file object: numpy would append ".npz" to the temporary name
        (np.savez_compressed if compressed else np.savez)(f, **arrays)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="apg-pipeline eval-sweep", description="evaluate every trained cell of a task's sweep"
    )
    parser.add_argument("--task", required=True)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default=None, help="output directory (default results/eval/<task>)")
    parser.add_argument("--device", default="cpu", help="where the networks run (cpu, cuda, cuda:1, ...)")
    args = parser.parse_args(argv)
    from pipeline.errors import run_guarded

    def work() -> None:
        checks.device(args.device)  # before any checkpoint is loaded onto it
        params = load_params(args.params)
        root = project_root()
        # The evaluation runs alone after the sweep: its own thread count (default: a trial's)
        evaluate = params[args.task].get("evaluate", {})
        torch.set_num_threads(evaluate.get("threads", params["sweep"].get("torch_threads", 1)))
        out = Path(args.out or root / "results" / "eval" / args.task)
        start = time.monotonic()
        meta = evaluate_task(params, args.task, root, out, args.device)
        record_stage_time(root, "evaluate", args.task, time.monotonic() - start)
        print(f"wrote {out} ({len(meta['cells'])} cells)")

    run_guarded(work)


if __name__ == "__main__":
    main()
