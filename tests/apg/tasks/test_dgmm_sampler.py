"""Tests of the rings task's sampler identities, proposals and a short training run."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from apg.blocks import Factorized, Proposals
from apg.smc.sampler import run_apg
from apg.tasks import get_task
from apg.tasks.dgmm import (
    DGMM,
    TWO_PI,
    DGMMConfig,
    GaussianMu,
    build_model,
    build_proposals,
    pool_per_cluster,
    reconstruct,
    sample_von_mises,
    simulate,
)
from tests.apg.tasks.dgmm_support import prior_local, simulated_rings
from tests.montecarlo import mean_se

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


def test_prior_kernels_give_likelihood_ratio_increments(f64):
    """eq. 9 with q = prior: the incremental weight is p(x | new) / p(x | old)."""
    model, data = simulated_rings(num_datasets=2, num_points=30)
    model = model.double()
    x = data["x"]
    inner = build_proposals(model, "apg").double()
    spy = _Spy(inner, {"mu": _prior_mu(model), "local": prior_local(model)})
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
    model, data = simulated_rings(num_datasets=2, num_points=30)
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
    model, data = simulated_rings(num_datasets=2, num_points=30)
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
    model, data = simulated_rings()
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

    model, data = simulated_rings(num_datasets=2, num_points=15)
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

    model, data = simulated_rings(num_datasets=2, num_points=30)
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

    model, data = simulated_rings(num_datasets=3, num_points=60)
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

    model, data = simulated_rings(num_datasets=1)
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
