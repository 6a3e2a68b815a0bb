"""Exact identities of the log-weight helpers."""

import math

import pytest
import torch

from apg.smc.weights import (
    DegenerateWeightsError,
    ess,
    ess_fraction,
    log_evidence,
    log_mean_exp,
    normalize,
    sanitize,
)


def test_ess_of_equal_weights_is_number_of_particles():
    log_w = torch.full((7, 3), -12.5, dtype=torch.float64)
    assert torch.allclose(ess(log_w), torch.full((3,), 7.0, dtype=torch.float64))
    assert torch.allclose(ess_fraction(log_w), torch.ones(3, dtype=torch.float64))


def test_ess_of_a_single_surviving_particle_is_one():
    log_w = torch.full((5, 2), -math.inf, dtype=torch.float64)
    log_w[3, 0], log_w[0, 1] = 4.0, -1e4
    assert torch.allclose(ess(log_w), torch.ones(2, dtype=torch.float64))


def test_ess_matches_the_definition():
    log_w = torch.randn(9, 4, dtype=torch.float64) * 3
    w = torch.exp(log_w)
    expected = w.sum(0) ** 2 / (w**2).sum(0)
    assert torch.allclose(ess(log_w), expected, rtol=1e-12)


def test_log_mean_exp_matches_naive_formula_in_float64():
    log_w = torch.randn(11, 6, dtype=torch.float64) * 5
    naive = torch.log(torch.exp(log_w).mean(0))
    assert torch.allclose(log_mean_exp(log_w), naive, rtol=0, atol=1e-12)
    assert torch.allclose(log_evidence(log_w), naive, rtol=0, atol=1e-12)


def test_log_mean_exp_is_stable_for_huge_log_weights():
    log_w = torch.tensor([[1e4], [1e4]], dtype=torch.float64)
    assert log_mean_exp(log_w).item() == pytest.approx(1e4)


def test_normalize_sums_to_one():
    log_w = torch.randn(8, 3, dtype=torch.float64) * 50
    assert torch.allclose(torch.exp(normalize(log_w)).sum(0), torch.ones(3, dtype=torch.float64))


def test_sanitize_turns_nan_into_minus_inf():
    log_w = torch.tensor([[0.0], [math.nan]])
    out = sanitize(log_w)
    assert out[0, 0] == 0.0 and torch.isneginf(out[1, 0])


def test_all_zero_weights_raise_a_named_error():
    log_w = torch.tensor([[0.0, math.nan], [1.0, -math.inf]])
    with pytest.raises(DegenerateWeightsError, match=r"dataset\(s\) \[1\]"):
        sanitize(log_w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flush_negligible_zeroes_only_weights_below_tiny_over_eps(dtype):
    from apg.objectives import flush_negligible, weighted_nll

    info = torch.finfo(dtype)
    cut = info.tiny / info.eps
    w = torch.tensor([[0.5, 2 * cut], [0.5 - 3 * cut, 0.5 * cut], [cut / 1e3, 1.0]], dtype=dtype)
    expect = w.clone()
    expect[1, 1] = expect[2, 0] = 0.0
    assert torch.equal(flush_negligible(w), expect)
    # The loss weighs with the flushed weights: a negligible weight's particle gets no gradient.
    log_density = torch.randn(3, 2, dtype=dtype, requires_grad=True)
    weighted_nll(w, log_density).backward()
    assert torch.equal(log_density.grad, -expect / 2)
