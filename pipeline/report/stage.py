"""The stage itself: ``make_report`` writes ``reports/`` (from ``results/eval`` or from the
committed rows), with every recorded run's own report; ``main`` is its command line.

The report is written into a copy of ``reports/`` beside it (``.reports.staging``) and
swapped in whole when done, so a report stage killed at any point leaves ``reports/`` as
the last complete report, never a mix of old and new files.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import seaborn as sns
import yaml

from apg.data import atomic_write
from pipeline.common import project_root
from pipeline.config.params import load_params
from pipeline.provenance import record as provenance
from pipeline.provenance import stages
from pipeline.recorded.files import GENERATIVE_ONLY, recorded_runs
from pipeline.report.claims import (
    claims_markdown,
    claims_not_run,
    replication_claims,
    replication_machine,
    replication_note,
)
from pipeline.report.data import (
    COMMITTED_DATA,
    FULL_METRICS,
    PAPER_NUMBERS,
    STAGE_TIMES,
    commit_rows,
    load_results,
)
from pipeline.report.headline import claims_json, headline_metrics
from pipeline.report.runs import runs_headline, runs_markdown
from pipeline.report.sections import (
    CLAIMS_HEADING,
    RESULTS_START,
    cells_training_seconds,
    index_markdown,
    pipeline_time_markdown,
    readme_results,
    report_task,
    reused_cells_markdown,
    task_sections,
    write_readme_results,
)
from pipeline.report.tracked import log_claims
from pipeline.statistics import MIN_SEEDS


def trials_at_once(sweep: dict[str, Any]) -> int:
    """How many CPU trials a sweep runs at once on this machine (``pipeline.sweep.stage``'s rule)."""
    cpus = sweep.get("num_cpus") or os.cpu_count() or 1
    parallel = max(int(cpus // max(sweep.get("cpus_per_trial", 1), 1e-9)), 1)
    return min(parallel, sweep["max_concurrent"]) if sweep.get("max_concurrent") else parallel


def make_report(params: dict[str, Any], root: Path, from_committed: bool = False) -> Path:
    """Write ``reports/`` from ``results/eval/<task>`` (keeping those rows in
    ``reports/data/``), or with ``from_committed`` from the rows kept there, by a clone
    that has trained nothing: the same tables, figures and verdicts, provenance untouched."""
    final = root / params.get("report", {}).get("out", "reports")
    with staged(final) as out:
        _write_report(params, root, out, final, from_committed)
    if from_committed and (root / ".dvc").is_dir() and final.is_relative_to(root):
        # DVC's record of the stage, as the rebuild left it (its rows and the continuing
        # runs it read, its code, its outputs): a clone's `dvc status` shows no change here.
        provenance.lock_inputs(root, only="report", paths=("recorded", final.relative_to(root).as_posix()))
    if not from_committed and params.get("tracking"):  # the claims beside the runs they judge
        log_claims(params, root, json.loads((final / "metrics.json").read_text()), final)
    return final


def _write_report(params: dict[str, Any], root: Path, out: Path, final: Path, from_committed: bool) -> None:
    """The report into ``out``, a staging copy of ``final`` (links and names say ``final``)."""
    cfg = params.get("report", {})
    fmt = cfg.get("figure_format", "png")
    label = cfg.get("scale", "CPU-sized")
    paper_all = yaml.safe_load(PAPER_NUMBERS.read_text())
    sns.set_theme(style="whitegrid", context="paper")
    data = out / COMMITTED_DATA
    parts = []
    for task in params["tasks"]:
        eval_dir = data / task if from_committed else root / "results" / "eval" / task
        results = load_results(eval_dir)
        if not from_committed:
            commit_rows(eval_dir, data / task)
        parts.append(report_task(task, results, paper_all.get(task), out, label, fmt))
    claims = [c for p in parts for c in p["claims"]]
    for task, section in paper_all.items():
        if task not in params["tasks"] and (section or {}).get("claims"):
            claims += claims_not_run(task, section["claims"], "not run (task not in this run)")
    unclaimed = [t for t in params["tasks"] if not (paper_all.get(t) or {}).get("claims")]
    flags = {cid: mark for p in parts for cid, mark in p["cell_flags"].items()}
    replication = replication_claims(root, params["tasks"], paper_all)
    # A rebuild from the committed rows names the machine that made them (its record's).
    record = out / provenance.RECORD
    made_on = json.loads(record.read_text()).get("machine") if from_committed and record.is_file() else None
    note = replication_note(
        provenance.machine_line(made_on or provenance.machine()), replication_machine(root)
    )
    claims_md = claims_markdown(claims, flags, unclaimed, replication, note)
    text = index_markdown(
        parts,
        label,
        claims_md,
        recorded_markdown(root, out, paper_all, fmt) + runs_markdown(root, out, paper_all, fmt),
    )
    if from_committed:
        times = json.loads((data / STAGE_TIMES).read_text()) if (data / STAGE_TIMES).is_file() else {}
    else:
        times = stages.stage_times(root)
        atomic_write(data / STAGE_TIMES, lambda tmp: tmp.write_text(json.dumps(times, indent=2) + "\n"))
    training = {
        f"sweep@{task}": cells_training_seconds(json.loads((data / task / "meta.json").read_text()))
        for task in params["tasks"]
    }
    parallel = trials_at_once(params.get("sweep", {}))
    lead = reused_cells_markdown(parts) + pipeline_time_markdown(
        times, params.get("sweep", {}).get("torch_threads"), training, parallel, made_on
    )
    text = text.replace(f"\n## {CLAIMS_HEADING}", f"\n{lead}## {CLAIMS_HEADING}", 1)
    atomic_write(out / "README.md", lambda tmp: tmp.write_text(text + "\n"))
    readme = root / "README.md"
    if readme.is_file() and RESULTS_START in readme.read_text():
        block = readme_results(
            claims,
            times,
            label,
            final.relative_to(root).as_posix(),
            replication,
            training,
            parallel,
        )
        write_readme_results(readme, block)
    full = {p["task"]: p["metrics"] for p in parts}
    full["claims"] = claims_json(claims)
    if replication is not None:
        full["replication_claims"] = claims_json(list(replication.values()))
    long_run = runs_headline(root, paper_all)
    if long_run:
        full["long_run"] = long_run
    for path, metrics in (
        (data / FULL_METRICS, full),
        (out / "metrics.json", headline_metrics(claims, replication, long_run)),
    ):
        payload = json.dumps(metrics, indent=2, sort_keys=True) + "\n"
        atomic_write(path, lambda tmp, payload=payload: tmp.write_text(payload))
    # What produced these results (code and params digests, commit): the CI check that
    # committed results are the checkout's own reads it (pipeline.provenance.record). A rebuild
    # from the committed rows trained and evaluated nothing: the record keeps what did, and
    # takes the report stage's own code (which did run) at this checkout's digests.
    if from_committed:
        recorded = provenance.refresh_report_inputs(params, root, out / provenance.RECORD)
        changed = provenance.changes(root, params, recorded) if recorded else []
        stale = provenance.stale_line(recorded, changed) if recorded and changed else None
        provenance.set_banner(out / "README.md", dict(provenance.BANNER_PLACES)["reports/README.md"], stale)
        if readme.is_file():
            provenance.set_banner(readme, dict(provenance.BANNER_PLACES)["README.md"], stale)
    else:
        from pipeline.provenance.numerics import numerics

        provenance.write_record(params, root, out, numerics(params))
        # These results are now the checkout's own: a stale line that an earlier
        # `provenance mark` put in the README goes (reports/README.md is written anew).
        if readme.is_file():
            provenance.set_banner(readme, dict(provenance.BANNER_PLACES)["README.md"], None)


@contextmanager
def staged(final: Path) -> Iterator[Path]:
    """A copy of ``final`` to write into, swapped in for it when the block ends without error.

    What a killed run left (a staging folder, or a complete old folder set aside by the
    fallback swap) is cleared first; an error leaves ``final`` untouched."""
    staging, old = (final.with_name(f".{final.name}.{kind}") for kind in ("staging", "old"))
    if old.is_dir() and not final.exists():
        os.rename(old, final)  # killed between the fallback's two renames
    for leftover in (staging, old):
        shutil.rmtree(leftover, ignore_errors=True)
    if final.is_dir():
        shutil.copytree(final, staging, symlinks=True)  # files of other stages (reports/tune) too
    else:
        staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not final.exists():
        os.rename(staging, final)
        return
    if not _exchange(staging, final):
        os.rename(final, old)  # a short window without ``final``; the next run restores ``old``
        os.rename(staging, final)
        staging = old
    shutil.rmtree(staging)  # now the previous report


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one step (Linux ``renameat2`` with ``RENAME_EXCHANGE``); ``False``
    where the system or the filesystem cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def recorded_parts(
    run_dir: Path, out: Path, root: Path, paper_all: dict[str, Any], fmt: str, label: str
) -> tuple[list[dict[str, Any]], list[Any]]:
    """A recorded run's report parts (``report_task`` per task, under ``out``) and the claims
    it can test."""
    params = yaml.safe_load((run_dir / "params.yaml").read_text())
    parts, claims = [], []
    for task in params["tasks"]:
        paper = paper_all.get(task) or {}
        paper = {**paper, "claims": (paper.get("claims") or []) + (paper.get("paper_scale_claims") or [])}
        part = report_task(task, load_results(run_dir / "eval" / task), paper, out, label, fmt)
        parts.append(part)
        # A run at another scale has other held-out sets and budgets: the claims it cannot
        # test (the CPU defaults' sets) are left out of its table, not listed as not run.
        claims += [c for c in part["claims"] if c.note != "not run"]
    return parts, claims


def recorded_about(run_dir: Path, manifest: dict[str, Any], parts: list[dict[str, Any]]) -> str:
    """Where a recorded run comes from: the commit and machine that trained it, whether the
    training code is still that code, its profile, and what a clone cannot re-check; links
    start with ``{up}``, the way from the page to the repository's root."""
    changed = [
        t
        for t, d in manifest["code_digest"].items()
        if stages.code_digest("sweep", t, stages.package_root()) != d
    ]
    code_today = f"**changed since** ({', '.join(changed)})" if changed else "the same"
    about = (
        f"Trained by commit `{manifest['commit']}` ({manifest.get('started', '?')} to "
        f"{manifest['finished']}, last run {manifest['wall_minutes_last_run']} min wall; "
        f"{manifest['machine']}). Training code today: {code_today}. "
        f"Profile `{manifest['profile']}` of `{manifest['base']}`; its params: "
        f"[`recorded/{run_dir.name}/params.yaml`]({{up}}recorded/{run_dir.name}/params.yaml)."
    )
    again = manifest.get("rerecorded") or {}
    if again:  # some tasks trained again since (apg-pipeline record --tasks)
        about += (
            " Re-recorded since: "
            + "; ".join(
                f"{task} by commit `{r['commit']}` (finished {r['finished']}; {r['machine']})"
                for task, r in again.items()
            )
            + "."
        )
    partial = [
        c["name"]
        for part in parts
        for c in part.get("cells", [])
        if Path(c["checkpoint"]).name == GENERATIVE_ONLY
    ]
    if partial:  # weights too large for git: the proposals were left out
        about += (
            f" Not re-checkable from a clone: {len(partial)} of its cells ({', '.join(f'`{n}`' for n in partial)}) "
            "keep their generative model's weights alone (their proposals were over the size kept in git), "
            "so their numbers are those their evaluation recorded and cannot be recomputed."
        )
    start = manifest.get("starts_from")
    if start:  # a curriculum's later step: its training continues another run's
        about += (
            f" A curriculum's later step: every cell started from the weights of the same method, K, L "
            f"and seed in the recorded run [`{start['profile']}`]({{up}}reports/recorded/{start['profile']}/README.md) "
            f"(commit `{start['commit']}`; checkpoints' sha256 in the manifest), so its training is "
            f"on top of that run's."
        )
    return about


def recorded_markdown(root: Path, out: Path, paper_all: dict[str, Any], fmt: str) -> str:
    """Each recorded run (``apg-pipeline record``, results kept in ``recorded/``): its own
    report under ``reports/recorded/<name>/``, and here its Table 1 beside the paper's, labelled
    with its scale and the commit that trained it. Nothing is retrained."""
    runs = recorded_runs(root)
    if not runs:
        return ""
    lines = [
        "## Recorded runs at other scales",
        "",
        "Runs too long for `dvc repro` (`apg-pipeline record <profile>`, `pipeline/recorded/record.py`): "
        "their evaluation results and trained weights are kept in `recorded/` and this stage "
        "rebuilds their tables and figures from them. Each names the commit whose code trained it; "
        "`training code today` says whether the training code (the sweep stage's code digest) is "
        "still that code.",
        "",
    ]
    for run_dir, manifest in runs:
        sub = out / "recorded" / run_dir.name
        label = manifest["scale"]
        parts, claims = recorded_parts(run_dir, sub, root, paper_all, fmt, label)
        flags = {cid: mark for p in parts for cid, mark in p["cell_flags"].items()}
        claims_md = claims_markdown(claims, flags, [])
        about = recorded_about(run_dir, manifest, parts)
        body = [
            f"# Recorded run `{run_dir.name}`: {label}",
            "",
            about.replace("{up}", "../../../"),
            "",
            "## Claims of the paper, checked at this scale",
            "",
            claims_md,
            "",
            *task_sections(parts),
        ]
        page = "\n".join(body) + "\n"
        atomic_write(sub / "README.md", lambda tmp, page=page: tmp.write_text(page))
        lines += [
            f"### [`{run_dir.name}`](recorded/{run_dir.name}/README.md): {label}",
            "",
            about.replace("{up}", "../"),
            "",
        ]
        for part in parts:
            lines += [f"Table 1, {part['task']} ({part['caption']}):", "", part["table_md"], ""]
        held = [c for c in claims if c.passed is not None]
        verdicts = (
            f"{sum(bool(c.passed) for c in held)} of its {len(held)} claims with a verdict hold"
            if held
            else f"None of its {len(claims)} claims has a verdict (each rests on fewer than {MIN_SEEDS} seeds)"
        )
        lines += [f"{verdicts} ([its report](recorded/{run_dir.name}/README.md)).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="apg-pipeline report", description="regenerate reports/ from recorded results"
    )
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument(
        "--from-committed",
        action="store_true",
        help="rebuild from the evaluation rows kept in reports/data/ (a clone: nothing trained or evaluated)",
    )
    args = parser.parse_args(argv)
    from pipeline.errors import run_guarded

    def work() -> None:
        start = time.monotonic()
        root = project_root()
        out = make_report(load_params(args.params), root, from_committed=args.from_committed)
        if not args.from_committed:  # its time shows in the next report's table, and in smoke's
            stages.record_stage_time(root, "report", None, time.monotonic() - start)
        print(f"wrote {out}/README.md")

    run_guarded(work)
