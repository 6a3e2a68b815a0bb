"""Benchmark: one DGMM (rings) APG training step, and peak memory of evaluation at N=600.

Paper config (issue 4): B=20 datasets of N=200 points, I=4 rings, K=10 sweeps, L=10
particles, 2 threads. The authors' research code takes ~1.1 s per such step on a 2-core
CPU machine; the target is <= 0.2 s. Evaluation at N=600 (no gradients) must fit a laptop:
its peak resident memory is reported (``VmHWM`` of a fresh subprocess: ``ru_maxrss`` would
inherit the parent's high-water mark across fork and exec on Linux).

    python bench/bench_dgmm.py [--threads 2] [--steps 10] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch


def step_time(
    threads: int, steps: int, warmup: int, batch: int, points: int, sweeps: int, particles: int
) -> dict:
    from apg.objectives import apg_loss
    from apg.smc.sampler import run_apg
    from apg.tasks import get_task

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    task = get_task("dgmm")
    model = task.build_model()
    proposals = task.build_proposals(model, "apg")
    params = [*model.parameters(), *proposals.parameters()]
    opt = torch.optim.Adam(params, lr=1e-4, betas=(0.9, 0.99), foreach=True)  # as apg.training
    x = task.simulate(model, batch, torch.Generator().manual_seed(0), num_points=points)["x"].float()
    times, cpu = [], []
    for i in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = apg_loss(run_apg(model, proposals, x, sweeps, particles))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    # CPU time beside wall time: on a shared machine, with one thread, it is close to
    # what an idle machine's wall time would be.
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "cpu_median_s": statistics.median(cpu),
        "steps": steps,
        "load_average": os.getloadavg()[0],
    }


_EVAL = """
import time, torch

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1])

torch.set_num_threads({threads})
from apg.smc.sampler import run_apg
from apg.tasks import get_task
task = get_task("dgmm")
model = task.build_model()
proposals = task.build_proposals(model, "apg")
x = task.simulate(model, {batch}, torch.Generator().manual_seed(0), num_points={points})["x"].float()
base = hwm()
start = time.perf_counter()
with torch.no_grad():
    run_apg(model, proposals, x, {sweeps}, {particles})
print(base, hwm(), time.perf_counter() - start)
"""


def eval_memory(threads: int, batch: int, points: int, sweeps: int, particles: int) -> dict:
    code = _EVAL.format(threads=threads, batch=batch, points=points, sweeps=sweeps, particles=particles)
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.split()
    before, peak, seconds = int(out[0]), int(out[1]), float(out[2])
    return {"peak_rss_mb": peak / 1024, "peak_rss_before_run_mb": before / 1024, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--eval-points", type=int, default=600)
    a = ap.parse_args()
    result = {
        "config": {"B": 20, "N": 200, "I": 4, "K": 10, "L": 10, "threads": a.threads},
        "train_step": step_time(a.threads, a.steps, a.warmup, 20, 200, 10, 10),
        "eval_memory": {
            "config": {"B": 20, "N": a.eval_points, "K": 10, "L": 10},
            **eval_memory(a.threads, 20, a.eval_points, 10, 10),
        },
        "self_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
