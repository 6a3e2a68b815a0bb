"""The float32 pairwise kernel's exp-product tanh, tanh(a + b) = 1 - 2 / (1 + e^2a e^2b)
(``apg/kernels/tanh_layers.c``), against float64 torch: its accuracy over a wide grid, the
fallback to the rational tanh where a part is too large for the identity, and the three
gradients through both.

Error bound per tanh (u = 2^-24, half an ulp of 1): the two exps (libmvec, < 1 ulp, so 2u
relative each) move t by at most half the product's relative error (d tanh / d ln E <= 1/2),
2u; rounding 1 + E moves it by 2 r^2 (1 + E) u <= 2u (r = 1 / (1 + E)); the reciprocal
(rcp14 and a fused Newton step, ~u relative) by 2 r u <= 2u; the final 1 - 2r by u / 2.
So |t - tanh| <= 6.5u ~ 3.9e-7, which is also fast_tanhf's bound (the fallback).
"""

import pytest
import torch

from apg.kernels import native_library
from apg.nn import pairwise_tanh_linear

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler: no native kernels")

U = 2.0**-24
TANH_ERR = 4e-7  # per tanh, either path (see the module docstring)


def _grid_tanh(a: torch.Tensor, b: torch.Tensor, per_particle: bool = False) -> torch.Tensor:
    """tanh(a_n + b_l) for every pair through the kernel, as (len(b), len(a)): b as L rows
    of one cluster and H = O = 1, W = 1. ``per_particle`` passes P per particle (Lp = L),
    whose blocks serve one row each: the kernel then takes the rational tanh."""
    p = a.reshape(1, -1, 1).float()
    c = b.reshape(-1, 1, 1, 1).float()
    if per_particle:
        p = p.expand(b.numel(), 1, -1, 1).contiguous()
    return pairwise_tanh_linear(p, c, torch.ones(1, 1))[:, 0, :, 0, 0].double()


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.tanh(a.float().double().reshape(1, -1) + b.float().double().reshape(-1, 1))


def test_exp_product_tanh_is_accurate_over_a_wide_grid():
    # Both parts over the whole exp range (+-20, opposite signs included), and a fine grid
    # near 0, where 1 - 2r cancels.
    a = torch.cat([torch.linspace(-20, 20, 4001), torch.linspace(-0.01, 0.01, 201)])
    b = torch.cat([torch.linspace(-20, 20, 801), torch.tensor([-20.0, -19.99, 19.99, 20.0, 0.0])])
    reference = _reference(a, b)
    exp_path = _grid_tanh(a, b)
    tanh_path = _grid_tanh(a, b, per_particle=True)
    assert float((exp_path - reference).abs().max()) <= TANH_ERR
    assert float((tanh_path - reference).abs().max()) <= TANH_ERR
    # The two calls took different paths (else this test checked only one of them).
    assert not torch.equal(exp_path, tanh_path)


def test_parts_beyond_the_exp_range_fall_back_to_the_rational_tanh():
    # |part| > 20 would need clamping, and clamped parts give wrong sums (25 - 24 -> 0):
    # the kernel must take the rational tanh for that block of points / cluster row.
    a = torch.linspace(-3, 3, 150)
    a[70], a[71], a[72] = 25.0, -25.0, -24.5  # in the second block of 64 points
    b = torch.linspace(-3, 3, 12)
    b[0], b[1], b[2] = -24.0, 24.0, 25.0
    out, reference = _grid_tanh(a, b), _reference(a, b)
    assert float((out - reference).abs().max()) <= TANH_ERR
    assert abs(float(out[0, 70]) - 0.7615941559557649) <= TANH_ERR  # tanh(25 - 24)
    assert abs(float(out[2, 72]) - 0.46211715726000974) <= TANH_ERR  # tanh(-24.5 + 25)


@pytest.mark.parametrize("large", [False, True], ids=["exp", "fallback"])
def test_forward_and_gradients_match_float64(large):
    # The GMM's sizes; parts up to ~15 stay on the exp path; "fallback" puts a 25 in one
    # block of points (met by -24 in dataset 1's first cluster: tanh(1), where clamped
    # parts would give tanh(0)) and a -25 in one cluster row, so blocks and rows of both
    # paths mix.
    torch.manual_seed(1)
    L, B, N, I, H, O = 10, 2, 130, 3, 32, 2
    inputs = [4 * torch.randn(B, N, H, dtype=torch.float64), 4 * torch.randn(L, B, I, H, dtype=torch.float64)]
    inputs.append(torch.randn(H, O, dtype=torch.float64) / H**0.5)
    if large:
        inputs[0][1, 100, 5] = 25.0
        inputs[1][:, 1, 0, 5] = -24.0
        inputs[1][3, 0, 2, 7] = -25.0
    grad_out = torch.randn(L, B, N, I, O, dtype=torch.float64)
    results = []
    for dtype in (torch.float32, torch.float64):
        args = [t.to(dtype).double().to(dtype).requires_grad_() for t in inputs]
        out = pairwise_tanh_linear(*args)
        out.backward(grad_out.to(dtype))
        results.append([out.detach().double(), *(a.grad.double() for a in args)])
    (out, gp, gc, gw), (ref_out, ref_gp, ref_gc, ref_gw) = results
    # Bounds: each tanh within TANH_ERR (1 - t^2 within 2 TANH_ERR), plus float32 rounding
    # of the sums, relative to the sums of absolute terms (taking |t|, 1 - t^2 <= 1).
    w = inputs[2].float().double()
    g = grad_out.float().double()
    gw_abs = (g @ w.T).abs()  # (L, B, N, I, H): |sum_o g w|, the backward's per-pair term
    bound_out = (TANH_ERR + (H + 1) * U) * w.abs().sum(0)  # (O,)
    bound_gp = (2 * TANH_ERR + (L * I + O) * U) * gw_abs.sum((0, 3))
    bound_gc = (2 * TANH_ERR + (N + O) * U) * gw_abs.sum(2)
    bound_gw = (TANH_ERR + L * B * N * I * U) * g.abs().sum((0, 1, 2, 3))  # (O,)
    assert bool(((out - ref_out).abs() <= bound_out).all())
    assert bool(((gp - ref_gp).abs() <= bound_gp).all())
    assert bool(((gc - ref_gc).abs() <= bound_gc).all())
    assert bool(((gw - ref_gw).abs() <= bound_gw).all())
