"""The evaluation rows the report reads (``results/eval/<task>/`` or the copy kept in
``reports/data/<task>/``) and the row selections every table, figure and claim shares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from apg.data import atomic_write
from pipeline.recorded.files import compress_samples

PAPER_NUMBERS = Path(__file__).parents[1] / "paper_numbers.yaml"

CURVE_METRICS = ("log_joint", "ess")


def load_results(eval_dir: Path) -> dict[str, Any]:
    for name in ("meta.json", "metrics.parquet", "training.parquet", "samples.npz"):
        if not (eval_dir / name).is_file():
            raise ValueError(f"{eval_dir / name} not found; run the evaluate stage first")
    samples = read_arrays(eval_dir / "samples.npz")
    meta = json.loads((eval_dir / "meta.json").read_text())
    metrics = pd.read_parquet(eval_dir / "metrics.parquet")
    training = pd.read_parquet(eval_dir / "training.parquet")
    # A cell of a swept axis is a method of its own in every table and figure: "apg
    # [network.hidden=64]"; its plain method name stays in base_method.
    labels = {c["cell_id"]: method_label(c) for c in meta["cells"]}
    for cell in meta["cells"]:
        cell["base_method"], cell["method"] = cell["method"], labels[cell["cell_id"]]
    for frame in (metrics, training):
        frame["method"] = frame["cell_id"].map(labels).fillna(frame["method"])
    imputation = None
    if (eval_dir / "imputation.parquet").is_file():
        examples = eval_dir / "imputation_examples.npz"
        imputation = (
            pd.read_parquet(eval_dir / "imputation.parquet"),
            read_arrays(examples) if examples.is_file() else {},
        )
    return {
        "meta": meta,
        "metrics": metrics,
        "training": training,
        "samples": samples,
        "imputation": imputation,
        "animation": read_arrays(eval_dir / ANIMATION)["frames"]
        if (eval_dir / ANIMATION).is_file()
        else None,
    }


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file, read into memory."""
    with np.load(path) as archive:
        return {k: archive[k] for k in archive.files}


def method_label(cell: dict[str, Any]) -> str:
    """``method``, or ``method [key=value,...]`` for a cell of a grid entry's axes."""
    axes = cell.get("axes") or {}
    return f"{cell['method']} [{','.join(f'{k}={v}' for k, v in axes.items())}]" if axes else cell["method"]


def finals(frame: pd.DataFrame) -> pd.DataFrame:
    """Each (cell, K, L, metric, dataset)'s value at the run's last sweep."""
    last = frame.groupby(["cell_id", "K", "L", "metric"])["sweep"].transform("max")
    return frame[frame["sweep"] == last]


def training_length(meta: dict[str, Any]) -> str:
    """How long the cells trained: the count most methods share, then the other methods'
    ("8000 training iterations (gibbs-bootstrap, reparam 5000; gibbs untrained)")."""
    per_method: dict[str, set[int]] = {}
    for cell in meta.get("cells", []):
        per_method.setdefault(cell["method"], set()).add(int(cell["iterations"]))
    if not per_method:  # results written before the metadata listed its cells
        return "/".join(str(i) for i in meta["iterations"]) + " training iterations"
    methods: dict[str, list[str]] = {}  # "8000" (or "3000/4500" for a method's grid) -> methods
    for method, counts in per_method.items():
        methods.setdefault("/".join(map(str, sorted(counts))), []).append(method)
    main = max((c for c in methods if c != "0"), key=lambda c: len(methods[c]), default="0")
    others = [
        f"{', '.join(methods[c])} {'untrained' if c == '0' else c}"
        for c in sorted(methods, key=lambda c: -int(c.split("/")[-1]))
        if c != main
    ]
    return f"{main} training iterations" + (f" ({'; '.join(others)})" if others else "")


def scale_caption(meta: dict[str, Any], label: str) -> str:
    sets = meta.get("test_sets") or []
    if len(sets) > 1:
        held_out = "held-out sets " + ", ".join(f"{s['name']} ({s['num_datasets']})" for s in sets)
    else:
        held_out = f"{meta['test_datasets']} held-out datasets"
    # What the training sets hold (points, frames, digits), so that every number this caption
    # heads says what it was trained on as well as what it was tested on.
    sizes = "; ".join(f"{k} {v}" for k, v in (meta.get("train_sizes") or {}).items() if k != "split")
    return (
        f"{label}: {training_length(meta)} on {meta['train_datasets']} simulated datasets "
        f"({sizes + '; ' if sizes else ''}batch {meta['batch_size']}), {held_out}, seeds {meta['seeds']}"
    )


def primary_test_set(frame: pd.DataFrame, meta: dict[str, Any]) -> pd.DataFrame:
    """Rows of the first held-out set (Table 1, method table, sweep and budget figures);
    results written before several test sets existed have one set and no column."""
    sets = meta.get("test_sets") or []
    if "test_set" not in frame or not sets:
        return frame
    return frame[frame["test_set"] == sets[0]["name"]]


def main_rows(frame: pd.DataFrame, meta: dict[str, Any]) -> pd.DataFrame:
    """Rows of the cells Table 1, the method tables and the claims use: those a ``pairs``
    grid entry trained (``roles`` in meta.json). Cells trained only for Figure 2's retrained
    curve (``budget``) would otherwise be averaged into Table 1 with cells trained at another
    (K, L). A method with no ``main`` cell, and results written before roles existed, keep
    every cell."""
    roles = {c["cell_id"]: c.get("roles", ["main"]) for c in meta["cells"]}
    is_main = {cid: "main" in r for cid, r in roles.items()}
    has_main = {c["method"] for c in meta["cells"] if is_main[c["cell_id"]]}
    keep = [
        is_main.get(cid, True) or method not in has_main
        for cid, method in zip(frame["cell_id"], frame["method"], strict=True)
    ]
    return frame[keep]


def retrained_rows(frame: pd.DataFrame, meta: dict[str, Any]) -> pd.DataFrame:
    """Rows of the cells a ``budget`` grid entry trained, evaluated at their own training
    pair: Figure 2 retrained per budget (one point per cell)."""
    budget = {c["cell_id"] for c in meta["cells"] if "budget" in c.get("roles", [])}
    own = (frame["K"] == frame["train_K"]) & (frame["L"] == frame["train_L"])
    return frame[frame["cell_id"].isin(budget) & own]


# The evaluation rows the report reads, kept beside it (``reports/data/<task>/``) so that a
# clone rebuilds every table, figure and verdict without retraining (``--from-committed``).
COMMITTED_DATA = "data"

ANIMATION = "animation.npz"  # the GIF's frames, drawn by the evaluation (pipeline.evaluate.stage)

COMMITTED_FILES = ("meta.json", "metrics.parquet", "training.parquet", "imputation.parquet", ANIMATION)

COMMITTED_ARRAYS = ("samples.npz", "imputation_examples.npz")  # deflated: most of a video is empty canvas

STAGE_TIMES = "stage_times.json"


# The long form of reports/metrics.json (every cell's headline numbers, every claim's value and
# interval), kept out of DVC's metrics so that `dvc metrics show` prints a readable row.
FULL_METRICS = "metrics-full.json"


def commit_rows(eval_dir: Path, data_dir: Path) -> None:
    """Copy one task's evaluation rows into the report's ``data/<task>/``; files the
    evaluation no longer writes are removed there."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name in (*COMMITTED_FILES, *COMMITTED_ARRAYS):
        source, target = eval_dir / name, data_dir / name
        if not source.is_file():
            target.unlink(missing_ok=True)
        elif name in COMMITTED_ARRAYS:
            atomic_write(target, lambda tmp, source=source: compress_samples(source, tmp))
        else:
            atomic_write(target, lambda tmp, source=source: tmp.write_bytes(source.read_bytes()))
