"""What the training code computes, as one short digest: a cell's numerics fingerprint.

A sweep cell is identified by its config, its data and this fingerprint instead of the
source text of the code that trains it: a rename, a moved function or a new comment keeps
every fingerprint and so every trained cell, while a change in what any kernel, network,
sampler or loss computes changes the fingerprint of exactly the configs that run it.

The fingerprint of a training config is a few optimizer steps of that config, shrunk
(``STEPS`` steps, at most ``MAX_SWEEPS`` sweeps, ``BATCH`` datasets) but otherwise as it
trains (its particles, networks, method options and learning rate), from a fixed seed, on
the datasets given (the pipeline passes the first rows of the cell's own training set).
What each step computes is read back: the loss, the step's metrics and the norm of the whole
gradient. These numbers, rounded to ``DIGITS`` significant digits, are hashed.

Why rounded, and to how many digits: the same code gives slightly different float32
results on other CPUs (the native kernels are built with ``-march=native -ffast-math``;
PyTorch picks its kernels by ISA), and a fingerprint should not retrain a cell on every
machine; yet it must see a real change. ``bench/fingerprint_stability.py`` computes the
numbers of every config of a params file under other arithmetic of the same code (the
kernels' PyTorch twins; the kernels built without ``-march=native`` and ``-ffast-math``;
one OpenMP thread). On the default and smoke params (17 configs each) the numbers moved by
at most 2.1e-4 relative, and at 4 digits 67 of the 68 (variant, config) fingerprints
agreed with the default build's (at 5 digits 54, at 6 digits 35); one thread against two
moved nothing. A change that moves any number by more than about 1e-3 relative always
changes the fingerprint (a 0.1% error in the GMM's log joint does, tests/test_fingerprint.py);
a smaller one may not, as it is within what two CPUs disagree on. Where two machines'
roundings part, the cell is retrained, never wrongly reused. docs/benchmarks.md
("Numerics fingerprint") has the table.
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
