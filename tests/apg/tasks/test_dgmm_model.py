"""Tests of the rings task (apg/tasks/dgmm/): the simulator and the model's densities."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from apg.tasks.dgmm import (
    TWO_PI,
    build_model,
    build_proposals,
    reconstruct,
    simulate,
    simulate_rings,
    squared_residuals,
    squared_residuals_change,
)

# --------------------------------------------------------------------------- simulator
from tests.apg.tasks.dgmm_support import random_latents, simulated_rings


def test_simulator_shapes_support_and_seeding():
    model = build_model(num_clusters=3)
    out = simulate(model, 5, torch.Generator().manual_seed(7), num_points=33, radius=1.5)
    assert out["x"].shape == (5, 33, 2) and out["x"].dtype == torch.float64
    assert out["mu"].shape == (5, 3, 2)
    assert out["c"].shape == (5, 33) and out["c"].dtype == torch.long
    assert int(out["c"].min()) >= 0 and int(out["c"].max()) < 3
    assert float(out["alpha"].min()) >= 0.0 and float(out["alpha"].max()) < TWO_PI
    again = simulate(model, 5, torch.Generator().manual_seed(7), num_points=33, radius=1.5)
    other = simulate(model, 5, torch.Generator().manual_seed(8), num_points=33, radius=1.5)
    for k in out:
        assert torch.equal(out[k], again[k])
    assert not torch.equal(out["x"], other["x"])


def test_simulated_points_lie_on_rings_of_the_given_radius():
    model = build_model()
    out = simulate(model, 50, torch.Generator().manual_seed(0), num_points=200, radius=2.0, noise=0.2)
    centre = out["mu"].gather(1, out["c"].unsqueeze(-1).expand(-1, -1, 2))
    resid = out["x"] - centre - 2.0 * torch.stack([out["alpha"].cos(), out["alpha"].sin()], -1)
    # The residual is the noise: mean 0, sd 0.2 per coordinate (20,000 draws: SE of sd ~ 0.001).
    assert abs(float(resid.mean())) < 3 * 0.2 / math.sqrt(resid.numel())
    assert abs(float(resid.std()) - 0.2) < 0.005
    # Distance from the centre: the noise across the ring adds sd^2 / (2 r) to its mean.
    dist = (out["x"] - centre).norm(dim=-1)
    se = float(dist.std()) / math.sqrt(dist.numel())
    assert abs(float(dist.mean()) - (2.0 + 0.2**2 / (2 * 2.0))) < 4 * se


def test_simulator_handles_test_set_sizes():
    model = build_model()
    for n in (100, 600):
        assert simulate(model, 2, torch.Generator().manual_seed(0), num_points=n)["x"].shape == (2, n, 2)


def test_true_ring_log_joint_integrates_the_angle_out(f64):
    # The closed form (Bessel I_0) against a 20,000-point quadrature over the angle, at the
    # simulator's own radius and noise and at a wider noise (where the Bessel term matters less).
    from apg.tasks.dgmm import true_ring_log_joint

    data = simulate_rings(3, 7, torch.Generator().manual_seed(2))
    angles = torch.linspace(0, 2 * math.pi, 20_001)[:-1]
    for noise in (0.2, 0.7):
        centres = data["mu"].gather(1, data["c"].unsqueeze(-1).expand(-1, -1, 2))
        offsets = data["x"] - centres  # (M, N, 2)
        ring = 2.0 * torch.stack([angles.cos(), angles.sin()], -1)  # (A, 2)
        sq = ((offsets[:, :, None, :] - ring) ** 2).sum(-1)
        per_point = torch.log(torch.exp(-sq / (2 * noise**2)).mean(-1) / (2 * math.pi * noise**2)) - math.log(
            4
        )
        prior = Normal(0.0, 3.5).log_prob(data["mu"]).sum((-2, -1))
        expected = prior + per_point.sum(-1)
        got = true_ring_log_joint(data["x"], data["mu"], data["c"], 4, 3.5, 2.0, noise)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-8)


# --------------------------------------------------------------------------- model


def test_likelihood_and_joint_by_hand(f64):
    model = build_model(num_clusters=2, sigma0=2.0, noise=0.5)
    with torch.no_grad():  # g(alpha) = (cos alpha, 0) + (0.3, -0.2): weights set by hand
        for p in model.shape_net.parameters():
            p.zero_()
        first, last = model.shape_net[0], model.shape_net[2]
        first.weight[0, 0] = 1e-4  # tanh(1e-4 cos) ~ 1e-4 cos, so last weight 1e4 gives cos
        last.weight[0, 0] = 1e4
        last.bias[:] = torch.tensor([0.3, -0.2])
    x = torch.tensor([[[1.0, 2.0], [-1.0, 0.5]]])  # B=1, N=2
    z = {
        "mu": torch.tensor([[[[0.5, 1.0], [-2.0, 0.0]]]]),  # L=1, B=1, I=2
        "c": torch.tensor([[[0, 1]]]),
        "alpha": torch.tensor([[[0.0, math.pi / 2]]]),
    }
    g0 = torch.tensor([1.0 + 0.3, -0.2])  # at alpha = 0
    g1 = torch.tensor([math.cos(math.pi / 2) + 0.3, -0.2])
    m0, m1 = torch.tensor([0.5, 1.0]) + g0, torch.tensor([-2.0, 0.0]) + g1
    by_hand_ll = sum(Normal(m, 0.5).log_prob(xi).sum() for m, xi in ((m0, x[0, 0]), (m1, x[0, 1])))
    ll = model.log_likelihood(x, z)
    assert ll.shape == (1, 1)
    assert torch.allclose(ll, by_hand_ll.reshape(1, 1), atol=1e-6)
    prior = Normal(0.0, 2.0).log_prob(z["mu"]).sum() + 2 * (math.log(1 / TWO_PI) + math.log(0.5))
    assert torch.allclose(model.log_joint(x, z), (by_hand_ll + prior).reshape(1, 1), atol=1e-6)
    # An angle outside [0, 2 pi) has zero prior density.
    bad = {**z, "alpha": torch.tensor([[[0.0, 7.0]]])}
    assert torch.isneginf(model.log_joint(x, bad)).all()


def test_squared_residuals_match_the_plain_formula_and_pass_gradcheck(f64, kernel_path):
    model, data = simulated_rings(num_datasets=2, num_points=7)
    z = random_latents(model, data["x"], 3)
    shape = model.g(z["alpha"]).detach().requires_grad_()
    got = squared_residuals(data["x"], z["mu"], z["c"], shape)
    assert torch.allclose(got, ((data["x"] - model.mean(z, shape)) ** 2).sum((-2, -1)), rtol=0, atol=1e-10)
    assert torch.autograd.gradcheck(lambda s: squared_residuals(data["x"], z["mu"], z["c"], s), (shape,))


def test_squared_residuals_change_is_the_difference_with_both_gradients(f64, kernel_path):
    # One autograd node for both residual sums (compiled on CPU): the difference of the two,
    # differentiable in both shapes, and in one shape passed on both sides (the mu block).
    model, data = simulated_rings(num_datasets=2, num_points=7)
    x = data["x"]
    z_new, z_old = random_latents(model, x, 3), random_latents(model, x, 3)
    s_new, s_old = (model.g(z["alpha"]).detach().requires_grad_() for z in (z_new, z_old))

    def change(a, b):
        return squared_residuals_change(x, (z_new["mu"], z_new["c"], a), (z_old["mu"], z_old["c"], b))

    want = squared_residuals(x, z_new["mu"], z_new["c"], s_new) - squared_residuals(
        x, z_old["mu"], z_old["c"], s_old
    )
    assert torch.allclose(change(s_new, s_old), want, rtol=0, atol=1e-10)
    assert torch.autograd.gradcheck(change, (s_new, s_old))
    assert torch.autograd.gradcheck(lambda s: change(s, s), (s_old,))


@pytest.mark.parametrize("block", ["mu", "local"])
def test_joint_change_has_the_joint_difference_gradient(f64, block):
    # theta's gradient of the change the sampler accumulates is that of the joint difference
    model, data = simulated_rings()
    model = model.double()
    x = data["x"]
    z_old, z_new = random_latents(model, x, 4), random_latents(model, x, 4)
    mixed = {**z_old, **{k: z_new[k] for k in model.blocks[block]}}
    params = list(model.parameters())
    got = torch.autograd.grad(model.log_joint_change(block, x, z_old, mixed).sum(), params)
    want = torch.autograd.grad(
        (model.log_joint(x, mixed) - model.log_joint(x, z_old)).sum(), params, allow_unused=True
    )
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, torch.zeros_like(g) if w is None else w, rtol=1e-10, atol=1e-8)


@pytest.mark.parametrize("block", ["mu", "local"])
def test_blanket_differences_equal_joint_differences(f64, block):
    model, data = simulated_rings()
    model = model.double()
    x = data["x"]
    z_old = random_latents(model, x, 4)
    z_new = random_latents(model, x, 4)
    mixed = {**z_old, **{k: z_new[k] for k in model.blocks[block]}}
    d_blanket = model.log_blanket(block, x, mixed) - model.log_blanket(block, x, z_old)
    d_joint = model.log_joint(x, mixed) - model.log_joint(x, z_old)
    assert d_blanket.shape == (4, 3)
    assert torch.allclose(d_blanket, d_joint, rtol=1e-12, atol=1e-8)
    assert torch.allclose(model.log_joint_change(block, x, z_old, mixed), d_joint, rtol=1e-12, atol=1e-8)
    assert d_joint.abs().min() > 0  # the test moved something


def test_model_rejects_bad_shapes_and_blocks():
    model, data = simulated_rings()
    z = random_latents(model, data["x"].float(), 2)
    with pytest.raises(ValueError, match=r"\(B, N, 2\)"):
        model.log_likelihood(data["x"].float()[..., :1], z)
    with pytest.raises(ValueError, match="unknown block"):
        model.log_blanket("tau", data["x"].float(), z)
    with pytest.raises(ValueError, match="architecture"):
        build_proposals(model, "transformer")


def test_reconstruct_is_centre_plus_shape():
    model, data = simulated_rings()
    x = data["x"].float()
    z = random_latents(model, x, 2)
    rec = reconstruct(model, x, z)
    assert rec.shape == (2, 3, 40, 2)
    p, b, n = 1, 2, 5
    expect = z["mu"][p, b, z["c"][p, b, n]] + model.g(z["alpha"][p, b, n])
    assert torch.allclose(rec[p, b, n], expect)
