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
