"""Benchmark: Bouncing MNIST's paper-scale training set in bounded memory (issue 19).

Two measurements, each in a fresh process so its peak resident memory (VmHWM) is its own:

1. ``generate``: simulate and write a training set at the paper's sizes (T=10, D=3,
   96 x 96 frames stored as float16) with the ``generate`` stage's own code
   (``apg.tasks.simulation.simulate_chunks`` + ``apg.data.save_dataset``: chunks of at most
   ``CHUNK_BYTES``);
2. ``train``: one trial of each method of the ``paper`` profile's Bouncing MNIST grid built
   as the sweep builds it (paper batch size, K, L, networks), reading that file as a sweep
   trial does (``apg.data.training_rows``: a file over ``IN_MEMORY_MAX_BYTES`` stays
   on disk, a batch read per step), for a warm-up step and ``--steps`` steps; and, for
   contrast, the process that loads the whole file (what trials did before).

    python bench/data_scale.py [--videos 60000] [--steps 2] [--readers rows whole] [--out DIR] [--keep]

Neither peak depends on the number of videos beyond the data order (8 bytes a video), so a
smaller ``--videos`` measures the same bound in minutes (the paper's 60,000 take ~45 min to
simulate on one core of this machine). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.paper_scale import vm_hwm_mb  # noqa: E402


def generate(path: str, videos: int) -> dict:
    import numpy as np
    import torch

    from apg.data import save_dataset
    from apg.tasks.simulation import simulate_chunks
    from pipeline.config.profiles import resolve

    torch.set_num_threads(1)
    data = resolve("paper")["bmnist"]["data"]
    train, x_dtype = data["train"], np.dtype(data.get("x_dtype", "float32"))
    start = time.perf_counter()
    chunks = simulate_chunks("bmnist", {}, videos, train["seed"], train["sizes"])
    save_dataset(Path(path), ({**c, "x": c["x"].astype(x_dtype)} for c in chunks))
    return {
        "seconds": time.perf_counter() - start,
        "peak_rss_mb": vm_hwm_mb(),
        "file_gb": Path(path).stat().st_size / 1e9,
    }


def train(path: str, method: str, steps: int, whole: bool) -> dict:
    import torch

    from apg.data import load_dataset, training_rows
    from apg.training import TrainConfig, Trainer
    from bench.paper_scale import plan

    torch.set_num_threads(1)
    torch.manual_seed(0)
    row = next(r for r in plan("paper", ["bmnist"]) if r["method"] == method)
    x = torch.from_numpy(load_dataset(path)["x"]) if whole else training_rows(path)
    trainer = Trainer(TrainConfig.from_dict(row["train"]), x)
    times = []
    for _ in range(steps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - t0)
    return {
        "reader": type(x).__name__,
        "seconds_per_step": sorted(times[1:])[len(times[1:]) // 2],
        "peak_rss_mb": vm_hwm_mb(),
        "K": row["K"],
        "L": row["L"],
        "B": row["train"]["batch_size"],
    }


def in_subprocess(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(args)], capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise SystemExit(proc.stderr.strip().splitlines()[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--videos", type=int, default=60000)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--methods", nargs="*", default=["apg", "rws-mlp", "avf"])
    parser.add_argument(
        "--readers",
        nargs="*",
        default=["rows", "whole"],
        help="rows: as a trial reads; whole: the file loaded",
    )
    parser.add_argument("--out", default=None, help="folder for the training set (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the training set")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        kind, *rest = json.loads(args.one)
        out = (
            generate(rest[0], int(rest[1]))
            if kind == "generate"
            else train(rest[0], rest[1], int(rest[2]), rest[3] == "whole")
        )
        print(json.dumps(out))
        return
    folder = Path(args.out or tempfile.mkdtemp(prefix="apg-data-scale-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.npz"
    try:
        print("| what | seconds | peak RSS (MB) | note |\n| --- | ---: | ---: | --- |", flush=True)
        g = in_subprocess("generate", str(path), str(args.videos))
        print(
            f"| generate {args.videos:,} videos (T=10, D=3, float16) | {g['seconds']:.0f} | "
            f"{g['peak_rss_mb']:.0f} | file {g['file_gb']:.2f} GB |",
            flush=True,
        )
        for method in args.methods:
            for reader in args.readers:
                r = in_subprocess("train", str(path), method, str(args.steps), reader)
                print(
                    f"| train {method} K={r['K']} L={r['L']} B={r['B']}, {r['reader']} | "
                    f"{r['seconds_per_step']:.2f} s/step | {r['peak_rss_mb']:.0f} | "
                    f"{'batches read from disk' if r['reader'] == 'StoredRows' else 'whole file in memory'} |",
                    flush=True,
                )
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
