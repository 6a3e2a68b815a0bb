"""Pipeline features that tasks beyond the GMM need: several held-out sets per task with
their own sizes and proposal-network overrides, compact frame storage, reproducible data
files, reconstructions in the samples, and Figure 4 (MSE versus sweeps per (T, D) set).

The slow test runs ``dvc repro`` on a tiny Bouncing MNIST configuration; it needs the MNIST
IDX files (``APG_MNIST_DIR``, else ``../shared/data/mnist``) and is skipped without them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math

import numpy as np
import pandas as pd
import pytest

from apg.loading import with_network
from pipeline.config.params import ParamsError, evaluation_sets, validate_params
from pipeline.generate import generate
from tests.pipeline.harness import TINY, make_repo, run
from tests.support import MNIST_DIR, needs_mnist


def bmnist_section(sets: list[tuple[int, int]]) -> dict:
    """A tiny Bouncing MNIST section: 2-frame training videos of 1 digit, a few seconds of training."""
    return {
        "model": {},
        "network": {"num_digits": 1},
        "data": {
            "x_dtype": "float16",
            "train": {
                "num_datasets": 6,
                "seed": 21,
                "sizes": {"num_frames": 2, "num_digits": 1, "split": "train"},
            },
            "tests": [
                {
                    "name": f"T{t}_D{d}",
                    "num_datasets": 2,
                    "seed": 30 + i,
                    "sizes": {"num_frames": t, "num_digits": d, "split": "test"},
                    "network": {"num_digits": d},
                }
                for i, (t, d) in enumerate(sets)
            ],
            "figures": [
                {
                    "num_datasets": 1,
                    "seed": 40,
                    "sizes": {"num_frames": 3, "num_digits": 2, "split": "test"},
                    "network": {"num_digits": 2},
                }
            ],
        },
        "train": {
            "batch_size": 2,
            "iterations": 4,
            "lr": 0.001,
            "resample_mode": "block",
            "resampler": "systematic",
            "method_options": {"avf": {"iterations": 1}},
        },
        "grid": [{"methods": ["apg", "rws-mlp", "avf"], "pairs": [[2, 2]], "seeds": [0]}],
        "evaluate": {
            "batch_size": 2,
            "resample_mode": "block",
            "seed": 0,
            "pairs": [[3, 2]],
            "baseline": "rws-mlp",
            "figure_sweeps": [1, 2],
            "figure_particles": 2,
        },
    }


# --------------------------------------------------------------------------- fast


def test_single_test_set_keeps_its_file_and_name():
    sets = evaluation_sets(TINY["gmm"])
    assert [(s["name"], s["stem"], s["kind"]) for s in sets] == [
        ("test", "test", "test"),
        ("figure_0", "figure_0", "figure"),
    ]


def test_named_test_sets_and_overrides_are_checked():
    params = copy.deepcopy(TINY)
    params["gmm"]["data"]["tests"] = [
        {"name": "N30", "num_datasets": 2, "seed": 5, "sizes": {"num_points": 30}}
    ]
    validate_params(params)
    assert [s["stem"] for s in evaluation_sets(params["gmm"])] == ["test", "test_N30", "figure_0"]
    for change, expected in (
        ({"name": "test"}, "duplicate test set name"),
        ({"name": "a/b"}, "gmm.data.tests[0].name"),
        ({"network": {"nope": 1}}, "gmm.data.tests[0].network"),
    ):
        bad = copy.deepcopy(params)
        bad["gmm"]["data"]["tests"][0].update(change)
        with pytest.raises(ParamsError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            validate_params(bad)
    bad = copy.deepcopy(params)
    bad["gmm"]["data"]["x_dtype"] = "int8"
    with pytest.raises(ParamsError, match="gmm.data.x_dtype"):
        validate_params(bad)


def test_generate_is_byte_reproducible_and_stores_compact_x(tmp_path):
    params = copy.deepcopy(TINY)
    params["gmm"]["data"]["x_dtype"] = "float16"
    first = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in generate("gmm", params, tmp_path / "a")
    }
    second = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in generate("gmm", params, tmp_path / "b")
    }
    assert first == second and set(first) == {"train.npz", "test.npz", "figure_0.npz"}
    with np.load(tmp_path / "a" / "train.npz") as archive:
        assert archive["x"].dtype == np.float16


def test_network_overrides_load_the_trained_weights():
    from apg.training import TrainConfig, build

    cfg = TrainConfig(
        task="gmm",
        method="apg",
        sweeps=2,
        particles=3,
        network={"hidden": 8},
        batch_size=20,
        iterations=1000,
        lr=1e-4,
    ).validate()
    model, proposals = build(cfg)
    same_cfg, same = with_network(cfg, model, proposals, {"hidden": 8})
    assert same is proposals and same_cfg is cfg
    with pytest.raises(ValueError, match="change the trained weights' shapes"):
        with_network(cfg, model, proposals, {"hidden": 16})


# --------------------------------------------------------------------------- slow


@pytest.mark.slow
@needs_mnist
def test_bmnist_dvc_repro_figure4(tmp_path, monkeypatch):
    monkeypatch.setenv("APG_MNIST_DIR", str(MNIST_DIR))
    sets = [(2, 1), (3, 2)]
    params = copy.deepcopy(TINY)
    params["tasks"] = ["bmnist"]
    del params["gmm"]
    params["bmnist"] = bmnist_section(sets)
    root = make_repo(tmp_path, params)
    out = run(["dvc", "repro"], root)
    for stage in ("generate@bmnist", "sweep@bmnist", "evaluate@bmnist", "report"):
        assert f"Running stage '{stage}'" in out.stdout

    with np.load(root / "data" / "bmnist" / "test_T3_D2.npz") as archive:
        assert archive["x"].shape == (2, 3, 96, 96) and archive["x"].dtype == np.float16
    metrics = pd.read_parquet(root / "results" / "eval" / "bmnist" / "metrics.parquet")
    mse = metrics[metrics["metric"] == "mse"]
    assert sorted(set(mse["test_set"])) == ["T2_D1", "T3_D2"]
    for (name, method), group in mse.groupby(["test_set", "method"]):
        assert group["value"].map(math.isfinite).all(), (name, method)
        assert sorted(set(group["sweep"])) == ([1, 2, 3] if method == "apg" else [1]), (name, method)
        assert json.loads(group["test_sizes"].iloc[0])["num_frames"] == int(name[1])
    meta = json.loads((root / "results" / "eval" / "bmnist" / "meta.json").read_text())
    assert [s["name"] for s in meta["test_sets"]] == ["T2_D1", "T3_D2"]
    assert meta["test_sets"][1]["network"] == {"num_digits": 2}

    assert sorted(set(mse["method"])) == ["apg", "avf", "rws-mlp"]
    evals = metrics[(metrics["metric"] == "model_evals") & (metrics["test_set"] == "T2_D1")]
    # compute per video at (K, L) = (3, 2): APG L (1 + 4 (k - 1)), RWS K L, AVF K L (1 + 4 n) with n = 1
    assert sorted(evals[evals["method"] == "apg"]["value"].unique()) == [2.0, 10.0, 18.0]
    assert evals[evals["method"] == "rws-mlp"]["value"].unique().tolist() == [6.0]
    assert evals[evals["method"] == "avf"]["value"].unique().tolist() == [30.0]
    for metric in ("log_joint", "ess", "log_evidence_is"):
        values = metrics[(metrics["metric"] == metric) & (metrics["method"] == "avf")]["value"]
        assert len(values) and values.map(math.isfinite).all(), metric

    reports = root / "reports"
    for name in (
        "figures/bmnist_mse.png",
        "figures/bmnist_samples.png",
        "figures/bmnist_samples.gif",
        "figures/bmnist_compute.png",
        "tables/bmnist_mse.csv",
        "tables/bmnist_table1.md",
    ):
        assert (reports / name).is_file(), name
    table = pd.read_csv(reports / "tables" / "bmnist_mse.csv")
    assert sorted(set(table["test_set"])) == ["T2_D1", "T3_D2"]
    assert table["mean"].map(math.isfinite).all()
    readme = (reports / "README.md").read_text()
    assert "Figure 4" in readme and "tiny test" in readme and "versus compute" in readme
    table1 = pd.read_csv(reports / "tables" / "bmnist_table1.csv")
    # one averaged column for the per-frame blocks, whatever T is
    assert "ess_where_t" in table1 and not any(c.startswith("ess_where_1") for c in table1)
    headline = json.loads((reports / "data" / "metrics-full.json").read_text())["bmnist"]
    assert math.isfinite(headline["apg/K3/L2"]["mse_T3_D2"])

    # tracking against the simulator's positions: every method, every set, every sweep
    err = metrics[metrics["metric"] == "pos_err"]
    tracked = metrics[metrics["metric"] == "tracked"]
    assert sorted(set(err["method"])) == ["apg", "avf", "rws-mlp"]
    assert sorted(set(err["test_set"])) == ["T2_D1", "T3_D2"]
    assert (err["value"] >= 0).all() and tracked["value"].between(0, 1).all()
    assert sorted(set(err[err["method"] == "apg"]["sweep"])) == [1, 2, 3]
    tracking = pd.read_csv(reports / "tables" / "bmnist_tracking.csv")
    assert sorted(set(tracking["test_set"])) == ["T2_D1", "T3_D2"]
    assert tracking["mean_pos_err"].map(math.isfinite).all()
    for column in (
        "mean_box_err",
        "mean_pos_err_aligned",
        "mean_tracked",
        "mean_pos_err_frame",
        "mean_swapped",
    ):
        assert tracking[column].map(math.isfinite).all(), column
    # a frame matched on its own is matched at least as well as by the video's matching
    assert (tracking["mean_pos_err_frame"] <= tracking["mean_pos_err"] + 1e-9).all()
    assert "boxes' error (px)" in readme and "frames with traded digits" in readme
    for name in ("figures/bmnist_pos_err.png", "figures/bmnist_tracked.png"):
        assert (reports / name).is_file(), name
    assert "Tracking against the simulator's positions" in readme
    assert math.isfinite(headline["apg/K3/L2"]["pos_err_T3_D2"])
    samples = np.load(root / "results" / "eval" / "bmnist" / "samples.npz")
    assert any(k.startswith("truth__") and k.endswith("__z_where") for k in samples.files)


def test_video_files_load_without_mnist(tmp_path, monkeypatch):
    # Evaluating a trained Bouncing MNIST model reads videos from files; only simulating
    # new ones needs the MNIST digits, so a file that fits must load without them.
    from apg.data import DatasetError
    from apg.loading import load_task_data

    monkeypatch.setenv("APG_MNIST_DIR", str(tmp_path / "no-mnist-here"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.cache/apg/mnist either
    videos = tmp_path / "videos.npz"
    np.savez(videos, x=np.random.default_rng(0).random((2, 3, 96, 96), dtype=np.float32))
    assert tuple(load_task_data("bmnist", videos).shape) == (2, 3, 96, 96)

    frames = tmp_path / "frames.npz"
    np.savez(frames, x=np.zeros((2, 96, 96), dtype=np.float32))
    with pytest.raises(DatasetError, match=r"must be shaped like \(M, T, H, W\)"):
        load_task_data("bmnist", frames)
