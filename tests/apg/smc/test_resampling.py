"""Resamplers: unbiased offspring counts, no zero-weight ancestors, gather, evidence."""

import math

import pytest
import torch

from apg.smc.resampling import RESAMPLERS, gather, get_resampler, resample
from apg.smc.weights import log_mean_exp

WEIGHTS = torch.tensor([0.05, 0.0, 0.31, 0.12, 0.0, 0.27, 0.25], dtype=torch.float64)


@pytest.mark.parametrize("name", sorted(RESAMPLERS))
def test_offspring_counts_are_unbiased(name, kernel_path):
    repeats, num_particles = 20000, len(WEIGHTS)
    log_w = torch.log(WEIGHTS).unsqueeze(1).expand(-1, repeats).contiguous()
    ancestors = get_resampler(name)(log_w)  # (L, R): R independent resamplings
    counts = torch.nn.functional.one_hot(ancestors, num_particles).sum(0).double()  # (R, L)
    mean, se = counts.mean(0), counts.std(0) / math.sqrt(repeats)
    expected = num_particles * WEIGHTS
    assert torch.all((mean - expected).abs() <= 3 * se + 1e-9), (mean, expected, se)
    # Zero-weight particles are never picked.
    assert counts[:, WEIGHTS == 0].sum() == 0
    # Every resampling returns exactly L ancestors.
    assert torch.all(counts.sum(1) == num_particles)


def test_systematic_counts_are_floor_or_ceil(kernel_path):
    log_w = torch.log(WEIGHTS).unsqueeze(1).expand(-1, 500).contiguous()
    counts = torch.nn.functional.one_hot(get_resampler("systematic")(log_w), len(WEIGHTS)).sum(0)
    expected = len(WEIGHTS) * WEIGHTS
    assert torch.all(counts >= torch.floor(expected)) and torch.all(counts <= torch.ceil(expected))


def test_unknown_resampler_is_rejected():
    with pytest.raises(ValueError, match="unknown resampler 'stratifed'"):
        get_resampler("stratifed")


def test_gather_works_for_any_trailing_dims():
    t = torch.arange(3 * 2 * 4 * 5).reshape(3, 2, 4, 5)
    ancestors = torch.tensor([[2, 0], [2, 1], [0, 1]])
    out = gather(t, ancestors)
    for l in range(3):
        for b in range(2):
            assert torch.equal(out[l, b], t[ancestors[l, b], b])
    assert torch.equal(gather(t[..., 0, 0], ancestors), out[..., 0, 0])


@pytest.mark.parametrize("name", sorted(RESAMPLERS))
def test_resample_keeps_the_evidence_estimate(name, kernel_path):
    log_w = torch.randn(6, 3, dtype=torch.float64)
    z = {"a": torch.randn(6, 3, 2, dtype=torch.float64)}
    new_log_w, new_z = resample(log_w, z, get_resampler(name))
    assert torch.allclose(new_log_w, log_mean_exp(log_w).expand(6, 3))
    assert new_z["a"].shape == (6, 3, 2)
    # Every outgoing particle is one of the incoming ones of the same dataset.
    for b in range(3):
        for l in range(6):
            assert any(torch.equal(new_z["a"][l, b], z["a"][k, b]) for k in range(6))


def test_compiled_systematic_resampling_picks_what_its_twin_picks(monkeypatch):
    # Same seed, same offsets: in float64 the two cumulative sums agree far below the
    # spacing of the points, so every ancestor must be the same. The compiled resample
    # copies contiguous tensors without a graph itself and gathers the others (one with
    # theta's graph, one a transposed view) as the twin does.
    import apg.kernels

    if apg.kernels.native_library() is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")
    log_w = 3 * torch.randn(10, 50, dtype=torch.float64)
    log_w[2] = -math.inf  # a zero weight in every dataset
    z = {
        "a": torch.randn(10, 50, 4, dtype=torch.float64),
        "c": torch.randint(5, (10, 50)),
        "graph": torch.randn(10, 50, 3, requires_grad=True),
        "view": torch.randn(50, 10).T,
    }
    runs = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(apg.kernels, "native_library", lambda: None)
        torch.manual_seed(7)
        ancestors = get_resampler("systematic")(log_w)
        torch.manual_seed(7)  # the same offsets again
        runs.append((ancestors, *resample(log_w, z, get_resampler("systematic"))))
    (anc, lw, out), (anc_t, lw_t, out_t) = runs
    assert torch.equal(anc, anc_t) and not (anc == 2).any()
    assert torch.allclose(lw, lw_t, rtol=0, atol=1e-12)
    assert all(torch.equal(out[k], out_t[k]) and torch.equal(out[k], gather(z[k], anc)) for k in z)
    assert out["graph"].requires_grad and not out["a"].requires_grad
