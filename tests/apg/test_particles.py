"""The highest-weight particle: its reconstructions, the GMM's assignment ceiling, the final
particle of every GMM method, and the rings' decoder-free scores of true and shuffled latents."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def test_best_particles_carry_reconstructions_only_for_small_data():
    from apg.particles import best_particles
    from apg.tasks import get_task
    from apg.training import TrainConfig, build

    cfg = TrainConfig(
        task="dgmm", method="apg", sweeps=2, particles=3, batch_size=20, iterations=1000, lr=1e-4
    ).validate()
    model, proposals = build(cfg)
    x = get_task("dgmm").simulate(model, 2, torch.Generator().manual_seed(0), num_points=20)["x"].float()
    best = best_particles(cfg, model, proposals, x, [1, 2], 3)
    assert sorted(best) == [1, 2]
    assert best[2]["recon"].shape == tuple(x.shape)  # the rings pictures draw the learned ring
    assert best[2]["mu"].shape[0] == 2

    cfg = TrainConfig(
        task="bmnist",
        method="apg",
        sweeps=2,
        particles=2,
        network={"num_digits": 1},
        batch_size=20,
        iterations=1000,
        lr=1e-4,
    ).validate()
    model, proposals = build(cfg)
    video = torch.zeros(1, 3, 96, 96)  # 27,648 numbers: a short video keeps its reconstruction
    video[0, :, 10:30, 10:30] = 1.0
    best = best_particles(cfg, model, proposals, video, [2], 2)
    assert best[2]["recon"].shape == tuple(video.shape) and best[2]["z_where_2"].shape == (1, 1, 2)
    long_video = torch.zeros(1, 30, 96, 96)  # 276,480 numbers: above RECON_MAX_ELEMENTS
    best = best_particles(cfg, model, proposals, long_video, [2], 2)
    assert "recon" not in best[2] and best[2]["z_where_30"].shape == (1, 1, 2)


def test_gmm_ceiling_recovers_well_separated_clusters():
    from apg.particles import ari_scores
    from apg.tasks.gmm import bayes_assignments

    gen = torch.Generator().manual_seed(1)
    c = torch.randint(3, (2, 50), generator=gen)
    mu = torch.tensor([[[-10.0, 0.0], [0.0, 10.0], [10.0, 0.0]]]).expand(2, -1, -1).double()
    tau = torch.full((2, 3, 2), 4.0, dtype=torch.float64)
    x = mu.gather(1, c.unsqueeze(-1).expand(-1, -1, 2)) + 0.5 * torch.randn(2, 50, 2, generator=gen).double()
    arrays = {"x": x.numpy(), "mu": mu.numpy(), "tau": tau.numpy(), "c": c.numpy()}
    best = bayes_assignments(arrays)
    assert best.shape == (2, 50)
    np.testing.assert_array_equal(best, c.numpy())
    np.testing.assert_allclose(ari_scores(c.numpy(), best), [1.0, 1.0])
    assert np.isnan(ari_scores(c.numpy(), None)).all()


@pytest.mark.parametrize("method", ["apg", "rws-mlp", "reparam"])
def test_final_particle_of_every_gmm_method(method):
    # The continuous-view baselines draw c from its exact conditional, so they have one too.
    from apg.particles import final_particle
    from apg.tasks import get_task
    from apg.training import TrainConfig, build

    torch.manual_seed(0)
    cfg = TrainConfig(
        task="gmm",
        method=method,
        sweeps=2,
        particles=3,
        network={"hidden": 8},
        batch_size=20,
        iterations=1000,
        lr=1e-4,
    ).validate()
    model, proposals = build(cfg)
    x = get_task("gmm").simulate(model, 5, torch.Generator().manual_seed(0), num_points=12)["x"].float()
    particle = final_particle(cfg, model, proposals, x, 2, 3, batch_size=2, resample_mode="block")
    c = particle["c"]
    assert c.shape == (5, 12) and c.dtype == np.int64 and ((c >= 0) & (c < 3)).all()
    assert particle["mu"].shape == (5, 3, 2)


def test_particle_scores_of_the_true_rings_beat_shuffled_ones():
    # The true latents score best on all three decoder-free measures; relabelling the rings
    # changes none of them, moving the centres or the assignments worsens each.
    from apg.particles import particle_scores
    from apg.tasks.dgmm import simulate_rings

    data = {k: v.numpy() for k, v in simulate_rings(4, 100, torch.Generator().manual_seed(1)).items()}
    truth = {"arrays": data, "c": data["c"], "ari_ceiling": None}
    sizes = {"radius": 2.0}
    exact = particle_scores("dgmm", truth, {"c": data["c"], "mu": data["mu"]}, {}, sizes)
    relabel = np.array([2, 0, 3, 1])
    permuted = particle_scores(
        "dgmm", truth, {"c": relabel[data["c"]], "mu": data["mu"][:, np.argsort(relabel)]}, {}, sizes
    )
    for name in ("ari", "centre_err", "log_joint_true"):
        np.testing.assert_allclose(permuted[name], exact[name], atol=1e-9)
    np.testing.assert_allclose(exact["ari"], 1.0)
    np.testing.assert_allclose(exact["centre_err"], 0.0, atol=1e-12)
    moved = particle_scores("dgmm", truth, {"c": data["c"], "mu": data["mu"] + 0.5}, {}, sizes)
    np.testing.assert_allclose(moved["centre_err"], 0.5 * np.sqrt(2), rtol=1e-9)
    assert (moved["log_joint_true"] < exact["log_joint_true"] - 50).all()
    scrambled = particle_scores(
        "dgmm", truth, {"c": np.roll(data["c"], 1, axis=1), "mu": data["mu"]}, {}, sizes
    )
    assert (scrambled["ari"] < 0.2).all() and (
        scrambled["log_joint_true"] < exact["log_joint_true"] - 100
    ).all()
    none = particle_scores("dgmm", truth, None, {}, sizes)
    assert all(np.isnan(none[name]).all() for name in ("ari", "centre_err", "log_joint_true"))
