"""Task registry: a task is one package here whose ``__init__`` defines ``TASK`` (an
``apg.blocks.TaskSpec``).

Packages are imported on first use, so a task's heavy dependencies (MNIST files, say)
cost nothing to the others. Adding a task is one package plus one line below (and its
params section).
"""

from __future__ import annotations

import importlib
import importlib.util

from apg.blocks import TaskSpec

_MODULES = {"gmm": "apg.tasks.gmm", "dgmm": "apg.tasks.dgmm", "bmnist": "apg.tasks.bmnist"}


def task_names() -> list[str]:
    """Names of the registered tasks whose package is present."""
    return [name for name, module in _MODULES.items() if importlib.util.find_spec(module) is not None]


def get_task(name: str) -> TaskSpec:
    """The ``TaskSpec`` registered as ``name``; raises ``ValueError`` for unknown names."""
    if name not in task_names():
        raise ValueError(f"unknown task {name!r}; choose one of {task_names()}")
    return importlib.import_module(_MODULES[name]).TASK
