"""The method interface, and APG itself (the method every baseline is compared with)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor

from apg.blocks import Model, Proposals, TaskSpec
from apg.objectives import apg_loss
from apg.smc.sampler import APGResult, Collector, run_apg


class Method:
    """A named inference method.

    ``architecture`` names the task proposals it trains; ``run`` spends a budget of
    ``sweeps x particles`` samples per dataset; ``loss`` is the surrogate to minimize.
    ``kernels`` says whether its proposals have block kernels (``q(z_b | x, z_-b)``),
    which the inclusive-KL metric (eq. 4) needs. ``options`` are the method's own knobs
    (``TrainConfig.method_options``), set by ``configure``.
    """

    name = "apg"
    architecture = "apg"
    kernels = True
    # Whether its training step traces into one graph (``TrainConfig.compile``); a method
    # whose step differentiates inside itself (``torch.autograd.grad``) names why not.
    not_compiled_because: str | None = None
    # Whether ``run`` takes ``compiled=True``: its sampler compiled unit by unit (``run_apg``),
    # for models whose step of block updates is too long to trace whole (``Model.compile_per_block``).
    supports_compiled_units = False
    # Option name -> default; ``configure`` accepts exactly these keys.
    defaults: Mapping[str, Any] = {}

    def __init__(self) -> None:
        self.options: dict[str, Any] = dict(self.defaults)

    def configure(self, **options: Any) -> Method:
        """A copy of this method with ``options`` set; raises ``ValueError`` for unknown
        names or bad values (``check_options``)."""
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            known = sorted(self.defaults) or "none"
            raise ValueError(
                f"method_options has unknown option(s) {unknown} for method {self.name!r}; known: {known}"
            )
        out = copy.copy(self)
        out.options = {**self.defaults, **options}
        out.check_options()
        return out

    def check_options(self) -> None:
        """Raise ``ValueError`` naming the first bad option value."""

    def check_task(self, task: TaskSpec) -> None:
        """Raise ``ValueError`` unless the method can run on ``task``."""
        if self.architecture not in task.architectures:
            raise ValueError(f"method {self.name!r} is not available for task {task.name!r}")

    def build_proposals(self, task: TaskSpec, model: Model, **network: Any) -> Proposals:
        """The proposals this method trains (default: the task's ``architecture``)."""
        return task.build_proposals(model, self.architecture, **network)

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
        # No ``compiled`` here: only a method that ``supports_compiled_units`` takes it (APG).
        raise NotImplementedError

    def loss(self, result: APGResult) -> Tensor:
        return apg_loss(result)

    def diagnostics(self, result: APGResult) -> Mapping[str, Tensor]:
        """The method's own per-dataset diagnostics of a run, ``{name: (B,)}`` (HMC-RWS: its
        acceptance rate ``accept``); training logs their means, evaluation keeps them."""
        return {}

    def model_evaluations(self, sweeps: int, particles: int) -> list[float] | None:
        """Compute spent per dataset by ``run``: cumulative likelihood evaluations after each
        sweep it reports (one entry per ``SweepStats``), or ``None`` when not counted.

        The unit is one evaluation of ``log p(x | z)`` over the whole dataset for one
        particle (for a video: every frame once); a gradient counts as two (forward and
        backward), and evaluating one block's Markov blanket counts as the share of the
        data it scores. The proposal networks' own cost is not counted.
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def apg_evaluations(sweeps: int, particles: int) -> list[float]:
    """``L (1 + 4 (k - 1))`` after sweep k: the initial log joint, then in every sweep each
    block's Markov blanket at its old and new value. In every task here the blankets of a
    sweep's blocks together score the data twice (GMM and rings: both blocks hold every
    point; Bouncing MNIST: ``what`` holds every frame, ``where_t`` frame t), hence 4 per sweep."""
    return [float(particles * (1 + 4 * (k - 1))) for k in range(1, sweeps + 1)]


class APG(Method):
    """The APG sampler: K sweeps (the first is the encoder) of L particles (section 2.2)."""

    supports_compiled_units = True

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
        compiled: bool = False,
    ) -> APGResult:
        return run_apg(
            model,
            proposals,
            x,
            sweeps,
            particles,
            resample_mode=resample_mode,
            resampler=resampler,
            collectors=collectors,
            compiled=compiled,
        )

    def model_evaluations(self, sweeps: int, particles: int) -> list[float]:
        return apg_evaluations(sweeps, particles)
