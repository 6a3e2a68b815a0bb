"""Stage ``sweep``: one Ray Tune trial per cell (task, method, K, L, seed) of a task's grid.

``python -m pipeline.sweep --task gmm`` trains every cell of ``<task>.grid`` and writes
``results/<task>/sweep.json`` (the stage's small cached output: every cell's final
checkpoint, its digest and final metrics) and ``<storage>/<task>/last_run.json`` (which
cells this invocation trained and which it skipped as finished). Ray's storage and the per-cell outputs live
under ``<sweep.storage>/<task>/`` and persist between runs, which is how:

- a finished cell (``cells/<cell_id>/done.json`` exists, and its ``model.pt`` matches the
  digest it records: a damaged one is trained again) is never trained again, so an
  interrupted sweep resumes with only the rest, and cells added to the grid later run
  without rerunning old ones; a cell's id hashes its whole config, the training data and
  the numerics fingerprint of its training (``apg.fingerprint``), so a changed option or
  a change in what the code computes is a new cell, and a refactor is not;
- an unfinished cell restarts from its last checkpoint: Tune's (``FailureConfig``
  restarts, ``Tuner.restore``) or, when Tune's experiment state is gone, the cell's own
  ``resume.pt`` (a damaged one is removed and the cell starts over);
- one driver at a time: a lock on ``<storage>/<task>/.sweep.lock`` makes a second driver
  on the same cells exit at once.

Scheduling is FIFO: a fixed-budget comparison needs every cell trained to its end.
Ray is embedded and local by default, listening on loopback only; ``RAY_ADDRESS`` or
``sweep.ray_address`` attaches to a cluster. On a cluster, ``sweep.storage`` must be a
filesystem every node sees (an absolute path, e.g. an NFS mount); the training data is
shipped to the trials through Ray's object store (files up to
``apg.data.IN_MEMORY_MAX_BYTES``; a larger one is read from its absolute path a
batch at a time, and must then be on storage every node sees); each trial uses only
the GPUs Ray assigned it, and records the node it ran on in ``cells/<id>/attempts.jsonl``.

``python -m pipeline.sweep --task gmm --fetch`` trains nothing: it rebuilds the finished
cells of the current grid from the MLflow server's records (each child run holds the
cell's ``model.pt``, ``history.csv`` and ``done.json``), so evaluate and report can run
on a machine that never saw the cluster's storage.

Fault injection, for tests only: ``APG_FAULT_INJECT="<cell name or id>:<iteration>"``
in the driver's environment makes that cell's trial raise once, right after that
iteration; with ``:disk-full`` appended, fail there with ``ENOSPC`` on every attempt, as a
full disk would (which stops the sweep at once, ``pipeline.diskfull``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from apg.data import atomic_write, training_rows
from apg.fingerprint import BATCH as FINGERPRINT_BATCH
from apg.fingerprint import fingerprint
from apg.training import build, make_method
from pipeline import tracking
from pipeline.common import file_digest, project_root, seed_everything
from pipeline.config import checks
from pipeline.config.params import Cell, grid_cells, load_params
from pipeline.diskfull import as_disk_full, disk_full_callback
from pipeline.errors import SweepError
from pipeline.provenance.stages import record_stage_time
from pipeline.runs.loop import DONE, HISTORY, MODEL
from pipeline.runs.trial import shipped_data
from pipeline.sweep.ray_setup import check_resources, quiet_tune_output, start_ray
from pipeline.sweep.trial import FAULT_ENV, tune_trainable

LOCK = ".sweep.lock"


# --------------------------------------------------------------------------- planning


def plan(params: dict[str, Any], task: str, root: Path) -> tuple[dict[str, Cell], Path, Path]:
    """``({cell_id: cell}, training data path, sweep directory)`` for the current grid.

    A cell's id hashes its config, the training data, its networks' shapes and the numerics
    fingerprint of its training (``apg.fingerprint``: what a few steps of its config compute
    on the first training datasets, not the source text), so a cell is reused exactly when
    the code still computes the same numbers. ``sweep.reuse_across_code: true`` (development
    only) reuses the newest finished cell of the same config whatever code trained it; the
    report names such cells in bold.
    """
    data = root / "data" / task / "train.npz"
    if not data.is_file():
        raise SweepError(f"training data {data} not found; run the generate stage first")
    digest = file_digest(data)
    rows = training_rows(data)
    first = rows[torch.arange(min(FINGERPRINT_BATCH, len(rows)))].to(torch.get_default_dtype())
    sweep_dir = (root / params["sweep"].get("storage", "results/sweeps") / task).resolve()
    reuse = params["sweep"].get("reuse_across_code", False)
    cells, prints = {}, {}
    for cell in grid_cells(params, task):
        config_key = cell.cell_id(digest + architecture_digest(cell))
        # Cells that differ only in their seed share one. Seeded as a trial is
        # (``seed_everything``), so the entry point's seeding is part of the numbers.
        key = json.dumps(cell.train.to_dict(), sort_keys=True)
        if key not in prints:
            prints[key] = fingerprint(cell.train, first, seed_everything)
        numerics = prints[key]
        cell_id = cell.cell_id(config_key + numerics)
        if reuse and not is_done(sweep_dir, cell_id):
            cell_id = _done_by_other_code(sweep_dir, config_key) or cell_id
        cells[cell_id] = dataclasses.replace(cell, config_key=config_key, fingerprint=numerics)
    return cells, data.resolve(), sweep_dir


def _done_by_other_code(sweep_dir: Path, config_key: str) -> str | None:
    """The newest finished cell of the same config trained by other code (opt-in reuse)."""
    found = []
    for done in (sweep_dir / "cells").glob(f"*/{DONE}"):
        record = checks.read_json(done)
        if record.get("config_key") == config_key:
            found.append((done.stat().st_mtime, done.parent.name))
    return max(found)[1] if found else None


def architecture_digest(cell: Cell) -> str:
    """Hash of every parameter's name and shape for the cell's model and proposals.

    A library change that alters the networks makes old checkpoints unloadable, so it must
    make a new cell; any other code edit keeps finished cells (retraining on every edit
    would defeat resuming)."""
    model, proposals = build(cell.train)
    shapes = [
        (f"{prefix}.{k}", tuple(v.shape))
        for prefix, module in (("model", model), ("proposals", proposals))
        for k, v in module.state_dict().items()
    ]
    return hashlib.sha256(repr(sorted(shapes)).encode()).hexdigest()[:12]


def is_done(sweep_dir: Path, cell_id: str) -> bool:
    """Whether a cell has finished: its ``done.json`` exists (its outputs are checked
    against it by ``check_finished`` when a sweep starts)."""
    return (sweep_dir / "cells" / cell_id / DONE).is_file()


def check_finished(sweep_dir: Path, cells: dict[str, Cell]) -> list[str]:
    """Finished cells whose files do not match their ``done.json`` (a ``model.pt`` changed or
    gone, a ``done.json`` that does not parse): their ``done.json`` is removed, so this sweep
    trains them again. Returns their names; the sweep says which."""
    damaged = []
    for cell_id, cell in cells.items():
        cell_dir = sweep_dir / "cells" / cell_id
        if not (cell_dir / DONE).is_file():
            continue
        try:
            recorded = json.loads((cell_dir / DONE).read_text())["checkpoint_sha256"]
            intact = (cell_dir / MODEL).is_file() and file_digest(cell_dir / MODEL) == recorded
        except (ValueError, KeyError):
            intact = False
        if not intact:
            (cell_dir / DONE).unlink()
            damaged.append(cell.name)
    return damaged


def acquire_lock(sweep_dir: Path, task: str):
    """An exclusive lock on the task's storage for the whole sweep: a second driver on the
    same cells exits at once with one line instead of training them twice. Released when
    the process ends, however it ends (``flock``)."""
    import fcntl

    sweep_dir.mkdir(parents=True, exist_ok=True)
    handle = open(sweep_dir / LOCK, "a+")  # noqa: SIM115 - held open for the sweep's lifetime
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise SweepError(
            f"another sweep of {task} is running on {sweep_dir} ({holder}); wait for it to end or stop it"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle


def short_hash(items: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(items)).encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- the driver


def cell_job(cell_id: str, cell: Cell, data: Path, sweep_dir: Path) -> dict[str, Any]:
    """What training a cell needs, wherever it runs (a Ray trial here, a process of its own
    with ``record --direct``): its identity, seed, config, data and folder."""
    return {
        "cell_id": cell_id,
        "name": cell.name,
        "config_key": cell.config_key,
        "fingerprint": cell.fingerprint,
        "seed": cell.seed,
        "train": cell.train.to_dict(),
        "data": str(data),
        "cell_dir": str(sweep_dir / "cells" / cell_id),
    }


def trial_configs(
    todo: dict[str, Cell],
    params: dict[str, Any],
    data: Path,
    sweep_dir: Path,
    uri: str,
    run_ids: dict[str, str],
) -> list[dict[str, Any]]:
    sweep = params["sweep"]
    return [
        {
            **cell_job(cell_id, cell, data, sweep_dir),
            "tracking_uri": uri,
            "run_id": run_ids[cell_id],
            "log_every": sweep.get("log_every", 10),
            "checkpoint_every": sweep.get("checkpoint_every", 50),
            "torch_threads": sweep.get("torch_threads", 1),
            "fault": os.environ.get(FAULT_ENV),
        }
        for cell_id, cell in todo.items()
    ]


class SweepProgress:
    """Prints ``cells done / total, ~time left`` while the trials run (for ``dvc repro``).

    The time left is the iterations still to run, each at the mean seconds per iteration
    seen so far for its method (any method's mean before one is seen), divided by the
    trials that run at once.
    """

    def __init__(
        self, task: str, configs: list[dict[str, Any]], done_before: int, parallel: int, every: float = 30.0
    ):
        self.task, self.done_before, self.parallel, self.every = task, done_before, max(parallel, 1), every
        self.total = {c["cell_id"]: c["train"]["iterations"] for c in configs}
        self.method = {c["cell_id"]: c["train"]["method"] for c in configs}
        self.at: dict[str, int] = {}
        self.started: dict[str, tuple[float, int]] = {}
        self.finished: set[str] = set()
        self.seconds_per_it: dict[str, list[float]] = {}
        self.start = self.last = time.monotonic()

    def result(self, cell_id: str, iteration: int) -> None:
        now = time.monotonic()
        self.started.setdefault(cell_id, (now, iteration))
        t0, i0 = self.started[cell_id]
        self.at[cell_id] = iteration
        if iteration > i0:
            self.seconds_per_it[cell_id] = [(now - t0) / (iteration - i0)]
        if now - self.last >= self.every:
            self.print()

    def complete(self, cell_id: str) -> None:
        self.finished.add(cell_id)
        self.at[cell_id] = self.total.get(cell_id, 0)
        self.print()

    def eta_seconds(self) -> float | None:
        rates: dict[str, list[float]] = {}
        for cid, (rate,) in self.seconds_per_it.items():
            rates.setdefault(self.method[cid], []).append(rate)
        if not rates:
            return None
        every = [r for rs in rates.values() for r in rs]
        mean = {m: sum(rs) / len(rs) for m, rs in rates.items()}
        left = sum(
            (self.total[c] - self.at.get(c, 0)) * mean.get(self.method[c], sum(every) / len(every))
            for c in self.total
            if c not in self.finished
        )
        return left / min(self.parallel, max(len(self.total) - len(self.finished), 1))

    def print(self) -> None:
        self.last = time.monotonic()
        total = len(self.total) + self.done_before
        done = len(self.finished) + self.done_before
        eta = self.eta_seconds()
        left = "estimating time left" if eta is None else f"~{_minutes(eta)} left"
        print(
            f"sweep {self.task}: {done}/{total} cells done, {_minutes(self.last - self.start)} elapsed, {left}",
            flush=True,
        )


def _minutes(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


def _tune_callback(progress: SweepProgress):
    from ray.tune import Callback

    class _Progress(Callback):
        def on_trial_result(self, iteration, trials, trial, result, **info):
            progress.result(trial.config["cell_id"], int(result.get("iteration", 0)))

        def on_trial_complete(self, iteration, trials, trial, **info):
            progress.complete(trial.config["cell_id"])

    return _Progress()


def run_tuner(
    configs: list[dict[str, Any]],
    params: dict[str, Any],
    sweep_dir: Path,
    data: dict[str, Any] | None = None,
    progress: SweepProgress | None = None,
) -> None:
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler

    # One snapshot per checkpoint is what resuming needs; the warning about it is noise.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")

    sweep = params["sweep"]
    # Named by the cells it runs: re-running the same pending cells restores Tune's state;
    # a different set (cells finished or added) starts a fresh experiment over it.
    name = "tune-" + short_hash([c["cell_id"] for c in configs])
    storage = sweep_dir / "ray"
    by_id = {c["cell_id"]: c for c in configs}
    trainable = tune.with_resources(
        tune.with_parameters(tune_trainable, cells=by_id, data=data),
        {"cpu": sweep.get("cpus_per_trial", 1), "gpu": sweep.get("gpus_per_trial", 0)},
    )
    callbacks = [disk_full_callback(), *([_tune_callback(progress)] if progress is not None else [])]
    if tune.Tuner.can_restore(str(storage / name)):
        tuner = tune.Tuner.restore(
            str(storage / name), trainable, resume_unfinished=True, resume_errored=True
        )
    else:
        tuner = tune.Tuner(
            trainable,
            param_space={"cell_id": tune.grid_search(list(by_id))},
            tune_config=tune.TuneConfig(
                scheduler=FIFOScheduler(),
                max_concurrent_trials=sweep.get("max_concurrent") or None,
                reuse_actors=True,
                trial_name_creator=lambda trial: trial.config["cell_id"],
                trial_dirname_creator=lambda trial: trial.config["cell_id"],
            ),
            run_config=tune.RunConfig(
                name=name,
                storage_path=str(storage),  # must be absolute
                failure_config=tune.FailureConfig(max_failures=sweep.get("max_failures", 2)),
                checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                callbacks=callbacks,
                # Tune's own status table every few seconds drowns the progress lines.
                verbose=0 if progress is not None else 1,
            ),
        )
    if progress is not None:
        quiet_tune_output()  # the progress lines are this sweep's whole output
    try:
        tuner.fit()
    except Exception as err:  # a trial's full disk (DiskFull) or the driver's own
        full = as_disk_full(err, storage)
        if full is None:
            raise
        raise full from None


def summarize(task: str, cells: dict[str, Cell], sweep_dir: Path, root: Path) -> dict[str, Any]:
    """The stage's cached output. Deterministic given the finished cells, so a re-run that
    trains nothing leaves it unchanged and the stages after it are skipped."""
    rows = []
    for cell_id, cell in cells.items():
        cell_dir = sweep_dir / "cells" / cell_id
        done = checks.read_json(cell_dir / DONE)
        rows.append(
            {
                "cell_id": cell_id,
                "name": cell.name,
                "method": cell.method,
                "K": cell.sweeps,
                "L": cell.particles,
                "seed": cell.seed,
                "axes": dict(cell.axes),  # the swept settings (grid entry axes), {} for none
                "iterations": done["iterations"],
                "fingerprint": done.get("fingerprint"),
                # Reused across code changes (sweep.reuse_across_code): not this code's result.
                "trained_by_other_code": done.get("fingerprint") != cell.fingerprint,
                "mean_it_per_s": done["mean_it_per_s"],
                "final": done["final"],
                "checkpoint": os.path.relpath(cell_dir / MODEL, root),
                "checkpoint_sha256": done["checkpoint_sha256"],
                "history": os.path.relpath(cell_dir / HISTORY, root),
            }
        )
    return {"task": task, "cells": rows}


def estimated_cost(cell: Cell) -> float:
    """A cell's training cost in likelihood evaluations per dataset (``Method.model_evaluations``,
    else K*L per step), for ordering trials: the longest start first, so that one long trial
    does not run alone at the end (the rings' hmc-rws cell ran 22 minutes on one core so)."""
    counted = make_method(cell.train).model_evaluations(cell.sweeps, cell.particles)
    return cell.train.iterations * (counted[-1] if counted else cell.sweeps * cell.particles)


def run_sweep(params: dict[str, Any], task: str, root: Path, fetch: bool = False) -> dict[str, Any]:
    cells, data, sweep_dir = plan(params, task, root)
    lock = acquire_lock(sweep_dir, task)
    try:
        return _run_sweep(params, task, root, fetch, cells, data, sweep_dir)
    finally:
        lock.close()


def _run_sweep(
    params: dict[str, Any],
    task: str,
    root: Path,
    fetch: bool,
    cells: dict[str, Cell],
    data: Path,
    sweep_dir: Path,
) -> dict[str, Any]:
    for name in check_finished(sweep_dir, cells):
        print(
            f"sweep {task}: {name}'s model.pt does not match its done.json (damaged or changed); training it again"
        )
    pending = [(cid, cell) for cid, cell in cells.items() if not is_done(sweep_dir, cid)]
    todo = dict(sorted(pending, key=lambda item: -estimated_cost(item[1])))  # stable: grid order on ties
    print(
        f"sweep {task}: {len(cells)} cells, {len(cells) - len(todo)} already done, "
        f"{len(todo)} to {'fetch from MLflow' if fetch else 'train'}"
    )
    uri = tracking.tracking_uri(root)
    tracking.check_reachable(uri)
    client = tracking.client(uri)
    exp_name = tracking.experiment_name(params)
    sweep_key = f"{task}-{short_hash(list(cells))}"
    if fetch:
        parent = fetch_cells(client, exp_name, sweep_key, todo, sweep_dir)
        exp_id = client.get_experiment_by_name(exp_name).experiment_id
        todo = {}
    else:
        exp_id = tracking.experiment_id(client, exp_name, tracking.artifact_location(root))
        source = tracking.source_tags(
            root, "pipeline.sweep.stage", {"sweep": params["sweep"], task: params[task]}
        )
        parent = tracking.open_parent(
            client,
            exp_id,
            sweep_key,
            f"sweep/{sweep_key}",
            {"task": task, "sweep": params["sweep"], task: params[task]},
            source,
        )
    if todo:
        done = len(cells) - len(todo)
        train_on_ray(params, task, todo, done, data, sweep_dir, uri, client, exp_id, parent, source)
    failed = [cells[cid].name for cid in todo if not is_done(sweep_dir, cid)]
    if failed:
        tracking.finish(client, parent, "FAILED")
        raise SweepError(f"{len(failed)} cell(s) did not finish: {', '.join(failed)}; re-run to resume them")
    summary = summarize(task, cells, sweep_dir, root)
    summary["mlflow"] = {
        "tracking_uri": tracking.redact(uri),
        "experiment_id": exp_id,
        "parent_run_id": parent,
    }
    if not fetch:
        # What this invocation trained goes beside Ray's storage, not into the summary.
        last_run = json.dumps({"trained": sorted(todo), "skipped": sorted(set(cells) - set(todo))}, indent=2)
        atomic_write(sweep_dir / "last_run.json", lambda tmp: tmp.write_text(last_run + "\n"))
        tracking.retry(
            lambda: tracking.log_metrics(
                client, parent, [(0, {"cells": len(cells), "trained_this_run": len(todo)})]
            ),
            "logging the sweep's summary",
        )
        tracking.finish(client, parent)
    print(tracking.browse_hint(uri, exp_id))
    return summary


def train_on_ray(
    params: dict[str, Any],
    task: str,
    todo: dict[str, Cell],
    done: int,
    data: Path,
    sweep_dir: Path,
    uri: str,
    client,
    exp_id: str,
    parent: str,
    source: dict[str, str],
) -> None:
    """Train ``todo``'s cells as Ray Tune trials (``done``: the sweep's cells already done, for
    the progress lines), each logging to an MLflow child run of the sweep's ``parent`` run."""
    run_ids = {
        cid: tracking.open_child(
            client,
            exp_id,
            parent,
            cid,
            cell.name,
            # The swept keys under their grid names too (train.lr beside lr): columns in the UI.
            {"cell_id": cid, "seed": cell.seed, **cell.train.to_dict(), **dict(cell.axes)},
            source,
        )
        for cid, cell in todo.items()
    }
    import ray

    start_ray(params)
    try:
        check_resources(params)
        configs = trial_configs(todo, params, data, sweep_dir, uri, run_ids)
        sweep = params["sweep"]
        parallel = int(ray.cluster_resources().get("CPU", 1) // max(sweep.get("cpus_per_trial", 1), 1e-9))
        if sweep.get("max_concurrent"):
            parallel = min(parallel, sweep["max_concurrent"])
        progress = SweepProgress(task, configs, done, parallel)
        run_tuner(configs, params, sweep_dir, shipped_data(data), progress)
    finally:
        ray.shutdown()


def fetch_cells(client, exp_name: str, sweep_key: str, todo: dict[str, Cell], sweep_dir: Path) -> str:
    """Rebuild ``todo``'s cell directories from their MLflow child runs; return the parent id.

    Every file is checked: a run that is not FINISHED, or whose ``model.pt`` does not
    match the digest its ``done.json`` records, raises ``SweepError`` naming the cell.
    """
    experiment = client.get_experiment_by_name(exp_name)
    if experiment is None:
        raise SweepError(f"MLflow has no experiment {exp_name!r}; run the sweep first")
    found = tracking.find_run(client, experiment.experiment_id, {tracking.TAG_SWEEP: sweep_key})
    if found is None:
        raise SweepError(f"MLflow has no sweep {sweep_key} (the current grid) in experiment {exp_name!r}")
    parent = found.info.run_id
    for cell_id, cell in todo.items():
        run = tracking.find_run(
            client, experiment.experiment_id, {tracking.TAG_PARENT: parent, tracking.TAG_CELL: cell_id}
        )
        if run is None or run.info.status != "FINISHED":
            state = "missing" if run is None else run.info.status
            raise SweepError(f"cell {cell.name} is {state} in MLflow; train it first")
        cell_dir = sweep_dir / "cells" / cell_id
        cell_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            for name in (MODEL, HISTORY, DONE):
                client.download_artifacts(run.info.run_id, name, tmp)
            done = json.loads((Path(tmp) / DONE).read_text())
            if file_digest(Path(tmp) / MODEL) != done["checkpoint_sha256"]:
                raise SweepError(
                    f"cell {cell.name}: the model.pt in MLflow does not match its recorded digest"
                )
            for name in (MODEL, HISTORY, DONE):  # done.json last: it marks the cell finished
                data = (Path(tmp) / name).read_bytes()
                atomic_write(cell_dir / name, lambda out, data=data: out.write_bytes(data))
        print(f"fetched {cell.name} from run {run.info.run_id}")
    return parent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="apg-pipeline sweep", description="Ray Tune sweep over one task's grid (params.yaml)"
    )
    parser.add_argument("--task", required=True)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default=None, help="summary JSON (default results/<task>/sweep.json)")
    parser.add_argument(
        "--fetch",
        action="store_true",
        help="train nothing: rebuild the finished cells from the MLflow server's records",
    )
    args = parser.parse_args(argv)
    from pipeline.errors import run_guarded

    def work() -> None:
        params = load_params(args.params)
        if args.task not in params["tasks"]:
            raise ValueError(f"task {args.task!r} is not listed in tasks: {params['tasks']}")
        root = project_root()
        start = time.monotonic()
        summary = run_sweep(params, args.task, root, fetch=args.fetch)
        out = Path(args.out or root / "results" / args.task / "sweep.json")
        text = json.dumps(summary, indent=2)
        atomic_write(out, lambda tmp: tmp.write_text(text + "\n"))
        # A rerun that found every cell done (a refactor that kept every fingerprint) keeps the
        # time of the run that trained them: the report's Time table is the training's.
        last_run = root / params["sweep"].get("storage", "results/sweeps") / args.task / "last_run.json"
        if args.fetch or not last_run.is_file() or checks.read_json(last_run)["trained"]:
            record_stage_time(root, "sweep", args.task, time.monotonic() - start)
        print(f"wrote {out}")

    run_guarded(work)


if __name__ == "__main__":
    main()
