"""What the stages compute, as short digests: the numerics fingerprint of a task's results.

The committed results are the code's own while the code computes the same numbers, not
while its source text is unchanged: a moved function, a renamed module or a new check of
the input keeps every number. :func:`task_numerics` runs each stage's own code on a few
datasets and hashes what comes out, rounded as :mod:`apg.fingerprint` rounds (the same code
gives slightly different float32 results on other CPUs; a real change moves a number by
far more than that):

- ``data``: the generate stage writes every set of the task's ``data`` params at
  ``DATASETS`` datasets each, through its own files (``pipeline.generate``), and every
  array read back is hashed;
- ``train``: the numerics fingerprint of each distinct training config of the grid
  (:func:`apg.fingerprint.fingerprint`, seeded as a trial is), on those training datasets;
- ``evaluate``: one config of each method, trained for the fingerprint's steps, scored by
  the evaluate stage (``held_out_frames``) on each held-out set at every pair the
  evaluation asks for; its numeric columns are hashed.

``python -m pipeline.provenance refresh`` compares these with the ones recorded beside the
results and, when every one is unchanged, takes the code's new digests into the record
(:mod:`pipeline.provenance.record`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

DATASETS = 2  # of each set: the fingerprint's batch (apg.fingerprint.BATCH)


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def _rounded_array(a: np.ndarray) -> Any:
    from apg.fingerprint import rounded

    if a.dtype.kind in "biu":
        return a.reshape(-1).tolist()
    # Summaries, not every entry: each is a chance for two CPUs' roundings to part.
    a = a.astype(np.float64)
    return [
        list(a.shape),
        rounded(float(a.sum())),
        rounded(float(np.abs(a).sum())),
        rounded(float((a * a).sum())),
    ]


def _small(section: dict[str, Any]) -> dict[str, Any]:
    """``section`` with every data set cut to ``DATASETS`` datasets."""
    out = copy.deepcopy(section)
    data = out["data"]
    for key in ("train", "test"):
        if key in data:
            data[key]["num_datasets"] = DATASETS
    for key in ("tests", "figures"):
        for entry in data.get(key) or []:
            entry["num_datasets"] = DATASETS
    return out


def task_numerics(params: dict[str, Any], task: str) -> dict[str, Any]:
    """``{"data": digest, "train": {config: digest}, "evaluate": {method: digest}}`` of
    ``task`` under ``params``, computed by this checkout's code on this machine."""
    import torch

    from apg.data import training_rows
    from apg.fingerprint import SEED, STEPS, fingerprint, shrunk
    from pipeline.common import seed_everything
    from pipeline.config.params import evaluation_pairs, grid_cells
    from pipeline.evaluate.stage import cell_pairs, cell_roles, held_out_frames, load_sets, training_ids
    from pipeline.generate import generate
    from pipeline.runs.loop import start

    section = _small(params[task])
    small_params = {**params, task: section}
    with tempfile.TemporaryDirectory() as tmp:
        written = generate(task, small_params, Path(tmp))
        data = {}
        for path in sorted(written):
            with np.load(path) as arrays:
                data[path.stem] = {k: _rounded_array(arrays[k]) for k in sorted(arrays.files)}
        x = training_rows(Path(tmp) / "train.npz")
        x = x[torch.arange(len(x))].to(torch.get_default_dtype())
        sets = [e for e in load_sets(task, section, Path(tmp)) if e["kind"] == "test"]

    train: dict[str, str] = {}
    first_of_method: dict[str, Any] = {}
    for cell in grid_cells(small_params, task):
        key = json.dumps(cell.train.to_dict(), sort_keys=True)
        if key not in train:
            train[key] = fingerprint(cell.train, x, seed_everything)
        first_of_method.setdefault(cell.method, cell)

    ev = section.get("evaluate", {})
    unique_pairs = sorted(
        {tuple(p) for pairs in evaluation_pairs(small_params, task).values() for p in pairs}
    )
    roles = cell_roles(small_params, task)
    evaluate: dict[str, str] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for method, cell in sorted(first_of_method.items()):
            cfg = shrunk(cell.train)
            trainer = start(cfg, x.clone(), "cpu", SEED)
            for _ in range(STEPS):
                trainer.step(log=False)
            trained = (cfg, trainer.model, trainer.proposals)
            row = {
                "method": method,
                "seed": cell.seed,
                "K": cell.sweeps,
                "L": cell.particles,
                "cell_id": "numerics",
            }
            ids = {"task": task, **training_ids(row)}
            pairs = cell_pairs(roles.get(cell.name, ["main"]), row, unique_pairs)
            rows = []
            for entry in sets:
                for frame in held_out_frames(
                    task, trained, entry, pairs, ids, ev, section.get("model", {}), "cpu"
                ):
                    rows.append(
                        {
                            f"{entry['name']}/K{frame['K'].iloc[0]}L{frame['L'].iloc[0]}/{metric}": _rounded_array(
                                part["value"].to_numpy()
                            )
                            for metric, part in frame.groupby("metric", sort=True)
                        }
                    )
            evaluate[method] = _digest(rows)
    finally:
        torch.set_num_threads(threads)
    return {
        "data": _digest(data),
        "train": {_digest(json.loads(k)): v for k, v in sorted(train.items())},
        "evaluate": evaluate,
    }


def numerics(params: dict[str, Any]) -> dict[str, Any]:
    """:func:`task_numerics` of every task of ``params`` that has its section (a report of
    rows alone, as some tests make, has none to compute)."""
    return {task: task_numerics(params, task) for task in params["tasks"] if task in params}


def differences(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The numbers that differ, as ``task/part[/key]`` (sorted; empty: all the same)."""
    out = []
    for task in sorted(set(recorded) | set(now)):
        old, new = recorded.get(task, {}), now.get(task, {})
        for part in sorted(set(old) | set(new)):
            a, b = old.get(part), new.get(part)
            if isinstance(a, dict) and isinstance(b, dict):
                out += [f"{task}/{part}/{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            elif a != b:
                out.append(f"{task}/{part}")
    return out
