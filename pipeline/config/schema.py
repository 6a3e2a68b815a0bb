"""The schema of ``params.yaml``: the keys each section allows with their types, and the
checks of one value against it.

Every check raises ``ParamsError`` with one line naming the key (``<task>.grid[0].pairs[1]:
...``); ``pipeline.config.params`` walks the file with them (sections, held-out sets, the grid).
"""

from __future__ import annotations

import difflib
from typing import Any, NamedTuple

from pipeline.config import checks
from pipeline.config.checks import ParamsError, first_line, is_kind

__all__ = ["ParamsError", "first_line", "is_kind"]


class AtLeast(NamedTuple):
    """A key's type with a lower bound on its value."""

    kind: Any
    low: float


# Allowed keys per section, with their expected types (``AtLeast``: and lowest value).
# ``dict`` values under ``model``, ``network`` and ``sizes`` are free-form (they are the
# task's own keyword arguments and are checked by calling the task's builders).
SWEEP_KEYS: dict[str, Any] = {
    "ray_address": (str, type(None)),
    "num_cpus": (int, type(None)),
    "cpus_per_trial": AtLeast((int, float), 0),
    "gpus_per_trial": AtLeast((int, float), 0),
    "max_concurrent": AtLeast(int, 0),
    "max_failures": AtLeast(int, 0),
    "checkpoint_every": AtLeast(int, 1),
    "log_every": AtLeast(int, 1),
    "torch_threads": AtLeast(int, 1),
    "storage": str,
    "reuse_across_code": bool,  # development only: reuse cells trained by other code
}
TRACKING_KEYS: dict[str, Any] = {"experiment": str}
REPORT_KEYS: dict[str, Any] = {"out": str, "figure_format": str, "scale": str}
TASK_KEYS: dict[str, Any] = {
    "model": dict,
    "network": dict,
    "data": dict,
    "train": dict,
    "grid": list,
    "evaluate": dict,
}
DATA_SET_KEYS: dict[str, Any] = {
    "num_datasets": int,
    "seed": int,
    "sizes": dict,
    "name": str,
    "network": dict,
}
# ``<task>.data`` itself: the training set, held-out test sets (one ``test`` or several
# named ``tests``), figure sets, and the dtype ``x`` is stored in.
DATA_KEYS: dict[str, Any] = {"train": dict, "test": dict, "tests": list, "figures": list, "x_dtype": str}
# Storage dtypes for ``x``: a plain cast back to the default dtype on load, so every
# reader (sweep, evaluate, cli) works unchanged. float16 halves the files (grey levels in
# [0, 1] keep 11 significant bits); integer quantization would need a scale every reader knows.
X_DTYPES = ("float32", "float64", "float16")
TRAIN_KEYS: dict[str, Any] = {
    "batch_size": int,
    "iterations": int,
    "lr": (int, float),
    "lr_schedule": str,  # constant | cosine (apg.training.learning_rate)
    "lr_final_factor": (int, float),
    "lr_hold_fraction": (int, float),  # cosine: the last fraction of steps at the floor rate
    "compile": bool,  # torch.compile the step (Bouncing MNIST APG: per block): GPU trials (apg.training)
    "resample_mode": str,
    "resampler": str,
    "method_options": dict,  # {method name: {option: value}}, e.g. {hmc-rws: {step_size: 0.05}}
}
# The training settings a task's ``train`` must state: every one ``TrainConfig`` gives no
# default (a cell's task, method, K and L come from the grid).
STATED_TRAIN_KEYS = ("batch_size", "iterations", "lr")
# ``train``: overrides of ``<task>.train`` for this entry's cells only (e.g. one iteration
# for exact Gibbs, which has nothing to learn). ``network``: overrides of ``<task>.network``
# for this entry's cells only (a baseline at the width its own search chose); the cells keep
# their method's name, unlike an axis value.
# ``axes``: ``{section.key: [values]}`` crossed with the entry's methods, budgets and seeds;
# section is one of AXIS_SECTIONS (``train.lr``, ``network.hidden``, ``model.sigma0``).
GRID_KEYS: dict[str, Any] = {
    "methods": list,
    "pairs": list,
    "budget": dict,
    "seeds": list,
    "train": dict,
    "network": dict,
    "axes": dict,
}
AXIS_SECTIONS = ("train", "network", "model")
BUDGET_KEYS: dict[str, Any] = {"total": int, "sweeps": list}
EVALUATE_KEYS: dict[str, Any] = {
    "batch_size": int,
    "resample_mode": str,
    # Also run every cell resampling once per sweep, for the paper's overall ESS {all blocks}
    # (Table 1's ESS column, section 5.3): the metric ``sweep_ess``.
    "sweep_resampling": bool,
    "seed": int,
    "pairs": list,
    "budget": dict,
    "baseline": str,
    "figure_sweeps": list,
    "figure_particles": int,
    "threads": int,  # torch threads of the evaluate stage (default: sweep.torch_threads)
    "imputation": dict,
}
# evaluate.imputation (issue 22, pipeline/evaluate/impute.py): which cells impute hidden entries of
# which held-out set, and how.
IMPUTATION_KEYS: dict[str, Any] = {
    "methods": list,
    "test_set": str,
    "num_datasets": AtLeast(int, 1),
    "pair": list,
    "iterations": AtLeast(int, 1),
    "burn_in": AtLeast(int, 0),
    "fill": str,
    "seed": int,
    "fraction": (int, float),  # gmm: the share of points with one coordinate hidden
    "occlusions": list,  # bmnist: [{start, frames}] blanked frames or [{rows, cols}] regions
}
TOP_KEYS = ("tasks", "sweep", "tracking", "report")


def budget_pairs(budget: Any, where: str) -> list[tuple[int, int]]:
    budget = check_mapping(budget, where, BUDGET_KEYS)
    total = budget.get("total")
    if not is_kind(total, int) or total < 2:
        raise ParamsError(f"{where}.total: must be an integer K*L >= 2, got {total!r}")
    if not budget.get("sweeps"):
        raise ParamsError(f"{where}.sweeps: list at least one K")
    pairs = []
    for j, k in enumerate(check_sweeps(budget["sweeps"], f"{where}.sweeps")):
        if total < k:
            raise ParamsError(f"{where}.total: budget {total} is smaller than K={k}")
        if total // k < 2:
            raise ParamsError(f"{where}.sweeps[{j}]: budget {total} // K={k} leaves L < 2 particles")
        pairs.append((k, total // k))
    return pairs


def check_sweeps(sweeps: list[Any], where: str) -> list[int]:
    for j, k in enumerate(sweeps):
        if not is_kind(k, int) or k < 1:
            raise ParamsError(f"{where}[{j}]: K must be an integer >= 1, got {k!r}")
    return sweeps


def check_pair(pair: Any, where: str) -> tuple[int, int]:
    if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(is_kind(v, int) for v in pair)):
        raise ParamsError(f"{where}: must be a pair [K, L] of integers, got {pair!r}")
    k, l = pair
    if k < 1:
        raise ParamsError(f"{where}: K must be >= 1, got {k}")
    if l < 2:
        raise ParamsError(f"{where}: L must be >= 2, got {l}")
    return k, l


def check_data_set(entry: Any, where: str) -> None:
    """One data set's keys (its sizes are the task's: ``checks.size_values``)."""
    entry = check_mapping(entry, where, DATA_SET_KEYS)
    if entry.get("num_datasets", 0) < 1:
        raise ParamsError(f"{where}.num_datasets: must be an integer >= 1, got {entry.get('num_datasets')!r}")
    if "seed" not in entry:
        raise ParamsError(f"{where}.seed: missing (datasets are always seeded)")
    checks.seed(entry["seed"], f"{where}.seed")
    checks.network_values(entry.get("network") or {}, f"{where}.network")


def check_mapping(value: Any, where: str, keys: dict[str, Any], required: bool = False) -> dict[str, Any]:
    """``value`` (``None``: ``{}``, or missing where ``required``) as a mapping of ``keys``: each
    key known, of its type and at least its ``AtLeast`` bound."""
    if value is None and required:
        raise ParamsError(f"{where}: missing section")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ParamsError(f"{where}: must be a mapping, got {type(value).__name__}")
    for key, item in value.items():
        if key not in keys:
            raise ParamsError(unknown_key(f"{where}.{key}", list(keys), "key"))
        want = keys[key]
        kind, low = want if isinstance(want, AtLeast) else (want, None)
        if not is_kind(item, kind):
            names = " or ".join(t.__name__ for t in (kind if isinstance(kind, tuple) else (kind,)))
            raise ParamsError(f"{where}.{key}: must be {names}, got {item!r}")
        if low is not None and item < low:
            raise ParamsError(f"{where}.{key}: must be >= {low}, got {item}")
    return value


def unknown_key(key: str, known: list[str], what: str) -> str:
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {sorted(known)}"
    return f"{key}: unknown {what}{hint}"
