"""Stage ``generate``: seeded simulated datasets for one task.

``python -m pipeline.generate --task gmm`` writes ``data/<task>/train.npz``, the
held-out sets (``test.npz`` for ``data.test``, ``test_<name>.npz`` for each entry of
``data.tests``) and ``figure_<i>.npz`` (small sets, possibly of other sizes, for the
sample pictures) from the ``<task>.model`` and ``<task>.data`` params.

``data.x_dtype`` (default float32) is the dtype ``x`` is stored in: float16 halves the
files of image tasks (Bouncing MNIST at paper scale: 60,000 videos of 10 x 96 x 96 are
22 GB in float32, 11 GB in float16); readers cast back to the default dtype.

A set is simulated and written in chunks of bounded size
(:func:`apg.tasks.simulation.simulate_chunks`, :func:`apg.data.save_dataset`), so memory
stays bounded whatever its size. Files are byte-reproducible: the same params give the
same bytes, so a re-run of the stage (after a code change, or by DVC, which deletes its
outputs first) keeps file digests, and thus the sweep's cell ids, stable: nothing is
retrained.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from apg.data import save_dataset
from apg.tasks.simulation import simulate_chunks
from pipeline.common import project_root
from pipeline.config import checks
from pipeline.config.params import evaluation_sets, load_params
from pipeline.provenance.stages import record_stage_time


def planned_sets(section: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{file stem: data-set params}`` for a task section: train, test sets, figure_<i>."""
    sets = {"train": section["data"]["train"]}
    for entry in evaluation_sets(section):
        sets[entry["stem"]] = entry
    return sets


def check_room(task: str, section: dict[str, Any], out_dir: Path) -> None:
    """Refuse, before anything is written, sets of which one dataset would not fit in memory,
    or which together would not fit on the disk under ``out_dir``: every archive (``x`` in
    its stored dtype) plus the spool of the largest, less the files they replace."""
    x_dtype = np.dtype(section["data"].get("x_dtype", "float32"))
    written, need = 0, 0  # bytes the sets written so far add; the most needed at once
    for stem, entry in planned_sets(section).items():
        one = checks.dataset_bytes(task, section.get("model", {}), entry.get("sizes", {}), x_dtype)
        checks.room(f"one dataset of {task}'s {stem} set", memory=one["simulated"])
        size = one["stored"] * entry["num_datasets"]
        need = max(need, written + 2 * size)  # its spool and its archive, before the spool goes
        old = out_dir / f"{stem}.npz"
        written += size - (old.stat().st_size if old.is_file() else 0)  # the file it replaces
    checks.room(f"{task}'s datasets ({', '.join(planned_sets(section))})", disk=need, folder=out_dir)


def generate(task: str, params: dict[str, Any], out_dir: Path) -> list[Path]:
    section = params[task]
    x_dtype = np.dtype(section["data"].get("x_dtype", "float32"))
    check_room(task, section, out_dir)
    written = []
    for stem, entry in planned_sets(section).items():
        chunks = simulate_chunks(
            task, section.get("model", {}), entry["num_datasets"], entry["seed"], entry.get("sizes", {})
        )
        cast = ({**c, "x": c["x"].astype(x_dtype)} for c in chunks)
        written.append(save_dataset(out_dir / f"{stem}.npz", cast))
    stale = {p for p in out_dir.glob("*.npz")} - set(written)
    for path in sorted(stale):  # sets no longer in params (e.g. a renamed test set)
        path.unlink()
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default=None, help="output directory (default data/<task>)")
    args = parser.parse_args(argv)
    from pipeline.errors import run_guarded

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
