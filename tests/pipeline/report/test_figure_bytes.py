"""A rebuild of an unchanged report adds nothing to git: a figure saved twice has the same
bytes, names no matplotlib version or date, and a picture that differs from the file already
there by at most one colour level (another CPU's rounding) leaves that file as it was; the
report's fits and sums come out to the same bits whatever the CPU."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from pipeline.present import write_gif
from pipeline.report import exact
from pipeline.report.figures import save_figure, write_picture
from pipeline.report.reach import curves_reach_figure, power_law_fit


def draw(path: Path, fmt: str = "png") -> bytes:
    fig, ax = plt.subplots(figsize=(3, 2))
    steps = exact.geomspace(250, 200_000, 50)
    ax.plot(steps, exact.exp(2.5 - 0.3 * exact.log(steps)), "k--", lw=0.8)
    ax.set(xscale="log", yscale="log", title="a line")
    save_figure(fig, path.with_suffix(f".{fmt}"))
    plt.close(fig)
    return path.with_suffix(f".{fmt}").read_bytes()


@pytest.mark.parametrize("fmt", ["png", "svg", "pdf"])
def test_a_figure_saved_twice_has_the_same_bytes(tmp_path, fmt):
    assert draw(tmp_path / "a", fmt) == draw(tmp_path / "b", fmt)


def test_a_png_names_no_matplotlib_version_or_date(tmp_path):
    draw(tmp_path / "a")
    with Image.open(tmp_path / "a.png") as image:
        assert not {"Software", "Creation Time", "date:create"} & set(image.info)


def test_the_runs_curves_draw_to_the_same_bytes_twice(tmp_path):
    steps = np.array([0, 250, 500, 1000, 2000, 4000, 8000])
    evals = pd.DataFrame(
        {
            "iteration": steps,
            "pos_err": 20.0 * (steps + 100.0) ** -0.3,
            "pos_err_sem": np.full(len(steps), 0.2),
            "device": ["cpu"] * 4 + ["gpu"] * 3,
        }
    )
    fit = power_law_fit(evals["iteration"].to_numpy(float), evals["pos_err"].to_numpy(float))
    curves = [("a run", evals, fit), ("another", evals.assign(pos_err=evals["pos_err"] * 2), None)]
    for name in ("a.png", "b.png"):
        curves_reach_figure(curves, "pos_err", "position error (px)", 3.0, 200_000, tmp_path / name)
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def png(path: Path, pixels: np.ndarray) -> None:
    Image.fromarray(pixels.astype(np.uint8)).save(path)


def test_a_picture_within_one_colour_level_keeps_the_file_and_a_changed_one_replaces_it(tmp_path):
    pixels = np.random.default_rng(0).integers(1, 254, size=(20, 30, 3))
    path = tmp_path / "f.png"
    png(path, pixels)
    before = path.read_bytes()
    off_by_one = pixels.copy()
    off_by_one[3:9, 4:12] += 1
    assert not write_picture(path, lambda tmp: png(tmp, off_by_one))
    assert path.read_bytes() == before
    changed = pixels.copy()
    changed[5, 5] += 2
    assert write_picture(path, lambda tmp: png(tmp, changed))
    with Image.open(path) as image:
        assert np.array_equal(np.asarray(image), changed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.png"]  # no temporary file left


def test_a_gif_keeps_its_file_unless_a_frame_or_the_timing_changes(tmp_path):
    frames = [np.full((8, 12, 3), 40 * i, np.uint8) for i in range(4)]
    path = tmp_path / "a.gif"
    write_gif(path, frames, 200)
    before = path.read_bytes()
    nudged = [f.copy() for f in frames]
    nudged[2][1, 1] += 1
    assert not write_picture(path, lambda tmp: write_gif(tmp, nudged, 200))
    assert path.read_bytes() == before
    assert write_picture(path, lambda tmp: write_gif(tmp, frames, 300))
    assert path.read_bytes() != before
    assert write_picture(path, lambda tmp: write_gif(tmp, frames[:3], 300))


def test_a_file_pil_cannot_read_is_kept_only_when_its_bytes_are_the_same(tmp_path):
    path = tmp_path / "f.svg"
    path.write_text("<svg>a</svg>")
    assert not write_picture(path, lambda tmp: tmp.write_text("<svg>a</svg>"))
    assert write_picture(path, lambda tmp: tmp.write_text("<svg>b</svg>"))
    assert path.read_text() == "<svg>b</svg>"


def test_exact_sums_are_correctly_rounded_so_the_same_on_every_cpu():
    # Each product is IEEE-rounded (the same on every CPU) and their sum correctly rounded:
    # one number, whatever the order a CPU would add in.
    rng = np.random.default_rng(1)
    for n in (3, 17, 1000):
        a, b = rng.standard_normal(n) * 1e3, rng.standard_normal(n)
        truth = float(sum(Fraction(x * y) for x, y in zip(a.tolist(), b.tolist(), strict=True)))
        assert exact.dot(a, b) == truth
    x = np.log(np.array([250.0, 500, 1000, 2000, 4000, 8000]))
    y = 2.0 - 0.3 * x + np.array([0.01, -0.02, 0.0, 0.015, -0.01, 0.005])
    intercept, slope = exact.line_fit(x, y)
    b, a = np.polyfit(x, y, 1)
    assert intercept == pytest.approx(a, rel=1e-12) and slope == pytest.approx(b, rel=1e-12)


def test_exact_exp_log_and_geomspace_behave_as_numpys():
    values = np.array([[0.0, 1.0], [-3.5, 700.0]])
    assert exact.exp(values).shape == (2, 2)
    assert np.allclose(exact.exp(values), np.exp(values), rtol=1e-15, atol=0)
    assert exact.exp(1e4)[()] == math.inf
    logs = exact.log(np.array([1.0, 0.0, -1.0, 5.0]))
    assert logs[0] == 0.0 and logs[1] == -math.inf and math.isnan(logs[2])
    assert logs[3] == pytest.approx(np.log(5.0), rel=1e-15)
    points = exact.geomspace(250, 200_000, 100)
    assert points[0] == 250 and points[-1] == 200_000
    assert np.allclose(points, np.geomspace(250, 200_000, 100), rtol=1e-14, atol=0)
