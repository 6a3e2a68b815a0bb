"""What a finished search of ``pipeline.search.stage`` leaves: ``trials.csv`` (a row per trial),
``best-params.yaml``, ``summary.json``, the best trial tagged in MLflow, and the tuning
report (markdown and its figure)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from apg.data import atomic_write
from pipeline import tracking
from pipeline.config import checks
from pipeline.present import markdown_table
from pipeline.provenance import record as provenance
from pipeline.runs import trial
from pipeline.search.plan import SECTIONS, trial_count

TAG_TRIAL = "apg.trial_id"
TAG_BEST = "apg.best"
ATTEMPTS = "attempts"  # results/tune/<task>/attempts/<trial id>.jsonl
STARTS = "starts.jsonl"  # results/tune/<task>/starts.jsonl: the code of each run of the search


def read_attempts(out: Path, trial_id: str) -> list[dict[str, Any]]:
    """Where each run of a trial started (``start_iteration`` > 0: resumed from a checkpoint)."""
    return trial.read_attempts(out / ATTEMPTS / f"{trial_id}.jsonl")


def score_key(metric: str) -> str:
    """The validation score's name in a trial's rows (Tune's results, MLflow)."""
    return f"val_{metric}"


def trial_name(setting: dict[str, Any]) -> str:
    return ", ".join(f"{k.split('.', 1)[1]}={_short(v)}" for k, v in setting.items())


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def trials_frame(plan: dict[str, Any], results, out: Path):
    """One row per trial: settings, last and best score, iterations trained, early stop."""
    import pandas as pd

    rows = []
    sign = 1 if plan["mode"] == "max" else -1
    score = score_key(plan["metric"])
    for result in results:
        history = result.metrics_dataframe
        # the trial's own log names it; its last metrics may be a PBT donor's
        own = history is not None and "trial_id" in history and len(history)
        trial_id = history["trial_id"].iloc[-1] if own else result.metrics["trial_id"]
        scores = history[score].tolist() if history is not None and score in history else []
        iterations = int(history["iteration"].max()) if scores else 0
        best = max(scores, key=lambda s: sign * s) if scores else float("nan")
        setting = {key: result.config[key] for key in plan["space"]}
        rows.append(
            {
                "trial": trial_id,
                **setting,
                **({"seed": result.config["seed"]} if "seeds" in plan else {}),
                "defaults": setting == plan.get("reference"),  # params.yaml's own settings
                "score": scores[-1] if scores else float("nan"),
                "best_score": best,
                "iterations": iterations,
                "stopped_early": result.error is None and 0 < iterations < plan["iterations"],
                "failed": result.error is not None,
                "attempts": len(read_attempts(out, trial_id)),
                "history": json.dumps(
                    [[int(i), float(s)] for i, s in zip(history["iteration"], history[score], strict=True)]
                )
                if scores
                else "[]",
            }
        )
    return asha_order(pd.DataFrame(rows), plan["mode"])


def asha_order(frame, mode: str):
    """Trials that trained longest first (those ASHA let go on), then by score.

    An early-stopped trial's score is from fewer iterations, and scores need not rise with
    training (the rings' validation log joint swings by ~100 nats between checkpoints), so the
    best trial is the best of the longest-trained, not the highest last score. ASHA stopped
    the others by their score at a rung they shared with trials that had got there first
    (the first to reach a rung always goes on: it has nobody to trail).
    """
    return frame.sort_values(
        ["iterations", "score"], ascending=[False, mode == "min"], na_position="last"
    ).reset_index(drop=True)


def settings_frame(plan: dict[str, Any], frame):
    """A search with seeds: one row per setting, its score over the seeds (mean, lowest,
    highest, and each seed's), best first among the settings whose every seed finished
    (``complete``): a setting is as good as its mean over seeds, stalls included."""
    import pandas as pd

    keys, rows = list(plan["space"]), []
    for values, part in frame.groupby(keys, sort=False):
        done = part[~part["failed"] & part["score"].notna() & (part["iterations"] == plan["iterations"])]
        scores = done.sort_values("seed")
        rows.append(
            {
                **dict(zip(keys, values if isinstance(values, tuple) else (values,), strict=True)),
                "defaults": bool(part["defaults"].any()),
                "complete": len(done) == len(plan["seeds"]),
                "mean": scores["score"].mean(),
                "lowest": scores["score"].min(),
                "highest": scores["score"].max(),
                "per_seed": json.dumps(
                    {int(s): float(v) for s, v in zip(scores["seed"], scores["score"], strict=True)}
                ),
                "trials": " ".join(sorted(part["trial"].astype(str))),
            }
        )
    return (
        pd.DataFrame(rows)
        .sort_values(["complete", "mean"], ascending=[False, plan["mode"] == "min"], na_position="last")
        .reset_index(drop=True)
    )


def scheduler_words(plan: dict[str, Any]) -> str:
    """The report's words for the search's scheduler."""
    if plan["asha"] is not None:
        return (
            f"ASHA (grace period {plan['asha'].get('grace_period', 1)}, reduction factor "
            f"{plan['asha'].get('reduction_factor', 2)})"
        )
    pbt = plan.get("pbt")
    if pbt is not None:
        return (
            f"PBT (every {pbt['perturbation_interval']} iterations the lowest "
            f"{pbt['quantile_fraction']:.0%} of trials take the weights of one in the top "
            f"{pbt['quantile_fraction']:.0%} and perturb its settings, resampling each with "
            f"probability {pbt['resample_probability']}; a trial's settings are those it ended with)"
        )
    return "no early stopping"


def best_params(params: dict[str, Any], plan: dict[str, Any], setting: dict[str, Any], score: float) -> str:
    """``params.yaml``'s sections of the task with ``setting`` applied, as YAML text."""
    task = plan["task"]
    section = {key: json.loads(json.dumps(params[task].get(key, {}))) for key in SECTIONS}
    for key, value in setting.items():
        part, _, name = key.partition(".")
        section[part][name] = value
    # What the trials ran: a schedule's length belongs with the rate it was searched with.
    section.setdefault("train", {})["iterations"] = plan["iterations"]
    head = (
        f"# Best of a search by `{plan.get('command', f'apg-pipeline tune --task {task}')}` "
        f"({plan.get('source', 'tune.yaml')}): validation "
        f"{plan['metric']} {score:.6g} at K={plan['pair'][0]}, L={plan['pair'][1]}, method "
        f"{plan['base']['method']}, {plan['iterations']} iterations.\n# Searched: {', '.join(plan['space'])}. "
        f"Copy these sections into params.yaml's {task}: to make them the sweep's starting point.\n"
    )
    return head + yaml.safe_dump({task: section}, sort_keys=False)


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def write_outputs(params, plan, results, out: Path, client, parent_id: str, exp_id: str):
    frame = trials_frame(plan, results, out)
    atomic_write(out / "trials.csv", lambda tmp: frame.to_csv(tmp, index=False))
    best, defaults = _best_and_defaults(plan, frame, out)
    setting = best["setting"]
    text = best_params(params, plan, setting, best["score"])
    atomic_write(out / "best-params.yaml", lambda tmp: tmp.write_text(text))
    for trial_id in best["trial"].split():  # with seeds, each seed's trial of the best setting
        best_run = tracking.find_run(client, exp_id, {tracking.TAG_PARENT: parent_id, TAG_TRIAL: trial_id})
        if best_run is not None:
            client.set_tag(best_run.info.run_id, TAG_BEST, "true")
    tracking.log_params(client, parent_id, {f"best.{k}": v for k, v in setting.items()})
    client.log_metric(parent_id, f"best_val_{plan['metric']}", best["score"])
    tracking.finish(client, parent_id)
    summary = {
        "task": plan["task"],
        "metric": plan["metric"],
        "mode": plan["mode"],
        "best": best,
        "defaults": defaults,
        "trials": len(frame),
        "max_iterations": plan["iterations"],
        "stopped_early": int(frame["stopped_early"].sum()),
        "failed": int(frame["failed"].sum()),
        "mlflow_parent_run": parent_id,
        # The code each run of the search imported (note_start): its report names it.
        "starts": [json.loads(line) for line in (out / STARTS).read_text().splitlines()]
        if (out / STARTS).is_file()
        else [],
        "finished": provenance.utc_now(),
    }
    atomic_write(out / "summary.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=2) + "\n"))
    return summary


def _best_and_defaults(
    plan: dict[str, Any], frame, out: Path
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The summary's best setting and params.yaml's own (``None``: not among the trials):
    the first of ``asha_order``'s trials that finished with a score, or, for a search with
    seeds, the first of ``settings_frame`` (written to ``settings.csv``), its score the mean
    over seeds."""
    if "seeds" not in plan:
        rows = frame[~frame["failed"] & frame["score"].notna()]
        if rows.empty:
            raise RuntimeError(f"tune {plan['task']}: no trial finished a validation score")
        defaults = frame[frame["defaults"]]

        def entry(row, setting: dict[str, Any]) -> dict[str, Any]:
            return {
                "trial": str(row["trial"]),
                "setting": setting,
                "score": float(row["score"]),
                "iterations": int(row["iterations"]),
                "failed": bool(row["failed"]),
            }
    else:
        rows = settings_frame(plan, frame)
        atomic_write(out / "settings.csv", lambda tmp: rows.to_csv(tmp, index=False))
        if not rows["complete"].any():
            raise RuntimeError(f"tune {plan['task']}: no setting finished a validation score for every seed")
        defaults = rows[rows["defaults"]]

        def entry(row, setting: dict[str, Any]) -> dict[str, Any]:
            return {
                "trial": row["trials"],
                "setting": setting,
                "score": float(row["mean"]),
                "iterations": plan["iterations"],
                "failed": not row["complete"],
                "per_seed": json.loads(row["per_seed"]),
            }

    top = rows.iloc[0]
    best = entry(top, {key: _plain(top[key]) for key in plan["space"]})
    best.pop("failed")
    return best, None if defaults.empty else entry(defaults.iloc[0], plan["reference"])


def _score_text(value: float) -> str:
    """A log joint to 0.01 (settings differ by about a nat); an ESS or MSE to 4 digits."""
    return f"{value:.2f}" if abs(value) >= 10 else f"{value:.4g}"


def made_at_line(summary: dict[str, Any]) -> str:
    """The code that ran the search: the commit of each start (a resumed search has several)."""
    starts = summary.get("starts") or []
    if not starts:  # summaries written before searches recorded their code
        return "Made by code whose commit was not recorded."

    def code(start: dict[str, Any]) -> str:
        dirty = start.get("uncommitted") or []
        return (
            f"commit `{start['commit']}`"
            + (f" with uncommitted changes to {', '.join(f'`{f}`' for f in dirty)}" if dirty else "")
            + f" (started {start['started']})"
        )

    resumed = "".join(f"; resumed at {code(s)}" for s in starts[1:])
    return f"Run at {code(starts[0])}{resumed}; finished {summary['finished']}."


def defaults_line(summary: dict[str, Any]) -> str:
    """How the best trial compares with params.yaml's own settings (the first trial; with
    seeds, the trials of the grid's setting that is theirs, and their mean)."""
    ref = summary.get("defaults")
    if ref is None:
        return "params.yaml's own settings lie outside the searched space: no trial ran them."
    seeded = "per_seed" in ref
    trials = f"trials `{ref['trial']}`, their mean" if seeded else f"trial `{ref['trial']}`"
    first = "" if seeded else ", the search's first"  # a grid lists the trials: none is first
    if ref["trial"] == summary["best"]["trial"]:
        return f"**params.yaml's own settings** ({trial_name(ref['setting'])}, {trials}) ranked best."
    if ref.get("failed"):
        how = " (failed)"
    elif ref["iterations"] < summary.get("max_iterations", ref["iterations"]):
        how = " (stopped early)"
    else:
        how = ""
    best = summary["best"]
    best_at = best.get("iterations", summary.get("max_iterations"))
    return (
        f"**params.yaml's own settings** ({trial_name(ref['setting'])}, {trials}{first}): "
        f"{ref['score']:.6g} after {ref['iterations']} iterations{how}; the best's "
        f"score (after {best_at}) differs from it by {best['score'] - ref['score']:+.4g}."
    )


def report_path(report: str | Path, name: str) -> Path:
    """Where the tuning report goes: ``report`` itself when it names a ``.md`` file, else
    ``<report>/<name>.md`` (its figure beside it, ``<stem>.png``)."""
    report = Path(report)
    return report if report.suffix == ".md" else report / f"{name}.md"


def write_report(plan: dict[str, Any], out: Path, path: Path) -> Path:
    """The tuning report at ``path`` (``report_path``): trials table, best settings, score
    against each searched key (early-stopped trials as crosses), learning curves."""
    task = plan["task"]
    frame = checks.read_csv(out / "trials.csv")
    summary = checks.read_json(out / "summary.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    command = plan.get("command", f"apg-pipeline tune --task {task}")
    source = plan.get("source", "tune.yaml")
    best_file = plan.get("best_file", f"results/tune/{task}/best-params.yaml")
    figure = _search_figure(plan, frame, path.with_suffix(".png"))
    table = _table(frame.drop(columns=["history"]), {"score", "best_score"})
    best = summary["best"]
    if "seeds" in plan:
        settings = checks.read_csv(out / "settings.csv").drop(columns=["per_seed", "trials"])
        best_line = (
            f"**Best** (the {'lowest' if plan['mode'] == 'min' else 'highest'} mean over the seeds "
            f"{', '.join(map(str, plan['seeds']))} among the settings that every seed trained to the end "
            f"with a score): {trial_name(best['setting'])}: {best['score']:.6g} (per seed: "
            + ", ".join(f"{_score_text(v)}" for v in best["per_seed"].values())
            + f"). `{best_file}` has the task's sections with these settings."
        )
        best_line += "\n\nEach setting over the seeds:\n\n" + _table(settings, {"mean", "lowest", "highest"})
    else:
        best_line = (
            f"**Best** (the {'lowest' if plan['mode'] == 'min' else 'highest'} score among the longest-trained of the trials that finished with a "
            f"score, {best.get('iterations', plan['iterations'])} iterations): trial `{best['trial']}`, {trial_name(best['setting'])}: {best['score']:.6g}. "
            f"`{best_file}` has the task's sections with these settings."
        )
    text = "\n".join(
        [
            f"# Hyperparameter search: {task}"
            + (f", {plan['base']['method']}" if plan.get("method_flag") else ""),
            "",
            f"`{command}` with `{source}`'s `{task}:` section: method "
            f"{plan['base']['method']} at K={plan['pair'][0]}, L={plan['pair'][1]}, up to "
            f"{plan['iterations']} iterations per trial, {plan['algorithm']} search over "
            f"{trial_count(plan)} trials, "
            + scheduler_words(plan)
            + f". Score: validation {plan['metric']} after the last sweep, mean over "
            f"{plan['validation']['num_datasets']} datasets simulated for the search (seed "
            f"{plan['validation']['seed']}; not a test set), every {plan['eval_every']} iterations.",
            "",
            made_at_line(summary),
            "",
            best_line,
            "",
            defaults_line(summary),
            "",
            f"{summary['trials']} trials, {summary['stopped_early']} stopped early by ASHA, "
            f"{summary['failed']} failed; `attempts` > 1: the trial was resumed after an interruption.",
            "",
            table,
            "",
            f"![{task} search]({figure.name})",
            "",
            "Left: validation score of each trial against each searched key (dots: ran to the end; "
            "crosses: stopped early). Right: every trial's validation score while it trained.",
            "",
        ]
    )
    atomic_write(path, lambda tmp: tmp.write_text(text))
    return path


def _table(frame, scores: set[str]) -> str:
    """``frame`` as a Markdown table, ``scores`` columns as ``_score_text``."""
    columns = list(frame.columns)
    return markdown_table(
        columns,
        (
            [_score_text(v) if c in scores else _short(_plain(v)) for c, v in zip(columns, row, strict=True)]
            for row in frame.itertuples(index=False)
        ),
    )


def _search_figure(plan: dict[str, Any], frame, figure: Path) -> Path:
    """Score against each searched key (early-stopped trials as crosses, params.yaml's
    settings circled) and every trial's learning curve, saved at ``figure``."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys, task = list(plan["space"]), plan["task"]
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(4.2 * (len(keys) + 1), 3.4), squeeze=False)
    for ax, key in zip(axes[0][:-1], keys, strict=True):
        kind, args = plan["space"][key]
        numbers = kind != "choice" and all(isinstance(v, (int, float)) for v in args)
        # A choice (or a grid of names) is a category: its values at evenly spaced positions,
        # labelled as given. A grid of positive numbers an order of magnitude apart: log scale.
        where = None if numbers else {v: i for i, v in enumerate(args)}
        log = kind == "loguniform" or (
            numbers and kind == "grid" and 0 < min(args) and max(args) >= 10 * min(args)
        )

        def x_of(values, where=where):
            return [where[v] for v in values] if where is not None else values

        for early, marker, label in ((False, "o", "ran to the end"), (True, "x", "stopped early (ASHA)")):
            part = frame[frame["stopped_early"] == early]
            ax.scatter(x_of(part[key]), part["score"], marker=marker, label=label)
        mine = frame[frame["defaults"]]
        ax.scatter(
            x_of(mine[key]),
            mine["score"],
            s=160,
            facecolors="none",
            edgecolors="k",
            label="params.yaml's settings",
        )
        if where is not None:
            ax.set_xticks(range(len(args)), [str(v) for v in args])
            ax.set_xlim(-0.5, len(args) - 0.5)
        elif log:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # unreadable when crowded
        ax.set_xlabel(key)
        ax.set_ylabel(f"validation {plan['metric']}")
    axes[0][0].legend(fontsize=8)
    curves = axes[0][-1]
    for row in frame.itertuples(index=False):
        points = np.array(json.loads(row.history)).reshape(-1, 2)
        curves.plot(points[:, 0], points[:, 1], marker="x" if row.stopped_early else ".", lw=1)
    curves.set_xlabel("iteration")
    curves.set_ylabel(f"validation {plan['metric']}")
    curves.set_title("every trial")
    fig.suptitle(
        f"{task}: search over {', '.join(keys)} ({plan['base']['method']}, K={plan['pair'][0]}, L={plan['pair'][1]})"
    )
    fig.tight_layout()
    fig.savefig(figure, dpi=110)
    plt.close(fig)
    return figure
