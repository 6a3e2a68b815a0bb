"""``apg-pipeline``: one command line for the library and the pipeline stages.

Subcommands::

    apg-pipeline generate --task gmm --out data/gmm/train.npz --num-datasets 1000 --seed 1 [--size num_points=60]
    apg-pipeline train    --task gmm --method apg --sweeps 5 --particles 10 --batch-size 20 \\
                          --iterations 300 --lr 3e-3 --seed 0 --data train.npz --out ckpt.pt
    apg-pipeline evaluate --checkpoint ckpt.pt --data test.npz --sweeps 10 --particles 10 --out metrics.json
    apg-pipeline impute   --checkpoint ckpt.pt --data obs.npz --mask mask.npz --out imputed.npz \\
                          [--iterations 20 --sweeps 5 --particles 10 --fill sample|mean --network num_digits=2]
    apg-pipeline config   --profile paper [--check] [--out params.yaml]   # a profile's params (profiles/)
    apg-pipeline sweep    --task gmm          # the DVC stages, with params.yaml
    apg-pipeline eval-sweep --task gmm
    apg-pipeline report
    apg-pipeline runs-url [--ui http://host:5000]   # the MLflow UI's runs table of the sweeps

``evaluate`` writes JSON with these keys (means over the held-out datasets):

- ``task``, ``method``, ``sweeps`` (K), ``particles`` (L), ``num_datasets`` (M), ``config``
  (the checkpoint's training config);
- per-sweep lists of length K: ``log_joint``, ``ess`` (ESS/L, eq. 11), ``log_evidence``,
  ``ess_<block>`` for every block (methods with block kernels), ``mse`` (tasks that
  reconstruct), ``model_evals`` (cumulative likelihood evaluations per dataset, methods
  that count them);
- final numbers: ``kl_<block>`` (inclusive KL to the exact conditional, eq. 4; tasks with
  exact Gibbs conditionals, methods with kernels and K > 1).
- ``log_evidence_is``: importance-sampled ``log p(x)`` from the method's encoder with
  K*L samples (Rezende et al. 2014, appendix E), for every method; ``accept``: HMC-RWS's
  Metropolis acceptance rate.

Bad input (shapes, non-finite data, K < 1, L < 2, unknown task or method, missing or
corrupt files, an invalid params file, values out of range, a device this machine lacks, a
set its memory or disk cannot hold: ``pipeline.config.checks``) ends with one line
``apg-pipeline: error: ...`` and exit status 2, before any training; outputs are written
atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from pipeline.config import checks
from pipeline.config.schema import TRAIN_KEYS

# torch, the library and the stages load inside the commands that use them: `--help` and a
# refused flag answer at once.
if TYPE_CHECKING:
    import numpy as np

    from apg.training import TrainConfig, Trainer


def _key_values(items: list[str], flag: str) -> dict[str, Any]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}`` (values parsed as YAML scalars)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ValueError(f"{flag} {item!r}: the value is not a YAML scalar") from None
    return out


# --------------------------------------------------------------------------- generate


def cmd_generate(args: argparse.Namespace) -> None:
    from apg.data import save_dataset
    from apg.tasks.simulation import simulate_set

    checks.integer(args.num_datasets, "--num-datasets", low=1)
    checks.seed(args.seed, "--seed")
    sizes = _key_values(args.size, "--size")
    if args.num_points is not None:
        sizes["num_points"] = args.num_points
    checks.size_values(args.task, sizes, "--size")
    model = _key_values(args.model, "--model")
    # Held in memory whole, then written: refuse what this machine cannot hold, before any of it.
    need = checks.dataset_bytes(args.task, model, sizes)["simulated"] * args.num_datasets
    what = f"{args.num_datasets} datasets of task {args.task} at {f'sizes {sizes}' if sizes else 'its default sizes'}"
    checks.room(what, memory=need, disk=need, folder=Path(args.out).parent)
    arrays = simulate_set(args.task, model, args.num_datasets, args.seed, sizes)
    path = save_dataset(args.out, arrays)
    print(f"wrote {path}: " + ", ".join(f"{k} {v.shape}" for k, v in arrays.items()))


# --------------------------------------------------------------------------- preview


def cmd_preview(args: argparse.Namespace) -> None:
    from pipeline.common import project_root
    from pipeline.provenance.preview import preview

    print(preview(project_root()))


def _add_preview(sub) -> None:
    preview = sub.add_parser(
        "preview", help="what `dvc repro` would run now, and about how long it would take"
    )
    preview.set_defaults(func=cmd_preview)


# --------------------------------------------------------------------------- MLflow


def cmd_runs_url(args: argparse.Namespace) -> None:
    from pipeline import tracking
    from pipeline.common import project_root
    from pipeline.config.params import load_params

    params = load_params(args.params)
    root = project_root()
    uri = tracking.tracking_uri(root)
    name = args.experiment or tracking.experiment_name(params)
    print(tracking.runs_address(uri, name, args.ui))
    if not uri.startswith(("http://", "https://")) and args.ui is None:
        print(f"(serve it with: mlflow ui --backend-store-uri {uri})", file=sys.stderr)


def _add_runs_url(sub) -> None:
    """``runs-url``: the address of the runs table, headline columns shown."""
    url = sub.add_parser(
        "runs-url",
        help="print the MLflow UI's address of the experiment's runs table, with the sweep's "
        "headline params and metrics as columns",
    )
    url.add_argument("--params", default="params.yaml")
    url.add_argument(
        "--experiment",
        default=None,
        help="default: tracking.experiment of the params (a search: <that>-tune)",
    )
    url.add_argument(
        "--ui",
        default=None,
        help="where the MLflow UI is served (default: the tracking server, or mlflow ui's "
        "http://127.0.0.1:5000 for the project's mlflow.db)",
    )
    url.set_defaults(func=cmd_runs_url)


# --------------------------------------------------------------------------- smoke


def cmd_smoke(args: argparse.Namespace) -> None:
    from pipeline.config.profiles import load, params_file
    from pipeline.smoke import run_smoke, timing_table

    with params_file(load(args.params)) as path:
        times, total = run_smoke(path, Path(args.dir))
    print(f"\nsmoke run of {args.params}: dvc repro from scratch in {total / 60:.1f} min\n")
    print(timing_table(times, total))


def cmd_config(args: argparse.Namespace) -> None:
    from pipeline.config.profiles import dump, extends, resolve

    params = resolve(args.profile, args.check)
    variant = f"profiles/check/{args.profile}.yaml over " if args.check else ""
    text = dump(
        params,
        f"apg-pipeline config --profile {args.profile}{' --check' if args.check else ''}: "
        f"{variant}profiles/{args.profile}.yaml over {extends(args.profile)}, resolved.\n"
        "Generated: edit the overlays in profiles/ (pipeline/config/profiles.py), not this.",
    )
    if args.out is None:
        sys.stdout.write(text)
        return
    from apg.data import atomic_write

    # Read before written: the base (params.yaml) is often the file replaced.
    path = atomic_write(args.out, lambda tmp: tmp.write_text(text))
    print(f"wrote {path}: profile {args.profile}")


def cmd_record(args: argparse.Namespace) -> None:
    from pipeline.recorded.record import record

    record(
        args.profile,
        args.params,
        Path(args.dir) if args.dir else None,
        args.fresh,
        direct=args.direct,
        device=args.device,
        minutes=args.minutes,
        check=args.check,
        stages=args.stages,
        deadline_minutes=args.deadline,
        tasks=args.tasks.split(",") if args.tasks else None,
    )


def _run_dir(root: Path, folder: str) -> Path:
    """A run's folder as given on the command line: absolute, or relative to the project."""
    return Path(folder) if Path(folder).is_absolute() else root / folder


def cmd_grid(args: argparse.Namespace) -> None:
    from pipeline.common import project_root
    from pipeline.runs.grid import evaluate_grid

    checks.device(args.device)
    sets = None if args.sets is None else [name for name in args.sets.split(",") if name]
    run_dir = _run_dir(project_root(), args.run)
    path = evaluate_grid(run_dir, videos=args.videos, device=args.device, state=args.state, sets=sets)
    print(f"{run_dir.name}: wrote {path}; commit it with the run's folder")


def cmd_continue(args: argparse.Namespace) -> None:
    from pipeline.common import project_root
    from pipeline.runs import spec
    from pipeline.runs.execute import advance, check_sitting

    root = project_root()
    if args.minutes is None and args.steps is None:
        raise ValueError("continue: give --minutes or --steps (how long each run trains this sitting)")
    check_sitting(args.minutes, args.steps, args.device)
    if args.start:
        if args.runs:
            raise ValueError("continue: --start names its cells; give no run folders with it")
        every = _key_values(args.every or [], "--every")
        starts = []
        for cell in args.start:
            task, method, k, l, seed = spec.parse_cell(cell)
            name = spec.run_name(args.profile, task, method, k, l, seed)
            new = spec.new_run(args.profile, task, method, k, l, seed, eval_size=args.eval_size, every=every)
            starts.append((root / spec.RUNS_DIR / name, new))
    else:
        if args.every or args.eval_size is not None:
            raise ValueError("continue: --every and --eval-size are fixed when a run starts (--start)")
        if not args.runs:
            raise ValueError(
                "continue: name the runs' folders (recorded/...), or start new ones with --start"
            )
        starts = [(_run_dir(root, r), None) for r in args.runs]
        for run_dir, _ in starts:
            spec.read_run(run_dir)  # every folder is a run, before any trains
    for run_dir, new in starts:
        segment = advance(
            root,
            run_dir,
            minutes=args.minutes,
            steps=args.steps,
            device=args.device,
            compile=args.compile,
            new=new,
            full_state=not args.no_full_state,
        )
        print(
            f"{run_dir.name}: steps {segment['from_iteration']} -> {segment['to_iteration']} on "
            f"{segment['device']} in {segment['seconds'] / 60:.1f} min; commit its folder to keep them",
            flush=True,
        )


# --------------------------------------------------------------------------- train


# Flags of `train` named as the training config's fields (its scalar ``train`` keys): unset,
# they take the value of the params file's cell, so the pipeline's defaults are the only ones.
TRAIN_FIELDS = ("sweeps", "particles", *(k for k, kind in TRAIN_KEYS.items() if kind not in (bool, dict)))
TRAIN_HELP = {
    "lr_schedule": "constant or cosine (decay to lr * --lr-final-factor)",
    "lr_hold_fraction": "cosine: the last fraction of steps at the floor rate",
}


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The training config of ``train``: the params' first cell of ``--task``/``--method``
    (its K, L, training settings, network and model), each flag given replacing its field."""
    from apg.baselines import get_method
    from apg.tasks import get_task
    from apg.training import TrainConfig
    from pipeline.config import profiles
    from pipeline.config.params import grid_cells

    get_method(args.method).check_task(get_task(args.task))  # an unknown task or method, by name
    params = profiles.load(args.params)
    if args.task not in params.get("tasks", []) or args.task not in params:
        raise ValueError(
            f"--task {args.task!r}: not a task of {args.params} ({', '.join(params.get('tasks', []))})"
        )
    cells = [c for c in grid_cells(params, args.task) if c.method == args.method]
    if not cells:
        methods = sorted({c.method for c in grid_cells(params, args.task)})
        raise ValueError(
            f"--method {args.method!r}: {args.params} trains no such {args.task} cell (it trains {', '.join(methods)})"
        )
    base = cells[0].train.to_dict()
    given = {field: getattr(args, field) for field in TRAIN_FIELDS if getattr(args, field) is not None}
    base.update(given)
    base["model"] = {**base["model"], **_key_values(args.model, "--model")}
    base["network"] = {**base["network"], **_key_values(args.network, "--network")}
    base["method_options"] = {**base["method_options"], **_key_values(args.option, "--option")}
    base["compile"] = False
    return TrainConfig.from_dict(base)


def cmd_train(args: argparse.Namespace) -> None:
    import torch

    from apg.checkpoint import save_checkpoint
    from apg.loading import load_training_rows
    from pipeline.runs import loop

    checks.device(args.device)
    checks.threads(args.threads)
    checks.seed(args.seed, "--seed")
    cfg = train_config(args).validate()  # before touching data: bad K, L, method, task fail first
    checks.finite_values(cfg.method_options, "--option")
    checks.networks(cfg)  # model keys the task knows, networks it can build
    train_x = load_training_rows(cfg.task, args.data, cfg.model)
    checks.step_room(cfg.particles, cfg.batch_size, train_x, args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    trainer = loop.start(cfg, train_x, args.device, args.seed)
    from tqdm import tqdm

    class ProgressBar(loop.Callback):
        """The loop's rows (every step's) on a tqdm bar, with the log joint and ESS."""

        def on_row(
            self, trainer: Trainer, row: dict[str, float], history: list[dict], checkpoint: bool
        ) -> None:
            bar.update(1)
            bar.set_postfix(log_joint=f"{row['log_joint']:.1f}", ess=f"{row['ess']:.3f}", refresh=False)

    with tqdm(
        total=cfg.iterations, desc=f"{cfg.task}/{cfg.method} K={cfg.sweeps} L={cfg.particles}", unit="it"
    ) as bar:
        loop.drive(trainer, log_every=1, callbacks=[ProgressBar()])
    print(f"wrote {save_checkpoint(args.out, cfg.to_dict(), trainer.state_dict())}")


# --------------------------------------------------------------------------- evaluate


def summarize(metrics: dict[str, np.ndarray]) -> dict[str, Any]:
    """Means over datasets: curves ``(K, M)`` -> lists, finals ``(M,)`` -> floats."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        mean = value.mean(axis=-1)
        out[key] = [float(v) for v in mean] if value.ndim == 2 else float(mean)
    return out


def cmd_evaluate(args: argparse.Namespace) -> None:
    from apg.data import atomic_write
    from apg.loading import load_task_data, load_trained
    from apg.training import check_budget, evaluate
    from pipeline.common import seed_everything

    checks.device(args.device)
    checks.seed(args.seed, "--seed")
    if args.batch_size is not None:
        checks.integer(args.batch_size, "--batch-size", low=1)
    cfg, model, proposals = load_trained(args.checkpoint, args.device)
    _trained_defaults(args, cfg, ("sweeps", "particles", "batch_size", "resample_mode"))
    check_budget(args.sweeps, args.particles)
    x = load_task_data(cfg.task, args.data, cfg.model)
    checks.step_room(args.particles, args.batch_size, x, args.device)
    x = x.to(args.device)
    seed_everything(args.seed)
    metrics = evaluate(
        cfg, model, proposals, x, args.sweeps, args.particles, args.batch_size, args.resample_mode
    )
    payload = {
        "task": cfg.task,
        "method": cfg.method,
        "sweeps": args.sweeps,
        "particles": args.particles,
        "num_datasets": int(x.shape[0]),
        **summarize(metrics),
        "config": cfg.to_dict(),
    }
    text = json.dumps(payload, indent=2)
    path = atomic_write(args.out, lambda tmp: tmp.write_text(text + "\n"))
    print(f"wrote {path}")


def _trained_defaults(args: argparse.Namespace, cfg: TrainConfig, names: tuple[str, ...]) -> None:
    """Each of ``names`` not given on the command line: the checkpoint's own (what its cell
    trained with, from its params), so no second default lives here."""
    for name in names:
        if getattr(args, name) is None:
            setattr(args, name, getattr(cfg, name))


# --------------------------------------------------------------------------- impute


def cmd_impute(args: argparse.Namespace) -> None:
    from pipeline.common import seed_everything
    from pipeline.evaluate.impute import impute_file

    checks.seed(args.seed, "--seed")
    seed_everything(args.seed)
    path = impute_file(
        args.checkpoint,
        args.data,
        args.mask,
        args.out,
        args.iterations,
        args.sweeps,
        args.particles,
        args.fill,
        _key_values(args.network, "--network"),
    )
    print(f"wrote {path}")


# --------------------------------------------------------------------------- parsers


def _key_value_flag(parser: argparse.ArgumentParser, flag: str, help: str | None = None) -> None:
    """A repeatable ``flag KEY=VALUE`` (read by ``_key_values``)."""
    parser.add_argument(flag, action="append", default=[], metavar="KEY=VALUE", help=help)


def _budget_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweeps", "-K", type=int, default=None)
    parser.add_argument("--particles", "-L", type=int, default=None)


def _add_generate(sub) -> None:
    """``generate``: simulate a task's datasets."""
    gen = sub.add_parser("generate", help="simulate datasets of a task into an .npz file")
    gen.add_argument("--task", default="gmm")
    gen.add_argument("--out", required=True)
    gen.add_argument("--num-datasets", type=int, required=True)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--num-points", type=int, default=None, help="shorthand for --size num_points=N")
    _key_value_flag(gen, "--size", "task size option")
    _key_value_flag(gen, "--model", "task model hyperparameter")
    gen.set_defaults(func=cmd_generate)


def _add_train(sub) -> None:
    """``train``: one method on one dataset file."""
    train = sub.add_parser(
        "train",
        help="train a method on a dataset file and save a checkpoint",
        description="Train one cell on a dataset file. Every setting not given is the --params "
        "file's first cell of --task and --method (its K, L, training settings, network, model).",
    )
    train.add_argument(
        "--params", default="params.yaml", help="params file or profile whose cell is the default"
    )
    train.add_argument("--task", default="gmm")
    train.add_argument("--method", default="apg")
    _budget_flags(train)
    for field in TRAIN_FIELDS[2:]:
        kind = TRAIN_KEYS[field]  # int, str, or (int, float): a float
        flag = "--" + field.replace("_", "-")
        train.add_argument(flag, type=float if isinstance(kind, tuple) else kind, help=TRAIN_HELP.get(field))
    _key_value_flag(train, "--model")
    _key_value_flag(train, "--network")
    _key_value_flag(train, "--option", "the method's own option (e.g. step_size=0.05 for hmc-rws)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    train.add_argument("--device", default="cpu")
    train.add_argument("--data", required=True)
    train.add_argument("--out", required=True)
    train.set_defaults(func=cmd_train)


def _add_evaluate(sub) -> None:
    """``evaluate``: one checkpoint on held-out datasets."""
    ev = sub.add_parser("evaluate", help="evaluate a checkpoint on held-out datasets, write JSON")
    ev.add_argument("--checkpoint", required=True)
    ev.add_argument("--data", required=True)
    _budget_flags(ev)  # each not given: the checkpoint's own
    ev.add_argument("--batch-size", type=int, default=None)
    ev.add_argument("--resample-mode", default=None)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--out", required=True)
    ev.set_defaults(func=cmd_evaluate)


def _add_impute(sub) -> None:
    """``impute``: fill in the entries a mask marks missing."""
    imp = sub.add_parser(
        "impute",
        help="fill in the entries of x a mask marks missing (1), by the chain of inference and "
        "generation of Rezende et al. 2014, Appendix F; writes x, mask and each iteration's values",
    )
    imp.add_argument("--checkpoint", required=True)
    imp.add_argument("--data", required=True, help=".npz with x shaped like the task's data")
    imp.add_argument("--mask", required=True, help=".npz with 'mask' shaped like x: 1 missing, 0 observed")
    imp.add_argument("--out", required=True)
    imp.add_argument("--iterations", type=int, default=20)
    _budget_flags(imp)  # not given: the checkpoint's own
    imp.add_argument("--fill", default="sample", help="sample: draw from p(x | z); mean: its mean")
    _key_value_flag(imp, "--network")
    imp.add_argument("--seed", type=int, default=0)
    imp.set_defaults(func=cmd_impute)


def _add_smoke(sub) -> None:
    """``smoke``: the whole pipeline on small params in a throwaway repo."""
    smoke = sub.add_parser(
        "smoke", help="the whole pipeline from scratch on small params in a throwaway repo (minutes)"
    )
    smoke.add_argument(
        "--params", default="smoke", help="a profile's name or a params file to run (default: smoke)"
    )
    smoke.add_argument("--dir", default="results/smoke", help="where the throwaway repo goes (replaced)")
    smoke.set_defaults(func=cmd_smoke)


def _add_config(sub) -> None:
    """``config``: a profile's params."""
    config = sub.add_parser(
        "config",
        help="print a profile's params (its overlays in profiles/ laid over params.yaml), validated",
    )
    config.add_argument(
        "--profile", required=True, help="smoke, paper, or a recorded profile (paper-gmm, ...)"
    )
    config.add_argument("--check", action="store_true", help="its check variant (profiles/check/)")
    config.add_argument(
        "--out", default=None, help="write to this file (params.yaml: the profile for dvc repro)"
    )
    config.set_defaults(func=cmd_config)


def _add_record(sub) -> None:
    """``record``: a profile's run, kept in ``recorded/``."""
    rec = sub.add_parser(
        "record",
        help="run a profile (profiles/; paper-gmm: GMM Table 1 at paper scale) and keep "
        "its results in recorded/ for the report; resumes a stopped run (not with --direct)",
    )
    rec.add_argument(
        "profile",
        help="paper-gmm, paper-gmm-std, paper-check, gpu-gmm, gpu-bmnist, gpu-bmnist-3d (after gpu-bmnist), "
        "gpu-bmnist-compiled or replicate (the default run with other seeds)",
    )
    rec.add_argument(
        "--params",
        default=None,
        help="a params file or profile laid under the profile in place of what it extends "
        "(default: its overlay's extends: paper, or params.yaml for replicate)",
    )
    rec.add_argument("--dir", default=None, help="the sandbox repo (default runs/<profile>)")
    rec.add_argument("--fresh", action="store_true", help="start over instead of resuming")
    rec.add_argument(
        "--direct",
        action="store_true",
        help="run the stages in-process, without DVC, Ray or MLflow (one machine)",
    )
    rec.add_argument(
        "--device", default="cpu", help="with --direct: where cells train and evaluate (cuda, cpu)"
    )
    rec.add_argument("--minutes", type=float, default=None, help="with --direct: train as many steps as fit")
    rec.add_argument("--check", action="store_true", help="the profile under paper-check's caps: a few steps")
    rec.add_argument(
        "--stages",
        default="all",
        choices=("all", "train", "evaluate"),
        help="with --direct: train only (keep the sandbox), or evaluate a trained sandbox and keep the run",
    )
    rec.add_argument(
        "--deadline", type=float, default=None, help="with --direct: stop training after this many minutes"
    )
    rec.add_argument(
        "--tasks",
        default=None,
        help="re-record these tasks of the recorded run (comma-separated), starting from its "
        "finished cells; its other tasks stay as recorded",
    )
    rec.set_defaults(func=cmd_record)


def _add_grid(sub) -> None:
    """``grid``: a run's state scored on its profile's held-out grid."""
    run = sub.add_parser(
        "grid",
        help="score a run's state on its profile's held-out T x D sets (a run that tracks objects: "
        "Bouncing MNIST); writes grid.csv and trail.npz into its folder; commit them after",
    )
    run.add_argument("run", help="the run's folder, e.g. recorded/bmnist-long")
    run.add_argument("--device", default="cpu", help="cpu or cuda")
    run.add_argument(
        "--videos",
        type=int,
        default=None,
        help="N videos of each set (the set's seed and N fix them: another N, other videos)",
    )
    run.add_argument(
        "--sets",
        default=None,
        help="score only these sets, comma-separated (T20_D4,T20_D5); their rows of the step are "
        "replaced, the other sets' kept",
    )
    run.add_argument(
        "--state",
        type=Path,
        default=None,
        help="score this checkpoint of the run (an earlier step's state.pt, from git history) "
        "instead of its latest state",
    )
    run.set_defaults(func=cmd_grid)


def _add_sitting(run) -> None:
    """The options of a sitting: how long, where, and which state it keeps."""
    run.add_argument("--minutes", type=float, default=None, help="train until this much wall time has passed")
    run.add_argument("--steps", type=int, default=None, help="train at most this many steps")
    run.add_argument("--device", default="cpu", help="cpu or cuda")
    run.add_argument("--compile", action="store_true", help="torch.compile the step (CUDA graphs on a GPU)")
    run.add_argument(
        "--no-full-state",
        action="store_true",
        help="checkpoint only the compact state (for a machine whose copy is discarded after the sitting)",
    )


def _add_continue(sub) -> None:
    """``continue``: any run of any profile, a sitting at a time."""
    run = sub.add_parser(
        "continue",
        help="continue runs (folders under recorded/) for --minutes or --steps each, one after another, "
        "or start a profile's cells as new runs with --start; commit the folders after",
    )
    run.add_argument("runs", nargs="*", help="the runs' folders, e.g. recorded/paper-dgmm-apg-K10-L10-s0")
    _add_sitting(run)
    run.add_argument(
        "--start",
        nargs="+",
        metavar="CELL",
        default=None,
        help="start these cells of --profile as new runs in recorded/<profile>-<task>-<method>-K<k>-L<l>-s<seed>: "
        "TASK/METHOD/K<k>/L<l>/seed<s>, e.g. dgmm/apg/K10/L10/seed0",
    )
    run.add_argument(
        "--profile", default="paper", help="with --start: the profile whose cells they are (paper)"
    )
    run.add_argument(
        "--every",
        nargs="*",
        metavar="KEY=STEPS",
        help="with --start: the cadences in steps: log=25 checkpoint=50 eval=250 (the defaults)",
    )
    run.add_argument(
        "--eval-size",
        type=int,
        default=None,
        help="with --start: score the first N datasets of the held-out set",
    )
    run.set_defaults(func=cmd_continue)


# The stages' subcommands: ``main`` hands every argument (--help included) to the stage's own
# parser; this one only lists them.
STAGES = {
    "sweep": ("sweep.stage", "stage: Ray Tune sweep of one task's grid (params.yaml)"),
    "eval-sweep": ("evaluate.stage", "stage: evaluate every trained cell of a sweep"),
    "report": ("report.stage", "stage: regenerate reports/ from recorded results"),
    "tune": ("search.stage", "hyperparameter search of one task (tune.yaml): Tune search algorithm + ASHA"),
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (exit status 2), like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="apg-pipeline", description="APG samplers: train, evaluate, sweep, report.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_train(sub)
    _add_evaluate(sub)
    _add_impute(sub)
    _add_preview(sub)
    _add_smoke(sub)
    _add_runs_url(sub)
    _add_config(sub)
    _add_record(sub)
    _add_continue(sub)
    _add_grid(sub)
    for name, (_, text) in STAGES.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in STAGES:
        import importlib

        importlib.import_module(f"pipeline.{STAGES[argv[0]][0]}").main(argv[1:])
        return
    args = build_parser().parse_args(argv)
    from pipeline.errors import run_guarded

    run_guarded(lambda: args.func(args))


if __name__ == "__main__":
    main()
