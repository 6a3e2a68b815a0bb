"""Several seeds of one cell trained in one process, each exactly as its own trial.

A cell's seeds differ only in their seed, so one process can train them side by side:
:class:`SeedTrainers` holds one :class:`~apg.training.Trainer` per seed, each built as a
separate trial builds it (after the caller's ``seed_fn(seed)``), so its initial weights and
data order are that trial's. Each seed's draws come from its own copy of the state of torch's
default generator (``apg.random``'s Philox keys included), swapped in around its step, so they
are the trial's draws too, and every number a seed gives is its trial's, bit for bit.

The seeds' steps run one after another, so a seed's step costs what its trial's does. A
forward folded over seeds (one call of each op for all S) is bounded by one trainer at S times
the batch, which on a CPU at one thread is 1.44 times faster per dataset than the trial at S=5
for the GMM and 1.46 times for the rings (docs/benchmarks.md, "Seeds in one process"), before
the per-seed work such a forward would add: the native kernels (``apg.kernels``) take one set
of weights per call and draw from one Philox key per call, and each seed's stream must give
its draws in its trial's order, so it would still call each such kernel and draw once per seed.

Legend: S seeds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from apg.data import Rows
from apg.training import TrainConfig, Trainer, TrainingDiverged


class _Stream:
    """One seed's copy of the default generators' state (torch's CPU generator, and the
    device's where the step runs on one), in force inside ``with``."""

    def __init__(self, device: torch.device):
        self.cuda = device if device.type == "cuda" else None
        self.state = self._get()

    def _get(self) -> tuple[Tensor, Tensor | None]:
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.cuda) if self.cuda else None

    def _set(self, state: tuple[Tensor, Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if self.cuda is not None:
            torch.cuda.set_rng_state(state[1], self.cuda)  # type: ignore[arg-type]

    def __enter__(self) -> None:
        self._outside = self._get()
        self._set(self.state)

    def __exit__(self, *exc: object) -> None:
        self.state = self._get()
        self._set(self._outside)  # the caller's generators as they were


class SeedTrainers:
    """Train the seeds ``seeds`` of one cell ``cfg`` on ``train_x`` in one process.

    ``seed_fn(seed)`` seeds torch before seed ``seed``'s trainer is built, as the caller's
    entry point seeds a trial (library code never seeds). Seed ``seeds[i]``'s trainer is
    ``trainers[i]``, a plain :class:`~apg.training.Trainer` (its ``weights()``,
    ``last_metrics()``, ``iteration``); :meth:`state_dict` gives what its trial would save.
    The compiled step (``cfg.compile``) is refused.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        train_x: Tensor | Rows,
        seeds: Sequence[int],
        device: torch.device | str = "cpu",
        seed_fn: Callable[[int], Any] = torch.manual_seed,
    ):
        if cfg.compile:
            # each compiled Trainer starts dynamo's caches afresh (torch._dynamo.reset()), which
            # would drop the graphs of the seeds built before it
            raise ValueError("seeds in one process train the eager step only: set train.compile: false")
        if not seeds or len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds must be distinct and at least one, got {list(seeds)}")
        self.cfg = cfg.validate()
        self.seeds = list(seeds)
        self.trainers: list[Trainer] = []
        self._streams: list[_Stream] = []
        for seed in self.seeds:
            seed_fn(seed)
            self.trainers.append(Trainer(cfg, train_x, device))
            self._streams.append(_Stream(torch.device(device)))  # where the trial's first step starts

    def step(self, log: bool = True) -> list[dict[str, float]] | None:
        """One step of every seed (``Trainer.step``), each in its own stream; with ``log``,
        their metrics in ``seeds``' order. A seed's divergence raises ``TrainingDiverged``
        naming the seed; the seeds before it have taken their step."""
        rows = []
        for seed, trainer, stream in zip(self.seeds, self.trainers, self._streams, strict=True):
            try:
                with stream:
                    rows.append(trainer.step(log))
            except TrainingDiverged as err:
                raise TrainingDiverged(f"seed {seed}: {err}") from err
        return [row for row in rows if row is not None] if log else None

    def state_dict(self, index: int) -> dict[str, Any]:
        """Seed ``seeds[index]``'s ``Trainer.state_dict()``, its ``rng`` the seed's stream:
        what its own trial would have saved."""
        with self._streams[index]:
            return self.trainers[index].state_dict()
