"""``TaskSpec.sample_data``: draws of data from ``p_theta(x | z)`` (what imputation redraws
missing entries from), checked against each task's likelihood within Monte Carlo error."""

from __future__ import annotations

import math

import torch

from apg.tasks import get_task
from apg.tasks.bmnist import where_key

DRAWS = 4000


def _standard_normal_within_mc_error(u: torch.Tensor) -> None:
    """``u``: standardized draws; their mean and variance are those of N(0, 1) within 4 SE."""
    n = u.numel()
    assert abs(u.mean().item()) < 4 / math.sqrt(n)
    assert abs(u.var().item() - 1) < 4 * math.sqrt(2 / n)


def test_gmm_draws_each_coordinate_from_its_clusters_normal():
    torch.manual_seed(0)
    spec = get_task("gmm")
    model = spec.build_model()
    truth = spec.simulate(model, 1, torch.Generator().manual_seed(1), num_points=30)
    z = {k: truth[k].expand(DRAWS, *truth[k].shape) for k in ("c", "mu", "tau")}
    z = {k: v if k == "c" else v.float() for k, v in z.items()}
    x = truth["x"].float()
    draws = spec.sample_data(model, x, z)
    assert draws.shape == (DRAWS, 1, 30, 2)
    index = truth["c"].unsqueeze(-1).expand(1, 30, 2)
    mu, tau = truth["mu"].gather(1, index).float(), truth["tau"].gather(1, index).float()
    _standard_normal_within_mc_error((draws - mu) * tau.sqrt())


def test_rings_draws_are_the_mean_plus_the_likelihoods_noise():
    torch.manual_seed(0)
    spec = get_task("dgmm")
    model = spec.build_model()
    truth = spec.simulate(model, 1, torch.Generator().manual_seed(1), num_points=40)
    z = {k: truth[k].expand(200, *truth[k].shape) for k in ("mu", "c", "alpha")}
    z = {k: v if k == "c" else v.float() for k, v in z.items()}
    x = truth["x"].float()
    with torch.no_grad():
        draws = spec.sample_data(model, x, z)
        mean = spec.reconstruct(model, x, z)
    assert draws.shape == (200, 1, 40, 2)
    _standard_normal_within_mc_error((draws - mean) / model.cfg.noise)


def test_bmnist_draws_each_pixel_from_its_bernoulli():
    torch.manual_seed(0)
    spec = get_task("bmnist")
    model = spec.build_model()
    frames, digits = 2, 2
    x = torch.zeros(1, frames, model.cfg.canvas_size, model.cfg.canvas_size)
    one = {"z_what": torch.randn(1, 1, digits, model.cfg.z_what_dim)}
    one.update({where_key(t): torch.rand(1, 1, digits, 2) * 1.6 - 0.8 for t in range(1, frames + 1)})
    z = {k: v.expand(DRAWS, *v.shape[1:]) for k, v in one.items()}
    with torch.no_grad():
        draws = spec.sample_data(model, x, z)
        p = spec.reconstruct(model, x, one)[0].clamp(model.cfg.prob_eps, 1 - model.cfg.prob_eps)
    assert draws.shape == (DRAWS, 1, frames, model.cfg.canvas_size, model.cfg.canvas_size)
    assert set(draws.unique().tolist()) <= {0.0, 1.0}
    inside = p > 0.05  # pixels a digit covers
    assert inside.sum() > 100
    freq = draws.mean(0)
    z_scores = (freq - p)[inside] / (p * (1 - p) / DRAWS).sqrt()[inside]
    _standard_normal_within_mc_error(z_scores)
    assert freq[~inside].max() < 0.1
