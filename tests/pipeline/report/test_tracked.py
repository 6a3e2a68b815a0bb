"""The report's claims as one MLflow run (pipeline.report.tracked)."""

from __future__ import annotations

import json

import pytest

from pipeline.report.tracked import claim_metrics, log_claims

HEADLINE = {
    "claims": {"held": 2, "judged": 3, "total": 4},
    "gmm": {"apg_kl_c": 1, "apg_ess_c": 0, "apg_none": None},
    "long_run": {"claims_held": 1, "claims_judged": 2, "reach": {"T10_D3": "within reach"}},
}


def test_each_verdict_and_count_is_a_metric_and_no_verdict_is_none():
    assert claim_metrics(HEADLINE) == {
        "claims.held": 2.0,
        "claims.judged": 3.0,
        "claims.total": 4.0,
        "claim.gmm.apg_kl_c": 1.0,
        "claim.gmm.apg_ess_c": 0.0,
    }


@pytest.mark.slow
def test_the_claims_run_holds_the_verdicts_and_the_report(tmp_path, monkeypatch, capsys):
    from pipeline import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "README.md").write_text("# Reproduction report\n")
    (reports / "metrics.json").write_text(json.dumps(HEADLINE))
    run_id = log_claims({"tracking": {"experiment": "apg"}}, tmp_path, HEADLINE, reports)
    assert run_id is not None
    client = tracking.client(tracking.tracking_uri(tmp_path))
    run = client.get_run(run_id)
    assert run.info.run_name == "claims" and run.data.tags[tracking.TAG_STAGE] == "report"
    assert run.data.metrics == claim_metrics(HEADLINE)
    assert {a.path for a in client.list_artifacts(run_id)} == {"README.md", "metrics.json"}
    # ... and the stage says where its page is (tests/pipeline/test_cluster.py opens it)
    exp = run.info.experiment_id
    assert (
        capsys.readouterr().out
        == tracking.browse_hint(tracking.tracking_uri(tmp_path), exp, run_id, "the claims") + "\n"
    )
