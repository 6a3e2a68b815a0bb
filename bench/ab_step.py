"""A/B one training step of two versions of the package, in one process, step by step.

The shared CPU machines this project is measured on drift by up to 1.5-2x within minutes,
so timings taken in separate runs cannot be compared. This script loads the package as of
a git revision (renamed ``apg_old``, with its own compiled kernels) beside the working
tree's ``apg``, builds the same trainer in both, and times their steps alternately: both
arms see the same machine at the same moments. Prints medians, CPU-time medians and the
median of the per-pair ratios.

    python bench/ab_step.py --old 6c609ec --task gmm --threads 2 --steps 30
    python bench/ab_step.py --old HEAD~3 --task dgmm --threads 2 --steps 8
    python bench/ab_step.py --old HEAD~1 --task bmnist --cell apg --threads 1 --steps 20
    python bench/ab_step.py --old HEAD~1 --task bmnist --threads 1 --steps 6 \
        --weights recorded/bmnist-long

Paper training configs: B=20 datasets, K=10 sweeps, L=10 particles; N=60 (gmm) or 200
(dgmm) points; Bouncing MNIST B=10 three-digit T=10 videos (of 50 simulated from MNIST
in ``APG_MNIST_DIR``), K=5, L=10. ``--cell METHOD``: the default run's step instead, the
first METHOD cell of params.yaml's grid for the task (its config and training data). ``--weights``: a continuing run's folder (``apg-pipeline
continue``), whose latest model and proposals weights both arms load (a trained model's particles, and so its cost, differ from a fresh
one's). Both arms then take the same steps; the script says whether their losses agreed
exactly. ``--inference`` first checks that both arms' samplers, as loaded, return the same
particles and says how far apart their log weights are. ``--flops`` then counts one more step's FLOPs in each arm and times a large float32
matmul: the step's FLOPs at that rate are a floor under its time on this CPU. Run from the
repository root.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

POINTS = {"gmm": 60, "dgmm": 200}


def export_old_package(rev: str, root: Path) -> Path:
    """Write ``apg`` as of ``rev`` to ``root/apg_old`` with its imports renamed."""
    archive = subprocess.run(["git", "archive", rev, "apg"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / "apg").rename(root / "apg_old")
    for path in (root / "apg_old").rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bfrom apg(\.| import)", r"from apg_old\1", text)
        text = re.sub(r"\bimport apg(\.|$)", r"import apg_old\1", text, flags=re.M)
        text = re.sub(r'"apg\.', '"apg_old.', text)  # module names in strings (the task registry)
        path.write_text(text)
    return root


def default_cell(task_name: str, method: str) -> tuple[dict, torch.Tensor]:
    """The training config (as a dict) and training inputs of the first cell of ``method``
    in params.yaml's grid for ``task_name``: the default run's step."""
    from apg.tasks.simulation import simulate_set
    from pipeline.config.params import grid_cells, load_params

    params = load_params(Path("params.yaml"))
    cells = [c for c in grid_cells(params, task_name) if c.method == method]
    if not cells:
        raise SystemExit(f"params.yaml's {task_name} grid has no {method} cell")
    train = params[task_name]["data"]["train"]
    data = simulate_set(
        task_name,
        params[task_name].get("model", {}),
        train["num_datasets"],
        train["seed"],
        train.get("sizes", {}),
    )
    return dataclasses.asdict(cells[0].train), torch.from_numpy(data["x"]).float()


def make_trainer(
    pkg: str, task_name: str, weights: str | None = None, cell: tuple[dict, torch.Tensor] | None = None
):
    tasks = importlib.import_module(f"{pkg}.tasks")
    training = importlib.import_module(f"{pkg}.training")
    torch.manual_seed(0)
    if cell is not None:
        return training.Trainer(training.TrainConfig(**cell[0]), cell[1])
    task = tasks.get_task(task_name)
    g = torch.Generator().manual_seed(0)
    if task_name == "bmnist":
        sizes = {
            "num_frames": 10,
            "num_digits": 3,
            "split": "train",
            "mnist_dir": os.environ.get("APG_MNIST_DIR"),
        }
        data = task.simulate(task.build_model(), 50, g, **sizes)
        cfg = training.TrainConfig(
            task=task_name,
            method="apg",
            sweeps=5,
            particles=10,
            batch_size=10,
            lr=1e-4,
            network={"num_digits": 3},
            iterations=1000,
        )
    else:
        data = task.simulate(task.build_model(), 400, g, num_points=POINTS[task_name])
        cfg = training.TrainConfig(
            task=task_name,
            method="apg",
            sweeps=10,
            particles=10,
            batch_size=20,
            lr=1e-4,
            iterations=1000,
        )
    trainer = training.Trainer(cfg, data["x"].float())
    if weights is not None:
        from pipeline.runs.execute import latest_state

        state = latest_state(Path(weights))
        if state is None:
            raise SystemExit(f"{weights}: no run state")
        trainer.model.load_state_dict(state["model"])
        trainer.proposals.load_state_dict(state["proposals"])
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="git revision of the baseline")
    parser.add_argument("--task", choices=[*sorted(POINTS), "bmnist"], default="gmm")
    parser.add_argument("--weights", default=None, help="a long run's folder: both arms load its weights")
    parser.add_argument(
        "--cell",
        metavar="METHOD",
        default=None,
        help="time the default run's step instead: the first METHOD cell of params.yaml's grid for --task",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per arm")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--inference",
        action="store_true",
        help="first run both arms' samplers as loaded (no training) on 10 of the training "
        "inputs: are their particles equal, how far apart are their log weights",
    )
    parser.add_argument(
        "--flops",
        action="store_true",
        help="then count one more step's FLOPs in each arm, beside this CPU's float32 matmul rate",
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, str(export_old_package(args.old, Path(tmp))))
        cell = default_cell(args.task, args.cell) if args.cell else None
        arms = {pkg: make_trainer(pkg, args.task, args.weights, cell) for pkg in ("apg_old", "apg")}
        arms = {"old": arms["apg_old"], "new": arms["apg"]}
        if args.inference:
            print(inference_agreement(arms), flush=True)
        # each arm draws from its own copy of the global generator: both take the same steps
        rng = dict.fromkeys(arms, torch.get_rng_state())
        losses: dict[str, list[float]] = {k: [] for k in arms}
        wall: dict[str, list[float]] = {k: [] for k in arms}
        cpu: dict[str, list[float]] = {k: [] for k in arms}
        for i in range(args.warmup + args.steps):
            for name, trainer in arms.items():
                torch.set_rng_state(rng[name])
                start, start_cpu = time.perf_counter(), time.process_time()
                metrics = trainer.step(log=True)
                if i >= args.warmup:
                    wall[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
                rng[name] = torch.get_rng_state()
                losses[name].append(float(metrics["loss"]))
        flops: dict[str, float] | None = None
        if args.flops:  # one more step each, from the same random state
            flops = {}
            for name, trainer in arms.items():
                torch.set_rng_state(rng["old"])
                flops[name] = step_gflop(trainer)
    old, new = (statistics.median(wall[k]) for k in ("old", "new"))
    ratio = statistics.median(b / a for a, b in zip(wall["old"], wall["new"], strict=True))
    gap = max(abs(b - a) / max(abs(a), 1e-30) for a, b in zip(losses["old"], losses["new"], strict=True))
    print(
        f"{args.task} step, {args.threads} thread(s), {args.steps} alternating steps per arm: "
        f"old ({args.old}) {old * 1e3:.1f} ms (CPU {statistics.median(cpu['old']) * 1e3:.1f}), "
        f"new {new * 1e3:.1f} ms (CPU {statistics.median(cpu['new']) * 1e3:.1f}); "
        f"speed-up {old / new:.2f}x, median paired ratio new/old {ratio:.3f}; "
        f"losses of all {len(losses['old'])} steps equal: {losses['old'] == losses['new']} "
        f"(largest relative difference {gap:.1e}); "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    if flops is not None:
        peak = matmul_gflops()
        print(
            f"GFLOP per step (matrix products and convolutions, torch.utils.flop_counter): "
            f"old {flops['old']:.1f}, new {flops['new']:.1f}; a 2000 x 2000 float32 matmul at "
            f"{args.threads} thread(s) runs at {peak:.0f} GFLOP/s, so the new step's FLOPs take "
            f"{flops['new'] / peak:.2f} s at that rate"
        )


def inference_agreement(arms: dict) -> str:
    """Each arm's sampler (its config's K and L, no gradients) on the first 10 training
    inputs from one random state: whether the final particles are equal, and how far apart
    their log weights are."""
    results = {}
    for name, trainer in arms.items():
        sampler = importlib.import_module(f"{'apg_old' if name == 'old' else 'apg'}.smc.sampler")
        cfg = trainer.cfg
        x = trainer.train_x[:10]
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(0)
            results[name] = sampler.run_apg(trainer.model, trainer.proposals, x, cfg.sweeps, cfg.particles)
    old, new = results["old"], results["new"]
    same = all(torch.equal(old.z[k], new.z[k]) for k in old.z)
    gap = (old.log_weights - new.log_weights).abs().max().item()
    return (
        f"inference, K={cfg.sweeps} L={cfg.particles} on {len(x)} training inputs: particles equal: "
        f"{same}; log weights' largest difference {gap:.2g} (largest |log weight| "
        f"{old.log_weights.abs().max().item():.3g})"
    )


def step_gflop(trainer) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        trainer.step()
    return counter.get_total_flops() / 1e9


def matmul_gflops(size: int = 2000, repeats: int = 5) -> float:
    """This CPU's float32 matrix-multiply rate at the current thread count (median of repeats)."""
    a = torch.randn(size, size)
    a @ a  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e9


if __name__ == "__main__":
    main()
