"""``apg-pipeline record --direct``: a recorded run's stages without Ray, MLflow or DVC
(``pipeline.recorded.direct``), training sized to the clock, cut at a deadline, split between
machines, and what the kept run holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from apg.checkpoint import load_checkpoint, save_checkpoint
from apg.training import TrainConfig, Trainer, build
from pipeline.common import seed_everything
from pipeline.provenance import record as provenance
from pipeline.recorded import direct
from pipeline.recorded import record as recorded

SMOKE = "smoke"  # the profile laid under paper-gmm in place of the paper's sizes


def gmm_job(tmp_path: Path, iterations: int, deadline: float | None) -> dict:
    import numpy as np

    from apg.data import save_dataset
    from apg.tasks.simulation import simulate_set

    data = tmp_path / "train.npz"
    arrays = simulate_set("gmm", {}, 20, 1, {"num_points": 20})
    save_dataset(data, {"x": arrays["x"].astype(np.float32)})
    cfg = TrainConfig(
        task="gmm",
        method="apg",
        sweeps=2,
        particles=3,
        batch_size=4,
        iterations=iterations,
        network={"hidden": 8},
        lr=1e-4,
    )
    return {
        "cell_id": "c1",
        "name": "gmm/apg",
        "config_key": "k",
        "fingerprint": "d",
        "train": cfg.to_dict(),
        "seed": 0,
        "data": str(data),
        "cell_dir": str(tmp_path / "cell"),
        "device": "cpu",
        "log_every": 5,
        "deadline": deadline,
        "calibrate": False,
    }


def test_a_cell_trains_its_iterations_and_writes_what_a_sweep_trial_writes(tmp_path):
    job = gmm_job(tmp_path, 12, None)
    assert direct.train_one(job)["seconds_per_step"] > 0
    done = json.loads((tmp_path / "cell" / "done.json").read_text())
    assert done["iterations"] == 12 and done["stopped_at_deadline"] is None and done["device"] == "cpu"
    history = (tmp_path / "cell" / "history.csv").read_text().splitlines()
    assert [int(row.split(",")[0]) for row in history[1:]] == [5, 10, 12]  # every log_every, and the last
    config, state = load_checkpoint(tmp_path / "cell" / "model.pt")
    assert config["iterations"] == 12 and {"model", "proposals"} <= set(state)


def test_a_cell_past_its_deadline_stops_and_says_so(tmp_path):
    job = gmm_job(tmp_path, 1000, time.time() - 1)
    direct.train_one(job)
    done = json.loads((tmp_path / "cell" / "done.json").read_text())
    assert done["iterations"] == 1
    assert done["stopped_at_deadline"] == {"planned_iterations": 1000}
    assert len((tmp_path / "cell" / "history.csv").read_text().splitlines()) == 2  # header + the step it took


def saved_weights(path: Path, seed: int) -> tuple[Path, dict]:
    """A checkpoint of gmm_job's networks drawn afresh under ``seed``."""
    cfg = TrainConfig(
        task="gmm",
        method="apg",
        network={"hidden": 8},
        sweeps=10,
        particles=10,
        batch_size=20,
        iterations=1000,
        lr=1e-4,
    )
    seed_everything(seed)
    model, proposals = build(cfg)
    state = {"model": model.state_dict(), "proposals": proposals.state_dict(), "iteration": 9}
    return save_checkpoint(path, cfg.to_dict(), state), state


def test_a_cell_started_from_a_checkpoint_starts_from_its_weights(tmp_path):
    from pipeline.common import file_digest

    init, state = saved_weights(tmp_path / "init.pt", seed=5)
    job = {**gmm_job(tmp_path, 0, None), "init": {"path": str(init), "sha256": file_digest(init)}}
    direct.train_one(job)  # no steps: what it saves is what it started from
    _, saved = load_checkpoint(tmp_path / "cell" / "model.pt")
    for part in ("model", "proposals"):
        assert saved[part].keys() == state[part].keys()
        for key, value in state[part].items():
            assert torch.equal(saved[part][key], value), (part, key)
    done = json.loads((tmp_path / "cell" / "done.json").read_text())
    assert done["started_from"] == {"checkpoint_sha256": file_digest(init)}
    (tmp_path / "fresh").mkdir()
    fresh = gmm_job(tmp_path / "fresh", 0, None)  # the same job from scratch: other weights
    direct.train_one(fresh)
    _, scratch = load_checkpoint(tmp_path / "fresh" / "cell" / "model.pt")
    assert not all(torch.equal(scratch["proposals"][k], v) for k, v in state["proposals"].items())
    assert json.loads((tmp_path / "fresh" / "cell" / "done.json").read_text())["started_from"] is None


def test_a_cell_refuses_a_starting_checkpoint_that_is_not_the_named_one(tmp_path):
    init, _ = saved_weights(tmp_path / "init.pt", seed=5)
    job = {**gmm_job(tmp_path, 0, None), "init": {"path": str(init), "sha256": "0" * 64}}
    with pytest.raises(ValueError, match="is not the checkpoint 000000000000"):
        direct.train_one(job)
    assert not (tmp_path / "cell").exists()


def fake_recorded_run(root: Path, checkpoint: Path, sha256: str) -> None:
    """``recorded/base``: one gmm apg cell whose full checkpoint sits in ``runs/base``."""
    run = root / "recorded" / "base"
    (run / "eval" / "gmm").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"commit": "abc1234", "cells": {"gmm": 1}}))
    cell = {"cell_id": "apg-c1", "method": "apg", "K": 2, "L": 3, "seed": 0, "checkpoint_sha256": sha256}
    (run / "eval" / "gmm" / "sweep.json").write_text(json.dumps({"task": "gmm", "cells": [cell]}))
    kept = root / "runs" / "base" / "results" / "sweeps" / "gmm" / "cells" / "apg-c1"
    kept.mkdir(parents=True)
    (kept / "model.pt").write_bytes(checkpoint.read_bytes())


def test_a_curriculum_step_finds_the_earlier_runs_checkpoints_by_their_recorded_sha256(tmp_path, monkeypatch):
    from pipeline.common import file_digest

    init, _ = saved_weights(tmp_path / "init.pt", seed=5)
    monkeypatch.setitem(recorded.STARTS_FROM, "later", "base")
    assert recorded.starting_weights("paper-gmm", tmp_path) is None  # not a later step: from scratch
    with pytest.raises(ValueError, match="starts from the recorded run base"):
        recorded.starting_weights("later", tmp_path)
    fake_recorded_run(tmp_path, init, file_digest(init))
    starts = recorded.starting_weights("later", tmp_path)
    assert starts["profile"] == "base" and starts["commit"] == "abc1234"
    found = starts["cells"]["gmm"][recorded.cell_key("apg", 2, 3, 0)]
    assert Path(found["path"]).read_bytes() == init.read_bytes() and found["sha256"] == file_digest(init)

    class Cell:  # what pipeline.sweep.stage.plan gives per cell
        name, seed = "gmm/apg", 0
        train = TrainConfig(
            task="gmm", method="apg", sweeps=2, particles=3, batch_size=20, iterations=1000, lr=1e-4
        )

    assert direct._starting_checkpoints({"c": Cell()}, starts["cells"], "gmm") == {"c": found}
    Cell.train = TrainConfig(
        task="gmm", method="rws-mlp", sweeps=2, particles=3, batch_size=20, iterations=1000, lr=1e-4
    )
    with pytest.raises(ValueError, match="gmm/apg has no trained cell to start from"):
        direct._starting_checkpoints({"c": Cell()}, starts["cells"], "gmm")
    kept = tmp_path / "runs" / "base" / "results" / "sweeps" / "gmm" / "cells" / "apg-c1" / "model.pt"
    kept.write_bytes(init.read_bytes() + b"x")  # another file in its place: not the recorded one
    with pytest.raises(ValueError, match="run `apg-pipeline record base` first"):
        recorded.starting_weights("later", tmp_path)


def test_calibration_times_steps_without_writing_a_cell(tmp_path):
    job = {**gmm_job(tmp_path, 1000, None), "calibrate": True}
    assert direct.train_one(job)["seconds_per_step"] > 0
    assert not (tmp_path / "cell").exists()


def test_calibration_plans_by_the_median_step_not_a_slow_first_one(tmp_path, monkeypatch):
    """A compiled cell's first timed step can still be recording CUDA graphs: one slow step
    among five moves the mean (1.8 s here), not the median (1 s). A fake clock: no wall time."""
    clock, costs = [0.0], iter([0.0, 0.0, 5.0, 1.0, 1.0, 1.0, 1.0])  # two warm-ups, then five

    def step(self, log=True):
        clock[0] += next(costs)

    monkeypatch.setattr(Trainer, "step", step)
    monkeypatch.setattr(direct.time, "perf_counter", lambda: clock[0])
    assert direct.train_one({**gmm_job(tmp_path, 1000, None), "calibrate": True})["seconds_per_step"] == 1.0


def test_set_iterations_leaves_cells_that_train_nothing_alone():
    params = {
        "gmm": {
            "train": {"iterations": 50},
            "grid": [
                {"methods": ["apg"], "train": {"iterations": 7}},
                {"methods": ["gibbs"], "train": {"iterations": 0}},
                {"methods": ["rws-mlp"]},
            ],
        }
    }
    direct.set_iterations(params, "gmm", 300)
    assert params["gmm"]["train"]["iterations"] == 300
    assert [e.get("train", {}).get("iterations") for e in params["gmm"]["grid"]] == [None, 0, None]


def test_a_large_checkpoint_is_kept_as_its_generative_model_alone(tmp_path, monkeypatch):
    cfg = TrainConfig(
        task="gmm",
        method="apg",
        network={"hidden": 8},
        sweeps=10,
        particles=10,
        batch_size=20,
        iterations=1000,
        lr=1e-4,
    )
    seed_everything(0)
    model, proposals = build(cfg)
    path = save_checkpoint(
        tmp_path / "model.pt",
        cfg.to_dict(),
        {"model": model.state_dict(), "proposals": proposals.state_dict()},
    )
    (tmp_path / "kept").mkdir()
    assert recorded.keep_file(path, tmp_path / "kept", "checkpoint") == "model.pt"  # small: kept whole
    monkeypatch.setattr(recorded, "CHECKPOINT_KEEP_BYTES", 0)
    name = recorded.keep_file(path, tmp_path / "kept", "checkpoint")
    assert name == recorded.GENERATIVE_ONLY
    config, state = load_checkpoint(tmp_path / "kept" / name)
    assert config == cfg.to_dict() and set(state) == {"model"}
    for key, value in model.state_dict().items():
        assert torch.equal(state["model"][key], value)


def test_direct_options_need_direct():
    with pytest.raises(ValueError, match="need --direct"):
        recorded.record("paper-gmm", SMOKE, minutes=1.0)
    with pytest.raises(ValueError, match="starts from gpu-bmnist's weights: run it with --direct"):
        recorded.record("gpu-bmnist-3d", directory=Path("/nonexistent/box"))
    with pytest.raises(ValueError, match="stages must be"):
        recorded.record("paper-gmm", SMOKE, direct=True, stages="sweep")


@pytest.mark.slow
def test_direct_record_trains_to_the_clock_on_one_machine_and_evaluates_on_another(tmp_path):
    # paper-gmm derived from the smoke profile, trained in one call and evaluated in another
    # (as a GPU machine trains and the CPU evaluates), with nothing but PyTorch in the way.
    env = {**os.environ, "APG_PROJECT_ROOT": str(tmp_path), "OMP_NUM_THREADS": "1", "APG_COMMIT": "c0ffee1"}
    base = [sys.executable, "-m", "pipeline.cli", "record", "paper-gmm", "--params", SMOKE, "--direct"]
    proc = subprocess.run(
        [*base, "--stages", "train", "--minutes", "0.1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sandbox = tmp_path / "runs" / "paper-gmm"
    params = yaml.safe_load((sandbox / "params.yaml").read_text())
    iterations = params["gmm"]["train"]["iterations"]
    assert iterations > 0 and iterations % params["sweep"]["log_every"] == 0
    sweep = json.loads((sandbox / "results" / "gmm" / "sweep.json").read_text())
    trained = {c["method"]: c["iterations"] for c in sweep["cells"]}
    assert trained == {"apg": iterations, "rws-mlp": iterations, "rws-lstm": iterations, "gibbs": 0}
    assert not (tmp_path / "recorded").exists()  # nothing kept before it is evaluated

    import shutil

    shutil.rmtree(sandbox / "data")  # the other machine has no data: the held-out sets are made again
    proc = subprocess.run(
        [*base, "--stages", "evaluate"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kept = tmp_path / "recorded" / "paper-gmm"
    manifest = json.loads((kept / "manifest.json").read_text())
    assert manifest["commit"] == "c0ffee1"  # named by the caller: a lent machine's git may be stale
    assert manifest["device"] == manifest["eval_device"] == provenance.device_line("cpu")  # the CPU's line
    assert "pipeline.recorded.direct" in manifest["machine"]
    assert set(manifest["stage_minutes"]) == {"generate@gmm", "sweep@gmm", "evaluate@gmm"}
    for name in recorded.EVAL_FILES:
        assert (kept / "eval" / "gmm" / name).is_file(), name
    meta = json.loads((kept / "eval" / "gmm" / "meta.json").read_text())
    assert {c["method"] for c in meta["cells"]} >= {"apg", "rws-mlp", "rws-lstm"}
    for cell in meta["cells"]:  # the report finds each cell's weights in the kept run
        assert (
            cell["checkpoint"].startswith("recorded/paper-gmm/cells/")
            and (tmp_path / cell["checkpoint"]).is_file()
        )
