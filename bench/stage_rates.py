"""Project the default run's sweep minutes on this machine from measured step rates.

A full ``dvc repro`` from a fresh checkout takes two hours or more; this takes minutes. For
every distinct training config of each task's grid (params.yaml; seeds share a rate), it
trains a few seconds at one torch thread (as a trial does) on the task's simulated training
set and takes the median seconds per step over short windows. Beside each rate stands the
one the committed results trained at (``reports/data/<task>/training.parquet``: the median
over the cell's seeds of its logged rates, two trials at once on the machine named in
``reports/README.md``), and their ratio. A sweep's projected minutes are its cells'
iterations over the rate measured here, summed and halved (two trials at once, as the
committed run trained them), without Ray's start-up: the same arithmetic as the report's
"from scratch" column. One trial runs at a time here, so where two trials at once slow each
other (memory bandwidth), the projection is low by that much.

    python bench/stage_rates.py [--seconds 20] [--tasks gmm dgmm bmnist]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from apg.tasks.simulation import simulate_set
from apg.training import Trainer
from pipeline.common import seed_everything
from pipeline.config.params import grid_cells, load_params
from pipeline.provenance.record import machine, machine_line

ROOT = Path(__file__).resolve().parents[1]
TRIALS_AT_ONCE = 2


def seconds_per_step(trainer: Trainer, seconds: float, window: int = 5, warmup: int = 3) -> float:
    """Median seconds per step over windows of ``window`` steps, for about ``seconds``."""
    for _ in range(warmup):
        trainer.step(log=False)
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        start = time.perf_counter()
        for _ in range(window):
            trainer.step(log=False)
        times.append((time.perf_counter() - start) / window)
    return statistics.median(times)


def committed_rates(task: str) -> pd.Series:
    """Median logged steps per second of the committed results' cells, per (method, K, L)."""
    path = ROOT / "reports" / "data" / task / "training.parquet"
    if not path.is_file():
        return pd.Series(dtype=float)
    rows = pd.read_parquet(path)
    rows = rows[rows["metric"] == "it_per_s"]
    per_seed = rows.groupby(["method", "K", "L", "seed"])["value"].median()
    return per_seed.groupby(["method", "K", "L"]).median()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds per config")
    parser.add_argument("--tasks", nargs="*", help="default: params.yaml's tasks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = load_params(ROOT / "params.yaml")
    print(f"machine: {machine_line(machine())}; 1 torch thread\n")
    print("| task | cell | cells | iterations | steps/s here | steps/s committed | ratio | minutes here |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    totals: dict[str, tuple[float, float]] = {}
    for task in args.tasks or params["tasks"]:
        section = params[task]
        train = simulate_set(
            task,
            section.get("model", {}),
            section["data"]["train"]["num_datasets"],
            section["data"]["train"]["seed"],
            section["data"]["train"].get("sizes", {}),
        )
        x = torch.from_numpy(train["x"])
        committed = committed_rates(task)
        groups: dict[tuple, list] = {}
        for cell in grid_cells(params, task):
            groups.setdefault((cell.method, cell.sweeps, cell.particles, cell.axes), []).append(cell)
        here_minutes = committed_minutes = 0.0
        for (method, k, l, axes), cells in groups.items():
            iterations = sum(c.train.iterations for c in cells)
            if iterations == 0:  # exact Gibbs: nothing to train
                continue
            seed_everything(cells[0].seed)
            rate = 1.0 / seconds_per_step(Trainer(cells[0].train, x), args.seconds)
            then = float(committed.get((method, k, l), float("nan")))
            minutes = iterations / rate / 60
            here_minutes += minutes
            committed_minutes += iterations / then / 60 if then == then else float("nan")
            name = f"{method} K{k} L{l}" + "".join(f" {a}={v}" for a, v in axes)
            print(
                f"| {task} | {name} | {len(cells)} | {iterations:,} | {rate:.2f} | {then:.2f} | "
                f"{then / rate:.2f} | {minutes:.1f} |",
                flush=True,
            )
        totals[task] = (here_minutes / TRIALS_AT_ONCE, committed_minutes / TRIALS_AT_ONCE)
    print("\n| sweep | minutes here (projected) | minutes at the committed rates |")
    print("|---|---:|---:|")
    for task, (here, then) in totals.items():
        print(f"| `sweep@{task}` | {here:.1f} | {then:.1f} |")
    here, then = (sum(v[i] for v in totals.values()) for i in (0, 1))
    print(f"| **sum** | **{here:.1f}** | **{then:.1f}** |")


if __name__ == "__main__":
    main()
