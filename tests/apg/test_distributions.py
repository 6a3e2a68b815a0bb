"""The categorical draws and log-probabilities over a short last axis, on both paths of
the native kernels (compiled and the PyTorch twins)."""

import math

import pytest
import torch

from apg.distributions import CategoricalBlock, categorical_log_prob, categorical_sample


def test_categorical_log_prob_matches_torch_and_its_gradient(kernel_path):
    torch.set_default_dtype(torch.float64)
    logits = torch.randn(3, 4, 5, 3, requires_grad=True)
    index = torch.randint(3, (3, 4, 5))
    expected = torch.distributions.Categorical(logits=logits).log_prob(index)
    assert torch.allclose(categorical_log_prob(logits, index), expected)
    assert torch.autograd.gradcheck(lambda t: categorical_log_prob(t, index), (logits,))


def test_categorical_log_prob_takes_impossible_categories_and_expanded_gradients(kernel_path):
    logits = torch.tensor([[0.0, -math.inf, 1.0], [2.0, 0.5, -math.inf]], requires_grad=True)
    index = torch.tensor([2, 0])
    out = categorical_log_prob(logits, index)
    expected = torch.log_softmax(logits.detach(), -1)[[0, 1], index]
    assert torch.allclose(out, expected)
    out.sum().backward()  # the incoming gradient of a sum is an expanded (stride-0) tensor
    probs = torch.softmax(logits.detach(), -1)
    assert torch.allclose(logits.grad, torch.nn.functional.one_hot(index, 3) - probs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_categorical_sample_frequencies_match_the_probabilities(kernel_path, dtype):
    probs = torch.tensor([0.1, 0.6, 0.0, 0.3], dtype=dtype)
    rows = 200_000
    logits = (probs.log() + 5.0).expand(rows, 4)  # unnormalized, one impossible category
    draws = categorical_sample(logits)
    assert draws.dtype == torch.long and draws.shape == (rows,)
    freq = torch.bincount(draws, minlength=4).to(torch.float64) / rows
    se = torch.sqrt(probs.double() * (1 - probs.double()) / rows)
    assert freq[2] == 0  # never the zero-probability category
    assert torch.all((freq - probs.double()).abs() <= 4 * se + 1e-12), freq


def test_categorical_block_sums_points_and_draws_in_range(kernel_path):
    logits = torch.randn(2, 3, 7, 4)
    block = CategoricalBlock("c", logits)
    c = block.sample()["c"]
    assert c.shape == (2, 3, 7) and int(c.min()) >= 0 and int(c.max()) < 4
    expected = torch.distributions.Categorical(logits=logits).log_prob(c).sum(-1)
    assert torch.allclose(block.log_prob({"c": c}), expected, atol=1e-5)


@pytest.mark.parametrize("num_points", [7, 64, 150])
def test_categorical_block_draws_and_scores_like_the_row_functions(kernel_path, num_points):
    # The block's compiled passes (a draw that keeps each row's log-normalizer; one
    # gather-and-sum per particle) give the per-row functions' draws for the same seed,
    # their summed log-probabilities of new and old values, and autograd's gradient.
    torch.set_default_dtype(torch.float64)
    logits = torch.randn(3, 2, num_points, 4, requires_grad=True)
    logits.data[0, 0, :, 1] = -math.inf  # an impossible category
    torch.manual_seed(5)
    want = categorical_sample(logits)
    torch.manual_seed(5)
    block = CategoricalBlock("c", logits)
    c = block.sample()["c"]
    assert torch.equal(c, want)
    old = torch.randint(4, c.shape)
    old[0, 0] = torch.where(old[0, 0] == 1, 0, old[0, 0])
    weights = torch.rand(3, 2)
    weights[1, 1] = 0.0  # a flushed particle: its rows' gradient is exactly zero
    for value in (c, old):
        expected = torch.distributions.Categorical(logits=logits).log_prob(value).sum(-1)
        got = block.log_prob({"c": value})
        assert torch.allclose(got, expected, rtol=0, atol=1e-12)
        (grad,) = torch.autograd.grad((weights * got).sum(), logits)
        (want_grad,) = torch.autograd.grad((weights * expected).sum(), logits)
        assert torch.allclose(grad, want_grad, rtol=0, atol=1e-12)
        assert torch.all(grad[1, 1] == 0)
    # scoring before any draw computes the normalizers itself
    fresh = CategoricalBlock("c", logits)
    assert torch.allclose(fresh.log_prob({"c": old}), block.log_prob({"c": old}), rtol=0, atol=1e-12)


@pytest.mark.parametrize("num_points", [7, 64, 151])
def test_categorical_block_proposes_like_its_separate_draw_and_scores(monkeypatch, num_points):
    # propose, compiled (one pass: the draw, and log q of the new and of the old values),
    # against sample and two log_prob calls on the PyTorch path: the same draws for the
    # same seed, the same scores, and the same gradient through log q of the new values;
    # odd row counts put a particle's first row in the middle of a Philox block.
    import apg.kernels
    from apg.blocks import propose, propose_separately

    if apg.kernels.native_library() is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")
    torch.set_default_dtype(torch.float64)
    logits = torch.randn(3, 2, num_points, 4, requires_grad=True)
    logits.data[0, 0, :, 1] = -math.inf  # an impossible category
    old = {"c": torch.randint(4, (3, 2, num_points))}
    old["c"][0, 0] = torch.where(old["c"][0, 0] == 1, 0, old["c"][0, 0])
    weights = torch.rand(3, 2)
    results = []
    for how in (propose, propose_separately):
        if how is propose_separately:
            monkeypatch.setattr(apg.kernels, "native_library", lambda: None)
        torch.manual_seed(5)
        new, log_q_new, log_q_old = how(CategoricalBlock("c", logits), old)
        (grad,) = torch.autograd.grad((weights * log_q_new).sum(), logits)
        assert not log_q_old.requires_grad and not new["c"].requires_grad
        results.append((new["c"], log_q_new, log_q_old, grad))
    (c, new_lq, old_lq, grad), (want_c, want_new, want_old, want_grad) = results
    assert torch.equal(c, want_c)
    for got, want in ((new_lq, want_new), (old_lq, want_old), (grad, want_grad)):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
