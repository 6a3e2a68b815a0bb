"""Tests of the rings task (apg/tasks/dgmm/): simulator, model, proposals, sampler identities."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Categorical, Normal, Uniform

from apg.blocks import Factorized, Proposals
from apg.smc.sampler import run_apg
from apg.tasks import get_task
from apg.tasks.dgmm import (
    DGMM,
    TWO_PI,
    DGMMConfig,
    GaussianMu,
    LocalProposal,
    build_model,
    build_proposals,
    pool_assigned,
    pool_per_cluster,
    reconstruct,
    sample_von_mises,
    simulate,
    simulate_rings,
    squared_residuals,
    squared_residuals_change,
    von_mises_log_prob,
)
from tests.montecarlo import mean_se


@pytest.fixture
def f64():
    torch.set_default_dtype(torch.float64)  # restored by conftest


def _data(num_datasets=3, num_points=40, seed=0, **kw):
    model = build_model(**kw)
    return model, simulate(model, num_datasets, torch.Generator().manual_seed(seed), num_points=num_points)


def _random_latents(model: DGMM, x: torch.Tensor, num_particles: int) -> dict[str, torch.Tensor]:
    batch, num_points = x.shape[:2]
    i = model.cfg.num_clusters
    return {
        "mu": model.cfg.sigma0 * torch.randn(num_particles, batch, i, 2),
        "c": torch.randint(i, (num_particles, batch, num_points)),
        "alpha": TWO_PI * torch.rand(num_particles, batch, num_points),
    }


# --------------------------------------------------------------------------- simulator


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
    model, data = _data(num_datasets=2, num_points=7)
    z = _random_latents(model, data["x"], 3)
    shape = model.g(z["alpha"]).detach().requires_grad_()
    got = squared_residuals(data["x"], z["mu"], z["c"], shape)
    assert torch.allclose(got, ((data["x"] - model.mean(z, shape)) ** 2).sum((-2, -1)), rtol=0, atol=1e-10)
    assert torch.autograd.gradcheck(lambda s: squared_residuals(data["x"], z["mu"], z["c"], s), (shape,))


def test_squared_residuals_change_is_the_difference_with_both_gradients(f64, kernel_path):
    # One autograd node for both residual sums (compiled on CPU): the difference of the two,
    # differentiable in both shapes, and in one shape passed on both sides (the mu block).
    model, data = _data(num_datasets=2, num_points=7)
    x = data["x"]
    z_new, z_old = _random_latents(model, x, 3), _random_latents(model, x, 3)
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
    model, data = _data()
    model = model.double()
    x = data["x"]
    z_old, z_new = _random_latents(model, x, 4), _random_latents(model, x, 4)
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
    model, data = _data()
    model = model.double()
    x = data["x"]
    z_old = _random_latents(model, x, 4)
    z_new = _random_latents(model, x, 4)
    mixed = {**z_old, **{k: z_new[k] for k in model.blocks[block]}}
    d_blanket = model.log_blanket(block, x, mixed) - model.log_blanket(block, x, z_old)
    d_joint = model.log_joint(x, mixed) - model.log_joint(x, z_old)
    assert d_blanket.shape == (4, 3)
    assert torch.allclose(d_blanket, d_joint, rtol=1e-12, atol=1e-8)
    assert torch.allclose(model.log_joint_change(block, x, z_old, mixed), d_joint, rtol=1e-12, atol=1e-8)
    assert d_joint.abs().min() > 0  # the test moved something


def test_model_rejects_bad_shapes_and_blocks():
    model, data = _data()
    z = _random_latents(model, data["x"].float(), 2)
    with pytest.raises(ValueError, match=r"\(B, N, 2\)"):
        model.log_likelihood(data["x"].float()[..., :1], z)
    with pytest.raises(ValueError, match="unknown block"):
        model.log_blanket("tau", data["x"].float(), z)
    with pytest.raises(ValueError, match="architecture"):
        build_proposals(model, "transformer")


def test_reconstruct_is_centre_plus_shape():
    model, data = _data()
    x = data["x"].float()
    z = _random_latents(model, x, 2)
    rec = reconstruct(model, x, z)
    assert rec.shape == (2, 3, 40, 2)
    p, b, n = 1, 2, 5
    expect = z["mu"][p, b, z["c"][p, b, n]] + model.g(z["alpha"][p, b, n])
    assert torch.allclose(rec[p, b, n], expect)


# --------------------------------------------------------------------------- distributions


def test_von_mises_sampler_matches_its_density(kernel_path):
    loc = torch.tensor([0.1, 3.0, 6.2, 1.0])
    conc = torch.tensor([0.05, 2.0, 50.0, 500.0])
    n = 20000
    s = sample_von_mises(loc.expand(n, 4), conc.expand(n, 4))
    assert float(s.min()) >= 0.0 and float(s.max()) < TWO_PI
    # E cos(theta - loc) = I1(k) / I0(k); E sin(theta - loc) = 0; both within 4 SE.
    c, sn = torch.cos(s - loc), torch.sin(s - loc)
    expect = torch.special.i1e(conc) / torch.special.i0e(conc)
    se_c, se_s = c.std(0) / math.sqrt(n), sn.std(0) / math.sqrt(n)
    assert ((c.mean(0) - expect).abs() < 4 * se_c + 1e-6).all()
    assert (sn.mean(0).abs() < 4 * se_s + 1e-6).all()
    # The density integrates to one over a period, also for a large concentration.
    grid = torch.linspace(0, TWO_PI, 200001, dtype=torch.float64)
    for k in (0.05, 2.0, 500.0):
        dens = von_mises_log_prob(
            grid, torch.tensor(1.0, dtype=torch.float64), torch.tensor(k, dtype=torch.float64)
        ).exp()
        assert abs(float(torch.trapezoid(dens, grid)) - 1.0) < 1e-6
    ref = torch.distributions.VonMises(loc, conc).log_prob(s[:5])
    assert torch.allclose(von_mises_log_prob(s[:5], loc, conc), ref, atol=1e-4)


def test_the_device_path_of_the_von_mises_sampler_draws_the_same_distribution():
    # On a GPU (no Philox key) one round of DEVICE_CANDIDATES proposals per element, no loop:
    # the same moments as above, within 4 SE, and every element accepted one.
    from apg.tasks.dgmm.distributions import _von_mises_torch

    loc = torch.tensor([0.1, 3.0, 6.2, 1.0])
    conc = torch.tensor([0.05, 2.0, 50.0, 500.0])
    n = 20000
    s = _von_mises_torch(loc.repeat(n), conc.repeat(n), 2, None).view(n, 4)
    assert bool(torch.isfinite(s).all()) and float(s.min()) >= 0.0 and float(s.max()) < TWO_PI
    c, sn = torch.cos(s - loc), torch.sin(s - loc)
    expect = torch.special.i1e(conc) / torch.special.i0e(conc)
    se_c, se_s = c.std(0) / math.sqrt(n), sn.std(0) / math.sqrt(n)
    assert ((c.mean(0) - expect).abs() < 4 * se_c + 1e-6).all()
    assert (sn.mean(0).abs() < 4 * se_s + 1e-6).all()


@pytest.mark.parametrize("k", [30.0, 1e3, 1e5])
def test_von_mises_spread_is_right_in_float32_for_large_concentrations(k, kernel_path):
    # The sampler runs in the parameters' dtype; its stable form must keep the spread
    # E[1 - cos(theta - loc)] = 1 - I1(k) / I0(k) (~ 1 / 2k) where the textbook form
    # would cancel to nothing in float32. Within 4 SE.
    n = 100000
    s = sample_von_mises(torch.zeros(n), torch.full((n,), k))
    assert s.dtype == torch.float32
    d = torch.remainder(s.double() + math.pi, TWO_PI) - math.pi
    spread = 2.0 * torch.sin(d / 2) ** 2
    kk = torch.tensor(k, dtype=torch.float64)
    expect = 1.0 - float(torch.special.i1e(kk) / torch.special.i0e(kk))
    assert abs(float(spread.mean()) - expect) < 4 * float(spread.std()) / math.sqrt(n)
    assert abs(float(torch.sin(d).mean())) < 4 * float(torch.sin(d).std()) / math.sqrt(n)


def test_von_mises_draws_stay_inside_the_prior_support_in_float32(kernel_path):
    # Draws just below loc = 0 wrap to just below 2 pi, which rounds to 2 pi in float32.
    s = sample_von_mises(torch.zeros(200000), torch.full((200000,), 1e4))
    assert s.dtype == torch.float32 and bool((s < TWO_PI).all()) and bool((s >= 0).all())
    model = build_model()
    z = {
        "mu": torch.zeros(1, 1, 4, 2),
        "c": torch.zeros(1, 1, 200000, dtype=torch.long),
        "alpha": s.view(1, 1, -1),
    }
    assert torch.isfinite(model.log_prior_local(torch.zeros(1, 200000, 2), z)).all()
    with pytest.raises(ValueError, match="finite"):
        sample_von_mises(torch.zeros(3), torch.tensor([1.0, float("nan"), 2.0]))


def test_local_proposal_scores_each_angle_under_its_own_assignment(kernel_path):
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 5, 4)
    direction = torch.randn(2, 3, 5, 4, 2)
    raw = torch.randn(2, 3, 5, 4)
    q = LocalProposal(logits, direction, raw)
    z = q.sample()
    assert z["c"].shape == (2, 3, 5) and z["alpha"].shape == (2, 3, 5)
    old = {"c": torch.randint(4, (2, 3, 5)), "alpha": TWO_PI * torch.rand(2, 3, 5)}
    by_hand = torch.zeros(2, 3)
    for p in range(2):
        for b in range(3):
            for n in range(5):
                i = old["c"][p, b, n]
                u = direction[p, b, n, i]
                conc = torch.nn.functional.softplus(raw[p, b, n, i]) + 1e-3
                vm = torch.distributions.VonMises(torch.atan2(u[1], u[0]), conc)
                by_hand[p, b] += torch.log_softmax(logits[p, b, n], -1)[i] + vm.log_prob(
                    old["alpha"][p, b, n]
                )
    assert torch.allclose(q.log_prob(old), by_hand, atol=1e-4)


def test_local_proposal_assignment_frequencies(kernel_path):
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])).expand(50000, 1, 1, 4)
    q = LocalProposal(logits, torch.ones(50000, 1, 1, 4, 2), torch.zeros(50000, 1, 1, 4))
    freq = torch.bincount(q.sample()["c"].flatten(), minlength=4).double() / 50000
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    assert ((freq - p).abs() < 4 * (p * (1 - p) / 50000).sqrt()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_local_kernels_draw_what_their_twins_draw(dtype, monkeypatch):
    """Same seed, same uniforms: the compiled draws (rings.c) equal the PyTorch twins' up to
    rounding, for assignments and angles (loc = 6.2 and tiny or huge k included)."""
    import apg.kernels

    if apg.kernels.native_library() is None:
        pytest.skip("no C compiler")
    params = torch.randn(3, 4, 500, 4, 4, dtype=dtype) * torch.tensor([3.0, 1.0, 1.0, 4.0], dtype=dtype)
    loc = torch.cat([torch.full((100,), 6.2), torch.rand(400) * 6.0 - 3.0]).to(dtype)
    conc = torch.cat([torch.full((100,), 1e-5), torch.full((100,), 1e5), torch.rand(300) * 20]).to(dtype)
    draws = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(apg.kernels, "native_library", lambda: None)
        torch.manual_seed(4)
        z = LocalProposal.from_params(params).sample()
        torch.manual_seed(5)
        draws.append((z["c"], z["alpha"], sample_von_mises(loc, conc)))
    (c1, a1, v1), (c2, a2, v2) = draws
    assert torch.equal(c1, c2)
    # asin(sqrt(x)) near x = 1 amplifies rounding (~1e-4 in float32); a flipped accept
    # test or a wrap at 0 = 2 pi would show as a gap of order 1.
    # In float64 every draw agrees; in float32 a few near-boundary ones may round apart.
    tol, stray = (1e-3, 5) if dtype == torch.float32 else (1e-9, 0)
    for got, want in ((a1, a2), (v1, v2)):
        gap = torch.remainder(got - want + math.pi, TWO_PI) - math.pi
        assert int((gap.abs() > tol).sum()) <= stray
        assert float(got.min()) >= 0 and float(got.max()) < TWO_PI


def _local_reference(net, x, mu):
    """``LocalNet``'s outputs by the plain formula (no fused layers)."""
    s0, s = net.cfg.sigma0, net.cfg.noise
    d = x.unsqueeze(-2) - mu.unsqueeze(-3)
    sq = (d**2).sum(-1, keepdim=True)
    norm = sq.clamp_min(1e-12).sqrt()
    skip_in = torch.cat([sq / (2 * s**2), norm / s**2, torch.log(norm), d / norm], -1)
    hidden = torch.tanh(net.point(x / s0).unsqueeze(-2) - net.cluster(mu / s0).unsqueeze(-3))
    return net.out(hidden) + net.skip(skip_in)


def _local_log_prob_reference(params, c, alpha):
    lp_c = torch.log_softmax(params[..., 0], -1).gather(-1, c.unsqueeze(-1)).squeeze(-1)
    picked = params.gather(-2, c[..., None, None].expand(*c.shape, 1, 4)).squeeze(-2)
    loc = torch.atan2(picked[..., 2], picked[..., 1])
    k = torch.nn.functional.softplus(picked[..., 3]) + 1e-3
    return (lp_c + von_mises_log_prob(alpha, loc, k)).sum(-1)


def _local_setup(dtype, num_particles=3, num_points=7):
    from apg.tasks.dgmm import LocalNet

    torch.manual_seed(2)
    cfg = DGMMConfig()
    net = LocalNet(cfg, 8)
    with torch.no_grad():  # exercise every weight, the skip's included
        net.skip.weight.normal_()
    net = net.to(dtype)
    x = simulate(build_model(), 2, torch.Generator().manual_seed(0), num_points=num_points)["x"].to(dtype)
    mu = cfg.sigma0 * torch.randn(num_particles, 2, cfg.num_clusters, 2, dtype=torch.float64)
    value = {
        "c": torch.randint(cfg.num_clusters, (num_particles, 2, num_points)),
        "alpha": TWO_PI * torch.rand(num_particles, 2, num_points, dtype=torch.float64).to(dtype),
    }
    return net, x, mu.to(dtype), value


def test_local_network_and_log_prob_match_the_plain_formulas(kernel_path):
    net, x, mu, value = _local_setup(torch.float64)
    q = net(x, mu)
    assert torch.allclose(q.params, _local_reference(net, x, mu), rtol=1e-10, atol=1e-10)
    expect = _local_log_prob_reference(q.params, value["c"], value["alpha"])
    assert torch.allclose(q.log_prob(value), expect, rtol=1e-10, atol=1e-10)
    weights = torch.randn(3, 2, dtype=torch.float64)
    grads = torch.autograd.grad(
        (q.log_prob(value) * weights).sum(), list(net.parameters()), retain_graph=True
    )
    expect_grads = torch.autograd.grad((expect * weights).sum(), list(net.parameters()))
    for got, want in zip(grads, expect_grads, strict=True):
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-10)


def test_local_kernels_pass_gradcheck(kernel_path):
    net, x, mu, value = _local_setup(torch.float64, num_particles=2, num_points=4)
    names = [n for n, _ in net.named_parameters()]

    def outputs(*weights):
        params = dict(zip(names, weights, strict=True))
        q = torch.func.functional_call(net, params, (x, mu))
        # transposed: the backward receives a non-contiguous gradient
        return q.params.transpose(-2, -3), q.log_prob(value)

    assert torch.autograd.gradcheck(outputs, tuple(p.detach().requires_grad_() for p in net.parameters()))
    params = net(x, mu).params.detach().requires_grad_()
    # rows with a zero (flushed) gradient and large concentrations (i0e's second expansion)
    with torch.no_grad():
        params[0, 0, :, :, 3] += 15.0
    assert torch.autograd.gradcheck(
        lambda p: LocalProposal.from_params(p).log_prob(value) * torch.tensor([[0.0, 1.0], [1.0, 2.0]]),
        (params,),
    )


@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_local_kernels_float32_agree_with_float64(kernel_path, scale):
    # scale 40 puts first-layer parts beyond 20 in some blocks of points and some cluster
    # rows, where the float32 layer's exp-product tanh gives way to the rational one.
    results = []
    for dtype in (torch.float64, torch.float32):
        net, x, mu, value = _local_setup(dtype, num_particles=10, num_points=200)
        with torch.no_grad():
            net.point.weight.mul_(scale)
            net.cluster.weight.mul_(scale)
            s0 = net.cfg.sigma0
            parts = torch.cat([net.point(x / s0).flatten(), net.cluster(mu.to(dtype) / s0).flatten()])
        if scale > 1:
            assert float(parts.abs().max()) > 20 and float((parts.abs() < 20).double().mean()) > 0.3
        q = net(x, mu)
        lp = q.log_prob(value)
        grads = torch.autograd.grad(lp.sum(), list(net.parameters()))
        results.append([q.params.detach(), lp.detach(), *grads])
    for high, low in zip(*results, strict=True):
        assert float((low.double() - high).abs().max()) < 1e-4 * float(high.abs().max())


def test_pooling_sharpens_with_count_and_leaves_empty_clusters_at_the_prior():
    n = 50
    weights = torch.zeros(n, 3)
    weights[:10, 0] = 1.0
    weights[10:, 1] = 1.0  # cluster 2 is empty
    stat = torch.randn(n, 2)
    mean, prec = pool_per_cluster(weights, stat, torch.full((n, 2), 4.0), prior_precision=0.1)
    assert torch.allclose(prec[:, 0], torch.tensor([0.1 + 40, 0.1 + 160, 0.1]))
    assert torch.allclose(mean[2], torch.zeros(2)) and torch.allclose(prec[2], torch.full((2,), 0.1))
    assert torch.allclose(mean[0], 40 * stat[:10].mean(0) / 40.1)


def test_centre_kernel_pooling_matches_the_one_hot_formula_and_passes_gradcheck(kernel_path):
    torch.set_default_dtype(torch.float64)
    per_point = torch.randn(3, 2, 9, 4, requires_grad=True)
    x = torch.randn(2, 9, 2)
    c = torch.randint(3, (3, 2, 9))
    c[0, 0] = 0  # clusters 1 and 2 of this dataset are empty: the prior comes back
    mean, prec = pool_assigned(per_point, x, c, 4, 0.1)
    one_hot = torch.nn.functional.one_hot(c, 4).double()
    offset, raw = per_point[..., :2], per_point[..., 2:]
    want_mean, want_prec = pool_per_cluster(one_hot, x - offset, raw.exp(), 0.1)
    assert torch.allclose(mean, want_mean, atol=1e-12) and torch.allclose(prec, want_prec, atol=1e-12)
    assert torch.equal(prec[0, 0, 1:], torch.full((3, 2), 0.1))
    # transposed: the backward receives a non-contiguous gradient
    assert torch.autograd.gradcheck(
        lambda q: torch.cat(pool_assigned(q, x, c, 4, 0.1), -1).transpose(-1, -2), (per_point,)
    )


# --------------------------------------------------------------------------- sampler identities


class _Spy(Proposals):
    """Wraps proposals; replaces chosen block kernels and records what each kernel saw."""

    def __init__(self, inner: Proposals, replace: dict):
        super().__init__()
        self.inner, self.replace, self.seen = inner, replace, []

    def initial(self, x, num_particles):
        return self.inner.initial(x, num_particles)

    def kernel(self, block, x, z):
        dist = self.replace[block](x, z) if block in self.replace else self.inner.kernel(block, x, z)
        spy = self

        class Recorded:
            def sample(self_inner):
                new = dist.sample()
                spy.seen.append((block, dict(z), new))
                return new

            def log_prob(self_inner, value):
                return dist.log_prob(value)

        return Recorded()


def _prior_mu(model):
    def kernel(x, z):
        loc = torch.zeros_like(z["mu"])
        return Factorized({"mu": (Normal(loc, model.cfg.sigma0), 2)})

    return kernel


def _prior_local(model):
    def kernel(x, z):
        shape = z["c"].shape
        i = model.cfg.num_clusters
        return Factorized(
            {
                "c": (Categorical(logits=torch.zeros(*shape, i)), 1),
                "alpha": (Uniform(torch.zeros(shape), torch.full(shape, TWO_PI)), 1),
            }
        )

    return kernel


def test_prior_kernels_give_likelihood_ratio_increments(f64):
    """eq. 9 with q = prior: the incremental weight is p(x | new) / p(x | old)."""
    model, data = _data(num_datasets=2, num_points=30)
    model = model.double()
    x = data["x"]
    inner = build_proposals(model, "apg").double()
    spy = _Spy(inner, {"mu": _prior_mu(model), "local": _prior_local(model)})
    result = run_apg(model, spy, x, num_sweeps=3, num_particles=5)
    assert [s[0] for s in spy.seen] == ["mu", "local", "mu", "local"]
    for sweep, (block, z_old, new) in zip((1, 1, 2, 2), spy.seen, strict=True):
        z_new = {**z_old, **new}
        ratio = model.log_likelihood(x, z_new) - model.log_likelihood(x, z_old)
        got = result.sweeps[sweep].log_increments[block]
        assert torch.allclose(got, ratio, rtol=1e-10, atol=1e-7)
        assert ratio.abs().max() > 1.0


def test_exact_mu_conditional_gives_zero_increment(f64):
    """With g fixed, q(mu | x, c, alpha) can be the exact conjugate conditional (the form of
    the NSS kernel with s_n = x_n - g(alpha_n), lambda_n = 1 / sigma_eps^2): then the
    incremental weight of the mu block is exactly one."""
    model, data = _data(num_datasets=2, num_points=30)
    model = model.double()
    x = data["x"]
    cfg = model.cfg

    def exact_mu(x, z):
        one_hot = torch.nn.functional.one_hot(z["c"], cfg.num_clusters).double()
        stat = x - model.g(z["alpha"])
        mean, prec = pool_per_cluster(one_hot, stat, torch.full_like(stat, cfg.noise**-2), cfg.sigma0**-2)
        return Factorized({"mu": (Normal(mean, prec.rsqrt()), 2)})

    spy = _Spy(build_proposals(model, "apg").double(), {"mu": exact_mu})
    with torch.no_grad():
        result = run_apg(model, spy, x, num_sweeps=3, num_particles=6)
    for stats in result.sweeps[1:]:
        assert stats.log_increments["mu"].abs().max() < 1e-6
        assert stats.log_increments["local"].abs().max() > 1e-3  # not trivially zero


def test_running_log_joint_matches_recomputed_joint(f64):
    model, data = _data(num_datasets=2, num_points=30)
    model = model.double()
    result = run_apg(model, build_proposals(model, "apg").double(), data["x"], num_sweeps=4, num_particles=5)
    assert torch.allclose(result.log_joint, model.log_joint(data["x"], result.z), rtol=1e-10)


# --------------------------------------------------------------------------- proposals


@pytest.mark.parametrize("arch", ["apg", "mlp", "lstm"])
def test_proposals_run_on_datasets_of_any_size(arch):
    model = build_model()
    proposals = build_proposals(model, arch)
    sweeps = 2 if arch == "apg" else 1
    for n in (100, 600):
        x = simulate(model, 2, torch.Generator().manual_seed(n), num_points=n)["x"].float()
        with torch.no_grad():
            result = run_apg(model, proposals, x, sweeps, 3)
        assert result.z["mu"].shape == (3, 2, 4, 2)
        assert result.z["c"].shape == (3, 2, n) and result.z["alpha"].shape == (3, 2, n)
        assert torch.isfinite(result.log_weights).all()
        assert float(result.z["alpha"].min()) >= 0.0 and float(result.z["alpha"].max()) < TWO_PI


def test_rws_architectures_have_no_kernels():
    model, data = _data()
    proposals = build_proposals(model, "mlp")
    z, _ = proposals.initial(data["x"].float(), 2)
    with pytest.raises(NotImplementedError):
        proposals.kernel("mu", data["x"].float(), z)


def test_cached_shapes_change_nothing_but_how_often_g_runs(f64):
    # The particles carry g_theta(alpha) through resampling (DGMM.log_joint_step); a
    # model that recomputes it everywhere must give the same run, values and gradients.
    from apg.blocks import Model
    from apg.objectives import apg_loss

    class Recomputing(DGMM):
        log_joint_step = Model.log_joint_step  # the default: no caches

    model, data = _data(num_datasets=2, num_points=15)
    plain = Recomputing(model.cfg)
    plain.load_state_dict(model.state_dict())
    proposals = build_proposals(model, "apg")
    runs = []
    for m in (model, plain):
        calls = []
        g = m.g
        m.g = lambda alpha, g=g, calls=calls: calls.append(1) or g(alpha)
        torch.manual_seed(3)
        result = run_apg(m, proposals, data["x"], num_sweeps=4, num_particles=5)
        params = [*m.parameters(), *proposals.parameters()]
        grads = torch.autograd.grad(apg_loss(result), params, allow_unused=True)
        runs.append((result, grads, len(calls)))
    (cached, cached_grads, cached_calls), (recomputed, grads, calls) = runs
    assert set(cached.z) == {"mu", "c", "alpha"}
    assert torch.equal(cached.z["c"], recomputed.z["c"])
    assert torch.allclose(cached.log_weights, recomputed.log_weights, rtol=0, atol=1e-9)
    assert torch.allclose(cached.log_joint, recomputed.log_joint, rtol=0, atol=1e-9)
    for a, b in zip(cached_grads, grads, strict=True):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-9, atol=1e-9)
    # initial joint, first centre update, one per local update; against 1 + 3 per sweep
    assert (cached_calls, calls) == (1 + 1 + 3, 1 + 3 * 3)


def test_apg_loss_reaches_model_and_every_proposal_network():
    from apg.objectives import apg_loss

    model, data = _data(num_datasets=2, num_points=30)
    proposals = build_proposals(model, "apg")
    apg_loss(run_apg(model, proposals, data["x"].float(), 3, 4)).backward()
    for name, module in (
        ("model", model),
        ("encoder", proposals.encoder),
        ("kernel", proposals.centre_kernel),
        ("local", proposals.local),
    ):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        assert grads and any(g.abs().sum() > 0 for g in grads), name


def test_flushing_negligible_weights_changes_no_gradient(monkeypatch):
    """The losses drop weights below ~1e-31 (apg.objectives.flush_negligible, for speed);
    the loss's gradients must be those without the flush, to float32 rounding."""
    import apg.objectives
    from apg.objectives import apg_loss

    model, data = _data(num_datasets=3, num_points=60)
    proposals = build_proposals(model, "apg")
    params = [*model.parameters(), *proposals.parameters()]

    def gradients():
        torch.manual_seed(3)
        result = run_apg(model, proposals, data["x"].float(), 4, 10)
        grads = torch.autograd.grad(apg_loss(result), params, allow_unused=True)
        smallest = min(float(s.weights[s.weights > 0].min()) for s in result.steps)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)], smallest

    flushed, smallest = gradients()
    assert smallest < 1e-31  # some weights are small enough to be flushed
    monkeypatch.setattr(apg.objectives, "flush_negligible", lambda w: w)
    plain, _ = gradients()
    for a, b in zip(flushed, plain, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def test_task_registry_and_draw():
    task = get_task("dgmm")
    assert task.name == "dgmm" and task.architectures == ("apg", "mlp", "lstm")
    assert task.reconstruct is reconstruct and task.draw is not None
    mpl = pytest.importorskip("matplotlib")
    mpl.use("Agg")
    import matplotlib.pyplot as plt

    model, data = _data(num_datasets=1)
    z = {"mu": data["mu"][0].numpy(), "c": data["c"][0].numpy(), "alpha": data["alpha"][0].numpy()}
    fig, ax = plt.subplots()
    task.draw(ax, data["x"][0].numpy(), z, model=model)
    assert len(ax.lines) == model.cfg.num_clusters
    fig2, ax2 = plt.subplots()
    task.draw(ax2, data["x"][0].numpy(), z)
    assert len(ax2.lines) == 0 and len(ax2.collections) == 1 + model.cfg.num_clusters
    # With reconstructions: one ring of dots per cluster besides its centre, no polygons.
    latents = {k: torch.as_tensor(v)[None, None] for k, v in z.items()}
    recon = reconstruct(model, data["x"][:1].float(), {**latents, "alpha": latents["alpha"].float()})
    fig3, ax3 = plt.subplots()
    task.draw(ax3, data["x"][0].numpy(), {**z, "recon": recon[0, 0].detach().numpy()})
    assert len(ax3.lines) == 0 and len(ax3.collections) == 1 + 2 * model.cfg.num_clusters
    plt.close("all")


def test_config_validation():
    with pytest.raises(ValueError):
        DGMMConfig(noise=0.0)
    assert isinstance(build_model(sigma0=2.0), DGMM)


# --------------------------------------------------------------------------- training


@pytest.mark.slow
def test_short_training_improves_inference_and_learns_a_ring():
    """A short CPU run of APG (about a minute) trains g_theta and the proposals jointly.

    Held-out log joint and ESS/L of the mu block must improve over the untrained model (per
    dataset, paired: mean gain > 3 standard errors, and > 0.1 for the ESS; on 10 held-out sets the
    trained ESS swung between 0.19 and 0.6 with float round-off, on 30 it is 0.6-0.7), and
    the learned shape must be a ring of the simulator's radius 2: reconstructions lie at
    2 +- 0.25 from their centres (0.25 is a bit more than the noise sd 0.2; the maximum-
    likelihood ring of noisy points is itself sqrt(r^2 + 2 sigma^2) - r ~ 0.02 wider) and
    |g_theta| varies little with the angle (an untrained g is a blob of radius ~0.2).
    """
    from apg.training import TrainConfig, Trainer, evaluate

    torch.set_num_threads(1)
    model = build_model()
    train = simulate(model, 200, torch.Generator().manual_seed(1), num_points=60)["x"].float()
    test = simulate(model, 30, torch.Generator().manual_seed(2), num_points=60)["x"].float()
    cfg = TrainConfig(
        task="dgmm", method="apg", sweeps=5, particles=10, batch_size=10, iterations=200, lr=3e-3
    )
    trainer = Trainer(cfg, train)

    def held_out():
        torch.manual_seed(5)
        out = evaluate(cfg, trainer.model, trainer.proposals, test, 5, 10, batch_size=10)
        return out["log_joint"][-1], out["ess_mu"][-1]

    lj0, ess0 = held_out()
    for _ in trainer.run():
        pass
    lj1, ess1 = held_out()
    for name, differences in (("log joint", lj1 - lj0), ("ESS/L", ess1 - ess0)):  # paired per dataset
        gain, standard_error = mean_se(differences)
        assert gain > 3 * standard_error, (name, gain, standard_error)
    assert (ess1 - ess0).mean() > 0.1, (ess0.mean(), ess1.mean())

    torch.manual_seed(6)
    with torch.no_grad():
        result = run_apg(trainer.model, trainer.proposals, test, 5, 10)
        centre = result.z["mu"].gather(-2, result.z["c"].unsqueeze(-1).expand(-1, -1, -1, 2))
        dist = (reconstruct(trainer.model, test, result.z) - centre).norm(dim=-1)  # (L, B, N)
        w = torch.softmax(result.log_weights, 0)
        mean_dist = float((w * dist.mean(-1)).sum(0).mean())
        shape = trainer.model.g(torch.linspace(0, TWO_PI, 64)).norm(dim=-1)
    assert abs(mean_dist - 2.0) < 0.25, mean_dist
    assert float(shape.std() / shape.mean()) < 0.1


def test_von_mises_draws_in_half_precision_use_torch_uniforms():
    # Philox uniforms serve float32/64; other dtypes keep torch.rand (a 24-bit grid would
    # overflow float16). The draws must still follow the density: E cos(theta) = I1/I0.
    torch.manual_seed(0)
    n, k = 4000, 2.0
    s = sample_von_mises(torch.zeros(n, dtype=torch.float16), torch.full((n,), k, dtype=torch.float16))
    assert s.dtype == torch.float16 and float(s.min()) >= 0.0 and float(s.max()) < TWO_PI
    c = torch.cos(s.double())
    expect = float(torch.special.i1e(torch.tensor(k)) / torch.special.i0e(torch.tensor(k)))
    assert abs(float(c.mean()) - expect) < 4 * float(c.std()) / math.sqrt(n) + 2e-3  # + float16 rounding


def test_angle_prior_is_exact_in_float64():
    model = build_model()
    alpha = torch.rand(2, 3, 200, dtype=torch.float64) * TWO_PI
    alpha[1, 2, 7] = TWO_PI  # outside the support
    z = {
        "mu": torch.zeros(2, 3, 4, 2, dtype=torch.float64),
        "c": torch.zeros(2, 3, 200, dtype=torch.long),
        "alpha": alpha,
    }
    got = model.log_prior_local(torch.zeros(3, 200, 2, dtype=torch.float64), z)
    expect = 200 * (-math.log(TWO_PI) - math.log(4))
    assert got.dtype == torch.float64 and got[1, 2] == -math.inf
    assert torch.equal(got.flatten()[:-1], torch.full((5,), expect, dtype=torch.float64))


def test_von_mises_refuses_non_finite_parameters():
    loc, k = torch.zeros(5), torch.ones(5)
    for bad_loc, bad_k in (
        (loc, k.index_fill(0, torch.tensor([3]), math.nan)),
        (loc.index_fill(0, torch.tensor([1]), math.inf), k),
    ):
        with pytest.raises(ValueError, match="must be finite"):
            sample_von_mises(bad_loc, bad_k)
    # finite parameters whose sum overflows still draw
    draws = sample_von_mises(torch.full((4,), 3e38), torch.ones(4))
    assert torch.isfinite(draws).all() and (draws >= 0).all() and (draws < 2 * math.pi).all()


def test_gaussian_mu_is_the_diagonal_normal_of_its_precisions(f64):
    torch.manual_seed(3)
    mean, precision = torch.randn(3, 2, 4, 2), torch.rand(3, 2, 4, 2) * 5 + 0.1
    mean.requires_grad_()
    q = GaussianMu(mean, precision)
    value = {"mu": torch.randn(3, 2, 4, 2)}
    want = Normal(mean, precision.rsqrt()).log_prob(value["mu"]).sum((-2, -1))
    assert torch.allclose(q.log_prob(value), want, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(q.log_prob(value).sum(), mean)
    assert torch.allclose(grad, precision * (value["mu"] - mean.detach()), rtol=0, atol=1e-12)
    # draws: standardized residuals have mean 0 and variance 1 within 4 standard errors
    draws = torch.stack([q.sample()["mu"] for _ in range(2000)])
    z = (draws - mean.detach()) * precision.sqrt()
    n = z.shape[0]
    assert (z.mean(0).abs() < 4 / n**0.5).all()
    assert ((z.var(0) - 1).abs() < 4 * (2 / n) ** 0.5).all()
