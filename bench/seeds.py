"""Per-seed step time of S seeds of one cell trained in one process, at S = 1, 5, 10.

For each task's default cell (the first entry of its params.yaml grid: APG at its first
(K, L)), on the task's simulated training set, at one torch thread (as a trial trains), it
times side by side, round by round (so that a change of the machine's load touches every arm
alike):

- ``trainer``: one plain ``apg.training.Trainer``, the separate trial (the reference);
- ``seeds S``: ``apg.seeds.SeedTrainers`` with S seeds (S=1: the same path with one), its step
  time over S;
- ``fold S``: one plain Trainer at S times the batch, its step time over S: the bound a
  forward folded over seeds could reach (the same work with one call of every op per step,
  without per-seed weights or draws), not a way of training seeds.

Each arm's time is the median over ``--repeats`` rounds of the process CPU time of
``--steps`` steps (wall time beside it), after ``--warmup`` steps. Speed-up: the
trainer's per-seed time over the arm's.

    python bench/seeds.py [--tasks gmm dgmm] [--sizes 1 5 10] [--steps 5] [--repeats 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from apg.seeds import SeedTrainers
from apg.tasks.simulation import simulate_set
from apg.training import Trainer
from pipeline.config.params import grid_cells, load_params
from pipeline.provenance.record import machine, machine_line

ROOT = Path(__file__).resolve().parents[1]


def cpu_and_wall(step: Callable[[], object], steps: int) -> tuple[float, float]:
    """Process CPU and wall seconds of ``steps`` calls of ``step``, per call."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step()
    return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="*", default=["gmm", "dgmm"])
    parser.add_argument("--sizes", nargs="*", type=int, default=[1, 5, 10], help="seeds per process S")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (the median is reported)")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = load_params(ROOT / "params.yaml")
    print(f"machine: {machine_line(machine())}; 1 torch thread")
    print(f"{args.steps} steps a round, median of {args.repeats} rounds, after {args.warmup} warm-up steps\n")
    print("| task | cell | arm | S | per-seed step, CPU (ms) | per-seed step, wall (ms) | speed-up (CPU) |")
    print("|---|---|---|---:|---:|---:|---:|")
    for task in args.tasks:
        section = params[task]
        data = section["data"]["train"]
        x = torch.from_numpy(
            simulate_set(
                task, section.get("model", {}), data["num_datasets"], data["seed"], data.get("sizes", {})
            )["x"]
        )
        cell = grid_cells(params, task)[0]
        cfg = cell.train
        name = f"{cell.method} K{cell.sweeps} L{cell.particles} B{cfg.batch_size}"
        arms: dict[tuple[str, int], tuple[Callable[[], object], int]] = {}
        torch.manual_seed(0)
        arms["trainer", 1] = (Trainer(cfg, x).step, 1)
        for size in args.sizes:
            seeds = SeedTrainers(cfg, x, list(range(size)))
            arms["seeds", size] = (seeds.step, size)
            if size > 1:
                torch.manual_seed(0)
                fold = dataclasses.replace(cfg, batch_size=cfg.batch_size * size)
                arms["fold", size] = (Trainer(fold, x).step, size)
        for step, _ in arms.values():
            for _ in range(args.warmup):
                step()
        times: dict[tuple[str, int], list[tuple[float, float]]] = {arm: [] for arm in arms}
        for _ in range(args.repeats):
            for arm, (step, _) in arms.items():
                times[arm].append(cpu_and_wall(step, args.steps))
        reference = statistics.median(t[0] for t in times["trainer", 1])
        for (kind, size), (_, per) in sorted(arms.items(), key=lambda a: (a[0][1], a[0][0] != "trainer")):
            cpu = statistics.median(t[0] for t in times[kind, size]) / per
            wall = statistics.median(t[1] for t in times[kind, size]) / per
            print(
                f"| {task} | {name} | {kind} | {size} | {cpu * 1e3:.2f} | {wall * 1e3:.2f} | "
                f"{reference / cpu:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
