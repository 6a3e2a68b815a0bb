"""Does the sampler on a GPU agree with the CPU one? (issue 21, item 4)

The same trained cell evaluated on the same held-out datasets on two devices: each
device averages every final metric over ``--seeds`` runs per dataset (the randomness
differs between devices: their generators are not the same streams), and ``--compare``
tests the paired per-dataset differences: mean difference over its standard error (over
datasets). Agreement means |z| < 3 for every metric.

    python bench/cuda_agreement.py --cell results/sweeps/gmm/cells/<id>/model.pt \\
        --data data/gmm/test.npz --pair 10 10 --device cuda --json cuda.json
    python bench/cuda_agreement.py ... --device cpu --json cpu.json
    python bench/cuda_agreement.py --compare cpu.json cuda.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np


def run(cell: Path, data: Path, pair: tuple[int, int], device: str, seeds: int, batch: int) -> dict:
    import torch

    from apg.loading import load_task_data, load_trained
    from apg.training import evaluate
    from pipeline.common import seed_everything

    cfg, model, proposals = load_trained(cell, device)
    x = load_task_data(cfg.task, data, cfg.model)
    per_seed: dict[str, list[np.ndarray]] = {}
    for seed in range(seeds):
        seed_everything(1000 + seed)
        metrics = evaluate(cfg, model, proposals, x, *pair, batch, "block")
        for name, value in metrics.items():
            final = value[-1] if value.ndim == 2 else value  # the last sweep's (M,)
            per_seed.setdefault(name, []).append(np.asarray(final, dtype=np.float64))
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    return {
        "device": f"{name} (torch {torch.__version__})",
        "cell": str(cell),
        "data": str(data),
        "pair": list(pair),
        "seeds": seeds,
        "metrics": {k: np.mean(v, axis=0).tolist() for k, v in per_seed.items()},
    }


def compare(a: dict, b: dict) -> str:
    lines = [
        f"{a['cell']} on {a['data']}, K, L = {a['pair']}: {a['device']} ({a['seeds']} seeds) against "
        f"{b['device']} ({b['seeds']} seeds); per-dataset means, paired over datasets",
        "",
        "| metric | A | B | B - A | SE | z |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in sorted(set(a["metrics"]) & set(b["metrics"])):
        x, y = np.asarray(a["metrics"][name]), np.asarray(b["metrics"][name])
        ok = np.isfinite(x) & np.isfinite(y)
        if ok.sum() < 2:
            continue
        d = y[ok] - x[ok]
        se = d.std(ddof=1) / math.sqrt(len(d))
        z = d.mean() / se if se > 0 else 0.0
        lines.append(
            f"| {name} | {x[ok].mean():.4g} | {y[ok].mean():.4g} | {d.mean():.3g} | {se:.3g} | {z:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cell", help="a trained cell's model.pt")
    parser.add_argument("--data", help="held-out datasets (.npz)")
    parser.add_argument("--pair", type=int, nargs=2, default=(5, 10))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--json")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = parser.parse_args(argv)
    if not args.compare and not (args.cell and args.data):
        parser.error("give --cell and --data (or --compare A B)")
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        print(compare(a, b))
        return
    out = run(Path(args.cell), Path(args.data), tuple(args.pair), args.device, args.seeds, args.batch)
    text = json.dumps(out)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(f"{out['device']}: " + ", ".join(f"{k} {np.nanmean(v):.4g}" for k, v in out["metrics"].items()))


if __name__ == "__main__":
    main()
