"""What a trial's process sets up (pipeline/runs/trial.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO

# Objects whose finalizers raise: Python cannot raise from there and hands the exception to
# sys.unraisablehook, as it does Ray's SystemExit when Tune stops a trial mid-collection.
FINALIZERS = """
from pipeline.runs.trial import quiet_trial_process
{setup}
class Raises:
    def __init__(self, error):
        self.error = error
    def __del__(self):
        raise self.error
Raises(SystemExit(1))
Raises(ValueError("still shown"))
"""


def run(setup: str) -> subprocess.CompletedProcess:
    code = FINALIZERS.format(setup=setup)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_stopped_trial_prints_no_traceback_and_other_errors_still_show():
    plain = run("")
    assert "SystemExit: 1" in plain.stderr  # what a stopped trial printed before
    quiet = run("quiet_trial_process()")
    assert quiet.returncode == 0
    assert "SystemExit" not in quiet.stderr
    assert "ValueError: still shown" in quiet.stderr
