"""Seeds of one cell in one process (apg.seeds): each seed is its own trial.

Every method the default sweep trains on the GMM and the rings (params.yaml's grids) is
trained for a few steps as S=3 seeds in one ``SeedTrainers`` and as three separate trainers,
each seeded as an entry point seeds a trial. The tolerance is zero: a seed's step is its
trial's step, run on the trial's weights in the trial's generator state, with nothing shared
between seeds, so every loss, metric, weight, Adam moment, data order and generator state must
be equal bit for bit (a difference means a seed drew from another's stream or trained on
another's data).
"""

import pytest
import torch

from apg.seeds import SeedTrainers
from apg.tasks import get_task
from apg.training import TrainConfig, Trainer

SEEDS = [3, 0, 7]
SIZES = {"gmm": {"num_points": 12}, "dgmm": {"num_points": 16, "radius": 2.0}}
OPTIONS = {"hmc-rws": {"step_size": 0.1, "leapfrog_steps": 2}}
METHODS = [
    *(("gmm", m) for m in ("apg", "rws-mlp", "rws-lstm", "gibbs", "gibbs-bootstrap", "reparam", "hmc-rws")),
    *(("dgmm", m) for m in ("apg", "rws-mlp", "rws-lstm", "reparam", "hmc-rws")),
]


def cell(task: str, method: str, iterations: int = 3) -> tuple[TrainConfig, torch.Tensor]:
    spec = get_task(task)
    x = spec.simulate(spec.build_model(), 9, torch.Generator().manual_seed(1), **SIZES[task])["x"].float()
    cfg = TrainConfig(
        task=task,
        method=method,
        sweeps=2,
        particles=3,
        batch_size=4,  # 9 datasets: the third step starts a new epoch (a fresh permutation)
        iterations=iterations,
        lr=0.02,
        lr_schedule="cosine",
        network={"hidden": 8},
        method_options=OPTIONS.get(method, {}),
    )
    return cfg, x


def assert_equal(a, b, where=""):
    """``a`` and ``b`` (nested dicts, lists and tensors) equal bit for bit."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            assert_equal(u, v, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.parametrize(("task", "method"), METHODS)
def test_each_seed_trains_as_its_own_trial(task, method):
    cfg, x = cell(task, method)
    seeds = SeedTrainers(cfg, x, SEEDS)
    assert seeds.step(log=False) is None
    together = [seeds.step(), seeds.step()]
    for i, seed in enumerate(SEEDS):
        torch.manual_seed(seed)
        alone = Trainer(cfg, x)
        alone.step(log=False)
        rows = [alone.step(), alone.step()]
        for row, step in zip(rows, together, strict=True):
            del row["step_seconds"], step[i]["step_seconds"]
            assert step[i] == row, f"seed {seed}"
        assert_equal(seeds.state_dict(i), alone.state_dict(), f"seed {seed}")


def test_seeds_leave_the_callers_generator_as_it_was():
    cfg, x = cell("gmm", "apg", iterations=1)
    seeds = SeedTrainers(cfg, x, [0, 1])
    torch.manual_seed(5)
    before = torch.get_rng_state()
    seeds.step()
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("bad", [[], [1, 1]])
def test_seeds_must_be_distinct_and_some(bad):
    cfg, x = cell("gmm", "apg")
    with pytest.raises(ValueError, match="seeds must be distinct and at least one"):
        SeedTrainers(cfg, x, bad)


def test_the_compiled_step_is_refused_in_one_line():
    cfg, x = cell("gmm", "apg")
    cfg.compile = True
    with pytest.raises(ValueError, match="seeds in one process train the eager step only"):
        SeedTrainers(cfg, x, [0, 1])
