"""Time one GMM training step at the paper's config (section 5.1).

One step = forward K sweeps + backward + optimizer step, on B=20 datasets of N=60
points, I=3 clusters, K=10 sweeps, L=10 particles. Prints median and min over the timed
steps (after warm-up) and the process's peak resident memory.

    python bench/bench_gmm.py [--threads 2] [--steps 30] [--warmup 5] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from apg.tasks import get_task
from apg.training import TrainConfig, Trainer


def peak_rss_mb() -> float:
    """Peak resident set size of this process (VmHWM), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="print a torch profiler table")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    task = get_task("gmm")
    data = task.simulate(task.build_model(), 400, torch.Generator().manual_seed(0), num_points=60)
    cfg = TrainConfig(
        task="gmm", method="apg", sweeps=10, particles=10, batch_size=20, lr=1e-4, iterations=1000
    )
    trainer = Trainer(cfg, data["x"].float())
    for _ in range(args.warmup):
        trainer.step()
    times, cpu = [], []
    for _ in range(args.steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        trainer.step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    # Process CPU time is reported beside wall time because the machine is shared: with
    # one thread it is what the wall time would be on an idle machine, give or take
    # cache effects from the neighbours.
    print(
        f"gmm step (B=20 N=60 I=3 K=10 L=10, {args.threads} threads): "
        f"median {statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms "
        f"(CPU time median {statistics.median(cpu) * 1e3:.1f} ms) over {args.steps} steps; "
        f"peak RSS {peak_rss_mb():.0f} MB; load average {os.getloadavg()[0]:.1f}"
    )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                trainer.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
