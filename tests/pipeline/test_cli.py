"""``apg-pipeline`` generate / train / evaluate: a round trip, and one-line errors for bad input."""

from __future__ import annotations

import json
import math
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from apg.checkpoint import CheckpointError, load_checkpoint
from apg.training import Trainer, TrainingDiverged
from pipeline.cli import main
from tests.support import REPO

TRAIN = [
    "--task",
    "gmm",
    "--method",
    "apg",
    "-K",
    "2",
    "-L",
    "3",
    "--batch-size",
    "4",
    "--iterations",
    "3",
    "--lr",
    "0.01",
    "--threads",
    "1",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    main(
        [
            "generate",
            "--out",
            str(root / "train.npz"),
            "--num-datasets",
            "8",
            "--seed",
            "1",
            "--num-points",
            "12",
        ]
    )
    main(
        [
            "generate",
            "--out",
            str(root / "test.npz"),
            "--num-datasets",
            "3",
            "--seed",
            "2",
            "--num-points",
            "15",
        ]
    )
    main(["train", *TRAIN, "--data", str(root / "train.npz"), "--out", str(root / "ckpt.pt")])
    return root


def run_error(argv, capsys, progress: bool = False) -> str:
    """Run the CLI expecting a one-line error with exit status 2; return that line.

    ``progress``: the progress bar (stderr) had started, so only the last line is the error.
    """
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    if not progress:
        assert len(err) == 1, err
    assert err[-1].startswith("apg-pipeline: error: "), err
    return err[-1]


def test_round_trip(files, capsys):
    payload = torch.load(files / "ckpt.pt", weights_only=True)
    assert payload["format"] == "apg-checkpoint-1"
    out = files / "metrics.json"
    main(
        [
            "evaluate",
            "--checkpoint",
            str(files / "ckpt.pt"),
            "--data",
            str(files / "test.npz"),
            "-K",
            "3",
            "-L",
            "4",
            "--out",
            str(out),
        ]
    )
    metrics = json.loads(out.read_text())
    assert (
        metrics["task"],
        metrics["method"],
        metrics["sweeps"],
        metrics["particles"],
        metrics["num_datasets"],
    ) == ("gmm", "apg", 3, 4, 3)
    for key in ("log_joint", "ess", "log_evidence", "ess_globals", "ess_c"):
        assert len(metrics[key]) == 3 and all(math.isfinite(v) for v in metrics[key]), key
    for key in ("kl_globals", "kl_c"):
        assert math.isfinite(metrics[key])
    assert all(0 < v <= 1 for v in metrics["ess"])
    assert metrics["config"]["iterations"] == 3 and metrics["config"]["sweeps"] == 2


def test_evaluate_and_impute_default_to_what_the_checkpoint_trained_with(files, tmp_path):
    """No -K, -L, --batch-size or --resample-mode: the checkpoint's own (no second default)."""
    out = tmp_path / "metrics.json"
    main(
        [
            "evaluate",
            "--checkpoint",
            str(files / "ckpt.pt"),
            "--data",
            str(files / "test.npz"),
            "--out",
            str(out),
        ]
    )
    metrics = json.loads(out.read_text())
    trained = metrics["config"]
    assert (metrics["sweeps"], metrics["particles"]) == (trained["sweeps"], trained["particles"])
    assert len(metrics["log_joint"]) == trained["sweeps"]
    x = np.load(files / "test.npz")["x"]
    mask = np.zeros(x.shape, dtype=np.uint8)
    mask[:, :2, 0] = 1
    np.savez(tmp_path / "mask.npz", mask=mask)
    imputed = tmp_path / "imputed.npz"
    argv = ["--data", str(files / "test.npz"), "--mask", str(tmp_path / "mask.npz"), "--iterations", "2"]
    main(["impute", "--checkpoint", str(files / "ckpt.pt"), *argv, "--out", str(imputed)])
    assert np.load(imputed)["history"].shape[0] == 2


def test_rws_evaluates_one_step(files):
    ckpt, out = files / "rws.pt", files / "rws.json"
    argv = [*TRAIN, "--data", str(files / "train.npz"), "--out", str(ckpt)]
    argv[argv.index("apg")] = "rws-lstm"
    main(["train", *argv])
    main(
        [
            "evaluate",
            "--checkpoint",
            str(ckpt),
            "--data",
            str(files / "test.npz"),
            "-K",
            "2",
            "-L",
            "3",
            "--out",
            str(out),
        ]
    )
    metrics = json.loads(out.read_text())
    # RWS spends its K*L particles in a single importance-sampling step: one curve point, no KL.
    assert len(metrics["log_joint"]) == 1 and "kl_c" not in metrics


@pytest.fixture()
def bad_files(tmp_path):
    np.savez(tmp_path / "shape.npz", x=np.zeros((4, 10, 3)))
    np.savez(tmp_path / "rank.npz", x=np.zeros((4, 10)))
    np.savez(tmp_path / "nan.npz", x=np.full((4, 10, 2), np.nan))
    (tmp_path / "corrupt.npz").write_bytes(b"not a zip")
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    return tmp_path


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"-K": "0"}, "sweeps (K)"),
        ({"-L": "1"}, "particles (L)"),
        ({"--method": "nope"}, "unknown method 'nope'"),
        ({"--task": "nope"}, "unknown task 'nope'"),
        ({"--lr": "-0.5"}, "lr must be a positive number"),
        ({"--data": "missing.npz"}, "not found"),
        ({"--data": "corrupt.npz"}, "corrupt"),
        ({"--data": "shape.npz"}, "does not fit task gmm"),
        ({"--data": "rank.npz"}, "must be shaped like"),
        ({"--data": "nan.npz"}, "NaN or infinite"),
    ],
)
def test_train_bad_input(files, bad_files, capsys, change, expected):
    argv = [*TRAIN, "--data", str(files / "train.npz"), "--out", str(bad_files / "out.pt")]
    for flag, value in change.items():
        if flag == "--data":
            value = str(bad_files / value)
        argv[argv.index(flag) + 1] = value
    line = run_error(["train", *argv], capsys)
    assert expected in line
    assert not (bad_files / "out.pt").exists()
    assert not list(bad_files.glob(".out.pt*"))  # no temporary file left behind


@pytest.mark.parametrize(
    "checkpoint, data, sweeps, particles, expected",
    [
        ("missing.pt", "test.npz", "2", "3", "checkpoint file not found"),
        ("corrupt.pt", "test.npz", "2", "3", "corrupt or not a checkpoint"),
        ("ckpt.pt", "nan.npz", "2", "3", "NaN or infinite"),
        ("ckpt.pt", "test.npz", "0", "3", "sweeps (K)"),
        ("ckpt.pt", "test.npz", "2", "1", "particles (L)"),
    ],
)
def test_evaluate_bad_input(files, bad_files, capsys, checkpoint, data, sweeps, particles, expected):
    def where(name):
        return str((files if (files / name).exists() else bad_files) / name)

    out = bad_files / "m.json"
    line = run_error(
        [
            "evaluate",
            "--checkpoint",
            where(checkpoint),
            "--data",
            where(data),
            "-K",
            sweeps,
            "-L",
            particles,
            "--out",
            str(out),
        ],
        capsys,
    )
    assert expected in line
    assert not out.exists()


def flip_a_weight(checkpoint: Path, out: Path) -> str:
    """Copy ``checkpoint`` to ``out`` with one byte flipped inside its largest tensor record
    (the archive's own bytes stay well formed); return that record's name."""
    with zipfile.ZipFile(checkpoint) as archive:
        record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        archive.fp.seek(record.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", archive.fp.read(4))
    data = bytearray(checkpoint.read_bytes())
    data[record.header_offset + 30 + name_len + extra_len + record.file_size // 2] ^= 0x10
    out.write_bytes(bytes(data))
    return record.filename


def test_a_flipped_weight_is_refused_on_load(files, tmp_path, capsys):
    damaged = tmp_path / "damaged.pt"
    record = flip_a_weight(files / "ckpt.pt", damaged)
    # torch.load alone does not check the records' CRCs: the damage loads as a changed weight.
    good, bad = (torch.load(p, weights_only=True)["state"] for p in (files / "ckpt.pt", damaged))
    assert any(not torch.equal(a, b) for a, b in zip(flat(good), flat(bad), strict=True))
    with pytest.raises(CheckpointError, match=f"damaged: record {re.escape(record)} fails its CRC check"):
        load_checkpoint(damaged)
    out = tmp_path / "m.json"
    argv = ["--data", str(files / "test.npz"), "-K", "2", "-L", "3", "--out", str(out)]
    line = run_error(["evaluate", "--checkpoint", str(damaged), *argv], capsys)
    assert str(damaged) in line and record in line and not out.exists()


def flat(state) -> list[torch.Tensor]:
    """Every tensor of a nested state dict, in order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in flat(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in flat(v)]
    return []


def test_nan_loss_stops_with_message(files, tmp_path, capsys, monkeypatch):
    def diverge(self, log=True):
        raise TrainingDiverged("loss became nan at iteration 1; try a lower learning rate")

    monkeypatch.setattr(Trainer, "step", diverge)
    out = tmp_path / "ckpt.pt"
    line = run_error(
        ["train", *TRAIN, "--data", str(files / "train.npz"), "--out", str(out)], capsys, progress=True
    )
    assert "training diverged" in line and "nan" in line
    assert not out.exists()


def test_a_nan_weight_stops_training_with_one_line_and_no_checkpoint(files, tmp_path, capsys, monkeypatch):
    # No step is mocked: one proposal weight is NaN, so the proposals draw NaN, every
    # particle's weight is NaN (zero) and the first step cannot go on.
    built = Trainer.__init__

    def with_a_nan_weight(self, *args, **kwargs):
        built(self, *args, **kwargs)
        with torch.no_grad():
            next(self.proposals.parameters()).view(-1)[0] = float("nan")

    monkeypatch.setattr(Trainer, "__init__", with_a_nan_weight)
    out = tmp_path / "ckpt.pt"
    line = run_error(
        ["train", *TRAIN, "--data", str(files / "train.npz"), "--out", str(out)], capsys, progress=True
    )
    assert line.startswith("apg-pipeline: error: training diverged: ") and "at iteration 1" in line
    assert not out.exists() and not list(tmp_path.glob(".ckpt.pt*"))


def test_module_entry_point_reports_one_line(tmp_path):
    """``python -m pipeline.cli`` works and prints no traceback for bad input."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "train",
            "-K",
            "0",
            "--data",
            "x.npz",
            "--out",
            str(tmp_path / "c.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "apg-pipeline: error: sweeps (K) must be an integer >= 1, got 0"


# --------------------------------------------------------------------------- impute


def test_impute_fills_in_what_the_mask_hides(files, tmp_path, capsys):
    x = np.load(files / "test.npz")["x"]
    mask = np.zeros(x.shape, dtype=np.uint8)
    mask[:, :4, 1] = 1
    np.savez(tmp_path / "mask.npz", mask=mask)
    out = tmp_path / "imputed.npz"
    main(
        [
            "impute",
            "--checkpoint",
            str(files / "ckpt.pt"),
            "--data",
            str(files / "test.npz"),
            "--mask",
            str(tmp_path / "mask.npz"),
            "--out",
            str(out),
            "--iterations",
            "3",
            "-K",
            "2",
            "-L",
            "3",
        ]
    )
    assert f"wrote {out}" in capsys.readouterr().out
    with np.load(out) as got:
        assert got["history"].shape == (3, mask.sum())
        assert np.allclose(got["x"][mask == 0], x[mask == 0].astype(np.float32))
        assert not np.allclose(got["x"][mask == 1], x[mask == 1])
        assert np.array_equal(got["history"][-1], got["x"][mask == 1])


@pytest.mark.parametrize(
    "make_mask, expected",
    [
        (lambda x: np.zeros(x.shape[:2]), "the mask must be shaped like the data (3, 15, 2), got (3, 15)"),
        (lambda x: np.zeros(x.shape), "the mask marks nothing missing"),
        (lambda x: np.ones(x.shape), "every entry of dataset(s) [0, 1, 2] is missing"),
        (lambda x: np.full(x.shape, 3), "the mask must hold only 0 (observed) and 1 (missing)"),
    ],
)
def test_impute_bad_masks(files, tmp_path, capsys, make_mask, expected):
    x = np.load(files / "test.npz")["x"]
    np.savez(tmp_path / "mask.npz", mask=make_mask(x))
    out = tmp_path / "imputed.npz"
    err = run_error(
        [
            "impute",
            "--checkpoint",
            str(files / "ckpt.pt"),
            "--data",
            str(files / "test.npz"),
            "--mask",
            str(tmp_path / "mask.npz"),
            "--out",
            str(out),
        ],
        capsys,
    )
    assert expected in err
    assert not out.exists() and not list(tmp_path.glob(".imputed*"))  # nothing half-written


@pytest.mark.parametrize(
    "write, expected",
    [
        (lambda p: p.write_bytes(b"junk"), "not an .npz archive"),
        (lambda p: p.write_bytes(b"PK\x03\x04truncated"), "not an .npz archive"),
        (lambda p: np.save(open(p, "wb"), np.zeros(3)), "a bare array"),
        (lambda p: np.savez(open(p, "wb"), a=np.zeros(3), b=np.zeros(3)), "name the array 'mask'"),
        (lambda p: np.savez(open(p, "wb"), mask=np.array(["a", "b"])), "must be 0/1 or bool"),
    ],
)
def test_impute_unreadable_mask_file(files, tmp_path, capsys, write, expected):
    write(tmp_path / "mask.npz")
    err = run_error(
        [
            "impute",
            "--checkpoint",
            str(files / "ckpt.pt"),
            "--data",
            str(files / "test.npz"),
            "--mask",
            str(tmp_path / "mask.npz"),
            "--out",
            str(tmp_path / "o.npz"),
        ],
        capsys,
    )
    assert "mask file" in err and expected in err


def test_an_os_error_is_one_line_naming_the_path(files, tmp_path, capsys):
    # --out naming a directory: the operating system's reason and the path, no traceback.
    target = tmp_path / "a-directory"
    target.mkdir()
    line = run_error(
        ["train", *TRAIN, "--data", str(files / "train.npz"), "--out", str(target)],
        capsys,
        progress=True,
    )
    assert "a-directory" in line and "Traceback" not in line


def test_params_with_a_key_given_twice_are_refused(tmp_path):
    from pipeline.config.params import ParamsError, load_params

    text = (REPO / "params.yaml").read_text()
    doubled = text.replace("tasks:", "tasks: [gmm]\ntasks:", 1)
    (tmp_path / "p.yaml").write_text(doubled)
    with pytest.raises(ParamsError, match=r"key 'tasks' given twice \(lines \d+ and \d+\)"):
        load_params(tmp_path / "p.yaml")
    (tmp_path / "bad.yaml").write_text("tasks: [gmm\n")
    with pytest.raises(ParamsError, match="bad.yaml is not valid YAML"):
        load_params(tmp_path / "bad.yaml")


def test_generate_refuses_a_dataset_of_no_points(tmp_path, capsys):
    out = tmp_path / "x.npz"
    line = run_error(
        ["generate", "--task", "gmm", "--num-datasets", "2", "--num-points", "-3", "--out", str(out)], capsys
    )
    assert line == "apg-pipeline: error: --size.num_points: must be positive, got -3"
    assert not out.exists()


def test_train_takes_every_setting_not_given_from_the_params_cell():
    import argparse

    from pipeline.cli import build_parser, train_config
    from pipeline.config import profiles
    from pipeline.config.params import grid_cells

    def parsed(*flags: str) -> argparse.Namespace:
        return build_parser().parse_args(
            ["train", "--task", "gmm", "--method", "rws-mlp", *flags, "--data", "x", "--out", "y"]
        )

    cell = next(c for c in grid_cells(profiles.load("params.yaml"), "gmm") if c.method == "rws-mlp")
    assert train_config(parsed()).to_dict() == {**cell.train.to_dict(), "compile": False}
    changed = train_config(parsed("--lr", "0.5", "-K", "3", "--network", "hidden=8")).to_dict()
    assert changed == {
        **cell.train.to_dict(),
        "compile": False,
        "lr": 0.5,
        "sweeps": 3,
        "network": {**cell.train.network, "hidden": 8},
    }


def test_the_command_line_answers_without_loading_torch():
    """`apg-pipeline --help` and a refused flag answer at once: torch loads in the commands."""
    code = "import sys, pipeline.cli as c; c.build_parser(); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


def test_preview_says_what_dvc_repro_would_run_and_for_how_long(capsys):
    """In this checkout (results absent or not), one line per stage DVC would run, each with
    the committed run's time for it, under a total; or that nothing would run."""
    from pipeline.cli import main

    main(["preview"])
    out = capsys.readouterr().out.splitlines()
    if out[0].startswith("dvc repro has nothing to run"):
        return
    assert out[0].startswith("dvc repro would run ") and "minutes on " in out[0]
    stages = [line.split()[0] for line in out[1:]]
    assert len(stages) == int(out[0].split()[4]) and "report" in stages
    assert all(" min " in line for line in out[1:])
