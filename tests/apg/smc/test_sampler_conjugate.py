"""The sampler on its own, against an analytic posterior: a conjugate toy model that is
none of the paper's tasks.

Two scalar latents with a correlated Gaussian prior, observed together with Gaussian
noise: ``(a, b) ~ N(0, [[1, rho], [rho, 1]])``, ``x_i | a, b ~ N((a, b), s^2 I)``,
``i = 1..n``. The posterior is Gaussian with known mean and covariance, and each block's
Gibbs conditional is a known Gaussian. APG updates the blocks ``{a}`` and ``{b}`` in turn.

With the exact conditionals as kernels, every block update leaves the posterior
invariant and its incremental weight is 1: the weighted particles estimate the posterior
moments however poor the initial proposal is. With kernels that are wrong (shifted and
too wide), the weights (eq. 9: the reverse kernel over the forward one) still make the
estimates consistent. Every tolerance is the Monte Carlo error of independent replicate
runs (each dataset of the batch is a replicate of the same data), times 4.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.distributions import Normal

from apg.blocks import Factorized, Model, Proposals
from apg.smc.sampler import run_apg
from apg.smc.weights import normalized_weights
from tests.montecarlo import mean_se

RHO, NOISE, POINTS = 0.8, 1.0, 4
REPLICATES, PARTICLES = 40, 400


class CorrelatedPair(Model):
    """``p(a, b, x)`` of the module docstring; blocks ``a`` then ``b``."""

    blocks = {"a": ("a",), "b": ("b",)}

    def log_joint(self, x, z):
        a, b = z["a"], z["b"]  # (L, B)
        prior = Normal(0.0, 1.0).log_prob(a) + Normal(RHO * a, math.sqrt(1 - RHO**2)).log_prob(b)
        means = torch.stack([a, b], -1).unsqueeze(-2)  # (L, B, 1, 2)
        return prior + Normal(means, NOISE).log_prob(x).sum((-2, -1))


def posterior(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``(2,)`` and covariance ``(2, 2)`` of ``(a, b)`` given one dataset ``x (n, 2)``."""
    prior_precision = torch.linalg.inv(torch.tensor([[1.0, RHO], [RHO, 1.0]], dtype=torch.float64))
    precision = prior_precision + POINTS / NOISE**2 * torch.eye(2, dtype=torch.float64)
    cov = torch.linalg.inv(precision)
    return cov @ (x.sum(0) / NOISE**2), cov


class GaussianKernels(Proposals):
    """The initial proposal: independent ``N(0, 2^2)`` for both (ignoring the data and the
    correlation); each block's kernel: its Gibbs conditional under the posterior of each
    dataset, with the mean moved by ``shift`` conditional sds and the sd times ``widen``
    (``shift=0, widen=1``: the exact conditional)."""

    def __init__(self, x: torch.Tensor, shift: float = 0.0, widen: float = 1.0):
        super().__init__()
        moments = [posterior(d) for d in x]
        self.mean = torch.stack([m for m, _ in moments])  # (B, 2)
        self.cov = torch.stack([c for _, c in moments])  # (B, 2, 2)
        self.shift, self.widen = shift, widen

    def initial(self, x, num_particles):
        q = Normal(torch.zeros(num_particles, x.shape[0], dtype=x.dtype), 2.0)
        a, b = q.sample(), q.sample()
        return {"a": a, "b": b}, q.log_prob(a) + q.log_prob(b)

    def kernel(self, block, x, z):
        i, j = (0, 1) if block == "a" else (1, 0)
        other = z["b" if block == "a" else "a"]  # (L, B)
        var_i, var_j, cov_ij = self.cov[:, i, i], self.cov[:, j, j], self.cov[:, i, j]
        mean = self.mean[:, i] + cov_ij / var_j * (other - self.mean[:, j])
        sd = torch.sqrt(var_i - cov_ij**2 / var_j)
        return Factorized({block: (Normal(mean + self.shift * sd, self.widen * sd), 0)})


def weighted_moments(result, name_a: str = "a", name_b: str = "b") -> np.ndarray:
    """Per replicate: the weighted means of a, b and a*b, ``(B, 3)``."""
    w = normalized_weights(result.log_weights)  # (L, B)
    a, b = result.z[name_a], result.z[name_b]
    return torch.stack([(w * a).sum(0), (w * b).sum(0), (w * a * b).sum(0)], -1).numpy()


@pytest.fixture
def data():
    torch.manual_seed(0)
    one = Normal(torch.tensor([0.7, -0.4], dtype=torch.float64), NOISE).sample((POINTS,))  # (n, 2)
    return one.expand(REPLICATES, -1, -1).clone()


@pytest.mark.parametrize(
    "shift, widen, resample_mode",
    [(0.0, 1.0, "block"), (0.5, 1.6, "block"), (0.5, 1.6, "sweep"), (0.0, 1.0, "none")],
)
def test_apg_estimates_the_analytic_posterior_moments(data, shift, widen, resample_mode):
    torch.manual_seed(1)
    model, kernels = CorrelatedPair(), GaussianKernels(data, shift, widen)
    with torch.no_grad():
        result = run_apg(model, kernels, data, 6, PARTICLES, resample_mode=resample_mode)
    mean, cov = posterior(data[0])
    truth = np.array([mean[0], mean[1], cov[0, 1] + mean[0] * mean[1]])
    estimates = weighted_moments(result)
    for k, name in enumerate(("E[a]", "E[b]", "E[ab]")):
        m, se = mean_se(estimates[:, k])
        assert abs(m - truth[k]) < 4 * se + 1e-3, f"{name}: {m:.4f} against {truth[k]:.4f} (se {se:.4f})"


def test_exact_kernels_have_unit_incremental_weights(data):
    # At the exact conditional the forward and reverse kernels cancel the joint's change:
    # every block update's ESS stays where resampling left it, at L.
    torch.manual_seed(2)
    with torch.no_grad():
        result = run_apg(CorrelatedPair(), GaussianKernels(data), data, 4, PARTICLES, resample_mode="block")
    w = normalized_weights(result.log_weights)
    np.testing.assert_allclose((1.0 / (w**2).sum(0)).numpy(), PARTICLES, rtol=1e-6)


def test_the_evidence_estimate_is_unbiased(data):
    # E[Z_hat] = p(x): the mean of Z_hat / p(x) over replicates is 1 within its error.
    torch.manual_seed(3)
    with torch.no_grad():
        result = run_apg(
            CorrelatedPair(), GaussianKernels(data, 0.5, 1.6), data, 3, 50, resample_mode="block"
        )
    x = data[0]
    prior_cov = torch.tensor([[1.0, RHO], [RHO, 1.0]], dtype=torch.float64)
    marginal = torch.distributions.MultivariateNormal(
        torch.zeros(2 * POINTS, dtype=torch.float64),
        torch.kron(torch.ones(POINTS, POINTS, dtype=torch.float64), prior_cov)
        + NOISE**2 * torch.eye(2 * POINTS, dtype=torch.float64),
    )
    log_px = marginal.log_prob(x.reshape(-1))
    ratio = torch.exp(result.log_evidence - log_px).numpy()
    m, se = mean_se(ratio)
    assert abs(m - 1.0) < 4 * se + 1e-3, f"E[Z_hat / p(x)] = {m:.4f} (se {se:.4f})"
