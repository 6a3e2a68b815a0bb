"""Stage ``generate``: seeded simulated datasets for one task.

``python -m pipeline.generate --task gmm`` writes ``data/<task>/train.npz``, the
held-out sets (``test.npz`` for ``data.test``, ``test_<name>.npz`` for each entry of
``data.tests``) and ``figure_<i>.npz`` (small sets, possibly of other sizes, for the
sample pictures) from the ``<task>.model`` and ``<task>.data`` params.

``data.x_dtype`` (default float32) is the dtype ``x`` is stored in: float16 halves the
files of image tasks (Bouncing MNIST at paper scale: 60,000 videos of 10 x 96 x 96 are
22 GB in float32, 11 GB in float16); readers cast back to the default dtype.

A set is simulated and written in chunks of at most ``CHUNK_BYTES`` of arrays, so
memory stays bounded whatever its size (60,000 paper-scale videos would take 22 GB at
once); each array's chunks are spooled to a temporary file beside the output and then
copied into the archive. A set that fits one chunk (every CPU-sized set) is simulated in
one call, with the same draws as before chunking existed.

Files are byte-reproducible: the same params give the same bytes (``np.savez`` stamps
each archive member with the write time; here every member gets a fixed date). So a
re-run of the stage (after a code change, or by DVC, which deletes its outputs first)
keeps file digests, and thus the sweep's cell ids, stable: nothing is retrained.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apg.data import DatasetError, atomic_write
from apg.tasks import get_task
from pipeline.common import project_root
from pipeline.config import checks
from pipeline.config.params import evaluation_sets, load_params
from pipeline.provenance.stages import record_stage_time

CHUNK_BYTES = 256 * 2**20  # arrays simulated and written at once, at most (roughly)


def simulate_set(
    task: str, model_hparams: dict[str, Any], num_datasets: int, seed: int, sizes: dict[str, Any]
) -> dict[str, np.ndarray]:
    """One seeded simulated set as numpy arrays (``x`` plus the true latents), whole."""
    chunks = list(simulate_chunks(task, model_hparams, num_datasets, seed, sizes, chunk_bytes=None))
    return {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}


def simulate_chunks(
    task: str,
    model_hparams: dict[str, Any],
    num_datasets: int,
    seed: int,
    sizes: dict[str, Any],
    chunk_bytes: int | None = CHUNK_BYTES,
) -> Iterator[dict[str, np.ndarray]]:
    """The set's datasets in order, as dicts of numpy arrays of at most ``chunk_bytes``
    each (``None``: one chunk). All chunks draw from one generator seeded with ``seed``, so
    the set depends on its chunk size only when it needs more than one chunk."""
    spec = get_task(task)
    model = spec.build_model(**model_hparams)

    def simulate(count: int, generator: torch.Generator) -> dict[str, np.ndarray]:
        try:
            with torch.no_grad():
                arrays = spec.simulate(model, count, generator, **sizes)
        except TypeError as err:
            raise ValueError(f"{task}: bad dataset sizes {sizes} ({err})") from None
        if 0 in arrays["x"].shape[1:]:
            shape = tuple(arrays["x"].shape)
            raise ValueError(f"{task}: sizes {sizes} give datasets of no entries ('x' {shape})")
        if not torch.isfinite(arrays["x"]).all():  # a model hyperparameter out of its range
            raise ValueError(
                f"{task}: the model {dict(model_hparams)} simulates NaN or infinite values of 'x'"
            )
        return {k: v.cpu().numpy() for k, v in arrays.items()}

    per_chunk = num_datasets
    if chunk_bytes is not None:  # one dataset's bytes, from a probe with its own generator
        probe = simulate(1, torch.Generator().manual_seed(seed))
        per_chunk = max(1, chunk_bytes // max(1, sum(a.nbytes for a in probe.values())))
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, num_datasets, per_chunk):
        yield simulate(min(per_chunk, num_datasets - start), generator)


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
        written.append(save_reproducible(out_dir / f"{stem}.npz", cast))
    stale = {p for p in out_dir.glob("*.npz")} - set(written)
    for path in sorted(stale):  # sets no longer in params (e.g. a renamed test set)
        path.unlink()
    return written


def save_reproducible(path: Path, arrays: dict[str, np.ndarray] | Iterator[dict[str, np.ndarray]]) -> Path:
    """Like ``apg.data.save_dataset`` (an uncompressed ``.npz``, written atomically), but the
    bytes depend only on the arrays: members in sorted order with a fixed timestamp.

    ``arrays``: the arrays, or an iterator of chunks of them (dicts with the same names,
    concatenated along the first axis), which are spooled to disk one at a time.
    """
    chunks = iter([arrays]) if isinstance(arrays, dict) else arrays
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as spool_dir:
        spool, layout = _spool(chunks, Path(spool_dir))
        if "x" not in layout:
            raise DatasetError("a dataset needs an array named 'x'")

        def write(tmp: Path) -> None:
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
                for name in sorted(layout):
                    info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                    with archive.open(info, "w", force_zip64=True) as member:
                        _write_npy_header(member, layout[name])
                        with open(spool[name], "rb") as body:
                            shutil.copyfileobj(body, member, 16 * 2**20)

        return atomic_write(path, write)


def _spool(
    chunks: Iterator[dict[str, np.ndarray]], spool_dir: Path
) -> tuple[dict[str, Path], dict[str, dict[str, Any]]]:
    """Append each chunk's arrays (C order) to one file per name; return the files and each
    array's ``.npy`` header fields for the whole."""
    spool: dict[str, Path] = {}
    layout: dict[str, dict[str, Any]] = {}
    for chunk in chunks:
        if layout and set(chunk) != set(layout):
            raise ValueError(f"chunks hold different arrays: {sorted(chunk)} vs {sorted(layout)}")
        for name, array in chunk.items():
            array = np.ascontiguousarray(array)
            header = np.lib.format.header_data_from_array_1_0(array)
            if name not in layout:
                layout[name], spool[name] = header, spool_dir / f"{name}.bin"
            else:
                rows, *rest = layout[name]["shape"]
                if (header["descr"], tuple(rest)) != (layout[name]["descr"], array.shape[1:]):
                    raise ValueError(f"chunks of {name!r} differ in dtype or trailing shape")
                layout[name]["shape"] = (rows + array.shape[0], *rest)
            with open(spool[name], "ab") as f:
                f.write(array.data)
    return spool, layout


def _write_npy_header(member: Any, header: dict[str, Any]) -> None:
    """The header ``np.lib.format.write_array`` would write for the whole array (version
    1.0 unless the header needs 2.0)."""
    try:
        np.lib.format.write_array_header_1_0(member, header)
    except ValueError:
        np.lib.format.write_array_header_2_0(member, header)


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
