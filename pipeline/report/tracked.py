"""The report's verdicts as one MLflow run, beside the sweeps' runs: a metric per claim.

The run (``claims``, tag ``apg.stage=report``) holds each claim's verdict as a metric
(``claim.<task>.<claim id>``: 1 holds, 0 fails; a claim without a verdict is left out), the
counts (``claims.held``, ``claims.judged``...) and the report itself as artifacts
(``README.md``, ``metrics.json``); the stage prints the run page's address (``browse the
claims: ...``). Best effort, as the evaluation's numbers are: the files of
``reports/`` are the record, and a tracking store that cannot be written leaves a note.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config.checks import first_line

CLAIMS_RUN = "claims"


def claim_metrics(headline: dict[str, Any]) -> dict[str, float]:
    """``reports/metrics.json``'s verdicts and counts as MLflow metrics."""
    out = {f"claims.{key}": float(value) for key, value in headline.get("claims", {}).items()}
    for task, verdicts in headline.items():
        if task in ("claims", "long_run") or not isinstance(verdicts, dict):
            continue
        out.update({f"claim.{task}.{cid}": float(v) for cid, v in verdicts.items() if v is not None})
    return out


def log_claims(params: dict[str, Any], root: Path, headline: dict[str, Any], report_dir: Path) -> str | None:
    """Log the report's claims run; its id, or None (with a note) when the store refused."""
    try:
        from pipeline import tracking

        uri = tracking.tracking_uri(root)
        client = tracking.client(uri)
        exp = tracking.experiment_id(
            client, tracking.experiment_name(params), tracking.artifact_location(root)
        )
        run = client.create_run(exp, run_name=CLAIMS_RUN, tags=tracking.source_tags(root, "report", params))
        run_id = run.info.run_id
        tracking.log_metrics(client, run_id, [(0, claim_metrics(headline))])
        for name in ("README.md", "metrics.json"):
            if (report_dir / name).is_file():
                client.log_artifact(run_id, str(report_dir / name))
        tracking.finish(client, run_id)
        print(tracking.browse_hint(uri, exp, run_id, "the claims"))
        return run_id
    except Exception as err:  # noqa: BLE001 - the report's files are the record; MLflow's copy is best effort
        print(f"note: the claims were not logged to MLflow ({type(err).__name__}: {first_line(err)})")
        return None
