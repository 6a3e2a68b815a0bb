"""Benchmark: trials sharing one GPU, as a sweep with fractional ``gpus_per_trial`` runs them.

``gpus_per_trial: 0.25`` makes Ray Tune start four trials on one GPU, each its own process
with its own CUDA context, time-slicing the device. This measures what that buys without Ray:
for each count P in ``--procs``, P processes each build the same paper-sized cell (as
``bench/paper_scale.py`` does), warm up, wait until all are ready, then train unlogged steps
for ``--seconds``; the row reports the steps per second of one process and of all together,
and the speed-up over one process alone.

    python bench/gpu_share.py --task gmm --method apg --pair 10 10 --procs 1 4 --seconds 20 \\
        [--device cuda] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))


def child(row: dict, device: str, seconds: float, warmup: int) -> None:
    """One trial: build, warm up, say ready, wait for go, train for ``seconds``, report."""
    import torch
    from paper_scale import cell_trainer

    torch.set_num_threads(1)
    trainer = cell_trainer(row, device)[0]
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(warmup):
        trainer.step(log=False)
    sync()
    print("ready", flush=True)
    sys.stdin.readline()  # go
    start = time.perf_counter()
    steps = 0
    while time.perf_counter() - start < seconds:
        trainer.step(log=False)
        steps += 1
    sync()
    elapsed = time.perf_counter() - start
    print(json.dumps({"steps": steps, "seconds": elapsed}), flush=True)


def shared(row: dict, procs: int, device: str, seconds: float, warmup: int) -> dict:
    """``procs`` trials at once on the device; their steps per second."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        json.dumps(row),
        "--device",
        device,
        "--seconds",
        str(seconds),
        "--warmup",
        str(warmup),
    ]
    children = [
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        for _ in range(procs)
    ]
    for c in children:  # every trial built and warmed up before any is timed
        if c.stdout.readline().strip() != "ready":
            raise SystemExit(f"a trial failed to start (exit {c.wait()})")
    for c in children:
        c.stdin.write("go\n")
        c.stdin.flush()
    results = [json.loads(c.communicate()[0].strip().splitlines()[-1]) for c in children]
    rates = [r["steps"] / r["seconds"] for r in results]
    return {"procs": procs, "steps_per_s_each": rates, "steps_per_s_total": sum(rates)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="paper", help="a profile's name or a params file")
    parser.add_argument("--task", default="gmm")
    parser.add_argument("--method", default="apg")
    parser.add_argument("--pair", type=int, nargs=2, default=(10, 10))
    parser.add_argument("--procs", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a row as JSON: be one trial
    args = parser.parse_args(argv)
    if args.child is not None:
        child(json.loads(args.child), args.device, args.seconds, args.warmup)
        return []
    from paper_scale import plan

    found = plan(args.params, [args.task], [args.method], [f"{args.pair[0]}x{args.pair[1]}"])
    if not found:
        raise SystemExit(f"{args.params} has no {args.task} {args.method} cell at K, L = {tuple(args.pair)}")
    rows = []
    for procs in args.procs:
        row = shared(found[0], procs, args.device, args.seconds, args.warmup)
        rows.append(row)
        alone = rows[0]["steps_per_s_total"] / rows[0]["procs"]
        print(
            f"{args.task} {args.method} K={args.pair[0]} L={args.pair[1]} on {args.device}: {procs} at once, "
            f"{row['steps_per_s_total']:.1f} steps/s together ({row['steps_per_s_total'] / alone:.2f}x one alone), "
            f"each {min(row['steps_per_s_each']):.1f}-{max(row['steps_per_s_each']):.1f}",
            flush=True,
        )
        if args.json:
            meta = {
                "task": args.task,
                "method": args.method,
                "pair": list(args.pair),
                "device": args.device,
                "seconds": args.seconds,
            }
            Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
