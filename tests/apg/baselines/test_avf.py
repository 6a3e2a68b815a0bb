"""Amortized variational filtering: the free-energy gradient its inference model reads,
refinement towards the exact filtering posterior of a linear-Gaussian state-space model
(the Kalman filter), correct importance weights, and the Bouncing MNIST method itself."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from apg.baselines import get_method
from apg.baselines.avf import (
    Gaussian,
    IterativeUpdate,
    free_energy_grad,
    gaussian_kl,
    refine,
    variational_filter,
)
from apg.tasks import get_task
from apg.tasks.bmnist import where_key
from apg.training import TrainConfig, Trainer, evaluate

# Linear-Gaussian state-space model: z_1 ~ N(0, 1), z_t ~ N(A z_{t-1}, Q), x_t ~ N(z_t, R).
A, Q, R = 0.9, 0.5, 0.3
XS = [0.8, 1.5, 0.4, -0.3]


def kalman(xs: list[float]) -> tuple[float, float, float]:
    """Filtering mean and variance of z_T, and log p(x_{1:T})."""
    mean, var, log_px = 0.0, 1.0, 0.0
    for t, x in enumerate(xs):
        if t:
            mean, var = A * mean, A * A * var + Q
        log_px += Normal(mean, math.sqrt(var + R)).log_prob(torch.tensor(x)).item()
        gain = var / (var + R)
        mean, var = mean + gain * (x - mean), (1 - gain) * var
    return mean, var, log_px


def one_step_posterior(prior_loc: torch.Tensor, prior_var: float, x: float) -> tuple[torch.Tensor, float]:
    """p(z_t | z_{t-1}, x_t): the optimum of the step free energy over Gaussians."""
    var = 1.0 / (1.0 / prior_var + 1.0 / R)
    return var * (prior_loc / prior_var + x / R), var


def lg_predict(particles: int):
    """The prior p(z_t | z_{t-1}) for ``particles`` independent filters of one sequence."""

    def predict(t: int, prev):
        return (
            (A * prev, math.sqrt(Q))
            if prev is not None
            else (torch.zeros(particles, 1, 1, dtype=torch.float64), 1.0)
        )

    return predict


def lg_log_lik(t: int, z: torch.Tensor) -> torch.Tensor:
    return Normal(z, math.sqrt(R)).log_prob(torch.tensor(XS[t - 1], dtype=z.dtype)).sum(-1)


def gradient_descent(lr: float, decay: float = 0.0, period: int = 1):
    """An update rule with the inference model's signature: one gradient step, of size
    ``lr / (1 + decay * k)`` at the k-th of every ``period`` calls (a Robbins-Monro schedule
    for noisy gradients, restarted at every step of a filter with ``period`` iterations)."""
    calls = [0]

    def update(q: Gaussian, grad: Gaussian) -> Gaussian:
        step = lr / (1.0 + decay * (calls[0] % period))
        calls[0] += 1
        return Gaussian(q.loc - step * grad.loc, q.log_scale - step * grad.log_scale)

    return update


# --------------------------------------------------------------------------- the gradient


def test_free_energy_gradient_is_the_reparameterized_gradient():
    """The exact identity: with the same noise, the gradient equals the closed form of the
    one-sample reparameterized estimate, and the free energy its value."""
    torch.set_default_dtype(torch.float64)
    x, prior_loc, prior_scale = 0.7, torch.tensor([[[0.2]]]), 0.8
    q = Gaussian(torch.tensor([[[0.5]]]), torch.tensor([[[-0.4]]]))
    torch.manual_seed(3)
    value, grad = free_energy_grad(
        q, lambda z: Normal(z, math.sqrt(R)).log_prob(torch.tensor(x)).sum(-1), prior_loc, prior_scale
    )
    torch.manual_seed(3)
    eps = torch.randn_like(q.loc)
    s = q.log_scale.exp()
    z = q.loc + s * eps
    dlik_dz = (x - z) / R
    kl = gaussian_kl(q, prior_loc, prior_scale)
    expected = -Normal(z, math.sqrt(R)).log_prob(torch.tensor(x)).sum(-1) + kl
    assert torch.allclose(value, expected)
    assert torch.allclose(grad.loc, -dlik_dz + (q.loc - prior_loc) / prior_scale**2)
    assert torch.allclose(grad.log_scale, -dlik_dz * s * eps + s**2 / prior_scale**2 - 1.0)
    # and the KL is the closed form of KL(N(m, s^2) || N(m0, s0^2))
    closed = (
        math.log(prior_scale) - q.log_scale + (s**2 + (q.loc - prior_loc) ** 2) / (2 * prior_scale**2) - 0.5
    )
    assert torch.allclose(kl, closed.sum(-1))


def test_free_energy_gradient_is_unbiased():
    """Averaged over particles (independent one-sample estimates), the gradient matches the
    analytic gradient of the exact free energy of a Gaussian likelihood, within 3 s.e."""
    torch.set_default_dtype(torch.float64)
    n, x, m0, s0 = 20000, 0.7, 0.2, 0.8
    loc, log_scale = torch.full((n, 1, 1), 0.5), torch.full((n, 1, 1), -0.4)
    _, grad = free_energy_grad(
        Gaussian(loc, log_scale),
        lambda z: Normal(z, math.sqrt(R)).log_prob(torch.tensor(x)).sum(-1),
        torch.full_like(loc, m0),
        s0,
    )
    s2 = math.exp(-0.8)
    exact_loc = -(x - 0.5) / R + (0.5 - m0) / s0**2
    exact_log_scale = s2 / R + s2 / s0**2 - 1.0
    for g, exact in ((grad.loc, exact_loc), (grad.log_scale, exact_log_scale)):
        se = g.std() / math.sqrt(n)
        assert abs(g.mean() - exact) < 3 * se, (g.mean(), exact, se)


# --------------------------------------------------------------------------- the filter


def test_refinement_reaches_the_exact_step_posterior():
    """Starting at the prior prediction, gradient steps on the step free energy converge to
    p(z_t | z_{t-1}, x_t), the optimum over Gaussians, at every step and for every particle
    (each particle's prior is centred at its own previous sample)."""
    torch.set_default_dtype(torch.float64)
    update = gradient_descent(0.2, decay=0.2, period=60)
    zs, _, qs = variational_filter(len(XS), lg_predict(20), lg_log_lik, update, iterations=60, samples=64)
    for t, q in enumerate(qs, start=1):
        prior_loc, prior_var = (A * zs[t - 2].detach(), Q) if t > 1 else (torch.zeros_like(q.loc), 1.0)
        loc, var = one_step_posterior(prior_loc, prior_var, XS[t - 1])
        error = (q.loc.detach() - loc).reshape(-1)
        var_error = (q.log_scale.detach().exp() ** 2 / var - 1).reshape(-1)
        # Every particle's q within a tenth of the posterior's sd (mean) and 10% (variance);
        # seen (3 seeds): at most 0.05 sd and 6%.
        assert error.abs().max() < 0.1 * math.sqrt(var), (t, error.abs().max())
        assert var_error.abs().max() < 0.1, (t, var_error.abs().max())
        # What is left is the 64-sample gradients' noise, not a bias: over the 20 particles
        # the errors average to 0 within 4 standard errors.
        for name, e in (("mean", error), ("variance", var_error)):
            assert abs(e.mean()) < 4 * e.std() / math.sqrt(len(e)), (t, name, e.mean(), e.std())


def test_importance_weights_recover_the_kalman_filter():
    """With weights p(x, z) / q(z | x) the filter's samples give the Kalman filter's mean of
    z_T and the evidence log p(x_{1:T}), whatever the number of refinements."""
    torch.set_default_dtype(torch.float64)
    mean, var, log_px = kalman(XS)
    for iterations in (0, 3):
        predict = lg_predict(4000)
        zs, log_q, _ = variational_filter(
            len(XS), predict, lg_log_lik, gradient_descent(0.1, 0.1), iterations, samples=8
        )
        with torch.no_grad():
            log_p = sum(lg_log_lik(t, z) for t, z in enumerate(zs, start=1))
            for t, z in enumerate(zs, start=1):
                loc, scale = predict(t, zs[t - 2] if t > 1 else None)
                log_p = log_p + Normal(loc, scale).log_prob(z).sum(-1)
            log_w = (log_p - log_q).squeeze(-1)
            w = torch.softmax(log_w, 0)
            z_t = zs[-1].detach().reshape(-1)
            estimate = (w * z_t).sum()
            ess = 1.0 / (w**2).sum()
            # self-normalized IS: standard error from the weighted variance and the ESS
            se = math.sqrt(var / ess)
            assert abs(estimate - mean) < 4 * se, (iterations, estimate, mean, se)
            log_z = torch.logsumexp(log_w, 0) - math.log(len(log_w))
            # log of the IS estimate: delta-method standard error sqrt(1 / ESS - 1 / N)
            se_log_z = math.sqrt(max(1.0 / float(ess) - 1.0 / len(log_w), 0.0))
            assert abs(log_z - log_px) < 4 * se_log_z, (iterations, log_z, log_px, se_log_z)


@pytest.mark.slow
def test_learned_update_approaches_the_exact_step_posterior():
    """The inference model itself, trained on the free energy (the ELBO), moves q from the
    prior most of the way to p(z | x) for data it never saw (a one-step model)."""
    torch.set_default_dtype(torch.float64)
    update = IterativeUpdate(1, hidden=32)
    optimizer = torch.optim.Adam(update.parameters(), lr=0.01)
    prior_var = 1.0

    def batch(n):
        z = torch.randn(n, 1, 1)
        return z + math.sqrt(R) * torch.randn(n, 1, 1)

    def refined(x, iterations=3):
        q0 = Gaussian(torch.zeros_like(x), torch.zeros_like(x))
        return refine(
            q0,
            lambda z: Normal(z, math.sqrt(R)).log_prob(x).sum(-1),
            torch.zeros_like(x),
            1.0,
            update,
            iterations,
        )

    for _ in range(400):
        x = batch(128)
        q = refined(x)
        z = q.rsample()
        elbo = Normal(z, math.sqrt(R)).log_prob(x).sum(-1) - gaussian_kl(q, torch.zeros_like(x), 1.0)
        optimizer.zero_grad()
        (-elbo.mean()).backward()
        optimizer.step()
    x = torch.linspace(-2, 2, 9).reshape(9, 1, 1)
    loc, var = one_step_posterior(torch.zeros_like(x), prior_var, x)
    exact = Gaussian(loc, torch.full_like(x, 0.5 * math.log(var)))

    def kl_to_exact(q):
        return gaussian_kl(exact, q.loc, q.log_scale.exp()).mean()

    prior = Gaussian(torch.zeros_like(x), torch.zeros_like(x))
    with torch.no_grad():
        before, after = kl_to_exact(prior), kl_to_exact(refined(x))
    assert after < 0.1 * before, (before, after)


# --------------------------------------------------------------------------- Bouncing MNIST


def _video(frames: int = 3) -> torch.Tensor:
    x = torch.zeros(2, frames, 96, 96)
    for t in range(frames):
        x[:, t, 20 + 3 * t : 40 + 3 * t, 30:45] = 1.0
    return x


def test_without_refinement_the_filter_is_the_prior():
    """iterations = 0: q(z_where_t | z_where_{t-1}) = p(z_where_t | z_where_{t-1}) and q(z_what) =
    N(0, I), so the importance weight p(x, z) / q(z | x) is the likelihood p(x | z)."""
    task = get_task("bmnist")
    model = task.build_model()
    method = get_method("avf").configure(iterations=0)
    proposals = method.build_proposals(task, model, num_digits=2)
    x = _video()
    with torch.no_grad():
        result = method.run(model, proposals, x, 1, 5)
        log_lik = model.log_likelihood(x, model.templates(result.z["z_what"]), result.z, 1, x.shape[1])
    assert torch.allclose(result.log_weights, log_lik, rtol=1e-5, atol=1e-2)


def test_refinement_uses_the_step_free_energy_gradient():
    """One refinement with the untrained model is a small step along minus the squashed
    gradient of frame 1's free energy (the gradient the inference model reads)."""
    task = get_task("bmnist")
    model = task.build_model()
    proposals = get_method("avf").configure(iterations=1).build_proposals(task, model, num_digits=1)
    x = _video(1)
    torch.manual_seed(0)
    q = Gaussian(torch.zeros(3, 2, 1, 2), torch.zeros(3, 2, 1, 2))
    blob = model.decoder(torch.zeros(10)).detach().expand(3, 2, 1, 28, 28)

    def log_lik(where):
        return model.log_likelihood(x, blob, {where_key(1): where}, 1, 1)

    torch.manual_seed(1)
    _, grad = free_energy_grad(q, log_lik, q.loc, 1.0)
    torch.manual_seed(1)
    new = refine(q, log_lik, q.loc, 1.0, proposals.where_update, 1)
    step = 0.05
    expected = -step * torch.sign(grad.loc) * torch.log1p(grad.loc.abs())
    assert torch.allclose(new.loc - q.loc, expected, atol=1e-6)


def test_avf_trains_and_evaluates_with_every_metric():
    x = _video(3).repeat(2, 1, 1, 1)
    cfg = TrainConfig(
        task="bmnist",
        method="avf",
        sweeps=2,
        particles=2,
        batch_size=2,
        iterations=2,
        lr=1e-3,
        network={"num_digits": 1},
        method_options={"iterations": 1},
    )
    trainer = Trainer(cfg, x)
    before = [p.detach().clone() for p in trainer.proposals.parameters()]
    decoder = [p.detach().clone() for p in trainer.model.parameters()]
    rows = list(trainer.run())
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.proposals.parameters(), strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(decoder, trainer.model.parameters(), strict=True))
    out = evaluate(cfg, trainer.model, trainer.proposals, x[:3], 2, 3, batch_size=2)
    for name in ("log_joint", "ess", "log_evidence", "mse", "model_evals", "log_evidence_is"):
        assert torch.isfinite(torch.as_tensor(out[name])).all(), name
    assert out["mse"].shape == (1, 3)  # one step, K * L samples
    assert (out["model_evals"] == 2 * 3 * (1 + 4 * 1)).all()


def test_avf_options_and_tasks_are_checked():
    with pytest.raises(ValueError, match="iterations"):
        get_method("avf").configure(iterations=-1)
    with pytest.raises(ValueError, match="bmnist"):
        TrainConfig(
            task="gmm", method="avf", sweeps=10, particles=10, batch_size=20, iterations=1000, lr=1e-4
        ).validate()
