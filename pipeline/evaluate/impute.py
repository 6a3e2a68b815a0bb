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
from pipeline.present import pm, write_gif

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
    sweeps: int,
    particles: int,
    fill: str,
    network: dict[str, Any] | None = None,
) -> Path:
    """Impute ``data``'s ``x`` where ``mask_file``'s ``mask`` (or its only array) is 1 and
    write ``out`` (``x`` imputed, ``mask``, ``history (iterations, n)``)."""
    from apg.data import atomic_write
    from apg.loading import load_task_data, load_trained, with_network

    cfg, model, proposals = load_trained(checkpoint)
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


# --------------------------------------------------------------------------- report

# metric -> column header, in the order the tables show them
REPORT_METRICS = {
    "rmse": "RMSE, mean of the draws",
    "rmse_draw": "RMSE, last draw",
    "rmse_oracle": "RMSE, true-parameter predictor",
    "mse": "MSE on hidden pixels",
    "pos_err": "position error, occluded frames (px)",
    "tracked": "tracked occluded frames",
}
FIGURE_TEXT = {
    "imputation": (
        "Imputation of hidden entries by the chain of inference and generation (Rezende et al. "
        "2014, Appendix F): each method's cells infer the latents of the filled-in data, then the "
        "hidden entries are redrawn from p(x | z) (params `fill: sample`) or set to its mean "
        "(`fill: mean`). Error bars: std over seeds x datasets."
    ),
    "imputation_gif": (
        "An occluded held-out video (hidden pixels grey) | its imputation by the first cell of "
        "APG (else of the first method listed), the chain's last state | the true video, for the "
        "occlusion that blanks the most frames."
    ),
}


def load_imputation(eval_dir: Path) -> tuple[pd.DataFrame, dict[str, np.ndarray]] | None:
    """The evaluate stage's imputation results, or ``None`` when it made none."""
    if not (eval_dir / "imputation.parquet").is_file():
        return None
    examples: dict[str, np.ndarray] = {}
    if (eval_dir / "imputation_examples.npz").is_file():
        with np.load(eval_dir / "imputation_examples.npz") as archive:
            examples = {k: archive[k] for k in archive.files}
    return pd.read_parquet(eval_dir / "imputation.parquet"), examples


def final_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Each metric at the chain's last iteration."""
    return frame[frame["iteration"] == frame.groupby("metric")["iteration"].transform("max")]


def imputation_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean and std over seeds x datasets of every metric at the last iteration, per
    (setting, method, K, L), with the number of seeds."""
    last = final_rows(frame)
    keys = ["setting", "method", "K", "L", "train_K", "train_L"]
    stats = last.groupby([*keys, "metric"], sort=False)["value"].agg(["mean", "std"]).unstack("metric")
    stats.columns = [f"{stat}_{metric}" for stat, metric in stats.columns]
    seeds = last.groupby(keys, sort=False)["seed"].nunique().rename("seeds")
    return stats.join(seeds).reset_index()


def imputation_markdown(table: pd.DataFrame) -> str:
    metrics = [m for m in REPORT_METRICS if f"mean_{m}" in table]
    head = [
        "| hidden | method | trained at | K | L | seeds | "
        + " | ".join(REPORT_METRICS[m] for m in metrics)
        + " |",
        "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in metrics) + " |",
    ]
    rows = [
        f"| {r['setting']} | {r['method']} | K{r['train_K']} L{r['train_L']} | {r['K']} | {r['L']} | {r['seeds']} | "
        + " | ".join(pm(r[f"mean_{m}"], r[f"std_{m}"]) for m in metrics)
        + " |"
        for _, r in table.iterrows()
    ]
    return "\n".join(head + rows)


def imputation_figure(frame: pd.DataFrame, path: Path, save) -> bool:
    """GMM: error versus chain iteration per method; Bouncing MNIST: the errors per
    occlusion, per method. ``save(fig, path)`` writes the figure."""
    import matplotlib.pyplot as plt

    if frame.empty:
        return False
    methods = sorted(set(frame["method"]))
    if "rmse" in set(frame["metric"]):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, method in enumerate(methods):
            sub = frame[(frame["method"] == method) & (frame["metric"] == "rmse")]
            stats = sub.groupby("iteration")["value"].agg(["mean", "std"]).reset_index()
            ax.errorbar(
                stats["iteration"],
                stats["mean"],
                yerr=stats["std"],
                label=method,
                color=f"C{i}",
                capsize=2,
                marker=".",
            )
        oracle = frame[frame["metric"] == "rmse_oracle"]["value"]
        if len(oracle):
            ax.axhline(oracle.mean(), ls="--", color="k", lw=1, label="true-parameter predictor")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.set_xlabel("chain iteration")
        ax.set_ylabel("RMSE of the hidden coordinates")
        ax.set_title(str(frame["setting"].iloc[0]), fontsize=9)
        ax.legend(fontsize=7)
    else:
        last = final_rows(frame)
        metrics = [m for m in ("mse", "pos_err") if m in set(last["metric"])]
        order = list(dict.fromkeys(last["setting"]))
        fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8), squeeze=False)
        for ax, metric in zip(axes[0], metrics, strict=False):
            for i, method in enumerate(methods):
                sub = last[(last["method"] == method) & (last["metric"] == metric)]
                stats = sub.groupby("setting")["value"].agg(["mean", "std"]).reindex(order)
                ax.errorbar(
                    range(len(order)),
                    stats["mean"],
                    yerr=stats["std"],
                    label=method,
                    color=f"C{i}",
                    capsize=2,
                    marker="o",
                )
            ax.set_xticks(range(len(order)), order, rotation=20, fontsize=7)
            ax.set_ylabel(REPORT_METRICS[metric])
        axes[0, 0].legend(fontsize=7)
    save(fig, path)
    return True


def imputation_gif(examples: dict[str, np.ndarray], frame: pd.DataFrame, path: Path) -> bool:
    """Bouncing MNIST: APG's (else the first method's) imputation of the setting that hides
    the most frames, as a GIF of observed | imputed | true frames."""
    settings = list(dict.fromkeys(frame["setting"]))
    methods = sorted({k.split("__")[0] for k in examples})
    method = "apg" if "apg" in methods else methods[0] if methods else None
    if method is None or examples[f"{method}__0__truth"].ndim != 3:
        return False
    counts = [
        int(examples[f"{method}__{j}__mask"].reshape(len(examples[f"{method}__{j}__mask"]), -1).all(1).sum())
        for j in range(len(settings))
    ]
    j = int(np.argmax(counts))
    truth, mask, imputed = (examples[f"{method}__{j}__{n}"] for n in ("truth", "mask", "imputed"))
    observed = np.where(mask, 0.5, truth)
    gap = np.ones((truth.shape[0], truth.shape[1], 4))
    panels = np.concatenate([observed, gap, imputed, gap, truth], axis=2)
    pixels = (np.clip(panels, 0, 1) * 255).astype(np.uint8)
    write_gif(path, [f.repeat(2, axis=0).repeat(2, axis=1) for f in pixels], 300)  # twice the size
    return True


def report_imputation(
    task: str, loaded: tuple[pd.DataFrame, dict[str, np.ndarray]] | None, out: Path, fmt: str, save
) -> dict[str, Any] | None:
    """The report's imputation part for one task (``loaded``: :func:`load_imputation`'s): a
    table (``tables/<task>_imputation.{csv,md}``), a figure and, for videos, a GIF;
    ``None`` when the evaluation made no imputations. ``save(fig, path)`` writes a figure."""
    from apg.data import atomic_write

    if loaded is None:
        return None
    frame, examples = loaded
    table = imputation_table(frame)
    md = imputation_markdown(table)
    atomic_write(out / "tables" / f"{task}_imputation.csv", lambda tmp: table.to_csv(tmp, index=False))
    atomic_write(out / "tables" / f"{task}_imputation.md", lambda tmp: tmp.write_text(md + "\n"))
    figures = {}
    if imputation_figure(frame, out / "figures" / f"{task}_imputation.{fmt}", save):
        figures["imputation"] = f"figures/{task}_imputation.{fmt}"
    if imputation_gif(examples, frame, out / "figures" / f"{task}_imputation.gif"):
        figures["imputation_gif"] = f"figures/{task}_imputation.gif"
    headline: dict[str, dict[str, float]] = {}
    for _, r in table.iterrows():
        setting = "".join(ch if ch.isalnum() else "_" for ch in str(r["setting"]))
        headline.setdefault(f"{r['method']}/K{r['K']}/L{r['L']}", {}).update(
            {
                f"impute_{m}_{setting}": float(r[f"mean_{m}"])
                for m in REPORT_METRICS
                if f"mean_{m}" in r and np.isfinite(r[f"mean_{m}"])
            }
        )
    return {"md": md, "figures": figures, "headline": headline}


__all__ = ["imputation_frame", "impute_file", "report_imputation"]
