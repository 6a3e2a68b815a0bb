"""Reweighted wake-sleep with an encoder (the paper's MLP and LSTM baselines, section 5.1).

RWS is importance sampling from the encoder with the same self-normalized gradient
estimators (eqs. 5 and 6) at ``K = 1``. Compared at an equal sample budget, a cell of K
sweeps x L particles gives RWS ``K * L`` particles in its one step.
"""

from __future__ import annotations

from apg.baselines.method import Method
from apg.smc.sampler import run_apg


class RWS(Method):
    kernels = False

    def __init__(self, name: str, architecture: str):
        super().__init__()
        self.name = name
        self.architecture = architecture

    def run(
        self,
        model,
        proposals,
        x,
        sweeps,
        particles,
        resample_mode="block",
        resampler="systematic",
        collectors=(),
    ):
        return run_apg(model, proposals, x, 1, sweeps * particles, resampler=resampler, collectors=collectors)

    def model_evaluations(self, sweeps: int, particles: int) -> list[float]:
        return [float(sweeps * particles)]  # one log joint per particle
