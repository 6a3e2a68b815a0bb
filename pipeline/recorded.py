"""``apg-pipeline record``: the pipeline at another scale, run once, kept in git.

The reproduction (``params.yaml``) is retrained from scratch by every ``dvc repro``; a run
at the paper's scale takes hours and is not. A *profile* derives a params file from
``params-paper.yaml`` (which tasks, which grid cells, how many trials at once: never the
per-step sizes B, N, T, D, K, L, and the networks only where a profile's name and report say
so: ``paper-gmm-std``). ``record`` runs the whole pipeline on it
in a sandbox repo under ``runs/<profile>/`` (as ``apg-pipeline smoke`` does), resumes it
if it was stopped (finished cells are skipped, unfinished ones restart from their last
checkpoint), and copies what the report needs into ``recorded/<profile>/``: the
evaluation results, each cell's summary and its trained weights, and a manifest naming
the commit and code digest that trained them. The report stage shows every recorded run
beside the paper's numbers without retraining.

    apg-pipeline record paper-gmm           # GMM Table 1 at the paper's scale (CPU: ~1 h)
    apg-pipeline record paper-gmm-std       # its APG on standardized offsets (CPU: ~2-3 h)
    apg-pipeline record paper-check         # every task and method, a few steps at paper sizes
    apg-pipeline record replicate           # the default run with other seeds (params.yaml; ~2 h)
    nohup apg-pipeline record paper-gmm > runs/paper-gmm.log 2>&1 &    # in the background

On one GPU machine with PyTorch alone (no Ray, MLflow or DVC), ``--direct`` runs the same
stages in-process (``pipeline.direct``) and ``--minutes`` sizes the training to the clock;
``--check`` first runs the profile with ``paper-check``'s caps (a few steps, one batch per
set) to fail fast on a new machine:

    apg-pipeline record gpu-bmnist --direct --device cuda --minutes 5
    apg-pipeline record gpu-bmnist-3d --direct --device cuda --minutes 7   # then on three digits
    apg-pipeline record gpu-bmnist-compiled --direct --device cuda --minutes 5   # more steps, compiled
    apg-pipeline record gpu-gmm --direct --device cuda   # GMM Table 1 compiled, 4 trials at once
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from pipeline import provenance
from pipeline.common import project_root
from pipeline.config import cell_key, load_params, validate_params
from pipeline.smoke import make_sandbox
from pipeline.stages import code_digest, package_root, stage_times

RECORDED = "recorded"
MANIFEST = "manifest.json"
SANDBOX_INFO = "record.json"
# What the report reads from a recorded run's evaluation (metrics.csv is the parquet's copy).
EVAL_FILES = ("meta.json", "metrics.parquet", "training.parquet", "samples.npz")
# Table 1's cells (section 5.1): the methods the paper compares, at its training budget.
TABLE1_METHODS = ("apg", "rws-mlp", "rws-lstm")


def _one_trial_per_core(params: dict[str, Any]) -> None:
    """On a small CPU machine: one thread per trial, as many trials as cores, no GPU."""
    params["sweep"].update(cpus_per_trial=1, torch_threads=1, gpus_per_trial=0, num_cpus=None)


def paper_gmm(paper: dict[str, Any]) -> dict[str, Any]:
    """GMM Table 1 as the paper ran it: APG, RWS-MLP and RWS-LSTM trained at K=10, L=10
    (RWS: K*L particles) for the paper's 200,000 iterations on its 20,000 datasets, one
    seed each (the paper trained one model per method), and the exact Gibbs sampler
    (nothing to train) as the reference; evaluated at the paper's K in {5, 10, 15}, L=10, and
    at K=50 (``params-paper.yaml``: the comparison with exact Gibbs at stationarity)."""
    params = copy.deepcopy(paper)
    params["tasks"] = ["gmm"]
    gmm = params["gmm"]
    table1 = [e for e in gmm["grid"] if set(TABLE1_METHODS) <= set(e["methods"])]
    if len(table1) != 1:
        raise ValueError("params-paper.yaml: expected one gmm grid entry with apg, rws-mlp and rws-lstm")
    gmm["grid"] = [
        {**table1[0], "methods": list(TABLE1_METHODS), "seeds": [0]},
        {"methods": ["gibbs"], "pairs": table1[0]["pairs"], "seeds": [0], "train": {"iterations": 0}},
    ]
    _one_trial_per_core(params)
    params["tracking"]["experiment"] = "apg-paper-gmm"
    params["report"]["scale"] = "paper scale (GMM Table 1 cells, one seed, CPU)"
    return params


def paper_gmm_std(paper: dict[str, Any]) -> dict[str, Any]:
    """``paper-gmm``'s APG cell (beside exact Gibbs) with the assignment network reading
    standardized offsets, ``network.c_inputs: standardized`` (apg/tasks/gmm/proposals.py,
    AssignmentProposal): the one profile whose networks depart from the paper's settings, in
    their inputs only (width and layers are Appendix E's), and its report says so. With raw
    offsets, paper-gmm's inclusive KL of {c} was ~0.03 (the paper: 0.004). Its RWS baselines
    are paper-gmm's."""
    params = paper_gmm(paper)
    gmm = params["gmm"]
    gmm["network"] = {**gmm["network"], "c_inputs": "standardized"}
    gmm["grid"] = [
        {**entry, "methods": ["apg"]} if "apg" in entry["methods"] else entry for entry in gmm["grid"]
    ]
    params["tracking"]["experiment"] = "apg-paper-gmm-std"
    params["report"]["scale"] = (
        "paper scale, APG's assignment network on standardized offsets (x - mu) sqrt(tau) "
        "(Appendix E's width and layers; GMM Table 1 cells, one seed, CPU)"
    )
    return params


# gpu-gmm: GMM Table 1 on one GPU in minutes, every step one compiled graph (issue 21).
GPU_GMM_ITERATIONS = 20_000  # a tenth of the paper's; 2.6 ms a compiled APG step on one H100
# params.yaml's gmm schedule (measured for 10,000 steps on CPU; the paper's constant 1e-4 is
# for 200,000): cosine from 0.02 to a hundredth, the last fifth at that floor.
GPU_GMM_SCHEDULE = {"lr": 0.02, "lr_schedule": "cosine", "lr_final_factor": 0.01, "lr_hold_fraction": 0.2}


def gpu_gmm(paper: dict[str, Any]) -> dict[str, Any]:
    """GMM Table 1 trained on one GPU, four trials sharing it (``gpus_per_trial: 0.25``;
    ``--direct`` runs them as four processes at once): APG on standardized offsets (as
    ``paper-gmm-std``) with two seeds, RWS-MLP and RWS-LSTM, at the paper's K=10, L=10, B=20
    on its 20,000 datasets, each step one compiled graph (``train.compile``: CUDA graphs; RWS-LSTM
    eager), for
    ``GPU_GMM_ITERATIONS`` at ``GPU_GMM_SCHEDULE``; exact Gibbs as the reference."""
    params = paper_gmm(paper)
    gmm = params["gmm"]
    gmm["network"] = {**gmm["network"], "c_inputs": "standardized"}
    table1, gibbs = gmm["grid"]
    gmm["grid"] = [
        {**table1, "methods": ["apg"], "seeds": [0, 1]},
        {**table1, "methods": ["rws-mlp"], "seeds": [0]},
        # eager: inductor's compiled nn.LSTM failed at run time on CPU (aten.mkldnn_rnn_layer,
        # torch 2.13) and has not been tried on CUDA; RWS-LSTM's eager GPU step is 9.5 ms
        {**table1, "methods": ["rws-lstm"], "seeds": [0], "train": {"compile": False}},
        gibbs,
    ]
    gmm["train"].update(iterations=GPU_GMM_ITERATIONS, compile=True, **GPU_GMM_SCHEDULE)
    params["sweep"].update(gpus_per_trial=0.25, log_every=100)
    params["tracking"]["experiment"] = "apg-gpu-gmm"
    params["report"]["scale"] = (
        "one GPU for minutes (GMM Table 1 cells at the paper's K, L, B, compiled, four trials at once; "
        f"{GPU_GMM_ITERATIONS:,} iterations; APG's assignment network on standardized offsets)"
    )
    return params


# paper-check caps: enough steps to run every code path (training, logging, the final
# checkpoint) and enough datasets for one batch of each stage.
CHECK_ITERATIONS = 3


def paper_check(paper: dict[str, Any]) -> dict[str, Any]:
    """Every task, method and budget of the paper's configuration at its per-step sizes, but
    ``CHECK_ITERATIONS`` training steps and one batch of datasets per set: what a cluster run
    would hit first (memory, shapes, every stage's code path), in minutes on a CPU."""
    params = copy.deepcopy(paper)
    for task in params["tasks"]:
        section = params[task]
        train_batch = section["train"]["batch_size"]
        eval_batch = section["evaluate"]["batch_size"]
        section["train"]["iterations"] = min(section["train"]["iterations"], CHECK_ITERATIONS)
        data = section["data"]
        data["train"]["num_datasets"] = min(data["train"]["num_datasets"], train_batch)
        for key in ("test", "tests", "figures"):
            entries = data.get(key)
            for entry in entries if isinstance(entries, list) else [entries] if entries else []:
                cap = eval_batch if key != "figures" else 2
                entry["num_datasets"] = min(entry["num_datasets"], cap)
        for entry in section["grid"]:
            entry["seeds"] = entry["seeds"][:1]
            if "iterations" in entry.get("train", {}):
                entry["train"]["iterations"] = min(entry["train"]["iterations"], CHECK_ITERATIONS)
    _one_trial_per_core(params)
    params["sweep"].update(checkpoint_every=1, log_every=1)
    params["tracking"]["experiment"] = "apg-paper-check"
    params["report"]["scale"] = (
        f"paper per-step sizes, {CHECK_ITERATIONS} training steps (a check, not results)"
    )
    return params


# gpu-bmnist: what one GPU does with Bouncing MNIST in minutes (issue 18, item 3).
GPU_BMNIST_TRAIN_VIDEOS = 5000  # 15,000 to 20,000 draws in minutes: each video seen a few times
GPU_BMNIST_TEST_VIDEOS = {10: 20, 20: 20, 100: 5}  # per held-out set, by video length


def gpu_bmnist(paper: dict[str, Any]) -> dict[str, Any]:
    """Bouncing MNIST on one GPU for minutes: the paper's methods, K=5, L=10, B=10, T=10 and
    held-out sets (T in {10, 20, 100} x D in {3, 4, 5}, fewer videos each), trained as the
    CPU default's curriculum starts, on one digit per video (params.yaml's note: with more
    digits from the start APG did not fit even one video), at its learning-rate schedule
    (cosine from 1e-3; the paper's constant 1e-4 is for 200,000 steps). The iterations
    come from ``--minutes`` (``pipeline.direct``)."""
    params = copy.deepcopy(paper)
    params["tasks"] = ["bmnist"]
    section = params["bmnist"]
    section["network"] = {**section.get("network", {}), "num_digits": 1}
    train = section["data"]["train"]
    train["num_datasets"] = GPU_BMNIST_TRAIN_VIDEOS
    train["sizes"] = {**train["sizes"], "num_digits": 1}
    for entry in section["data"]["tests"]:
        entry["num_datasets"] = GPU_BMNIST_TEST_VIDEOS.get(entry["sizes"]["num_frames"], 5)
    section["data"]["figures"] = section["data"]["figures"][:1]
    section["train"].update(lr=1e-3, lr_schedule="cosine", lr_final_factor=0.01)
    section["evaluate"]["pairs"] = [section["evaluate"]["pairs"][0]]
    params["sweep"].update(gpus_per_trial=0, log_every=25)
    params["tracking"]["experiment"] = "apg-gpu-bmnist"
    params["report"]["scale"] = (
        "one GPU for minutes (Bouncing MNIST: paper K, L, B, T and test sets; trained on one digit)"
    )
    return params


def gpu_bmnist_3d(paper: dict[str, Any]) -> dict[str, Any]:
    """The curriculum's second step on one GPU: the paper's training videos (T=10, D=3) and
    networks (three digits tracked), every cell starting from the weights its method learnt
    in ``gpu-bmnist`` on one digit (``STARTS_FROM``); the rest as ``gpu-bmnist``, with a
    cosine schedule from half its rate (the networks are trained, not fresh)."""
    params = gpu_bmnist(paper)
    section, theirs = params["bmnist"], paper["bmnist"]
    section["network"] = copy.deepcopy(theirs["network"])
    section["data"]["train"]["sizes"] = copy.deepcopy(theirs["data"]["train"]["sizes"])
    section["train"]["lr"] = 5e-4
    params["tracking"]["experiment"] = "apg-gpu-bmnist-3d"
    params["report"]["scale"] = (
        "one GPU for minutes (Bouncing MNIST: paper K, L, B, T, D and test sets; "
        "trained on three digits after gpu-bmnist's one-digit training)"
    )
    return params


def compile_where_possible(params: dict[str, Any], task: str) -> None:
    """``train.compile`` on for ``task``'s cells, off for the grid entries with a method that
    cannot compile (AVF)."""
    from apg.baselines import METHODS

    params[task]["train"]["compile"] = True
    for entry in params[task]["grid"]:
        if any(METHODS[m].not_compiled_because for m in entry["methods"]):
            entry.setdefault("train", {})["compile"] = False


def gpu_bmnist_compiled(paper: dict[str, Any]) -> dict[str, Any]:
    """``gpu-bmnist`` with every step that compiles compiled (``train.compile``: APG one graph
    per block update, RWS-MLP whole; AVF eager): the same minutes buy several times the
    one-digit steps, the next thing to try after ``gpu-bmnist``'s 800 (its log joint was
    still rising) and ``gpu-bmnist-3d``'s three-digit steps (no gain)."""
    params = gpu_bmnist(paper)
    compile_where_possible(params, "bmnist")
    params["tracking"]["experiment"] = "apg-gpu-bmnist-compiled"
    params["report"]["scale"] = (
        "one GPU for minutes (Bouncing MNIST: paper K, L, B, T and test sets; trained on one digit, "
        "APG and RWS-MLP compiled)"
    )
    return params


# The default run again with other seeds: every grid entry's training seeds moved past the
# default's, the data, held-out sets and settings unchanged. The report shows its verdict
# beside each claim's and counts the claims that hold in both runs; run it on another CPU
# type when one is at hand (each run names its machine).
REPLICATE_SEED_OFFSET = 100


def replicate(defaults: dict[str, Any]) -> dict[str, Any]:
    """``params.yaml`` with disjoint training seeds (seed s -> s + 100): a second full default run."""
    params = copy.deepcopy(defaults)
    for task in params["tasks"]:
        for entry in params[task]["grid"]:
            entry["seeds"] = [seed + REPLICATE_SEED_OFFSET for seed in entry["seeds"]]
    scale = params["report"]["scale"]
    params["report"]["scale"] = f"{scale}, replication: training seeds moved by {REPLICATE_SEED_OFFSET}"
    return params


PROFILES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "paper-gmm": paper_gmm,
    "paper-gmm-std": paper_gmm_std,
    "paper-check": paper_check,
    "gpu-bmnist": gpu_bmnist,
    "gpu-bmnist-3d": gpu_bmnist_3d,
    "gpu-bmnist-compiled": gpu_bmnist_compiled,
    "gpu-gmm": gpu_gmm,
    "replicate": replicate,
}
# The params file each profile derives from (params-paper.yaml unless named here).
PROFILE_BASES = {"replicate": "params.yaml"}
DEFAULT_BASE = "params-paper.yaml"


def profile_base(name: str) -> str:
    return PROFILE_BASES.get(name, DEFAULT_BASE)


# A curriculum's later step: the profile's cells start from the trained weights of the same
# method, K, L and seed in another profile's run (its sandbox holds the full checkpoints).
STARTS_FROM = {"gpu-bmnist-3d": "gpu-bmnist"}


def starting_weights(name: str, root: Path) -> dict[str, Any] | None:
    """Where profile ``name``'s cells start: ``None`` (from scratch), or the earlier
    profile's recorded run (``recorded/<earlier>``, committed) and, per task and cell key
    ``method/K/L/seed``, the full checkpoint its cell left, found in the recorded run (when
    small) or in that run's sandbox (``runs/<earlier>``) and checked against the recorded
    sha256: the weights a recorded run names are the ones training starts from."""
    earlier = STARTS_FROM.get(name)
    if earlier is None:
        return None
    from pipeline.common import file_digest

    run = root / RECORDED / earlier
    if not (run / MANIFEST).is_file():
        raise ValueError(f"profile {name} starts from the recorded run {earlier}: {run} has no {MANIFEST}")
    manifest = json.loads((run / MANIFEST).read_text())
    cells: dict[str, dict[str, dict[str, str]]] = {}
    for task in manifest["cells"]:
        sweep = json.loads((run / "eval" / task / "sweep.json").read_text())
        for cell in sweep["cells"]:
            candidates = [
                run / "cells" / task / cell["cell_id"] / "model.pt",
                root
                / "runs"
                / earlier
                / "results"
                / "sweeps"
                / task
                / "cells"
                / cell["cell_id"]
                / "model.pt",
            ]
            path = next(
                (p for p in candidates if p.is_file() and file_digest(p) == cell["checkpoint_sha256"]), None
            )
            if path is None:
                raise ValueError(
                    f"profile {name} starts from {earlier}'s cell {cell['cell_id']}, whose checkpoint "
                    f"(sha256 {cell['checkpoint_sha256'][:12]}) is in none of {', '.join(map(str, candidates))}; "
                    f"run `apg-pipeline record {earlier}` first"
                )
            key = cell_key(cell["method"], cell["K"], cell["L"], cell["seed"])
            cells.setdefault(task, {})[key] = {"path": str(path), "sha256": cell["checkpoint_sha256"]}
    return {"profile": earlier, "commit": manifest["commit"], "cells": cells}


def derive(name: str, base: Path, check: bool = False) -> dict[str, Any]:
    """Profile ``name``'s params (with ``check``: under ``paper-check``'s caps)."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
    params = PROFILES[name](load_params(base))
    if check and name != "paper-check":
        params = paper_check(params)
        for task in params["tasks"]:  # the code paths, not every held-out set
            data = params[task]["data"]
            if data.get("tests"):
                imputed = (params[task].get("evaluate", {}).get("imputation") or {}).get("test_set")
                data["tests"] = [t for i, t in enumerate(data["tests"]) if i == 0 or t["name"] == imputed]
    validate_params(params)
    return params


def sandbox_for(
    name: str, base: Path, directory: Path, fresh: bool, check: bool = False, direct: bool = False
) -> tuple[Path, dict[str, Any]]:
    """The profile's sandbox repo: made anew, or the one a stopped run left (resumed only if
    the same code and params made it, since its finished cells are reused as they are)."""
    code = package_root()
    params = derive(name, base, check)
    info = {
        "profile": name,
        "base": base.name,
        # A copy of the code whose git history is absent or stale (a lent machine's copy of
        # the working tree) names its commit in APG_COMMIT.
        "commit": os.environ.get("APG_COMMIT") or provenance.git_commit(code),
        "code_digest": {t: code_digest("sweep", t, code) for t in params["tasks"]},
        "params_sha": _digest(params),
    }
    marker = directory / SANDBOX_INFO
    if directory.exists() and not fresh:
        if not marker.is_file():
            raise ValueError(
                f"{directory} exists and is not a recorded run's sandbox; remove it or pass --fresh"
            )
        old = json.loads(marker.read_text())
        if (old["code_digest"], old["params_sha"]) != (info["code_digest"], info["params_sha"]):
            raise ValueError(
                f"{directory} was started by other code or params (commit {old['commit'][:10]}); "
                "pass --fresh to start over"
            )
        info = {**old, "resumed": old.get("resumed", 0) + 1}
    else:
        with _params_file(params) as path:
            make_sandbox(directory, path, init_repo=not direct)
        info["started"] = provenance.utc_now()
    marker.write_text(json.dumps(info, indent=2) + "\n")
    return directory, info


class _params_file:
    def __init__(self, params: dict[str, Any]):
        self.params = params

    def __enter__(self) -> Path:
        import tempfile

        self.dir = tempfile.TemporaryDirectory()
        path = Path(self.dir.name) / "params.yaml"
        path.write_text(yaml.safe_dump(self.params, sort_keys=False))
        return path

    def __exit__(self, *exc) -> None:
        self.dir.cleanup()


def _digest(params: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]


def run_profile(sandbox: Path) -> float:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the sandbox's own ./mlflow.db
    env.pop("APG_PROJECT_ROOT", None)  # the stages' root is the sandbox
    start = time.monotonic()
    proc = subprocess.run(["dvc", "repro"], cwd=sandbox, env=env)
    if proc.returncode != 0:
        raise SystemExit(
            f"apg-pipeline: error: dvc repro failed in {sandbox} (exit {proc.returncode}); "
            "run the same command again to resume"
        )
    return time.monotonic() - start


def collect(sandbox: Path, info: dict[str, Any], dest: Path, wall_seconds: float) -> Path:
    """Copy the report's inputs, each cell's summary and weights, and a manifest."""
    params = yaml.safe_load((sandbox / "params.yaml").read_text())
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cells = {}
    for task in params["tasks"]:
        for name in EVAL_FILES:
            source, target = sandbox / "results" / "eval" / task / name, tmp / "eval" / task / name
            target.parent.mkdir(parents=True, exist_ok=True)
            (compress_samples if name == "samples.npz" else shutil.copy)(source, target)
        sweep = json.loads((sandbox / "results" / task / "sweep.json").read_text())
        kept = {}
        for cell in sweep["cells"]:
            cell_dir = tmp / "cells" / task / cell["cell_id"]
            cell_dir.mkdir(parents=True)
            for key in ("checkpoint", "history"):
                if cell.get(key):
                    name = keep_file(sandbox / cell[key], cell_dir, key)
                    cell[key] = (
                        Path(RECORDED) / dest.name / "cells" / task / cell["cell_id"] / name
                    ).as_posix()
            kept[cell["cell_id"]] = cell["checkpoint"]
        (tmp / "eval" / task / "sweep.json").write_text(json.dumps(sweep, indent=2) + "\n")
        meta_path = tmp / "eval" / task / "meta.json"  # the report finds the weights through it
        meta = json.loads(meta_path.read_text())
        for cell in meta["cells"]:
            cell["checkpoint"] = kept.get(cell["cell_id"], cell["checkpoint"])
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        cells[task] = len(sweep["cells"])
    shutil.copy(sandbox / "params.yaml", tmp / "params.yaml")
    manifest = {
        **info,
        "finished": provenance.utc_now(),
        "wall_minutes_last_run": round(wall_seconds / 60, 1),
        "stage_minutes": {k: round(v / 60, 1) for k, v in stage_times(sandbox).items()},
        "scale": params["report"]["scale"],
        "cells": cells,
        "machine": f"trained on {info['device']}, evaluated on {info.get('eval_device', info['device'])}; "
        "in-process (pipeline.direct)"
        if info.get("device")
        else f"{provenance.machine_line(provenance.machine())}; torch threads per trial "
        f"{params['sweep']['torch_threads']}",
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def compress_samples(source: Path, target: Path) -> None:
    """``source``'s arrays written to ``target`` deflated: pictures of videos are mostly empty
    canvas (Bouncing MNIST's reconstructions shrink ~5x), and they are kept in git."""
    import numpy as np

    with np.load(source) as data:
        arrays = {k: data[k] for k in data.files}
    with open(target, "wb") as f:
        np.savez_compressed(f, **arrays)


# Trained weights kept whole up to this size; a larger checkpoint (Bouncing MNIST's
# proposals: ~18 MB) keeps the generative model's weights alone, which is what the report
# draws with (its GIF), and leaves the proposals out of git.
CHECKPOINT_KEEP_BYTES = 4 * 2**20
GENERATIVE_ONLY = "generative.pt"


def keep_file(path: Path, cell_dir: Path, key: str) -> str:
    """Copy a cell's file into the recorded run; returns the name it is kept under."""
    if key != "checkpoint" or path.stat().st_size <= CHECKPOINT_KEEP_BYTES:
        shutil.copy(path, cell_dir / path.name)
        return path.name
    from apg.checkpoint import load_checkpoint, save_checkpoint

    config, state = load_checkpoint(path)
    save_checkpoint(cell_dir / GENERATIVE_ONLY, config, {"model": state["model"]})
    return GENERATIVE_ONLY


def record(
    name: str,
    base: Path,
    directory: Path | None = None,
    fresh: bool = False,
    direct: bool = False,
    device: str = "cpu",
    minutes: float | None = None,
    check: bool = False,
    stages: str = "all",
    deadline_minutes: float | None = None,
) -> Path:
    """Run profile ``name`` (resuming a stopped run) and keep its results in ``recorded/<name>``;
    ``paper-check`` (or any profile with ``check``) is a check, not results: it prints what
    each cell cost instead.

    ``direct``: the stages in-process on ``device``, no DVC or Ray (``pipeline.direct``), the
    training sized to ``minutes`` when given and cut at ``deadline_minutes`` from now. With
    ``stages="train"`` it stops after training (the sandbox keeps the cells); ``"evaluate"``
    then evaluates that sandbox, possibly on another machine or device, and keeps the run.
    """
    root = project_root()
    if not direct and (minutes is not None or stages != "all" or deadline_minutes is not None):
        raise ValueError("--minutes, --stages and --deadline need --direct (dvc repro runs every stage)")
    if name in STARTS_FROM and not direct:
        raise ValueError(f"profile {name} starts from {STARTS_FROM[name]}'s weights: run it with --direct")
    if stages not in ("all", "train", "evaluate"):
        raise ValueError(f"stages must be all, train or evaluate, got {stages!r}")
    label = f"{name}-check" if check and name != "paper-check" else name
    directory = (directory or root / "runs" / label).resolve()
    if stages == "evaluate":
        marker = directory / SANDBOX_INFO
        if not marker.is_file():
            raise ValueError(
                f"{directory} is not a recorded run's sandbox (no {SANDBOX_INFO}); train it first"
            )
        sandbox, info = directory, json.loads(marker.read_text())
    else:
        sandbox, info = sandbox_for(name, base, directory, fresh or direct, check, direct)
    if direct:
        from pipeline.direct import run_direct

        print(
            f"record {label}: {stages} stages in-process on {device} in {sandbox} (commit {info['commit']})",
            flush=True,
        )
        params = yaml.safe_load((sandbox / "params.yaml").read_text())
        deadline = time.time() + 60 * deadline_minutes if deadline_minutes is not None else None
        starts = starting_weights(name, root) if stages != "evaluate" else None
        if starts is not None:
            cells = {t: {k: c["sha256"] for k, c in by_key.items()} for t, by_key in starts["cells"].items()}
            info["starts_from"] = {"profile": starts["profile"], "commit": starts["commit"], "cells": cells}
            print(
                f"record {label}: every cell starts from {starts['profile']}'s (commit {starts['commit']})",
                flush=True,
            )
        run_direct(
            sandbox,
            device,
            None if check else minutes,
            params["sweep"]["log_every"],
            stages,
            deadline,
            starts["cells"] if starts is not None else None,
        )
        key = "eval_device" if stages == "evaluate" else "device"
        info = {**info, key: _device_name(device)}
        if stages == "all":
            info["eval_device"] = info["device"]
        info["params_sha"] = _digest(yaml.safe_load((sandbox / "params.yaml").read_text()))
        (sandbox / SANDBOX_INFO).write_text(json.dumps(info, indent=2) + "\n")
        wall = sum(stage_times(sandbox).values())
        if stages == "train":
            print(
                f"record {label}: trained; evaluate with `apg-pipeline record {name} --direct --stages evaluate --dir {sandbox}`"
            )
            return sandbox
    else:
        print(f"record {label}: dvc repro in {sandbox} (commit {info['commit']})", flush=True)
        wall = run_profile(sandbox)
    if name == "paper-check" or check:
        text = check_summary(sandbox, wall)
        (sandbox / "summary.md").write_text(text + "\n")
        print(text)
        return sandbox
    dest = collect(sandbox, info, root / RECORDED / name, wall)
    print(
        f"record {name}: done in {wall / 60:.1f} min; kept in {dest} (commit it; `dvc repro report` shows it)"
    )
    return dest


def _device_name(device: str) -> str:
    import torch

    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"cpu (torch {torch.__version__})"


def check_summary(sandbox: Path, wall: float) -> str:
    """Per task: the data on disk; per cell: seconds per training step (the last step's,
    after first-call costs) and where the stages' time went."""
    import pandas as pd

    params = yaml.safe_load((sandbox / "params.yaml").read_text())
    lines = [
        f"paper-check: every stage in {wall / 60:.1f} min at the paper's per-step sizes "
        f"({CHECK_ITERATIONS} training steps per cell).",
        "",
        "| task | data on disk (MB) | cell | s/step (last step) |",
        "| --- | ---: | --- | ---: |",
    ]
    for task in params["tasks"]:
        size = sum(f.stat().st_size for f in (sandbox / "data" / task).rglob("*") if f.is_file()) / 1e6
        sweep = json.loads((sandbox / "results" / task / "sweep.json").read_text())
        for cell in sweep["cells"]:
            path = sandbox / cell["history"] if cell.get("history") else None
            history = pd.read_csv(path) if path is not None and path.stat().st_size else None
            rate = history["it_per_s"].iloc[-1] if history is not None and len(history) else None
            per_step = f"{1 / rate:.3g}" if rate else "nothing to train"
            lines.append(f"| {task} | {size:.1f} | {cell['name']} | {per_step} |")
    times = stage_times(sandbox)
    lines += ["", "| stage | minutes |", "| --- | ---: |"]
    lines += [f"| `{k}` | {v / 60:.1f} |" for k, v in times.items()]
    return "\n".join(lines)


def recorded_runs(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every recorded run under ``root/recorded`` with its manifest, by name."""
    base = root / RECORDED
    return (
        [(p.parent, json.loads(p.read_text())) for p in sorted(base.glob(f"*/{MANIFEST}"))]
        if base.is_dir()
        else []
    )
