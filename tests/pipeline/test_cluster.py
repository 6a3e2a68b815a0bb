"""Cluster mode: the sweep on a multi-node Ray cluster with an MLflow tracking server.

Everything listens on 127.0.0.1. One Ray cluster (a head and a worker node, one CPU
each, ``ray.cluster_utils.Cluster``) and one ``mlflow server`` (SQLite backend, artifact
store, both in a temporary directory) are shared by the module; the sweeps run as a user
runs them: ``python -m pipeline.cli sweep`` with ``RAY_ADDRESS``, ``MLFLOW_TRACKING_URI``
and ``RAY_AUTH_MODE=disabled`` in the environment. Faults: a trial that raises, the
driver killed with SIGKILL, a worker node killed, the MLflow server stopped for a while.

Teardown kills every process the module started (the cluster's nodes, the server's
process group, leftover drivers), even when a test fails.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from pipeline import tracking
from pipeline.report.tracked import claim_metrics
from tests.pipeline.cluster_support import (
    MlflowServer,
    cells_dir,
    check_child_runs,
    cluster_env,
    done,
    kill_group,
    make_project,
    processes_mentioning,
    run_cli,
    server_runs,
    start_sweep,
    summary,
    wait_for,
)
from tests.pipeline.harness import tiny

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TIMING = ("it_per_s", "step_seconds")  # wall-clock metrics: differ between runs

# The pipeline tests' tiny params, with longer training, three methods and one budget.
CLUSTER_CHANGES = {
    "sweep.max_failures": 2,
    "tracking.experiment": "apg-cluster-test",
    "report.scale": "cluster test",
    "gmm.train.iterations": 24,
    "gmm.grid": [{"methods": ["apg", "rws-mlp", "rws-lstm"], "pairs": [[2, 3]], "seeds": [0]}],
    "gmm.evaluate.pairs": [[2, 3]],
}
FAULT_CELL, FAULT_ITERATION = "gmm/apg/K2/L3/seed0", 7  # after the checkpoint at 4 and the log at 6


def params(**changes) -> dict:
    """The cluster tests' params with ``changes`` given as dotted keys."""
    # Deep-copied: a test that changes e.g. gmm.grid.0.methods must not edit CLUSTER_CHANGES.
    return tiny(**copy.deepcopy({**CLUSTER_CHANGES, **changes}))


PARAMS = params()


# --------------------------------------------------------------------------- services
@pytest.fixture(scope="module")
def mlflow_server():
    home = Path(tempfile.mkdtemp(prefix="apgmlf"))
    server = MlflowServer(home)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        for pid in processes_mentioning(str(home)):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster():
    """A head and a worker node on 127.0.0.1, one CPU each, in a private temp dir."""
    temp = tempfile.mkdtemp(prefix="apgray", dir="/tmp")  # short: Unix socket paths are limited
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    # RAY_TMPDIR: Cluster writes its address file there, not where other users' plain
    # ray.init() would find it. The cluster switch keeps every node on loopback (Ray
    # otherwise advertises the machine's routable address and binds all interfaces).
    os.environ["RAY_TMPDIR"] = temp
    os.makedirs(os.path.join(temp, "ray"))
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    was_enabled, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    cluster = Cluster()
    try:
        node_args = {"num_cpus": 1, "temp_dir": temp, "include_dashboard": False}
        cluster.add_node(**node_args)
        cluster.add_node(**{k: v for k, v in node_args.items() if k != "include_dashboard"})
        cluster.node_args = node_args
        yield cluster
    finally:
        try:
            cluster.shutdown()
        finally:
            ray_constants.ENABLE_RAY_CLUSTER = was_enabled
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            for pid in processes_mentioning(temp):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            shutil.rmtree(temp, ignore_errors=True)


def add_worker(cluster):
    return cluster.add_node(**{k: v for k, v in cluster.node_args.items() if k != "include_dashboard"})


# --------------------------------------------------------------------------- projects


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The tiny training/test data, generated once for every project of the module."""
    root = make_project(tmp_path_factory.mktemp("gen"), PARAMS, data=None)
    run_cli(["generate-stage"], root, {})
    return root / "data"


# --------------------------------------------------------------------------- the sweep on the cluster


@pytest.fixture(scope="module")
def cluster_sweep(ray_cluster, mlflow_server, data_dir, tmp_path_factory):
    """The 3-cell sweep on the cluster, with one injected fault (the apg cell raises once)."""
    root = make_project(tmp_path_factory.mktemp("cluster"), PARAMS, data_dir)
    env = cluster_env(ray_cluster, mlflow_server, APG_FAULT_INJECT=f"{FAULT_CELL}:{FAULT_ITERATION}")
    start = time.perf_counter()
    proc = run_cli(["sweep", "--task", "gmm"], root, env)
    return {"root": root, "proc": proc, "seconds": time.perf_counter() - start}


def test_sweep_runs_every_trial_across_nodes(cluster_sweep, ray_cluster):
    root = cluster_sweep["root"]
    s = summary(root)
    assert sorted(c["name"] for c in s["cells"]) == [
        "gmm/apg/K2/L3/seed0",
        "gmm/rws-lstm/K2/L3/seed0",
        "gmm/rws-mlp/K2/L3/seed0",
    ]
    assert all(c["iterations"] == 24 for c in s["cells"])
    finished = done(root)
    assert len(finished) == 3
    nodes = {a["node_id"] for d in finished.values() for a in d["attempts"]}
    cluster_nodes = {ray_cluster.head_node.node_id, *(n.node_id for n in ray_cluster.worker_nodes)}
    assert len(nodes) >= 2 and nodes <= cluster_nodes, (nodes, cluster_nodes)
    assert "trained" in (root / "results" / "sweeps" / "gmm" / "last_run.json").read_text()


def test_every_child_run_is_on_the_server_under_its_parent(cluster_sweep, mlflow_server):
    check_child_runs(mlflow_server, cluster_sweep["root"])


CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def browser_dom(url: str, screenshot: str | None = None) -> str:
    """The page at ``url`` as headless Chromium renders it (20 s of the page's own time), in a
    window wide enough that the runs table's headline columns are all drawn (it draws only
    the columns in sight)."""
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1800,700",
        "--virtual-time-budget=20000",
    ]
    if screenshot:
        subprocess.run(
            [*flags, f"--screenshot={screenshot}", url], capture_output=True, timeout=180, check=True
        )
    return subprocess.run(
        [*flags, "--dump-dom", url], capture_output=True, text=True, timeout=180, check=True
    ).stdout


def table_columns(dom: str) -> set[str]:
    """The param and metric columns of the runs table in a rendered page."""
    return set(re.findall(r'col-id="((?:params|metrics)\.`[^`]+`)"', dom))


@pytest.mark.skipif(CHROMIUM is None, reason="needs a headless Chromium (apt-get install chromium)")
def test_mlflow_ui_opens_the_sweep_in_its_runs_table(cluster_sweep, mlflow_server):
    # The sweep prints where to look, and `apg-pipeline runs-url` prints the same address; a
    # browser there sees every run of the sweep as a row (no child folded under its parent)
    # with the headline params and metrics as columns, none picked by hand.
    # APG_UI_SCREENSHOT=<png> also saves what it sees (the picture in docs/reproduce.md).
    root = cluster_sweep["root"]
    (url,) = re.findall(r"browse the runs: (\S+)", cluster_sweep["proc"].stdout)
    printed = run_cli(["runs-url"], root, {"MLFLOW_TRACKING_URI": mlflow_server.uri}).stdout
    assert printed.splitlines() == [url] and url.startswith(mlflow_server.uri)
    runs = [c["name"] for c in summary(root)["cells"]]
    dom = browser_dom(url, os.environ.get("APG_UI_SCREENSHOT"))
    (parent,) = set(re.findall(r"sweep/gmm-[0-9a-f]+", dom))
    assert all(name in dom for name in runs), runs
    assert table_columns(dom) == set(tracking.HEADLINE_COLUMNS)
    assert "No data available" not in dom
    # Why the address is printed: the bare one lands on MLflow 3.17's GenAI welcome page,
    # with no run and no column of the sweep in sight.
    bare = browser_dom(mlflow_server.uri)
    assert parent not in bare and not any(name in bare for name in runs) and not table_columns(bare)


def test_raising_trial_restarts_from_its_checkpoint(cluster_sweep, mlflow_server):
    root = cluster_sweep["root"]
    cell = next(c for c in summary(root)["cells"] if c["name"] == FAULT_CELL)
    attempts = done(root)[cell["cell_id"]]["attempts"]
    # First attempt from scratch, raised after iteration 7; the retry resumed from the
    # checkpoint at iteration 4 (not from scratch) and finished.
    assert [a["start_iteration"] for a in attempts] == [0, 4]
    assert "injected fault after iteration 7" in cluster_sweep["proc"].stdout + cluster_sweep["proc"].stderr
    # Its run: FINISHED, steps 2, 4, 6 (logged before the fault; 6 recomputed after it)
    # once each -- checked with every other cell by check_child_runs.
    client, runs = server_runs(mlflow_server)
    run = next(r for r in runs if r.data.tags.get("apg.cell_id") == cell["cell_id"])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(2, 25, 2))
    for other in summary(root)["cells"]:
        if other["name"] != FAULT_CELL:
            assert len(done(root)[other["cell_id"]]["attempts"]) == 1


@pytest.fixture(scope="module")
def regenerated(cluster_sweep, mlflow_server, data_dir, tmp_path_factory):
    """A machine without the cluster's storage: the cells come from MLflow, then evaluate
    and report run as usual (the report logs its claims run to the server)."""
    root = make_project(tmp_path_factory.mktemp("regenerated"), PARAMS, data_dir)
    env = {"MLFLOW_TRACKING_URI": mlflow_server.uri}
    run_cli(["sweep", "--task", "gmm", "--fetch"], root, env)
    fetched = summary(root)
    run_cli(["eval-sweep", "--task", "gmm"], root, env)
    return {"root": root, "fetched": fetched, "report": run_cli(["report"], root, env)}


def test_report_regenerates_from_the_servers_records(cluster_sweep, regenerated):
    root = regenerated["root"]
    assert regenerated["fetched"] == summary(cluster_sweep["root"])
    assert (root / "reports" / "README.md").is_file()
    metrics = json.loads((root / "reports" / "data" / "metrics-full.json").read_text())
    assert set(metrics["gmm"]) >= {"apg/K2/L3", "rws-mlp/K2/L3", "rws-lstm/K2/L3"}


def page_text(dom: str) -> list[str]:
    """The text of a rendered page, piece by piece in reading order."""
    return [t.strip() for t in re.findall(r">([^<>]+)<", dom) if t.strip()]


@pytest.mark.skipif(CHROMIUM is None, reason="needs a headless Chromium (apt-get install chromium)")
def test_mlflow_ui_shows_the_claims_run_with_each_verdict(regenerated, mlflow_server):
    # The report prints where its claims run is; a browser there sees the run, and each
    # verdict and count of reports/metrics.json as a metric beside its value.
    (url,) = re.findall(r"browse the claims: (\S+)", regenerated["report"].stdout)
    assert url.startswith(mlflow_server.uri) and "View run" not in regenerated["report"].stdout
    client, _ = server_runs(mlflow_server)
    run = client.get_run(url.rsplit("/", 1)[-1])
    headline = json.loads((regenerated["root"] / "reports" / "metrics.json").read_text())
    assert run.info.run_name == "claims" and run.data.metrics == claim_metrics(headline)
    assert {"claims.held", "claims.judged", "claims.total"} <= set(run.data.metrics)
    text = page_text(browser_dom(url))
    assert "claims" in text and f"Metrics ({len(run.data.metrics)})" in text
    shown = {name: float(value) for name, value in itertools.pairwise(text) if name in run.data.metrics}
    assert shown == run.data.metrics


def test_same_seed_same_cell_identical_final_metrics(cluster_sweep, data_dir, tmp_path):
    """The same cells in local mode (embedded Ray, local SQLite, no faults) reach exactly
    the cluster's final metrics, including the cell that was restarted from a checkpoint."""
    # Only the restarted cell and one other: a cell's id hashes its config, seed and
    # data, not the grid, so these are the same cells.
    root = make_project(tmp_path, params(**{"gmm.grid.0.methods": ["apg", "rws-mlp"]}), data_dir)
    run_cli(["sweep", "--task", "gmm"], root, {})
    local = {c["cell_id"]: c["final"] for c in summary(root)["cells"]}
    remote = {c["cell_id"]: c["final"] for c in summary(cluster_sweep["root"])["cells"]}
    assert len(local) == 2 and set(local) <= set(remote)
    for cell_id in local:
        for key, value in local[cell_id].items():
            if key not in TIMING:
                assert value == remote[cell_id][key], (cell_id, key)  # bit-identical on CPU


# --------------------------------------------------------------------------- faults


LONG = {"gmm.train.iterations": 150, "sweep.checkpoint_every": 10, "sweep.log_every": 10}


def settled(read, quiet: float = 5.0, timeout: float = 60.0):
    """``read()`` once it has returned the same value for ``quiet`` seconds."""
    value, since, deadline = read(), time.monotonic(), time.monotonic() + timeout
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(0.5)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


def test_driver_killed_then_rerun_resumes(ray_cluster, mlflow_server, data_dir, tmp_path):
    p = params(**{**LONG, "gmm.grid.0.seeds": [1], "gmm.train.iterations": 120})
    root = make_project(tmp_path, p, data_dir)
    env = cluster_env(ray_cluster, mlflow_server)
    log = tmp_path / "driver.log"
    proc = start_sweep(root, env, log)
    try:
        wait_for(lambda: done(root), 300, "a finished cell", proc, log)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        kill_group(proc)
    # The cluster ends a dead driver's trials a moment after it dies: one that was about to
    # finish may still write its done.json. Take the finished cells once that has settled.
    finished = settled(
        lambda: {cid: (cells_dir(root) / cid / "done.json").stat().st_mtime_ns for cid in done(root)}
    )
    assert 1 <= len(finished) < 3, finished
    assert not (root / "results" / "gmm" / "sweep.json").exists()

    run_cli(["sweep", "--task", "gmm"], root, env)
    s = summary(root)
    assert len(s["cells"]) == 3 and all(c["iterations"] == 120 for c in s["cells"])
    last_run = json.loads((root / "results" / "sweeps" / "gmm" / "last_run.json").read_text())
    assert sorted(last_run["skipped"]) == sorted(finished)
    for cell_id, mtime in finished.items():  # not retrained
        assert (cells_dir(root) / cell_id / "done.json").stat().st_mtime_ns == mtime
    check_child_runs(mlflow_server, root)


def test_worker_node_killed_trials_restart_elsewhere(ray_cluster, mlflow_server, data_dir, tmp_path):
    extra = add_worker(ray_cluster)
    try:
        p = params(**{**LONG, "gmm.grid.0.seeds": [2]})
        root = make_project(tmp_path, p, data_dir)
        log = tmp_path / "driver.log"
        proc = start_sweep(root, cluster_env(ray_cluster, mlflow_server), log)
        try:

            def victim():  # a cell now running on the extra node that has a checkpoint
                for cell in cells_dir(root).glob("*"):
                    attempts = (
                        [json.loads(x) for x in (cell / "attempts.jsonl").read_text().splitlines()]
                        if (cell / "attempts.jsonl").is_file()
                        else []
                    )
                    if (
                        attempts
                        and attempts[-1]["node_id"] == extra.node_id
                        and (cell / "resume.pt").is_file()
                        and not (cell / "done.json").exists()
                    ):
                        return cell.name
                return None

            cell_id = wait_for(victim, 300, "a checkpointed trial on the extra node", proc, log)
            ray_cluster.remove_node(extra, allow_graceful=False)  # SIGKILL: raylet, workers
            extra = None
            assert proc.wait(timeout=400) == 0, log.read_text()[-5000:]
        finally:
            kill_group(proc)
        s = summary(root)
        assert len(s["cells"]) == 3 and all(c["iterations"] == 150 for c in s["cells"])
        attempts = done(root)[cell_id]["attempts"]
        assert len(attempts) >= 2
        assert attempts[-1]["node_id"] != attempts[0]["node_id"]
        assert attempts[-1]["start_iteration"] > 0  # from its checkpoint, not from scratch
        check_child_runs(mlflow_server, root)
    finally:
        if extra is not None:
            ray_cluster.remove_node(extra, allow_graceful=False)


def test_mlflow_server_outage_loses_no_metrics(ray_cluster, mlflow_server, data_dir, tmp_path):
    # Long enough that the two trials' logging overlaps even when one starts late: at LONG's
    # 150 steps the first RWS trial once finished before the second logged (a loaded machine).
    longer = {**LONG, "gmm.train.iterations": 600}
    p = params(**{**longer, "gmm.grid.0.seeds": [3], "gmm.grid.0.methods": ["rws-mlp", "rws-lstm"]})
    root = make_project(tmp_path, p, data_dir)
    log = tmp_path / "driver.log"
    proc = start_sweep(root, cluster_env(ray_cluster, mlflow_server), log)
    try:

        def logging_started():  # both trials have logged, neither has finished
            _, runs = server_runs(mlflow_server)
            return (
                sum(
                    "loss" in r.data.metrics and r.info.status == "RUNNING" and "apg.cell_id" in r.data.tags
                    for r in runs
                )
                >= 2
            )

        wait_for(logging_started, 300, "both trials logging", proc, log)
        mlflow_server.stop()
        down = time.time()
        time.sleep(2)
        mlflow_server.start()  # ~30 s until healthy: trials train (and finish) meanwhile
        up = time.time()
        assert proc.wait(timeout=400) == 0, log.read_text()[-5000:]
    finally:
        kill_group(proc)
    text = log.read_text()
    assert "MLflow unreachable" in text and "buffering metrics" in text
    check_child_runs(mlflow_server, root)
    # Points computed while the server was down reached it, with the time they were computed.
    client, runs = server_runs(mlflow_server)
    stamps = [
        m.timestamp / 1000
        for r in runs
        if r.data.tags.get("apg.cell_id") in {c["cell_id"] for c in summary(root)["cells"]}
        for m in client.get_metric_history(r.info.run_id, "loss")
    ]
    assert any(down < t < up for t in stamps), (down, up)


def test_no_service_left_listening_beyond_loopback(ray_cluster, mlflow_server):
    """Ray's and MLflow's listening sockets are all on 127.0.0.1."""
    if shutil.which("ss") is None:
        pytest.skip("ss not available")
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    ours = set(processes_mentioning(str(mlflow_server.home))) | set(
        processes_mentioning(ray_cluster.head_node.get_session_dir_path())
    )
    assert ours, "found no Ray or MLflow process: the check below would pass vacuously"
    mine = [line for line in out.splitlines() if any(f"pid={pid}," in line for pid in ours)]
    assert mine, "ss shows none of their listening sockets (no pid= fields?)"
    wide = [
        line
        for line in mine
        if not line.split()[3].startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:"))
    ]
    assert not wide, wide
