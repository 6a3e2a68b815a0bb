"""Bad input stops at the edge: every flag and params key is checked where it enters, and
each fault ends with one line ``apg-pipeline: error: ...`` and exit status 2, before torch,
the filesystem or a loop sees it (issue 72's fault probe, case by case)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml

from apg.data import DatasetError, load_dataset
from pipeline.cli import main
from pipeline.config import checks
from pipeline.config.params import ParamsError, load_params
from tests.support import REPO

TRAIN = ["--task", "gmm", "-K", "2", "-L", "3", "--batch-size", "4", "--iterations", "1", "--threads", "1"]


def run_error(argv, capsys, entry=main) -> str:
    """Run ``entry(argv)`` expecting one line on stderr and exit status 2; return the line."""
    with pytest.raises(SystemExit) as exit_info:
        entry(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("apg-pipeline: error: "), err
    return err[0].removeprefix("apg-pipeline: error: ")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny GMM training set and a checkpoint trained on it for one step."""
    root = tmp_path_factory.mktemp("edge")
    main(["generate", "--out", str(root / "train.npz"), "--num-datasets", "6", "--num-points", "10"])
    main(["train", *TRAIN, "--data", str(root / "train.npz"), "--out", str(root / "ckpt.pt")])
    return root


def write_params(path, change) -> str:
    """params.yaml with ``change(params)`` applied, written to ``path``."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    change(params)
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return str(path)


# --------------------------------------------------------------------------- tracebacks


def test_generate_refuses_a_model_key_the_task_does_not_know(tmp_path, capsys):
    line = run_error(
        ["generate", "--out", str(tmp_path / "x.npz"), "--num-datasets", "2", "--model", "nope=1"], capsys
    )
    assert line == "--model: GMMConfig.__init__() got an unexpected keyword argument 'nope'"


@pytest.mark.parametrize(
    "flags", [["--num-datasets", "1000000000000"], ["--num-datasets", "2", "--num-points", "100000000000"]]
)
def test_generate_estimates_the_bytes_first_and_refuses_what_memory_cannot_hold(tmp_path, capsys, flags):
    out = tmp_path / "x.npz"
    line = run_error(["generate", "--out", str(out), *flags], capsys)
    assert "in memory, more than the" in line and "available" in line, line
    assert " TB " in line or " PB " in line, line  # the estimate, before any allocation
    assert not out.exists()


def test_generate_refuses_what_the_disk_cannot_hold(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(checks, "free_disk", lambda folder: 1000)
    line = run_error(["generate", "--out", str(tmp_path / "x.npz"), "--num-datasets", "100"], capsys)
    assert line.endswith(f"on disk, more than the 1.0 kB free under {tmp_path}"), line


def test_train_on_a_cpu_build_refuses_cuda_in_one_line(files, capsys, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    argv = [
        "train",
        *TRAIN,
        "--data",
        str(files / "train.npz"),
        "--out",
        str(files / "x.pt"),
        "--device",
        "cuda",
    ]
    assert run_error(argv, capsys) == "--device cuda: this torch build has no CUDA"


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--device", "tpu9"], "--device tpu9: unknown device (cpu, cuda, cuda:N or mps)"),
        (["--threads", "-2"], "--threads: must be at least 0, got -2"),
        (["--network", "hidden=-4"], "--network.hidden: must be at least 1, got -4"),
        (["--model", "nope=1"], "--model: GMMConfig.__init__() got an unexpected keyword argument 'nope'"),
        (["--model", "nu0=abc"], "--model.nu0: must be a number, got 'abc'"),
        (["--seed", str(2**70)], f"--seed: must be in [-2**63, 2**64 - 1] (torch's seeds), got {2**70}"),
        (["-L", "1000000000000"], "L=1000000000000 particles x 4 datasets shaped (10, 2): at least"),
    ],
)
def test_train_refuses_bad_flags_in_one_line(files, capsys, flags, expected):
    out = files / "never.pt"
    line = run_error(["train", *TRAIN, "--data", str(files / "train.npz"), "--out", str(out), *flags], capsys)
    assert line.startswith(expected), line
    assert not out.exists()


def test_record_direct_refuses_a_device_that_does_not_exist(tmp_path, capsys):
    line = run_error(
        ["record", "paper-gmm", "--direct", "--device", "tpu9", "--dir", str(tmp_path / "s")], capsys
    )
    assert line == "--device tpu9: unknown device (cpu, cuda, cuda:N or mps)"
    assert not (tmp_path / "s").exists()


def test_eval_sweep_blames_a_bad_device_not_the_checkpoint(capsys):
    line = run_error(["eval-sweep", "--task", "gmm", "--device", "tpu9"], capsys)
    assert line == "--device tpu9: unknown device (cpu, cuda, cuda:N or mps)"


def test_the_device_check_says_why_a_named_device_is_missing(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^--device cuda: no cuda device is available on this machine$"):
        checks.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"^--device cuda:3: this machine has 1 cuda device\(s\)$"):
        checks.device("cuda:3")
    assert checks.device("cuda:0") == "cuda:0" and checks.device("cpu") == "cpu"
    with pytest.raises(ValueError, match="not a device this pipeline runs on"):
        checks.device("meta")


# --------------------------------------------------------------------------- silent acceptances


def test_generate_refuses_a_nan_model_hyperparameter(tmp_path, capsys):
    out = tmp_path / "x.npz"
    line = run_error(["generate", "--out", str(out), "--num-datasets", "2", "--model", "nu0=.nan"], capsys)
    assert line == "--model.nu0: must be a finite number, got nan"
    line = run_error(["generate", "--out", str(out), "--num-datasets", "2", "--model", "nu0=-1"], capsys)
    assert line == "gmm: the model {'nu0': -1} simulates NaN or infinite values of 'x'"
    assert not out.exists()


@pytest.mark.parametrize("out", ["../../../tmp/elsewhere", "/tmp/elsewhere", "reports/../../elsewhere"])
def test_params_keep_the_report_inside_the_project(tmp_path, capsys, out):
    def change(params):
        params["report"]["out"] = out

    path = write_params(tmp_path / "p.yaml", change)
    line = run_error(["report", "--params", path], capsys)
    assert line == f"report.out: {out!r} is outside the project; give a path relative to it"


def test_params_sweep_storage_may_be_shared_but_a_relative_one_stays_inside(tmp_path):
    for storage in ("/shared/sweeps", "s3://bucket/sweeps", "results/sweeps"):
        load_params(write_params(tmp_path / "p.yaml", lambda p, s=storage: p["sweep"].update(storage=s)))
    path = write_params(tmp_path / "p.yaml", lambda p: p["sweep"].update(storage="../sweeps"))
    with pytest.raises(ParamsError, match=r"^sweep.storage: '../sweeps' is outside the project"):
        load_params(path)


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            lambda p: p["gmm"]["grid"][0].update(seeds=[2**70]),
            r"^gmm.grid\[0\].seeds\[0\]: must be in \[-2\*\*63",
        ),
        (lambda p: p["gmm"]["data"]["train"].update(seed=2**64), r"^gmm.data.train.seed: must be in"),
        (
            lambda p: p["gmm"].update(model={"nu0": math.nan}),
            r"^gmm.model.nu0: must be a finite number, got nan",
        ),
        (lambda p: p["gmm"]["network"].update(hidden=-4), r"^gmm.network.hidden: must be at least 1, got -4"),
        (
            lambda p: p["gmm"]["data"]["train"]["sizes"].update(num_points=math.inf),
            r"^gmm.data.train.sizes.num_points: must be a finite number, got inf",
        ),
        (
            lambda p: p["gmm"]["data"]["test"]["sizes"].update(points=60),
            r"^gmm.data.test.sizes.points: unknown size of task gmm; known: \['num_points'\]",
        ),
        (lambda p: p["gmm"]["grid"][0].update(seeds=[]), r"^gmm.grid\[0\].seeds: must be a non-empty list"),
    ],
)
def test_params_refuse_values_out_of_range(tmp_path, change, expected):
    with pytest.raises(ParamsError, match=expected):
        load_params(write_params(tmp_path / "p.yaml", change))


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--minutes", "-1"], "--minutes: must be positive, got -1.0"),
        (["--minutes", "0"], "--minutes: must be positive, got 0.0"),
        (["--minutes", "nan"], "--minutes: must be a finite number, got nan"),
        (["--deadline", "nan"], "--deadline: must be a finite number, got nan"),
        (["--deadline", "inf"], "--deadline: must be a finite number, got inf"),
        (["--deadline", "1e308"], "--deadline: must be at most 1e+07, got 1e+308"),
    ],
)
def test_record_refuses_durations_that_are_not_finite_and_positive(tmp_path, capsys, flags, expected):
    line = run_error(["record", "paper-gmm", "--direct", "--dir", str(tmp_path / "s"), *flags], capsys)
    assert line == expected
    assert not (tmp_path / "s").exists()


def test_datasets_of_no_points_or_all_nan_are_refused(files, tmp_path, capsys):
    np.savez(tmp_path / "zero.npz", x=np.zeros((4, 0, 2)))
    np.savez(tmp_path / "nan.npz", x=np.full((4, 10, 2), np.nan))
    with pytest.raises(DatasetError, match=r"'x' shaped \(4, 0, 2\) has datasets of no entries"):
        load_dataset(tmp_path / "zero.npz")
    for name, expected in (
        ("zero", "has datasets of no entries"),
        ("nan", "contains NaN or infinite values"),
    ):
        data = str(tmp_path / f"{name}.npz")
        line = run_error(["train", *TRAIN, "--data", data, "--out", str(tmp_path / "c.pt")], capsys)
        assert expected in line and data in line, line
        argv = [
            "evaluate",
            "--checkpoint",
            str(files / "ckpt.pt"),
            "--data",
            data,
            "--out",
            str(tmp_path / "m.json"),
        ]
        line = run_error(argv, capsys)
        assert expected in line and data in line, line
    assert not (tmp_path / "c.pt").exists() and not (tmp_path / "m.json").exists()


def test_a_file_read_in_batches_is_refused_when_its_first_dataset_is_nan(tmp_path):
    from apg.data import StoredRows
    from apg.loading import check_task_data

    np.savez(tmp_path / "nan.npz", x=np.full((4, 10, 2), np.nan, dtype=np.float32))
    with pytest.raises(DatasetError, match="contains NaN or infinite values"):
        check_task_data("gmm", StoredRows(tmp_path / "nan.npz"), tmp_path / "nan.npz")


# --------------------------------------------------------------------------- hangs


def test_the_generate_stage_refuses_a_set_the_disk_cannot_hold_before_writing(tmp_path, capsys):
    from pipeline.generate import main as generate_main

    path = write_params(tmp_path / "p.yaml", lambda p: p["gmm"]["data"]["train"].update(num_datasets=10**12))
    out = tmp_path / "data"
    line = run_error(["--task", "gmm", "--params", path, "--out", str(out)], capsys, entry=generate_main)
    assert (
        line.startswith("gmm's datasets (train, test, figure_0, figure_1): about ") and "on disk" in line
    ), line
    assert not out.exists()


def test_the_generate_stage_refuses_one_dataset_memory_cannot_hold(tmp_path, capsys, monkeypatch):
    from pipeline.generate import main as generate_main

    monkeypatch.setattr(checks, "available_memory", lambda device="cpu": 10_000)
    path = write_params(
        tmp_path / "p.yaml", lambda p: p["gmm"]["data"]["train"]["sizes"].update(num_points=10**6)
    )
    line = run_error(
        ["--task", "gmm", "--params", path, "--out", str(tmp_path / "data")], capsys, entry=generate_main
    )
    assert line.startswith("one dataset of gmm's train set: about 24.1 MB in memory"), line


def test_the_byte_estimate_matches_a_small_set_and_scales_a_large_one():
    one = checks.dataset_bytes("gmm", {}, {"num_points": 60})
    # x (60, 2) and mu, tau (3, 2) in float64; c (60,) int64
    assert one == {"simulated": 8 * (120 + 6 + 6 + 60), "stored": 8 * (120 + 6 + 6 + 60)}
    assert checks.dataset_bytes("gmm", {}, {"num_points": 60}, np.float16)["stored"] == 2 * 120 + 8 * 72
    big = checks.dataset_bytes("gmm", {}, {"num_points": 10**9})["simulated"]
    assert big >= 8 * 3 * 10**9  # never below what the arrays take


# --------------------------------------------------------------------------- messages


def test_a_binary_params_file_is_named(tmp_path, capsys):
    path = tmp_path / "params.yaml"
    path.write_bytes(bytes(range(128, 256)) * 4)
    line = run_error(["report", "--params", str(path)], capsys)
    assert line.startswith(f"{path} is not a YAML text file"), line


@pytest.mark.parametrize("content", [b"", b"{not json", bytes(range(128, 256))])
def test_every_json_parse_error_names_its_file(tmp_path, content):
    for name in ("run.json", "meta.json", "manifest.json"):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=rf"^{path} is not (valid JSON|UTF-8 text) \("):
            checks.read_json(path)


def test_a_corrupt_history_or_manifest_is_named(tmp_path):
    from pipeline.evaluate.stage import cell_history
    from pipeline.recorded.files import recorded_runs

    cell = {"history": "history.csv", "method": "apg", "K": 2, "L": 3, "seed": 0, "cell_id": "c"}
    for content in (bytes(range(128, 256)) * 8, b"a,b\n1,2,3,4\n5\n", b"x\n1\n"):
        (tmp_path / "history.csv").write_bytes(content)
        with pytest.raises(ValueError, match=rf"^{tmp_path / 'history.csv'} "):
            cell_history(tmp_path, "gmm", cell)
    (tmp_path / "recorded" / "run").mkdir(parents=True)
    (tmp_path / "recorded" / "run" / "manifest.json").write_text('{"cells": ')
    with pytest.raises(ValueError, match=r"manifest.json is not valid JSON"):
        recorded_runs(tmp_path)


def test_a_bad_key_value_flag_is_one_line(tmp_path, capsys):
    line = run_error(
        ["generate", "--out", str(tmp_path / "x.npz"), "--num-datasets", "2", "--model", "nu0=["], capsys
    )
    assert line == "--model 'nu0=[': the value is not a YAML scalar"
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--out", str(tmp_path / "x.npz"), "--num-datasets", "two"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "apg-pipeline generate: error: argument --num-datasets: invalid int value: 'two' "
        "(see apg-pipeline generate --help)"
    ]


def test_valid_input_still_writes_the_same_dataset(tmp_path):
    """The checks come before the work and draw from their own generator: a valid set is
    the draws the simulator makes from the seed alone."""
    from apg.tasks.simulation import simulate_set

    out = tmp_path / "x.npz"
    main(["generate", "--out", str(out), "--num-datasets", "3", "--num-points", "7", "--seed", "5"])
    expected = simulate_set("gmm", {}, 3, 5, {"num_points": 7})
    got = load_dataset(out)
    assert set(got) == set(expected) and all(np.array_equal(got[k], expected[k]) for k in expected)
