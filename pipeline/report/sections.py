"""One task's part of the report (its tables, figures and claims) and the Markdown that
puts the parts together: the index, the per-task sections, the README's results block."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from apg.data import atomic_write
from apg.tasks import get_task
from pipeline.present import markdown_table, pm
from pipeline.provenance import record as provenance
from pipeline.report.axes import axes_markdown
from pipeline.report.claims import REPLICATION, ClaimResult, task_claims
from pipeline.report.data import main_rows, primary_test_set, retrained_rows, scale_caption
from pipeline.report.figures import (
    SET_CURVES,
    animation,
    budget_figure,
    compute_figure,
    kl_figure,
    methods_sweeps_figure,
    samples_figure,
    set_curve_figure,
    sweeps_figure,
    training_figure,
)
from pipeline.report.headline import verdict_count, verdict_tally
from pipeline.report.imputation import FIGURE_TEXT as IMPUTATION_FIGURE_TEXT
from pipeline.report.imputation import report_imputation
from pipeline.report.tables import (
    MSE_KEYS,
    _flagged,
    _footnote,
    comparison_markdown,
    comparison_table,
    set_table,
    table1,
    table_markdown,
    tracking_markdown,
    write_table,
)
from pipeline.report.training import (
    NOT_ASSESSABLE,
    NOT_PLATEAUED,
    PLATEAU_MIN_POINTS,
    PLATEAU_Z,
    cell_flags,
    row_flag,
    stalled_markdown,
    stalled_seeds,
    training_markdown,
    training_table,
    with_flags,
)


def report_task(
    task: str,
    results: dict[str, Any],
    paper: dict[str, Any] | None,
    out: Path,
    label: str,
    fmt: str,
) -> dict[str, Any]:
    """One task's tables, figures and claims."""
    meta = results["meta"]
    all_sets = main_rows(results["metrics"], meta)
    frame = primary_test_set(all_sets, meta)
    caption = scale_caption(meta, label)
    tables = out / "tables"
    training, training_md = training_tables(task, results, meta, paper, tables)
    flags = cell_flags(training)
    table = with_flags(table1(frame, meta, paper), frame, ["method", "K", "L"], flags)
    md = table_markdown(
        table, {**(paper or {}).get("block_labels", {}), **(paper or {}).get("metric_labels", {})}
    )
    write_table(tables / f"{task}_table1", table, md)
    methods = comparison_table(frame, meta)
    methods = methods.assign(flag=[row_flag(ids.split(), flags) for ids in methods["cells"]])
    methods_md = comparison_markdown(methods)
    write_table(tables / f"{task}_methods", methods, methods_md)
    mse, mse_md = mse_tables(task, all_sets, meta, flags, tables)
    tracking_md = tracking_markdown(all_sets, meta, flags, tables / f"{task}_tracking")
    axes_md = axes_markdown(frame, meta, caption, out, task, fmt)
    claims = task_claims(task, results, paper)
    made = task_figures(task, results, all_sets, frame, training, paper, out, caption, fmt)
    imputation = report_imputation(task, results.get("imputation"), out, fmt, caption)
    if imputation is not None:
        made.update(imputation["figures"])
    sets = meta.get("test_sets") or []
    return {
        "task": task,
        "imputation_md": (imputation or {}).get("md", ""),
        "imputation_set": (meta.get("imputation") or {}).get("test_set"),
        "caption": caption,
        "table_md": md,
        "methods_md": methods_md,
        "figures": made,
        "metrics": headline_numbers(table, mse, all_sets, meta, imputation),
        "paper": paper,
        "mse_md": mse_md,
        "tracking_md": tracking_md,
        "axes_md": axes_md,
        "training_md": training_md,
        "cell_flags": flags,
        "claims": claims,
        "cells": meta["cells"],
        "primary": sets[0]["name"] if len(sets) > 1 else None,
    }


def training_tables(
    task: str, results: dict[str, Any], meta: dict[str, Any], paper: dict[str, Any] | None, tables: Path
) -> tuple[pd.DataFrame, str]:
    """The training table (has every cell plateaued?) and the stalled seeds, written; the table
    and its Markdown."""
    training = training_table(results["training"], meta)
    training_md = training_markdown(training)
    if (paper or {}).get("stalled_margin") is not None:
        stalled = stalled_seeds(training, paper["stalled_margin"])
        write_table(tables / f"{task}_stalled", stalled)
        if not stalled.empty:
            training_md += "\n\n" + stalled_markdown(stalled, paper["stalled_margin"])
    write_table(tables / f"{task}_training", training, training_md)
    return training, training_md


def mse_tables(
    task: str, all_sets: pd.DataFrame, meta: dict[str, Any], flags: dict[str, str], tables: Path
) -> tuple[pd.DataFrame, str]:
    """Final-sweep reconstruction MSE per held-out set, written where the task has it; the
    table (empty otherwise) and its Markdown."""
    mse = set_table(all_sets, meta)
    if mse.empty:
        return mse, ""
    mse = with_flags(mse, all_sets.assign(test_set=all_sets.get("test_set", "test")), MSE_KEYS, flags)
    write_table(tables / f"{task}_mse", mse)
    rows = [
        [r.test_set, _flagged(r.method, r.flag), f"{r.K}", f"{r.L}", pm(r.mean, r.std)]
        for r in mse.itertuples(index=False)
    ]
    mse_md = markdown_table(["test set", "method", "K", "L", "MSE"], rows) + _footnote(mse)
    return mse, mse_md


def task_figures(
    task: str,
    results: dict[str, Any],
    all_sets: pd.DataFrame,
    frame: pd.DataFrame,
    training: pd.DataFrame,
    paper: dict[str, Any] | None,
    out: Path,
    caption: str,
    fmt: str,
) -> dict[str, str]:
    """Every figure the task's results allow, drawn; ``{name: path relative to out}``.
    ``all_sets``: the main cells' rows on every held-out set, ``frame`` on the first."""
    meta = results["meta"]
    retrained = retrained_rows(primary_test_set(results["metrics"], meta), meta)
    figures = out / "figures"

    def at(name: str) -> Path:
        return figures / f"{task}_{name}.{fmt}"

    drawn = {
        **{metric: set_curve_figure(all_sets, meta, caption, at(metric), metric) for metric in SET_CURVES},
        "compute": compute_figure(all_sets, meta, caption, at("compute")),
        "methods_sweeps": methods_sweeps_figure(frame, meta, caption, at("methods_sweeps")),
        "kl": kl_figure(frame, meta, caption, at("kl"), (paper or {}).get("block_labels")),
        "budget": budget_figure(frame, retrained, meta, caption, at("budget")),
        "sweeps": sweeps_figure(frame, meta, caption, at("sweeps")),
        "training": training_figure(results["training"], training, caption, at("training")),
        "samples": samples_figure(task, results["samples"], meta, caption, at("samples")),
        "animation": animation(results.get("animation"), figures / f"{task}_samples.gif"),
    }
    return {
        name: f"figures/{task}_{'samples.gif' if name == 'animation' else f'{name}.{fmt}'}"
        for name, ok in drawn.items()
        if ok
    }


def headline_numbers(
    table: pd.DataFrame,
    mse: pd.DataFrame,
    all_sets: pd.DataFrame,
    meta: dict[str, Any],
    imputation: dict[str, Any] | None,
) -> dict[str, dict[str, float]]:
    """``{method/K/L: {metric: value}}``: the task's headline numbers, from Table 1, the
    per-set tables and the imputation."""
    headline = {
        f"{row.method}/K{row.K}/L{row.L}": {
            m: float(getattr(row, m))
            for m in ("log_joint", "d_log_joint", "ess", "ari", "ari_ceiling")
            if m in table and np.isfinite(getattr(row, m))
        }
        for row in table.itertuples(index=False)
    }
    for metric in ("mse", "pos_err", "tracked"):
        for r in (mse if metric == "mse" else set_table(all_sets, meta, metric)).itertuples(index=False):
            if np.isfinite(r.mean):
                headline.setdefault(f"{r.method}/K{r.K}/L{r.L}", {})[f"{metric}_{r.test_set}"] = float(r.mean)
    for key, values in (imputation or {}).get("headline", {}).items():
        headline.setdefault(key, {}).update(values)
    return headline


FIGURE_TEXT = {
    "mse": "Figure 4: reconstruction MSE per pixel between held-out frames and the reconstructions of the weighted particles, versus sweep, one line per held-out set (e.g. per (T, D)); error bars: std over seeds x videos.",
    "pos_err": "Position error of the highest-weight particle against the simulator's digits (pixels between the centres of the inferred and the true digits' ink, best matching of digits per video), versus sweep, one line per held-out set; error bars: std over seeds x videos.",
    "tracked": "Fraction of frames whose every digit is within 3 px of its true position (highest-weight particle), versus sweep, one line per held-out set; error bars: std over seeds x videos.",
    "compute": "Reconstruction MSE per pixel versus compute, per held-out set. Compute: likelihood evaluations per dataset, in units of one evaluation of log p(x | z) over the whole dataset for one particle (for a video: all T frames; a gradient counts 2, a block's Markov blanket its share of the data; the proposal networks' own cost is not counted). APG: L (1 + 4 (k - 1)) after sweep k (every block's blanket before and after its update), drawn as a line over its sweeps; RWS: K*L (one encoder pass); AVF: K*L (1 + 4 n) for n inference iterations per frame and for the codes. Error bars: std over seeds x videos.",
    "methods_sweeps": "Held-out log joint versus sweep for every method at each test-time budget (K, L): APG, exact population Gibbs (gibbs), bootstrapped Gibbs, HMC-RWS (K-1 HMC transitions), and the one-step methods (RWS, reparam: K*L particles at once) as dashed levels; shaded: standard error of the mean over seeds x datasets (the same held-out datasets for every method; their spread is in Table 1).",
    "kl": "Inclusive KL (eq. 4) of each method's block kernels to the exact Gibbs conditionals, per block, using the final particles of each test-time budget as samples of the other blocks (4 exact draws each); gibbs uses the exact kernels (0 by construction) and gibbs-bootstrap the prior for the global block. Error bars: std over seeds x datasets.",
    "budget": "Figure 2: log joint and ESS/L of the final sweep versus K at a fixed budget K*L. Solid: APG retrained at each (K, L = total // K) and evaluated at that same (K, L); dashed: each method's main cell (trained at its grid pair) run at the test-time budgets, one model for every K, as the paper did. Shaded: std over seeds x datasets.",
    "sweeps": "Log joint and ESS/L versus sweep at the largest evaluation budget; RWS (one step with K*L particles) as a dashed level; shaded: standard error of the mean over seeds x datasets (their spread is in Table 1).",
    "training": "Training log joint of every cell (last sweep of each training batch; rolling mean over 1/50 of the logged points), one panel per method, one thin line per seed, coloured by the (K, L) it was trained at. Shaded: the last fifth of training, where the plateau test of the training table fits its trend; † / ‡ at a curve's end: not plateaued / not assessable.",
    "samples": "Figure 1/3 style: each method's highest-weight sample after k sweeps, on held-out datasets of different sizes (the task's draw hook: for videos, frames with the inferred digit boxes).",
    "animation": "Animated sample (the task's animate hook): for videos, each frame | its reconstruction, with the inferred boxes.",
    **IMPUTATION_FIGURE_TEXT,
}


CLAIMS_HEADING, TIME_HEADING = "Claims of the paper, checked", "Time"


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def index_markdown(parts: list[dict[str, Any]], label: str, claims_md: str, recorded_md: str = "") -> str:
    lines = [
        "# Reproduction report",
        "",
        f"**Scale: {label}.** Generated by `dvc repro` (stage `report`) from recorded results in "
        "`results/eval/`; do not edit by hand. Paper: Wu et al., *Amortized Population Gibbs "
        "Samplers with Neural Sufficient Statistics* (arXiv 1911.01382). Our numbers come from far "
        "shorter training than the paper's and are not expected to match them; the paper's numbers "
        "are shown beside ours (`paper` columns), never in place of them. Each task's section "
        "states the iterations, datasets and seeds its numbers were made with.",
        "",
        f"## {CLAIMS_HEADING}",
        "",
        "Computed by the report stage from the evaluation metrics (claim definitions: "
        "`pipeline/paper_numbers.yaml`, `claims`); ✓ holds, ✗ does not, – no verdict. Each row "
        "names the held-out set and budget it was scored at; its cells were trained as follows:",
        "",
        *(f"- {part['task']}: {part['caption']}" for part in parts),
        "",
        claims_md,
        "",
        "## Where the settings come from",
        "",
        "Every setting is `params.yaml`'s; its comments say how each was chosen (the learning-rate "
        "schedules were measured per task). `apg-pipeline tune --task <task>` searches a task's "
        "training settings (`tune.yaml`) with `params.yaml`'s own as its first trial; each search's "
        "report, in [tune/](tune/), says whether the best beat them.",
        "",
        *([recorded_md] if recorded_md else []),
    ]
    return "\n".join(lines + task_sections(parts))


TABLE1_TEXT = (
    "Mean ± std over seeds and held-out datasets at each test-time budget (K, L); `paper`: the "
    "paper's value for the column to its left (Table 1), where it reports one. Δ log p(x,z): "
    "paired difference (same dataset) to the baseline method at the same budget; ESS/L: eq. 11; "
    "`ess`/`kl` per block: ESS/L after the block update and inclusive KL (eq. 4); numbered "
    "blocks (one per video frame) are averaged over t. ARI: adjusted Rand index of the "
    "highest-weight particle's assignments c against the true c (1: the true clustering up to "
    "relabeling, 0: chance); blank for a method whose particles carry no c. ARI ceiling: the "
    "ARI of argmax_i p(c_n = i | x_n, true mu, true tau), the best any sampler can do, the same "
    "for every row (tasks whose assignments have an exact conditional). RWS rows "
    "spend K*L particles in one step. Rows average the cells trained at each method's grid "
    "pair (Figure 2's retrained cells appear only there). The CSV has every column unrounded."
)
METHODS_TEXT = (
    "Every method at each test-time budget K×L: held-out log joint, ESS/L, the SMC estimate "
    "of log p(x) and the importance-sampled one from the method's encoder with K×L samples "
    "(Rezende et al. 2014, appendix E). Mean ± std over seeds (each seed first averaged over "
    "the held-out datasets). RWS, reparam and AVF draw K×L samples in one step (AVF: K×L "
    "independent variational filters); HMC-RWS runs L chains through K-1 HMC transitions "
    "(extra gradient evaluations per transition; `HMC accept`: its mean Metropolis acceptance "
    "probability, also logged per training step as `accept` in MLflow); gibbs uses the exact "
    "conditionals. Each row names the sweep cells (and MLflow child runs, tag `apg.cell_id`) "
    "it averages."
)
TRAINING_TEXT = (
    "Per cell, over the last fifth of its training iterations: the mean training log joint "
    "(`final`), the change Δ an ordinary least-squares line through the logged values makes "
    "across that window, its standard error, and z = Δ / se(Δ); the same for the training "
    "ESS/L (the proposals' objective, an inclusive KL, shows there after the log joint is "
    "flat). The cells of one configuration (differing only by seed) are also tested together: "
    "one slope common to the seeds, an intercept per seed, over every seed's window, se(Δ) from "
    "the pooled residuals (the table under the cells'). A cell has plateaued when "
    f"|z| < {PLATEAU_Z:g} for both curves, its own and its configuration's pooled ones (one "
    "seed's window of single batches has a standard error about √S times the pooled one's, S seeds: "
    f"`docs/decisions.md#plateau-test`); with fewer than {PLATEAU_MIN_POINTS} "
    "logged points in its window it is not assessable. Rows elsewhere whose numbers come from a cell that has not "
    f"plateaued carry {NOT_PLATEAUED} (not assessable: {NOT_ASSESSABLE}). Where the rate "
    "still falls in that window, the curves rise with it (less gradient noise) whether or "
    "not more steps would help; where the schedule holds its floor rate there "
    "(`lr_hold_fraction: 0.2`, as params.yaml's do), a trend is one that more steps would "
    "extend."
)
MSE_TEXT = "Final-sweep MSE per pixel, mean ± std over seeds x videos (Figure 4's last points)."
TRACKING_TEXT = (
    "The highest-weight particle after the last sweep, per video: pixels between each "
    "inferred digit and its true digit after the best matching of digits (one "
    "permutation per video: a digit keeps its identity), averaged over frames and digits; "
    "and the fraction of frames whose every digit is within 3 px. Mean ± std over seeds x videos. "
    "A digit is where its ink is: the position error compares the centres of the ink "
    "(box corner plus the ink centre of the decoded template, against box corner plus "
    "the ink centre of the MNIST digit). The boxes' error compares box corners alone; it "
    "also counts where the learned decoder draws a digit inside its 28 x 28 box, which "
    "the data cannot pin down (a digit drawn 2 px to the right in a box 2 px to the "
    "left makes the same frame). Motion error: the position error after removing each "
    "digit's mean offset over its video."
)
AXES_TEXT = (
    "Each point: the cells trained at one value of the key (the task's own cells at "
    "theirs), evaluated at their training pair on the first held-out set after the last "
    "sweep; mean over seeds of the per-seed mean over datasets, error bars the 95% "
    "interval over seeds (with 3 or more). In the tables above such cells are rows "
    "`method [key=value]`."
)


def imputation_text(task: str, test_set: str | None) -> str:
    """The imputation table's explanation, naming the held-out set it hides entries of; what
    the numbers measure is the task's to say (``ImputationSpec.description``)."""
    spec = get_task(task).imputation
    return (
        "Missing data filled in by a Markov chain that alternates inference and generation "
        "(Rezende et al. 2014, Appendix F; `apg.imputation`): each cell infers the latents of "
        "the data with its hidden entries at their current values (its method at the budget "
        "K, L; exact Gibbs uses the exact conditionals), picks one particle by its weight, and "
        "redraws the hidden entries from p(x | z) (or sets them to its mean), from a start at "
        "the dataset's mean, on held-out set "
        f"`{test_set}`. Numbers at the chain's last iteration, mean ± std over "
        f"seeds x datasets. {spec.description if spec is not None else ''}"
    ).rstrip()


def figure_text(task: str, name: str) -> str:
    """Figure ``name``'s caption; the imputation figure's task part is the task's to say."""
    spec = get_task(task).imputation if name == "imputation" else None
    return f"{FIGURE_TEXT[name]} {spec.figure_description}".rstrip() if spec else FIGURE_TEXT[name]


def _section(heading: str, text: str, body: str) -> list[str]:
    """A subsection's lines: its heading, what its numbers are, then the numbers."""
    return [heading, "", text, "", body, ""]


def task_sections(parts: list[dict[str, Any]]) -> list[str]:
    """Each task's tables and figures (links relative to the report holding them)."""
    lines: list[str] = []
    for part in parts:
        task = part["task"]
        lines += [f"## {task}", "", part["caption"] + ".", ""]
        if part.get("primary"):
            lines += [
                f"Tables and the sweep/budget figures use the first held-out set, `{part['primary']}`; "
                "Figure 4 and the MSE table cover every set.",
                "",
            ]
        if (part["paper"] or {}).get("scale"):
            lines += [f"Paper scale: {part['paper']['scale']}.", ""]
        lines += _section(
            f"### Table 1 ([csv](tables/{task}_table1.csv))",
            TABLE1_TEXT,
            part["table_md"],
        )
        lines += _section(
            f"### Methods at equal sample budgets ([csv](tables/{task}_methods.csv))",
            METHODS_TEXT,
            part["methods_md"],
        )
        optional = (
            (
                "training_md",
                f"### Training: has every cell plateaued? ([csv](tables/{task}_training.csv))",
                TRAINING_TEXT,
            ),
            (
                "mse_md",
                f"### Reconstruction MSE per held-out set ([csv](tables/{task}_mse.csv))",
                MSE_TEXT,
            ),
            (
                "tracking_md",
                f"### Tracking against the simulator's positions ([csv](tables/{task}_tracking.csv))",
                TRACKING_TEXT,
            ),
            (
                "imputation_md",
                f"### Imputation of hidden entries ([csv](tables/{task}_imputation.csv))",
                imputation_text(task, part.get("imputation_set")),
            ),
            ("axes_md", "### Swept settings (grid entries' `axes`)", AXES_TEXT),
        )
        for key, heading, text in optional:
            if part.get(key):
                lines += _section(heading, text, part[key])
        for name, rel in part["figures"].items():
            lines += [
                f"### {name}",
                "",
                f"![{task} {name}]({rel})",
                "",
                f"{figure_text(task, name)} {part['caption']}.",
                "",
            ]
    return lines


RESULTS_START, RESULTS_END = "<!-- results:start -->", "<!-- results:end -->"


def reused_cells_markdown(parts: list[dict[str, Any]]) -> str:
    """A bold warning naming cells trained by other code (``sweep.reuse_across_code``)."""
    names = [c["name"] for p in parts for c in p.get("cells", []) if c.get("trained_by_other_code")]
    if not names:
        return ""
    return (
        f"**Reused across code changes: {len(names)} cell(s) were trained by other code than this "
        f"report's ({', '.join(names)}; `sweep.reuse_across_code: true`). Their numbers are not "
        "this code's results.**\n\n"
    )


def cells_training_seconds(meta: dict[str, Any]) -> float:
    """A sweep's training time on one trial slot: each cell's steps over its measured rate."""
    return sum(
        c["iterations"] / c["mean_it_per_s"] for c in meta["cells"] if c["iterations"] and c["mean_it_per_s"]
    )


def from_scratch_seconds(
    times: dict[str, float], training: dict[str, float], parallel: int
) -> dict[str, float]:
    """A from-scratch run's stages: each sweep as its cells' training over the trials run at
    once (``training``: seconds per sweep stage), the others as they last ran."""
    return {name: training[name] / parallel if name in training else s for name, s in times.items()}


def from_scratch_minutes(times: dict[str, float], training: dict[str, float], parallel: int) -> float:
    """The from-scratch estimate of the whole run (``from_scratch_seconds``), in minutes."""
    return sum(from_scratch_seconds(times, training, parallel).values()) / 60


def pipeline_time_markdown(
    times: dict[str, float],
    threads: int | None = None,
    training: dict[str, float] | None = None,
    parallel: int = 1,
    made_on: dict[str, Any] | None = None,
) -> str:
    """Wall time of each stage when it last ran (``results/timings``), a from-scratch
    estimate beside it (``training``: each sweep's cells' training seconds), and the machine
    the results were made on (``made_on``, a ``provenance.machine()``; default: this one)."""
    if not times:
        return ""
    scratch = from_scratch_seconds(times, training or {}, parallel)
    rows = "\n".join(
        f"| `{name}` | {seconds / 60:.1f} | {scratch[name] / 60:.1f} |" for name, seconds in times.items()
    )
    total = sum(times.values()) / 60
    per_trial = f"; {threads} torch thread{'s' if threads != 1 else ''} per trial" if threads else ""
    return (
        f"## {TIME_HEADING}\n\nWall time of each stage when it last ran (2 trials at once on a 2-core machine "
        "unless the params say otherwise; after a partial `dvc repro`, the stages it skipped keep "
        "the times of the run that made their outputs, and a sweep that trained some cells anew "
        "shows only their time; the report's own is its previous run's). From scratch: each "
        "sweep as every one of its cells' training time (its steps over the rate it measured), "
        f"summed and divided by the {parallel} trials run at once, without Ray's start-up (1-3 "
        "minutes a sweep); the other stages as they last ran.\n\n"
        "| stage | minutes (last run) | minutes (from scratch) |\n| --- | ---: | ---: |\n"
        f"{rows}\n| **sum** | **{total:.1f}** | **{sum(scratch.values()) / 60:.1f}** |\n\n"
        "Machine that trained and evaluated these results (a from-scratch `dvc repro` also writes "
        "the report there; a rebuild from the committed rows keeps this line; trained numbers "
        f"differ across CPUs): {provenance.machine_line(made_on or provenance.machine())}"
        f"{per_trial}.\n\n"
    )


def readme_results(
    claims: list[ClaimResult],
    times: dict[str, float],
    label: str,
    report_dir: str,
    replication: dict[str, ClaimResult] | None = None,
    training: dict[str, float] | None = None,
    parallel: int = 1,
) -> str:
    """The project README's results block from this run, a few lines: the verdict counts, the
    from-scratch time, and where to read on. The claims table itself lives in the report
    (``report_dir``: the report's folder relative to the README)."""
    page = f"{report_dir}/README.md"
    total = from_scratch_minutes(times, training or {}, parallel) if times else None
    took = (
        f" From scratch its stages take about {total:.0f} minutes in all "
        f"([the report's Time section]({page}#{heading_anchor(TIME_HEADING)}))."
        if total is not None
        else ""
    )
    tally = verdict_tally(claims)
    lines = [
        f"Written by the report stage of the run that made the committed [`{report_dir}/`]({page}) "
        f"({label}).{took}",
        "",
        f"- **{tally['held']} of the {tally['judged']} claims with a verdict hold** in this run.",
    ]
    if replication is not None:
        lines.append(
            f"- With the recorded replication [`{REPLICATION}`]({report_dir}/recorded/{REPLICATION}/README.md) "
            f"(training seeds moved by 100): **{verdict_count(claims, replication)}**."
        )
    far = sum(bool(c.departure) for c in claims)
    if far:
        lines.append(
            f"- {far} of the claims' numbers lie more than 2x from the paper's; the claims table flags "
            "each with its reason."
        )
    lines.append(
        f"- Every claim with its numbers, target and verdicts: [the report's claims table]"
        f"({page}#{heading_anchor(CLAIMS_HEADING)}); every table and figure, and each cell's training "
        f"curve and plateau check: [the report]({page})."
    )
    return "\n".join(lines) + "\n"


def write_readme_results(readme: Path, block: str) -> None:
    text = readme.read_text()
    start, end = text.index(RESULTS_START), text.index(RESULTS_END)
    new = text[: start + len(RESULTS_START)] + "\n" + block + text[end:]
    atomic_write(readme, lambda tmp: tmp.write_text(new))
