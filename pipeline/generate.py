"""Stage ``generate``: seeded simulated datasets for one task.

``python -m pipeline.generate --task gmm`` writes ``data/<task>/train.npz``,
``test.npz`` and ``figure_<i>.npz`` (small sets, possibly of other sizes, for the
sample pictures) from the ``<task>.model`` and ``<task>.data`` params.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apg.data import save_dataset
from apg.tasks import get_task
from pipeline.config import load_params


def simulate_set(task: str, model_hparams: dict[str, Any], num_datasets: int, seed: int, sizes: dict[str, Any]) -> dict[str, np.ndarray]:
    """One seeded simulated set as numpy arrays (``x`` plus the true latents)."""
    spec = get_task(task)
    model = spec.build_model(**model_hparams)
    try:
        with torch.no_grad():
            arrays = spec.simulate(model, num_datasets, torch.Generator().manual_seed(seed), **sizes)
    except TypeError as err:
        raise ValueError(f"{task}: bad dataset sizes {sizes} ({err})") from None
    return {k: v.cpu().numpy() for k, v in arrays.items()}


def planned_sets(section: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{file stem: data-set params}`` for a task section: train, test, figure_<i>."""
    data = section["data"]
    sets = {"train": data["train"], "test": data["test"]}
    for i, entry in enumerate(data.get("figures", [])):
        sets[f"figure_{i}"] = entry
    return sets


def generate(task: str, params: dict[str, Any], out_dir: Path) -> list[Path]:
    section = params[task]
    written = []
    for stem, entry in planned_sets(section).items():
        arrays = simulate_set(task, section.get("model", {}), entry["num_datasets"], entry["seed"], entry.get("sizes", {}))
        written.append(save_dataset(out_dir / f"{stem}.npz", arrays))
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default=None, help="output directory (default data/<task>)")
    args = parser.parse_args(argv)
    from pipeline.cli import run_guarded

    def work() -> None:
        params = load_params(args.params)
        if args.task not in params["tasks"]:
            raise ValueError(f"task {args.task!r} is not listed in tasks: {params['tasks']}")
        for path in generate(args.task, params, Path(args.out or f"data/{args.task}")):
            print(f"wrote {path}")

    run_guarded(work)


if __name__ == "__main__":
    main()
