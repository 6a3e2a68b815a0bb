"""Services and project helpers of the cluster tests (tests/pipeline/test_cluster.py): an
``mlflow server`` on loopback, process-group clean-up, throwaway projects and the sweep's
command lines, and the checks of a sweep's records on the server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` on loopback in its own process group; can be stopped and restarted
    on the same port and store (the outage test)."""

    def __init__(self, home: Path):
        self.home, self.port = home, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = home / "server.log"

    def start(self, timeout: float = 120) -> None:
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.home / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.home / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=self.home, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"mlflow server not healthy in {timeout} s: {self.log.read_text()[-3000:]}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc)
        self.proc = None


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Kill a process started with ``start_new_session=True`` and everything in its group."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (our temp dirs)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def make_project(root: Path, p: dict, data: Path | None) -> Path:
    for name in ("apg", "pipeline"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    if data is not None:
        shutil.copytree(data, root / "data")
    return root


def cluster_env(ray_cluster, server: MlflowServer, **extra) -> dict:
    """What a user sets to run the sweep on the cluster and the server."""
    return {
        "RAY_ADDRESS": ray_cluster.address,
        "MLFLOW_TRACKING_URI": server.uri,
        "RAY_AUTH_MODE": "disabled",
        **extra,
    }


def base_env(extra: dict) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RAY_ADDRESS",
            "MLFLOW_TRACKING_URI",
            "RAY_TMPDIR",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
            "APG_FAULT_INJECT",
        )
    }
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled", **extra}


def run_cli(args: list[str], root: Path, extra: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = (
        [sys.executable, "-m", "pipeline.generate", "--task", "gmm"]
        if args == ["generate-stage"]
        else [sys.executable, "-m", "pipeline.cli", *args]
    )
    proc = subprocess.run(cmd, cwd=root, env=base_env(extra), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return proc


def start_sweep(root: Path, extra: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "sweep", "--task", "gmm"],
            cwd=root,
            env=base_env(extra),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(
    predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None
):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"sweep exited ({proc.returncode}) before {what}: {log.read_text()[-4000:] if log else ''}"
            )
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def cells_dir(root: Path) -> Path:
    return root / "results" / "sweeps" / "gmm" / "cells"


def done(root: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in cells_dir(root).glob("*/done.json")}


def summary(root: Path) -> dict:
    return json.loads((root / "results" / "gmm" / "sweep.json").read_text())


def server_runs(server: MlflowServer, experiment: str = "apg-cluster-test"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server.uri)
    exp = client.get_experiment_by_name(experiment)
    return client, (client.search_runs([exp.experiment_id], max_results=1000) if exp else [])


def check_child_runs(server: MlflowServer, root: Path) -> None:
    """Every cell of the sweep has one FINISHED child run under the sweep's parent, whose
    metric history holds each logged step exactly once, equal to the cell's history.csv, and
    which holds the headline params and metrics (``tracking.HEADLINE_COLUMNS``)."""
    import pandas as pd

    from pipeline import tracking

    s = summary(root)
    client, runs = server_runs(server)
    parent = s["mlflow"]["parent_run_id"]
    assert s["mlflow"]["tracking_uri"] == server.uri
    children = {
        r.data.tags[tracking.TAG_CELL]: r for r in runs if r.data.tags.get(tracking.TAG_PARENT) == parent
    }
    assert sorted(children) == sorted(c["cell_id"] for c in s["cells"])
    assert client.get_run(parent).info.status == "FINISHED"
    for cell in s["cells"]:
        run = children[cell["cell_id"]]
        assert run.info.status == "FINISHED", cell["name"]
        assert run.info.run_name == cell["name"]
        history = pd.read_csv(root / cell["history"])
        for key in ("loss", "log_joint", "ess"):
            points = client.get_metric_history(run.info.run_id, key)
            steps = [m.step for m in points]
            assert sorted(steps) == list(history["iteration"]), (
                cell["name"],
                key,
                steps,
            )  # none lost, none twice
            assert [m.value for m in sorted(points, key=lambda m: m.step)] == pytest.approx(
                list(history[key])
            )
        assert run.data.metrics["final_log_joint"] == pytest.approx(cell["final"]["log_joint"])
        # the runs table's headline columns name what every cell's run holds
        assert set(tracking.HEADLINE_PARAMS) <= set(run.data.params), cell["name"]
        assert set(tracking.HEADLINE_METRICS) <= set(run.data.metrics), cell["name"]
