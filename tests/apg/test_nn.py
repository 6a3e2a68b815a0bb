"""The fused tanh layers equal the plain autograd formulas, values and gradients, on both
of their paths (the compiled CPU kernels and the PyTorch fallback)."""

import pytest
import torch

from apg.kernels import native_library
from apg.nn import PointFeatures, pairwise_tanh_linear, scaled_pairwise_tanh_linear, tanh_mlp


def test_the_native_kernel_builds_on_this_machine():
    # CI machines have a C compiler; a silent fallback would hide a broken build.
    assert native_library() is not None


def test_pairwise_tanh_linear_matches_the_plain_formula_and_its_gradients(kernel_path):
    torch.set_default_dtype(torch.float64)
    point = torch.randn(2, 5, 4, requires_grad=True)
    cluster = torch.randn(3, 2, 6, 4, requires_grad=True)
    weight = torch.randn(4, 3, requires_grad=True)
    reference = torch.tanh(point.unsqueeze(-2) + cluster.unsqueeze(-3)) @ weight
    assert torch.allclose(pairwise_tanh_linear(point, cluster, weight), reference)
    assert torch.autograd.gradcheck(pairwise_tanh_linear, (point, cluster, weight))


def test_pairwise_tanh_linear_accepts_per_particle_points(kernel_path):
    torch.set_default_dtype(torch.float64)
    point = torch.randn(3, 2, 5, 4, requires_grad=True)
    cluster = torch.randn(3, 2, 6, 4, requires_grad=True)
    weight = torch.randn(4, 1, requires_grad=True)
    assert torch.autograd.gradcheck(pairwise_tanh_linear, (point, cluster, weight))


def test_pairwise_tanh_linear_float32_agrees_with_float64(kernel_path):
    shapes = ((20, 60, 32), (10, 20, 3, 32), (32, 4))
    inputs = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
    grads = []
    for dtype in (torch.float32, torch.float64):
        args = [t.to(dtype).clone().requires_grad_() for t in inputs]
        out = pairwise_tanh_linear(*args)
        out.backward(torch.ones_like(out))
        grads.append([out.detach().double(), *(a.grad.double() for a in args)])
    # float32 sums of ~10^5 terms: compare against each tensor's own scale.
    for low, high in zip(*grads, strict=True):
        assert float((low - high).abs().max()) < 1e-4 * float(high.abs().max())


@pytest.mark.parametrize("num_points", [5, 64, 70])
def test_scaled_pairwise_tanh_linear_matches_the_plain_formula_and_its_gradients(kernel_path, num_points):
    # Blocks of 64 points: a partial one, a full one, and one of each.
    torch.set_default_dtype(torch.float64)
    x = torch.randn(2, num_points, 2)
    scale = torch.randn(3, 2, 4, 2, 5, requires_grad=True)
    cluster = torch.randn(3, 2, 4, 5, requires_grad=True)
    weight = torch.randn(5, requires_grad=True)
    reference = torch.tanh(torch.einsum("bnd,lbidh->lbnih", x, scale) + cluster.unsqueeze(-3)) @ weight
    out = scaled_pairwise_tanh_linear(x, scale, cluster, weight)
    assert out.shape == (3, 2, num_points, 4) and torch.allclose(out, reference)
    assert torch.autograd.gradcheck(
        lambda *a: scaled_pairwise_tanh_linear(x, *a).transpose(-1, -2), (scale, cluster, weight)
    )


def test_scaled_pairwise_broadcasts_like_its_formula(kernel_path):
    # Sizes that only broadcast (one particle's scale for three particles' rows, one dataset's
    # points for four datasets) are the formula's, never read past an input's end.
    torch.set_default_dtype(torch.float64)
    cases = [
        (torch.randn(4, 10, 2), torch.randn(1, 4, 3, 2, 5), torch.randn(3, 4, 3, 5)),
        (torch.randn(1, 10, 2), torch.randn(3, 4, 3, 2, 5), torch.randn(3, 4, 3, 5)),
    ]
    weight = torch.randn(5)
    for x, scale, cluster in cases:
        want = torch.tanh(torch.einsum("...nd,...idh->...nih", x, scale) + cluster.unsqueeze(-3)) @ weight
        got = scaled_pairwise_tanh_linear(x, scale, cluster, weight)
        assert got.shape == want.shape == (3, 4, 10, 3) and torch.allclose(got, want)


def test_scaled_pairwise_float32_agrees_with_float64(kernel_path):
    shapes = ((10, 20, 3, 2, 32), (10, 20, 3, 32), (32,))
    x = torch.randn(20, 60, 2, dtype=torch.float64)
    inputs = [torch.randn(shape, dtype=torch.float64) / 2 for shape in shapes]
    grads = []
    for dtype in (torch.float32, torch.float64):
        args = [t.to(dtype).clone().requires_grad_() for t in inputs]
        out = scaled_pairwise_tanh_linear(x.to(dtype), *args)
        out.backward(torch.ones_like(out))
        grads.append([out.detach().double(), *(a.grad.double() for a in args)])
    for low, high in zip(*grads, strict=True):
        assert float((low - high).abs().max()) < 1e-4 * float(high.abs().max())


def test_fused_layers_take_non_contiguous_gradients(kernel_path):
    # A transposed consumer (a short-axis softmax, say) hands backward a strided gradient;
    # the native path must copy it and keep the copy alive through the C call.
    torch.set_default_dtype(torch.float64)
    point = torch.randn(2, 5, 4, requires_grad=True)
    cluster = torch.randn(3, 2, 6, 4, requires_grad=True)
    weight = torch.randn(4, 2, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: pairwise_tanh_linear(*a).transpose(-2, -3), (point, cluster, weight)
    )
    u = torch.randn(3, 5, 2, requires_grad=True)
    w1, b1, w2, b2 = (torch.randn(shape, requires_grad=True) for shape in ((7, 2), (7,), (4, 7), (4,)))
    assert torch.autograd.gradcheck(lambda *a: tanh_mlp(*a).transpose(0, 1), (u, w1, b1, w2, b2))


def test_fused_layers_split_work_across_threads(kernel_path):
    # Large enough for one chunk per thread on both kernels (pointwise chunks >= 4096 rows).
    torch.set_default_dtype(torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cases = [
            (
                pairwise_tanh_linear,
                [(20, 60, 8), (10, 20, 3, 8), (8, 2)],
                lambda p, c, w: torch.tanh(p.unsqueeze(-2) + c.unsqueeze(-3)) @ w,
            ),
            (
                pairwise_tanh_linear,
                [(10, 20, 60, 8), (10, 20, 3, 8), (8, 2)],
                lambda p, c, w: torch.tanh(p.unsqueeze(-2) + c.unsqueeze(-3)) @ w,
            ),
            (
                tanh_mlp,
                [(3, 4000, 2), (8, 2), (8,), (3, 8), (3,)],
                lambda u, w1, b1, w2, b2: torch.tanh(u @ w1.T + b1) @ w2.T + b2,
            ),
            (
                lambda u, *w: tanh_mlp(u, *w, angles=True),
                [(3, 4000), (8, 2), (8,), (3, 8), (3,)],
                lambda u, w1, b1, w2, b2: torch.tanh(_angles(u) @ w1.T + b1) @ w2.T + b2,
            ),
        ]
        for fused, shapes, plain in cases:
            inputs = [torch.randn(shape, requires_grad=True) for shape in shapes]
            out = fused(*inputs)
            weights = torch.randn_like(out)
            grads = torch.autograd.grad((out * weights).sum(), inputs)
            expect = plain(*inputs)
            expect_grads = torch.autograd.grad((expect * weights).sum(), inputs)
            assert torch.allclose(out, expect)
            for got, want in zip(grads, expect_grads, strict=True):
                assert torch.allclose(got, want)
    finally:
        torch.set_num_threads(threads)


def _angles(u):
    return torch.stack([torch.cos(u), torch.sin(u)], -1)


def test_tanh_mlp_matches_the_plain_formula_and_its_gradients(kernel_path):
    torch.set_default_dtype(torch.float64)
    u = torch.randn(3, 4, 5, 2, requires_grad=True)
    w1, b1, w2, b2 = (torch.randn(shape, requires_grad=True) for shape in ((7, 2), (7,), (3, 7), (3,)))
    reference = torch.tanh(u @ w1.T + b1) @ w2.T + b2
    out = tanh_mlp(u, w1, b1, w2, b2)
    assert out.shape == (3, 4, 5, 3)
    assert torch.allclose(out, reference)
    assert torch.autograd.gradcheck(tanh_mlp, (u, w1, b1, w2, b2))
    # Of angles: the features (cos, sin) are formed inside, and the angle's gradient too.
    alpha = 7.0 * torch.rand(3, 4, 70) - 0.5  # 70 rows per (3, 4): blocks of 64 and a remainder
    alpha.requires_grad_()
    out = tanh_mlp(alpha, w1, b1, w2, b2, angles=True)
    assert out.shape == (3, 4, 70, 3)
    assert torch.allclose(out, torch.tanh(_angles(alpha) @ w1.T + b1) @ w2.T + b2)
    assert torch.autograd.gradcheck(lambda *a: tanh_mlp(*a, angles=True), (alpha[:, :, :5], w1, b1, w2, b2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tanh_mlp_weight_gradients_with_inputs_that_take_none(kernel_path, dtype):
    # The rings' networks read sampled angles: no input gradient is computed, and blocks of
    # rows whose output gradient is all zero (flushed particles) are skipped.
    torch.manual_seed(0)
    u = torch.randn(300, 2, dtype=dtype)
    shapes = ((32, 2), (32,), (4, 32), (4,))
    w1, b1, w2, b2 = (torch.randn(shape, dtype=dtype, requires_grad=True) for shape in shapes)
    g = torch.randn(300, 4, dtype=dtype)
    g[64:192] = 0.0  # two whole blocks of 64 rows, and part of a third
    g[250:] = 0.0
    got = torch.autograd.grad((tanh_mlp(u, w1, b1, w2, b2) * g).sum(), (w1, b1, w2, b2))
    want = torch.autograd.grad(((torch.tanh(u @ w1.T + b1) @ w2.T + b2) * g).sum(), (w1, b1, w2, b2))
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=tol, atol=tol * float(b.abs().max()))


def test_point_features_keep_the_point_axis():
    for kind, width in (("linear", 2), ("mlp", 8), ("lstm", 8)):
        out = PointFeatures(kind, 2, 8)(torch.randn(3, 7, 2))
        assert out.shape == (3, 7, width)


def test_tanh_mlp_of_angles_needs_two_input_columns():
    with pytest.raises(ValueError, match="2 columns"):
        tanh_mlp(
            torch.rand(5), torch.randn(4, 3), torch.randn(4), torch.randn(2, 4), torch.randn(2), angles=True
        )
