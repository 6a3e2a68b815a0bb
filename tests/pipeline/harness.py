"""The pipeline tests' tiny params and their throwaway repositories.

``tiny`` is also the ``tiny`` fixture (tests/pipeline/conftest.py); the repository helpers run
the real stages in a temporary git + DVC repo holding this project's code.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml

from pipeline.smoke import no_recorded_runs
from tests.support import REPO

TINY = {
    "tasks": ["gmm"],
    "sweep": {
        "ray_address": None,
        "num_cpus": 2,
        "cpus_per_trial": 1,
        "gpus_per_trial": 0,
        "max_concurrent": 0,
        "max_failures": 1,
        "checkpoint_every": 4,
        "log_every": 2,
        "torch_threads": 1,
        "storage": "results/sweeps",
    },
    "tracking": {"experiment": "apg-test"},
    "report": {"out": "reports", "figure_format": "png", "scale": "tiny test"},
    "gmm": {
        "model": {},
        "network": {"hidden": 8},
        "data": {
            "train": {"num_datasets": 16, "seed": 1, "sizes": {"num_points": 15}},
            "test": {"num_datasets": 3, "seed": 2, "sizes": {"num_points": 15}},
            "figures": [{"num_datasets": 1, "seed": 3, "sizes": {"num_points": 30}}],
        },
        "train": {
            "batch_size": 4,
            "iterations": 6,
            "lr": 0.01,
            "resample_mode": "block",
            "resampler": "systematic",
        },
        "grid": [{"methods": ["apg", "rws-mlp"], "pairs": [[2, 3]], "seeds": [0]}],
        "evaluate": {
            "batch_size": 4,
            "resample_mode": "block",
            "seed": 0,
            "pairs": [[2, 3], [3, 3]],
            "budget": {"total": 6, "sweeps": [1, 3]},
            "baseline": "rws-mlp",
            "figure_sweeps": [1, 2],
            "figure_particles": 3,
        },
    },
}


def tiny(**changes) -> dict:
    """TINY with ``changes`` given as dotted keys, e.g. ``tiny(**{"gmm.train.lr": -1})``."""
    params = copy.deepcopy(TINY)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = params
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[leaf] = value
    return params


def make_repo(root: Path, params: dict) -> Path:
    """A throwaway git + DVC repo holding this project's code and ``params``."""
    for name in ("apg", "pipeline"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("dvc.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(REPO / name, root / name)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    no_recorded_runs(root)
    for cmd in (
        ["git", "init", "-q"],
        ["dvc", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"],
    ):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
    return root


def env() -> dict:
    out = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out.pop("MLFLOW_TRACKING_URI", None)
    out.pop("RAY_ADDRESS", None)
    return out


def run(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def start_sweep(root: Path) -> subprocess.Popen:
    """The GMM's data generated, then its sweep started in the background, quietly."""
    run([sys.executable, "-m", "pipeline.generate", "--task", "gmm"], root)
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.sweep.stage", "--task", "gmm"],
        cwd=root,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def mlflow_runs(root: Path, experiment: str) -> pd.DataFrame:
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id])
