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
  the listed methods, and one imputed dataset per method and setting (``pipeline.impute``).
- ``meta.json``: the scale everything was made at (iterations, dataset counts, seeds),
  which the report prints under every figure, and each cell's ``roles``: ``main`` (a
  ``pairs`` grid entry trains it: Table 1, the method tables, the claims) and/or
  ``budget`` (a ``budget`` grid entry trains it: Figure 2 retrained per budget).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pandas as pd
import torch

from apg.checkpoint import CheckpointError
from apg.data import atomic_write, load_dataset
from apg.metrics import adjusted_rand_index, matched_centre_error
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
from pipeline.config import axis_keys, evaluation_pairs, evaluation_sets, grid_cells, load_params, setting_of
from pipeline.impute import check_settings as check_imputation
from pipeline.impute import imputation_frame
from pipeline.stages import record_stage_time

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
            rows = torch.arange(log_w.shape[1], device=log_w.device)
            chosen = {name: t[best, rows] for name, t in z.items()}
            out[k] = {name: t.cpu().numpy() for name, t in chosen.items()}
            if keep_recon:
                recon = reconstruct(model, x, {name: t[None] for name, t in chosen.items()})[0]
                out[k]["recon"] = recon.cpu().numpy()

    x = x.to(_device(model, proposals, x), torch.get_default_dtype())
    with torch.no_grad():
        make_method(cfg).run(
            model, proposals, x, max(sweeps), particles, "block", cfg.resampler, collectors=[collect]
        )
    return out


# --------------------------------------------------------------------------- cluster recovery


def _device(model, proposals, x: torch.Tensor) -> torch.device:
    """Where the trained networks live (``x``'s device for a method without parameters)."""
    return next(iter([*model.parameters(), *proposals.parameters()]), x.new_zeros(())).device


def final_particle(
    cfg, model, proposals, x: torch.Tensor, sweeps: int, particles: int, batch_size: int, resample_mode: str
) -> dict[str, np.ndarray] | None:
    """Each dataset's highest-weight particle after the method's last sweep at budget
    ``(sweeps, particles)``: its assignments ``c (M, N)`` and, when the particles have them,
    its centres ``mu (M, I, D)``; ``None`` when the method's particles have no ``c``
    (nothing to score).

    A run of its own: ``apg.training.evaluate`` does not hand out its final particles.
    """
    method = make_method(cfg)
    device = _device(model, proposals, x)
    chunks: dict[str, list[np.ndarray]] = {}
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            xb = x[start : start + batch_size].to(device, torch.get_default_dtype())
            result = method.run(model, proposals, xb, sweeps, particles, resample_mode, cfg.resampler)
            if "c" not in result.z:
                return None
            best = result.log_weights.argmax(0)  # (B,)
            rows = torch.arange(xb.shape[0], device=device)
            for name in ("c", "mu"):
                if name in result.z:
                    chunks.setdefault(name, []).append(result.z[name][best, rows].cpu().numpy())
    return {name: np.concatenate(parts) for name, parts in chunks.items()}


def ari_scores(true_c: np.ndarray, pred_c: np.ndarray | None) -> np.ndarray:
    """Per-dataset ARI ``(M,)`` of ``pred_c (M, N)`` against ``true_c (M, N)``; NaN when
    there are no predicted assignments."""
    if pred_c is None:
        return np.full(len(true_c), np.nan)
    return adjusted_rand_index(torch.from_numpy(true_c), torch.from_numpy(pred_c)).numpy()


def latent_truth(task: str, path: Path) -> dict[str, Any] | None:
    """What a held-out file holds of the truth for scoring a final particle: its arrays
    (``x`` and the true ``c``, ``mu``) and the ceiling's per-dataset ARI ``ari_ceiling``
    ``(M,)`` (None for tasks without a ceiling rule); None without true assignments."""
    arrays = load_dataset(path)
    if "c" not in arrays:
        return None
    true_c = arrays["c"].astype(np.int64)
    rule = get_task(task).assignment_ceiling
    return {"arrays": arrays, "c": true_c, "ari_ceiling": ari_scores(true_c, rule(arrays)) if rule else None}


def particle_scores(
    task: str,
    truth: dict[str, Any],
    particle: dict[str, np.ndarray] | None,
    model_hparams: dict[str, Any],
    sizes: dict[str, Any],
) -> dict[str, np.ndarray]:
    """Final metrics ``(M,)`` of the highest-weight particles (``final_particle``) against the
    truth (``latent_truth``): ``ari``; ``centre_err`` (``apg.metrics.matched_centre_error``)
    when both hold centres ``mu``; ``log_joint_true`` for the tasks with a
    ``TaskSpec.common_log_joint``; ``ari_ceiling`` where the task has one. NaN where the
    particles lack what a metric reads."""
    size = len(truth["c"])
    scores = {"ari": ari_scores(truth["c"], None if particle is None else particle["c"])}
    if "mu" in truth["arrays"]:
        scores["centre_err"] = np.full(size, np.nan)
        if particle is not None and "mu" in particle:
            true_mu, mu = (
                torch.from_numpy(np.asarray(a, dtype=np.float64))
                for a in (truth["arrays"]["mu"], particle["mu"])
            )
            scores["centre_err"] = matched_centre_error(true_mu, mu).numpy()
    common_log_joint = get_task(task).common_log_joint
    if common_log_joint is not None:
        scores["log_joint_true"] = np.full(size, np.nan)
        if particle is not None and "mu" in particle:
            scores["log_joint_true"] = common_log_joint(truth["arrays"], particle, model_hparams, sizes)
    if truth["ari_ceiling"] is not None:
        scores["ari_ceiling"] = truth["ari_ceiling"]
    return scores


# --------------------------------------------------------------------------- tracking


def position_truth(task: str, path: Path) -> dict[str, np.ndarray] | None:
    """The simulator's positions in a held-out file, for tasks that track
    (``TaskSpec.tracking``: Bouncing MNIST's digits); None otherwise."""
    tracking = get_task(task).tracking
    if tracking is None:
        return None
    data = load_dataset(path)
    try:
        return tracking.truth(data)
    except ValueError as err:
        raise ValueError(f"{path} {err}; run `dvc repro generate@{task}`") from None


def tracking_errors(
    cfg,
    model,
    proposals,
    x: torch.Tensor,
    truth: dict[str, np.ndarray],
    sweeps: int,
    particles: int,
    batch_size: int,
    resample_mode: str,
) -> dict[str, np.ndarray]:
    """Curves ``(K, M)``: the task's position errors (``TaskSpec.tracking``; Bouncing MNIST:
    the position error in pixels at the digits' ink centres, the boxes' error, the motion
    error and the tracked-frame fraction) of each dataset's highest-weight particle after
    each sweep, against the simulator's (``truth`` from ``position_truth``). A run of its
    own, like ``final_particle``."""
    tracking = get_task(cfg.task).tracking
    device = _device(model, proposals, x)
    method = make_method(cfg)
    per_sweep: dict[int, list[dict[str, np.ndarray]]] = {}

    def collect(k: int, z: dict[str, torch.Tensor], log_w: torch.Tensor) -> None:
        rows = torch.arange(log_w.shape[1], device=log_w.device)
        best = log_w.argmax(0)
        chosen = {name: t[best, rows][None] for name, t in z.items()}  # (1, B, ...)
        per_sweep.setdefault(k, []).append(tracking.positions(model, x, chosen))

    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            xb = x[start : start + batch_size].to(device, torch.get_default_dtype())
            method.run(
                model, proposals, xb, sweeps, particles, resample_mode, cfg.resampler, collectors=[collect]
            )
    curves: dict[str, list[np.ndarray]] = {}
    for k in sorted(per_sweep):
        found = {name: np.concatenate([part[name] for part in per_sweep[k]]) for name in per_sweep[k][0]}
        errors = tracking.errors(truth, found)
        for name, value in errors.items():
            curves.setdefault(name, []).append(value)
    return {name: np.stack(values) for name, values in curves.items()}


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


def evaluate_task(
    params: dict[str, Any], task: str, root: Path, out_dir: Path, device: torch.device | str = "cpu"
) -> dict[str, Any]:
    """Evaluate every cell of ``results/<task>/sweep.json`` on ``device`` (the networks run
    there; the held-out data stay on the host and go there a batch at a time)."""
    summary_path = root / "results" / task / "sweep.json"
    if not summary_path.is_file():
        raise ValueError(f"sweep summary {summary_path} not found; run the sweep stage first")
    summary = json.loads(summary_path.read_text())
    section, spec = params[task], get_task(task)
    ev = section.get("evaluate", {})
    plan = evaluation_pairs(params, task)
    model_hparams = section.get("model", {})
    data_dir = root / "data" / task
    # Every held-out set (Table 1 and curves: each with its own sizes and network overrides)
    # and every figure set is read once, before the cells.
    sets = evaluation_sets(section)
    for entry in sets:
        entry["x"] = load_task_data(task, data_dir / f"{entry['stem']}.npz", model_hparams)
        entry["truth"] = position_truth(task, data_dir / f"{entry['stem']}.npz")
        if entry["kind"] == "test":
            entry["latents"] = latent_truth(task, data_dir / f"{entry['stem']}.npz")
    test_sets = [e for e in sets if e["kind"] == "test"]
    figure_sets = [e for e in sets if e["kind"] == "figure"]
    figure_sweeps = ev.get("figure_sweeps", [1])
    frames, histories, samples, index = [], [], {}, []
    imputing = ev.get("imputation")  # issue 22: the cells' imputations of hidden entries
    imputations: list[pd.DataFrame] = []
    impute_examples: dict[str, np.ndarray] = {}
    if imputing:
        impute_set = next(
            (e for e in test_sets if e["name"] == imputing.get("test_set", test_sets[0]["name"])), None
        )
        if impute_set is None:
            raise ValueError(
                f"{task}.evaluate.imputation.test_set {imputing['test_set']!r} is not a test set"
            )
        check_imputation(task, imputing, section, impute_set)
        impute_arrays = load_dataset(data_dir / f"{impute_set['stem']}.npz")
    unique_pairs = sorted({tuple(p) for pairs in plan.values() for p in pairs})
    roles = cell_roles(params, task)
    swept = axis_keys(params, task)
    settings: dict[str, dict[str, Any]] = {}  # every cell's value of every swept key
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
        cfg, model, proposals = load_trained(ckpt, device)
        settings[cell["cell_id"]] = {key: setting_of(cfg.to_dict(), key) for key in swept}
        # Cells of an earlier grid still in the summary have no entry now: treat as main.
        cell_role = roles.get(cell["name"], ["main"])
        ids = {
            "task": task,
            "method": cell["method"],
            "seed": cell["seed"],
            "train_K": cell["K"],
            "train_L": cell["L"],
            "cell_id": cell["cell_id"],
        }
        for entry in test_sets:
            set_cfg, set_proposals = with_network(cfg, model, proposals, entry.get("network"), device)
            set_ids = {
                **ids,
                "test_set": entry["name"],
                "test_sizes": json.dumps(entry.get("sizes", {}), sort_keys=True),
            }
            for k, l in cell_pairs(cell_role, cell, unique_pairs):
                # Same seed for every cell at a pair: methods see the same randomness budget.
                seed_everything(ev.get("seed", 0) + 1000 * cell["seed"])
                run_args = (ev.get("batch_size", 20), ev.get("resample_mode", "block"))
                metrics = evaluate_cell(set_cfg, model, set_proposals, entry["x"], k, l, *run_args)
                if entry["latents"] is not None:
                    particle = final_particle(set_cfg, model, set_proposals, entry["x"], k, l, *run_args)
                    metrics.update(
                        particle_scores(
                            task, entry["latents"], particle, model_hparams, entry.get("sizes", {})
                        )
                    )
                if entry["truth"] is not None:
                    metrics.update(
                        tracking_errors(
                            set_cfg, model, set_proposals, entry["x"], entry["truth"], k, l, *run_args
                        )
                    )
                if ev.get("sweep_resampling") and run_args[1] != "sweep":
                    # The paper's overall ESS: the same sampler resampling once per sweep only.
                    # Last, and from the pair's seed, so the runs above draw as without it.
                    seed_everything(ev.get("seed", 0) + 1000 * cell["seed"])
                    per_sweep = evaluate_cell(
                        set_cfg, model, set_proposals, entry["x"], k, l, run_args[0], "sweep"
                    )
                    metrics["sweep_ess"] = per_sweep["ess"]
                frames.append(tidy(metrics, {**set_ids, "K": k, "L": l}))
        if (
            imputing
            and "main" in cell_role
            and not cell.get("axes")
            and cell["method"] in imputing["methods"]
        ):
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
                {key: ids[key] for key in ("method", "seed", "train_K", "train_L", "cell_id")},
                ev.get("resample_mode", "block"),
            )
            imputations.append(rows)
            for name, value in examples.items():  # the pictures show each method's first cell
                impute_examples.setdefault(f"{cell['method']}__{name}", value)
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
        # Figure 2's retrained cells stand for one number each, and cells of a swept axis
        # for one point of its figure; the pictures show the task's own main cells.
        pictured = "main" in cell_role and not cell.get("axes")
        for i, entry in enumerate(figure_sets if pictured else []):
            stem, x = entry["stem"], entry["x"]
            samples[f"x__{stem}"] = x.numpy()
            if entry["truth"] is not None:
                for name in spec.tracking.pictured:
                    samples[f"truth__{stem}__{name}"] = entry["truth"][name]
            set_cfg, set_proposals = with_network(cfg, model, proposals, entry.get("network"), device)
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
    logged = log_evaluation(summary, run_ids, metrics_frame)
    if logged:
        print(
            f"evaluate {task}: held-out numbers logged to {logged} MLflow runs (metrics eval.<set>.K<K>L<L>.<metric>)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "metrics.parquet", lambda tmp: metrics_frame.to_parquet(tmp, index=False))
    atomic_write(out_dir / "metrics.csv", lambda tmp: metrics_frame.to_csv(tmp, index=False))
    training = pd.concat(histories, ignore_index=True)
    atomic_write(out_dir / "training.parquet", lambda tmp: training.to_parquet(tmp, index=False))
    atomic_write(out_dir / "samples.npz", lambda tmp: _savez(tmp, samples))
    if imputations:
        imputed = pd.concat(imputations, ignore_index=True)
        atomic_write(out_dir / "imputation.parquet", lambda tmp: imputed.to_parquet(tmp, index=False))
        atomic_write(out_dir / "imputation_examples.npz", lambda tmp: _savez(tmp, impute_examples))
    else:  # imputation no longer asked for: no leftover from an earlier run
        for name in ("imputation.parquet", "imputation_examples.npz"):
            (out_dir / name).unlink(missing_ok=True)
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
                "roles": roles.get(c["name"], ["main"]),
                # The settings this cell's grid entry swept, and its value of every key any
                # entry sweeps (the report's figure per swept key).
                "axes": c.get("axes", {}),
                "settings": settings[c["cell_id"]],
                # Reused from other code (sweep.reuse_across_code): the report says so in bold.
                "trained_by_other_code": bool(c.get("trained_by_other_code", False)),
            }
            for c in summary["cells"]
        ],
        "axes": swept,
        "pairs": [list(p) for p in plan.get("pairs", [])],
        "budget": {"total": ev["budget"]["total"], "pairs": [list(p) for p in plan["budget"]]}
        if "budget" in plan
        else None,
        "baseline": ev.get("baseline"),
        "imputation": {**imputing, "test_set": impute_set["name"]} if imputing else None,
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


def _sweep_client(summary: dict[str, Any]):
    """The sweep's MLflow client, or None when the sweep logged nothing; the store is looked
    up in this project when the sweep ran in a copy of it since moved or deleted."""
    info = summary.get("mlflow") or {}
    if not info.get("parent_run_id"):
        return None
    from pipeline import tracking

    uri = info["tracking_uri"]
    store = uri.removeprefix("sqlite:///") if urlparse(uri).scheme == "sqlite" else None
    if store is not None and not Path(store).is_file():
        # Opening the gone store would create an empty one there.
        uri = tracking.tracking_uri(project_root())
        print(
            f"note: the sweep's MLflow store {store} is gone; looking its runs up in {tracking.redact(uri)}"
        )
    return tracking.client(uri)


def _note(what: str, err: Exception) -> None:
    print(f"note: {what} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")


def mlflow_run_ids(summary: dict[str, Any]) -> dict[str, str]:
    """``{cell_id: MLflow child run id}`` for the sweep's cells, so that every reported
    number can be traced to its run; empty when the tracking store cannot be read (the
    cell id is also a tag, ``apg.cell_id``, on the child run)."""
    try:
        from pipeline import tracking

        client = _sweep_client(summary)
        if client is None:
            return {}
        info = summary["mlflow"]
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
        _note("MLflow run ids not recorded", err)
        return {}


def evaluation_metrics(frame: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Per cell id, its held-out numbers as MLflow metrics: the mean over the datasets of
    each final metric, named ``eval.<test set>.K<K>L<L>.<metric>`` (one name per number of
    Table 1 and the method tables, so the runs table can show and sort them)."""
    last = frame.groupby(["cell_id", "test_set", "K", "L", "metric"])["sweep"].transform("max")
    fin = frame[frame["sweep"] == last]
    means = fin.groupby(["cell_id", "test_set", "K", "L", "metric"])["value"].mean().dropna()
    out: dict[str, dict[str, float]] = {}
    for (cell_id, test_set, k, l, metric), value in means.items():
        out.setdefault(cell_id, {})[f"eval.{test_set}.K{k}L{l}.{metric}"] = float(value)
    return out


def log_evaluation(summary: dict[str, Any], run_ids: dict[str, str], frame: pd.DataFrame) -> int:
    """Log every cell's held-out numbers (``evaluation_metrics``) to its MLflow run, beside
    its training curves; the number of runs logged (best effort, like ``mlflow_run_ids``)."""
    if not run_ids:
        return 0
    try:
        from pipeline import tracking

        client = _sweep_client(summary)
        if client is None:
            return 0
        logged = 0
        for cell_id, values in evaluation_metrics(frame).items():
            if cell_id in run_ids:
                tracking.log_metrics(client, run_ids[cell_id], [(0, values)])
                logged += 1
        return logged
    except Exception as err:  # noqa: BLE001 - the evaluation's files are the record; MLflow is a view of them
        _note("held-out numbers not logged to MLflow", err)
        return 0


def _savez(tmp: Path, arrays: dict[str, np.ndarray]) -> None:
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)


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
