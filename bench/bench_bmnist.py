"""Benchmark: Bouncing MNIST training step and the cost of a sweep versus video length.

One training step at the paper's configuration (B=10 videos, D=3 digits, T=10 frames,
K=5 sweeps, L=10 particles, 96x96, 2 threads): median and minimum over repeats, peak
resident memory of the process (VmHWM), and achieved GFLOP/s (matmul/conv FLOPs counted
by ``torch.utils.flop_counter`` over one step, divided by the median time). Then the
cost of one sweep (all T + 1 block updates, no gradients) at T=100 versus T=10.

Targets (issue 5): <= 2.8 s per step, <= 1.5 GB peak, sweep ratio T=100/T=10 <= 12.
The authors' code: ~14 s per step, 5.3 GB.

    python bench/bench_bmnist.py [--repeats 5] [--threads 2] [--mnist-dir DIR] [--json OUT]

Run it on an otherwise quiet machine: it measures wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from apg.smc.sampler import run_apg
from apg.tasks import get_task
from apg.training import TrainConfig, Trainer


def vm_hwm_mb() -> float:
    """Peak resident set size of this process in MB (Linux /proc; psutil as a fallback)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil  # pragma: no cover

    return psutil.Process().memory_info().rss / 2**20  # pragma: no cover


def videos(num: int, frames: int, digits: int, mnist_dir: str | None, seed: int) -> torch.Tensor:
    task = get_task("bmnist")
    g = torch.Generator().manual_seed(seed)
    try:
        return task.simulate(
            task.build_model(),
            num,
            g,
            num_frames=frames,
            num_digits=digits,
            split="train",
            mnist_dir=mnist_dir,
        )["x"]
    except FileNotFoundError:  # no MNIST: random blobs have the same cost
        from apg.tasks.bmnist import pixel_offsets, render, simulate_trajectories

        where = simulate_trajectories(num, frames, digits, 0.2, g).float()
        blobs = (torch.rand(num, 1, digits, 28, 28, generator=g) > 0.8).float()
        return render(blobs, pixel_offsets(where)).clamp(0, 1)


def time_step(trainer: Trainer, repeats: int) -> list[float]:
    trainer.step()  # warm-up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.step()
        out.append(time.perf_counter() - start)
    return out


@torch.no_grad()
def sweep_cost(frames: int, repeats: int, mnist_dir: str | None, batch: int, particles: int) -> dict:
    """One sweep = run_apg with K=2 minus K=1 (no gradients): median process CPU seconds
    (less sensitive than wall time to other jobs on a shared machine) and counted FLOPs."""
    task = get_task("bmnist")
    model = task.build_model()
    prop = task.build_proposals(model, "apg", num_digits=3)
    x = videos(batch, frames, 3, mnist_dir, seed=1)
    cpu = []
    for _ in range(repeats):
        t0 = time.process_time()
        run_apg(model, prop, x, 1, particles)
        t1 = time.process_time()
        run_apg(model, prop, x, 2, particles)
        t2 = time.process_time()
        cpu.append((t2 - t1) - (t1 - t0))
    flops = []
    for k in (1, 2):
        with FlopCounterMode(display=False) as counter:
            run_apg(model, prop, x, k, particles)
        flops.append(counter.get_total_flops())
    return {"cpu_seconds": statistics.median(cpu), "gflop": (flops[1] - flops[0]) / 1e9}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mnist-dir", default=os.environ.get("APG_MNIST_DIR"))
    parser.add_argument("--sweep-repeats", type=int, default=3)
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--skip-step", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    res: dict = {}
    if not args.skip_step:
        res.update(step(args))
        print(json.dumps(res), flush=True)
    if not args.skip_sweep:
        t10 = sweep_cost(10, args.sweep_repeats, args.mnist_dir, 10, 10)
        t100 = sweep_cost(100, args.sweep_repeats, args.mnist_dir, 10, 10)
        res.update(
            sweep_T10=t10,
            sweep_T100=t100,
            sweep_cpu_ratio_T100_T10=round(t100["cpu_seconds"] / t10["cpu_seconds"], 2),
            sweep_flop_ratio_T100_T10=round(t100["gflop"] / t10["gflop"], 2),
            load_average_end=os.getloadavg(),
        )
    print(json.dumps(res), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


def step(args: argparse.Namespace) -> dict:
    x = videos(50, 10, 3, args.mnist_dir, seed=0)
    cfg = TrainConfig(
        task="bmnist",
        method="apg",
        sweeps=5,
        particles=10,
        batch_size=10,
        lr=1e-4,
        network={"num_digits": 3},
        iterations=1000,
    )
    trainer = Trainer(cfg, x)
    rss_before = vm_hwm_mb()
    times = time_step(trainer, args.repeats)
    peak = vm_hwm_mb()
    with FlopCounterMode(display=False) as counter:
        trainer.step()
    flops = counter.get_total_flops()
    med = statistics.median(times)
    res = {
        "config": "B=10 D=3 T=10 K=5 L=10 96x96",
        "threads": args.threads,
        "step_seconds_median": round(med, 3),
        "step_seconds_min": round(min(times), 3),
        "step_seconds_all": [round(t, 3) for t in times],
        "peak_rss_mb": round(peak, 1),
        "rss_before_steps_mb": round(rss_before, 1),
        "gflop_per_step": round(flops / 1e9, 1),
        "gflops_achieved": round(flops / 1e9 / med, 1),
        "load_average": os.getloadavg(),
    }
    return res


if __name__ == "__main__":
    main()
