"""A training step reads nothing back from the device (issue 21, item 1).

On the ``meta`` device a tensor has a shape and no values, so every host read (``.item()``,
``bool(t)``, ``nonzero``, an output shape that depends on values) raises. A step there takes
the code path of a GPU (``apg.host``: every site that reads values on a CPU asks first), so
a step that completes on ``meta`` forces no host synchronization on a GPU. Every task with
every method it runs, two steps each (the second after the first's resampling left copies).
"""

from __future__ import annotations

import math

import pytest
import torch

from apg.tasks.simulation import simulate_set
from apg.training import TrainConfig, Trainer, TrainingDiverged
from tests.pairs import runnable

SIZES = {"gmm": {"num_points": 12}, "dgmm": {"num_points": 24}}
NETWORK = {"bmnist": {"num_digits": 2}}


def videos() -> torch.Tensor:
    """Frames for Bouncing MNIST's step (no MNIST needed: any values in [0, 1] will do)."""
    return torch.rand(4, 3, 96, 96)


def config_for(task: str, method: str) -> TrainConfig:
    return TrainConfig(
        task=task,
        method=method,
        sweeps=2,
        particles=3,
        batch_size=2,
        iterations=2,
        network=NETWORK.get(task, {}),
        lr=1e-4,
    )


CASES = runnable(config_for)


@pytest.mark.parametrize("task,method", CASES)
def test_an_unlogged_training_step_reads_nothing_back(task, method):
    x = (
        videos()
        if task == "bmnist"
        else torch.as_tensor(simulate_set(task, {}, 4, 1, SIZES[task])["x"]).float()
    )
    cfg = config_for(task, method)
    trainer = Trainer(cfg, x, device="meta")
    if trainer.optimizer is not None:
        # fused Adam has no meta kernels (on a GPU it reads nothing back either): plain SGD
        params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        trainer.optimizer = torch.optim.SGD(params, lr=1e-3, foreach=False)
    for _ in range(2):
        assert trainer.step(log=False) is None
    assert trainer.iteration == 2
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        trainer.step(log=True)  # a logged step reads its metrics back, in one read


def test_an_unlogged_step_on_a_cpu_still_stops_at_a_non_finite_loss(monkeypatch):
    # Reading the loss is free on a CPU: every step checks it, before the update.
    x = torch.as_tensor(simulate_set("gmm", {}, 4, 1, SIZES["gmm"])["x"]).float()
    trainer = Trainer(config_for("gmm", "apg"), x)
    trainer.step(log=False)
    before = [p.detach().clone() for p in trainer.proposals.parameters()]
    loss = trainer.method.loss
    monkeypatch.setattr(trainer.method, "loss", lambda result: loss(result) * float("nan"))
    with pytest.raises(TrainingDiverged, match="loss became nan at iteration 2"):
        trainer.step(log=False)
    assert trainer.iteration == 1
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.proposals.parameters(), strict=True))


def test_multinomial_resampling_on_a_device_survives_a_dataset_without_weight(monkeypatch):
    # On a device nothing checks the weights (apg.host); CUDA's multinomial would assert on
    # NaN probabilities, so such a dataset is drawn uniformly (its loss is non-finite).
    from apg.smc import resampling

    monkeypatch.setattr(resampling, "values_on_host", lambda t: False)
    log_w = torch.tensor([[0.0, -math.inf], [-1.0, -math.inf], [-2.0, -math.inf]])  # (L, B)
    ancestors = resampling.multinomial(log_w)
    assert ancestors.shape == (3, 2) and bool(((ancestors >= 0) & (ancestors < 3)).all())
