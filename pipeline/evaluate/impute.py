"""Missing-data imputation in the pipeline (issue 22): the chains of each cell on what the
task's evaluation hides and the rows of their errors (which entries are hidden and how
their imputation is scored is the task's ``TaskSpec.imputation``: ``apg/tasks/gmm/imputation.py``,
``apg/tasks/bmnist/imputation.py``), and one observation and mask file imputed from the
command line.

The chain itself is ``apg.imputation.impute`` (Rezende et al. 2014, Appendix F). The
``evaluate`` stage calls :func:`imputation_frame` for every cell of the methods listed in
``<task>.evaluate.imputation``; it writes ``results/eval/<task>/imputation.parquet``, long
format with columns ``task, method, K, L, seed, train_K, train_L, cell_id, setting,
dataset, iteration, metric, value`` (``K, L``: the budget of each inference step):

- GMM (``missing: one_coordinate``): in each held-out dataset a fraction of the points has
  one coordinate hidden (which one and which points drawn from ``seed``). ``rmse``: RMSE,
  over the hidden coordinates, of the mean of the chain's draws up to that iteration
  (after ``burn_in``; the chain's estimate of E[x_missing | x_observed]) against the true
  values; ``rmse_draw``: the same for that iteration's draw alone; ``rmse_oracle``: the
  Bayes predictor with the simulator's true parameters (the best any method can do, like
  the ARI ceiling). The exact Gibbs cells (method ``gibbs``) are the exact-conditional
  reference.
- Bouncing MNIST (``missing: frames`` and/or ``region``): ``occlusions`` lists blocks of
  consecutive frames blanked (``{start, frames}``, 1-based) or a rectangle hidden in every
  frame (``{rows: [a, b], cols: [a, b]}``, pixels, end exclusive). ``mse``: pixel MSE of
  the imputation on the hidden pixels, per iteration; at the last iteration, ``pos_err``
  and ``tracked`` of the digits the chain's last inference tracked, on the occluded frames
  (against the simulator's positions, ``apg.tasks.bmnist.position_errors``).

``apg-pipeline impute --checkpoint CELL/model.pt --data obs.npz --mask mask.npz`` imputes the
entries of ``x`` that ``mask`` marks (1: missing) and writes ``x`` with its history.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from apg.data import DatasetError
from apg.imputation import MaskError, check_mask, impute
from apg.tasks import get_task, task_names
from apg.training import make_method

COLUMNS = [
    "task",
    "method",
    "K",
    "L",
    "seed",
    "train_K",
    "train_L",
    "cell_id",
    "setting",
    "dataset",
    "iteration",
    "metric",
    "value",
]


# --------------------------------------------------------------------------- settings


def check_settings(
    task: str, settings: dict[str, Any], section: dict[str, Any], test_set: dict[str, Any]
) -> None:
    """What ``pipeline.config.params`` cannot check without knowing the task: raise ``ValueError``
    (one line, naming the key) before the evaluate stage does any work."""
    where = f"{task}.evaluate.imputation"
    spec = get_task(task)
    fill = settings.get("fill", "sample")
    if spec.imputation is None:
        raise ValueError(
            f"{where}: imputation is evaluated for {' and '.join(imputing_tasks())} only, not {task}"
        )
    if (spec.sample_data if fill == "sample" else spec.reconstruct) is None:
        raise ValueError(
            f"{where}.fill: task {task} cannot {'draw' if fill == 'sample' else 'reconstruct'} data"
        )
    if spec.imputation.check is not None:
        spec.imputation.check(settings, section.get("model", {}), test_set, where)


def imputing_tasks() -> list[str]:
    """The registered tasks whose evaluation scores imputations (``TaskSpec.imputation``)."""
    return [name for name in task_names() if get_task(name).imputation is not None]


# --------------------------------------------------------------------------- per cell


def imputation_frame(
    task: str,
    cfg,
    model,
    proposals,
    settings: dict[str, Any],
    arrays: dict[str, np.ndarray],
    sweeps: int,
    particles: int,
    ids: dict[str, Any],
    resample_mode: str = "block",
) -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
    """One cell's imputation rows on one held-out set (``arrays``: its file's arrays), and
    its first dataset's example per setting (``{setting index}__{truth,mask,imputed}``).

    ``settings``: the task's ``evaluate.imputation`` section. Every cell of a task hides
    the same entries (drawn from its ``seed``); each chain is seeded from that ``seed`` and
    the cell's training seed (``ids["seed"]``), as the evaluate stage seeds its runs, so
    cells of different seeds (exact Gibbs's too) run chains of their own.
    """
    spec = get_task(task)
    method = make_method(cfg)
    dtype = torch.get_default_dtype()
    count = min(int(settings.get("num_datasets", len(arrays["x"]))), len(arrays["x"]))
    x = torch.from_numpy(arrays["x"][:count]).to(dtype)
    iterations, fill = int(settings.get("iterations", 10)), settings.get("fill", "sample")
    seed = int(settings.get("seed", 0))
    chain_seed = seed + 1000 * int(ids.get("seed", 0))
    run = (iterations, sweeps, particles, fill, resample_mode, cfg.resampler)
    rows: list[dict[str, Any]] = []
    examples: dict[str, np.ndarray] = {}

    def keep(index: int, mask: torch.Tensor, imputed: torch.Tensor) -> None:
        examples[f"{index}__truth"] = x[0].numpy()
        examples[f"{index}__mask"] = mask[0].numpy()
        examples[f"{index}__imputed"] = imputed[0].numpy()

    def add(setting: str, metric: str, values: np.ndarray, iteration: int) -> None:
        for dataset, value in enumerate(np.asarray(values, dtype=np.float64)):
            rows.append(
                {
                    "setting": setting,
                    "dataset": dataset,
                    "iteration": iteration,
                    "metric": metric,
                    "value": value,
                }
            )

    if spec.imputation is None:
        raise ValueError(
            f"task {task!r} has no imputation evaluation ({' and '.join(imputing_tasks())} have)"
        )
    for j, (setting, mask) in enumerate(spec.imputation.masks(settings, x)):
        torch.manual_seed(chain_seed)
        result = impute(method, model, proposals, spec, x, mask, *run)
        keep(j, mask, result.x)
        for metric, values, iteration in spec.imputation.scores(settings, x, mask, arrays, model, result):
            add(setting, metric, values, iteration)
    frame = pd.DataFrame(rows)
    for key, value in ids.items():
        frame[key] = value
    frame["task"], frame["K"], frame["L"] = task, sweeps, particles
    return frame[COLUMNS], examples


# --------------------------------------------------------------------------- one file, from the CLI


def read_mask(path: str | Path) -> torch.Tensor:
    """The array ``mask`` (or the only array) of an ``.npz`` file, numeric or bool;
    ``MaskError`` / ``DatasetError`` with a one-line reason otherwise."""
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise DatasetError(f"mask file {path} is not an .npz archive ({err})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DatasetError(f"mask file {path} is not an .npz archive (a bare array: save it with np.savez)")
    with archive:
        names = archive.files
        name = "mask" if "mask" in names else names[0] if len(names) == 1 else None
        if name is None:
            raise MaskError(f"mask file {path} holds {names}: name the array 'mask'")
        try:
            mask = archive[name]
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            raise DatasetError(f"mask file {path} is corrupt ({err})") from None
    if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.number):
        raise MaskError(f"mask file {path}: the mask must be 0/1 or bool, got dtype {mask.dtype}")
    return torch.from_numpy(mask)


def impute_file(
    checkpoint: str | Path,
    data: str | Path,
    mask_file: str | Path,
    out: str | Path,
    iterations: int,
    sweeps: int | None,
    particles: int | None,
    fill: str,
    network: dict[str, Any] | None = None,
) -> Path:
    """Impute ``data``'s ``x`` where ``mask_file``'s ``mask`` (or its only array) is 1 and
    write ``out`` (``x`` imputed, ``mask``, ``history (iterations, n)``); ``sweeps`` and
    ``particles`` not given: the checkpoint's own."""
    from apg.data import atomic_write
    from apg.loading import load_task_data, load_trained, with_network
    from apg.training import check_budget

    cfg, model, proposals = load_trained(checkpoint)
    sweeps = cfg.sweeps if sweeps is None else sweeps
    particles = cfg.particles if particles is None else particles
    check_budget(sweeps, particles)
    cfg, proposals = with_network(cfg, model, proposals, network)
    x = load_task_data(cfg.task, data, cfg.model)
    missing = check_mask(x, read_mask(mask_file))
    result = impute(
        make_method(cfg),
        model,
        proposals,
        get_task(cfg.task),
        x,
        missing,
        iterations,
        sweeps,
        particles,
        fill,
    )
    arrays = {"x": result.x.numpy(), "mask": missing.numpy(), "history": result.history.numpy()}

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    return atomic_write(out, write)


__all__ = ["imputation_frame", "impute_file"]
