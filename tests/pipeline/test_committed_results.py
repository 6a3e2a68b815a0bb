"""The committed results recompute from a clone: every verdict of reports/metrics.json (and
of its long form reports/data/metrics-full.json) follows from the evaluation rows kept in
reports/data/ (issue: verdicts a reviewer can
re-check without retraining). Fast: the claims only, no figures."""

from __future__ import annotations

import json

import pytest
import yaml

from pipeline import report
from pipeline.config.params import load_params
from pipeline.provenance import record as provenance
from pipeline.report.training import training_table
from tests.support import REPO

DATA = REPO / "reports" / report.COMMITTED_DATA


@pytest.mark.slow
def test_every_committed_verdict_recomputes_from_the_committed_rows():
    if not DATA.is_dir() and provenance.current_banners(REPO).get("README.md"):
        pytest.skip(
            "the committed results are marked stale and keep no rows yet: the next report stage writes them"
        )
    params = load_params(REPO / "params.yaml")
    paper_all = yaml.safe_load(report.PAPER_NUMBERS.read_text())
    committed = json.loads((DATA / report.FULL_METRICS).read_text())["claims"]
    headline = json.loads((REPO / "reports" / "metrics.json").read_text())
    recomputed = {}
    for task in params["tasks"]:
        assert (DATA / task / "metrics.parquet").is_file(), (
            f"reports/data/{task} is missing: run the report stage"
        )
        results = report.load_results(DATA / task)
        recomputed.update(report.claims_json(report.task_claims(task, results, paper_all.get(task))))
    assert set(recomputed) == {key for key in committed if key.split("/")[0] in params["tasks"]}
    for key, claim in recomputed.items():
        assert claim["pass"] == committed[key]["pass"] and claim["note"] == committed[key]["note"], key
        assert json.dumps(claim["value"]) == json.dumps(committed[key]["value"]) or claim[
            "value"
        ] == pytest.approx(committed[key]["value"], rel=1e-12, nan_ok=True), key
        task, claim_id = key.split("/")
        assert headline[task][claim_id] == (None if claim["pass"] is None else int(claim["pass"])), key


def committed_training_tables():
    """``(rows folder, committed table)`` of every training table the report rebuilds from
    committed rows: the default run's (``reports/data/<task>``) and each recorded run's."""
    found = []
    for path in sorted((REPO / "reports" / "tables").glob("*_training.csv")):
        found.append((DATA / path.name.removesuffix("_training.csv"), path))
    for path in sorted((REPO / "reports" / "recorded").glob("*/tables/*_training.csv")):
        run, task = path.parent.parent.name, path.name.removesuffix("_training.csv")
        found.append((REPO / "recorded" / run / "eval" / task, path))
    return [(rows, table) for rows, table in found if (rows / "training.parquet").is_file()]


@pytest.mark.parametrize(
    "rows,table", committed_training_tables(), ids=lambda p: p.relative_to(REPO).as_posix()
)
def test_committed_training_tables_recompute_to_the_same_bytes(rows, table):
    # The plateau columns are sums of floats: summed in an order the CPU picks (BLAS), their
    # last bit changed with the machine that rebuilt the report, and so did the committed
    # file. Correctly rounded sums give one answer; a rebuild anywhere leaves the file as is.
    results = report.load_results(rows)
    assert training_table(results["training"], results["meta"]).to_csv(index=False) == table.read_text()


def test_dvc_metrics_show_is_a_table_a_terminal_shows():
    """`dvc metrics show` prints every value of reports/metrics.json: at most 60 of them."""
    from pipeline.report.headline import HEADLINE_NUMBERS, count_numbers

    headline = json.loads((REPO / "reports" / "metrics.json").read_text())
    assert count_numbers(headline) <= HEADLINE_NUMBERS
