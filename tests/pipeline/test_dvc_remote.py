"""Results shared through a DVC remote, with this project's own ``dvc.yaml``: what ``dvc push``
sends, what a fresh clone gets from git and from ``dvc pull``, and what ``dvc repro`` then
runs (docs/reproduce.md, "Results through DVC").

The real stages would train for hours, so every stage's command is replaced by a stand-in
that writes the stage's outputs; the outs, their ``cache``/``persist`` flags, the deps on
other stages' outputs and the params are the project's, so a change to what DVC caches (and
so pushes) shows here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import REPO

TASK = "gmm"

# Writes each path it is given: a file where the name has a suffix (JSON where it ends in
# .json, so `dvc metrics` reads it), else a folder holding one file. The content depends on
# the path alone, so a stage run twice writes the same bytes.
STAND_IN = """\
import json, pathlib, sys
for name in sys.argv[1:]:
    path = pathlib.Path(name)
    if path.suffix:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"stand_in": 1}) if path.suffix == ".json" else name + "\\n")
    else:
        path.mkdir(parents=True, exist_ok=True)
        (path / "stand_in.txt").write_text(name + "\\n")
"""


def _out_path(entry: Any) -> str:
    return entry if isinstance(entry, str) else next(iter(entry))


def stand_in_stages(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` (a parsed dvc.yaml) with each stage's command replaced by the stand-in that
    writes its outs and metrics, and its deps cut to those on other stages' outputs (the
    code is not copied)."""
    stages = {}
    bodies = {name: stage.get("do", stage) for name, stage in spec["stages"].items()}
    outs = [_out_path(o) for body in bodies.values() for o in body.get("outs", []) + body.get("metrics", [])]
    deps = [d for body in bodies.values() for d in body.get("deps", [])]

    def produced(dep: str) -> bool:
        return any(dep == o or dep.startswith(o + "/") or o.startswith(dep + "/") for o in outs)

    for name, stage in spec["stages"].items():
        body = dict(bodies[name])
        written = [_out_path(o) for o in body.get("outs", []) + body.get("metrics", [])]
        # a later stage may read one file of a folder this stage writes (data/<task>/train.npz)
        written += [d for d in deps if any(d.startswith(o + "/") for o in written)]
        body["cmd"] = " ".join([sys.executable, "stand_in.py", *written])
        body["deps"] = ["stand_in.py", *(d for d in body.get("deps", []) if produced(d))]
        stages[name] = {**stage, "do": body} if "do" in stage else body
    return {"stages": stages}


def run(cmd: list[str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def commit(cwd: Path, message: str) -> None:
    run(["git", "add", "-A"], cwd)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qm", message], cwd)


@pytest.mark.slow
def test_a_clone_pulls_the_cached_outputs_and_reruns_only_the_sweep_storage(tmp_path):
    if shutil.which("dvc") is None:
        pytest.skip("dvc is not installed")
    origin, clone, remote = tmp_path / "origin", tmp_path / "clone", tmp_path / "remote"
    origin.mkdir()
    spec = yaml.safe_load((REPO / "dvc.yaml").read_text())
    (origin / "dvc.yaml").write_text(yaml.safe_dump(stand_in_stages(spec), sort_keys=False))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    (origin / "params.yaml").write_text(yaml.safe_dump({**params, "tasks": [TASK]}, sort_keys=False))
    (origin / "stand_in.py").write_text(STAND_IN)
    shutil.copy(REPO / ".gitignore", origin / ".gitignore")
    run(["git", "init", "-q"], origin)
    run(["dvc", "init", "-q"], origin)
    run(["dvc", "repro", "-q"], origin)
    run(["dvc", "remote", "add", "-d", "store", str(remote)], origin)
    commit(origin, "results")
    run(["dvc", "push", "-q"], origin)

    run(["git", "clone", "-q", str(origin), str(clone)], tmp_path)
    # git brings the report (its outs are cache: false and committed) ...
    for path in ("reports/README.md", "reports/metrics.json", "reports/provenance.json", "reports/tables"):
        assert (clone / path).exists(), path
    # ... and dvc pull the cached outputs: the data, the sweep's summary, the evaluation rows.
    run(["dvc", "pull", "-q"], clone)
    for path in (f"data/{TASK}", f"results/{TASK}/sweep.json", f"results/eval/{TASK}"):
        assert (clone / path).exists(), path
    # Ray's storage and the checkpoints (persist, cache: false) are never pushed: DVC sees
    # that output deleted, so a plain `dvc repro` would run the sweep stage again.
    assert not (clone / "results" / "sweeps" / TASK).exists()
    status = json.loads(run(["dvc", "status", "--json"], clone))
    assert status == {f"sweep@{TASK}": [{"changed outs": {f"results/sweeps/{TASK}": "deleted"}}]}
    assert f"Running stage 'sweep@{TASK}'" in run(["dvc", "repro", "--dry"], clone)
    # --allow-missing skips a stage whose only change is missing data: nothing runs.
    skipped = run(["dvc", "repro", "--allow-missing", "--dry"], clone)
    assert "Running stage" not in skipped and "Data and pipelines are up to date" in skipped
    assert json.loads(run(["dvc", "metrics", "show", "--json"], clone))
