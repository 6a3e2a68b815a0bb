"""What a fresh clone meets, run as the README gives it: ``apg-pipeline preview`` lists the
stages whose results are absent and no changed one, ``apg-pipeline report --from-committed``
rebuilds the report without changing a byte that git tracks (the committed report, its
provenance record and ``dvc.lock`` are the committed code's own), and every command that
tests/doc_commands.py says is run in a clone runs there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.doc_commands import RUN
from tests.support import MNIST_DIR, REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    where = tmp_path_factory.mktemp("clone") / "apg"
    subprocess.run(["git", "clone", "-q", str(REPO), str(where)], check=True)
    return where


def clone_env(clone) -> dict[str, str]:
    # The clone's own code, whatever checkout the package is installed from.
    env = {**os.environ, "PYTHONPATH": str(clone), "OMP_NUM_THREADS": "1"}
    env.pop("APG_PROJECT_ROOT", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def cli(clone, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=clone,
        env=clone_env(clone),
        capture_output=True,
        text=True,
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


def tracked_changes(clone) -> str:
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=clone, capture_output=True, text=True
    ).stdout


def test_the_docs_commands_run_in_a_clone_and_change_no_tracked_file(clone, tmp_path):
    failed = []
    for doc, line in RUN.items():
        if line.startswith("test_clone.py::") or ("{mnist}" in line and MNIST_DIR is None):
            continue
        command = line.replace("{clone}", str(clone)).replace("{tmp}", str(tmp_path))
        command = command.replace("{mnist}", str(MNIST_DIR))
        proc = subprocess.run(
            ["bash", "-c", command], cwd=clone, env=clone_env(clone), capture_output=True, text=True
        )
        if proc.returncode != 0:
            failed.append(f"{doc}\n  ran: {command}\n  exit {proc.returncode}: {proc.stderr[-1500:]}")
        # dvc repro generate@gmm, the last, records this CPU's GMM data (tests/doc_commands.py)
        elif doc != "dvc repro generate@gmm" and tracked_changes(clone):
            failed.append(f"{doc}\n  changed tracked files: {tracked_changes(clone)}")
    # The clone as it was made, for the module's other tests.
    subprocess.run(["git", "checkout", "-q", "--", "."], cwd=clone, check=True)
    subprocess.run(["git", "clean", "-fdqx"], cwd=clone, check=True)
    assert not failed, "\n".join(failed)
