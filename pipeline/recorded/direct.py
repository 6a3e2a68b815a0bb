"""The stages of a recorded run without Ray, MLflow or DVC: one machine, one GPU.

``apg-pipeline record <profile> --direct`` runs here instead of ``dvc repro`` in the
profile's sandbox, for a machine where only PyTorch is installed (a single GPU machine, a
notebook server): ``generate`` as the stage does it, every grid cell trained in its own
process at once on the one device (each writes the cell files a sweep trial writes:
``model.pt``, ``history.csv``, ``done.json``), the sweep's ``sweep.json``, then the
``evaluate`` stage on the device. What comes out is what ``dvc repro`` would have made in
the sandbox, so ``pipeline.recorded.record.collect`` keeps it the same way.

With ``minutes``, the iterations are set from the clock: every cell first times a few
steps while all of them run at once (the device is shared as in training), and all
cells then train for the same number of iterations, the most the slowest cell fits
into ``minutes`` (a multiple of ``log_every``). The learning-rate schedule is built
for that number from the start, so a rerun with ``iterations`` set to it in the params
trains the same way; the manifest and the run's params record it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from apg.checkpoint import load_checkpoint
from apg.data import atomic_write, training_rows
from apg.training import TrainConfig
from pipeline.common import file_digest, seed_everything
from pipeline.config.params import cell_key
from pipeline.generate import generate
from pipeline.provenance.stages import record_stage_time
from pipeline.runs.loop import PrintProgress, cell_identity, drive, mark_done, start, write_cell
from pipeline.sweep.stage import cell_job, plan, summarize

CALIBRATION_STEPS = 5  # timed one by one after two warm-up steps; their median plans the run


def run_direct(
    sandbox: Path,
    device: str,
    minutes: float | None,
    log_every: int,
    stages: str = "all",
    deadline: float | None = None,
    starts: dict[str, dict[str, dict[str, str]]] | None = None,
) -> None:
    """In ``sandbox``: generate and train every cell (``stages`` "all" or "train"), evaluate
    every cell (``stages`` "all" or "evaluate": a sandbox whose training is done). Its
    ``params.yaml`` is rewritten with the iterations when ``minutes`` sets them; a cell
    still training at ``deadline`` (``time.time()``) stops there and keeps what it has
    (``done.json`` says so). With ``starts`` (per task, ``cell_key`` -> ``path``
    and ``sha256`` of a checkpoint), every cell starts from those weights instead of afresh.
    Each stage's time goes to ``results/timings`` as the DVC stages' does."""
    from pipeline.evaluate.stage import evaluate_task

    params_path = sandbox / "params.yaml"
    params = yaml.safe_load(params_path.read_text())
    for task in params["tasks"] if stages in ("all", "train") else []:
        t0 = time.monotonic()
        generate(task, params, sandbox / "data" / task)
        record_stage_time(sandbox, "generate", task, time.monotonic() - t0)
        print(f"direct: generate@{task} {time.monotonic() - t0:.0f} s", flush=True)
        t0 = time.monotonic()
        if minutes is not None:
            cells, data, sweep_dir = plan(params, task, sandbox)
            inits = _starting_checkpoints(cells, starts, task)
            per_step = max(_run_cells(cells, data, sweep_dir, device, log_every, None, inits, calibrate=True))
            iterations = max(log_every, int(minutes * 60 / per_step) // log_every * log_every)
            print(
                f"direct: {task}: slowest cell {per_step:.3f} s/step at once -> {iterations} iterations",
                flush=True,
            )
            set_iterations(params, task, iterations)
            params_path.write_text(yaml.safe_dump(params, sort_keys=False))
        cells, data, sweep_dir = plan(params, task, sandbox)
        inits = _starting_checkpoints(cells, starts, task)
        _run_cells(cells, data, sweep_dir, device, log_every, deadline, inits, calibrate=False)
        summary = summarize(task, cells, sweep_dir, sandbox)
        out = sandbox / "results" / task / "sweep.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, lambda tmp, s=summary: tmp.write_text(json.dumps(s, indent=2) + "\n"))
        record_stage_time(sandbox, "sweep", task, time.monotonic() - t0)
    for task in params["tasks"] if stages in ("all", "evaluate") else []:
        if not (sandbox / "results" / task / "sweep.json").is_file():
            raise ValueError(f"{sandbox} has no trained cells of {task}; run the training stages first")
        t0 = time.monotonic()
        # Trained on another machine: the held-out sets are made again from their seeds.
        if not (sandbox / "data" / task).is_dir():
            generate(task, params, sandbox / "data" / task)
        seed_everything(0)
        evaluate_task(params, task, sandbox, sandbox / "results" / "eval" / task, device)
        record_stage_time(sandbox, "evaluate", task, time.monotonic() - t0)
        print(f"direct: evaluate@{task} {time.monotonic() - t0:.0f} s", flush=True)


def set_iterations(params: dict[str, Any], task: str, iterations: int) -> None:
    """Every cell of ``task`` that learns trains ``iterations`` steps (cells whose grid
    entry trains nothing, such as exact Gibbs, keep their 0)."""
    section = params[task]
    section["train"]["iterations"] = iterations
    for entry in section["grid"]:
        if entry.get("train", {}).get("iterations", 1) != 0:
            entry.get("train", {}).pop("iterations", None)


def _starting_checkpoints(cells, starts, task: str) -> dict[str, dict[str, str] | None]:
    """Per cell id: the checkpoint it starts from (``None``: from scratch)."""
    if starts is None:
        return {cell_id: None for cell_id in cells}
    by_key, out = starts.get(task, {}), {}
    for cell_id, cell in cells.items():
        key = cell_key(cell.train.method, cell.train.sweeps, cell.train.particles, cell.seed)
        if key not in by_key:
            raise ValueError(
                f"cell {cell.name} has no trained cell to start from (known: {', '.join(sorted(by_key))})"
            )
        out[cell_id] = by_key[key]
    return out


def _run_cells(
    cells,
    data: Path,
    sweep_dir: Path,
    device: str,
    log_every: int,
    deadline: float | None,
    inits: dict[str, dict[str, str] | None],
    calibrate: bool,
) -> list[float]:
    """One process per cell, all at once; each prints one JSON line last (its s/step when
    calibrating). A failed cell stops the run with its last line of error."""
    procs = []
    for cell_id, cell in cells.items():
        job = {
            **cell_job(cell_id, cell, data, sweep_dir),
            "device": device,
            "log_every": log_every,
            "deadline": deadline,
            "calibrate": calibrate,
            "init": inits[cell_id],
        }
        cmd = [sys.executable, "-m", "pipeline.recorded.direct", json.dumps(job)]
        procs.append((cell.name, subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)))
    last: dict[str, str] = {}

    def forward(name: str, proc: subprocess.Popen) -> None:  # each cell's lines as they come
        for line in proc.stdout:
            last[name] = line
            if not calibrate:
                print(f"  {line}", end="", flush=True)  # the cell's PrintProgress line

    threads = [threading.Thread(target=forward, args=item) for item in procs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results = []
    for name, proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"direct: cell {name} failed (exit {proc.returncode}); see its error above")
        results.append(json.loads(last[name])["seconds_per_step"])
    return results


def train_one(job: dict[str, Any]) -> dict[str, Any]:
    """Train (or time) one cell in this process; the cell files a sweep trial writes."""
    torch.set_num_threads(1)
    cfg = TrainConfig.from_dict(job["train"])
    cell_dir = Path(job["cell_dir"])
    trainer = start(cfg, training_rows(job["data"]), job["device"], job["seed"])
    init = job.get("init")
    if init is not None:  # a curriculum's later step: the trained networks, a fresh optimizer
        if file_digest(init["path"]) != init["sha256"]:
            raise ValueError(
                f"{init['path']} is not the checkpoint {init['sha256'][:12]} this cell starts from"
            )
        _, state = load_checkpoint(init["path"], map_location=job["device"])
        trainer.model.load_state_dict(state["model"])
        trainer.proposals.load_state_dict(state["proposals"])
    sync = torch.cuda.synchronize if torch.device(job["device"]).type == "cuda" else (lambda: None)
    if job["calibrate"]:
        for _ in range(2):
            trainer.step(log=False)
        # Each step timed on its own (not read back, as training runs them) and the median
        # kept: a compiled cell's first steps after its warm-up can still be recording CUDA
        # graphs. Their mean gave 0.283 s/step for Bouncing MNIST's APG on an H100, where its
        # training then ran at 0.11-0.14 s, so the run was planned half full.
        times = []
        for _ in range(CALIBRATION_STEPS):
            sync()
            t0 = time.perf_counter()
            trainer.step(log=False)
            sync()
            times.append(time.perf_counter() - t0)
        return {"seconds_per_step": statistics.median(times)}
    cell_dir.mkdir(parents=True, exist_ok=True)
    outcome = drive(
        trainer, log_every=job["log_every"], deadline=job["deadline"], callbacks=[PrintProgress(job["name"])]
    )
    attempts = [{"start_iteration": 0, "device": job["device"]}]
    _, record = write_cell(cell_dir, cfg, trainer, outcome, cell_identity(job), attempts)
    record.update(
        device=torch.cuda.get_device_name() if torch.device(job["device"]).type == "cuda" else "cpu",
        # The deadline came first: fewer steps than planned, the schedule cut short.
        stopped_at_deadline={"planned_iterations": cfg.iterations} if outcome.stopped_at_deadline else None,
        started_from={"checkpoint_sha256": init["sha256"]} if init is not None else None,
    )
    mark_done(cell_dir, record)
    return {"seconds_per_step": outcome.seconds / max(trainer.iteration, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="train one cell (internal: pipeline.recorded.direct.run_direct)"
    )
    parser.add_argument("job", help="the cell's job as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print(json.dumps(train_one(json.loads(args.job))), flush=True)


if __name__ == "__main__":
    main()
