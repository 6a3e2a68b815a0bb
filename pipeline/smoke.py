"""``apg-pipeline smoke``: the whole pipeline from scratch on small params, in a throwaway repo.

Copies the code, ``dvc.yaml`` and a profile's params (default the ``smoke`` profile,
``profiles/smoke.yaml``: every task, every stage, minutes on 2 cores) or a params file into a
fresh git + DVC repo under ``--dir``, runs
``dvc repro`` there and prints the time each stage took. The project's own ``data/``,
``results/``, ``reports/`` and ``mlflow.db`` are never touched, so it is safe to run
beside a full reproduction. CI runs it; use it to try a change before a full ``dvc repro``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from apg.data.mnist import ENV_VAR as MNIST_ENV
from pipeline.provenance.stages import package_root, source_commit, stage_times

COPIED = ("apg", "pipeline", "dvc.yaml", ".dvcignore", ".gitignore")
MARKER = ".apg-sandbox"  # in every sandbox: only a folder holding it is ever deleted


def make_sandbox(directory: Path, params_file: Path, init_repo: bool = True) -> Path:
    """A fresh git + DVC repo at ``directory`` holding the code and ``params_file`` as
    ``params.yaml`` (``init_repo=False``: the files alone, for stages run without DVC).

    An existing sandbox there (a folder holding ``MARKER``) is replaced; any other existing
    folder that is not empty raises ``ValueError`` and is left as it was, as is the project
    itself or a folder holding it."""
    src = package_root()
    directory = directory.resolve()
    if src == directory or src.is_relative_to(directory):
        raise ValueError(f"{directory} holds this project; a sandbox needs a folder of its own")
    if directory.exists():
        if not directory.is_dir():
            raise ValueError(f"{directory} is a file, not a folder for a sandbox")
        if any(directory.iterdir()) and not (directory / MARKER).is_file():
            raise ValueError(
                f"{directory} is not empty and is not a sandbox made by apg-pipeline; "
                "name a new or empty folder"
            )
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    (directory / MARKER).write_text("made by apg-pipeline: deleted and remade by the next run here\n")
    _copy_code(src, directory)
    shutil.copy(params_file, directory / "params.yaml")
    no_recorded_runs(directory)
    for cmd in (
        ()
        if not init_repo
        else (
            ["git", "init", "-q"],
            ["dvc", "init", "-q"],
            ["git", "add", "-A"],
            ["git", "-c", "user.name=smoke", "-c", "user.email=smoke@localhost", "commit", "-qm", "smoke"],
        )
    ):
        subprocess.run(cmd, cwd=directory, check=True, capture_output=True)
    return directory


def refresh_code(directory: Path) -> None:
    """Put this code in place of the copy in sandbox ``directory`` (its params, data and
    results stay; the stages whose code changed rerun)."""
    directory = directory.resolve()
    if not (directory / MARKER).is_file():
        raise ValueError(f"{directory} is not a sandbox made by apg-pipeline")
    for name in COPIED:
        path = directory / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    _copy_code(package_root(), directory)


def _copy_code(src: Path, directory: Path) -> None:
    for name in COPIED:
        path = src / name
        if path.is_dir():
            shutil.copytree(path, directory / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(path, directory / name)


def no_recorded_runs(directory: Path) -> None:
    """The report stage reads recorded runs (``pipeline.recorded.record``, a dvc dep); a sandbox has none."""
    (directory / "recorded").mkdir(exist_ok=True)
    (directory / "recorded" / "README.md").write_text("No recorded runs in a sandbox.\n")


def timing_table(times: dict[str, float], total: float) -> str:
    rows = ["| stage | minutes |", "| --- | ---: |"]
    rows += [f"| `{name}` | {seconds / 60:.1f} |" for name, seconds in times.items()]
    rows.append(f"| **total (`dvc repro`, wall)** | **{total / 60:.1f}** |")
    return "\n".join(rows)


def sandbox_env() -> dict[str, str]:
    """The environment a sandbox's ``dvc repro`` runs in: its own MLflow store and project
    root, MNIST's folder as an absolute path (the stages run inside the sandbox, where a
    relative one would point elsewhere), and ``APG_COMMIT``, the project's own commit, which
    the runs name as theirs (the sandbox's git repo has a commit of its own)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the sandbox's own ./mlflow.db
    env.pop("APG_PROJECT_ROOT", None)  # the stages' root is the sandbox
    if env.get(MNIST_ENV):
        env[MNIST_ENV] = str(Path(env[MNIST_ENV]).resolve())
    commit = source_commit(package_root(), short=False)
    if commit != "unknown":
        env["APG_COMMIT"] = commit
    return env


def run_smoke(params_file: Path, directory: Path) -> tuple[dict[str, float], float]:
    if not params_file.is_file():
        raise FileNotFoundError(f"params file not found: {params_file}")
    root = make_sandbox(directory.resolve(), params_file.resolve())
    env = sandbox_env()
    start = time.monotonic()
    # -q: the stages' own lines, not DVC's git and push hints for a throwaway repo
    proc = subprocess.run(["dvc", "repro", "-q"], cwd=root, env=env)
    total = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"apg-pipeline: error: dvc repro failed in {root} (exit {proc.returncode}); see above"
        )
    return stage_times(root), total
