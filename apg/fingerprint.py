"""What the training code computes, as one short digest: a cell's numerics fingerprint.

A sweep cell is identified by its config, its data and this fingerprint instead of the
source text of the code that trains it: a rename, a moved function or a new comment keeps
every fingerprint and so every trained cell, while a change in what any kernel, network,
sampler or loss computes changes the fingerprint of exactly the configs that run it.

The fingerprint of a training config is a few optimizer steps of that config, shrunk
(``STEPS`` steps, at most ``MAX_SWEEPS`` sweeps, ``BATCH`` datasets) but otherwise as it
trains (its particles, networks, method options and learning rate), from a fixed seed, on
the datasets given (the pipeline passes the first rows of the cell's own training set).
What each step computes is read back: the loss, the step's metrics and the norm of every
parameter's gradient. These numbers, rounded to ``DIGITS`` significant digits, are hashed.

Why rounded, and to how many digits: the same code gives slightly different float32
results on other CPUs (the native kernels are built with ``-march=native -ffast-math``;
PyTorch picks its kernels by ISA), and a fingerprint must not retrain a cell on every
machine. The rounding must absorb those differences and still see any real change. The
measurement behind ``DIGITS`` is in docs/benchmarks.md ("Numerics fingerprint"): across
the native kernels against their PyTorch twins, one thread against two, and the kernels
built without ``-march=native``/``-ffast-math``, the largest relative difference of any
fingerprinted number was below ``1e-4``, so the 4-digit rounding absorbs it except when a
number lies within that distance of a rounding boundary (for such a number the two
machines then disagree and the cell is retrained, never wrongly reused).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import torch
from torch import Tensor

from apg.training import TrainConfig, Trainer

STEPS = 3
MAX_SWEEPS = 3
BATCH = 2
DIGITS = 4
SEED = 0


def shrunk(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` at the fingerprint's sizes: everything that selects code paths kept (task,
    method and its options, particles, networks, model, resampling, learning rate), only
    the number of steps, sweeps and datasets cut. Eager: a compiled cell's graph is what
    its own first step checks (``CompiledGradientsLost``); its flag stays in the cell id."""
    return dataclasses.replace(
        cfg,
        sweeps=min(cfg.sweeps, MAX_SWEEPS),
        batch_size=BATCH,
        iterations=STEPS,
        compile=False,
    )


def numbers(cfg: TrainConfig, x: Tensor) -> list[tuple[str, float]]:
    """The named numbers the fingerprint hashes, unrounded: per step the loss, the step's
    metrics (log joint, ESS, evidence, the method's diagnostics) and the norm of the whole
    gradient. Few numbers on purpose: each is a chance for two machines' roundings to part.

    ``x``: ``(M, ...)`` datasets, ``M >= 1``; the first ``BATCH`` are used. Torch's random
    state and thread count are restored afterwards, so a caller's draws do not change."""
    if x.dim() == 0 or len(x) < 1:
        raise ValueError(f"a fingerprint needs at least one dataset, got x of shape {tuple(x.shape)}")
    small = shrunk(cfg)
    threads = torch.get_num_threads()
    out: list[tuple[str, float]] = []
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(1)
        try:
            torch.manual_seed(SEED)
            trainer = Trainer(small, x[:BATCH].clone())
            params = [
                p for m in (trainer.model, trainer.proposals) for p in m.parameters() if p.requires_grad
            ]
            for step in range(STEPS):
                metrics = trainer.step(log=True)
                assert metrics is not None
                metrics.pop("step_seconds")
                grads = [p.grad.double().square().sum() for p in params if p.grad is not None]
                metrics["grad_norm"] = float(torch.stack(grads).sum().sqrt()) if grads else 0.0
                out += [(f"{step}/{k}", v) for k, v in sorted(metrics.items())]
        finally:
            torch.set_num_threads(threads)
    return out


def rounded(value: float, digits: int = DIGITS) -> str:
    """``value`` to ``digits`` significant digits, as text (``nan`` and ``inf`` kept)."""
    return f"{value:.{digits - 1}e}"


def fingerprint(cfg: TrainConfig, x: Tensor) -> str:
    """The numerics fingerprint of ``cfg`` on datasets ``x`` (12 hex digits)."""
    payload: dict[str, Any] = {name: rounded(v) for name, v in numbers(cfg, x)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
