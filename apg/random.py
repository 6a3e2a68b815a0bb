"""Counter-based uniform draws (Philox4x32-10) for the samplers' hot loops on CPU.

``torch.rand`` on CPU runs one Mersenne Twister serially, ~5 ns per number on this
machine's class of CPU; the rings' local kernel draws ~2 million uniforms per training
step. Philox (Salmon et al., SC 2011; the generator of cuRAND and of PyTorch's CUDA
backend) is a pure function of a key and a counter, so the compiled kernels draw inside
their own loops (``apg/kernels/philox.h``), in parallel, any number of rounds, and the
PyTorch twins below draw the very same numbers: tests compare the two paths value for
value.

Each call takes one fresh 64-bit key from torch's default generator (``new_key``), so
draws follow ``torch.manual_seed`` and do not depend on the number of threads. Block
``(key; element, draw)`` gives two uniforms on ``[0, 1)``: float32 keeps 24 bits of a word
each (torch.rand's grid), float64 53 bits of two words each.

``standard_gamma`` draws Gamma variates from the same blocks (Marsaglia and Tsang's method),
in place of ``torch._standard_gamma``, a serial loop on CPU. On other devices ``uniform`` is
``torch.rand`` and ``standard_gamma`` is ``torch._standard_gamma`` (the kernels are CPU code),
and so they are inside ``torch.compile`` (a key is a host integer: ``apg.host``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from apg.host import values_on_host
from apg.kernels import call
from apg.kernels.ops import KernelOp

_MASK = 0xFFFFFFFF
_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_KEY_BUMPS = (0x9E3779B9, 0xBB67AE85)


def new_key() -> int:
    """A 64-bit key (a signed int, as the kernels take it) from torch's default generator."""
    return int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64))


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """High and low words of ``a * m`` for words ``a`` (int64 holding uint32 values): the
    product needs 64 unsigned bits, so ``m`` is split into 16-bit halves to stay in int64."""
    p_lo, p_hi = a * (m & 0xFFFF), a * (m >> 16)  # each < 2^48
    mid = p_lo + ((p_hi & 0xFFFF) << 16)  # a * m = (p_hi >> 16) 2^32 + mid, mid < 2^49
    return (p_hi >> 16) + (mid >> 32), mid & _MASK


def philox4x32_10(counter: tuple[Tensor | int, ...], key: tuple[int, int]) -> tuple[Tensor, ...]:
    """The four output words of Philox4x32-10 for counters ``(c0, c1, c2, c3)`` (int64
    tensors or ints holding uint32 values, broadcast) under key ``(k0, k1)``."""
    x0, x1, x2, x3 = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mulhilo(x0, _MULTIPLIERS[0])
        hi1, lo1 = _mulhilo(x2, _MULTIPLIERS[1])
        x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
        k0, k1 = (k0 + _KEY_BUMPS[0]) & _MASK, (k1 + _KEY_BUMPS[1]) & _MASK
    return x0, x1, x2, x3


def uniform_pair(key: int, element: Tensor, draw: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The two uniforms of blocks ``(key; element, draw)`` for int64 ``element`` numbers,
    as ``philox_uniform2f`` / ``philox_uniform2d`` in ``apg/kernels/philox.h``."""
    words = philox4x32_10((element & _MASK, element >> 32, draw, 0), (key & _MASK, (key >> 32) & _MASK))
    if dtype == torch.float64:
        a, b, c, d = words
        return tuple(
            ((hi >> 5).double() * 67108864.0 + (lo >> 6).double()) * 2.0**-53 for hi, lo in ((a, b), (c, d))
        )  # type: ignore[return-value]
    return tuple((w >> 8).to(dtype) * 2.0**-24 for w in words[:2])  # type: ignore[return-value]


def uniform(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """Uniforms on ``[0, 1)`` shaped ``shape``: on CPU, element ``2 j + s`` is uniform ``s``
    of block ``(new_key(); j, 0)`` (the op ``apg::philox_uniform``)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type != "cpu" or dtype not in (torch.float32, torch.float64) or torch.compiler.is_compiling():
        return torch.rand(shape, dtype=dtype, device=device)
    return philox_uniform_op(new_key(), list(shape), dtype, device)


def _uniform_twin(key: int, shape: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    numel = math.prod(shape)
    pair = uniform_pair(key, torch.arange((numel + 1) // 2, device=device), 0, dtype)
    return torch.stack(pair, -1).flatten()[:numel].view(shape)


def _uniform_native(fn, key: int, shape: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    out = torch.empty(shape, dtype=dtype)
    call(fn, key, out, out.numel())
    return out


_EMPTY = {dtype: torch.empty(0, dtype=dtype) for dtype in (torch.float32, torch.float64)}

# Uniforms on [0, 1) shaped ``shape`` from the Philox blocks ``(key; j, 0)`` (a CPU kernel).
philox_uniform_op = KernelOp(
    "philox_uniform",
    _uniform_twin,
    kernel="philox_uniform",
    native=_uniform_native,
    checked=lambda key, shape, dtype, device: (_EMPTY.get(dtype, _EMPTY[torch.float32]),),
    fake=lambda key, shape, dtype, device: torch.empty(shape, dtype=dtype, device=device),
)


# apg/kernels/gamma.h: a shape that has not accepted after this many tries gets NaN
_GAMMA_TRIES = 64


def standard_gamma(alpha: Tensor) -> Tensor:
    """Draws from ``Gamma(alpha, 1)`` shaped like ``alpha``, one fresh key per call.

    On CPU, element ``e``'s try ``k`` of Marsaglia and Tsang's method takes the float64
    uniforms of blocks ``(key; e, 2k)`` and ``(key; e, 2k + 1)`` (``apg/kernels/gamma.h``
    spells the method out); the compiled pass and this twin compute in float64 and agree
    to rounding. A shape that is not positive and finite gives NaN.
    """
    if not values_on_host(alpha) or alpha.dtype not in (torch.float32, torch.float64):
        return torch._standard_gamma(alpha)
    return philox_standard_gamma_op(new_key(), alpha.detach())


def _gamma_native(fn, key: int, alpha: Tensor) -> Tensor:
    out = torch.empty_like(alpha, memory_format=torch.contiguous_format)
    call(fn, key, alpha, out, out.numel())
    return out


def _gamma_twin(key: int, alpha: Tensor) -> Tensor:
    a = alpha.detach().double().flatten()
    shape = torch.where(a < 1, a + 1, a)
    d = shape - 1 / 3
    c = torch.rsqrt(9 * torch.where(d > 0, d, 1.0))
    draw, u_boost = torch.full_like(a, math.nan), torch.zeros_like(a)
    valid = (a > 0) & (a < math.inf)
    pending = valid.nonzero().flatten()
    for k in range(_GAMMA_TRIES):
        if not len(pending):
            break
        u1, u2 = uniform_pair(key, pending, 2 * k, torch.float64)
        u3, u4 = uniform_pair(key, pending, 2 * k + 1, torch.float64)
        x = torch.sqrt(-2 * torch.log(1 - u1)) * torch.cos(2 * math.pi * u2)
        v = (1 + c[pending] * x) ** 3
        dk = d[pending]
        accept = (v > 0) & (torch.log(u3) < x * x / 2 + dk - dk * v + dk * torch.log(v.clamp_min(1e-300)))
        done = pending[accept]
        draw[done], u_boost[done] = (dk * v)[accept], u4[accept]
        pending = pending[~accept]
    boost = a < 1
    draw[boost] = draw[boost] * u_boost[boost] ** (1 / a[boost])
    return draw.to(alpha.dtype).view(alpha.shape)


# Draws from Gamma(alpha, 1) from the Philox blocks of ``key`` (see ``standard_gamma``), on CPU.
philox_standard_gamma_op = KernelOp(
    "philox_standard_gamma",
    _gamma_twin,
    kernel="philox_standard_gamma",
    native=_gamma_native,
    fake=lambda key, alpha: torch.empty_like(alpha, memory_format=torch.contiguous_format),
)
