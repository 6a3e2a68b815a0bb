"""The rings' continuous view (assignments summed out, angles through a logistic bijection)
and the gradient-based baselines on it: the reparameterized recognition model's per-point
head, HMC-RWS and stochastic backpropagation."""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn
from torch.distributions import Normal

from apg.baselines import get_method
from apg.baselines.continuous import DGMMTarget, GMMTarget, continuous_target
from apg.baselines.reparam import GaussianRecognition
from apg.tasks import get_task
from apg.tasks.dgmm import DGMM, TWO_PI, DGMMConfig
from apg.training import TrainConfig, Trainer


def small_rings(num_datasets: int = 2, num_points: int = 7, num_clusters: int = 3, seed: int = 1):
    model = DGMM(DGMMConfig(num_clusters=num_clusters, hidden=8))
    data = get_task("dgmm").simulate(model, num_datasets, torch.Generator().manual_seed(seed), num_points)
    return model, data["x"].to(torch.get_default_dtype())


def random_u(num_particles: int, num_datasets: int, num_points: int, num_clusters: int) -> dict:
    return {
        "mu": 3.0 * torch.randn(num_particles, num_datasets, num_clusters, 2),
        "logit_alpha": 2.0 * torch.randn(num_particles, num_datasets, num_points),
    }


def test_dgmm_view_is_registered_and_has_per_point_angles():
    target = continuous_target(get_task("dgmm").build_model())
    assert isinstance(target, DGMMTarget)
    assert target.event_shapes == {"mu": (4, 2)} and target.point_shapes == {"logit_alpha": ()}
    assert GMMTarget(get_task("gmm").build_model()).point_shapes == {}


def test_view_plus_exact_assignments_is_the_log_joint(f64):
    model, x = small_rings()
    target = DGMMTarget(model)
    u = random_u(5, 2, 7, 3)
    z, log_c = target.complete(x, u)
    assert z["c"].shape == (5, 2, 7) and z["alpha"].shape == (5, 2, 7)
    assert ((z["alpha"] >= 0) & (z["alpha"] < TWO_PI)).all()
    # log p(x, mu, alpha) + log p(c | x, mu, alpha) = log p(x, mu, c, alpha)
    lhs = target.log_density(x, u) - target.log_det_jacobian(u) + log_c
    torch.testing.assert_close(lhs, model.log_joint(x, z), rtol=0, atol=1e-9)
    # and the unconstrained value of a completed sample maps back to it
    back = target.to_unconstrained(z)
    torch.testing.assert_close(back["logit_alpha"], u["logit_alpha"], rtol=0, atol=1e-9)


def test_summed_out_likelihood_equals_enumerating_the_assignments(f64):
    model, x = small_rings(num_datasets=2, num_points=3, num_clusters=2, seed=4)
    target = DGMMTarget(model)
    u = random_u(3, 2, 3, 2)
    alpha = target.angle(u["logit_alpha"])
    joints = []
    for assignment in itertools.product(range(2), repeat=3):  # all 2^3 values of c
        c = torch.tensor(assignment).expand(3, 2, 3)
        joints.append(model.log_joint(x, {"mu": u["mu"], "c": c, "alpha": alpha}))
    brute = torch.logsumexp(torch.stack(joints), 0)  # log sum_c p(x, mu, c, alpha)
    torch.testing.assert_close(
        target.log_density(x, u) - target.log_det_jacobian(u), brute, rtol=0, atol=1e-9
    )


def test_log_jacobian_is_autograds_derivative_of_the_bijection(f64):
    target = DGMMTarget(DGMM(DGMMConfig(hidden=8)))
    # (autograd's sigmoid derivative loses digits past |a| ~ 10, where ours, from log-sigmoids, does not)
    a = torch.cat([torch.randn(2, 3, 5) * 3.0, torch.tensor([-9.0, -4.0, 0.0, 4.0, 9.0]).expand(2, 1, 5)], 1)
    a.requires_grad_(True)
    (grad,) = torch.autograd.grad(target.angle(a).sum(), a)  # elementwise: d alpha_n / d a_n
    expected = torch.log(grad).sum(-1)
    torch.testing.assert_close(
        target.log_det_jacobian({"logit_alpha": a.detach()}), expected, rtol=1e-10, atol=0
    )


def test_angles_stay_on_the_support_at_the_float32_edges():
    target = DGMMTarget(DGMM(DGMMConfig(hidden=8)))
    alpha = target.angle(torch.tensor([-200.0, -20.0, 0.0, 20.0, 200.0]))
    assert ((alpha >= 0) & (alpha < TWO_PI)).all()  # sigmoid(20) rounds to 1: 2 pi wraps to 0
    u = target.to_unconstrained({"mu": torch.zeros(1, 1, 4, 2), "alpha": torch.tensor([[[0.0, 3.0]]])})
    assert torch.isfinite(u["logit_alpha"]).all()  # angle 0 (a von Mises draw) maps inside


def test_view_is_differentiable_in_the_positions_and_in_theta(f64):
    model, x = small_rings()
    target = DGMMTarget(model)
    u = {k: v.requires_grad_(True) for k, v in random_u(4, 2, 7, 3).items()}
    target.log_density(x, u).sum().backward()
    assert all(v.grad is not None and v.grad.abs().sum() > 0 for v in u.values())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.shape_net.parameters())


# --------------------------------------------------------------------------- recognition


def test_recognition_serves_any_number_of_points_and_scores_like_normal(f64):
    model, _ = small_rings()
    recognition = GaussianRecognition(DGMMTarget(model), hidden=8)
    assert recognition.point_head is not None
    for layer in (recognition.head[-1], recognition.point_head[-1]):
        nn.init.normal_(layer.weight, std=0.3)
        nn.init.normal_(layer.bias, std=0.3)
    for num_points in (5, 11):
        _, x = small_rings(num_datasets=3, num_points=num_points)
        u, log_q = recognition.rsample(x, 4)
        assert u["mu"].shape == (4, 3, 3, 2) and u["logit_alpha"].shape == (4, 3, num_points)
        loc, scale = recognition.gaussian(x)
        point_loc, point_scale = recognition.point_gaussian(x)
        assert loc.shape == (3, 6) and point_loc.shape == (3, num_points, 1)
        expected = Normal(loc, scale).log_prob(u["mu"].flatten(2)).sum(-1)
        expected = expected + Normal(point_loc.squeeze(-1), point_scale.squeeze(-1)).log_prob(
            u["logit_alpha"]
        ).sum(-1)
        torch.testing.assert_close(log_q, expected, rtol=1e-10, atol=1e-10)
        # permuting the points permutes their Gaussians and leaves the centres' alone
        perm = torch.randperm(num_points)
        loc_p, _ = recognition.gaussian(x[:, perm])
        point_loc_p, _ = recognition.point_gaussian(x[:, perm])
        torch.testing.assert_close(loc_p, loc)
        torch.testing.assert_close(point_loc_p, point_loc[:, perm])


# --------------------------------------------------------------------------- methods


def test_hmc_rws_on_the_rings_moves_and_accepts():
    model, x = small_rings(num_datasets=3, num_points=20, num_clusters=4)
    x = x.float()
    method = get_method("hmc-rws").configure(step_size=0.03, leapfrog_steps=3)
    proposals = method.build_proposals(get_task("dgmm"), model, hidden=8)
    result = method.run(model, proposals, x, 4, 5)
    accept = method.diagnostics(result)["accept"]
    assert accept.shape == (3,) and (accept > 0).all() and (accept <= 1).all()
    for stats in result.sweeps:
        assert torch.isfinite(stats.log_joint).all()
    assert (result.sweeps[-1].log_joint > result.sweeps[0].log_joint).all()  # about -4000 -> -1000
    assert ((result.z["alpha"] >= 0) & (result.z["alpha"] < TWO_PI)).all()
    method.loss(result).backward()  # eq. 6 at the HMC-improved particles reaches g_theta
    assert model.shape_net[0].weight.grad.abs().sum() > 0


def test_reparam_training_on_the_rings_raises_the_elbo():
    task = get_task("dgmm")
    data = task.simulate(task.build_model(), 8, torch.Generator().manual_seed(3), num_points=20)["x"].float()
    cfg = TrainConfig(
        task="dgmm",
        method="reparam",
        sweeps=1,
        particles=8,
        batch_size=8,
        iterations=25,
        lr=0.01,
        network={"hidden": 16},
    )
    trainer = Trainer(cfg, data)

    def elbo() -> tuple[float, float]:
        """The ELBO's estimate over 5 independent draws of 32 particles: mean, standard error."""
        with torch.no_grad():
            draws = []
            for seed in range(5):
                torch.manual_seed(seed)
                result = trainer.method.run(trainer.model, trainer.proposals, data, 1, 32)
                draws.append(-trainer.method.loss(result).item())
        draws = torch.tensor(draws, dtype=torch.float64)
        return float(draws.mean()), float(draws.std() / math.sqrt(len(draws)))

    before, se_before = elbo()
    rows = list(trainer.run())
    after, se_after = elbo()
    assert all(math.isfinite(r["loss"]) for r in rows)
    # the gain exceeds 3 standard errors of the two estimates' difference (-3300 -> about -1600)
    assert after - before > 3 * math.hypot(se_before, se_after), (before, se_before, after, se_after)
