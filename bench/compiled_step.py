"""Compiled PyTorch against the C kernels: one paper cell's training step, side by side.

Issue 21, item 3. For each (task, method) asked, at the paper's per-step sizes
(the ``paper`` profile), three trainers in one process on the same data: ``native`` (eager,
the C kernels of ``apg/kernels``: the CPU default), ``torch`` (eager, the kernels switched
off: what a GPU trial ran before compiling) and ``compiled`` (``TrainConfig.compile``: the
sampler and loss as one ``torch.compile`` graph, inductor's C++ on a CPU). The compiled
arm's first step is timed apart (tracing and code generation, paid once per trial); then
the arms take turns step by step, so that all three see the same machine at the same
moments. Prints medians and the median of the per-round ratios to ``native``.

    python bench/compiled_step.py --tasks gmm dgmm --methods apg --steps 15 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from paper_scale import plan  # noqa: E402

import apg.kernels  # noqa: E402
from apg.tasks.simulation import simulate_set  # noqa: E402
from apg.training import TrainConfig, Trainer  # noqa: E402


class kernels_off:
    """The eager PyTorch path: ``apg.kernels`` finds no library while this is entered."""

    def __enter__(self):
        self.saved = apg.kernels.native_library
        apg.kernels.native_library = lambda: None

    def __exit__(self, *exc):
        apg.kernels.native_library = self.saved


def compare(row: dict, steps: int) -> dict:
    train = {**row["train"], "compile": False}
    cfg = TrainConfig.from_dict(train)
    arrays = simulate_set(cfg.task, cfg.model, 2 * cfg.batch_size, 0, row["sizes"])
    x = torch.from_numpy(arrays["x"]).float()
    trainers = {}
    for arm in ("native", "torch", "compiled"):
        torch.manual_seed(0)
        trainers[arm] = Trainer(TrainConfig.from_dict({**train, "compile": arm == "compiled"}), x)
    start = time.perf_counter()
    trainers["compiled"].step()  # tracing and code generation, once per trial
    compile_seconds = time.perf_counter() - start
    trainers["native"].step()
    with kernels_off():
        trainers["torch"].step()
    times: dict[str, list[float]] = {arm: [] for arm in trainers}
    for _ in range(steps):
        for arm, trainer in trainers.items():
            start = time.perf_counter()
            if arm == "torch":
                with kernels_off():
                    trainer.step(log=False)
            else:
                trainer.step(log=False)
            times[arm].append(time.perf_counter() - start)
    ratio = {
        arm: statistics.median(t / n for t, n in zip(times[arm], times["native"], strict=True))
        for arm in times
    }
    return {
        "task": row["task"],
        "method": row["method"],
        "K": row["K"],
        "L": row["L"],
        "compile_seconds": round(compile_seconds, 1),
        **{f"{arm}_ms": round(1000 * statistics.median(t), 2) for arm, t in times.items()},
        **{f"{arm}_over_native": round(r, 2) for arm, r in ratio.items() if arm != "native"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="paper", help="a profile's name or a params file")
    parser.add_argument("--tasks", nargs="*", default=["gmm", "dgmm", "bmnist"])
    parser.add_argument("--methods", nargs="*", default=["apg"])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r for r in plan(args.params, args.tasks) if r["method"] in args.methods]
    seen, out = set(), []
    print(
        "| task | method | K | L | compile (s) | native (ms) | torch (ms) | compiled (ms) | torch / native | compiled / native |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        if (row["task"], row["method"]) in seen:  # the paper's training budget: the first pair
            continue
        seen.add((row["task"], row["method"]))
        r = compare(row, args.steps)
        out.append(r)
        print(
            f"| {r['task']} | {r['method']} | {r['K']} | {r['L']} | {r['compile_seconds']} | {r['native_ms']} | "
            f"{r['torch_ms']} | {r['compiled_ms']} | {r['torch_over_native']} | {r['compiled_over_native']} |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
