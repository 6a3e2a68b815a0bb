"""The amortized population Gibbs sampler (paper section 2.2, last algorithm).

An initial proposal from the encoder, then ``K - 1`` sweeps; each sweep updates every
block with its learned conditional proposal, which also serves as the reverse kernel
(eq. 8), so the incremental weight is eq. 9. The same run accumulates the
self-normalized surrogate losses of eq. 5 (proposals) and eq. 6 (generative model) at
the initial step and after every block update. RWS is this loop with ``K = 1``.

Legend: L particles, B datasets; latents ``(L, B, ...)``, log-weights ``(L, B)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from apg.blocks import Latents, Model, Proposals, check_particles, propose
from apg.smc.resampling import get_resampler, resample
from apg.smc.weights import ess_fraction_of, log_evidence, normalized_weights, sanitize

RESAMPLE_MODES = ("block", "sweep", "none")

# State entries whose names start with "_" travel with the particles through resampling
# but are not latents: the running log joint, and values a model caches per particle
# (``Model.log_joint_step``). Proposals, collectors and results never see them.
_LOG_JOINT = "__log_joint__"


def _latents(state: dict[str, Tensor]) -> Latents:
    return {k: v for k, v in state.items() if not k.startswith("_")}


# Called after every sweep with (sweep number from 1, particles, log-weights).
Collector = Callable[[int, Latents, Tensor], None]


class SweepStats(NamedTuple):
    """Diagnostics after one sweep (sweep 1 is the initial proposal).

    Attributes
    ----------
    log_joint: ``(B,)`` self-normalized weighted ``log p(x, z)``.
    ess: ``(B,)`` ESS/L (eq. 11) of the weights accumulated since the last resampling,
        at the end of the sweep (with ``resample="sweep"`` this is the paper's overall
        ESS of a whole sweep).
    ess_blocks: block name -> ``(B,)`` ESS/L right after that block's update (with
        ``resample="block"`` these are the paper's per-block ESS).
    log_evidence: ``(B,)`` running estimate of ``log p(x)``.
    log_increments: block name -> ``(L, B)`` log incremental weights (eq. 9).
    """

    log_joint: Tensor
    ess: Tensor
    ess_blocks: dict[str, Tensor]
    log_evidence: Tensor
    log_increments: dict[str, Tensor]


class Step(NamedTuple):
    """What the gradient estimators need from one step (initial proposal or block update).

    weights: ``(L, B)`` self-normalized weights after the step, detached.
    log_q: ``(L, B)`` log-density of the values proposed at this step (phi's graph).
    log_joint: ``(L, B)`` ``log p(x, z)`` after the step (theta's graph).
    """

    weights: Tensor
    log_q: Tensor
    log_joint: Tensor


class APGResult(NamedTuple):
    """Output of ``run_apg``.

    Attributes
    ----------
    z: final particles, each ``(L, B, ...)``.
    log_weights: ``(L, B)`` final log-weights.
    log_joint: ``(L, B)`` ``log p(x, z)`` of the final particles (carries theta's graph).
    sweeps: one ``SweepStats`` per sweep, ``K`` in all.
    steps: the initial step and every block update, in order (see ``apg.objectives``).
    """

    z: Latents
    log_weights: Tensor
    log_joint: Tensor
    sweeps: list[SweepStats]
    steps: list[Step]

    @property
    def log_evidence(self) -> Tensor:
        return log_evidence(self.log_weights)


def run_apg(
    model: Model,
    proposals: Proposals,
    x: Tensor,
    num_sweeps: int,
    num_particles: int,
    *,
    resample_mode: str = "block",
    resampler: str = "systematic",
    blocks: Iterable[str] | None = None,
    collectors: Iterable[Collector] = (),
    compiled: bool = False,
) -> APGResult:
    """Run the APG sampler on a batch of datasets ``x`` shaped ``(B, ...)``.

    Parameters
    ----------
    num_sweeps: K >= 1; ``K = 1`` is importance sampling from the encoder (RWS).
    num_particles: L >= 1 particles per dataset.
    resample_mode: ``"block"`` resamples before every block update (the paper),
        ``"sweep"`` once before each sweep, ``"none"`` never (sequential IS).
    resampler: a name registered in ``apg.smc.resampling.RESAMPLERS``.
    blocks: the blocks to update and their order; default ``model.blocks_for(x)``.
    collectors: callables ``(sweep, z, log_w)`` run after every sweep, for diagnostics
        that need the particles themselves (reconstructions, say).
    compiled: run the initial proposal, each resampling and each block update as a
        ``torch.compile`` graph (``Model.compile_per_block``): one graph per distinct
        unit, reused at every sweep, and by every block that ``Model.block_window`` maps
        to the same local block. The bookkeeping between them stays eager (a few ops).
    """
    if num_sweeps < 1:
        raise ValueError(f"number of sweeps K must be >= 1, got {num_sweeps}")
    if num_particles < 1:
        raise ValueError(f"number of particles L must be >= 1, got {num_particles}")
    if resample_mode not in RESAMPLE_MODES:
        raise ValueError(f"resample_mode must be one of {RESAMPLE_MODES}, got {resample_mode!r}")
    resample_fn = get_resampler(resampler)
    model_blocks = model.blocks_for(x)
    block_names = list(model_blocks if blocks is None else blocks)
    for name in block_names:
        if name not in model_blocks:
            raise ValueError(f"unknown block {name!r}; the model has {list(model_blocks)}")

    units = compiled_units(cuda_graphs=x.device.type == "cuda") if compiled else _UNITS
    # Initial proposal: z ~ q(z | x), w = p(x, z) / q(z | x).
    z, log_q, log_p = units.initial(model, proposals, x, num_particles)
    log_w = sanitize((log_p - log_q).detach())
    # Per step (the initial one, then every block update): log-weights and the log-densities
    # of eq. 5 and 6; the steps' normalized weights are one softmax after the run.
    step_log_w, step_log_q, step_log_joint = [log_w], [log_q], [log_p]
    # Per sweep: log-weights, log joints and log increments; the diagnostics are computed
    # from them in one batch after the run (a few ops instead of a dozen per block update).
    sweep_increments: list[dict[str, Tensor]]
    sweep_log_w, sweep_log_joint, sweep_increments = [log_w], [log_p.detach()], [{}]
    collectors = list(collectors)
    for collect in collectors:
        collect(1, z, log_w)

    state: dict[str, Tensor] = {**z, _LOG_JOINT: log_p}
    for _ in range(1, num_sweeps):
        increments: dict[str, Tensor] = {}
        for i, block in enumerate(block_names):
            if resample_mode == "block" or (resample_mode == "sweep" and i == 0):
                log_w, state = units.resample(log_w, state, resample_fn, sanitized=True)
            z = {k: v for k, v in state.items() if k != _LOG_JOINT}  # with the model's caches
            proposed, change, caches, log_q_new, log_q_old = units.update(
                model, proposals, block, model_blocks[block], x, z
            )
            z_new = {**_latents(z), **proposed}
            # eq. 9: incremental weight p(x, z_b', z_-b) q(z_b | .) / (p(x, z_b, z_-b) q(z_b' | .))
            log_v = (change + log_q_old - log_q_new).detach()
            log_w = sanitize(log_w + log_v)
            # Keep the running joint exact and differentiable in theta.
            log_joint = state[_LOG_JOINT] + change
            state = {**z_new, **caches, _LOG_JOINT: log_joint}
            step_log_w.append(log_w)
            step_log_q.append(log_q_new)
            step_log_joint.append(log_joint)
            increments[block] = log_v
        sweep_log_w.append(log_w)
        sweep_log_joint.append(state[_LOG_JOINT].detach())
        sweep_increments.append(increments)
        for collect in collectors:
            collect(len(sweep_log_w), _latents(state), log_w)

    weights = normalized_weights(torch.stack(step_log_w, -1))  # (L, B, steps)
    steps = [Step(*parts) for parts in zip(weights.unbind(-1), step_log_q, step_log_joint, strict=True)]
    # Every block update's ESS, in one batch.
    block_ess = ess_fraction_of(weights[..., 1:]).unbind(-1)
    per_sweep = len(block_names)
    ess_blocks: list[dict[str, Tensor]] = [{}] + [
        dict(zip(block_names, block_ess[k * per_sweep : (k + 1) * per_sweep], strict=True))
        for k in range(num_sweeps - 1)
    ]
    sweeps = all_sweep_stats(sweep_log_w, sweep_log_joint, ess_blocks, sweep_increments)
    return APGResult(_latents(state), log_w, state[_LOG_JOINT], sweeps, steps)


def initial_step(
    model: Model, proposals: Proposals, x: Tensor, num_particles: int
) -> tuple[Latents, Tensor, Tensor]:
    """The encoder's draw ``z ~ q(z | x)``, its log-density and ``log p(x, z)``."""
    z, log_q = proposals.initial(x, num_particles)
    for name, t in z.items():
        check_particles(f"latent {name!r}", t, num_particles, x.shape[0])
    log_p = model.log_joint(x, z)
    check_particles("log_joint", log_p, num_particles, x.shape[0])
    return z, log_q, log_p


def block_update(
    model: Model, proposals: Proposals, block: str, names: Sequence[str], x: Tensor, z: Latents
) -> tuple[Latents, Tensor, Latents, Tensor, Tensor]:
    """One block update from particles ``z`` (latents and the model's caches): the block's
    new values ``z_b'`` (its latents ``names``), the log joint's change, the model's caches
    for the new particles, ``log q(z_b' | .)`` and the reverse kernel's ``log q(z_b | .)``."""
    latents = _latents(z)
    kernel = proposals.kernel(block, x, latents)
    old = {name: z[name] for name in names}
    # the forward kernel's draw and score, and the reverse kernel's score of the old values
    proposed, log_q_new, log_q_old = propose(kernel, old)
    # The joint changes only in the block's blanket (Model.log_joint_step).
    change, caches = model.log_joint_step(block, x, z, {**latents, **proposed})
    if any(not name.startswith("_") for name in caches):
        raise ValueError(f"model caches must be named with a leading '_', got {sorted(caches)}")
    return proposed, change, caches, log_q_new, log_q_old


class _Units(NamedTuple):
    """The pieces of ``run_apg`` that run as one graph each when it is ``compiled``."""

    initial: Callable[..., tuple[Latents, Tensor, Tensor]]
    resample: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    update: Callable[..., tuple[Latents, Tensor, Latents, Tensor, Tensor]]


_UNITS = _Units(initial_step, resample, block_update)


def update_in_window(
    update: Callable,
    model: Model,
    proposals: Proposals,
    block: str,
    names: Sequence[str],
    x: Tensor,
    z: Latents,
) -> tuple[Latents, Tensor, Latents, Tensor, Tensor]:
    """``update`` (``block_update``'s signature) run on ``block``'s window
    (``Model.block_window``; ``names`` then come from the window's own blocks), its results
    named as in the whole problem. The window's data and latents are contiguous copies (a
    few frames), so that its graph depends neither on the video's length nor on whether the
    latents are views (the encoder's positions are, before the first resampling)."""
    window = model.block_window(block, x)
    if window is None:
        return update(model, proposals, block, names, x, z)
    _check_no_caches(model, z)
    local = {here: z[there].contiguous() for here, there in window.names.items()}
    local_x = window.x.contiguous()
    local_names = model.blocks_for(local_x)[window.block]
    proposed, change, caches, log_q_new, log_q_old = update(
        model, proposals, window.block, local_names, local_x, local
    )
    _check_no_caches(model, caches)
    return {window.names[k]: v for k, v in proposed.items()}, change, {}, log_q_new, log_q_old


def _check_no_caches(model: Model, state: Latents) -> None:
    if any(name.startswith("_") for name in state):
        raise ValueError(
            f"{type(model).__name__} has both per-particle caches and block windows; windows need none"
        )


@functools.cache
def compiled_units(backend: str = "inductor", cuda_graphs: bool = False) -> _Units:
    """``run_apg``'s units compiled (``backend``: tests trace with ``"aot_eager"``, which
    runs the traced ops without generating code), each graph with CUDA graphs if
    ``cuda_graphs`` (``mode="reduce-overhead"``; ``run_apg`` asks for them on a GPU)."""
    # A step calls each graph several times (every sweep) while autograd still holds the
    # earlier calls' outputs, so CUDA graph trees record those calls as separate replays and
    # warn that they miss their fast path ("pending, uninvoked backwards"). They are still
    # worth it: Bouncing MNIST's APG step at the paper's sizes was 4.0 times slower without
    # them on an H200, is 0.126 s with them on an H100, and the cell trained with them learnt
    # as the eager one did (docs/benchmarks.md, "The compiled step on a GPU").
    mode = "reduce-overhead" if cuda_graphs else None
    compile_ = functools.partial(torch.compile, fullgraph=True, dynamic=False, backend=backend, mode=mode)
    update = functools.partial(update_in_window, compile_(block_update))
    return _Units(compile_(initial_step), compile_(resample), update)


def all_sweep_stats(
    log_ws: list[Tensor],
    log_joints: list[Tensor],
    ess_blocks: list[dict[str, Tensor]],
    increments: list[dict[str, Tensor]],
) -> list[SweepStats]:
    """``SweepStats`` of several sweeps at once, from each sweep's log-weights and log
    joints (``(L, B)`` each), per-block ESS and log increments."""
    with torch.no_grad():
        log_w = torch.stack(log_ws, -1)  # (L, B, K): ESS and evidence reduce over dim 0
        weights = normalized_weights(log_w)
        weighted = (weights * torch.stack(log_joints, -1).detach()).sum(0)
        columns = (weighted, ess_fraction_of(weights), log_evidence(log_w))
        rows = zip(*(c.unbind(-1) for c in columns), ess_blocks, increments, strict=True)
        return [SweepStats(lj, ess, blocks, ev, inc) for lj, ess, ev, blocks, inc in rows]


def sweep_stats(
    log_w: Tensor,
    log_joint: Tensor,
    ess_blocks: dict[str, Tensor] | None = None,
    increments: dict[str, Tensor] | None = None,
) -> SweepStats:
    """``SweepStats`` of particles with log-weights ``log_w`` and log joints ``log_joint``
    (both ``(L, B)``); also used by the baselines that report in the sampler's terms."""
    return all_sweep_stats([log_w], [log_joint], [ess_blocks or {}], [increments or {}])[0]
