"""Tests of the rings task's distributions and local kernels: von Mises draws, the local
proposal and its network, pooling, in both kernel paths."""

from __future__ import annotations

import math

import pytest
import torch

from apg.tasks.dgmm import (
    TWO_PI,
    DGMMConfig,
    LocalProposal,
    build_model,
    pool_assigned,
    pool_per_cluster,
    sample_von_mises,
    simulate,
    von_mises_log_prob,
)

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
