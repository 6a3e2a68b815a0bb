"""Stage ``sweep``: one Ray Tune trial per cell (task, method, K, L, seed) of a task's grid.

``python -m pipeline.sweep --task gmm`` trains every cell of ``<task>.grid`` and writes
``results/<task>/sweep.json`` (the stage's small cached output: every cell's final
checkpoint, its digest and final metrics) and ``<storage>/<task>/last_run.json`` (which
cells this invocation trained and which it skipped as finished). Ray's storage and the per-cell outputs live
under ``<sweep.storage>/<task>/`` and persist between runs, which is how:

- a finished cell (``cells/<cell_id>/done.json`` exists) is never trained again, so an
  interrupted sweep resumes with only the rest, and cells added to the grid later run
  without rerunning old ones; a cell's id hashes its whole config and the training
  data, so a changed option is a new cell;
- an unfinished cell restarts from its last checkpoint: Tune's (``FailureConfig``
  restarts, ``Tuner.restore``) or, when Tune's experiment state is gone, the cell's own
  ``resume.pt``.

Scheduling is FIFO: a fixed-budget comparison needs every cell trained to its end.
Ray is embedded and local by default; ``RAY_ADDRESS`` or ``sweep.ray_address`` attaches
to a cluster (storage must then be a filesystem every node sees).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from apg.checkpoint import load_checkpoint, save_checkpoint
from apg.data import atomic_write, load_dataset
from apg.training import TrainConfig, Trainer, build
from pipeline import tracking
from pipeline.common import file_digest, project_root, seed_everything
from pipeline.config import Cell, grid_cells, load_params

DONE = "done.json"
RESUME = "resume.pt"
MODEL = "model.pt"
HISTORY = "history.csv"


class SweepError(ValueError):
    """The sweep could not run or some cells did not finish (one-line message; a
    ``ValueError`` so entry points report it like any other bad input)."""


# --------------------------------------------------------------------------- planning


def plan(params: dict[str, Any], task: str, root: Path) -> tuple[dict[str, Cell], Path, Path]:
    """``({cell_id: cell}, training data path, sweep directory)`` for the current grid."""
    data = root / "data" / task / "train.npz"
    if not data.is_file():
        raise SweepError(f"training data {data} not found; run the generate stage first")
    digest = file_digest(data)
    cells = {cell.cell_id(digest + architecture_digest(cell)): cell for cell in grid_cells(params, task)}
    sweep_dir = (root / params["sweep"].get("storage", "results/sweeps") / task).resolve()
    return cells, data.resolve(), sweep_dir


def architecture_digest(cell: Cell) -> str:
    """Hash of every parameter's name and shape for the cell's model and proposals.

    A library change that alters the networks makes old checkpoints unloadable, so it must
    make a new cell; any other code edit keeps finished cells (retraining on every edit
    would defeat resuming)."""
    model, proposals = build(cell.train)
    shapes = [(f"{prefix}.{k}", tuple(v.shape)) for prefix, module in (("model", model), ("proposals", proposals))
              for k, v in module.state_dict().items()]
    return hashlib.sha256(repr(sorted(shapes)).encode()).hexdigest()[:12]


def is_done(sweep_dir: Path, cell_id: str) -> bool:
    return (sweep_dir / "cells" / cell_id / DONE).is_file()


def short_hash(items: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(items)).encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- the trial


def tune_trainable(config: dict[str, Any], cells: dict[str, dict[str, Any]]) -> None:
    """What Tune runs: the grid searches over cell ids (short, readable in Tune's table);
    the cells' full configs come through ``tune.with_parameters``."""
    train_cell(cells[config["cell_id"]])


def train_cell(config: dict[str, Any]) -> None:
    """Ray Tune trainable: train one cell, report metrics, checkpoint, record its outputs."""
    import ray
    from ray import tune

    torch.set_num_threads(config["torch_threads"])
    cfg = TrainConfig.from_dict(config["train"])
    cell_dir = Path(config["cell_dir"])
    cell_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(config["seed"])
    # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it assigned, but no longer hides GPUs
    # from trials that asked for none: only use a GPU that Ray gave this trial.
    device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
    x = torch.from_numpy(load_dataset(config["data"])["x"])
    trainer = Trainer(cfg, x, device)
    history: list[dict[str, float]] = []
    resumed = _resume_state(tune.get_checkpoint(), cell_dir / RESUME)
    if resumed is not None:
        trainer.load_state_dict(resumed["trainer"])
        history = list(resumed["history"])

    client = tracking.client(config["tracking_uri"])
    run_id = config["run_id"]
    log_every, ckpt_every = config["log_every"], config["checkpoint_every"]
    start, window_start, window_iters = time.perf_counter(), time.perf_counter(), 0
    while trainer.iteration < cfg.iterations:
        metrics = trainer.step()
        window_iters += 1
        last = trainer.iteration == cfg.iterations
        if trainer.iteration % log_every and not last:
            continue
        row = {"iteration": trainer.iteration, **metrics, "it_per_s": window_iters / (time.perf_counter() - window_start)}
        window_start, window_iters = time.perf_counter(), 0
        history.append(row)
        tracking.log_metrics(client, run_id, [(trainer.iteration, {k: v for k, v in row.items() if k != "iteration"})])
        if trainer.iteration % ckpt_every == 0 or last:
            state = {"trainer": trainer.state_dict(), "history": history}
            save_checkpoint(cell_dir / RESUME, cfg.to_dict(), state)
            with tempfile.TemporaryDirectory() as tmp:
                save_checkpoint(Path(tmp) / RESUME, cfg.to_dict(), state)
                tune.report(row, checkpoint=tune.Checkpoint.from_directory(tmp))
        else:
            tune.report(row)
    _finish_cell(config, cfg, trainer, history, time.perf_counter() - start, client)


def _resume_state(checkpoint, fallback: Path) -> dict[str, Any] | None:
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            return load_checkpoint(Path(d) / RESUME)[1]
    if fallback.is_file():
        return load_checkpoint(fallback)[1]
    return None


def _finish_cell(config: dict[str, Any], cfg: TrainConfig, trainer: Trainer, history: list[dict], seconds: float, client) -> None:
    """Write the cell's outputs; ``done.json`` last, since it marks the cell finished."""
    cell_dir = Path(config["cell_dir"])
    model_path = save_checkpoint(cell_dir / MODEL, cfg.to_dict(), trainer.state_dict())
    write_history(cell_dir / HISTORY, history)
    for path in (model_path, cell_dir / HISTORY):
        client.log_artifact(config["run_id"], str(path))
    final = {k: v for k, v in (history[-1] if history else {}).items() if k != "iteration"}
    rates = [row["it_per_s"] for row in history]
    done = {
        "cell_id": config["cell_id"],
        "name": config["name"],
        "iterations": trainer.iteration,
        "seconds_this_run": seconds,
        "mean_it_per_s": sum(rates) / len(rates) if rates else None,
        "final": final,
        "checkpoint_sha256": file_digest(model_path),
    }
    tracking.log_metrics(client, config["run_id"], [(trainer.iteration, {f"final_{k}": v for k, v in final.items()})])
    text = json.dumps(done, indent=2)
    atomic_write(cell_dir / DONE, lambda tmp: tmp.write_text(text))
    (cell_dir / RESUME).unlink(missing_ok=True)
    tracking.finish(client, config["run_id"])


def write_history(path: Path, rows: list[dict[str, float]]) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            if rows:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)

    atomic_write(path, write)


# --------------------------------------------------------------------------- the driver


def ray_address(params: dict[str, Any]) -> str | None:
    return os.environ.get("RAY_ADDRESS") or params["sweep"].get("ray_address")


def check_ray_address(address: str, timeout: float = 5.0) -> None:
    """Fail within seconds naming an unreachable ``host:port`` instead of hanging."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise SweepError(f"Ray address {address!r} is not 'auto' or host:port")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as err:
        raise SweepError(f"Ray cluster at {address} is unreachable ({err})") from None


def start_ray(params: dict[str, Any]) -> None:
    import ray

    address = ray_address(params)
    if address:
        check_ray_address(address)
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    else:
        # "local" always starts a fresh instance; plain ray.init() silently attaches to any
        # cluster already running on the machine.
        ray.init(address="local", num_cpus=params["sweep"].get("num_cpus"), include_dashboard=False)


def check_resources(params: dict[str, Any]) -> None:
    """Fail now, not after trials pend forever, if no node can fit one trial."""
    import ray

    sweep = params["sweep"]
    have = ray.cluster_resources()
    for key, name in (("cpus_per_trial", "CPU"), ("gpus_per_trial", "GPU")):
        want = sweep.get(key, 1 if name == "CPU" else 0)
        if want and have.get(name, 0) < want:
            raise SweepError(f"sweep.{key}={want} but the Ray cluster has {have.get(name, 0):g} {name}s")


def trial_configs(
    todo: dict[str, Cell], params: dict[str, Any], data: Path, sweep_dir: Path, uri: str, run_ids: dict[str, str]
) -> list[dict[str, Any]]:
    sweep = params["sweep"]
    return [
        {
            "cell_id": cell_id,
            "name": cell.name,
            "seed": cell.seed,
            "train": cell.train.to_dict(),
            "data": str(data),
            "cell_dir": str(sweep_dir / "cells" / cell_id),
            "tracking_uri": uri,
            "run_id": run_ids[cell_id],
            "log_every": sweep.get("log_every", 10),
            "checkpoint_every": sweep.get("checkpoint_every", 50),
            "torch_threads": sweep.get("torch_threads", 1),
        }
        for cell_id, cell in todo.items()
    ]


def run_tuner(configs: list[dict[str, Any]], params: dict[str, Any], sweep_dir: Path) -> None:
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
        tune.with_parameters(tune_trainable, cells=by_id),
        {"cpu": sweep.get("cpus_per_trial", 1), "gpu": sweep.get("gpus_per_trial", 0)},
    )
    if tune.Tuner.can_restore(str(storage / name)):
        tuner = tune.Tuner.restore(str(storage / name), trainable, resume_unfinished=True, resume_errored=True)
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
                verbose=1,
            ),
        )
    tuner.fit()


def summarize(task: str, cells: dict[str, Cell], sweep_dir: Path, root: Path) -> dict[str, Any]:
    """The stage's cached output. Deterministic given the finished cells, so a re-run that
    trains nothing leaves it unchanged and the stages after it are skipped."""
    rows = []
    for cell_id, cell in cells.items():
        cell_dir = sweep_dir / "cells" / cell_id
        done = json.loads((cell_dir / DONE).read_text())
        rows.append(
            {
                "cell_id": cell_id,
                "name": cell.name,
                "method": cell.method,
                "K": cell.sweeps,
                "L": cell.particles,
                "seed": cell.seed,
                "iterations": done["iterations"],
                "mean_it_per_s": done["mean_it_per_s"],
                "final": done["final"],
                "checkpoint": os.path.relpath(cell_dir / MODEL, root),
                "checkpoint_sha256": done["checkpoint_sha256"],
                "history": os.path.relpath(cell_dir / HISTORY, root),
            }
        )
    return {"task": task, "cells": rows}


def run_sweep(params: dict[str, Any], task: str, root: Path) -> dict[str, Any]:
    cells, data, sweep_dir = plan(params, task, root)
    todo = {cid: cell for cid, cell in cells.items() if not is_done(sweep_dir, cid)}
    print(f"sweep {task}: {len(cells)} cells, {len(cells) - len(todo)} already done, {len(todo)} to train")
    uri = tracking.tracking_uri(root)
    tracking.check_reachable(uri)
    client = tracking.client(uri)
    exp_id = tracking.experiment_id(client, params.get("tracking", {}).get("experiment", "apg"), tracking.artifact_location(root))
    sweep_key = f"{task}-{short_hash(list(cells))}"
    parent = tracking.open_parent(client, exp_id, sweep_key, f"sweep/{sweep_key}", {"task": task, "sweep": params["sweep"], task: params[task]})
    if todo:
        run_ids = {
            cid: tracking.open_child(client, exp_id, parent, cid, cell.name, {"cell_id": cid, "seed": cell.seed, **cell.train.to_dict()})
            for cid, cell in todo.items()
        }
        import ray

        start_ray(params)
        try:
            check_resources(params)
            run_tuner(trial_configs(todo, params, data, sweep_dir, uri, run_ids), params, sweep_dir)
        finally:
            ray.shutdown()
    failed = [cells[cid].name for cid in todo if not is_done(sweep_dir, cid)]
    if failed:
        tracking.finish(client, parent, "FAILED")
        raise SweepError(f"{len(failed)} cell(s) did not finish: {', '.join(failed)}; re-run to resume them")
    summary = summarize(task, cells, sweep_dir, root)
    summary["mlflow"] = {"tracking_uri": uri, "experiment_id": exp_id, "parent_run_id": parent}
    # What this invocation trained goes beside Ray's storage, not into the summary.
    last_run = json.dumps({"trained": sorted(todo), "skipped": sorted(set(cells) - set(todo))}, indent=2)
    atomic_write(sweep_dir / "last_run.json", lambda tmp: tmp.write_text(last_run + "\n"))
    tracking.log_metrics(client, parent, [(0, {"cells": len(cells), "trained_this_run": len(todo)})])
    tracking.finish(client, parent)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Ray Tune sweep over one task's grid (params.yaml)")
    parser.add_argument("--task", required=True)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default=None, help="summary JSON (default results/<task>/sweep.json)")
    args = parser.parse_args(argv)
    from pipeline.cli import run_guarded

    def work() -> None:
        params = load_params(args.params)
        if args.task not in params["tasks"]:
            raise ValueError(f"task {args.task!r} is not listed in tasks: {params['tasks']}")
        root = project_root()
        summary = run_sweep(params, args.task, root)
        out = Path(args.out or root / "results" / args.task / "sweep.json")
        text = json.dumps(summary, indent=2)
        atomic_write(out, lambda tmp: tmp.write_text(text + "\n"))
        print(f"wrote {out}")

    run_guarded(work)


if __name__ == "__main__":
    main()
