"""Benchmark: every cell of the paper's configuration at its per-step sizes, and what the
full paper-scale run would cost.

For each task of the ``paper`` profile (``profiles/paper.yaml``) and each distinct (method,
K, L) of its grid, a
fresh process builds the cell's trainer exactly as the sweep would (paper batch size,
dataset sizes, networks, method options), trains it for a warm-up step and ``--steps``
timed steps on ``B`` simulated datasets, and reports the median seconds per step and the
process's peak resident memory (each cell in its own process, so each peak is its own).
The training set's size on disk comes from the same simulated datasets (bytes per dataset
in the params' storage dtype, times the paper's dataset count). The full cost is then
cells x iterations x seconds per step, shown per row with its arithmetic.

    python bench/paper_scale.py [--params paper] [--steps 3] [--threads 1]
        [--tasks gmm dgmm bmnist] [--methods apg rws-mlp] [--pairs 10x10] [--json OUT]
        [--markdown OUT] [--device cuda] [--compile] [--wait-for FILE]

``--compile`` trains every cell whose method allows it with ``TrainConfig.compile`` (one
``torch.compile`` graph, or for Bouncing MNIST's APG one graph per unit of its sampler; CUDA
graphs in each on a GPU) and reports its warm-up apart.

Timed steps are unlogged (``Trainer.step(log=False)``: on a GPU nothing is read back).
On a GPU (``--device cuda``) each step is timed between ``torch.cuda.synchronize()`` calls
(``s/step``: the step's latency, host launch included), and the same number of steps is then
run back to back with one synchronization at the end (``queued``: what training gets when
the host launches the next step while the GPU still runs the last); the peak is the
device's allocated memory (``torch.cuda.max_memory_allocated``, reset per cell), and the
cells run one after another in this process (one CUDA start-up, not one per cell); a cell
that fails is reported with its error and the others still run.

Bouncing MNIST reads MNIST from ``$APG_MNIST_DIR``. It measures wall time: run it on an
otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def vm_hwm_mb() -> float:
    """Peak resident set size of this process in MB (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def plan(
    params_file: str | Path,
    tasks: list[str] | None,
    methods: list[str] | None = None,
    pairs: list[str] | None = None,
) -> list[dict]:
    """One row per (task, method, K, L) of the grid: the cell's config and how many cells
    (seeds, roles) of the grid share it; only ``methods`` and ``pairs`` ("KxL") if given.
    ``params_file``: a params file or a profile's name."""
    from pipeline.config.params import grid_cells
    from pipeline.config.profiles import load

    params = load(params_file)
    rows: dict[tuple, dict] = {}
    for task in tasks or params["tasks"]:
        section = params[task]
        for cell in grid_cells(params, task):
            if (
                methods
                and cell.method not in methods
                or pairs
                and f"{cell.sweeps}x{cell.particles}" not in pairs
            ):
                continue
            key = (task, cell.method, cell.sweeps, cell.particles)
            row = rows.setdefault(
                key,
                {
                    "task": task,
                    "method": cell.method,
                    "K": cell.sweeps,
                    "L": cell.particles,
                    "train": cell.train.to_dict(),
                    "sizes": section["data"]["train"].get("sizes", {}),
                    "num_datasets": section["data"]["train"]["num_datasets"],
                    "x_dtype": section["data"].get("x_dtype", "float32"),
                    "cells": 0,
                },
            )
            row["cells"] += 1
    return list(rows.values())


def cell_trainer(row: dict, device: str = "cpu", compile_: bool = False) -> tuple:
    """The row's trainer as the sweep would build it, on ``B`` simulated datasets:
    ``(trainer, compiled, simulate_seconds_per_dataset, bytes_per_dataset)``."""
    import numpy as np
    import torch

    from apg.baselines import METHODS
    from apg.tasks.simulation import simulate_set
    from apg.training import TrainConfig, Trainer

    torch.manual_seed(0)
    compiled = compile_ and METHODS[row["method"]].not_compiled_because is None
    cfg = TrainConfig.from_dict({**row["train"], "compile": compiled})
    start = time.perf_counter()
    arrays = simulate_set(cfg.task, cfg.model, cfg.batch_size, 0, row["sizes"])
    simulate_seconds = (time.perf_counter() - start) / cfg.batch_size
    arrays["x"] = arrays["x"].astype(np.dtype(row["x_dtype"]))
    bytes_per_dataset = sum(a.nbytes for a in arrays.values()) / cfg.batch_size
    return Trainer(cfg, torch.from_numpy(arrays["x"]), device), compiled, simulate_seconds, bytes_per_dataset


def measure(
    row: dict,
    steps: int,
    threads: int,
    device: str = "cpu",
    compile_: bool = False,
    wait_for: str | None = None,
) -> dict:
    """Time one cell's training steps in this process (called in a fresh subprocess on a CPU).
    With ``compile_``, cells whose method compiles train with ``TrainConfig.compile``; their
    first steps (tracing, code generation, CUDA graph capture) are timed apart."""
    import torch

    torch.set_num_threads(threads)
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer, compiled, simulate_seconds, bytes_per_dataset = cell_trainer(row, device, compile_)
    start = time.perf_counter()
    # warm-up: first-call costs (kernel compilation, allocator; compiled: tracing, code
    # generation and, on a GPU, CUDA graph recording over the first calls) once per trial
    for _ in range(3 if compiled else 1):
        trainer.step(log=False)
    sync()
    warmup_seconds = time.perf_counter() - start
    # Another run on the same GPU (a compilation beside eager timings) times its cells only
    # once the other's are done, so neither's steps share the device.
    while wait_for is not None and not Path(wait_for).exists():
        time.sleep(0.5)
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        trainer.step(log=False)
        sync()
        times.append(time.perf_counter() - t0)
    queued = None
    if cuda:
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.step(log=False)
        sync()
        queued = (time.perf_counter() - t0) / steps
    return {
        "compiled": compiled,
        "warmup_seconds": warmup_seconds,
        "seconds_per_step": statistics.median(times),
        "step_seconds": times,
        "queued_seconds_per_step": queued,
        "peak_rss_mb": vm_hwm_mb(),
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "train_set_gb": bytes_per_dataset * row["num_datasets"] / 1e9,
        "simulate_seconds_per_dataset": simulate_seconds,
    }


def full_cost(row: dict) -> dict:
    """Hours for every cell of this row at the paper's iterations, one trial at a time."""
    iterations = row["train"]["iterations"]
    hours = row["cells"] * iterations * row["seconds_per_step"] / 3600
    arithmetic = f"{row['cells']} x {iterations:,} x {row['seconds_per_step']:.3g} s"
    return {"iterations": iterations, "hours": hours, "arithmetic": arithmetic}


def markdown(rows: list[dict], meta: dict) -> str:
    gpu = meta.get("device", "cpu") != "cpu"
    where = "one process, cells one after another" if gpu else "each cell in its own process"
    lines = [
        f"Paper per-step sizes (`{meta['params']}`), {meta['threads']} thread(s), median of "
        f"{meta['steps']} steps after a warm-up, {where}; {meta['machine']}.",
        "",
        f"| task | method | K | L | B | s/step |{' queued s/step |' if gpu else ''} "
        f"{'peak GPU memory' if gpu else 'peak RSS'} (MB) | train set (GB) "
        "| cells | full run: cells x iterations x s/step | hours |",
        "| --- | --- | ---: | ---: | ---: | ---: |"
        + (" ---: |" if gpu else "")
        + " ---: | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(
                f"| {r['task']} | {r['method']} | {r['K']} | {r['L']} | {r['train']['batch_size']} | "
                f"failed: {r['error']} |{' |' if gpu else ''} | | {r['cells']} | | |"
            )
            continue
        peak = r["peak_gpu_mb"] if gpu else r["peak_rss_mb"]
        compiled = f" (compiled; warm-up {r['warmup_seconds']:.0f} s)" if r.get("compiled") else ""
        lines.append(
            f"| {r['task']} | {r['method']} | {r['K']} | {r['L']} | {r['train']['batch_size']} | "
            f"{r['seconds_per_step']:.3g}{compiled} |"
            + (f" {r['queued_seconds_per_step']:.3g} |" if gpu else "")
            + f" {peak:.0f} | {r['train_set_gb']:.2f} | {r['cells']} | "
            f"{r['cost']['arithmetic']} | {r['cost']['hours']:.1f} |"
        )
    rows = [r for r in rows if not r.get("error")]
    by_task: dict[str, float] = {}
    for r in rows:
        by_task[r["task"]] = by_task.get(r["task"], 0.0) + r["cost"]["hours"]
    total = sum(by_task.values())
    lines += [
        "",
        "Total, one trial at a time: "
        + " + ".join(f"{t} {h:.0f} h" for t, h in by_task.items())
        + f" = **{total:.0f} h** (divide by the trials that run at once).",
    ]
    return "\n".join(lines)


def write(rows: list[dict], args: argparse.Namespace) -> str:
    """The rows measured so far as markdown (returned) and, where asked, files."""
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    )
    if args.device != "cpu":
        import torch

        machine = f"{torch.cuda.get_device_name(args.device)}, torch {torch.__version__}; host {machine}"
    meta = {
        "params": os.path.relpath(args.params, REPO) if Path(args.params).is_file() else args.params,
        "steps": args.steps,
        "threads": args.threads,
        "device": args.device,
        "compile": args.compile,
        "machine": machine,
    }
    text = markdown(rows, meta)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return text


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--params", default="paper", help="a profile's name or a params file")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tasks", nargs="*", default=None)
    parser.add_argument("--methods", nargs="*", default=None, help="only these methods")
    parser.add_argument("--pairs", nargs="*", default=None, help="only these budgets, as KxL (10x10)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: cells in this process on the GPU")
    parser.add_argument(
        "--compile", action="store_true", help="train with TrainConfig.compile where the method allows it"
    )
    parser.add_argument(
        "--wait-for",
        default=None,
        help="a file: time a cell only once it exists (warm-up and compilation go first)",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a row as JSON: measure it here
    args = parser.parse_args(argv)
    if args.one is not None:
        print(
            json.dumps(measure(json.loads(args.one), args.steps, args.threads, compile_=args.compile)),
            flush=True,
        )
        return []
    rows = plan(args.params, args.tasks, args.methods, args.pairs)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done: list[dict] = []
    text = write(done, args)
    for row in rows:
        if args.device != "cpu":
            try:
                row.update(measure(row, args.steps, args.threads, args.device, args.compile, args.wait_for))
            except Exception as err:  # noqa: BLE001 - one failing cell must not hide the others' numbers
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
                print(
                    f"{row['task']:7s} {row['method']:16s} K={row['K']:<3d} L={row['L']:<4d} {row['error']}",
                    flush=True,
                )
        else:
            cmd = [
                sys.executable,
                __file__,
                "--one",
                json.dumps(row),
                "--steps",
                str(args.steps),
                "--threads",
                str(args.threads),
                *(["--compile"] if args.compile else []),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
            if proc.returncode != 0:
                raise SystemExit(f"{row['task']}/{row['method']}: {proc.stderr.strip().splitlines()[-1]}")
            row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        if not row.get("error"):
            row["cost"] = full_cost(row)
            print(
                f"{row['task']:7s} {row['method']:16s} K={row['K']:<3d} L={row['L']:<4d} "
                f"{row['seconds_per_step']:.4f} s/step  {row['peak_rss_mb']:.0f} MB  "
                f"{row['cost']['hours']:.1f} h for {row['cost']['arithmetic']}",
                flush=True,
            )
        done.append(row)
        # written after every cell: a run stopped at a time limit keeps what it measured
        text = write(done, args)
    print(text)
    return rows


if __name__ == "__main__":
    main()
