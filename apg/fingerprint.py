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
gradient, the last two steps on a trainer resumed from a checkpoint; with them the learning rate
of the real schedule at five points and the optimizer's settings (:func:`numbers`). These
numbers, rounded to ``DIGITS`` significant digits, are hashed.

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
changes the fingerprint (a 0.1% error in the GMM's log joint does, tests/apg/test_fingerprint.py);
a smaller one may not, as it is within what two CPUs disagree on. Where two machines'
roundings part, the cell is retrained, never wrongly reused. docs/benchmarks.md
("Numerics fingerprint") has the table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from apg import training
from apg.checkpoint import load_checkpoint, save_checkpoint
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


def numbers(
    cfg: TrainConfig, x: Tensor, start: Callable[[int], None] | None = None
) -> list[tuple[str, float]]:
    """The named numbers the fingerprint hashes, unrounded.

    - Per step (``STEPS`` of them): the loss, the step's metrics (log joint, ESS, evidence,
      the method's diagnostics) and the norm of the whole gradient. The last two steps run on
      a trainer resumed from a checkpoint of the first (``apg.checkpoint``), as a restarted
      trial does, so the resume path is part of what is fingerprinted.
    - The learning rate of ``cfg``'s own schedule at five points of its real length (the
      shrunk run sees only its first steps) and the optimizer's settings.

    Few numbers on purpose: each is a chance for two machines' roundings to part.

    ``x``: ``(M, ...)`` datasets, ``M >= 1``; the first ``BATCH`` are used. ``start(seed)``
    seeds the run as the caller's entry point seeds a trial (default ``torch.manual_seed``);
    torch's, numpy's and Python's random states and torch's thread count are restored
    afterwards, so a caller's draws do not change."""
    if x.dim() == 0 or len(x) < 1:
        raise ValueError(f"a fingerprint needs at least one dataset, got x of shape {tuple(x.shape)}")
    small = shrunk(cfg)
    threads, np_state, py_state = torch.get_num_threads(), np.random.get_state(), random.getstate()
    out: list[tuple[str, float]] = []
    with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory() as tmp:
        torch.set_num_threads(1)
        try:
            (start or torch.manual_seed)(SEED)
            trainer = Trainer(small, x[:BATCH].clone())
            for step in range(STEPS):
                # Resumed from a checkpoint, as a restarted trial is, one step before the last
                # (whose forward pass then shows the resumed optimizer's update).
                if step == STEPS - 2:
                    saved = save_checkpoint(Path(tmp) / "resume.pt", small.to_dict(), trainer.state_dict())
                    trainer = Trainer(small, x[:BATCH].clone())
                    trainer.load_state_dict(load_checkpoint(saved)[1])
                metrics = trainer.step(log=True)
                assert metrics is not None
                metrics.pop("step_seconds")
                grads = [
                    p.grad.double().square().sum()
                    for m in (trainer.model, trainer.proposals)
                    for p in m.parameters()
                    if p.grad is not None
                ]
                metrics["grad_norm"] = float(torch.stack(grads).sum().sqrt()) if grads else 0.0
                out += [(f"{step}/{k}", v) for k, v in sorted(metrics.items())]
            last = max(cfg.iterations - 1, 0)
            for where, i in (
                ("0", 0),
                ("1/4", last // 4),
                ("1/2", last // 2),
                ("3/4", 3 * last // 4),
                ("end", last),
            ):
                out.append((f"lr/{where}", training.learning_rate(cfg, i)))
            if trainer.optimizer is not None:
                for key, value in sorted(trainer.optimizer.defaults.items()):
                    for j, v in enumerate(value if isinstance(value, (tuple, list)) else (value,)):
                        if isinstance(v, (bool, int, float)):
                            out.append((f"optimizer/{key}/{j}", float(v)))
        finally:
            torch.set_num_threads(threads)
            np.random.set_state(np_state)
            random.setstate(py_state)
    return out


def rounded(value: float, digits: int = DIGITS) -> str:
    """``value`` to ``digits`` significant digits, as text (``nan`` and ``inf`` kept)."""
    return f"{value:.{digits - 1}e}"


def fingerprint(cfg: TrainConfig, x: Tensor, start: Callable[[int], None] | None = None) -> str:
    """The numerics fingerprint of ``cfg`` on datasets ``x`` (12 hex digits); ``start`` as
    in :func:`numbers`."""
    payload: dict[str, Any] = {name: rounded(v) for name, v in numbers(cfg, x, start)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
