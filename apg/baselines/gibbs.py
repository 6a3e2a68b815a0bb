"""Population Gibbs samplers: the exact reference and its "bootstrapped" variant.

``gibbs``: the APG sampler (section 2.2) with the task's exact Gibbs conditionals as
block kernels (``TaskSpec.exact_gibbs``). With exact kernels every incremental weight
(eq. 9) is 1, so this is the limit that learned APG proposals should approach; it has
nothing to learn.

``gibbs-bootstrap``: globals proposed from their prior (a bootstrap proposal, the
incremental weight is then the likelihood ratio), locals from the learned conditional
proposal of the task's ``apg`` architecture, trained by eq. 5 as in APG. A sanity
baseline: it shows what the learned global kernel buys.

Legend: L particles, B datasets; latents ``(L, B, ...)``, log-densities ``(L, B)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from apg.baselines.method import APG
from apg.blocks import BlockDistribution, Latents, Model, Proposals, TaskSpec
from apg.objectives import theta_loss
from apg.smc.sampler import APGResult


class ExactGibbs(APG):
    """Population Gibbs with the exact conditionals (no learned proposals): APG's sampler
    and budget with other kernels."""

    name = "gibbs"
    architecture = "exact"

    def check_task(self, task: TaskSpec) -> None:
        if task.exact_gibbs is None:
            raise ValueError(
                f"method {self.name!r} needs exact Gibbs conditionals, and task {task.name!r} has none "
                "(TaskSpec.exact_gibbs is None)"
            )

    def build_proposals(self, task: TaskSpec, model: Model, **network: Any) -> Proposals:
        self.check_task(task)
        assert task.exact_gibbs is not None
        return task.exact_gibbs(model)

    def loss(self, result: APGResult) -> Tensor:
        # The kernels have no parameters, so eq. 5 is void; eq. 6 still trains a model
        # that has parameters (for a model without, ``Trainer`` takes no step at all).
        return theta_loss(result)


class BootstrapProposals(Proposals):
    """Globals from ``model.prior_globals``; every other block from ``learned.kernel``.

    The global block is the block whose variables the prior draws. ``learned`` holds the
    task's ``apg`` proposals; only its local kernels are used (its encoder and global
    kernel stay untrained and cost nothing but memory).
    """

    def __init__(self, model: Model, learned: Proposals):
        super().__init__()
        prior = getattr(model, "prior_globals", None)
        if not callable(prior):
            raise ValueError(
                f"method 'gibbs-bootstrap' needs a model with a prior_globals(batch_shape, like) method; "
                f"{type(model).__name__} has none"
            )
        self.model = model
        self.learned = learned

    def _prior(self, x: Tensor, num_particles: int) -> BlockDistribution:
        return self.model.prior_globals((num_particles, x.shape[0]), x)  # type: ignore[operator]

    def _global_block(self, x: Tensor) -> str:
        """The block whose variables are exactly those the prior draws."""
        names = set(self._prior(x[:1], 1).sample())
        for block, variables in self.model.blocks_for(x).items():
            if set(variables) == names:
                return block
        raise ValueError(f"no block of the model holds exactly the prior's variables {sorted(names)}")

    def initial(self, x: Tensor, num_particles: int) -> tuple[Latents, Tensor]:
        prior = self._prior(x, num_particles)
        z = prior.sample()
        log_q = prior.log_prob(z)
        global_block = self._global_block(x)
        for block in self.model.blocks_for(x):
            if block == global_block:
                continue
            kernel = self.learned.kernel(block, x, z)
            proposed = kernel.sample()
            log_q = log_q + kernel.log_prob(proposed)
            z = {**z, **proposed}
        return z, log_q

    def kernel(self, block: str, x: Tensor, z: Mapping[str, Tensor]) -> BlockDistribution:
        if block == self._global_block(x):
            # A kernel that ignores the current state: eq. 9 becomes the likelihood ratio.
            return self._prior(x, next(iter(z.values())).shape[0])
        return self.learned.kernel(block, x, z)


class BootstrapGibbs(APG):
    """Bootstrapped population Gibbs: prior for the globals, learned local kernels (APG's
    sampler, budget and loss)."""

    name = "gibbs-bootstrap"
    architecture = "apg"

    def build_proposals(self, task: TaskSpec, model: Model, **network: Any) -> Proposals:
        return BootstrapProposals(model, task.build_proposals(model, self.architecture, **network))
