"""Bouncing MNIST's image operations against pixel references: placement (render, crop),
correlation, and the frame likelihood with its gradient."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from apg.tasks.bmnist import (
    BMNISTConfig,
    correlate,
    crop,
    frame_log_likelihood,
    pixel_offsets,
    render,
)

# --------------------------------------------------------------------------- references


def _bilinear_ref(img: np.ndarray, y: float, x: float) -> float:
    """Bilinear sample of ``img`` at continuous (row y, column x), zero outside."""
    h, w = img.shape
    y0, x0 = math.floor(y), math.floor(x)
    total = 0.0
    for yy, wy in ((y0, 1 - (y - y0)), (y0 + 1, y - y0)):
        for xx, wx in ((x0, 1 - (x - x0)), (x0 + 1, x - x0)):
            if 0 <= yy < h and 0 <= xx < w:
                total += wy * wx * img[yy, xx]
    return total


def _render_ref(digits: np.ndarray, offsets: np.ndarray, canvas: int) -> np.ndarray:
    """Pixel by pixel: canvas(i, j) = sum_d digit_d sampled at (i - oy_d, j - ox_d)."""
    out = np.zeros((canvas, canvas))
    for img, (ox, oy) in zip(digits, offsets, strict=True):
        for i in range(canvas):
            for j in range(canvas):
                out[i, j] += _bilinear_ref(img, i - oy, j - ox)
    return out


CASES = [  # (column, row) offsets of two 5x5 digits on a 13x13 canvas
    [(0.0, 0.0), (8.0, 8.0)],  # integer, touching the corners
    [(2.25, 3.5), (3.75, 2.125)],  # fractional, overlapping
    [(-2.6, 4.3), (10.4, -1.2)],  # partly off the canvas
    [(-9.0, 1.0), (20.5, 3.0)],  # entirely off the canvas
]


@pytest.mark.parametrize("offsets", CASES)
def test_render_matches_pixel_reference(f64, offsets):
    digits = torch.rand(2, 5, 5)
    off = torch.tensor(offsets)
    got = render(digits, off, canvas_size=13)
    want = _render_ref(digits.numpy(), off.numpy(), 13)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-12)


@pytest.mark.parametrize("offsets", CASES)
def test_crop_matches_pixel_reference(f64, offsets):
    frames = torch.rand(1, 1, 13, 13)
    off = torch.tensor(offsets)[None, None, None]  # (L=1, B=1, F=1, D=2, 2)
    got = crop(frames, off, digit_size=5)[0, 0, 0]
    for d, (ox, oy) in enumerate(offsets):
        want = [[_bilinear_ref(frames[0, 0].numpy(), oy + r, ox + c) for c in range(5)] for r in range(5)]
        np.testing.assert_allclose(got[d].numpy(), np.array(want), atol=1e-12)


def test_crop_is_adjoint_of_render(f64):
    """<render(d, o), f> = <d, crop(f, o)>: cropping is placement's transpose."""
    digit = torch.rand(1, 1, 1, 1, 6, 6)
    frame = torch.rand(1, 1, 17, 17)
    off = torch.tensor([3.3, 7.8]).reshape(1, 1, 1, 1, 2)
    lhs = (render(digit[0, 0], off[0, 0], 17) * frame[0]).sum()
    rhs = (digit * crop(frame, off, 6)).sum()
    assert torch.allclose(lhs, rhs)


def test_where_maps_to_canvas_box():
    off = pixel_offsets(torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]]))
    assert off.tolist() == [[0.0, 0.0], [68.0, 68.0], [34.0, 34.0]]


def test_correlate_matches_direct_sum(f64):
    frames = torch.rand(2, 9, 9)
    templates = torch.rand(3, 2, 2, 4, 4)  # (L, B, D, S, S)
    got = correlate(frames, templates)
    assert got.shape == (3, 2, 2, 6, 6)
    for l, b, d, sy, sx in [(0, 0, 0, 0, 0), (2, 1, 1, 5, 3), (1, 0, 1, 2, 4)]:
        want = (frames[b, sy : sy + 4, sx : sx + 4] * templates[l, b, d]).sum()
        assert torch.allclose(got[l, b, d, sy, sx], want)


def test_the_fft_correlation_equals_the_direct_sum_at_the_papers_sizes_in_float32():
    from apg.tasks.bmnist.likelihood import correlate_spectra

    frames = torch.rand(3, 96, 96)  # pixels in [0, 1], as the videos'
    templates = torch.rand(4, 3, 2, 28, 28)  # (L, B, D, S, S)
    want = correlate(frames, templates)  # the direct sum (a convolution)
    got = correlate_spectra(torch.fft.rfft2(frames)[:, None], templates)
    assert got.shape == want.shape == (4, 3, 2, 69, 69)
    # float32 rounding of sums of 784 products of size <= 1: both sides err by ~1e-5 of
    # the maps' scale (about 200); a wrapped (circular) read would be off by tens
    assert torch.allclose(got, want, rtol=0, atol=2e-5 * want.abs().max())


def test_the_device_path_correlates_every_particle_as_the_cpu_path_does_its_originals(f64):
    from apg.tasks.bmnist.likelihood import _correlate_all, _correlate_distinct, _first_copies

    frames = torch.rand(2, 9, 9)
    templates = torch.rand(4, 2, 3, 4, 4)  # (L, B, D, S, S)
    templates[2, 0] = templates[0, 0]  # a resampled copy: the CPU path computes it once
    z = templates.flatten(3)  # stands in for z_what: equal exactly where the templates are
    cpu_maps, cpu_rows = _correlate_distinct(frames, templates, _first_copies(z))
    all_maps, all_rows = _correlate_all(frames, templates)
    assert all_maps.shape[0] == 4 * 2 * 3 > cpu_maps.shape[0]
    assert torch.allclose(all_maps[all_rows], cpu_maps[cpu_rows])
    assert torch.allclose(all_maps[all_rows], correlate(frames, templates))


def test_frame_likelihood_equals_dense_bernoulli(f64):
    cfg = BMNISTConfig(canvas_size=20, digit_size=6, prob_eps=1e-3)
    L, B, Fr, D = 2, 3, 2, 3
    templates = (torch.rand(L, B, D, 6, 6) * 0.8).requires_grad_()
    where = torch.rand(L, B, Fr, D, 2) * 2.6 - 1.3  # some digits partly off the canvas
    where[0, 0, 0, 1] = where[0, 0, 0, 0] + 0.05  # heavy overlap
    x = torch.rand(B, Fr, 20, 20) * (torch.rand(B, Fr, 20, 20) < 0.3)
    got = frame_log_likelihood(x, templates, where, cfg)
    canvas = render(templates.unsqueeze(2), pixel_offsets(where, 20, 6), 20)
    p = canvas.clamp(cfg.prob_eps, 1 - cfg.prob_eps)
    want = (x * p.log() + (1 - x) * torch.log1p(-p)).sum((-3, -2, -1))
    assert got.shape == (L, B)
    assert torch.allclose(got, want, atol=1e-9)
    # the hand-written backward pass equals autograd through the dense formula
    weights = torch.rand(L, B)
    (g_got,) = torch.autograd.grad((weights * got).sum(), templates)
    (g_want,) = torch.autograd.grad((weights * want).sum(), templates)
    assert g_want.abs().sum() > 0
    assert torch.allclose(g_got, g_want, atol=1e-9)


def test_frame_likelihood_gradient_in_positions(f64):
    """Reparameterized methods (AVF) differentiate the likelihood in z_where too."""
    cfg = BMNISTConfig(canvas_size=20, digit_size=6, prob_eps=1e-3)
    L, B, Fr, D = 2, 2, 2, 3
    templates = torch.rand(L, B, D, 6, 6) * 0.8
    where = (torch.rand(L, B, Fr, D, 2) * 2.6 - 1.3).requires_grad_()
    where.data[0, 0, 0, 1] = where.data[0, 0, 0, 0] + 0.05
    x = torch.rand(B, Fr, 20, 20) * (torch.rand(B, Fr, 20, 20) < 0.3)
    got = frame_log_likelihood(x, templates, where, cfg)
    canvas = render(templates.unsqueeze(2), pixel_offsets(where, 20, 6), 20)
    p = canvas.clamp(cfg.prob_eps, 1 - cfg.prob_eps)
    want = (x * p.log() + (1 - x) * torch.log1p(-p)).sum((-3, -2, -1))
    weights = torch.rand(L, B)
    (g_got,) = torch.autograd.grad((weights * got).sum(), where)
    (g_want,) = torch.autograd.grad((weights * want).sum(), where)
    assert g_want.abs().sum() > 0
    assert torch.allclose(g_got, g_want, atol=1e-9)
