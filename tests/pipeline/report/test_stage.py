"""The report stage on synthetic results: what it writes (claims table, headline metrics, training
and method tables, figures), a rebuild from the committed rows, a write killed midway, a
recorded replication's column, the stale line and the time table.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from pipeline import report
from pipeline.provenance import record as provenance
from tests.pipeline.report.synthetic import write_results
from tests.support import REPO


def test_report_opens_with_the_claims_table(synthetic_report):
    text = (synthetic_report / "README.md").read_text()
    lines = text.splitlines()
    assert lines[0] == "# Reproduction report"
    body = [line for line in lines[1:] if line and not line.startswith("<!--") and not line.startswith(">")]
    assert body[0].startswith("**Scale: synthetic.**")
    assert body[1] == "## Claims of the paper, checked"
    claims = [line for line in lines if line.startswith("| gmm |")]
    claim_ids = yaml.safe_load(report.PAPER_NUMBERS.read_text())["gmm"]["claims"]
    assert len(claims) == len(claim_ids)
    verdicts = [line.rstrip(" |").split("| ")[-1].strip() for line in claims]
    assert set(verdicts) <= {"✓", "✗", "–", "not run"}, verdicts
    lstm = next(line for line in claims if "RWS LSTM" in line)
    assert lstm.endswith("| not run |")  # no rws-lstm cells in these results
    # tasks not run: their claims are listed as not run; bmnist has none yet
    assert "| dgmm |" in text and "not run (task not in this run)" in text
    assert "Verdict rules:" in text

    metrics = json.loads((synthetic_report / "data" / report.FULL_METRICS).read_text())
    checked = metrics["claims"]
    assert checked["gmm/apg_ess_globals"]["pass"] is True
    assert checked["gmm/apg_log_joint_above_rws_mlp"]["pass"] is True
    assert checked["gmm/apg_kl_c"]["pass"] is True
    assert checked["gmm/apg_ari_vs_gibbs_stationary"]["pass"] is True  # both ARIs drawn from U(0.8, 0.9)
    budget = checked["gmm/apg_budget_more_sweeps"]
    assert len(budget["value"]) == 3 and budget["pass"] is True
    assert checked["dgmm/apg_ess_mu_with_K"]["pass"] is None


def test_metrics_json_is_a_short_headline_of_the_verdicts(synthetic_report):
    # `dvc metrics show` prints one column per number: metrics.json keeps a verdict per claim
    # and the counts, the long form sits in data/ where DVC does not read it as a metric.
    headline = json.loads((synthetic_report / "metrics.json").read_text())
    full = json.loads((synthetic_report / "data" / report.FULL_METRICS).read_text())["claims"]

    def leaves(node, prefix=""):
        for key, value in node.items():
            assert "." not in key and "/" not in key, key  # DVC joins nested keys with "."
            yield from (
                leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]
            )

    flat = dict(leaves(headline))
    assert len(flat) <= 50
    for key, claim in full.items():
        task, claim_id = key.split("/")
        assert flat[f"{task}.{claim_id}"] == (None if claim["pass"] is None else int(claim["pass"])), key
    judged = [c for c in full.values() if c["pass"] is not None]
    assert headline["claims"] == {
        "held": sum(c["pass"] for c in judged),
        "judged": len(judged),
        "total": len(full),
    }


def test_training_table_flags_cells_that_have_not_plateaued(synthetic_report):
    table = pd.read_csv(synthetic_report / "tables" / "gmm_training.csv")
    assert len(table) == 15
    verdicts = dict(zip(table["cell_id"], table["plateaued"], strict=True))
    assert verdicts["rws-mlp-K5-L10-s0"] == "no"
    assert verdicts["gibbs-K5-L10-s0"] == "not trained"
    assert verdicts["apg-K5-L10-s1"] == "yes"
    md = (synthetic_report / "tables" / "gmm_training.md").read_text()
    assert "| `gmm/rws-mlp/K5/L10/seed0` |" in md and "no †" in md

    # Rows from the not-plateaued cell carry the mark, with its footnote, and only those.
    table1 = (synthetic_report / "tables" / "gmm_table1.md").read_text()
    assert "| rws-mlp † | 10 | 10 |" in table1 and "| apg | 10 | 10 |" in table1
    assert (
        "† not plateaued (the cell's own trend, or its seeds' pooled trend): see the training table" in table1
    )
    methods = pd.read_csv(synthetic_report / "tables" / "gmm_methods.csv")
    assert set(methods[methods["flag"].fillna("") == "†"]["method"]) == {"rws-mlp"}
    readme = (synthetic_report / "README.md").read_text()
    claim = next(line for line in readme.splitlines() if "beats the RWS MLP" in line)
    assert "†" in claim


def test_tables_use_main_cells_and_the_budget_figure_exists(synthetic_report):
    table1 = pd.read_csv(synthetic_report / "tables" / "gmm_table1.csv")
    # the APG row at (10, 5) of Table 1's pairs is absent: (10, 5) is only a budget pair,
    # and the retrained (10, 5) cells do not enter Table 1
    assert sorted(set(zip(table1["method"], table1["K"], strict=True))) == [
        (method, k) for method in ("apg", "gibbs", "rws-mlp") for k in (5, 10, 15, 50)
    ]
    assert {"ari", "ari_ceiling"} <= set(table1.columns)
    methods = pd.read_csv(synthetic_report / "tables" / "gmm_methods.csv")
    apg = methods[(methods["method"] == "apg") & (methods["K"] == 10)]
    assert apg["cells"].str.contains("K5-L10").all() and not apg["cells"].str.contains("K10-L5").any()
    for name in ("gmm_budget.png", "gmm_training.png"):
        assert (synthetic_report / "figures" / name).stat().st_size > 10_000


@pytest.mark.slow
def test_a_clone_rebuilds_the_report_from_the_committed_rows(synthetic_report):
    # The report keeps the rows it read in reports/data/; with results/ gone (a clone that
    # trained nothing) --from-committed writes the same verdicts, tables and README, and
    # leaves the provenance record's account of what trained and evaluated as it was.
    root = synthetic_report.parent
    assert (synthetic_report / "data" / "gmm" / "metrics.parquet").is_file()
    before = {
        name: (synthetic_report / name).read_text()
        for name in ("README.md", "metrics.json", f"data/{report.FULL_METRICS}", "provenance.json")
    }
    tables = {p.name: p.read_text() for p in (synthetic_report / "tables").glob("*.csv")}
    shutil.rmtree(root / "results")
    recorded = {"commit": "abc", "code": {}, "params": {}, "fingerprints": {"gmm": {"c": {"cell_id": "c-1"}}}}
    (synthetic_report / "provenance.json").write_text(json.dumps(recorded))
    report.make_report(
        {"tasks": ["gmm"], "report": {"out": "reports", "figure_format": "png", "scale": "synthetic"}},
        root,
        from_committed=True,
    )
    for name in ("metrics.json", f"data/{report.FULL_METRICS}"):
        assert (synthetic_report / name).read_text() == before[name], name
    assert (synthetic_report / "README.md").read_text() == before["README.md"]
    assert {p.name: p.read_text() for p in (synthetic_report / "tables").glob("*.csv")} == tables
    after = json.loads((synthetic_report / "provenance.json").read_text())
    assert {k: after[k] for k in recorded} == recorded and "report_commit" not in after
    # Rebuilt again in a checkout at a commit (the one the first rebuild would go into), the
    # same rows give the same bytes, figures included: the report names no commit of its own,
    # no time and no matplotlib version, so an unchanged report adds nothing to git.
    rebuilt = files_of(synthetic_report)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"]
    subprocess.run(git, cwd=root, check=True)
    report.make_report(
        {"tasks": ["gmm"], "report": {"out": "reports", "figure_format": "png", "scale": "synthetic"}},
        root,
        from_committed=True,
    )
    assert files_of(synthetic_report) == rebuilt


def files_of(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by its relative path, with its sha256 (files moved or
    replaced while it reads are left out)."""
    found = {}
    for p in sorted(folder.rglob("*")):
        try:
            if p.is_file():
                found[p.relative_to(folder).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
        except FileNotFoundError:
            continue
    return found


def differs(folder: Path, old: dict[str, str]) -> bool:
    """Whether a file under ``folder`` is not in ``old`` or not as it was there."""
    return any(old.get(name) != digest for name, digest in files_of(folder).items())


@pytest.mark.slow
def test_a_report_killed_mid_write_leaves_the_last_complete_report(synthetic_report, tiny):
    root = synthetic_report.parent
    (root / "params.yaml").write_text(yaml.safe_dump(tiny(**{"report.scale": "synthetic"})))
    rows = synthetic_report / "data" / "gmm" / "metrics.parquet"
    frame = pd.read_parquet(rows)
    frame.loc[frame["metric"] == "log_joint", "value"] += 1.0  # so the next report differs
    frame.to_parquet(rows, index=False)
    old = files_of(synthetic_report)
    staging = root / ".reports.staging"
    cmd = [sys.executable, "-m", "pipeline.report", "--from-committed"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Killed at the first changed file, wherever it is written (reports/ itself, were the
        # files written in place; long before the swap when they are staged).
        while proc.poll() is None and not (differs(staging, old) or differs(synthetic_report, old)):
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # as the machine going down would
        assert proc.wait(timeout=60) == -signal.SIGKILL, "the report finished before it could be killed"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert files_of(synthetic_report) == old  # the last complete report, every file of it

    subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True, timeout=600)
    new = files_of(synthetic_report)
    assert new.keys() == old.keys() and new["data/gmm/metrics.parquet"] == old["data/gmm/metrics.parquet"]
    assert new["README.md"] != old["README.md"] and not staging.exists()


def test_a_recorded_replication_adds_its_verdicts_and_counts_claims_holding_in_both(tmp_path):
    # The replication here is the same rows with RWS-MLP's log joint raised above APG's:
    # that claim holds in the main run and fails in the replication, so it drops out of the
    # count of claims holding in both runs.
    write_results(tmp_path, with_training_trend=False)
    run = tmp_path / "recorded" / "replicate"
    shutil.copytree(tmp_path / "results" / "eval" / "gmm", run / "eval" / "gmm")
    metrics = pd.read_parquet(run / "eval" / "gmm" / "metrics.parquet")
    raised = (metrics["method"] == "rws-mlp") & (metrics["metric"] == "log_joint")
    metrics.loc[raised, "value"] += 100.0
    metrics.to_parquet(run / "eval" / "gmm" / "metrics.parquet", index=False)
    (run / "params.yaml").write_text(
        yaml.safe_dump({"tasks": ["gmm"], "report": {"scale": "synthetic replication"}})
    )
    manifest = {
        "commit": "abc",
        "started": "s",
        "finished": "f",
        "wall_minutes_last_run": 1.0,
        "machine": "Other CPU (avx2), 2 cores; torch 2.13.0+cpu",
        "code_digest": {},
        "profile": "replicate",
        "base": "params.yaml",
        "scale": "synthetic replication",
    }
    (run / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "README.md").write_text("# x\n\n## Results\n\n<!-- results:start -->\n<!-- results:end -->\n")
    params = {"tasks": ["gmm"], "report": {"out": "reports", "figure_format": "png", "scale": "synthetic"}}
    torch.set_num_threads(1)
    report.make_report(params, tmp_path)
    text = (tmp_path / "reports" / "README.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| task | claim"))
    assert header.endswith("| ✓/✗ [`replicate`](recorded/replicate/README.md) |")
    row = next(
        line
        for line in text.splitlines()
        if line.startswith("| gmm |") and "RWS MLP encoder at the same" in line
    )
    assert row.endswith("| ✓ | ✗ |")
    # The note under the table names both runs' machines and whether their CPU types differ.
    this = provenance.machine_line(provenance.machine())
    assert "trained on a different CPU type: Other CPU (avx2), 2 cores; torch 2.13.0+cpu." in text
    assert f"This run: {this}." in text
    written = json.loads((tmp_path / "reports" / "data" / report.FULL_METRICS).read_text())
    main, again = written["claims"], written["replication_claims"]
    assert main["gmm/apg_log_joint_above_rws_mlp"]["pass"] is True
    assert again["gmm/apg_log_joint_above_rws_mlp"]["pass"] is False
    both = [k for k in main if main[k]["pass"] is not None and again.get(k, {}).get("pass") is not None]
    held = sum(main[k]["pass"] and again[k]["pass"] for k in both)
    headline = json.loads((tmp_path / "reports" / "metrics.json").read_text())["claims"]
    assert (headline["held_both"], headline["judged_both"]) == (held, len(both))
    readme = (tmp_path / "README.md").read_text()
    assert f"{held} of the {len(both)} claims with a verdict in both runs hold in both" in readme
    assert f"{headline['held']} of the {headline['judged']} claims with a verdict hold" in readme
    assert "](reports/recorded/replicate/README.md)" in readme
    # The README's block is a few lines: the claims table stays in the report, which it links
    # at the table's heading.
    assert "| task | claim" not in readme
    assert "](reports/README.md#claims-of-the-paper-checked)" in readme
    assert "\n## Claims of the paper, checked\n" in text


def test_the_replication_note_says_whether_the_two_cpu_types_differ():
    from pipeline.report.claims import replication_note

    xeon = "Intel(R) Xeon(R) Processor (avx512f, avx2), 2 cores; torch 2.13.0+cpu, Python 3.11.7"
    epyc = "AMD EPYC (avx2, fma), 2 cores; torch 2.13.0+cpu, Python 3.11.7"
    assert f"trained on the same CPU type: {xeon}. This run: {xeon}." in replication_note(xeon, xeon)
    assert f"trained on a different CPU type: {xeon}. This run: {epyc}." in replication_note(epyc, xeon)
    assert "its machine is named in its report" in replication_note(epyc, None)


def test_the_report_stage_clears_a_stale_line_in_the_readme(tmp_path):
    # `provenance mark` left the results marked stale; the report stage then made them anew
    # from this code, so the README's stale line goes (a from-committed rebuild keeps it
    # while code that trains or evaluates differs from the record's).
    write_results(tmp_path, with_training_trend=False)
    stale = "**Stale since abc:** `apg/x.py` changed after these results were made."
    (tmp_path / "README.md").write_text(
        "# x\n\n## Results\n\n<!-- provenance:stale -->\n> " + stale + "\n<!-- /provenance:stale -->\n\n"
        "<!-- results:start -->\n<!-- results:end -->\n"
    )
    params = {"tasks": ["gmm"], "report": {"out": "reports", "figure_format": "png", "scale": "synthetic"}}
    torch.set_num_threads(1)
    report.make_report(params, tmp_path)
    readme = (tmp_path / "README.md").read_text()
    assert "provenance:stale" not in readme and stale not in readme
    assert readme.startswith("# x\n\n## Results\n\n<!-- results:start -->")


def test_the_time_table_estimates_a_from_scratch_run_from_every_cells_training():
    from pipeline.report.sections import cells_training_seconds, from_scratch_minutes, pipeline_time_markdown

    meta = {"cells": [{"iterations": 600, "mean_it_per_s": 10.0}, {"iterations": 0, "mean_it_per_s": 0.0}]}
    assert cells_training_seconds(meta) == 60.0
    # The sweep last trained one new cell (6 s); from scratch its cells take 240 s on 2 slots.
    times = {"sweep@gmm": 6.0, "evaluate@gmm": 60.0}
    training = {"sweep@gmm": 240.0}
    assert from_scratch_minutes(times, training, 2) == (120.0 + 60.0) / 60
    table = pipeline_time_markdown(times, 1, training, 2)
    assert "| `sweep@gmm` | 0.1 | 2.0 |" in table and "| `evaluate@gmm` | 1.0 | 1.0 |" in table
    assert "| **sum** | **1.1** | **3.0** |" in table and "divided by the 2 trials run at once" in table
    other = {"cpu": "Some CPU", "vector": ["avx2"], "cores": 64, "torch": "2.13.0", "python": "3.11.7"}
    named = pipeline_time_markdown(times, 1, training, 2, made_on=other)  # a rebuild: the record's machine
    assert "Machine that trained and evaluated these results" in named
    assert "trained numbers differ across CPUs): Some CPU (avx2), 64 cores; torch 2.13.0" in named
