"""Checked loading of what a run reads: a dataset file's ``x`` against its task, and a
trained checkpoint's networks against their config.

Every failure raises a ``ValueError`` subclass (``DatasetError``, ``CheckpointError``) with
a one-line message, so an entry point can stop before any training starts. Files are read
through :mod:`apg.data` and :mod:`apg.checkpoint` only.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from apg.baselines import METHODS
from apg.blocks import Model, Proposals
from apg.checkpoint import CheckpointError, load_checkpoint
from apg.data import DatasetError, StoredRows, load_dataset, training_rows
from apg.tasks import get_task
from apg.training import TrainConfig, build, make_method


def load_task_data(task: str, path: str | os.PathLike, model_hparams: dict[str, Any] | None = None) -> Tensor:
    """Load ``x`` from a dataset file, cast to the default dtype, and check that the task's
    model accepts it (see :func:`check_task_data`)."""
    x = torch.from_numpy(load_dataset(path)["x"]).to(torch.get_default_dtype())
    check_task_data(task, x, path, model_hparams)
    return x


def load_training_rows(
    task: str, path: str | os.PathLike, model_hparams: dict[str, Any] | None = None
) -> Tensor | StoredRows:
    """:func:`training_rows` of a dataset file, checked like :func:`load_task_data`."""
    x = training_rows(path)
    check_task_data(task, x, path, model_hparams)
    return x


def check_task_data(
    task: str, x: Tensor | StoredRows, path: str | os.PathLike, model_hparams: dict[str, Any] | None = None
) -> None:
    """Raise ``DatasetError`` unless the task's model accepts ``x`` (read from ``path``).

    The task interface has no declared event shape, so the check is generic: the data
    must have the rank of a simulated dataset, and one short run of the model and an
    untrained proposal on the first dataset must succeed.
    """
    spec = get_task(task)
    model = spec.build_model(**(model_hparams or {}))
    if len(x.shape) != 1 + len(spec.data_dims):
        want = ", ".join(["M", *spec.data_dims])
        raise DatasetError(
            f"dataset file {path}: 'x' must be shaped like ({want}) for task {task}, got {tuple(x.shape)}"
        )
    architecture = spec.architectures[0]
    proposals = spec.build_proposals(model, architecture)
    method = next(m for m in METHODS.values() if m.architecture == architecture)
    # Files may store x in a compact dtype (``data.x_dtype``, e.g. float16): cast back.
    first = x[torch.zeros(1, dtype=torch.long)].to(torch.get_default_dtype())
    if not torch.isfinite(first).all():  # a file read a batch at a time is not scanned whole
        raise DatasetError(f"dataset file {path}: 'x' contains NaN or infinite values (dataset 0)")
    try:
        with torch.no_grad():
            method.run(model, proposals, first, 1, 2)
    except (RuntimeError, ValueError, IndexError) as err:
        raise DatasetError(
            f"dataset file {path}: 'x' shaped {tuple(x.shape)} does not fit task {task}"
            f"{_example_note(task, model_hparams or {})}: {_first_line(err)}"
        ) from None


def _example_note(task: str, model_hparams: dict[str, Any]) -> str:
    """`` (a simulated one is (1, ...))`` for an error message, or nothing where the
    simulator cannot run here (Bouncing MNIST without the MNIST files): a file that fits
    is loaded without ever simulating."""
    try:
        return f" (a simulated one is {tuple(_example_x(task, model_hparams).shape)})"
    except Exception:  # noqa: BLE001 - only decorates an error already being raised
        return ""


_EXAMPLES: dict[str, Tensor] = {}


def _example_x(task: str, model_hparams: dict[str, Any]) -> Tensor:
    """One simulated dataset at the task's default sizes, cached per process: some
    simulators are costly to start (Bouncing MNIST reads and checksums MNIST)."""
    key = f"{task}:{sorted(model_hparams.items())!r}"
    if key not in _EXAMPLES:
        spec = get_task(task)
        with torch.no_grad():
            _EXAMPLES[key] = spec.simulate(
                spec.build_model(**model_hparams), 1, torch.Generator().manual_seed(0)
            )["x"]
    return _EXAMPLES[key]


def with_network(
    cfg: TrainConfig,
    model: Model,
    proposals: Proposals,
    overrides: dict[str, Any] | None,
    device: torch.device | str = "cpu",
) -> tuple[TrainConfig, Proposals]:
    """``(cfg, proposals)`` with proposal-network keyword ``overrides`` (e.g. the number of
    objects to track in a held-out set), loading the trained weights into the rebuilt
    networks. Overrides must not change any weight's shape (``CheckpointError`` otherwise)."""
    if not overrides or all(cfg.network.get(k) == v for k, v in overrides.items()):
        return cfg, proposals
    cfg = TrainConfig.from_dict({**cfg.to_dict(), "network": {**cfg.network, **overrides}}).validate()
    rebuilt = make_method(cfg).build_proposals(get_task(cfg.task), model, **cfg.network).to(device)
    try:
        rebuilt.load_state_dict(proposals.state_dict())
    except RuntimeError as err:
        raise CheckpointError(
            f"network overrides {overrides} change the trained weights' shapes ({_first_line(err)})"
        ) from None
    rebuilt.eval()
    return cfg, rebuilt


def load_trained(
    path: str | os.PathLike, device: torch.device | str = "cpu"
) -> tuple[TrainConfig, Model, Proposals]:
    """``(cfg, model, proposals)`` from a checkpoint written by ``train`` or a sweep."""
    config, state = load_checkpoint(path, map_location=device)
    try:
        cfg = TrainConfig.from_dict(config).validate()
        model, proposals = build(cfg, device)
        model.load_state_dict(state["model"])
        proposals.load_state_dict(state["proposals"])
    except (KeyError, TypeError, RuntimeError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint file {path} does not match its config ({_first_line(err)})"
        ) from None
    model.eval()
    proposals.eval()
    return cfg, model, proposals


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
