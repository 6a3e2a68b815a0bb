"""What a fresh clone meets, run as the README gives it: ``apg-pipeline preview`` lists the
stages whose results are absent and no changed one, and ``apg-pipeline report
--from-committed`` rebuilds the report without changing a byte that git tracks (the
committed report, its provenance record and ``dvc.lock`` are the committed code's own)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    where = tmp_path_factory.mktemp("clone") / "apg"
    subprocess.run(["git", "clone", "-q", str(REPO), str(where)], check=True)
    return where


def cli(clone, *args: str) -> subprocess.CompletedProcess:
    # The clone's own code, whatever checkout the package is installed from.
    env = {**os.environ, "PYTHONPATH": str(clone), "OMP_NUM_THREADS": "1"}
    env.pop("APG_PROJECT_ROOT", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], cwd=clone, env=env, capture_output=True, text=True
    )


def test_a_clone_previews_absent_results_and_no_changed_stage(clone):
    proc = cli(clone, "preview")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("dvc repro would run ")
    changed = [line for line in lines[1:] if " changed" in line or " new" in line]
    assert not changed, changed


def test_a_clone_rebuilds_the_committed_report_byte_for_byte(clone):
    proc = cli(clone, "report", "--from-committed")
    assert proc.returncode == 0, proc.stderr[-2000:]
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True)
    assert status.stdout == "", status.stdout
