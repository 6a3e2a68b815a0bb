"""Sequential Monte Carlo core: log-weights, resampling and the APG sweep loop."""

from apg.smc.resampling import RESAMPLERS, gather, get_resampler, resample
from apg.smc.sampler import APGResult, Step, SweepStats, run_apg
from apg.smc.weights import DegenerateWeightsError, ess, ess_fraction, log_evidence, log_mean_exp

__all__ = [
    "APGResult",
    "DegenerateWeightsError",
    "RESAMPLERS",
    "Step",
    "SweepStats",
    "ess",
    "ess_fraction",
    "gather",
    "get_resampler",
    "log_evidence",
    "log_mean_exp",
    "resample",
    "run_apg",
]
