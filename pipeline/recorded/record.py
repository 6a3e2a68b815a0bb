"""``apg-pipeline record``: the pipeline at another scale, run once, kept in git.

The reproduction (``params.yaml``) is retrained from scratch by every ``dvc repro``; a run
at the paper's scale takes hours and is not. A *profile* is an overlay of ``params.yaml``
under ``profiles/`` (:mod:`pipeline.config.profiles`), most of them of ``profiles/paper.yaml``
(which tasks, which grid cells, how many trials at once: never the per-step sizes B, N, T,
D, K, L, and the networks only where a profile's name and report say so:
``paper-gmm-std``). ``record`` runs the whole pipeline on it
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
    apg-pipeline record replicate --tasks gmm   # re-record one task; the others stay as recorded

``--tasks`` re-records some tasks of a recorded run after their params changed, when the
run's sandbox is gone: a new sandbox runs those tasks' stages alone, starting from the
recorded run's finished cells that the grid still names (so only changed cells train), and
the tasks' results replace theirs in ``recorded/<profile>``; the manifest names the commit
of each re-recorded task (``rerecorded``).

On one GPU machine with PyTorch alone (no Ray, MLflow or DVC), ``--direct`` runs the same
stages in-process (``pipeline.recorded.direct``) and ``--minutes`` sizes the training to the clock;
``--check`` first runs the profile's check variant (``profiles/check/<profile>.yaml``:
``paper-check``'s caps, a few steps, one batch per set) to fail fast on a new machine:

    apg-pipeline record gpu-bmnist --direct --device cuda --minutes 5
    apg-pipeline record gpu-bmnist-3d --direct --device cuda --minutes 7   # then on three digits
    apg-pipeline record gpu-bmnist-compiled --direct --device cuda --minutes 5   # more steps, compiled
    apg-pipeline record gpu-gmm --direct --device cuda   # GMM Table 1 compiled, 4 trials at once
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from pipeline.common import project_root
from pipeline.config import checks
from pipeline.config.params import cell_key
from pipeline.evaluate.stage import ANIMATION
from pipeline.provenance import record as provenance
from pipeline.provenance.stages import code_digest, package_root, source_commit, stage_times
from pipeline.recorded.files import EVAL_FILES, GENERATIVE_ONLY, MANIFEST, RECORDED, compress_samples
from pipeline.smoke import make_sandbox, refresh_code, sandbox_env

SANDBOX_INFO = "record.json"
# The check profile: with --check it is itself (it has no check variant of its own).
CHECK_PROFILE = "paper-check"
# The training steps of paper-check and of every check variant (profiles/check/): enough
# to run every code path (training, logging, the final checkpoint). Its summary says so.
CHECK_ITERATIONS = 3

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
    manifest = checks.read_json(run / MANIFEST)
    cells: dict[str, dict[str, dict[str, str]]] = {}
    for task in manifest["cells"]:
        sweep = checks.read_json(run / "eval" / task / "sweep.json")
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


def derive(name: str, check: bool = False, under: str | Path | None = None) -> dict[str, Any]:
    """Profile ``name``'s params (``check``: its check variant, ``paper-check``'s caps).

    ``under``: a params file or profile that takes the place of what ``name`` extends (the
    tests run ``paper-gmm`` on the smoke profile's sizes)."""
    # Imported here: the report stage imports this module for the recorded runs alone.
    from pipeline.config import profiles

    below = profiles.load(under) if under is not None else None
    return profiles.resolve(name, check and name != CHECK_PROFILE, below)


def base_name(name: str, under: str | Path | None = None) -> str:
    """What profile ``name`` was laid over, as the manifest names it."""
    from pipeline.config import profiles

    return profiles.extends(name) if under is None else Path(under).name


def sandbox_for(
    name: str,
    under: str | Path | None,
    directory: Path,
    fresh: bool,
    check: bool = False,
    direct: bool = False,
    tasks: list[str] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The profile's sandbox repo: made anew, or the one a stopped run left, resumed only
    under the same params. Resumed under other code, the sandbox takes this code's copy and
    its finished cells are kept only where their numerics fingerprint still matches
    (``pipeline.sweep.stage.plan``); the earlier commits are listed in ``commits``. ``tasks``:
    those of the profile's tasks alone (``--tasks``)."""
    from pipeline.config.profiles import params_file

    code = package_root()
    params = derive(name, check, under)
    if tasks:
        params = {**params, "tasks": tasks}
    info = {
        "profile": name,
        "base": base_name(name, under),
        # A copy of the code whose git history is absent or stale (a remote GPU machine's copy of
        # the working tree) names its commit in APG_COMMIT.
        "commit": source_commit(code),
        "code_digest": {t: code_digest("sweep", t, code) for t in params["tasks"]},
        "params_sha": _digest(params),
    }
    marker = directory / SANDBOX_INFO
    if directory.exists() and not fresh:
        if not marker.is_file():
            raise ValueError(
                f"{directory} exists and is not a recorded run's sandbox; remove it or pass --fresh"
            )
        old = checks.read_json(marker)
        if old["params_sha"] != info["params_sha"]:
            raise ValueError(
                f"{directory} was started with other params (commit {old['commit'][:10]}); "
                "pass --fresh to start over"
            )
        commits = old.get("commits", [old["commit"]])
        if old["code_digest"] != info["code_digest"]:
            refresh_code(directory)
            commits = [*commits, info["commit"]] if commits[-1] != info["commit"] else commits
        info = {**old, **info, "started": old["started"], "commits": commits}
        info["resumed"] = old.get("resumed", 0) + 1
    else:
        with params_file(params) as path:
            make_sandbox(directory, path, init_repo=not direct)
        info["started"] = provenance.utc_now()
    marker.write_text(json.dumps(info, indent=2) + "\n")
    return directory, info


# What a sweep reads back from a finished cell's done.json, all in the recorded summary.
DONE_KEYS = ("cell_id", "name", "fingerprint", "iterations", "mean_it_per_s", "final", "checkpoint_sha256")


def restore_cells(sandbox: Path, run: Path, root: Path) -> dict[str, int]:
    """Put recorded run ``run``'s finished cells of the sandbox's tasks back into the
    sandbox's sweep storage, each as its sweep left it (``model.pt``, ``history.csv`` and a
    ``done.json`` made from the recorded summary), so that its sweep trains only the cells
    whose id the recorded run lacks. A cell kept without its proposals (``generative.pt``)
    cannot be resumed and is left out. Returns per task how many cells were restored."""
    from pipeline.common import file_digest
    from pipeline.runs.loop import DONE, HISTORY, MODEL

    params = yaml.safe_load((sandbox / "params.yaml").read_text())
    storage = sandbox / params["sweep"]["storage"]
    restored = {}
    for task in params["tasks"]:
        summary = run / "eval" / task / "sweep.json"
        if not summary.is_file():
            raise ValueError(f"{run} has no results for task {task} to start from")
        restored[task] = 0
        for cell in checks.read_json(summary)["cells"]:
            checkpoint = root / cell["checkpoint"]
            if checkpoint.name != MODEL or file_digest(checkpoint) != cell["checkpoint_sha256"]:
                continue
            cell_dir = storage / task / "cells" / cell["cell_id"]
            cell_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(checkpoint, cell_dir / MODEL)
            shutil.copy(root / cell["history"], cell_dir / HISTORY)
            done = {k: cell.get(k) for k in DONE_KEYS}
            (cell_dir / DONE).write_text(json.dumps({**done, "restored_from": run.name}, indent=2) + "\n")
            restored[task] += 1
    return restored


def _digest(params: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]


def run_profile(sandbox: Path) -> float:
    start = time.monotonic()
    proc = subprocess.run(["dvc", "repro", "-q"], cwd=sandbox, env=sandbox_env())  # as smoke's
    if proc.returncode != 0:
        raise SystemExit(
            f"apg-pipeline: error: dvc repro failed in {sandbox} (exit {proc.returncode}); "
            "run the same command again to resume"
        )
    return time.monotonic() - start


def collect(
    sandbox: Path,
    info: dict[str, Any],
    dest: Path,
    wall_seconds: float,
    whole: dict[str, Any] | None = None,
) -> Path:
    """Copy the report's inputs, each cell's summary and weights, and a manifest.

    ``whole``: the profile's params when the sandbox ran some of its tasks (``--tasks``):
    those tasks' results replace theirs in ``dest`` and the rest stay as recorded."""
    params = yaml.safe_load((sandbox / "params.yaml").read_text())
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if whole is None:
        tmp.mkdir(parents=True)
    else:
        shutil.copytree(dest, tmp)
        for task in params["tasks"]:
            for part in ("eval", "cells"):
                shutil.rmtree(tmp / part / task, ignore_errors=True)
    cells = {}
    for task in params["tasks"]:
        for name in (*EVAL_FILES, ANIMATION):
            source, target = sandbox / "results" / "eval" / task / name, tmp / "eval" / task / name
            if name == ANIMATION and not source.is_file():  # a task without frames
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            (compress_samples if name == "samples.npz" else shutil.copy)(source, target)
        sweep = checks.read_json(sandbox / "results" / task / "sweep.json")
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
        meta = checks.read_json(meta_path)
        for cell in meta["cells"]:
            cell["checkpoint"] = kept.get(cell["cell_id"], cell["checkpoint"])
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        cells[task] = len(sweep["cells"])
    if whole is None:
        shutil.copy(sandbox / "params.yaml", tmp / "params.yaml")
    manifest = {
        **info,
        "finished": provenance.utc_now(),
        "wall_minutes_last_run": round(wall_seconds / 60, 1),
        "stage_minutes": {k: round(v / 60, 1) for k, v in stage_times(sandbox).items()},
        "scale": params["report"]["scale"],
        "cells": cells,
        "machine": f"trained on {info['device']}, evaluated on {info.get('eval_device', info['device'])}; "
        "in-process (pipeline.recorded.direct)"
        if info.get("device")
        else f"{provenance.machine_line(provenance.machine())}; torch threads per trial "
        f"{params['sweep']['torch_threads']}",
    }
    if whole is not None:
        manifest = merged_manifest(checks.read_json(dest / MANIFEST), manifest, whole, params["tasks"])
        from pipeline.config.profiles import params_file

        with params_file(whole) as path:
            shutil.copy(path, tmp / "params.yaml")
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def merged_manifest(
    old: dict[str, Any], new: dict[str, Any], whole: dict[str, Any], tasks: list[str]
) -> dict[str, Any]:
    """A recorded run's manifest after ``tasks`` were re-recorded (``new``: the sandbox's):
    the first commit and start stay, each re-recorded task names its commit, finish and
    machine under ``rerecorded``, and the per-task entries are the new ones."""
    stages = {k: v for k, v in old["stage_minutes"].items() if k.split("@")[-1] not in tasks}
    stages.update({k: v for k, v in new["stage_minutes"].items() if k.split("@")[-1] in tasks})
    again = {
        t: {"commit": new["commit"], "finished": new["finished"], "machine": new["machine"]} for t in tasks
    }
    commits = old.get("commits", [old["commit"]])
    return {
        **old,
        "commits": commits + ([new["commit"]] if commits[-1] != new["commit"] else []),
        "code_digest": {**old["code_digest"], **new["code_digest"]},
        "params_sha": _digest(whole),
        "stage_minutes": stages,
        "cells": {**old["cells"], **new["cells"]},
        "rerecorded": {**old.get("rerecorded", {}), **again},
    }


# Trained weights kept whole up to this size; a larger checkpoint (Bouncing MNIST's
# proposals: ~18 MB) keeps the generative model's weights alone, which is what the report
# draws with (its GIF), and leaves the proposals out of git.
CHECKPOINT_KEEP_BYTES = 4 * 2**20


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
    under: str | Path | None = None,
    directory: Path | None = None,
    fresh: bool = False,
    direct: bool = False,
    device: str = "cpu",
    minutes: float | None = None,
    check: bool = False,
    stages: str = "all",
    deadline_minutes: float | None = None,
    tasks: list[str] | None = None,
) -> Path:
    """Run profile ``name`` (resuming a stopped run) and keep its results in ``recorded/<name>``;
    ``paper-check`` (or any profile with ``check``) is a check, not results: it prints what
    each cell cost instead. ``under``: params (a file or a profile's name) laid under the
    profile's overlay in place of what it extends (``--params``).

    ``direct``: the stages in-process on ``device``, no DVC or Ray (``pipeline.recorded.direct``), the
    training sized to ``minutes`` when given and cut at ``deadline_minutes`` from now. With
    ``stages="train"`` it stops after training (the sandbox keeps the cells); ``"evaluate"``
    then evaluates that sandbox, possibly on another machine or device, and keeps the run.

    ``tasks``: re-record these tasks of the recorded run alone, from its finished cells
    (``restore_cells``); its other tasks stay as recorded.
    """
    root = project_root()
    _check_record_options(name, direct, minutes, stages, deadline_minutes, device)
    whole = _check_tasks(name, tasks, under, check, direct, root) if tasks else None
    label = f"{name}-check" if check and name != CHECK_PROFILE else name
    directory = (directory or root / "runs" / label).resolve()
    if stages == "evaluate":
        marker = directory / SANDBOX_INFO
        if not marker.is_file():
            raise ValueError(
                f"{directory} is not a recorded run's sandbox (no {SANDBOX_INFO}); train it first"
            )
        sandbox, info = directory, checks.read_json(marker)
    else:
        made = fresh or direct or not (directory / SANDBOX_INFO).is_file()
        sandbox, info = sandbox_for(name, under, directory, fresh or direct, check, direct, tasks)
        if tasks and made:
            restored = restore_cells(sandbox, root / RECORDED / name, root)
            print(
                f"record {label}: finished cells put back from recorded/{name}: {restored} "
                "(the sweep keeps those whose id its grid still gives)",
                flush=True,
            )
    if direct:
        info, wall = _record_direct(
            name, label, sandbox, info, root, device, None if check else minutes, stages, deadline_minutes
        )
        if stages == "train":
            print(
                f"record {label}: trained; evaluate with `apg-pipeline record {name} --direct --stages evaluate --dir {sandbox}`"
            )
            return sandbox
    else:
        print(f"record {label}: dvc repro in {sandbox} (commit {info['commit']})", flush=True)
        wall = run_profile(sandbox)
    if name == CHECK_PROFILE or check:
        text = check_summary(sandbox, wall)
        (sandbox / "summary.md").write_text(text + "\n")
        print(text)
        return sandbox
    dest = collect(sandbox, info, root / RECORDED / name, wall, whole)
    print(
        f"record {name}: done in {wall / 60:.1f} min; kept in {dest} (commit it; `dvc repro report` shows it)"
    )
    return dest


def _check_record_options(
    name: str,
    direct: bool,
    minutes: float | None,
    stages: str,
    deadline_minutes: float | None,
    device: str = "cpu",
) -> None:
    """``record``'s options that only ``--direct`` takes, the stages it knows, durations
    finite and positive, a device this machine has."""
    checks.minutes(minutes, "--minutes")
    checks.minutes(deadline_minutes, "--deadline")
    checks.device(device)
    if not direct and (minutes is not None or stages != "all" or deadline_minutes is not None):
        raise ValueError("--minutes, --stages and --deadline need --direct (dvc repro runs every stage)")
    if name in STARTS_FROM and not direct:
        raise ValueError(f"profile {name} starts from {STARTS_FROM[name]}'s weights: run it with --direct")
    if stages not in ("all", "train", "evaluate"):
        raise ValueError(f"stages must be all, train or evaluate, got {stages!r}")


def _check_tasks(
    name: str, tasks: list[str], under: str | Path | None, check: bool, direct: bool, root: Path
) -> dict[str, Any]:
    """``--tasks``'s conditions; returns the profile's whole params (the recorded run's)."""
    if direct or check or name == CHECK_PROFILE:
        raise ValueError(
            "--tasks re-records a recorded run's tasks with dvc repro: not with --direct or --check"
        )
    if not (root / RECORDED / name / MANIFEST).is_file():
        raise ValueError(f"--tasks re-records some tasks of recorded/{name}, which has no {MANIFEST}")
    whole = derive(name, False, under)
    unknown = [t for t in tasks if t not in whole["tasks"]]
    if unknown:
        raise ValueError(f"--tasks: {', '.join(unknown)} not among profile {name}'s tasks {whole['tasks']}")
    return whole


def _record_direct(
    name: str,
    label: str,
    sandbox: Path,
    info: dict[str, Any],
    root: Path,
    device: str,
    minutes: float | None,
    stages: str,
    deadline_minutes: float | None,
) -> tuple[dict[str, Any], float]:
    """``record --direct``: the stages in-process on ``device`` (``pipeline.recorded.direct``), the
    training sized to ``minutes`` when given; the sandbox's updated info (written to it) and
    the stages' wall seconds."""
    from pipeline.recorded.direct import run_direct

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
        minutes,
        params["sweep"]["log_every"],
        stages,
        deadline,
        starts["cells"] if starts is not None else None,
    )
    key = "eval_device" if stages == "evaluate" else "device"
    info = {**info, key: provenance.device_line(device)}
    if stages == "all":
        info["eval_device"] = info["device"]
    info["params_sha"] = _digest(yaml.safe_load((sandbox / "params.yaml").read_text()))
    (sandbox / SANDBOX_INFO).write_text(json.dumps(info, indent=2) + "\n")
    wall = sum(stage_times(sandbox).values())
    return info, wall


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
        sweep = checks.read_json(sandbox / "results" / task / "sweep.json")
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
