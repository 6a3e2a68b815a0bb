"""The fused pairwise layer equals the plain autograd formula, values and gradients."""

import torch

from apg.nn import PointFeatures, pairwise_tanh_linear


def test_pairwise_tanh_linear_matches_the_plain_formula_and_its_gradients():
    torch.set_default_dtype(torch.float64)
    point = torch.randn(2, 5, 4, requires_grad=True)
    cluster = torch.randn(3, 2, 6, 4, requires_grad=True)
    weight = torch.randn(4, 3, requires_grad=True)
    reference = torch.tanh(point.unsqueeze(-2) + cluster.unsqueeze(-3)) @ weight
    assert torch.allclose(pairwise_tanh_linear(point, cluster, weight), reference)
    assert torch.autograd.gradcheck(pairwise_tanh_linear, (point, cluster, weight))


def test_pairwise_tanh_linear_accepts_per_particle_points():
    torch.set_default_dtype(torch.float64)
    point = torch.randn(3, 2, 5, 4, requires_grad=True)
    cluster = torch.randn(3, 2, 6, 4, requires_grad=True)
    weight = torch.randn(4, 1, requires_grad=True)
    assert torch.autograd.gradcheck(pairwise_tanh_linear, (point, cluster, weight))


def test_point_features_keep_the_point_axis():
    for kind, width in (("linear", 2), ("mlp", 8), ("lstm", 8)):
        out = PointFeatures(kind, 2, 8)(torch.randn(3, 7, 2))
        assert out.shape == (3, 7, width)
