"""The small interface between the sampler and a task.

A task is a generative model ``p_theta(x, z)`` whose latents are a dict of named
tensors, grouped into ordered *blocks*, together with neural proposals for each block.
The sampler (``apg.smc.sampler``) only ever sees this interface; tasks never import the
sampler and never resample.

Dimension letters used throughout the package:

    L  particles (samples per dataset)
    B  batch of independent datasets
    N  points in a dataset       I  mixture components / clusters
    T  frames in a video         D  digits in a video (BMNIST) or data dimension

Every latent tensor is shaped ``(L, B, ...)`` (particles first, then datasets) and
every log-density a task returns is summed over event dims to ``(L, B)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

Latents = dict[str, Tensor]


@runtime_checkable
class BlockDistribution(Protocol):
    """A distribution over the variables of one block.

    ``sample()`` draws the forward kernel; ``log_prob(old)`` scores any values of the
    same variables, which is how the sampler evaluates the reverse kernel (eq. 8).
    Samples are never reparameterized: APG's gradients (eq. 5) need only
    ``log_prob`` to be differentiable in the proposal's parameters.
    """

    def sample(self) -> Latents: ...

    def log_prob(self, value: Mapping[str, Tensor]) -> Tensor: ...


def propose(kernel: BlockDistribution, old: Mapping[str, Tensor]) -> tuple[Latents, Tensor, Tensor]:
    """A block update's draws and scores: ``(new, kernel.log_prob(new), kernel.log_prob(old))``
    for ``new = kernel.sample()``, the last without a graph (the reverse kernel enters only
    the detached weight).

    A distribution may define ``propose(old)`` returning the same (the same draws from the
    same random state, the same values and gradients, up to rounding) in fewer passes;
    otherwise this is ``propose_separately``.
    """
    fused = getattr(kernel, "propose", None)
    return fused(old) if fused is not None else propose_separately(kernel, old)


def propose_separately(
    kernel: BlockDistribution, old: Mapping[str, Tensor]
) -> tuple[Latents, Tensor, Tensor]:
    """``propose`` by ``sample`` and two ``log_prob`` calls."""
    new = kernel.sample()
    log_q_new = kernel.log_prob(new)
    with torch.no_grad():
        log_q_old = kernel.log_prob(old)
    return new, log_q_new, log_q_old


class Factorized:
    """Independent named torch distributions, each summed over its ``event_dims``.

    Parameters
    ----------
    parts:
        ``{name: (distribution, event_dims)}``; the distribution's batch shape is
        ``(L, B, *event)`` and the last ``event_dims`` dims are summed so that
        ``log_prob`` returns ``(L, B)``.
    """

    def __init__(self, parts: Mapping[str, tuple[torch.distributions.Distribution, int]]):
        self.parts = dict(parts)

    def sample(self) -> Latents:
        return {name: dist.sample() for name, (dist, _) in self.parts.items()}

    def log_prob(self, value: Mapping[str, Tensor]) -> Tensor:
        total: Tensor | None = None
        for name, (dist, event_dims) in self.parts.items():
            lp = dist.log_prob(value[name])
            if event_dims:
                lp = lp.sum(dim=tuple(range(-event_dims, 0)))
            total = lp if total is None else total + lp
        assert total is not None, "Factorized needs at least one part"
        return total


class BlockWindow(NamedTuple):
    """A block's update as an update of a smaller problem (``Model.block_window``).

    ``block``: the block's name there; ``x``: the data there (a view of the whole);
    ``names``: latent name there -> latent name in the whole problem, for every latent the
    update reads (the block's own included).
    """

    block: str
    x: Tensor
    names: dict[str, str]


class Model(nn.Module):
    """Base class of a task's generative model ``p_theta(x, z)``.

    Subclasses set ``blocks`` (ordered block name -> names of its latent variables)
    and implement ``log_joint``. ``log_blanket`` may be overridden to return only the
    factors that involve one block (its Markov blanket); the sampler needs no more
    than that for the incremental weight (eq. 9), so tasks with many blocks (one per
    frame) stay linear in their size.
    """

    blocks: dict[str, tuple[str, ...]] = {}
    # ``TrainConfig.compile`` compiles the sampler unit by unit (the initial proposal,
    # resampling, one graph per kind of block update: ``run_apg(compiled=True)``) instead
    # of the whole step as one graph, for methods with block updates: for models whose step
    # unrolls into more ops than a trace can take (Bouncing MNIST: T frames x K sweeps).
    compile_per_block: bool = False

    def blocks_for(self, x: Tensor) -> dict[str, tuple[str, ...]]:
        """The ordered blocks for data ``x``; the default is ``self.blocks``.

        Models whose block set depends on the size of the data (one block per video frame)
        override this, so that one trained model serves data of any size.
        """
        return self.blocks

    def block_window(self, block: str, x: Tensor) -> BlockWindow | None:
        """The smaller problem that holds everything ``block``'s update reads, or ``None``
        (the default: the whole problem).

        A compiled block update (``run_apg(compiled=True)``) is one graph per block name
        and input layout (names, shapes, strides); a model whose blocks differ only in where
        they sit (a video's frames) maps each to the same local block of a window of the
        data, so that one graph serves them all. The update in the window must equal the
        update in the whole problem exactly (the proposal and the log joint change read the
        same values). Windows are for models without per-particle caches
        (``log_joint_step``): the sampler raises where both meet.
        """
        return None

    def log_joint(self, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
        """``log p_theta(x, z)`` of shape ``(L, B)``."""
        raise NotImplementedError

    def log_blanket(self, block: str, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
        """Sum of the log-factors of ``p_theta(x, z)`` that involve ``block``, ``(L, B)``.

        Differences of this quantity between two values of the block equal differences
        of the log joint. The default is the whole log joint, which is always correct.
        """
        return self.log_joint(x, z)

    def log_joint_change(
        self, block: str, x: Tensor, z_old: Mapping[str, Tensor], z_new: Mapping[str, Tensor]
    ) -> Tensor:
        """``log p(x, z_new) - log p(x, z_old)`` for values that differ only in ``block``, ``(L, B)``.

        The sampler needs only this difference (eq. 9 and the running log joint). The
        default is the difference of the two blankets; a model whose two blankets share
        an expensive term (a network of latents the block does not contain) overrides it
        to compute that term once.
        """
        return self.log_blanket(block, x, z_new) - self.log_blanket(block, x, z_old)

    def log_joint_step(
        self, block: str, x: Tensor, z_old: Mapping[str, Tensor], z_new: Mapping[str, Tensor]
    ) -> tuple[Tensor, Latents]:
        """What ``run_apg`` calls at a block update: ``log_joint_change`` and per-particle
        caches for ``z_new``.

        Caches are values the model derives from the latents and would otherwise
        recompute at every block update (the rings' ``g_theta(alpha)``), named with a
        leading ``"_"``. The sampler keeps them with the particles, through resampling,
        and passes them back in ``z_old`` at the next block update; they never reach
        proposals or results, and a cache not returned again is dropped. The default
        keeps none.
        """
        return self.log_joint_change(block, x, z_old, z_new), {}


class Proposals(nn.Module):
    """Base class of a task's inference networks for one architecture.

    ``initial`` is the encoder ``q_phi(z | x)`` (the only proposal RWS uses);
    ``kernel`` is the conditional ``q_phi(z_b | x, z_-b)`` used both as forward and
    reverse kernel (eq. 8). Architectures without block kernels (RWS encoders) leave
    ``kernel`` unimplemented.
    """

    def initial(self, x: Tensor, num_particles: int) -> tuple[Latents, Tensor]:
        """Draw ``z ~ q_phi(z | x)`` for ``num_particles`` particles.

        Returns the sample (detached values shaped ``(L, B, ...)``) and its
        log-density ``(L, B)``, differentiable in phi. The initial proposal is only
        ever scored at its own sample, so it returns that score instead of a
        distribution object (it is usually a chain: globals, then locals given them).
        """
        raise NotImplementedError

    def kernel(self, block: str, x: Tensor, z: Mapping[str, Tensor]) -> BlockDistribution:
        """The conditional proposal ``q_phi(z_block | x, z_-block)``."""
        raise NotImplementedError(f"{type(self).__name__} has no kernel for block {block!r}")


def check_particles(name: str, t: Tensor, num_particles: int, batch: int) -> None:
    """Raise ``ValueError`` naming the tensor unless it is shaped ``(L, B, ...)``."""
    if t.dim() < 2 or t.shape[0] != num_particles or t.shape[1] != batch:
        raise ValueError(f"{name} must be shaped (L={num_particles}, B={batch}, ...), got {tuple(t.shape)}")


class TrackingSpec(NamedTuple):
    """What a task whose latents place objects in its data (Bouncing MNIST) adds to held-out
    evaluation: per-dataset errors of the positions one particle infers.

    Attributes
    ----------
    truth: ``(arrays) -> {name: array}``: from a held-out file's arrays, the simulator's
        positions the errors are measured against; raises ``ValueError`` with the reason
        (not naming the file) when the file lacks them.
    positions: ``(model, x, z) -> {name: array}``: the positions that one particle per
        dataset infers, numpy arrays with leading dim B; ``x (B, ...)`` the data, ``z`` the
        particle shaped ``(1, B, ...)``.
    errors: ``(truth, positions) -> {metric: (M,)}``: per-dataset errors of ``M`` datasets'
        positions against their truth.
    pictured: the names of ``truth``'s entries that are latents too, which sample pictures
        draw beside the inferred ones.
    """

    truth: Callable[[Mapping[str, Any]], dict[str, Any]]
    positions: Callable[..., dict[str, Any]]
    errors: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]
    pictured: tuple[str, ...] = ()


class ImputationSpec(NamedTuple):
    """How a task's held-out evaluation hides entries of its data and scores their imputation
    (``apg.imputation``); ``settings`` is the task's imputation settings (a mapping of keys
    such as ``fraction`` or ``occlusions``, as the pipeline's params give them).

    Attributes
    ----------
    masks: ``(settings, x) -> [(setting, mask)]``: the entries each setting hides, ``mask``
        bool shaped like ``x (M, ...)``; ``setting`` names it in tables.
    scores: ``(settings, x, mask, arrays, model, result) -> [(metric, (M,), iteration)]``: the
        errors of one chain's imputation (``result``: ``apg.imputation.Imputation``) against
        ``x``'s hidden entries, in the order they are recorded; ``arrays`` are the held-out
        file's (the truth beside ``x``, first ``M`` rows).
    check: optional ``(settings, model_hparams, test_set, where) -> None``: raise
        ``ValueError`` (one line, naming the key under ``where``) for settings that do not
        fit the model or the held-out set (a mapping with its ``name`` and simulator
        ``sizes``).
    description: what ``scores`` measures, in a sentence or two for the report's readers.
    figure_description: what the imputation figure draws of them, likewise.
    """

    masks: Callable[..., list[tuple[str, Tensor]]]
    scores: Callable[..., list[tuple[str, Any, int]]]
    check: Callable[..., None] | None = None
    description: str = ""
    figure_description: str = ""


class TaskSpec(NamedTuple):
    """What the rest of the package needs to know about a task (one per task module).

    Attributes
    ----------
    name: the task's name in params and on the command line.
    build_model: ``(**model_hparams) -> Model``.
    build_proposals: ``(model, architecture, **net_hparams) -> Proposals``; the
        architectures are ``"apg"`` (encoder plus block kernels) and the RWS encoders
        the task offers (``"mlp"``, ``"lstm"``).
    simulate: ``(model, num_datasets, generator, **sizes) -> {"x": (M, ...), ...}``; extra
        keys hold the true latents when known.
    architectures: the architecture names ``build_proposals`` accepts.
    data_dims: names of one dataset's dims, e.g. ``("N", "D")`` for points or ``("T",
        "H", "W")`` for a video; files of data are checked against this rank.
    exact_gibbs: optional ``(model) -> Proposals`` whose kernels are the exact Gibbs
        conditionals (conjugate models); enables the inclusive-KL metric (eq. 4).
    reconstruct: optional ``(model, x, z) -> (L, B, ...)`` mean of ``p(x | z)`` shaped
        like the data; enables the reconstruction-MSE metric and pictures.
    sample_data: optional ``(model, x, z) -> (L, B, ...)``: a draw of data from
        ``p_theta(x | z)``, shaped like ``x`` (which gives only the sizes). Every task here
        has entries of ``x`` independent given ``z``, so the draw's entries are draws from
        their own conditionals too: what imputation of missing entries redraws.
    draw: optional ``(ax, x, z) -> None``: draw one dataset ``x`` (numpy, no batch dim)
        with one sample ``z`` (numpy dict, no particle or batch dims) on a matplotlib axes;
        the report uses it for Figure 1/3-style sample pictures.
    animate: optional ``(model, x, z) -> uint8 array (frames, H, W, 3)`` for one dataset
        and one sample (torch, no particle or batch dims); the report writes it as a GIF.
    assignment_ceiling: optional ``(arrays) -> (M, N)``: the best-possible assignments of a
        held-out file's points from its true parameters (its arrays); enables the
        ``ari_ceiling`` metric.
    common_log_joint: optional ``(arrays, particle, model_hparams, sizes) -> (M,)``: the
        log joint of one particle per dataset (numpy dict, ``(M, ...)`` each) under one model
        common to every method (the simulator's), for tasks whose cells learn their own
        generative model; enables the ``log_joint_true`` metric.
    tracking: optional ``TrackingSpec``: position errors of the objects the latents place.
    imputation: optional ``ImputationSpec``: the hidden entries held-out imputation scores.
    """

    name: str
    build_model: Callable[..., Model]
    build_proposals: Callable[..., Proposals]
    simulate: Callable[..., dict[str, Tensor]]
    architectures: tuple[str, ...]
    data_dims: tuple[str, ...]
    exact_gibbs: Callable[..., Proposals] | None = None
    reconstruct: Callable[..., Tensor] | None = None
    sample_data: Callable[..., Tensor] | None = None
    draw: Callable[..., None] | None = None
    animate: Callable[..., Any] | None = None
    assignment_ceiling: Callable[[Mapping[str, Any]], Any] | None = None
    common_log_joint: Callable[..., Any] | None = None
    tracking: TrackingSpec | None = None
    imputation: ImputationSpec | None = None
