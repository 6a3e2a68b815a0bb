"""The fused pairwise layer equals the plain autograd formula, values and gradients, on
both of its paths (the compiled CPU kernel and the PyTorch fallback)."""

import pytest
import torch

from apg import nn as apg_nn
from apg.kernels import pairwise_library
from apg.nn import PointFeatures, pairwise_tanh_linear


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    if request.param == "native":
        if pairwise_library() is None:
            pytest.skip("no C compiler: the native kernel cannot be built here")
    else:
        monkeypatch.setattr(apg_nn, "_native_pairwise", lambda *args: None)
    return request.param


def test_the_native_kernel_builds_on_this_machine():
    # CI machines have a C compiler; a silent fallback would hide a broken build.
    assert pairwise_library() is not None


def test_pairwise_tanh_linear_matches_the_plain_formula_and_its_gradients(path):
    torch.set_default_dtype(torch.float64)
    point = torch.randn(2, 5, 4, requires_grad=True)
    cluster = torch.randn(3, 2, 6, 4, requires_grad=True)
    weight = torch.randn(4, 3, requires_grad=True)
    reference = torch.tanh(point.unsqueeze(-2) + cluster.unsqueeze(-3)) @ weight
    assert torch.allclose(pairwise_tanh_linear(point, cluster, weight), reference)
    assert torch.autograd.gradcheck(pairwise_tanh_linear, (point, cluster, weight))


def test_pairwise_tanh_linear_accepts_per_particle_points(path):
    torch.set_default_dtype(torch.float64)
    point = torch.randn(3, 2, 5, 4, requires_grad=True)
    cluster = torch.randn(3, 2, 6, 4, requires_grad=True)
    weight = torch.randn(4, 1, requires_grad=True)
    assert torch.autograd.gradcheck(pairwise_tanh_linear, (point, cluster, weight))


def test_pairwise_tanh_linear_float32_agrees_with_float64(path):
    shapes = ((20, 60, 32), (10, 20, 3, 32), (32, 4))
    inputs = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
    grads = []
    for dtype in (torch.float32, torch.float64):
        args = [t.to(dtype).clone().requires_grad_() for t in inputs]
        out = pairwise_tanh_linear(*args)
        out.backward(torch.ones_like(out))
        grads.append([out.double(), *(a.grad.double() for a in args)])
    for low, high in zip(*grads, strict=True):
        assert torch.allclose(low, high, rtol=1e-4, atol=1e-3)


def test_point_features_keep_the_point_axis():
    for kind, width in (("linear", 2), ("mlp", 8), ("lstm", 8)):
        out = PointFeatures(kind, 2, 8)(torch.randn(3, 7, 2))
        assert out.shape == (3, 7, width)
