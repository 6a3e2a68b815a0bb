"""The learning-rate schedule (apg.training.learning_rate)."""

import math
from itertools import pairwise

import pytest

from apg.training import TrainConfig, learning_rate


def rates(iterations=100, **changes):
    cfg = TrainConfig(
        task="gmm",
        method="apg",
        sweeps=10,
        particles=10,
        batch_size=20,
        lr=0.02,
        lr_schedule="cosine",
        lr_final_factor=0.01,
        iterations=iterations,
        **changes,
    ).validate()
    return [learning_rate(cfg, i) for i in range(cfg.iterations)]


def test_cosine_runs_from_the_rate_to_its_floor_over_every_step():
    lr = rates()
    assert lr[0] == pytest.approx(0.02) and lr[-1] == pytest.approx(2e-4)
    assert lr[50] == pytest.approx(2e-4 + (0.02 - 2e-4) * 0.5 * (1 + math.cos(math.pi * 50 / 99)))
    assert all(a > b for a, b in pairwise(lr))


def test_hold_fraction_reaches_the_floor_early_and_keeps_it():
    lr = rates(lr_hold_fraction=0.2)
    assert lr[0] == pytest.approx(0.02)
    # the cosine over steps 0..79, as a schedule of 80 steps would be
    assert lr[:80] == pytest.approx(rates(iterations=80))
    assert lr[79:] == pytest.approx([2e-4] * 21)
    assert all(a > b for a, b in pairwise(lr[:80]))


@pytest.mark.parametrize("bad", [-0.1, 1.0, "0.2"])
def test_bad_hold_fraction_is_a_one_line_error(bad):
    with pytest.raises(ValueError, match="lr_hold_fraction must be in"):
        TrainConfig(
            lr=0.02,
            lr_schedule="cosine",
            lr_hold_fraction=bad,
            task="gmm",
            method="apg",
            sweeps=10,
            particles=10,
            batch_size=20,
            iterations=1000,
        ).validate()
