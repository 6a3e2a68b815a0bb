"""Hyperparameter search: ``apg-pipeline tune --task T`` (stage ``tune@<task>`` of
``tuning/dvc.yaml``, outside the default ``dvc repro``).

Where a sweep trains a fixed grid of cells to the end (the reproduction), a search asks
Ray Tune for the best training settings of one method at one (K, L): a search algorithm
proposes settings from a space, a trial scheduler stops the trials that trail, and every
trial is scored on a validation set simulated for the search (its own seed; never a test
set). Its params are ``tune.yaml``, one section per task::

    gmm:
      method: apg
      pair: [5, 10]                 # (K, L) every trial trains and is scored at
      iterations: 3000              # per trial, at most (ASHA's max_t); default: <task>.train.iterations
      space:                        # Tune's vocabulary over keys of <task>.train / .network / .model
        train.lr: {loguniform: [1.0e-3, 3.0e-2]}
        network.hidden: {choice: [16, 32, 64]}
      search: {algorithm: optuna, num_samples: 8, seed: 0}     # optuna (TPE) or random
      scheduler: {asha: {grace_period: 500, reduction_factor: 2}}   # or fifo: {}
      metric: log_joint             # validation metric after the last sweep: log_joint, ess, ess_<block> (max) or mse (min)
      eval_every: 250               # iterations between validation scores (ASHA's time unit)
      time_budget_s: 1800           # optional: stop proposing trials after this long
      validation: {num_datasets: 20, seed: 101, sizes: {num_points: 60}}

Every other training setting is the task's in ``params.yaml``; its values of the searched
keys, when the space holds them, are the first trial (the report compares the best with them). Everything in the section
is checked before Ray starts: a bad space (unknown key, an empty choice, a negative
learning-rate bound, a log-uniform range touching zero) is one line on stderr.

Outputs, in ``results/tune/<task>/``: Ray's storage (an interrupted search resumes from it
when run again with the same section: finished trials are kept, unfinished ones go on from
their last validation checkpoint), ``trials.csv`` (one row per trial: its settings, its
last and best validation scores, how far it trained, whether ASHA stopped it early),
``best-params.yaml`` (the task's ``train`` / ``network`` / ``model`` sections of
``params.yaml`` with the best trial's settings, ready to copy into it) and ``summary.json``.
The tuning report ``reports/tune/<task>.md`` has the trials table, the best settings, the
validation score against each searched key (early-stopped trials marked) and the learning
curves. MLflow: a parent run named ``tune <task>`` in the experiment ``<experiment>-tune``,
one child run per trial (named after its settings; params are the searched keys), the best
trial tagged ``apg.best``. The driver logs to MLflow (trials start at the search's
pace, and one writer keeps a SQLite store safe).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from apg.baselines import get_method
from apg.checkpoint import load_checkpoint, save_checkpoint
from apg.data import atomic_write, load_dataset
from apg.tasks import get_task
from apg.training import TrainConfig, Trainer, build, evaluate
from pipeline import provenance, stages, tracking
from pipeline.common import project_root, seed_everything, training_rows
from pipeline.config import ParamsError, apply_setting, load_params, read_yaml, setting_of
from pipeline.driver import Callback, drive

DISTRIBUTIONS = ("uniform", "loguniform", "choice", "randint")
SECTIONS = ("train", "network", "model")
METRICS = {"log_joint": "max", "ess": "max", "mse": "min"}  # and ess_<block> (max): one kernel's ESS
ALGORITHMS = ("optuna", "random")
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
}
STATE = "trial.pt"
ATTEMPTS = "attempts"  # results/tune/<task>/attempts/<trial id>.jsonl
STARTS = "starts.jsonl"  # results/tune/<task>/starts.jsonl: the code of each run of the search
TAG_TRIAL = "apg.trial_id"
TAG_BEST = "apg.best"


# --------------------------------------------------------------------------- the section


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
        if kind == "choice":
            if not isinstance(args, list) or not args:
                raise _bad(f"{where}.{key}", "choice needs a non-empty list of values")
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
    if kind == "choice":
        return value in args
    return _is_number(value) and args[0] <= value <= args[1] and (kind != "randint" or isinstance(value, int))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def extremes(space: dict[str, tuple[str, Any]]) -> list[dict[str, Any]]:
    """Settings that touch every bound of every key (each key's low, then each key's high /
    each choice, the others at their first value): what ``check_section`` builds."""

    def values(kind: str, args: Any) -> list[Any]:
        if kind == "choice":
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
    search = dict(section.get("search", {}))
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
    scheduler = section.get("scheduler", {"asha": {}})
    if not (
        isinstance(scheduler, dict) and len(scheduler) == 1 and next(iter(scheduler)) in ("asha", "fifo")
    ):
        raise _bad(
            f"{task}.scheduler",
            f"{{asha: {{grace_period, reduction_factor}}}} or {{fifo: {{}}}}, got {scheduler!r}",
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
    if metric.startswith("ess_"):
        blocks = [f"ess_{b}" for b in get_task(task).build_model(**task_params.get("model", {})).blocks]
        if metric not in blocks:
            raise _bad(f"{task}.metric", f"a block's ESS is one of {blocks}, got {metric!r}")
        if not get_method(method).kernels or pair[0] < 2:  # block updates run from sweep 2 on
            raise _bad(
                f"{task}.metric", f"{metric} needs block updates: method {method} at K={pair[0]} has none"
            )
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
        "algorithm": algorithm,
        "num_samples": num_samples,
        "seed": search.get("seed", 0),
        "max_concurrent": max_concurrent,
        "asha": asha,
        "time_budget_s": budget,
        "validation": validation,
        "pair": pair,
    }


def _held_out(task_params: dict[str, Any]) -> list[dict[str, Any]]:
    data = task_params["data"]
    return [*([data["test"]] if "test" in data else []), *data.get("tests", []), *data.get("figures", [])]


def tune_space(space: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    """Tune's own search-space objects (``randint`` upper bounds are inclusive here)."""
    from ray import tune

    make = {
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
        "choice": lambda a: tune.choice(a),
        "randint": lambda a: tune.randint(a[0], a[1] + 1),
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


# --------------------------------------------------------------------------- a trial


def validation_score(cfg: TrainConfig, trainer: Trainer, x_val: torch.Tensor, metric: str) -> float:
    """Mean over the validation datasets of ``metric`` after the last sweep."""
    with (
        torch.random.fork_rng()
    ):  # the same particles for every trial and checkpoint; training's stream untouched
        torch.manual_seed(0)
        curves = evaluate(
            cfg, trainer.model, trainer.proposals, x_val, cfg.sweeps, cfg.particles, cfg.batch_size
        )
    if metric not in curves:
        raise ValueError(f"task {cfg.task} has no validation metric {metric!r}")
    return float(np.mean(curves[metric][-1]))


def run_trial(config: dict[str, Any], plan: dict[str, Any], paths: dict[str, str]) -> None:
    """What Tune runs: train one setting, scoring it on the validation set every
    ``eval_every`` iterations (a report and a checkpoint each: ASHA may stop it there, and a
    resumed search continues from there)."""
    from ray import tune

    torch.set_num_threads(1)
    setting = {key: config[key] for key in plan["space"]}
    cfg = TrainConfig.from_dict(apply_setting(plan["base"], setting)).validate()
    seed_everything(plan["seed"])
    x = training_rows(paths["train"])
    x_val = torch.from_numpy(load_dataset(paths["validation"])["x"]).to(torch.get_default_dtype())
    trainer = Trainer(cfg, x)
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            trainer.load_state_dict(load_checkpoint(Path(d) / STATE)[1])
    # Our own log of attempts, outside Tune's trial folders (Tune re-creates those from the
    # last synced copy when a search resumes, so lines appended there can be lost).
    trial_id = tune.get_context().get_trial_id()
    with open(Path(paths["attempts"]) / f"{trial_id}.jsonl", "a") as f:
        f.write(json.dumps({"start_iteration": trainer.iteration, "time": time.time()}) + "\n")
    every = plan["eval_every"]
    drive(
        trainer, log_every=every, checkpoint_every=every, callbacks=[_Validation(cfg, x_val, plan["metric"])]
    )


class _Validation(Callback):
    """At each row (every ``eval_every`` iterations and the last): the validation score,
    reported to Tune with a checkpoint (ASHA may stop the trial there, and a resumed search
    continues from there)."""

    def __init__(self, cfg: TrainConfig, x_val: torch.Tensor, metric: str):
        self.cfg, self.x_val, self.metric = cfg, x_val, metric

    def on_row(self, trainer: Trainer, row: dict[str, float], history: list[dict], checkpoint: bool) -> None:
        from ray import tune

        score = validation_score(self.cfg, trainer, self.x_val, self.metric)
        with tempfile.TemporaryDirectory() as tmp:
            save_checkpoint(Path(tmp) / STATE, self.cfg.to_dict(), trainer.state_dict())
            tune.report(
                {"score": score, "iteration": trainer.iteration},
                checkpoint=tune.Checkpoint.from_directory(tmp),
            )


def read_attempts(out: Path, trial_id: str) -> list[dict[str, Any]]:
    """Where each run of a trial started (``start_iteration`` > 0: resumed from a checkpoint)."""
    path = out / ATTEMPTS / f"{trial_id}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


# --------------------------------------------------------------------------- MLflow


def _trial_name(setting: dict[str, Any]) -> str:
    return ", ".join(f"{k.split('.', 1)[1]}={_short(v)}" for k, v in setting.items())


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def mlflow_callback(uri: str, exp_id: str, parent_id: str, plan: dict[str, Any]):
    """A child run per trial, written from the driver: created when the trial starts (or
    found again after a resume), its validation scores as metrics, ended with the trial.
    Tune pickles it with the search's state, so the client is made on first use."""
    from ray.tune import Callback

    class _MLflow(Callback):
        def __init__(self) -> None:
            self.runs: dict[str, str] = {}
            self._client = None

        def __getstate__(self) -> dict[str, Any]:
            return {**self.__dict__, "_client": None}

        @property
        def client(self):
            if self._client is None:
                self._client = tracking.client(uri)
            return self._client

        def run_id(self, trial) -> str:
            client = self.client
            if trial.trial_id not in self.runs:
                found = tracking.find_run(
                    client, exp_id, {tracking.TAG_PARENT: parent_id, TAG_TRIAL: trial.trial_id}
                )
                if found is not None:
                    self.runs[trial.trial_id] = found.info.run_id
                else:
                    setting = {k: trial.config[k] for k in plan["space"]}
                    run = client.create_run(
                        exp_id,
                        run_name=_trial_name(setting),
                        tags={tracking.TAG_PARENT: parent_id, TAG_TRIAL: trial.trial_id},
                    )
                    tracking.log_params(client, run.info.run_id, setting)
                    self.runs[trial.trial_id] = run.info.run_id
            return self.runs[trial.trial_id]

        def on_trial_start(self, iteration, trials, trial, **info):
            self.run_id(trial)

        def on_trial_result(self, iteration, trials, trial, result, **info):
            step = int(result["iteration"])
            tracking.log_metrics(
                self.client, self.run_id(trial), [(step, {f"val_{plan['metric']}": result["score"]})]
            )

        def on_trial_complete(self, iteration, trials, trial, **info):
            tracking.finish(self.client, self.run_id(trial))

        def on_trial_error(self, iteration, trials, trial, **info):
            tracking.finish(self.client, self.run_id(trial), status="FAILED")

    return _MLflow()


# --------------------------------------------------------------------------- the search


def prepare_validation(params: dict[str, Any], plan: dict[str, Any], out: Path) -> Path:
    """The search's validation set, simulated from its own seed (like ``generate``)."""
    from pipeline.generate import save_reproducible, simulate_set

    section = params[plan["task"]]
    val = plan["validation"]
    arrays = simulate_set(
        plan["task"], section.get("model", {}), val["num_datasets"], val["seed"], val.get("sizes", {})
    )
    arrays["x"] = arrays["x"].astype(np.dtype(section["data"].get("x_dtype", "float32")))
    return save_reproducible(out / "validation.npz", arrays)


def searcher(plan: dict[str, Any]):
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

    first = [plan["reference"]] if plan.get("reference") else None  # params.yaml's settings
    if plan["algorithm"] == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search = OptunaSearch(seed=plan["seed"], points_to_evaluate=first)
        return ConcurrencyLimiter(search, max_concurrent=plan.get("max_concurrent", 2))
    return BasicVariantGenerator(random_state=plan["seed"], points_to_evaluate=first)


def note_start(out: Path, fresh: bool) -> None:
    """Append the code this run of the search imports (commit, uncommitted files) to
    ``out/starts.jsonl``; a fresh search starts the file again."""
    code = stages.package_root()
    start = {
        "commit": provenance.git_commit(code),
        "uncommitted": provenance.uncommitted(code, list(stages.CODE_PREFIXES)),
        "started": provenance.utc_now(),
    }
    earlier = "" if fresh or not (out / STARTS).is_file() else (out / STARTS).read_text()
    atomic_write(out / STARTS, lambda tmp: tmp.write_text(earlier + json.dumps(start) + "\n"))


def run_search(params: dict[str, Any], plan: dict[str, Any], root: Path, out: Path) -> dict[str, Any]:
    """Run (or resume) the search; return its summary after writing the outputs."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from pipeline.sweep import start_ray

    # One snapshot per validation checkpoint is what resuming needs; Tune's warning about it is noise.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    train = (root / "data" / plan["task"] / "train.npz").resolve()
    if not train.is_file():  # before anything is written
        raise FileNotFoundError(f"{train}: run `dvc repro generate@{plan['task']}` first")
    out.mkdir(parents=True, exist_ok=True)
    (out / ATTEMPTS).mkdir(exist_ok=True)
    paths = {
        "train": str(train),
        "validation": str(prepare_validation(params, plan, out).resolve()),
        "attempts": str((out / ATTEMPTS).resolve()),
    }
    name = plan_key(plan)
    storage = (out / "ray").resolve()
    uri = tracking.tracking_uri(root)
    tracking.check_reachable(uri)
    client = tracking.client(uri)
    exp_name = params.get("tracking", {}).get("experiment", "apg") + "-tune"
    exp_id = tracking.experiment_id(client, exp_name, tracking.artifact_location(root))
    key = f"{plan['task']}-{name}"
    resuming = tune.Tuner.can_restore(str(storage / name))
    earlier = tracking.find_run(client, exp_id, {tracking.TAG_SWEEP: key})
    if resuming and earlier is None:
        # Tune's saved state holds the parent's id (the MLflow callback): a new parent would
        # be left without its trials.
        raise FileNotFoundError(
            f"tune {plan['task']}: the MLflow parent run of {storage / name} is gone from {uri}; "
            f"delete {storage} to search again from scratch"
        )
    if not resuming and earlier is not None:
        # The same search run again from scratch (its Ray storage deleted): its trials are new,
        # so they get a parent of their own; the earlier one keeps its trials, marked superseded.
        client.set_tag(earlier.info.run_id, tracking.TAG_SWEEP, f"{key}@superseded-{earlier.info.run_id[:8]}")
        if earlier.info.status == "RUNNING":
            client.set_terminated(earlier.info.run_id, "KILLED")
    note_start(out, fresh=not resuming)
    parent_id = tracking.open_parent(
        client,
        exp_id,
        key,
        f"tune {plan['task']}",
        {
            "metric": plan["metric"],
            "method": plan["base"]["method"],
            "K": plan["pair"][0],
            "L": plan["pair"][1],
            "space": json.dumps({k: {kind: args} for k, (kind, args) in plan["space"].items()}),
        },
        tracking.source_tags(root, "pipeline.tune", computed(plan)),
    )
    start_ray(params)
    try:
        # Each trial takes what a sweep's trial takes (params.yaml's sweep section).
        sweep = params.get("sweep", {})
        resources = {"cpu": sweep.get("cpus_per_trial", 1), "gpu": sweep.get("gpus_per_trial", 0)}
        trainable = tune.with_resources(tune.with_parameters(run_trial, plan=plan, paths=paths), resources)
        callbacks = [mlflow_callback(uri, exp_id, parent_id, plan)]
        if resuming:
            print(f"tune {plan['task']}: resuming {storage / name}")
            tuner = tune.Tuner.restore(
                str(storage / name), trainable, resume_unfinished=True, resume_errored=True
            )
        else:
            scheduler = (
                ASHAScheduler(time_attr="iteration", max_t=plan["iterations"], **plan["asha"])
                if plan["asha"] is not None
                else FIFOScheduler()
            )
            tuner = tune.Tuner(
                trainable,
                param_space=tune_space(plan["space"]),
                tune_config=tune.TuneConfig(
                    metric="score",
                    mode=plan["mode"],
                    search_alg=searcher(plan),
                    scheduler=scheduler,
                    num_samples=plan["num_samples"],
                    time_budget_s=plan["time_budget_s"],
                ),
                run_config=tune.RunConfig(
                    name=name,
                    storage_path=str(storage),
                    checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                    callbacks=callbacks,
                    verbose=1,
                ),
            )
        results = tuner.fit()  # a restored search keeps the callbacks it was made with
    finally:
        ray.shutdown()
    # After Ctrl+C Tune saves its state and returns early; the saved state says which
    # trials had not ended (the returned grid may count them as ended).
    statuses = [t.status for t in tune.ExperimentAnalysis(str(storage / name)).trials]
    ended = sum(status in ("TERMINATED", "ERROR") for status in statuses)
    if ended < len(statuses):
        tracking.finish(client, parent_id, "KILLED")  # not left RUNNING; a resumed search reopens it
        print(
            f"tune {plan['task']}: interrupted with {ended} of {len(statuses)} trials ended; "
            "run the same command again to resume",
            file=sys.stderr,
        )
        raise KeyboardInterrupt
    summary = write_outputs(params, plan, results, out, client, parent_id, exp_id)
    print(tracking.browse_hint(uri, exp_id))
    return summary


def trials_frame(plan: dict[str, Any], results, out: Path):
    """One row per trial: settings, last and best score, iterations trained, early stop."""
    import pandas as pd

    rows = []
    sign = 1 if plan["mode"] == "max" else -1
    for result in results:
        trial_id = result.metrics["trial_id"]
        history = result.metrics_dataframe
        scores = history["score"].tolist() if history is not None and "score" in history else []
        iterations = int(history["iteration"].max()) if scores else 0
        best = max(scores, key=lambda s: sign * s) if scores else float("nan")
        setting = {key: result.config[key] for key in plan["space"]}
        rows.append(
            {
                "trial": trial_id,
                **setting,
                "defaults": setting == plan.get("reference"),  # params.yaml's own settings
                "score": scores[-1] if scores else float("nan"),
                "best_score": best,
                "iterations": iterations,
                "stopped_early": result.error is None and 0 < iterations < plan["iterations"],
                "failed": result.error is not None,
                "attempts": len(read_attempts(out, trial_id)),
                "history": json.dumps(
                    [[int(i), float(s)] for i, s in zip(history["iteration"], history["score"], strict=True)]
                )
                if scores
                else "[]",
            }
        )
    return asha_order(pd.DataFrame(rows), plan["mode"])


def asha_order(frame, mode: str):
    """Trials that trained longest first (those ASHA let go on), then by score.

    An early-stopped trial's score is from fewer iterations, and scores need not rise with
    training (the rings' validation log joint swings by ~100 nats between checkpoints), so the
    best trial is the best of the longest-trained, not the highest last score. ASHA stopped
    the others by their score at a rung they shared with trials that had got there first
    (the first to reach a rung always goes on: it has nobody to trail).
    """
    return frame.sort_values(
        ["iterations", "score"], ascending=[False, mode == "min"], na_position="last"
    ).reset_index(drop=True)


def best_params(params: dict[str, Any], plan: dict[str, Any], setting: dict[str, Any], score: float) -> str:
    """``params.yaml``'s sections of the task with ``setting`` applied, as YAML text."""
    task = plan["task"]
    section = {key: json.loads(json.dumps(params[task].get(key, {}))) for key in SECTIONS}
    for key, value in setting.items():
        part, _, name = key.partition(".")
        section[part][name] = value
    # What the trials ran: a schedule's length belongs with the rate it was searched with.
    section.setdefault("train", {})["iterations"] = plan["iterations"]
    head = (
        f"# Best of a search by `{plan.get('command', f'apg-pipeline tune --task {task}')}` "
        f"({plan.get('source', 'tune.yaml')}): validation "
        f"{plan['metric']} {score:.6g} at K={plan['pair'][0]}, L={plan['pair'][1]}, method "
        f"{plan['base']['method']}, {plan['iterations']} iterations.\n# Searched: {', '.join(plan['space'])}. "
        f"Copy these sections into params.yaml's {task}: to make them the sweep's starting point.\n"
    )
    return head + yaml.safe_dump({task: section}, sort_keys=False)


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def write_outputs(params, plan, results, out: Path, client, parent_id: str, exp_id: str):
    frame = trials_frame(plan, results, out)
    atomic_write(out / "trials.csv", lambda tmp: frame.to_csv(tmp, index=False))
    finished = frame[~frame["failed"] & frame["score"].notna()]
    if finished.empty:
        raise RuntimeError(f"tune {plan['task']}: no trial finished a validation score")
    best = finished.iloc[0]
    setting = {key: _plain(best[key]) for key in plan["space"]}
    text = best_params(params, plan, setting, float(best["score"]))
    atomic_write(out / "best-params.yaml", lambda tmp: tmp.write_text(text))
    best_run = tracking.find_run(
        client, exp_id, {tracking.TAG_PARENT: parent_id, TAG_TRIAL: str(best["trial"])}
    )
    if best_run is not None:
        client.set_tag(best_run.info.run_id, TAG_BEST, "true")
    tracking.log_params(client, parent_id, {f"best.{k}": v for k, v in setting.items()})
    client.log_metric(parent_id, f"best_val_{plan['metric']}", float(best["score"]))
    tracking.finish(client, parent_id)
    defaults = frame[frame["defaults"]]
    summary = {
        "task": plan["task"],
        "metric": plan["metric"],
        "mode": plan["mode"],
        "best": {
            "trial": str(best["trial"]),
            "setting": setting,
            "score": float(best["score"]),
            "iterations": int(best["iterations"]),
        },
        "defaults": None
        if defaults.empty
        else {
            "trial": str(defaults.iloc[0]["trial"]),
            "setting": plan["reference"],
            "score": float(defaults.iloc[0]["score"]),
            "iterations": int(defaults.iloc[0]["iterations"]),
            "failed": bool(defaults.iloc[0]["failed"]),
        },
        "trials": len(frame),
        "max_iterations": plan["iterations"],
        "stopped_early": int(frame["stopped_early"].sum()),
        "failed": int(frame["failed"].sum()),
        "mlflow_parent_run": parent_id,
        # The code each run of the search imported (note_start): its report names it.
        "starts": [json.loads(line) for line in (out / STARTS).read_text().splitlines()]
        if (out / STARTS).is_file()
        else [],
        "finished": provenance.utc_now(),
    }
    atomic_write(out / "summary.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=2) + "\n"))
    return summary


# --------------------------------------------------------------------------- the report


def _score_text(value: float) -> str:
    """A log joint to 0.01 (settings differ by about a nat); an ESS or MSE to 4 digits."""
    return f"{value:.2f}" if abs(value) >= 10 else f"{value:.4g}"


def made_at_line(summary: dict[str, Any]) -> str:
    """The code that ran the search: the commit of each start (a resumed search has several)."""
    starts = summary.get("starts") or []
    if not starts:  # summaries written before searches recorded their code
        return "Made by code whose commit was not recorded."

    def code(start: dict[str, Any]) -> str:
        dirty = start.get("uncommitted") or []
        return (
            f"commit `{start['commit']}`"
            + (f" with uncommitted changes to {', '.join(f'`{f}`' for f in dirty)}" if dirty else "")
            + f" (started {start['started']})"
        )

    resumed = "".join(f"; resumed at {code(s)}" for s in starts[1:])
    return f"Run at {code(starts[0])}{resumed}; finished {summary['finished']}."


def defaults_line(summary: dict[str, Any]) -> str:
    """How the best trial compares with params.yaml's own settings (the first trial)."""
    ref = summary.get("defaults")
    if ref is None:
        return "params.yaml's own settings lie outside the searched space: no trial ran them."
    if ref["trial"] == summary["best"]["trial"]:
        return f"**params.yaml's own settings** ({_trial_name(ref['setting'])}, trial `{ref['trial']}`) ranked best."
    if ref.get("failed"):
        how = " (failed)"
    elif ref["iterations"] < summary.get("max_iterations", ref["iterations"]):
        how = " (stopped early)"
    else:
        how = ""
    best = summary["best"]
    best_at = best.get("iterations", summary.get("max_iterations"))
    return (
        f"**params.yaml's own settings** ({_trial_name(ref['setting'])}, trial `{ref['trial']}`, the "
        f"search's first): {ref['score']:.6g} after {ref['iterations']} iterations{how}; the best's "
        f"score (after {best_at}) differs from it by {best['score'] - ref['score']:+.4g}."
    )


def report_path(report: str | Path, name: str) -> Path:
    """Where the tuning report goes: ``report`` itself when it names a ``.md`` file, else
    ``<report>/<name>.md`` (its figure beside it, ``<stem>.png``)."""
    report = Path(report)
    return report if report.suffix == ".md" else report / f"{name}.md"


def write_report(plan: dict[str, Any], out: Path, path: Path) -> Path:
    """The tuning report at ``path`` (``report_path``): trials table, best settings, score
    against each searched key (early-stopped trials as crosses), learning curves."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    task = plan["task"]
    frame = pd.read_csv(out / "trials.csv")
    summary = json.loads((out / "summary.json").read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    command = plan.get("command", f"apg-pipeline tune --task {task}")
    source = plan.get("source", "tune.yaml")
    best_file = plan.get("best_file", f"results/tune/{task}/best-params.yaml")
    keys = list(plan["space"])
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(4.2 * (len(keys) + 1), 3.4), squeeze=False)
    for ax, key in zip(axes[0][:-1], keys, strict=True):
        kind, args = plan["space"][key]
        # A choice is a category: its values at evenly spaced positions, labelled as given.
        where = {v: i for i, v in enumerate(args)} if kind == "choice" else None

        def x_of(values, where=where):
            return [where[v] for v in values] if where is not None else values

        for early, marker, label in ((False, "o", "ran to the end"), (True, "x", "stopped early (ASHA)")):
            part = frame[frame["stopped_early"] == early]
            ax.scatter(x_of(part[key]), part["score"], marker=marker, label=label)
        mine = frame[frame["defaults"]]
        ax.scatter(
            x_of(mine[key]),
            mine["score"],
            s=160,
            facecolors="none",
            edgecolors="k",
            label="params.yaml's settings",
        )
        if where is not None:
            ax.set_xticks(range(len(args)), [str(v) for v in args])
            ax.set_xlim(-0.5, len(args) - 0.5)
        elif kind == "loguniform":
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # unreadable when crowded
        ax.set_xlabel(key)
        ax.set_ylabel(f"validation {plan['metric']}")
    axes[0][0].legend(fontsize=8)
    curves = axes[0][-1]
    for row in frame.itertuples(index=False):
        points = np.array(json.loads(row.history)).reshape(-1, 2)
        curves.plot(points[:, 0], points[:, 1], marker="x" if row.stopped_early else ".", lw=1)
    curves.set_xlabel("iteration")
    curves.set_ylabel(f"validation {plan['metric']}")
    curves.set_title("every trial")
    fig.suptitle(
        f"{task}: search over {', '.join(keys)} ({plan['base']['method']}, K={plan['pair'][0]}, L={plan['pair'][1]})"
    )
    fig.tight_layout()
    figure = path.with_suffix(".png")
    fig.savefig(figure, dpi=110)
    plt.close(fig)
    shown = frame.drop(columns=["history"])
    table = ["| " + " | ".join(shown.columns) + " |", "|" + " --- |" * len(shown.columns)]
    scores = {"score", "best_score"}
    for row in shown.itertuples(index=False):
        cells = [
            _score_text(v) if c in scores else _short(_plain(v))
            for c, v in zip(shown.columns, row, strict=True)
        ]
        table.append("| " + " | ".join(cells) + " |")
    best = summary["best"]
    text = "\n".join(
        [
            f"# Hyperparameter search: {task}"
            + (f", {plan['base']['method']}" if plan.get("method_flag") else ""),
            "",
            f"`{command}` with `{source}`'s `{task}:` section: method "
            f"{plan['base']['method']} at K={plan['pair'][0]}, L={plan['pair'][1]}, up to "
            f"{plan['iterations']} iterations per trial, {plan['algorithm']} search over "
            f"{plan['num_samples']} trials, "
            + (
                f"ASHA (grace period {plan['asha'].get('grace_period', 1)}, reduction factor "
                f"{plan['asha'].get('reduction_factor', 2)})"
                if plan["asha"] is not None
                else "no early stopping"
            )
            + f". Score: validation {plan['metric']} after the last sweep, mean over "
            f"{plan['validation']['num_datasets']} datasets simulated for the search (seed "
            f"{plan['validation']['seed']}; not a test set), every {plan['eval_every']} iterations.",
            "",
            made_at_line(summary),
            "",
            f"**Best** (the highest score among the longest-trained of the trials that finished with a "
            f"score, {best.get('iterations', plan['iterations'])} iterations): trial `{best['trial']}`, {_trial_name(best['setting'])}: {best['score']:.6g}. "
            f"`{best_file}` has the task's sections with these settings.",
            "",
            defaults_line(summary),
            "",
            f"{summary['trials']} trials, {summary['stopped_early']} stopped early by ASHA, "
            f"{summary['failed']} failed; `attempts` > 1: the trial was resumed after an interruption.",
            "",
            *table,
            "",
            f"![{task} search]({figure.name})",
            "",
            "Left: validation score of each trial against each searched key (dots: ran to the end; "
            "crosses: stopped early). Right: every trial's validation score while it trained.",
            "",
        ]
    )
    atomic_write(path, lambda tmp: tmp.write_text(text))
    return path


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="apg-pipeline tune", description="hyperparameter search of one task (tune.yaml)"
    )
    parser.add_argument("--task", required=True)
    parser.add_argument("--tune-params", default="tune.yaml", help="the search's params (default tune.yaml)")
    parser.add_argument("--params", default="params.yaml", help="the task's other settings")
    parser.add_argument(
        "--method",
        default=None,
        help="search for this method instead of the section's (a baseline tuned "
        "with APG's budget); its outputs are named <task>-<method>",
    )
    parser.add_argument("--metric", default=None, help="score trials by this metric instead of the section's")
    parser.add_argument(
        "--out", default=None, help="default results/tune/<task> (<task>-<method> with --method)"
    )
    parser.add_argument(
        "--report",
        default="reports/tune",
        help="a folder for <name>.md and its figure, or the report's .md file",
    )
    args = parser.parse_args(argv)
    from pipeline.errors import run_guarded

    def work() -> None:
        root = project_root()
        params = load_params(args.params)
        section = load_section(args.tune_params, args.task)
        name = args.task
        command = f"apg-pipeline tune --task {args.task}"
        if args.method is not None and args.method != section.get("method", "apg"):
            section, name = {**section, "method": args.method}, f"{args.task}-{args.method}"
            command += f" --method {args.method}"
        if args.metric is not None:
            section = {**section, "metric": args.metric}
            command += f" --metric {args.metric}"
        if args.tune_params != "tune.yaml":
            command += f" --tune-params {args.tune_params}"
        plan = check_section(params, args.task, section)
        from pipeline.sweep import ray_address

        if not ray_address(params):
            # The embedded instance listens on loopback only; attached to a cluster (RAY_ADDRESS
            # or sweep.ray_address), token auth stays as the user set it.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        out = Path(args.out or root / "results" / "tune" / name)
        shown = (
            out.resolve().relative_to(root.resolve()) if out.resolve().is_relative_to(root.resolve()) else out
        )
        plan.update(
            command=command,
            source=str(args.tune_params),
            best_file=f"{shown}/best-params.yaml",
            method_flag=name != args.task,
        )
        summary = run_search(params, plan, root, out)
        path = write_report(plan, out, report_path(root / args.report, name))
        best = summary["best"]
        print(
            f"tune {args.task}: best {_trial_name(best['setting'])} ({plan['metric']} {best['score']:.6g}); "
            f"{summary['trials']} trials, {summary['stopped_early']} stopped early; wrote {out}/best-params.yaml, {path}"
        )

    run_guarded(work)


if __name__ == "__main__":
    main()
