"""Philox4x32-10 uniforms (apg/random.py and apg/kernels/philox.h)."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

import apg.kernels
from apg.random import philox4x32_10, standard_gamma, uniform, uniform_pair

# Known-answer vectors of the generator's authors (Random123's kat_vectors, philox4x32 with
# 10 rounds): counter (4 words), key (2 words) -> output (4 words).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, expect", KAT)
def test_philox_matches_the_known_answers(counter, key, expect):
    assert tuple(int(w) for w in philox4x32_10(counter, key)) == expect
    lib = apg.kernels.native_library()
    if lib is not None:
        words = (ctypes.c_uint32 * 6)(*counter, *key)
        lib.philox_block(words)
        assert tuple(words[:4]) == expect


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_uniforms_equal_the_twins(dtype, monkeypatch):
    if apg.kernels.native_library() is None:
        pytest.skip("no C compiler")
    draws = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(apg.kernels, "native_library", lambda: None)
        torch.manual_seed(3)
        draws.append(uniform((7, 1001), dtype))  # an odd count: the last block's second is unused
    assert draws[0].dtype == dtype and torch.equal(draws[0], draws[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniforms_are_uniform_and_follow_the_torch_seed(dtype, kernel_path):
    torch.manual_seed(0)
    n = 200_000
    u = uniform((n,), dtype)
    assert u.dtype == dtype and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # Mean 1/2 and variance 1/12 within 4 standard errors; every tenth of [0, 1) holds its
    # share within 4 binomial SE; neighbours are uncorrelated (lag-1 and lag-2, i.e. within
    # and across Philox blocks) within 4 SE.
    x = u.double()
    assert abs(float(x.mean()) - 0.5) < 4 * math.sqrt(1 / 12 / n)
    assert abs(float(x.var()) - 1 / 12) < 4 * math.sqrt(1 / 180 / n)
    counts = torch.bincount((x * 10).long(), minlength=10).double()
    assert ((counts / n - 0.1).abs() < 4 * math.sqrt(0.09 / n)).all()
    for lag in (1, 2):
        corr = float(torch.corrcoef(torch.stack([x[:-lag], x[lag:]]))[0, 1])
        assert abs(corr) < 4 / math.sqrt(n)
    torch.manual_seed(0)
    assert torch.equal(uniform((n,), dtype), u)
    assert not torch.equal(uniform((n,), dtype), u)  # a fresh key per call


def test_float64_uniforms_have_53_bits():
    # Two words per double: the spacing of the grid is 2^-53, far below float32's 2^-24.
    u0, u1 = uniform_pair(12345, torch.arange(100_000), 0, torch.float64)
    frac = torch.cat([u0, u1]) * 2.0**24
    assert float((frac - frac.floor()).max()) > 0.5  # bits beyond the 24th are used
    assert bool(((torch.cat([u0, u1]) * 2.0**53) % 1 == 0).all())  # and none beyond the 53rd


# shapes below 1 (the boosted draw), at 1, and large; then invalid ones, which give NaN
_SHAPES = [0.05, 0.3, 0.9, 1.0, 2.5, 7.0, 40.0, 300.0]
_INVALID = [0.0, -1.0, math.nan, math.inf]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_gamma_draws_equal_the_twins(dtype, monkeypatch):
    if apg.kernels.native_library() is None:
        pytest.skip("no C compiler")
    alpha = torch.tensor(_SHAPES + _INVALID, dtype=dtype).repeat(300).view(60, -1)[:, 1:]  # not contiguous
    draws = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(apg.kernels, "native_library", lambda: None)
        torch.manual_seed(3)
        draws.append(standard_gamma(alpha))
    native, twin = draws
    assert native.dtype == dtype and native.shape == alpha.shape
    invalid = ~((alpha > 0) & (alpha < math.inf))
    assert torch.equal(native.isnan(), invalid) and torch.equal(twin.isnan(), invalid)
    # both compute in float64: equal up to the rounding of their log, cos and pow
    rtol = 1e-12 if dtype == torch.float64 else 1e-6
    assert torch.allclose(native[~invalid], twin[~invalid], rtol=rtol, atol=0)


@pytest.mark.parametrize("alpha", _SHAPES)
def test_gamma_draws_follow_the_gamma_distribution(alpha, kernel_path):
    torch.manual_seed(0)
    n = 20_000
    x = standard_gamma(torch.full((n,), alpha, dtype=torch.float64))
    assert bool((x >= 0).all())
    # Kolmogorov-Smirnov against the regularized incomplete gamma function: under the null,
    # P(sqrt(n) D > 2.23) ~ 2 exp(-2 * 2.23^2) = 1e-4.
    cdf = torch.special.gammainc(torch.tensor(alpha, dtype=torch.float64), x.sort().values)
    grid = torch.arange(n + 1, dtype=torch.float64) / n
    distance = torch.maximum((grid[1:] - cdf).abs(), (cdf - grid[:-1]).abs()).max()
    assert float(distance) * math.sqrt(n) < 2.23
    # mean alpha within 4 standard errors (variance alpha)
    assert abs(float(x.mean()) - alpha) < 4 * math.sqrt(alpha / n)
    torch.manual_seed(0)
    assert torch.equal(standard_gamma(torch.full((n,), alpha, dtype=torch.float64)), x)
