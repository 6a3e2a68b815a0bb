"""Baselines: exact and bootstrapped population Gibbs, HMC-RWS, stochastic backpropagation,
and the importance-sampled evidence estimate, each on a model whose answer is known."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
import torch
from torch import Tensor, nn
from torch.distributions import Normal

from apg.baselines import METHODS, get_method
from apg.baselines.continuous import GMMTarget, continuous_target, register_target
from apg.baselines.hmc import hmc_step, leapfrog
from apg.baselines.reparam import GaussianRecognition
from apg.blocks import Model, Proposals
from apg.metrics import importance_log_evidence
from apg.tasks import get_task
from apg.training import TrainConfig, Trainer, evaluate


@pytest.fixture
def gmm_data():
    task = get_task("gmm")
    model = task.build_model()
    return model, task.simulate(model, 12, torch.Generator().manual_seed(1), num_points=30)["x"].float()


# --------------------------------------------------------------------------- Gibbs


def test_new_methods_are_registered():
    for name in ("gibbs", "gibbs-bootstrap", "hmc-rws", "reparam"):
        assert get_method(name).name == name
    assert set(METHODS) >= {"apg", "rws-mlp", "rws-lstm"}


def test_exact_gibbs_trains_nothing_and_has_unit_weights(gmm_data):
    _, x = gmm_data
    cfg = TrainConfig(task="gmm", method="gibbs", sweeps=3, particles=4, batch_size=4, iterations=2, lr=0.01)
    trainer = Trainer(cfg, x)
    assert trainer.optimizer is None  # no parameters: no optimizer step
    rows = list(trainer.run())
    assert len(rows) == 2 and all(math.isfinite(r["log_joint"]) for r in rows)
    result = trainer.method.run(trainer.model, trainer.proposals, x[:3], 3, 4)
    for stats in result.sweeps[1:]:
        for block, log_v in stats.log_increments.items():
            # eq. 9 with the exact conditional as kernel: the incremental weight is 1.
            assert torch.allclose(log_v, torch.zeros_like(log_v), atol=1e-3), block
    state = trainer.state_dict()
    Trainer(cfg, x).load_state_dict(state)  # a checkpoint round trip without optimizer state


def test_gibbs_needs_exact_conditionals():
    with pytest.raises(ValueError, match="exact Gibbs conditionals"):
        TrainConfig(
            task="dgmm", method="gibbs", sweeps=10, particles=10, batch_size=20, iterations=1000, lr=1e-4
        ).validate()
    for name in ("hmc-rws", "reparam"):  # the rings have a continuous view
        TrainConfig(
            task="dgmm", method=name, sweeps=10, particles=10, batch_size=20, iterations=1000, lr=1e-4
        ).validate()


def test_bootstrap_proposes_globals_from_the_prior_and_learns_locals(gmm_data):
    model, x = gmm_data
    cfg = TrainConfig(
        task="gmm", method="gibbs-bootstrap", sweeps=2, particles=4, batch_size=4, iterations=3, lr=0.05
    )
    trainer = Trainer(cfg, x)
    z = {"mu": torch.randn(4, 2, 3, 2), "tau": torch.rand(4, 2, 3, 2) + 0.5}
    kernel = trainer.proposals.kernel("globals", x[:2], z)
    prior = model.prior_globals((4, 2), x[:2])
    assert torch.allclose(kernel.log_prob(z), prior.log_prob(z))
    assign = trainer.proposals.learned.assign.out.weight.clone()
    encoder = trainer.proposals.learned.encoder.stat.weight.clone()
    list(trainer.run())
    assert not torch.equal(assign, trainer.proposals.learned.assign.out.weight)  # q(c | x, mu, tau) learns
    assert torch.equal(encoder, trainer.proposals.learned.encoder.stat.weight)  # the encoder is unused


def test_bootstrap_global_increment_is_the_likelihood_ratio(gmm_data):
    model, x = gmm_data
    method = get_method("gibbs-bootstrap")
    proposals = method.build_proposals(get_task("gmm"), model)
    torch.manual_seed(3)
    result = method.run(model, proposals, x[:2], 2, 5, resample_mode="none")
    torch.manual_seed(3)
    z0, _ = proposals.initial(x[:2], 5)
    kernel = proposals.kernel("globals", x[:2], z0)
    new = kernel.sample()
    expected = model.log_likelihood(x[:2], {**z0, **new}) - model.log_likelihood(x[:2], z0)
    assert torch.allclose(result.sweeps[1].log_increments["globals"], expected, atol=1e-3)


# --------------------------------------------------------------------------- HMC


def _gaussian_target():
    mean = torch.tensor([1.0, -2.0], dtype=torch.float64)
    cov = torch.tensor([[1.0, 0.8], [0.8, 2.0]], dtype=torch.float64)
    dist = torch.distributions.MultivariateNormal(mean, cov)
    return dist, lambda q: dist.log_prob(q["q"])


def test_leapfrog_moves_positions_and_is_reversible():
    _, log_density = _gaussian_target()
    q = {"q": torch.zeros(3, 2, 2, dtype=torch.float64)}
    p = {"q": torch.randn(3, 2, 2, dtype=torch.float64)}
    q1, p1, _ = leapfrog(log_density, q, p, 0.1, 10)
    assert (q1["q"] - q["q"]).abs().min() > 1e-3  # the authors' leapfrog never moved q
    q2, p2, _ = leapfrog(log_density, q1, {"q": -p1["q"]}, 0.1, 10)
    assert torch.allclose(q2["q"], q["q"], atol=1e-10) and torch.allclose(-p2["q"], p["q"], atol=1e-10)


def test_hmc_leaves_a_gaussian_invariant():
    dist, log_density = _gaussian_target()
    chains = 4000
    q = {"q": dist.sample((chains, 1))}  # exact draws: (L, B=1, 2)
    start = q["q"].clone()
    accepts = []
    for _ in range(5):
        # A step size large enough that the Metropolis correction matters.
        q, accept = hmc_step(log_density, q, 1.2, 4)
        accepts.append(accept.mean().item())
    out = q["q"].squeeze(1)
    assert (out != start.squeeze(1)).any(-1).double().mean() > 0.5
    assert 0.3 < sum(accepts) / len(accepts) < 1.0
    sd = dist.covariance_matrix.diagonal().sqrt()
    se_mean = sd / math.sqrt(chains)
    assert ((out.mean(0) - dist.mean).abs() < 3 * se_mean).all(), out.mean(0)
    var = dist.covariance_matrix.diagonal()
    se_var = var * math.sqrt(2.0 / (chains - 1))
    assert ((out.var(0) - var).abs() < 3 * se_var).all(), out.var(0)


def test_hmc_without_metropolis_would_fail_the_invariance_check():
    """The invariance test has power: plain leapfrog (no correction) at this step size
    inflates the variance far beyond the Monte Carlo error."""
    dist, log_density = _gaussian_target()
    chains = 4000
    q = {"q": dist.sample((chains, 1))}
    for _ in range(5):
        q, _, _ = leapfrog(log_density, q, {"q": torch.randn_like(q["q"])}, 1.2, 4)
    var = dist.covariance_matrix.diagonal()
    se_var = var * math.sqrt(2.0 / (chains - 1))
    assert ((q["q"].squeeze(1).var(0) - var).abs() > 3 * se_var).any()


def test_hmc_rws_improves_the_log_joint_and_validates_options(gmm_data):
    model, x = gmm_data
    method = get_method("hmc-rws").configure(step_size=0.03, leapfrog_steps=5)
    proposals = method.build_proposals(get_task("gmm"), model)
    with torch.no_grad():
        result = method.run(model, proposals, x[:4], 6, 8)
    first, last = result.sweeps[0].log_joint, result.sweeps[-1].log_joint
    assert len(result.sweeps) == 6 and (last > first).all()
    with pytest.raises(ValueError, match="step_size"):
        get_method("hmc-rws").configure(step_size=-1.0)
    with pytest.raises(ValueError, match="unknown option"):
        get_method("hmc-rws").configure(stepsize=0.1)
    with pytest.raises(ValueError, match="unknown option"):
        TrainConfig(
            task="gmm",
            method="apg",
            method_options={"step_size": 0.1},
            sweeps=10,
            particles=10,
            batch_size=20,
            iterations=1000,
            lr=1e-4,
        ).validate()


# --------------------------------------------------------------------------- continuous view


def test_gmm_view_recovers_the_log_joint(gmm_data):
    model, x = gmm_data
    target = GMMTarget(model)
    z = model.prior_globals((5, 3), x[:3]).sample()
    u = target.to_unconstrained(z)
    full, log_c = target.complete(x[:3], u)
    # log p(x, mu, tau) = log p(x, mu, tau, c) - log p(c | x, mu, tau), for any c.
    lhs = target.log_density(x[:3], u) - target.log_det_jacobian(u)
    rhs = model.log_joint(x[:3], full) - log_c
    assert torch.allclose(lhs, rhs, rtol=1e-5, atol=1e-3)


class NoView(Model):
    blocks = {"z": ("z",)}


def test_models_without_a_view_are_refused():
    with pytest.raises(ValueError, match="no continuous view"):
        continuous_target(NoView())


# --------------------------------------------------------------------------- conjugate Gaussian

S2 = 0.5  # x ~ N(z, S2), z ~ N(0, 1): p(z | x) = N(x / (1 + S2), S2 / (1 + S2)), p(x) = N(0, 1 + S2)


class Conjugate(Model):
    blocks = {"z": ("z",)}

    def log_joint(self, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
        prior = Normal(0.0, 1.0).log_prob(z["z"])
        return prior + Normal(z["z"], math.sqrt(S2)).log_prob(x[:, 0])


class ConjugateTarget:
    event_shapes = {"z": ()}
    point_shapes: dict = {}
    point_dim = 1

    def __init__(self, model):
        self.model = model

    def points(self, x):
        return x.unsqueeze(-1)  # (B, 1 point, 1)

    def to_unconstrained(self, z):
        return {"z": z["z"]}

    def log_det_jacobian(self, u):
        return torch.zeros_like(u["z"])

    def log_density(self, x, u):
        return self.model.log_joint(x, u)

    def complete(self, x, u):
        return {"z": u["z"]}, torch.zeros_like(u["z"])


register_target(Conjugate, ConjugateTarget)


class FixedGaussian(Proposals):
    def __init__(self, loc: float, scale: float):
        super().__init__()
        self.loc, self.scale = loc, scale

    def initial(self, x, num_particles):
        q = Normal(torch.full((num_particles, x.shape[0]), self.loc, dtype=x.dtype), self.scale)
        z = q.sample()
        return {"z": z}, q.log_prob(z)


def test_importance_evidence_is_unbiased():
    torch.set_default_dtype(torch.float64)
    x = torch.full((4000, 1), 0.7)  # 4000 independent estimates for the same x
    log_px = Normal(0.0, math.sqrt(1 + S2)).log_prob(torch.tensor(0.7))
    # A proposal off the posterior (but wider), so the estimate is noisy and Jensen's gap visible.
    est = importance_log_evidence(Conjugate(), FixedGaussian(0.0, 1.2), x, 3, chunk=2)
    ratio = torch.exp(est - log_px)
    se = ratio.std() / math.sqrt(len(ratio))
    assert abs(ratio.mean() - 1) < 3 * se, (ratio.mean(), se)
    assert est.mean() < log_px  # log of an unbiased estimate: biased low (Jensen)


@pytest.mark.slow
def test_reparameterized_elbo_optimum_is_the_exact_posterior():
    torch.set_default_dtype(torch.float64)
    model = Conjugate()
    method = get_method("reparam")
    recognition = GaussianRecognition(continuous_target(model), hidden=16)
    optimizer = torch.optim.Adam(recognition.parameters(), lr=0.01)
    for step in range(1500):
        x = torch.randn(64, 1) * math.sqrt(1 + S2)  # the marginal of x
        if step == 1000:
            for group in optimizer.param_groups:
                group["lr"] = 0.002
        loss = method.loss(method.run(model, recognition, x, 1, 16))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    x = torch.tensor([[-1.0], [0.0], [1.0]])
    with torch.no_grad():
        loc, scale = recognition.gaussian(x)
    assert torch.allclose(loc.squeeze(-1), x.squeeze(-1) / (1 + S2), atol=0.05), loc
    assert torch.allclose(scale.squeeze(-1) ** 2, torch.full((3,), S2 / (1 + S2)), rtol=0.1), scale**2


def test_reparam_weights_are_the_appendix_e_weights(gmm_data):
    model, x = gmm_data
    method = get_method("reparam")
    proposals = method.build_proposals(get_task("gmm"), model)
    nn.init.normal_(proposals.head[-1].weight, std=0.1)
    # Through initial() (the generic path every method's evidence uses) and through the
    # method's own run the weights p(x, z) / q(z | x) are the same function of u.
    torch.manual_seed(5)
    z, log_q = proposals.initial(x[:3], 7)
    torch.manual_seed(5)
    result = method.run(model, proposals, x[:3], 1, 7)
    assert torch.allclose(model.log_joint(x[:3], z) - log_q, result.log_weights, rtol=1e-5, atol=1e-3)


# --------------------------------------------------------------------------- evaluation


@pytest.fixture
def dgmm_data():
    task = get_task("dgmm")
    model = task.build_model()
    return model, task.simulate(model, 12, torch.Generator().manual_seed(1), num_points=20)["x"].float()


@pytest.mark.parametrize(
    "task, name",
    [
        ("gmm", "gibbs"),
        ("gmm", "gibbs-bootstrap"),
        ("gmm", "hmc-rws"),
        ("gmm", "reparam"),
        ("dgmm", "hmc-rws"),  # per-point angles: the continuous view's point_shapes
        ("dgmm", "reparam"),
    ],
)
def test_every_method_evaluates_with_an_evidence_estimate(request, task, name):
    _, x = request.getfixturevalue(f"{task}_data")
    cfg = TrainConfig(task=task, method=name, sweeps=3, particles=4, batch_size=4, iterations=2, lr=0.01)
    trainer = Trainer(cfg, x)
    list(trainer.run())
    out = evaluate(cfg, trainer.model, trainer.proposals, x[:5], 3, 4, batch_size=3)
    assert (
        out["log_evidence_is"].shape == (5,) and torch.isfinite(torch.as_tensor(out["log_evidence_is"])).all()
    )
    assert out["log_joint"].shape[1] == 5
    assert ("kl_c" in out) == get_method(name).kernels
