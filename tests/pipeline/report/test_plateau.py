"""The plateau test (``pipeline.report.training``): one curve's and a configuration's pooled
least-squares trend, the marks they put on cells, and the pooled test's power and false alarms
on curves like the rings' default (simulated)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from pipeline import report
from pipeline.report.training import PLATEAU_Z, pooled_plateau, training_markdown, training_table
from tests.pipeline.report.synthetic import cell

# --------------------------------------------------------------------------- plateau


def test_plateau_matches_ordinary_least_squares():
    rng = np.random.default_rng(0)
    it = np.arange(10, 1010, 10)
    value = -300 + 0.01 * it + rng.normal(0, 2.0, len(it))
    stat = report.plateau(it, value)
    window = it > 800
    t, v = it[window], value[window]
    (slope, _), cov = np.polyfit(t, v, 1, cov="unscaled")
    resid = v - np.polyval([slope, _], t)
    se_slope = math.sqrt(resid @ resid / (len(t) - 2) * cov[0, 0])
    span = t.max() - t.min()
    assert stat.points == window.sum() == 20
    assert (stat.start, stat.end) == (810, 1000)
    assert stat.final == pytest.approx(v.mean())
    assert stat.delta == pytest.approx(slope * span)
    assert stat.se == pytest.approx(se_slope * span)
    assert stat.z == pytest.approx(stat.delta / stat.se)


def test_plateau_verdicts():
    rng = np.random.default_rng(1)
    it = np.arange(1, 2001)
    flat = report.plateau(it, -280 + rng.normal(0, 1.0, len(it)))
    assert flat.plateaued is True and abs(flat.z) < 3
    rising = report.plateau(it, -280 + 0.01 * it + rng.normal(0, 1.0, len(it)))
    assert rising.plateaued is False and rising.z > 3 and rising.delta == pytest.approx(4.0, rel=0.2)
    few = report.plateau(np.array([2, 4, 6]), np.array([-3.0, -2.0, -1.0]))
    assert few.points == 1 and few.plateaued is None and math.isnan(few.z)
    four = report.plateau(np.arange(1, 21), np.arange(20.0))  # 4 points in the window
    assert four.points == 4 and four.plateaued is None
    straight = report.plateau(np.arange(1, 101), np.arange(100.0))  # no noise: a trend is a trend
    assert straight.plateaued is False and straight.z == math.inf
    assert report.plateau(np.array([]), np.array([])).points == 0


def test_pooled_plateau_is_least_squares_with_an_intercept_per_seed():
    rng = np.random.default_rng(2)
    # Three seeds at other levels and noise; the third trained longer (its own last fifth).
    lengths, levels, noise = (1000, 1000, 1500), (-300.0, -250.0, -320.0), (1.0, 3.0, 2.0)
    curves = []
    for last, level, sd in zip(lengths, levels, noise, strict=True):
        it = np.arange(10, last + 1, 10)
        curves.append((it, level + 0.03 * it + rng.normal(0, sd, len(it))))
    stat = pooled_plateau(curves)
    windows = [(t[t > 0.8 * t.max()], v[t > 0.8 * t.max()]) for t, v in curves]
    t = np.concatenate([w[0] for w in windows])
    v = np.concatenate([w[1] for w in windows])
    seed = np.repeat(np.arange(3), [len(w[0]) for w in windows])
    design = np.column_stack([seed == s for s in range(3)] + [t]).astype(float)
    coef, rss, *_ = np.linalg.lstsq(design, v, rcond=None)
    dof = len(v) - 3 - 1
    se_slope = math.sqrt(rss[0] / dof * np.linalg.inv(design.T @ design)[-1, -1])
    span = np.mean([w[0].max() - w[0].min() for w in windows])
    assert stat.points == len(v) == 20 + 20 + 30
    assert (stat.start, stat.end) == (810, 1500) and stat.final == pytest.approx(v.mean())
    assert stat.delta == pytest.approx(coef[-1] * span)
    assert stat.se == pytest.approx(se_slope * span)
    assert stat.z == pytest.approx(stat.delta / stat.se) and stat.plateaued is False
    # One curve is the plain OLS of ``plateau``, to the last bit.
    assert pooled_plateau(curves[:1]) == report.plateau(*curves[0])
    # A seed with fewer than 5 points in its window leaves the pooled trend not assessable.
    short = (np.arange(1, 21), np.arange(20.0))
    assert pooled_plateau([*curves, short]).plateaued is None


def _rows(cell_id, it, value, metric="log_joint"):
    return pd.DataFrame({"iteration": it, "metric": metric, "value": value, "cell_id": cell_id})


def test_a_configurations_pooled_trend_marks_every_seed_and_a_seeds_own_trend_marks_it_alone():
    it = np.arange(10, 1010, 10)  # windows of 20 points, 810 to 1000
    # Noise orthogonal to any line over the window (+1 -1 -1 +1 per 4 points): each seed's own
    # slope is its true one and its residuals are this pattern, so every z below is exact.
    pattern = np.resize([1.0, -1.0, -1.0, 1.0], len(it))

    def line(rise, sd):  # ``rise`` nats over the window
        return rise * (it - 810) / 190 + sd * pattern

    cells, rows = [], []
    # apg K5 L10: ten seeds rising 1.5 nats a window under noise 1 (own z 1.9 each, pooled z
    # 6.3); the same at K10, flat; at K5 with another swept setting, three flat seeds (their own
    # configuration).
    for k, hidden, rise, seeds in ((5, 32, 1.5, range(10)), (10, 32, 0.0, range(10)), (5, 64, 0.0, range(3))):
        for seed in seeds:
            c = cell("apg", k, 10, seed) | {"settings": {"network.hidden": hidden}}
            c["cell_id"] += f"-h{hidden}"
            cells.append(c)
            rows.append(_rows(c["cell_id"], it, -280 + seed + line(rise, 1.0)))
    # rws-mlp: one seed of five climbing 20 nats a window under noise 5 (own z 5.2), the others
    # flat: a common slope of 4 nats against the spread of the seeds' slopes (pooled z 2.1).
    for seed in range(5):
        c = cell("rws-mlp", 5, 10, seed)
        cells.append(c)
        rows.append(_rows(c["cell_id"], it, -300 + line(20.0 if seed == 0 else 0.0, 5.0)))
    table = training_table(pd.concat(rows, ignore_index=True), {"cells": cells}).set_index("cell_id")
    rising = table.loc[[f"apg-K5-L10-s{s}-h32" for s in range(10)]]
    assert rising["z"].to_numpy() == pytest.approx(1.5 / (190 * math.sqrt(20 / 18 / 66_500)))
    assert rising["pooled_z"].to_numpy() == pytest.approx(1.5 / (190 * math.sqrt(200 / 189 / 665_000)))
    assert (rising["own"] == "yes").all() and (rising["pooled"] == "no").all()
    assert (rising["plateaued"] == "no").all() and (rising["seeds_pooled"] == 10).all()
    assert rising["pooled_delta"].to_numpy() == pytest.approx(1.5)
    flat = table[(table["K"] == 10) | table.index.str.endswith("-h64")]
    assert (flat["pooled"] == "yes").all() and (flat["plateaued"] == "yes").all()
    assert sorted(flat["seeds_pooled"].unique()) == [3, 10]
    rws = table[table["method"] == "rws-mlp"]
    assert rws.loc["rws-mlp-K5-L10-s0", "own"] == "no" and rws["pooled"].eq("yes").all()
    assert 2.0 < rws["pooled_z"].iloc[0] < 2.2 and rws["z"].iloc[0] > 5
    assert list(rws["plateaued"]) == ["no", "yes", "yes", "yes", "yes"]
    assert set(report.training.cell_flags(table.reset_index())) == {*rising.index, "rws-mlp-K5-L10-s0"}
    md = training_markdown(table.reset_index())
    assert md.count("no † (seeds pooled)") == 10 and "| `gmm/rws-mlp/K5/L10/seed0` |" in md
    for hidden, seeds in ((32, 10), (64, 3)):
        name = f'gmm/apg/K5/L10 (1000 iterations, settings {{"network.hidden": {hidden}}})'
        assert md.count(f"| `{name}` | {seeds} | 1000 |") == 1


# The rings' default as committed (reports/data/dgmm/training.parquet, APG at K=5 L=10): ten
# seeds logged every 50 of 4,500 steps, so 18 points in a window (3,650 to 4,500), each seed's
# residual standard deviation around its window's line (nats), and the spread of the seeds'
# levels.
RINGS_ITERATIONS = np.arange(50, 4501, 50.0)
RINGS_NOISE = np.array([121.0, 180.0, 127.0, 131.0, 136.0, 240.0, 167.0, 201.0, 82.0, 166.0])
RINGS_LEVEL, RINGS_LEVEL_SPREAD = -880.0, 36.0
RISE = 99.0  # nats over the window: the mean rise of the rings' APG seeds in the issue


def _simulate(rng, reps, rise, noise):
    """``reps`` configurations of the rings' ten seeds, each a line rising ``rise`` nats over
    the window (flat before it does not matter: only the window is fitted) plus a level per
    seed and independent noise per point; ``(reps, seeds, points)``."""
    shape = (reps, len(RINGS_NOISE), len(RINGS_ITERATIONS))
    levels = RINGS_LEVEL + rng.normal(0, RINGS_LEVEL_SPREAD, shape[:2])[..., None]
    trend = rise * (RINGS_ITERATIONS - 3650) / 850
    return levels + trend + noise(rng, shape) * RINGS_NOISE[:, None]


def _normal(rng, shape):
    return rng.normal(0.0, 1.0, shape)


def _left_skewed(rng, shape):
    # A mirrored Gumbel scaled to unit variance: skew -1.14 and excess kurtosis 2.4, beyond the
    # rings' residuals (skew -0.7, excess kurtosis 0.6).
    return -(rng.gumbel(0.0, 1.0, shape) - np.euler_gamma) / (math.pi / math.sqrt(6))


def _rate(hits, p):
    """``(hits / reps, its Monte Carlo standard deviation at the predicted rate p)``."""
    return hits.mean(), math.sqrt(p * (1 - p) / len(hits))


@pytest.mark.slow
def test_pooled_plateau_power_and_false_alarms_on_curves_like_the_rings():
    """Bounds from the Monte Carlo error. Under independent normal noise the pooled z is
    Student's t on N - S - 1 = 180 - 11 = 169 degrees of freedom when the trend is flat, and
    noncentral t with ncp = rise / sd(Delta) under a rise, sd(Delta) = span sqrt(mean_s
    sigma_s^2 / (S sum dt^2)) (the seeds' windows share iterations, so the common slope is the
    mean of the seeds' slopes). Unequal sigma_s make the pooled variance a weighted sum of
    chi-squares (Satterthwaite: about 150 degrees of freedom), which moves P(|t| >= 3) by less
    than 1e-4, below the Monte Carlo error. So the count of rejections in M simulated
    configurations is Binomial(M, p) with p predicted, and the rate is checked within 4 of its
    standard deviations sqrt(p (1 - p) / M) (a chance failure about 1 in 16,000 for a fixed
    seed; the generator is seeded). Left-skewed, heavier-tailed noise than the rings' has no
    exact prediction; the slope is a weighted sum of 180 independent errors, so z is close to
    the normal case and its false alarms are checked against the same upper bound.
    """
    rng = np.random.default_rng(70)
    window = RINGS_ITERATIONS > 0.8 * RINGS_ITERATIONS.max()
    t = RINGS_ITERATIONS[window]
    dt = t - t.mean()
    seeds, points = len(RINGS_NOISE), int(window.sum())
    dof = seeds * points - seeds - 1
    sd_delta = (t.max() - t.min()) * math.sqrt(np.mean(RINGS_NOISE**2) / (seeds * (dt @ dt)))
    p_flat = 2 * stats.t.sf(PLATEAU_Z, dof)
    ncp = RISE / sd_delta
    p_rise = stats.nct.sf(PLATEAU_Z, dof, ncp) + stats.nct.cdf(-PLATEAU_Z, dof, ncp)
    assert points == 18 and dof == 169 and 0.3 < p_rise < 0.34

    def pooled_hits(values):
        return np.array(
            [pooled_plateau([(RINGS_ITERATIONS, v) for v in rep]).plateaued is False for rep in values]
        )

    for noise, reps in ((_normal, 10_000), (_left_skewed, 10_000)):
        rate, sd = _rate(pooled_hits(_simulate(rng, reps, 0.0, noise)), p_flat)
        assert rate <= p_flat + 4 * sd, (noise.__name__, rate, p_flat)
        if noise is _normal:
            assert abs(rate - p_flat) <= 4 * sd, (rate, p_flat)

    rising = _simulate(rng, 2_000, RISE, _normal)
    power, sd = _rate(pooled_hits(rising), p_rise)
    assert abs(power - p_rise) <= 4 * sd, (power, p_rise)

    # Against the same curves: each seed's own test (the per-cell rule), and the mean of the
    # seeds' slopes against their spread (Welch-style) at the threshold that gives it the
    # pooled test's false-alarm rate on its S - 1 degrees of freedom.
    w = rising[..., window]
    slopes = (w - w.mean(-1, keepdims=True)) @ dt / (dt @ dt)
    resid = w - w.mean(-1, keepdims=True) - slopes[..., None] * dt
    own_z = slopes / np.sqrt((resid**2).sum(-1) / (points - 2) / (dt @ dt))
    z0 = report.plateau(RINGS_ITERATIONS, rising[0, 0]).z
    assert own_z[0, 0] == pytest.approx(z0)
    own_ncp = RISE / ((t.max() - t.min()) * RINGS_NOISE / math.sqrt(dt @ dt))
    own_p = stats.nct.sf(PLATEAU_Z, points - 2, own_ncp) + stats.nct.cdf(-PLATEAU_Z, points - 2, own_ncp)
    own_rate = (np.abs(own_z) >= PLATEAU_Z).mean(0)
    own_sd = np.sqrt(own_p * (1 - own_p) / len(rising))
    assert np.all(np.abs(own_rate - own_p) <= 4 * own_sd), (own_rate, own_p)
    assert own_p.max() < 0.12 and power > 2.5 * own_p.max()
    welch_z = slopes.mean(1) / (slopes.std(1, ddof=1) / math.sqrt(seeds))
    matched = stats.t.isf(p_flat / 2, seeds - 1)
    welch = (np.abs(welch_z) >= matched).mean()
    assert power - welch > 4 * math.sqrt(2 * 0.25 / len(rising)), (power, welch)
