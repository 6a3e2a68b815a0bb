"""MLflow tracking: a parent run per sweep, a child run per trial.

The driver does everything that touches the store's schema (creating the SQLite file,
the experiment, the parent and all child runs) before any trial starts: several trials
creating a fresh SQLite store at once fail. Trials then only append to their own run
through ``MlflowClient`` (``log_batch``), with the run id they were given.

Tracking URI: ``MLFLOW_TRACKING_URI`` if set (a tracking server on a cluster), else a
SQLite file ``mlflow.db`` in the project with artifacts under ``mlartifacts/``.

A tracking server can go away for a while (restart, network hiccup). Trials must keep
training and lose nothing, so a trial logs through ``RunLogger``: metrics are buffered
with the time they were computed, sent in batches, and kept (with a warning) while the
server is unreachable; they go out when it is back. Steps the server already holds are
never sent twice, which also covers a trial restarted from an older checkpoint: it
recomputes steps after the checkpoint, and the ones already logged are skipped.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from pipeline.config.checks import first_line

# Tags that identify our runs, so a resumed sweep finds its runs instead of duplicating them.
TAG_SWEEP = "apg.sweep_key"
TAG_CELL = "apg.cell_id"
TAG_PARENT = "mlflow.parentRunId"
TAG_STAGE = "apg.stage"
TAG_PARAMS = "apg.params_digest"


# How long a trial waits, at its end, for an unreachable server before it fails (its
# buffered metrics are then in its checkpoint's history and are re-sent by the retry).
FLUSH_TIMEOUT_S = float(os.environ.get("APG_TRACKING_FLUSH_TIMEOUT_S", "900"))


class TrackingError(ValueError):
    """The tracking store cannot be reached or used."""


def is_transient(err: BaseException) -> bool:
    """Connection failures and server-side errors: worth retrying. A 4xx is our bug."""
    from mlflow.exceptions import MlflowException

    if isinstance(err, MlflowException):
        status = err.get_http_status_code()
        return status >= 500 or status in (408, 429)
    return isinstance(err, (OSError, ConnectionError))


def warn(message: str) -> None:
    print(f"apg-pipeline: warning: {message}", file=sys.stderr, flush=True)


def retry(call: Callable[[], Any], what: str, timeout: float = FLUSH_TIMEOUT_S) -> Any:
    """``call()``, retried with backoff while the server is unreachable (warns once)."""
    deadline, delay, warned = time.monotonic() + timeout, 1.0, False
    while True:
        try:
            return call()
        except Exception as err:
            if not is_transient(err) or time.monotonic() + delay > deadline:
                raise
            if not warned:
                warn(f"MLflow unreachable while {what} ({_said(err)}); retrying for up to {timeout:.0f} s")
                warned = True
            time.sleep(delay)
            delay = min(delay * 2, 30.0)


def tracking_uri(root: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"


def artifact_location(root: Path) -> str | None:
    """Local store: artifacts inside the project; a server decides its own."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    return (root / "mlartifacts").resolve().as_uri()


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fail within seconds, naming the server, instead of hanging on retries."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout).close()
    except OSError as err:
        raise TrackingError(f"MLflow tracking server {redact(uri)} is unreachable ({err})") from None


def client(uri: str):
    # Fail fast on HTTP errors instead of MLflow's default minutes of retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    # Not MLflow's two "View run ... at" lines for every run ended on a server (each trial of a
    # sweep): the stages print one address each, of the page that shows what they logged.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # not its database migrations, line by line
    prepare_store(uri)
    return MlflowClient(tracking_uri=uri)


_PREPARED: set[str] = set()  # local stores this process has checked


def prepare_store(uri: str) -> None:
    """A local SQLite store (``sqlite:///<path>``) whole before MLflow opens it.

    MLflow creates a missing store in place, table by table and migration by migration: a
    disk that fills (or a process killed) in between leaves a half-migrated file that every
    later run fails on ("table _alembic_tmp_jobs already exists"). Here a missing store is
    made and migrated under a temporary name in the same folder and linked into place
    whole. A store found half-made (an ``_alembic_tmp_*`` table, no or an old schema
    version, an unreadable or empty file) is rebuilt when it holds no runs (an unreadable
    one is kept beside it as ``<name>.broken-<time>``); one that holds runs is left alone,
    with one line saying how to upgrade it. Other URIs (a server) are the server's own.
    """
    path = _sqlite_path(uri)
    if path is None or uri in _PREPARED:
        return
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process makes or repairs it; the others wait
        for stale in path.parent.glob(f".{path.name}.*.tmp*"):  # a maker killed mid-way
            stale.unlink(missing_ok=True)
        if path.exists():
            problem, runs = store_problem(path)
            if problem is None:
                _PREPARED.add(uri)
                return
            if runs:
                raise TrackingError(
                    f"MLflow store {path} is {problem} and holds {runs} runs: back it up, then run "
                    f"`mlflow db upgrade sqlite:///{path}`"
                )
            if runs is None:  # unreadable: kept aside, in case something in it matters
                aside = path.with_name(f"{path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
                os.replace(path, aside)
                warn(f"MLflow store {path} was {problem}; moved to {aside.name} and made anew")
            else:
                warn(f"MLflow store {path} was {problem} with no runs; made anew")
        _make_store(path)
    _PREPARED.add(uri)


def _sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///") or uri.endswith(":memory:"):
        return None
    return Path(uri.removeprefix("sqlite:///"))


def store_problem(path: Path) -> tuple[str | None, int | None]:
    """``(what is wrong with the SQLite store at path or None, how many runs it holds or
    None when it cannot be read)``."""
    import sqlite3

    from mlflow.store.db.utils import _get_latest_schema_revision

    if path.stat().st_size == 0:
        return "empty", 0
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            runs = con.execute("SELECT count(*) FROM runs").fetchone()[0] if "runs" in tables else 0
            version = (
                con.execute("SELECT version_num FROM alembic_version").fetchone()
                if "alembic_version" in tables
                else None
            )
        finally:
            con.close()
    except sqlite3.DatabaseError as err:
        return f"unreadable ({err})", None
    leftovers = sorted(t for t in tables if t.startswith("_alembic_tmp_"))
    if leftovers:
        return f"half-migrated (leftover {', '.join(leftovers)})", runs
    head = _get_latest_schema_revision()
    if version is None or version[0] != head:
        return f"at schema {version[0] if version else 'none'}, not {head}", runs
    return None, runs


def _make_store(path: Path) -> None:
    """Create and migrate a SQLite store under a temporary name beside ``path``, then link
    it into place (``os.link`` never replaces: a store another process made first wins)."""
    from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    tmp = path.with_name(f".{path.name}.{os.getpid()}-{time.monotonic_ns()}.tmp")
    tmp_uri = f"sqlite:///{tmp}"
    try:
        try:
            SqlAlchemyStore(tmp_uri, DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH)
        except Exception as err:
            if "disk is full" in str(err):  # SQLite's SQLITE_FULL, as sqlite3 or SQLAlchemy raise it
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from err
            raise
        _forget_engine(tmp_uri)  # every connection to it closed before it moves
        if path.exists():  # a broken store with no runs, replaced whole
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:  # made meanwhile by a process that does not lock (mlflow ui)
                pass
            except OSError as err:
                if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
                os.replace(tmp, path)  # a filesystem without hard links
    finally:
        _forget_engine(tmp_uri)
        for leftover in path.parent.glob(f"{tmp.name}*"):
            leftover.unlink(missing_ok=True)


def _forget_engine(uri: str) -> None:
    """Close and drop MLflow's cached engine of ``uri`` (it keeps one per URI)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    engine = SqlAlchemyStore._engine_map.pop(uri, None)
    if engine is not None:
        engine.dispose()


DEFAULT_EXPERIMENT = "apg"


def experiment_name(params: Mapping[str, Any]) -> str:
    """The MLflow experiment of the sweeps and the report (``tracking.experiment``)."""
    return params.get("tracking", {}).get("experiment", DEFAULT_EXPERIMENT)


# The sweep's headline columns of the runs table: what a cell is (params every cell's run
# logs, from its TrainConfig and seed) and how its training ended (the last logged step's
# metrics, which a trial logs as final_<name>: apg.training's log joint, ESS/L, log evidence).
HEADLINE_PARAMS = ("method", "sweeps", "particles", "seed")
HEADLINE_METRICS = ("final_log_joint", "final_ess", "final_log_evidence")
# ... as the UI names its columns
HEADLINE_COLUMNS = [f"params.`{p}`" for p in HEADLINE_PARAMS] + [f"metrics.`{m}`" for m in HEADLINE_METRICS]

# The runs table as a sweep is read, kept in the experiment as one of MLflow 3.17's saved views
# (an experiment tag ``mlflow.sharedViewState.<id>``, listed under the runs page's "Views"):
# the headline columns, and every run a row ordered by name, so a sweep's cells sit together
# (the UI nests child runs under a collapsed parent only in its default order, by time).
RUNS_VIEW = "apg-headline"
_VIEW_STATE = {
    "selectedColumns": HEADLINE_COLUMNS,
    "orderByKey": "tags.`mlflow.runName`",
    "orderByAsc": True,
}
_RUNS_VIEW_TAG = {
    f"mlflow.sharedViewState.{RUNS_VIEW}": json.dumps(
        {"name": "sweep: headline columns", "createdAt": 0, "state": json.dumps(_VIEW_STATE)}
    )
}
# Set on every experiment the pipeline makes or reuses: its kind (model training, as MLflow's
# experiments list shows it) and the saved view that ui_url opens.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development", **_RUNS_VIEW_TAG}
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store


def ui_url(base: str, exp_id: str, run_id: str | None = None) -> str:
    """The MLflow UI's runs table of an experiment, in its saved view :data:`RUNS_VIEW`; with
    ``run_id``, that run's page (its metrics with their values, params and artifacts).

    The address names the view and the model-training workflow: MLflow 3.17's UI opens every
    experiment in its GenAI view (a traces overview saying "No data") unless the URL asks for
    the other one, and the experiment's kind alone does not switch it; the bare address lands
    on the GenAI welcome page, and no server option changes that (seen in headless Chromium,
    tests/pipeline/test_cluster.py)."""
    if run_id is not None:
        return f"{base.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}"
    return (
        f"{base.rstrip('/')}/#/experiments/{exp_id}/runs"
        f"?workflowType=machine_learning&viewStateShareKey={RUNS_VIEW}"
    )


def browse_hint(uri: str, exp_id: str, run_id: str | None = None, what: str = "the runs") -> str:
    """One line telling where to look at the runs of ``exp_id`` in the store ``uri`` (at the
    run ``run_id``, named ``what``, if given: :func:`ui_url`)."""
    if uri.startswith(("http://", "https://")):
        return f"browse {what}: {ui_url(redact(uri), exp_id, run_id)}"
    return f"browse {what}: mlflow ui --backend-store-uri {uri}, then {ui_url(LOCAL_UI, exp_id, run_id)}"


def runs_address(uri: str, experiment: str, ui: str | None = None) -> str:
    """The address of ``experiment``'s runs table in the store ``uri`` (:func:`ui_url`), its
    saved view added to an experiment made before there was one. ``ui``: where the MLflow UI
    is served (default: the tracking server itself, or :data:`LOCAL_UI` for a local store)."""
    path = _sqlite_path(uri)
    if path is not None and not path.is_file():
        raise TrackingError(f"no MLflow store at {path}: run a sweep first")
    check_reachable(uri)
    mlflow_client = client(uri)
    found = mlflow_client.get_experiment_by_name(experiment)
    if found is None:
        raise TrackingError(f"MLflow store {redact(uri)} has no experiment {experiment!r}: run a sweep first")
    _set_experiment_tags(mlflow_client, found)
    remote = uri if uri.startswith(("http://", "https://")) else LOCAL_UI
    return ui_url(redact(ui or remote), found.experiment_id)


def experiment_id(mlflow_client, name: str, artifacts: str | None) -> str:
    found = mlflow_client.get_experiment_by_name(name)
    if found is None:
        return mlflow_client.create_experiment(name, artifact_location=artifacts, tags=EXPERIMENT_TAGS)
    _set_experiment_tags(mlflow_client, found)
    return found.experiment_id


def _set_experiment_tags(mlflow_client, experiment) -> None:
    for key, value in EXPERIMENT_TAGS.items():  # experiments made before a tag was set
        if experiment.tags.get(key) != value:
            mlflow_client.set_experiment_tag(experiment.experiment_id, key, value)


def find_run(mlflow_client, exp_id: str, tags: Mapping[str, str]) -> Any | None:
    """The most recent run carrying all ``tags`` (None if there is none)."""
    query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    runs = mlflow_client.search_runs(
        [exp_id], filter_string=query, max_results=1, order_by=["attributes.start_time DESC"]
    )
    return runs[0] if runs else None


def source_tags(root: Path, stage: str, params: Mapping[str, Any]) -> dict[str, str]:
    """Where a run comes from: the git commit of the project (MLflow's own tag, shown in
    the runs table), the stage or command that made it and a digest of its params."""
    import hashlib

    from pipeline.provenance.stages import source_commit

    commit = source_commit(root, short=False)
    tags = {
        "mlflow.source.name": stage,
        "mlflow.source.type": "PROJECT",
        TAG_STAGE: stage,
        TAG_PARAMS: hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:12],
    }
    if commit != "unknown":
        tags["mlflow.source.git.commit"] = commit
    return tags


def open_parent(
    mlflow_client,
    exp_id: str,
    sweep_key: str,
    name: str,
    params: Mapping[str, Any],
    tags: Mapping[str, str] | None = None,
) -> str:
    """The sweep's parent run: reused when the same grid is resumed (its ``tags``, the
    source of this run of it, updated), else created."""
    run = find_run(mlflow_client, exp_id, {TAG_SWEEP: sweep_key})
    if run is not None:
        if run.info.status != "RUNNING":
            mlflow_client.update_run(run.info.run_id, status="RUNNING")
        for key, value in (tags or {}).items():
            mlflow_client.set_tag(run.info.run_id, key, value)
        return run.info.run_id
    run = mlflow_client.create_run(exp_id, run_name=name, tags={TAG_SWEEP: sweep_key, **(tags or {})})
    log_params(mlflow_client, run.info.run_id, params)
    return run.info.run_id


def open_child(
    mlflow_client,
    exp_id: str,
    parent_id: str,
    cell_id: str,
    name: str,
    params: Mapping[str, Any],
    tags: Mapping[str, str] | None = None,
) -> str:
    """One child run per cell under ``parent_id``; a restarted cell keeps its run."""
    run = find_run(mlflow_client, exp_id, {TAG_PARENT: parent_id, TAG_CELL: cell_id})
    if run is not None:
        return run.info.run_id
    run = mlflow_client.create_run(
        exp_id, run_name=name, tags={TAG_PARENT: parent_id, TAG_CELL: cell_id, **(tags or {})}
    )
    log_params(mlflow_client, run.info.run_id, params)
    return run.info.run_id


def log_params(mlflow_client, run_id: str, params: Mapping[str, Any]) -> None:
    from mlflow.entities import Param

    flat = [Param(k, str(v)[:500]) for k, v in flatten(params).items()]
    for start in range(0, len(flat), 100):  # log_batch takes at most 100 params
        mlflow_client.log_batch(run_id, params=flat[start : start + 100])


def log_metrics(mlflow_client, run_id: str, rows: Iterable[tuple[int, Mapping[str, float]]]) -> None:
    """``rows``: ``(step, {metric: value})``; sent in batches (one request per batch)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, int(step)) for step, values in rows for k, v in values.items()]
    for start in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
        mlflow_client.log_batch(run_id, metrics=metrics[start : start + 1000])


def finish(mlflow_client, run_id: str, status: str = "FINISHED") -> None:
    retry(lambda: mlflow_client.set_terminated(run_id, status=status), f"ending run {run_id}")


MODEL_NAME = "model"  # the logged model of a cell's run: mlflow.pytorch.load_model("runs:/<run id>/model")


class TrainedCell(torch.nn.Module):
    """A cell's trained generative model and proposals as one module, the way MLflow's
    PyTorch flavour keeps a model (``.model``, ``.proposals``)."""

    def __init__(self, model, proposals):
        super().__init__()
        self.model, self.proposals = model, proposals


def log_model(uri: str, run_id: str, model, proposals, params: Mapping[str, Any]) -> None:
    """Log a cell's trained model into its run with MLflow's PyTorch flavour (pickled:
    loading it needs this package installed). ``params``: shown with the logged model."""
    import mlflow
    import mlflow.pytorch

    mlflow.set_tracking_uri(uri)
    # pickle is the chosen format (below); MLflow's warning against it would print per cell
    logging.getLogger("mlflow.pytorch").setLevel(logging.ERROR)
    with mlflow.start_run(run_id=run_id):
        mlflow.pytorch.log_model(
            TrainedCell(model, proposals),  # on its device: load_model(..., map_location="cpu")
            name=MODEL_NAME,
            # torch alone: inferring the environment imports every package (slow, noisy)
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
            params={k: str(v) for k, v in params.items()},
            # pickled: the default ("pt2") traces forward(), and a sampler's networks have none
            serialization_format="pickle",
        )


class RunLogger:
    """A trial's metrics for one run: buffered, batched, retried, never sent twice.

    ``log`` never raises on an unreachable server: it keeps the metrics (with the time
    they were computed) and warns once per outage; later calls retry with backoff (1 s
    doubling to 30 s, so a dead server costs training almost nothing). ``close`` waits
    up to ``timeout`` seconds for everything to go out, then raises ``TrackingError``.

    Before the first send it asks the server which step each metric already reached and
    drops buffered points at or below it: a trial restarted from a checkpoint recomputes
    (identically, on CPU) steps it had already logged, and the run keeps one point per
    step.
    """

    def __init__(self, mlflow_client, run_id: str):
        self.client, self.run_id = mlflow_client, run_id
        self.pending: list[Any] = []
        self.tags: dict[str, str] = {}
        self.sent_steps: dict[str, int] | None = None
        self.sent = self.dropped = 0
        self._next_try, self._delay, self._down_since = 0.0, 1.0, None

    def log(self, step: int, values: Mapping[str, float], timestamp_ms: int | None = None) -> bool:
        from mlflow.entities import Metric

        now = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        self.pending += [Metric(k, float(v), now, int(step)) for k, v in values.items()]
        return self.flush()

    def set_tag(self, key: str, value: str) -> bool:
        self.tags[key] = str(value)[:5000]
        return self.flush()

    def flush(self, force: bool = False) -> bool:
        """Try to send what is buffered; True when nothing is left."""
        if not self.pending and not self.tags:
            return True
        if not force and time.monotonic() < self._next_try:
            return False
        try:
            self._send()
        except Exception as err:
            if not is_transient(err):
                raise
            if self._down_since is None:
                self._down_since = time.monotonic()
                warn(
                    f"MLflow unreachable for run {self.run_id} ({_said(err)}); buffering metrics and retrying"
                )
            self._next_try = time.monotonic() + self._delay
            self._delay = min(self._delay * 2, 30.0)
            return False
        if self._down_since is not None:
            warn(
                f"MLflow reachable again for run {self.run_id} after "
                f"{time.monotonic() - self._down_since:.0f} s; buffered metrics sent"
            )
        self._down_since, self._delay, self._next_try = None, 1.0, 0.0
        return True

    def _send(self) -> None:
        from mlflow.entities import RunTag

        if self.sent_steps is None:
            run = self.client.get_run(self.run_id)
            self.sent_steps = {
                key: max(m.step for m in self.client.get_metric_history(self.run_id, key))
                for key in run.data.metrics
            }
        fresh = [m for m in self.pending if m.step > self.sent_steps.get(m.key, -1)]
        self.dropped += len(self.pending) - len(fresh)
        if self.tags:
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in self.tags.items()])
            self.tags = {}
        for start in range(0, len(fresh), 1000):  # log_batch takes at most 1000 metrics
            batch = fresh[start : start + 1000]
            self.client.log_batch(self.run_id, metrics=batch)
            for m in batch:
                self.sent_steps[m.key] = max(m.step, self.sent_steps.get(m.key, -1))
            self.sent += len(batch)
        self.pending = []

    def close(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Send everything, waiting up to ``timeout`` s for the server; else raise."""
        deadline = time.monotonic() + timeout
        while not self.flush(force=True):
            if time.monotonic() > deadline:
                raise TrackingError(
                    f"MLflow server unreachable for {timeout:.0f} s; "
                    f"{len(self.pending)} metric points of run {self.run_id} not sent"
                )
            time.sleep(min(self._delay, max(0.0, deadline - time.monotonic()), 30.0))


def redact(text: str) -> str:
    """Hide ``user:password@`` in URIs, so credentials never reach logs or summaries."""
    return re.sub(r"//[^/@\s]+@", "//***@", text)


def _said(err: BaseException) -> str:
    """What an MLflow error says, for a warning: its first line, short, credentials hidden."""
    return redact(first_line(err)[:200])


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out
