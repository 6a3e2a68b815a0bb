"""Stage ``generate``: seeded simulated datasets for one task.

``python -m pipeline.generate --task gmm`` writes ``data/<task>/train.npz``, the
held-out sets (``test.npz`` for ``data.test``, ``test_<name>.npz`` for each entry of
``data.tests``) and ``figure_<i>.npz`` (small sets, possibly of other sizes, for the
sample pictures) from the ``<task>.model`` and ``<task>.data`` params.

``data.x_dtype`` (default float32) is the dtype ``x`` is stored in: float16 halves the
files of image tasks (Bouncing MNIST at paper scale: 60,000 videos of 10 x 96 x 96 are
22 GB in float32, 11 GB in float16); readers cast back to the default dtype.

Files are byte-reproducible: the same params give the same bytes (``np.savez`` stamps
each archive member with the write time; here every member gets a fixed date). So a
re-run of the stage (after a code change, or by DVC, which deletes its outputs first)
keeps file digests, and thus the sweep's cell ids, stable: nothing is retrained.
"""

from __future__ import annotations

import argparse
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apg.data import DatasetError, atomic_write
from apg.tasks import get_task
from pipeline.common import project_root
from pipeline.config import evaluation_sets, load_params
from pipeline.provenance import record_stage_time


def simulate_set(
    task: str, model_hparams: dict[str, Any], num_datasets: int, seed: int, sizes: dict[str, Any]
) -> dict[str, np.ndarray]:
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
    """``{file stem: data-set params}`` for a task section: train, test sets, figure_<i>."""
    sets = {"train": section["data"]["train"]}
    for entry in evaluation_sets(section):
        sets[entry["stem"]] = entry
    return sets


def generate(task: str, params: dict[str, Any], out_dir: Path) -> list[Path]:
    section = params[task]
    x_dtype = np.dtype(section["data"].get("x_dtype", "float32"))
    written = []
    for stem, entry in planned_sets(section).items():
        arrays = simulate_set(
            task, section.get("model", {}), entry["num_datasets"], entry["seed"], entry.get("sizes", {})
        )
        arrays["x"] = arrays["x"].astype(x_dtype)
        written.append(save_reproducible(out_dir / f"{stem}.npz", arrays))
    stale = {p for p in out_dir.glob("*.npz")} - set(written)
    for path in sorted(stale):  # sets no longer in params (e.g. a renamed test set)
        path.unlink()
    return written


def save_reproducible(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    """Like ``apg.data.save_dataset`` (an uncompressed ``.npz``, written atomically), but the
    bytes depend only on the arrays: members in sorted order with a fixed timestamp."""
    if "x" not in arrays:
        raise DatasetError("a dataset needs an array named 'x'")

    def write(tmp: Path) -> None:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name in sorted(arrays):
                info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                with archive.open(info, "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.ascontiguousarray(arrays[name]), allow_pickle=False)

    return atomic_write(path, write)


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
        start = time.monotonic()
        for path in generate(args.task, params, Path(args.out or f"data/{args.task}")):
            print(f"wrote {path}")
        record_stage_time(project_root(), "generate", args.task, time.monotonic() - start)

    run_guarded(work)


if __name__ == "__main__":
    main()
