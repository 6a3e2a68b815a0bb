"""The training loop one trial runs, and held-out evaluation.

No Ray, no MLflow, no files here: ``Trainer`` yields metrics and exposes its state, and
whoever drives it (the CLI, a Ray Tune trial) decides what to log and when to checkpoint.
Seeding is the caller's job too (entry points seed; library code never does).

Legend: M datasets in a file, B datasets per batch, K sweeps, L particles.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from apg.baselines import Method, get_method
from apg.blocks import Model, Proposals
from apg.data import Rows
from apg.host import values_on_host
from apg.metrics import importance_log_evidence, inclusive_kl, reconstruction_mse, sweep_curves
from apg.smc.resampling import get_resampler
from apg.smc.sampler import RESAMPLE_MODES
from apg.smc.weights import DegenerateWeightsError
from apg.tasks import get_task

LR_SCHEDULES = ("constant", "cosine")


def learning_rate(cfg: TrainConfig, iteration: int) -> float:
    """The rate of step ``iteration`` (0-based) under ``cfg.lr_schedule``."""
    if cfg.lr_schedule == "constant" or cfg.iterations <= 1:
        return cfg.lr
    # The cosine spans the first (1 - lr_hold_fraction) of the steps and reaches the floor at
    # its last one; the rest hold the floor.
    decay_steps = max(round(cfg.iterations * (1.0 - cfg.lr_hold_fraction)), 2)
    frac = min(iteration / (decay_steps - 1), 1.0)
    floor = cfg.lr * cfg.lr_final_factor
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite, or every particle of a dataset lost its weight."""


class CompiledGradientsLost(RuntimeError):
    """The compiled step left a parameter without the gradient the eager step gives it."""


@dataclass(kw_only=True)
class TrainConfig:
    """Everything that defines one training run (one cell of a sweep).

    The cell's numbers have no defaults here: the pipeline takes every one from a cell of
    params.yaml (the one home of defaults), and a library caller states them. What has a
    default is the plain algorithm, which params.yaml may change per task."""

    task: str
    method: str
    sweeps: int  # K
    particles: int  # L
    batch_size: int  # B
    iterations: int
    lr: float
    # "constant", or "cosine": lr decays along a half cosine to lr * lr_final_factor at the
    # last iteration. A decayed rate is what lets the stochastic objective settle on a plateau
    # within a CPU-sized budget (a constant rate keeps the weights jittering at its noise level).
    lr_schedule: str = "constant"
    lr_final_factor: float = 0.01
    # cosine only: the last fraction of the steps trains at the floor rate. While the rate
    # still falls, the training curves rise with it (less gradient noise), whether or not
    # more steps would help; a trend while the rate holds still is one more steps would
    # extend, which is what the report's plateau test looks for in the last fifth.
    lr_hold_fraction: float = 0.0
    resample_mode: str = "block"
    resampler: str = "systematic"
    model: dict[str, Any] = field(default_factory=dict)  # task hyperparameters
    network: dict[str, Any] = field(default_factory=dict)  # proposal hyperparameters
    method_options: dict[str, Any] = field(default_factory=dict)  # the method's own knobs (Method.defaults)
    # The step's sampler and loss as one torch.compile graph (fullgraph; CUDA graphs on a
    # GPU), compiled at the first step: the path of a GPU trial. Random draws then come from
    # torch's generators instead of apg.random's CPU Philox streams, so it is part of the cell.
    compile: bool = False

    def validate(self) -> TrainConfig:
        """Raise ``ValueError`` naming the first bad field; return self."""
        task = get_task(self.task)
        if not isinstance(self.method_options, dict):
            raise ValueError(f"method_options must be a mapping, got {self.method_options!r}")
        make_method(self).check_task(task)
        check_budget(self.sweeps, self.particles)
        _check_int("batch_size", self.batch_size, 1)
        _check_int("iterations", self.iterations, 0)
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not (isinstance(self.lr_final_factor, (int, float)) and 0 <= self.lr_final_factor <= 1):
            raise ValueError(f"lr_final_factor must be in [0, 1], got {self.lr_final_factor!r}")
        if not (isinstance(self.lr_hold_fraction, (int, float)) and 0 <= self.lr_hold_fraction < 1):
            raise ValueError(f"lr_hold_fraction must be in [0, 1), got {self.lr_hold_fraction!r}")
        if self.resample_mode not in RESAMPLE_MODES:
            raise ValueError(f"resample_mode must be one of {RESAMPLE_MODES}, got {self.resample_mode!r}")
        get_resampler(self.resampler)
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true or false, got {self.compile!r}")
        why = make_method(self).not_compiled_because
        if self.compile and why:
            raise ValueError(f"method {self.method!r} cannot be compiled: {why}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown training option(s) {unknown}; known: {sorted(names)}")
        return cls(**d)


def _read(loss: Tensor, values: dict[str, Tensor]) -> dict[str, float]:
    """``loss`` and ``values`` (detached) as floats, in one host read (float64 holds every float32)."""
    read = torch.stack([loss.double(), *(v.double() for v in values.values())]).tolist()
    return dict(zip(["loss", *values], read, strict=True))


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_budget(sweeps: int, particles: int) -> None:
    """Raise ``ValueError`` unless ``sweeps`` K >= 1 and ``particles`` L >= 2 are integers
    (one particle has no weights to compare)."""
    _check_int("sweeps (K)", sweeps, 1)
    _check_int("particles (L)", particles, 2)


def make_method(cfg: TrainConfig) -> Method:
    """The method named by ``cfg.method`` with ``cfg.method_options`` applied."""
    return get_method(cfg.method).configure(**cfg.method_options)


def build(cfg: TrainConfig, device: torch.device | str = "cpu") -> tuple[Model, Proposals]:
    """The task's model and the method's proposals for ``cfg``, on ``device``."""
    task = get_task(cfg.task)
    model = task.build_model(**cfg.model).to(device)
    proposals = make_method(cfg).build_proposals(task, model, **cfg.network).to(device)
    return model, proposals


class Trainer:
    """Adam on the method's surrogate loss over batches of training datasets.

    ``train_x``: ``(M, ...)`` training datasets, in memory or as ``apg.data.Rows``
    (read a batch at a time: from disk, or simulated); batches of ``cfg.batch_size`` are drawn without
    replacement, reshuffled every epoch.
    """

    def __init__(self, cfg: TrainConfig, train_x: Tensor | Rows, device: torch.device | str = "cpu"):
        self.cfg = cfg.validate()
        self.device = torch.device(device)
        self.method = make_method(cfg)
        self.model, self.proposals = build(cfg, self.device)
        params = [p for p in (*self.model.parameters(), *self.proposals.parameters()) if p.requires_grad]
        # Adam betas (0.9, 0.99) as in the paper's experiments. A method with nothing to
        # learn (exact Gibbs on a model without parameters) gets no optimizer: its steps
        # still run the sampler and report metrics, but take no gradient. fused updates
        # all tensors in one kernel (CPU and GPU): the default per-tensor loop costs ~1 ms
        # per step in dispatch on CPU, foreach's multi-tensor ops 0.50 ms, fused 0.18 ms.
        self.optimizer = (
            torch.optim.Adam(params, lr=cfg.lr, betas=(0.9, 0.99), fused=True) if params else None
        )
        # Kept in its stored dtype and cast per batch: a float16 video set at paper scale
        # would double in size if cast whole. Rows on disk (StoredRows) stay there.
        self.train_x = train_x.to(self.device) if isinstance(train_x, Tensor) else train_x
        self.iteration = 0
        self._last: tuple[Tensor, dict[str, Tensor]] | None = None
        self._order = torch.randperm(len(self.train_x))
        self._cursor = 0
        self._forward = self._loss_and_metrics
        self._gradients_checked = not cfg.compile  # a compiled trainer's first step checks them
        if cfg.compile:
            # One compiled trainer per process at a time: a sweep's actors train trials one
            # after another (Ray's reuse_actors), and every trainer's trace shares this
            # method's code, whose cache would pile up entries to dynamo's recompile limit
            # and then run eager. So a new trainer starts the cache afresh.
            torch._dynamo.reset()
            # A model whose block updates are too many to trace whole has the sampler compile
            # them one at a time; a method without block updates (RWS) still compiles whole.
            if self.model.compile_per_block and self.method.kernels:
                if not self.method.supports_compiled_units:
                    raise ValueError(
                        f"method {cfg.method!r} cannot be compiled on task {cfg.task!r}: the task's "
                        "block updates compile one at a time (run_apg(compiled=True)), which its run lacks"
                    )
                self._forward = functools.partial(self._loss_and_metrics, compiled=True)
            else:
                mode = "reduce-overhead" if self.device.type == "cuda" else None  # CUDA graphs
                self._forward = torch.compile(
                    self._loss_and_metrics, fullgraph=True, dynamic=False, mode=mode
                )

    def _next_batch(self) -> Tensor:
        size = min(self.cfg.batch_size, len(self.train_x))
        if self._cursor + size > len(self._order):
            self._order, self._cursor = torch.randperm(len(self.train_x)), 0
        idx = self._order[self._cursor : self._cursor + size]
        self._cursor += size
        if isinstance(self.train_x, Tensor):
            return self.train_x[idx.to(self.device)].to(torch.get_default_dtype())
        return self.train_x[idx].to(self.device, torch.get_default_dtype())

    def step(self, log: bool = True) -> dict[str, float] | None:
        """One gradient step. With ``log``: the scalar metrics of its final sweep, read back
        in one host read before the update. Without: nothing is read back from a device
        (``apg.host``), so on a GPU the step only queues its work. A non-finite loss raises
        ``TrainingDiverged`` before the update, at every step on a CPU and at logged steps
        on a device (a divergence between two logged steps shows at the second). On a GPU
        a logged step's ``step_seconds`` includes waiting for the unlogged steps queued
        before it."""
        start = time.perf_counter()
        x = self._next_batch()
        cfg = self.cfg
        try:
            if cfg.compile:
                # nn.LSTM (RWS-LSTM's encoder) is traced only with allow_rnn
                with torch._dynamo.config.patch(allow_rnn=True):
                    loss, values = self._forward(x)
            else:
                loss, values = self._forward(x)
        except DegenerateWeightsError as err:
            # NaN weights or proposals make every particle's weight NaN (zero): the same
            # divergence as a NaN loss, stopped before any update.
            raise TrainingDiverged(f"{err} at iteration {self.iteration + 1}") from err
        self._last = (loss.detach(), values)
        metrics = _read(*self._last) if log else None
        # Every step's loss is checked where reading it is free (apg.host); on a device only
        # the logged steps', so a divergence shows there and the weights may be NaN by then.
        value = (
            metrics["loss"] if metrics is not None else float(self._last[0]) if values_on_host(loss) else 0.0
        )
        if not math.isfinite(value):
            raise TrainingDiverged(
                f"loss became {value} at iteration {self.iteration + 1}; try a lower learning rate"
            )
        if self.optimizer is not None:
            lr = learning_rate(cfg, self.iteration)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if not self._gradients_checked:
                self._check_compiled_gradients(x)
            self.optimizer.step()
        self.iteration += 1
        if metrics is not None:
            metrics["step_seconds"] = time.perf_counter() - start
        return metrics

    def _check_compiled_gradients(self, x: Tensor) -> None:
        """Raise ``CompiledGradientsLost`` if the compiled step's gradients (in ``.grad``)
        miss a parameter that the eager step on the same batch trains.

        torch 2.11's compile silently zeroed the gradient of an autograd.Function whose
        output it had written in place: a GPU run then trained a decoder that never moved
        (docs/kernels.md). The draws differ between the two steps, so what is compared is only
        whether each parameter gets a gradient at all; any parameter the step uses gets one
        that is not exactly zero. One eager step and one host read, once per trainer; the
        random streams are left as they were, so the trial's draws do not change.
        """
        named = [
            (f"{owner}.{name}", p)
            for owner, module in (("model", self.model), ("proposals", self.proposals))
            for name, p in module.named_parameters()
            if p.requires_grad
        ]
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            loss, _ = self._loss_and_metrics(x)
            eager = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)

        def live(g: Tensor | None) -> Tensor:
            return g.ne(0).any() if g is not None else torch.zeros((), dtype=torch.bool, device=self.device)

        flags = torch.stack(
            [torch.stack((live(e), live(p.grad))) for e, (_, p) in zip(eager, named, strict=True)]
        )
        lost = [
            name
            for (name, _), (by_eager, by_compiled) in zip(named, flags.tolist(), strict=True)
            if by_eager and not by_compiled
        ]
        if lost:
            shown = ", ".join(lost[:5]) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
            raise CompiledGradientsLost(
                f"the compiled step gives no gradient to {len(lost)} of the {len(named)} parameters "
                f"that the eager step trains ({shown}) under torch {torch.__version__}; "
                "train this cell with train.compile: false"
            )
        self._gradients_checked = True

    def last_metrics(self) -> dict[str, float]:
        """The metrics of the last step, read back now (for a step run with ``log=False``
        that turns out to need logging, such as the last before a deadline)."""
        assert self._last is not None, "last_metrics() before any step"
        return _read(*self._last)

    def _loss_and_metrics(self, x: Tensor, compiled: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
        """The method's surrogate loss on batch ``x`` and its final sweep's scalar metrics
        (detached, still on the device): what ``torch.compile`` compiles when ``cfg.compile``,
        unless the model compiles per block (then the sampler is ``compiled``)."""
        cfg = self.cfg
        # the keyword only where it is set: the methods that cannot compile per block lack it
        per_block: dict[str, Any] = {"compiled": True} if compiled else {}
        result = self.method.run(
            self.model,
            self.proposals,
            x,
            cfg.sweeps,
            cfg.particles,
            cfg.resample_mode,
            cfg.resampler,
            **per_block,
        )
        last = result.sweeps[-1]
        values = {
            "log_joint": last.log_joint.mean(),
            "ess": last.ess.mean(),
            "log_evidence": last.log_evidence.mean(),
            # the method's own diagnostics, e.g. HMC-RWS's acceptance rate ``accept``
            **{k: v.float().mean() for k, v in self.method.diagnostics(result).items()},
        }
        return self.method.loss(result), {k: v.detach() for k, v in values.items()}

    def run(self, iterations: int | None = None, log_every: int = 1) -> Iterator[dict[str, float]]:
        """Train until ``iterations`` (default ``cfg.iterations``) steps are done in total;
        yields the metrics of every ``log_every``-th step and of the last."""
        total = self.cfg.iterations if iterations is None else iterations
        while self.iteration < total:
            done = self.iteration + 1
            metrics = self.step(log=done % log_every == 0 or done == total)
            if metrics is not None:
                yield metrics

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "proposals": self.proposals.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else {},
            "iteration": self.iteration,
            "order": self._order.clone(),
            "cursor": self._cursor,
            "rng": torch.get_rng_state(),
        }

    def weights(self) -> dict[str, Any]:
        """What a trained model needs (no optimizer moments or data order: a third of the
        bytes), in the layout of :meth:`state_dict`."""
        return {
            "model": self.model.state_dict(),
            "proposals": self.proposals.state_dict(),
            "iteration": self.iteration,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.proposals.load_state_dict(state["proposals"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.iteration = int(state["iteration"])
        self._order, self._cursor = state["order"].clone(), int(state["cursor"])
        torch.set_rng_state(state["rng"])


def network_device(model: Model, proposals: Proposals, x: Tensor) -> torch.device:
    """Where the trained networks live (``x``'s device for a method without parameters)."""
    return next(iter([*model.parameters(), *proposals.parameters()]), x.new_zeros(())).device


@torch.no_grad()
def evaluate(
    cfg: TrainConfig,
    model: Model,
    proposals: Proposals,
    x: Tensor,
    sweeps: int,
    particles: int,
    batch_size: int = 20,
    resample_mode: str = "block",
) -> dict[str, np.ndarray]:
    """Run the trained method on held-out datasets ``x (M, ...)``.

    Returns per-dataset metrics: curves over sweeps shaped ``(K, M)`` (``log_joint``,
    ``ess``, ``log_evidence``, ``ess_<block>``, and ``mse`` when the task can
    reconstruct, ``model_evals`` when the method counts its compute: cumulative likelihood
    evaluations per dataset, ``Method.model_evaluations``) and final-particle metrics shaped
    ``(M,)``: ``kl_<block>`` when the task has exact conditionals and the method has
    kernels, ``log_evidence_is``, the importance-sampled ``log p(x)`` from the method's
    initial proposal (encoder) with the same budget of ``sweeps * particles`` samples
    (Rezende et al. 2014, appendix E), and the method's own diagnostics (HMC-RWS: ``accept``).
    """
    check_budget(sweeps, particles)
    task = get_task(cfg.task)
    method = make_method(cfg)
    exact = task.exact_gibbs(model) if task.exact_gibbs is not None and method.kernels else None
    device = network_device(model, proposals, x)
    chunks: dict[str, list[np.ndarray]] = {}
    for start in range(0, len(x), batch_size):
        xb = x[start : start + batch_size].to(device, torch.get_default_dtype())
        mse: list[Tensor] = []
        collectors = []
        if task.reconstruct is not None:
            collectors.append(_mse_collector(task.reconstruct, model, xb, mse))
        result = method.run(model, proposals, xb, sweeps, particles, resample_mode, cfg.resampler, collectors)
        out = {k: torch.stack(v) for k, v in sweep_curves(result).items()}
        if mse:
            out["mse"] = torch.stack(mse)
        evals = method.model_evaluations(sweeps, particles)
        if evals is not None:
            out["model_evals"] = torch.tensor(evals, dtype=torch.float64)[:, None].expand(-1, xb.shape[0])
        out.update(method.diagnostics(result))
        if exact is not None and len(result.sweeps) > 1:
            for block, names in model.blocks.items():
                out[f"kl_{block}"] = inclusive_kl(
                    exact, proposals, block, names, xb, result.z, result.log_weights
                )
        out["log_evidence_is"] = importance_log_evidence(model, proposals, xb, sweeps * particles)
        for k, v in out.items():
            chunks.setdefault(k, []).append(v.cpu().numpy())
    return {k: np.concatenate(v, axis=-1) for k, v in chunks.items()}


def _mse_collector(reconstruct, model, x: Tensor, out: list[Tensor]):
    """A sweep collector that appends the weighted reconstruction MSE ``(B,)`` to ``out``."""

    def collect(sweep: int, z, log_w: Tensor) -> None:
        out.append(reconstruction_mse(x, reconstruct(model, x, z), log_w))

    return collect
