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
one child run per trial (named after its settings; params are the searched keys; metrics its
rows with ``val_<metric>``), the best trial tagged ``apg.best``. The driver makes the parent
and ends each trial's run; a trial makes its run and logs to it as a sweep's trial does
(:mod:`pipeline.runs.trial`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apg.data import atomic_write, load_dataset
from apg.training import TrainConfig, Trainer, evaluate
from pipeline import tracking
from pipeline.common import project_root
from pipeline.config.params import apply_setting, load_params
from pipeline.provenance import record as provenance
from pipeline.provenance import stages
from pipeline.runs.loop import Callback, drive
from pipeline.runs.trial import MlflowRows, TuneReports, begin, shipped_data, trial_rows
from pipeline.search.plan import check_section, computed, load_section, plan_key, trial_count, tune_space
from pipeline.search.report import (
    ATTEMPTS,
    STARTS,
    TAG_TRIAL,
    report_path,
    score_key,
    trial_name,
    write_outputs,
    write_report,
)

# --------------------------------------------------------------------------- a trial


def run_trial(
    config: dict[str, Any], plan: dict[str, Any], setup: dict[str, Any], data: dict[str, Any] | None = None
) -> None:
    """What Tune runs: train one setting (a run-layer trial, :mod:`pipeline.runs.trial`), its
    rows every ``eval_every`` iterations with the validation score, each sent to the trial's
    MLflow run and reported to Tune with a checkpoint (ASHA may stop it there, and a resumed
    search continues from there)."""
    from ray import tune

    setting = {key: config[key] for key in plan["space"]}
    seed = config.get("seed", plan["seed"])  # a search with seeds trains each setting with each
    cfg = TrainConfig.from_dict(apply_setting(plan["base"], setting)).validate()
    x = trial_rows(setup["train"], data)
    x_val = torch.from_numpy(load_dataset(setup["validation"])["x"]).to(torch.get_default_dtype())
    # Our own log of attempts, outside Tune's trial folders (Tune re-creates those from the
    # last synced copy when a search resumes, so lines appended there can be lost).
    trial_id = tune.get_context().get_trial_id()
    attempts_file = Path(setup["attempts"]) / f"{trial_id}.jsonl"
    trainer, history, attempts = begin(cfg, x, seed, setup["torch_threads"], attempts_file)
    # The trial's child run, named after its setting (its params), found again when the trial
    # resumes; the driver ends it (``mlflow_callback``).
    client, ids = tracking.client(setup["tracking_uri"]), (setup["exp_id"], setup["parent_id"], trial_id)
    named = {**setting, **({"train.seed": seed} if "seeds" in plan else {})}
    run_id = tracking.retry(
        lambda: tracking.open_child(client, *ids, trial_name(named), named, {TAG_TRIAL: trial_id}),
        "opening the trial's run",
    )
    mlflow = MlflowRows(client, run_id, history, attempts)
    every = plan["eval_every"]
    drive(
        trainer,
        log_every=every,
        checkpoint_every=every,
        history=history,
        callbacks=[_Validation(x_val, plan["metric"]), mlflow, TuneReports()],
    )
    mlflow.logger.close()


class _Validation(Callback):
    """Each row's validation score (every ``eval_every`` iterations and the last): the mean
    over the validation datasets of the metric after the last sweep, what the search ranks
    trials by."""

    def __init__(self, x_val: torch.Tensor, metric: str):
        self.x_val, self.metric = x_val, metric

    def on_row(self, trainer: Trainer, row: dict[str, float], history: list[dict], checkpoint: bool) -> None:
        cfg = trainer.cfg
        # the same particles for every trial and checkpoint; training's stream untouched
        with torch.random.fork_rng():
            torch.manual_seed(0)
            curves = evaluate(
                cfg, trainer.model, trainer.proposals, self.x_val, cfg.sweeps, cfg.particles, cfg.batch_size
            )
        if self.metric not in curves:
            raise ValueError(f"task {cfg.task} has no validation metric {self.metric!r}")
        row[score_key(self.metric)] = float(np.mean(curves[self.metric][-1]))


# --------------------------------------------------------------------------- MLflow


def mlflow_callback(uri: str, exp_id: str, parent_id: str, plan: dict[str, Any]):
    """In the driver: ends each trial's child run (made by the trial) as Tune ends the trial,
    FAILED on an error; after PBT, with the settings the trial ended with as ``final.<key>``
    tags. Tune pickles it with the search's state, so the client is made on first use."""
    from ray.tune import Callback

    class _EndRuns(Callback):
        def __init__(self) -> None:
            self._client = None

        def __getstate__(self) -> dict[str, Any]:
            return {**self.__dict__, "_client": None}

        def end(self, trial, status: str) -> None:
            if self._client is None:
                self._client = tracking.client(uri)
            found = tracking.find_run(
                self._client, exp_id, {tracking.TAG_PARENT: parent_id, TAG_TRIAL: trial.trial_id}
            )
            if found is None:  # failed before it made its run
                return
            if status == "FINISHED" and plan.get("pbt") is not None:  # settings its params no longer hold
                for key in plan["space"]:
                    self._client.set_tag(found.info.run_id, f"final.{key}", str(trial.config[key]))
            tracking.finish(self._client, found.info.run_id, status)

        def on_trial_complete(self, iteration, trials, trial, **info):
            self.end(trial, "FINISHED")

        def on_trial_error(self, iteration, trials, trial, **info):
            self.end(trial, "FAILED")

    return _EndRuns()


# --------------------------------------------------------------------------- the search


def prepare_validation(params: dict[str, Any], plan: dict[str, Any], out: Path) -> Path:
    """The search's validation set, simulated from its own seed (like ``generate``)."""
    from apg.data import save_dataset
    from apg.tasks.simulation import simulate_set

    section = params[plan["task"]]
    val = plan["validation"]
    arrays = simulate_set(
        plan["task"], section.get("model", {}), val["num_datasets"], val["seed"], val.get("sizes", {})
    )
    arrays["x"] = arrays["x"].astype(np.dtype(section["data"].get("x_dtype", "float32")))
    return save_dataset(out / "validation.npz", arrays)


def searcher(plan: dict[str, Any]):
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

    # params.yaml's settings first, unless a grid lists the trials (it holds them if they are in it)
    grid = any(kind == "grid" for kind, _ in plan["space"].values())
    first = [plan["reference"]] if plan.get("reference") and not grid else None
    if plan["algorithm"] == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search = OptunaSearch(seed=plan["seed"], points_to_evaluate=first)
    elif plan["algorithm"] == "hyperopt":
        from ray.tune.search.hyperopt import HyperOptSearch

        search = HyperOptSearch(random_state_seed=plan["seed"], points_to_evaluate=first)
    else:
        return BasicVariantGenerator(random_state=plan["seed"], points_to_evaluate=first)
    return ConcurrencyLimiter(search, max_concurrent=plan.get("max_concurrent", 2))


def scheduler(plan: dict[str, Any]):
    """Tune's trial scheduler: ASHA stops trials early, PBT moves weights and settings
    between them, FIFO runs each to its end."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    if plan["asha"] is not None:
        return ASHAScheduler(time_attr="iteration", max_t=plan["iterations"], **plan["asha"])
    if plan.get("pbt") is not None:
        # PBT draws its perturbations from Python's global generator: seeded with the search.
        random.seed(plan["seed"])
        return PopulationBasedTraining(
            time_attr="iteration", hyperparam_mutations=tune_space(plan["space"]), **plan["pbt"]
        )
    return FIFOScheduler()


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


def _open_parent(
    params: dict[str, Any],
    plan: dict[str, Any],
    root: Path,
    out: Path,
    uri: str,
    experiment: Path,
    resuming: bool,
):
    """The search's MLflow parent run: reopened when the search resumes, new otherwise (an
    earlier parent of the same search, run again from scratch, is marked superseded).
    Returns the client, the experiment's id and the parent's run id."""
    tracking.check_reachable(uri)
    client = tracking.client(uri)
    exp_name = params.get("tracking", {}).get("experiment", "apg") + "-tune"
    exp_id = tracking.experiment_id(client, exp_name, tracking.artifact_location(root))
    key = f"{plan['task']}-{experiment.name}"
    earlier = tracking.find_run(client, exp_id, {tracking.TAG_SWEEP: key})
    if resuming and earlier is None:
        # Tune's saved state holds the parent's id (the MLflow callback): a new parent would
        # be left without its trials.
        raise FileNotFoundError(
            f"tune {plan['task']}: the MLflow parent run of {experiment} is gone from {uri}; "
            f"delete {experiment.parent} to search again from scratch"
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
        tracking.source_tags(root, "pipeline.search.stage", computed(plan)),
    )
    return client, exp_id, parent_id


def checkpoints_to_keep(plan: dict[str, Any]) -> int:
    """Checkpoints kept per trial. Resuming needs the last one only; PBT copies a donor from
    the checkpoint of its last perturbation, which must outlive the donor's next
    ``perturbation_interval`` of checkpoints (twice that, for a slow restore: with one kept,
    a copy failed on a donor checkpoint already deleted)."""
    if plan.get("pbt") is None:
        return 1
    return 2 * plan["pbt"]["perturbation_interval"] // plan["eval_every"] + 1


def _progress_callback(plan: dict[str, Any]):
    """One line a finished trial: how many of the search's are done and the best score yet."""
    from ray.tune import Callback

    better = max if plan["mode"] == "max" else min

    class _Progress(Callback):
        def __init__(self) -> None:
            self.done, self.best = 0, None

        def on_trial_complete(self, iteration, trials, trial, **info):
            self.done += 1
            score = (trial.last_result or {}).get(score_key(plan["metric"]))
            if score is not None:
                self.best = score if self.best is None else better(self.best, score)
            best = f", best {plan['metric']} {self.best:.4g}" if self.best is not None else ""
            print(f"tune {plan['task']}: {self.done}/{trial_count(plan)} trials done{best}", flush=True)

    return _Progress()


def _new_tuner(
    plan: dict[str, Any], trainable, storage: Path, name: str, callbacks: list, verbose: bool = False
):
    """A new search: Tune's space, searcher and scheduler from the plan."""
    from ray import tune

    return tune.Tuner(
        trainable,
        param_space={
            **tune_space(plan["space"]),
            **({"seed": tune.grid_search(plan["seeds"])} if "seeds" in plan else {}),
        },
        tune_config=tune.TuneConfig(
            metric=score_key(plan["metric"]),
            mode=plan["mode"],
            search_alg=searcher(plan),
            scheduler=scheduler(plan),
            num_samples=plan["num_samples"],
            time_budget_s=plan["time_budget_s"],
        ),
        run_config=tune.RunConfig(
            name=name,
            storage_path=str(storage),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=checkpoints_to_keep(plan)),
            # A trial's last result stops it before the scheduler sees it: PBT would otherwise
            # clone a donor into a trial that has finished, which then ends on the donor's result.
            stop={"iteration": plan["iterations"]},
            callbacks=callbacks,
            # Quiet: a line a finished trial (_progress_callback); --verbose: Tune's own tables.
            verbose=1 if verbose else 0,
        ),
    )


def run_search(
    params: dict[str, Any], plan: dict[str, Any], root: Path, out: Path, verbose: bool = False
) -> dict[str, Any]:
    """Run (or resume) the search; return its summary after writing the outputs. Quiet but
    for a line a finished trial, unless ``verbose`` (Tune's own status tables)."""
    import ray
    from ray import tune

    from pipeline.sweep.ray_setup import quiet_tune_output, start_ray

    # One snapshot per validation checkpoint is what resuming needs; Tune's warning about it is noise.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    train = (root / "data" / plan["task"] / "train.npz").resolve()
    if not train.is_file():  # before anything is written
        raise FileNotFoundError(f"{train}: run `dvc repro generate@{plan['task']}` first")
    out.mkdir(parents=True, exist_ok=True)
    (out / ATTEMPTS).mkdir(exist_ok=True)
    name = plan_key(plan)
    storage = (out / "ray").resolve()
    uri = tracking.tracking_uri(root)
    resuming = tune.Tuner.can_restore(str(storage / name))
    client, exp_id, parent_id = _open_parent(params, plan, root, out, uri, storage / name, resuming)
    # Each trial takes what a sweep's trial takes (params.yaml's sweep section).
    sweep = params.get("sweep", {})
    setup = {
        "train": str(train),
        "validation": str(prepare_validation(params, plan, out).resolve()),
        "attempts": str((out / ATTEMPTS).resolve()),
        "tracking_uri": uri,
        "exp_id": exp_id,
        "parent_id": parent_id,
        "torch_threads": sweep.get("torch_threads", 1),
    }
    start_ray(params)
    try:
        resources = {"cpu": sweep.get("cpus_per_trial", 1), "gpu": sweep.get("gpus_per_trial", 0)}
        trainable = tune.with_resources(
            tune.with_parameters(run_trial, plan=plan, setup=setup, data=shipped_data(train)), resources
        )
        callbacks = [mlflow_callback(uri, exp_id, parent_id, plan)]
        if not verbose:
            callbacks.append(_progress_callback(plan))
            quiet_tune_output()
        if resuming:
            print(f"tune {plan['task']}: resuming {storage / name}")
            tuner = tune.Tuner.restore(
                str(storage / name), trainable, resume_unfinished=True, resume_errored=True
            )
        else:
            tuner = _new_tuner(plan, trainable, storage, name, callbacks, verbose)
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
    parser.add_argument("--verbose", action="store_true", help="Tune's own status tables and trial lines")
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
        summary = run_search(params, plan, root, out, args.verbose)
        path = write_report(plan, out, report_path(root / args.report, name))
        best = summary["best"]
        print(
            f"tune {args.task}: best {trial_name(best['setting'])} ({plan['metric']} {best['score']:.6g}); "
            f"{summary['trials']} trials, {summary['stopped_early']} stopped early; wrote {out}/best-params.yaml, {path}"
        )

    run_guarded(work)


if __name__ == "__main__":
    main()
