"""A training step reads nothing back from the device (issue 21, item 1).

On the ``meta`` device a tensor has a shape and no values, so every host read (``.item()``,
``bool(t)``, ``nonzero``, an output shape that depends on values) raises. A step there takes
the code path of a GPU (``apg.host``: every site that reads values on a CPU asks first), so
a step that completes on ``meta`` forces no host synchronization on a GPU. Every task with
every method it runs, two steps each (the second after the first's resampling left copies).
"""

from __future__ import annotations

import pytest
import torch

from apg.baselines import METHODS
from apg.tasks import get_task, task_names
from apg.training import TrainConfig, Trainer, make_method
from pipeline.generate import simulate_set

SIZES = {"gmm": {"num_points": 12}, "dgmm": {"num_points": 24}}
NETWORK = {"bmnist": {"num_digits": 2}}


def videos() -> torch.Tensor:
    """Frames for Bouncing MNIST's step (no MNIST needed: any values in [0, 1] will do)."""
    return torch.rand(4, 3, 96, 96)


def runnable(task: str, method: str) -> bool:
    try:
        make_method(TrainConfig(task=task, method=method)).check_task(get_task(task))
        return True
    except ValueError:
        return False


CASES = [(t, m) for t in task_names() for m in METHODS if runnable(t, m)]


@pytest.mark.parametrize("task,method", CASES)
def test_an_unlogged_training_step_reads_nothing_back(task, method):
    x = videos() if task == "bmnist" else torch.as_tensor(simulate_set(task, {}, 4, 1, SIZES[task])["x"]).float()
    cfg = TrainConfig(
        task=task, method=method, sweeps=2, particles=3, batch_size=2, iterations=2, network=NETWORK.get(task, {})
    )
    try:
        trainer = Trainer(cfg, x, device="meta")
    except ValueError as err:  # the method cannot run this task's model
        pytest.skip(str(err))
    if trainer.optimizer is not None:
        # fused Adam has no meta kernels (on a GPU it reads nothing back either): plain SGD
        params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        trainer.optimizer = torch.optim.SGD(params, lr=1e-3, foreach=False)
    for _ in range(2):
        assert trainer.step(log=False) is None
    assert trainer.iteration == 2
    with pytest.raises((RuntimeError, NotImplementedError)):  # a logged step reads its metrics back
        trainer.step(log=True)
