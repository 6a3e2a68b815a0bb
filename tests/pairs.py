"""Which methods run which tasks: the (task, method) pairs the step tests cover.

A method says whether it accepts a task when asked (``check_task``); some check the task's
model only when the trainer is built (bootstrapped Gibbs needs a prior over the globals,
HMC-RWS and reparam a continuous view). Shared by test_compile.py and test_host_syncs.py.
"""

from __future__ import annotations

from collections.abc import Callable

from apg.baselines import METHODS
from apg.tasks import get_task, task_names
from apg.training import TrainConfig, build, make_method


def accepts(cfg: TrainConfig) -> bool:
    """Whether the method says it runs the task."""
    try:
        make_method(cfg).check_task(get_task(cfg.task))
        return True
    except ValueError:
        return False


def builds(cfg: TrainConfig) -> bool:
    """Whether a trainer builds for the task and method."""
    try:
        build(cfg)
        return True
    except ValueError:
        return False


def accepted(config: Callable[[str, str], TrainConfig]) -> list[tuple[str, str]]:
    return [(t, m) for t in task_names() for m in METHODS if accepts(config(t, m))]


def runnable(config: Callable[[str, str], TrainConfig]) -> list[tuple[str, str]]:
    """Every pair that is accepted and builds."""
    return [(t, m) for t, m in accepted(config) if builds(config(t, m))]
