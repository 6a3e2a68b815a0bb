"""A search's section of ``tune.yaml`` checked and turned into its plan (everything the
driver and the trials of ``pipeline.search.stage`` need): the space of settings, the metric, the
(K, L) pair, the searcher, the scheduler and the validation set; a bad section is one
``ParamsError`` line before Ray starts. Also Tune's own search-space objects, and the key
that names a search's Ray experiment."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from apg.baselines import get_method
from apg.tasks import get_task
from apg.training import TrainConfig, build
from pipeline.config.params import ParamsError, apply_setting, read_yaml, setting_of

# grid: every value, each once (Tune's grid_search; the random searcher only, which crosses
# a grid with the other keys' draws).
DISTRIBUTIONS = ("uniform", "loguniform", "choice", "randint", "grid")
LISTED = ("choice", "grid")  # distributions given as their values


SECTIONS = ("train", "network", "model")


METRICS = {"log_joint": "max", "ess": "max", "mse": "min"}  # and ess_<block> (max): one kernel's ESS


ALGORITHMS = ("optuna", "hyperopt", "random")  # TPE (two libraries), or random


KEYS = {
    "method",
    "pair",
    "iterations",
    "space",
    "search",
    "scheduler",
    "metric",
    "eval_every",
    "time_budget_s",
    "validation",
    "seeds",
}


def load_section(path: str | Path, task: str) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: no such tuning params file")
    spec = read_yaml(path) or {}
    if not isinstance(spec, dict):
        raise ParamsError(f"{path} must hold a mapping of task sections")
    if task not in spec:
        raise ParamsError(f"{path}: no section {task}: (sections: {sorted(spec)})")
    return spec[task]


def _bad(where: str, message: str) -> ParamsError:
    return ParamsError(f"tune.yaml {where}: {message}")


def check_space(space: Any, where: str = "space") -> dict[str, tuple[str, Any]]:
    """``{section.key: (distribution, args)}`` from the ``space`` mapping, or ParamsError."""
    if not isinstance(space, dict) or not space:
        raise _bad(where, "must map at least one key (train.lr, network.hidden, ...) to a distribution")
    out = {}
    for key, dist in space.items():
        section, _, name = str(key).partition(".")
        if section not in SECTIONS or not name:
            raise _bad(f"{where}.{key}", f"keys are <section>.<name> with section one of {list(SECTIONS)}")
        if not isinstance(dist, dict) or len(dist) != 1:
            raise _bad(
                f"{where}.{key}",
                f"give one distribution, one of {list(DISTRIBUTIONS)}: {{uniform: [lo, hi]}}",
            )
        ((kind, args),) = dist.items()
        if kind not in DISTRIBUTIONS:
            raise _bad(f"{where}.{key}", f"unknown distribution {kind!r}; one of {list(DISTRIBUTIONS)}")
        if kind in LISTED:
            if not isinstance(args, list) or not args:
                raise _bad(f"{where}.{key}", f"{kind} needs a non-empty list of values")
        else:
            if not (isinstance(args, list) and len(args) == 2 and all(_is_number(a) for a in args)):
                raise _bad(f"{where}.{key}", f"{kind} needs [low, high], two numbers; got {args!r}")
            lo, hi = args
            if not lo < hi:
                raise _bad(f"{where}.{key}", f"{kind} needs low < high; got [{lo}, {hi}]")
            if kind == "loguniform" and lo <= 0:
                raise _bad(f"{where}.{key}", f"loguniform needs 0 < low; got [{lo}, {hi}]")
            if kind == "randint" and not all(isinstance(a, int) for a in args):
                raise _bad(f"{where}.{key}", f"randint needs integer bounds; got [{lo}, {hi}]")
        out[str(key)] = (kind, args)
    return out


def in_space(spec: tuple[str, Any], value: Any) -> bool:
    """Whether ``value`` is one the distribution ``(kind, args)`` can draw."""
    kind, args = spec
    if kind in LISTED:
        return value in args
    return _is_number(value) and args[0] <= value <= args[1] and (kind != "randint" or isinstance(value, int))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def extremes(space: dict[str, tuple[str, Any]]) -> list[dict[str, Any]]:
    """Settings that touch every bound of every key (each key's low, then each key's high /
    each choice, the others at their first value): what ``check_section`` builds."""

    def values(kind: str, args: Any) -> list[Any]:
        if kind in LISTED:
            return list(args)
        return [args[0], args[1] - 1] if kind == "randint" else list(args)

    first = {key: values(*spec)[0] for key, spec in space.items()}
    out = [first]
    for key, spec in space.items():
        out += [{**first, key: v} for v in values(*spec)[1:]]
    return out


def check_section(params: dict[str, Any], task: str, section: dict[str, Any]) -> dict[str, Any]:
    """The search's plan (everything the driver and the trials need), or ParamsError."""
    unknown = sorted(set(section) - KEYS)
    if unknown:
        raise _bad(task, f"unknown key(s) {unknown}; known: {sorted(KEYS)}")
    if task not in params.get("tasks", []):
        raise _bad(task, f"task {task!r} is not in params.yaml's tasks {params.get('tasks')}")
    space = check_space(section.get("space"), f"{task}.space")
    metric = section.get("metric", "log_joint")
    if not (isinstance(metric, str) and (metric in METRICS or metric.startswith("ess_"))):
        raise _bad(f"{task}.metric", f"one of {sorted(METRICS)} or ess_<block>, got {metric!r}")
    if metric == "mse" and get_task(task).reconstruct is None:
        raise _bad(f"{task}.metric", f"task {task} does not reconstruct its data: no mse")
    pair = section.get("pair")
    if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, int) and v >= 1 for v in pair)):
        raise _bad(f"{task}.pair", f"[K, L] with positive integers, got {pair!r}")
    task_params = params[task]
    train = dict(task_params.get("train", {}))
    iterations = section.get("iterations", train.get("iterations"))
    eval_every = section.get("eval_every", 100)
    for name, value in (("iterations", iterations), ("eval_every", eval_every)):
        if not (isinstance(value, int) and value >= 1):
            raise _bad(f"{task}.{name}", f"a positive integer, got {value!r}")
    search = _check_search(task, dict(section.get("search", {})))
    scheduler = section.get("scheduler", {"asha": {}})
    asha = _check_scheduler(task, scheduler, iterations)
    seeds = _check_grids_and_seeds(task, section.get("seeds"), space, search, scheduler)
    pbt = _check_pbt(task, scheduler, space, search["algorithm"], iterations, eval_every)
    budget = section.get("time_budget_s")
    if budget is not None and not (_is_number(budget) and budget > 0):
        raise _bad(f"{task}.time_budget_s", f"a positive number of seconds, got {budget!r}")
    validation = section.get("validation")
    if not (isinstance(validation, dict) and {"num_datasets", "seed"} <= set(validation)):
        raise _bad(f"{task}.validation", "needs {num_datasets, seed, sizes}: a set simulated for the search")
    used = {s["seed"] for s in [task_params["data"]["train"], *_held_out(task_params)]}
    if validation["seed"] in used:
        raise _bad(f"{task}.validation.seed", f"{validation['seed']} is a seed of the training or a test set")
    method = section.get("method", "apg")
    options = train.pop("method_options", None) or {}  # keyed by method, as in the sweep's grid
    base = {
        **train,
        "method_options": dict(options.get(method, {})),
        "task": task,
        "method": method,
        "sweeps": pair[0],
        "particles": pair[1],
        "iterations": iterations,
        "model": task_params.get("model", {}),
        "network": task_params.get("network", {}),
    }
    base.pop("seed", None)
    # Every bound of every key must make a model and proposals that the method accepts.
    for setting in extremes(space):
        try:
            cfg = TrainConfig.from_dict(apply_setting(base, setting)).validate()
            build(cfg)
        except (TypeError, ValueError, KeyError) as err:
            text = str(err).strip().splitlines()
            raise _bad(f"{task}.space", f"{setting}: {text[0] if text else type(err).__name__}") from None
    _check_block_metric(task, task_params, method, pair, metric)
    # params.yaml's own settings are the search's first trial when the space holds them: the
    # report then says how they did against the best.
    current = {key: setting_of(base, key) for key in space}
    reference = current if all(in_space(space[k], v) for k, v in current.items()) else None
    return {
        "task": task,
        "space": space,
        "reference": reference,
        "base": base,
        "metric": metric,
        "mode": METRICS.get(metric, "max"),
        "eval_every": eval_every,
        "iterations": iterations,
        **search,
        "asha": asha,
        # only when chosen: the plan of a search without PBT (its Ray experiment's key) is as before
        **({"pbt": pbt} if pbt is not None else {}),
        "time_budget_s": budget,
        "validation": validation,
        "pair": pair,
        # only when given: the plan of a search with one training seed (its key) is as before
        **({"seeds": seeds} if seeds is not None else {}),
    }


def _check_grids_and_seeds(
    task: str,
    seeds: Any,
    space: dict[str, tuple[str, Any]],
    search: dict[str, Any],
    scheduler: dict[str, Any],
) -> list[int] | None:
    """The section's ``seeds``: training seeds every setting is trained with, each its own
    trial, the setting ranked by its mean score over them (a setting that trains well for one
    seed and stalls for another is found out). ``None``: one trial a setting, trained with the
    search's ``seed``.

    The same setting must reach each seed: the random searcher crossing a grid (a model-based
    searcher proposes each trial's setting anew). And each seed must train to the end: a
    scheduler that stops trials early would compare a setting's seeds at different lengths."""
    algorithm = search["algorithm"]
    grids = [key for key, (kind, _) in space.items() if kind == "grid"]
    if grids and algorithm != "random":
        raise _bad(
            f"{task}.search.algorithm",
            f"a grid ({', '.join(grids)}) needs the random searcher, got {algorithm!r}",
        )
    if seeds is None:
        return None
    where = f"{task}.seeds"
    if not (
        isinstance(seeds, list)
        and seeds
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
        and len(set(seeds)) == len(seeds)
    ):
        raise _bad(where, f"a list of distinct non-negative integers, got {seeds!r}")
    if algorithm != "random" or any(kind != "grid" for kind, _ in space.values()):
        raise _bad(
            where, "every setting is trained with each seed: give the space as grids and the random searcher"
        )
    if "fifo" not in scheduler:
        raise _bad(where, f"each seed trains to the end: scheduler {{fifo: {{}}}}, got {scheduler!r}")
    if search["num_samples"] != 1:
        raise _bad(
            f"{task}.search.num_samples", "1 with seeds: the grid crossed with the seeds is every trial"
        )
    return seeds


def _check_search(task: str, search: dict[str, Any]) -> dict[str, Any]:
    """The section's ``search``: the algorithm, its number of trials, seed and concurrency."""
    algorithm = search.get("algorithm", "optuna")
    if algorithm not in ALGORITHMS:
        raise _bad(f"{task}.search.algorithm", f"one of {list(ALGORITHMS)}, got {algorithm!r}")
    num_samples = search.get("num_samples", 8)
    if not (isinstance(num_samples, int) and num_samples >= 1):
        raise _bad(f"{task}.search.num_samples", f"a positive integer, got {num_samples!r}")
    # TPE learns from finished trials: a few in flight, not all (2 suits 2 cores; a cluster
    # may run more). The random search runs as many as the resources allow.
    max_concurrent = search.get("max_concurrent", 2)
    if not (isinstance(max_concurrent, int) and max_concurrent >= 1):
        raise _bad(f"{task}.search.max_concurrent", f"a positive integer, got {max_concurrent!r}")
    unknown = sorted(set(search) - {"algorithm", "num_samples", "seed", "max_concurrent"})
    if unknown:
        raise _bad(
            f"{task}.search", f"unknown key(s) {unknown}; known: algorithm, num_samples, seed, max_concurrent"
        )
    return {
        "algorithm": algorithm,
        "num_samples": num_samples,
        "seed": search.get("seed", 0),
        "max_concurrent": max_concurrent,
    }


SCHEDULERS = ("asha", "fifo", "pbt")
PBT_KEYS = ("perturbation_interval", "quantile_fraction", "resample_probability", "synch")


def _check_scheduler(task: str, scheduler: Any, iterations: int) -> dict[str, Any] | None:
    """The section's ``scheduler``: ASHA's settings, or ``None`` for FIFO or PBT."""
    if not (isinstance(scheduler, dict) and len(scheduler) == 1 and next(iter(scheduler)) in SCHEDULERS):
        raise _bad(
            f"{task}.scheduler",
            "{asha: {grace_period, reduction_factor}}, {pbt: {perturbation_interval, "
            f"quantile_fraction, resample_probability}} or {{fifo: {{}}}}, got {scheduler!r}",
        )
    asha = scheduler.get("asha")
    if asha is not None:
        unknown = sorted(set(asha) - {"grace_period", "reduction_factor"})
        if unknown:
            raise _bad(f"{task}.scheduler.asha", f"unknown key(s) {unknown}")
        if not (
            isinstance(asha.get("grace_period", 1), int) and 1 <= asha.get("grace_period", 1) <= iterations
        ):
            raise _bad(f"{task}.scheduler.asha.grace_period", f"an integer in [1, iterations={iterations}]")
        if not (_is_number(asha.get("reduction_factor", 2)) and asha.get("reduction_factor", 2) > 1):
            raise _bad(f"{task}.scheduler.asha.reduction_factor", "a number > 1")
    return asha


def _check_pbt(
    task: str,
    scheduler: dict[str, Any],
    space: dict[str, tuple[str, Any]],
    algorithm: str,
    iterations: int,
    eval_every: int,
) -> dict[str, Any] | None:
    """PBT's settings, or ``None`` when another scheduler was chosen.

    PBT copies a better trial's weights into a worse one and perturbs its settings while it
    trains, so every searched key must be one a running trainer can take mid-way (``train.*``:
    the rate is applied at every step), the population is drawn at random (a model-based
    searcher would learn from scores whose settings changed under it), and settings change
    only where a trial checkpoints (every ``eval_every``). ``synch`` (default true): every
    trial waits at each perturbation point for the others, so which trial copies which
    depends on the scores alone, not on which trials the cores happened to run first
    (``synch: false``, Tune's asynchronous PBT, keeps the cores busy instead)."""
    pbt = scheduler.get("pbt")
    if pbt is None:
        return None
    where = f"{task}.scheduler.pbt"
    if not isinstance(pbt, dict) or set(pbt) - set(PBT_KEYS):
        raise _bad(where, f"a mapping of {', '.join(PBT_KEYS)}, got {pbt!r}")
    fixed = [key for key in space if not key.startswith("train.")]
    if fixed:
        raise _bad(
            f"{task}.space",
            f"PBT changes settings while a trial trains: train.* keys only, not {fixed} "
            "(they shape the networks or the model)",
        )
    if algorithm != "random":
        raise _bad(
            f"{task}.search.algorithm", f"PBT draws its population at random: 'random', got {algorithm!r}"
        )
    interval = pbt.get("perturbation_interval", eval_every)
    if not (isinstance(interval, int) and interval % eval_every == 0 and eval_every <= interval < iterations):
        raise _bad(
            f"{where}.perturbation_interval",
            f"a multiple of eval_every={eval_every} below iterations={iterations}, got {interval!r}",
        )
    quantile = pbt.get("quantile_fraction", 0.25)
    if not (_is_number(quantile) and 0 < quantile <= 0.5):
        raise _bad(f"{where}.quantile_fraction", f"a number in (0, 0.5], got {quantile!r}")
    resample = pbt.get("resample_probability", 0.25)
    if not (_is_number(resample) and 0 <= resample <= 1):
        raise _bad(f"{where}.resample_probability", f"a number in [0, 1], got {resample!r}")
    synch = pbt.get("synch", True)
    if not isinstance(synch, bool):
        raise _bad(f"{where}.synch", f"true or false, got {synch!r}")
    return {
        "perturbation_interval": interval,
        "quantile_fraction": quantile,
        "resample_probability": resample,
        "synch": synch,
    }


def _check_block_metric(
    task: str, task_params: dict[str, Any], method: str, pair: list[int], metric: str
) -> None:
    """A block's ESS as the metric (``ess_<block>``) needs that block and block updates."""
    if metric.startswith("ess_"):
        blocks = [f"ess_{b}" for b in get_task(task).build_model(**task_params.get("model", {})).blocks]
        if metric not in blocks:
            raise _bad(f"{task}.metric", f"a block's ESS is one of {blocks}, got {metric!r}")
        if not get_method(method).kernels or pair[0] < 2:  # block updates run from sweep 2 on
            raise _bad(
                f"{task}.metric", f"{metric} needs block updates: method {method} at K={pair[0]} has none"
            )


def _held_out(task_params: dict[str, Any]) -> list[dict[str, Any]]:
    data = task_params["data"]
    return [*([data["test"]] if "test" in data else []), *data.get("tests", []), *data.get("figures", [])]


def trial_count(plan: dict[str, Any]) -> int:
    """The search's trials: ``num_samples`` times each grid's values times the seeds."""
    count = plan["num_samples"] * len(plan.get("seeds", [None]))
    for kind, args in plan["space"].values():
        count *= len(args) if kind == "grid" else 1
    return count


def tune_space(space: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    """Tune's own search-space objects (``randint`` upper bounds are inclusive here)."""
    from ray import tune

    make = {
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
        "choice": lambda a: tune.choice(a),
        "randint": lambda a: tune.randint(a[0], a[1] + 1),
        "grid": lambda a: tune.grid_search(a),
    }
    return {key: make[kind](args) for key, (kind, args) in space.items()}


# How the report and best-params.yaml name the search (the command, the tuning file, where
# the best settings went): not part of what the search computes.
PRESENTATION = ("command", "source", "best_file", "method_flag")


def computed(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan without how the search is named (``PRESENTATION``): what its trials compute."""
    return {k: v for k, v in plan.items() if k not in PRESENTATION}


def plan_key(plan: dict[str, Any]) -> str:
    """Names the search's Ray experiment: the same section resumes, a changed one starts afresh."""
    import hashlib

    settings = {k: v for k, v in computed(plan).items() if k != "time_budget_s"}
    text = json.dumps(settings, sort_keys=True, default=str)
    return "search-" + hashlib.sha256(text.encode()).hexdigest()[:10]
