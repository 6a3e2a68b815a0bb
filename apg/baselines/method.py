"""The method interface, and APG itself (the method every baseline is compared with)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from apg.blocks import Model, Proposals
from apg.objectives import apg_loss
from apg.smc.sampler import APGResult, Collector, run_apg


class Method:
    """A named inference method.

    ``architecture`` names the task proposals it trains; ``run`` spends a budget of
    ``sweeps x particles`` samples per dataset; ``loss`` is the surrogate to minimize.
    """

    name = "apg"
    architecture = "apg"

    def run(
        self,
        model: Model,
        proposals: Proposals,
        x: Tensor,
        sweeps: int,
        particles: int,
        resample_mode: str = "block",
        resampler: str = "systematic",
        collectors: Iterable[Collector] = (),
    ) -> APGResult:
        raise NotImplementedError

    def loss(self, result: APGResult) -> Tensor:
        return apg_loss(result)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class APG(Method):
    """The APG sampler: K sweeps (the first is the encoder) of L particles (section 2.2)."""

    def run(self, model, proposals, x, sweeps, particles, resample_mode="block", resampler="systematic", collectors=()):
        return run_apg(
            model, proposals, x, sweeps, particles,
            resample_mode=resample_mode, resampler=resampler, collectors=collectors,
        )
