"""Placing digits on the canvas and the frames' likelihood, evaluated on the digits'
patches only (see ``apg.tasks.bmnist.model``); the correlations the proposals read.

Legend: L particles, B videos, T frames, F a subset (chunk) of frames, D digits,
H canvas side (96), S digit side (28), P = (S + 1)^2 patch pixels, Z = 10 (z_what dim).
Latents: ``z_what (L, B, D, Z)``, ``z_where_t (L, B, D, 2)`` for t = 1..T.
Data ``x``: ``(B, T, H, H)`` in [0, 1].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from apg.host import values_on_host
from apg.tasks.bmnist.config import CANVAS, DIGIT, BMNISTConfig


def pixel_offsets(where: Tensor, canvas_size: int = CANVAS, digit_size: int = DIGIT) -> Tensor:
    """Continuous top-left offsets in pixels, ``(..., 2)`` (column, row), of digits at ``where``."""
    return (where + 1.0) * (0.5 * (canvas_size - digit_size))


def _patch_indices(offset: Tensor, canvas_size: int, patch_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Flat canvas indices of a ``patch_size``-square patch whose top-left pixel is
    ``floor(offset)``; pixels off the canvas point at the dump slot ``canvas_size**2``.

    Returns ``index (..., patch_size**2)`` long, ``valid`` (same shape, bool) and the
    fractional part ``frac (..., 2)`` of the offset (differentiable).
    """
    base = torch.floor(offset.detach())
    frac = offset - base
    base = base.long()
    ar = torch.arange(patch_size, device=offset.device)
    cols = base[..., 0, None] + ar  # (..., p)
    rows = base[..., 1, None] + ar
    ok_c = (cols >= 0) & (cols < canvas_size)
    ok_r = (rows >= 0) & (rows < canvas_size)
    valid = (ok_r[..., :, None] & ok_c[..., None, :]).flatten(-2)
    index = (rows[..., :, None] * canvas_size + cols[..., None, :]).flatten(-2)
    index = torch.where(valid, index, torch.full_like(index, canvas_size * canvas_size))
    return index, valid, frac


def blend(images: Tensor, frac: Tensor) -> Tensor:
    """Bilinear sub-pixel shift: ``(..., S, S)`` images moved by ``frac (..., 2)`` in [0, 1)
    become ``(..., S + 1, S + 1)`` patches (zero outside the image)."""
    fx = frac[..., 0, None, None]
    fy = frac[..., 1, None, None]
    rows = (1.0 - fy) * F.pad(images, (0, 0, 0, 1)) + fy * F.pad(images, (0, 0, 1, 0))
    return (1.0 - fx) * F.pad(rows, (0, 1, 0, 0)) + fx * F.pad(rows, (1, 0, 0, 0))


def place(images: Tensor, offset: Tensor, canvas_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Blended patches and where they go: ``(index, valid, patch)``, each ``(..., P)``.

    ``images (..., S, S)`` broadcast against ``offset (..., 2)`` (pixels, column/row).
    """
    size = images.shape[-1] + 1
    index, valid, frac = _patch_indices(offset, canvas_size, size)
    patch = blend(images, frac).flatten(-2)
    shape = torch.broadcast_shapes(patch.shape, index.shape)
    return index.expand(shape), valid.expand(shape), patch.expand(shape)


def render(images: Tensor, offset: Tensor, canvas_size: int = CANVAS) -> Tensor:
    """Sum of ``images (..., D, S, S)`` placed at pixel offsets ``(..., D, 2)``:
    ``(..., H, H)``, unclamped. Cost O(D S^2) per canvas plus clearing it."""
    index, _, patch = place(images, offset, canvas_size)
    lead = index.shape[:-2]
    n = canvas_size * canvas_size
    flat_index = index.reshape(-1, index.shape[-2] * index.shape[-1])
    canvas = patch.new_zeros(flat_index.shape[0], n + 1).scatter_add(
        1, flat_index, patch.reshape(flat_index.shape)
    )
    return canvas[:, :n].reshape(*lead, canvas_size, canvas_size)


def crop(frames: Tensor, offset: Tensor, digit_size: int = DIGIT) -> Tensor:
    """Bilinear ``S x S`` windows of ``frames (B, F, H, H)`` at pixel offsets
    ``(L, B, F, D, 2)``: ``(L, B, F, D, S, S)`` (zero off the canvas). The adjoint of
    ``render``'s placement: one gather of 29 x 29 pixels per digit, no sampling grid."""
    canvas_size = frames.shape[-1]
    index, _, frac = _patch_indices(offset, canvas_size, digit_size + 1)
    num_particles, batch, frames_n, digits = index.shape[:4]
    flat = F.pad(frames.flatten(-2), (0, 1))  # (B, F, H*H + 1), last slot is the zero dump
    flat = flat.unsqueeze(0).expand(num_particles, *flat.shape)
    window = flat.gather(-1, index.reshape(num_particles, batch, frames_n, -1))
    window = window.reshape(num_particles, batch, frames_n, digits, digit_size + 1, digit_size + 1)
    fx = frac[..., 0, None, None]
    fy = frac[..., 1, None, None]
    rows = (1.0 - fy) * window[..., :-1, :] + fy * window[..., 1:, :]
    return (1.0 - fx) * rows[..., :-1] + fx * rows[..., 1:]


def correlate(frames: Tensor, templates: Tensor) -> Tensor:
    """Cross-correlation of each video's frame with its own templates.

    ``frames (B, H, H)``, ``templates (L, B, D, S, S)`` -> ``(L, B, D, H-S+1, H-S+1)``:
    one dense convolution per video against all L x D templates (Appendix E's conv
    layer), the direct sum; the samplers' CPU path computes the same maps by
    ``correlate_spectra``, and the tests hold the two together.
    """
    num_particles, batch, digits, size = templates.shape[:4]
    out = [
        F.conv2d(frames[b][None, None], templates[:, b].reshape(num_particles * digits, 1, size, size))
        for b in range(batch)
    ]
    side = out[0].shape[-1]
    return torch.stack([o.reshape(num_particles, digits, side, side) for o in out], 1)


def correlate_spectra(spectra: Tensor, templates: Tensor) -> Tensor:
    """Valid cross-correlations ``(..., H-S+1, H-S+1)`` of frames given by their spectra
    ``spectra = torch.fft.rfft2(frames)`` (``(..., H, H // 2 + 1)``) with ``templates
    (..., S, S)``, leading dimensions broadcast: the same maps as ``correlate``.

    The circular correlation of size H equals the valid one exactly where it is read: an
    output pixel o <= H - S reads frame pixels o + q <= H - 1, so none wraps. Why not the
    convolution: oneDNN runs a 28 x 28 kernel with one input channel and few output
    channels far below peak. One thread of a 2.45 GHz AVX2 CPU, a 96 x 96 frame: against
    4 templates 2.35 ms by ``F.conv2d`` (12.5 GFLOP/s), 25 frames against one template
    55.6 ms (3.4 GFLOP/s); the FFT took 0.9 and 4.1 ms (docs/benchmarks.md has the
    training step). On a device the convolutions stay (``_correlate_all``), unmeasured
    against this.
    """
    canvas = spectra.shape[-2]
    side = canvas - templates.shape[-1] + 1
    kernel = torch.fft.rfft2(templates, s=(canvas, canvas)).conj()
    return torch.fft.irfft2(spectra * kernel, s=(canvas, canvas))[..., :side, :side]


def cross_correlations(templates: Tensor) -> Tensor:
    """``A[..., e, d, k] = sum_q T_e(q + k) T_d(q)`` for ``k`` in ``[-(S-1), S-1]^2`` (stored
    at ``k + S - 1``) and ``e < d`` (zero elsewhere): ``(..., D, D, 2S-1, 2S-1)`` from
    ``templates (..., D, S, S)``.

    Digit e placed at pixel offset p adds ``A[e, d](o - p)`` to the correlation of a frame
    with template d at offset o, exactly (placement is bilinear, hence linear), so
    ``render(A[e, d], p - (S - 1))`` is what digit e contributes to digit d's map.
    """
    *lead, digits, size, _ = templates.shape
    out = templates.new_zeros(*lead, digits, digits, 2 * size - 1, 2 * size - 1)
    pairs = [(e, d) for d in range(digits) for e in range(d)]
    if not pairs:
        return out
    first = torch.tensor([e for e, _ in pairs], device=templates.device)
    second = torch.tensor([d for _, d in pairs], device=templates.device)
    flat = templates.reshape(-1, digits, size, size)
    channels = flat.shape[0] * len(pairs)
    padded = F.pad(flat[:, first], (size - 1,) * 4).reshape(1, channels, 3 * size - 2, 3 * size - 2)
    weight = flat[:, second].reshape(channels, 1, size, size)
    maps = F.conv2d(padded, weight, groups=channels)  # depthwise: one pair per channel
    out.view(-1, digits, digits, 2 * size - 1, 2 * size - 1)[:, first, second] = maps.view(
        -1, len(pairs), 2 * size - 1, 2 * size - 1
    )
    return out


def _first_copies(z: Tensor) -> Tensor:
    """``(L, B)`` index of the first particle of each video equal (exactly, all of its
    values) to each particle of ``z (L, B, ...)``: ``first[l, b] == l`` for distinct ones."""
    same = (z.unsqueeze(1) == z.unsqueeze(0)).flatten(3).all(-1)  # (L, L', B)
    return same.to(torch.uint8).argmax(1)


def _distinct_particles(values: list[Tensor]) -> tuple[Tensor, Tensor] | None:
    """Where some video's particles are exact copies of each other (in all of ``values``,
    each ``(L, B, ...)``): ``compact (L', B)``, for each video its distinct particles
    first (in order) then copies, ``L'`` the largest number of distinct particles of a
    video, and ``position (L, B)``: particle l of video b is ``compact[position[l, b], b]``'s
    copy. ``None`` when no video has copies, and on a device (``apg.host``: the count of
    distinct particles would be a host read)."""
    if not values_on_host(values[0]):
        return None
    num_particles = values[0].shape[0]
    flat = torch.cat([v.flatten(2) for v in values], -1)  # (L, B, V)
    first = _first_copies(flat)
    ar = torch.arange(num_particles, device=first.device)[:, None]
    distinct = first == ar
    size = int(distinct.sum(0).max())
    if size == num_particles:
        return None
    order = torch.where(distinct, ar, ar + num_particles).argsort(0)  # distinct first, in order
    rank = distinct.long().cumsum(0) - 1
    return order[:size], rank.gather(0, first)


def _correlate_distinct(frames: Tensor, templates: Tensor, first: Tensor) -> tuple[Tensor, Tensor]:
    """``correlate`` for the distinct particles only.

    ``frames (B, H, H)``, ``templates (L, B, D, S, S)``, ``first (L, B)`` from
    ``_first_copies``. Returns the maps of the distinct particles, video by video,
    ``(N, H-S+1, H-S+1)`` with ``N = D x (number of distinct particles)``, and
    ``rows (L, B, D)``: the map of digit d of particle l in video b is ``corr[rows[l, b, d]]``.
    """
    num_particles, batch, digits = templates.shape[:3]
    distinct = first == torch.arange(num_particles, device=first.device)[:, None]  # (L, B)
    counts = distinct.sum(0)  # (B,)
    # the distinct particles video by video, in order: rows of the (B, L) boolean mask
    keep = distinct.t()
    video = torch.arange(batch, device=first.device)[:, None].expand(batch, num_particles)[keep]
    own = templates.transpose(0, 1)[keep]  # (n, D, S, S)
    maps = correlate_spectra(torch.fft.rfft2(frames)[video, None], own)  # (n, D, side, side)
    # row of particle l's first digit: the video's start + the rank of its original
    rank = distinct.long().cumsum(0) - 1  # (L, B): rank among the video's distinct particles
    start = counts.cumsum(0) - counts  # (B,)
    first_row = (start + rank.gather(0, first)) * digits  # (L, B)
    rows = first_row[..., None] + torch.arange(digits, device=first.device)
    return maps.flatten(0, 1), rows


def _correlate_all(frames: Tensor, templates: Tensor) -> tuple[Tensor, Tensor]:
    """``_correlate_distinct``'s maps and rows for every particle, copies included:
    one grouped convolution, video b's frame against its ``L x D`` templates."""
    num_particles, batch, digits, size = templates.shape[:4]
    weight = templates.transpose(0, 1).reshape(batch * num_particles * digits, 1, size, size)
    corr = F.conv2d(frames[None], weight, groups=batch)[0]  # (B L D, H-S+1, H-S+1)
    ar = torch.arange
    rows = (ar(batch, device=frames.device) * num_particles)[None, :, None] + ar(
        num_particles, device=frames.device
    )[:, None, None]
    return corr, rows * digits + ar(digits, device=frames.device)


def frame_log_likelihood(x: Tensor, templates: Tensor, where: Tensor, cfg: BMNISTConfig) -> Tensor:
    """``sum_{t in chunk} log p(x_t | z_what, z_where_t)`` for a chunk of frames, ``(L, B)``.

    ``x (B, F, H, H)``, ``templates (L, B, D, S, S)`` (or broadcastable to it),
    ``where (L, B, F, D, 2)``. With ``p = clamp(canvas, eps, 1 - eps)`` and
    ``f(p) = x log p + (1 - x) log(1 - p)``, every pixel no digit touches has ``p = eps``;
    so the sum over the frame is the data constant ``sum f(eps)`` plus ``f(p) - f(eps)``
    over the union of the digits' patches, where a pixel covered by m patches is counted
    m times with weight 1/m. This costs O(D S^2) per frame and particle instead of
    O(H^2), forward and backward. Differentiable in ``templates`` and ``where``.
    """
    num_particles, batch, frames_n, digits = where.shape[:4]
    size = templates.shape[-1]
    templates = templates.expand(num_particles, batch, digits, size, size)
    offset = pixel_offsets(where, cfg.canvas_size, cfg.digit_size)
    local = _PatchLikelihood.apply(templates, offset, x, cfg.prob_eps)
    log_eps, log1m_eps = math.log(cfg.prob_eps), math.log1p(-cfg.prob_eps)
    # sum over the chunk's pixels of f(eps) = x log eps + (1 - x) log(1 - eps)
    background = log1m_eps * x[0].numel() + (log_eps - log1m_eps) * x.flatten(1).sum(-1)  # (B,)
    return local + background


class _PatchLikelihood(torch.autograd.Function):
    """``sum over the union of the patches of f(p) - f(eps)``, ``(L, B)`` (see
    ``frame_log_likelihood``), with its gradients computed eagerly, frame by frame.

    ``templates (L, B, D, S, S)``, ``offset (L, B, F, D, 2)`` continuous pixel offsets,
    ``x (B, F, H, H)``. Each digit's ``(S + 1)^2`` bilinear patch is scattered into a flat
    ``(H + 1) x (H + 1)`` canvas per frame and particle, whose last row and column collect
    the off-canvas pixels and hold ``-inf``, and ``p`` is read back at the patch pixels.
    Off the canvas ``p = -inf`` clamps to ``eps``, so ``f(p) - f(eps) = 0`` there and no
    validity mask is needed. As ``p`` at a pixel is the sum of the patches covering it,
    ``d log p(x) / d patch = f'(p) = (x - p) / (p (1 - p))`` there (0 where the clamp is
    active, off the canvas included); the adjoint of the bilinear blend carries it to the
    templates (summed over frames) and to the offsets' fractional parts. Only those
    gradients, ``(L, B, D, S, S)`` and ``(L, B, F, D, 2)``, are kept for the backward
    pass: autograd would keep the canvas, the int64 indices and several patch-sized
    intermediates of every block's likelihood until the theta loss (which spans all K
    sweeps) is differentiated. Frames are processed one at a time so that the working
    set (a few MB) stays in cache.
    """

    @staticmethod
    def forward(ctx, templates: Tensor, offset: Tensor, x: Tensor, eps: float) -> Tensor:
        need_t, need_o = ctx.needs_input_grad[:2]
        out = templates.new_zeros(offset.shape[:2])
        d_templates = torch.zeros_like(templates) if need_t else None
        d_offset = torch.zeros_like(offset) if need_o else None
        padded = F.pad(x, (0, 1, 0, 1)).flatten(-2)  # (B, F, (H + 1)^2), zero off the canvas
        for f in range(offset.shape[2]):
            value, dt, do = _patch_likelihood_frame(
                templates, offset[:, :, f], padded[:, f], x.shape[-1], eps, need_t, need_o
            )
            # Not `out += value`: torch.compile (torch 2.11) gives a Function whose output is
            # written in place zero gradients, silently (the sum's order is the same).
            out = out + value
            if need_t:
                assert d_templates is not None and dt is not None  # both made when need_t
                d_templates += dt
            if need_o:
                assert d_offset is not None and do is not None  # both made when need_o
                d_offset[:, :, f] = do
        ctx.save_for_backward(d_templates, d_offset)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        saved_t, saved_o = ctx.saved_tensors
        g_t = g_o = None
        if saved_t is not None:
            g_t = saved_t * grad[:, :, None, None, None]
        if saved_o is not None:
            g_o = saved_o * grad[:, :, None, None, None]
        return g_t, g_o, None, None


def _patch_likelihood_frame(
    t: Tensor,
    offset: Tensor,
    flat_x: Tensor,
    canvas_size: int,
    eps: float,
    need_t: bool,
    need_o: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One frame of ``_PatchLikelihood``: the frame's term ``(L, B)`` and
    its gradients with respect to ``t (L, B, D, S, S)`` and ``offset (L, B, D, 2)``.
    ``flat_x (B, (H + 1)^2)`` is the frame padded with a zero row and column."""
    num_particles, batch, digits, size = t.shape[:4]
    side = size + 1
    wide = canvas_size + 1
    base = torch.floor(offset)
    frac = offset - base
    base = base.long()
    fx, fy = frac[..., 0, None, None], frac[..., 1, None, None]  # (L, B, D, 1, 1)
    # bilinear blend, rows then columns: patch (L, B, D, S + 1, S + 1)
    if torch.compiler.is_compiling():  # the same sums padded: no out= into strided views there
        rows = F.pad(t * (1.0 - fy), (0, 0, 0, 1)) + F.pad(t * fy, (0, 0, 1, 0))
        patch = F.pad(rows * (1.0 - fx), (0, 1)) + F.pad(rows * fx, (1, 0))
    else:  # in place, without the padded copies
        rows = t.new_empty(num_particles, batch, digits, side, size)
        torch.mul(t, 1.0 - fy, out=rows[..., :size, :])
        rows[..., size, :] = 0.0
        rows[..., 1:, :].addcmul_(t, fy)
        patch = t.new_empty(num_particles, batch, digits, side, side)
        torch.mul(rows, 1.0 - fx, out=patch[..., :size])
        patch[..., size] = 0.0
        patch[..., 1:].addcmul_(rows, fx)
    # flat canvas indices, separable: row part + column part; off-canvas -> row/column H
    ar = torch.arange(side, device=t.device)
    cols = base[..., 0, None] + ar  # (L, B, D, S + 1)
    rws = base[..., 1, None] + ar
    cols = torch.where((cols >= 0) & (cols < canvas_size), cols, canvas_size)
    rws = torch.where((rws >= 0) & (rws < canvas_size), rws, canvas_size) * wide
    canvases = num_particles * batch
    index = (rws[..., :, None] + cols[..., None, :]).view(canvases, -1)
    xv = (
        flat_x.expand(num_particles, -1, -1).gather(2, index.view(num_particles, batch, -1)).view(patch.shape)
    )
    canvas = patch.new_zeros(canvases, wide, wide)
    canvas[:, canvas_size, :] = -math.inf
    canvas[:, :, canvas_size] = -math.inf
    canvas = canvas.view(canvases, -1).scatter_add_(1, index, patch.view(canvases, -1))
    p = canvas.gather(1, index).view(patch.shape)
    del canvas, index
    q = p.clamp(eps, 1.0 - eps)
    log_q = torch.log(q)
    log_1mq = torch.log1p(q.neg())
    log_eps, log1m_eps = math.log(eps), math.log1p(-eps)
    # f(q) - f(eps) = x (log q - log(1 - q) - log eps + log(1 - eps)) + log(1 - q) - log(1 - eps),
    # where a pixel covered by m patches counts 1/m in each
    term = log_q.sub_(log_1mq).sub_(log_eps - log1m_eps).mul_(xv).add_(log_1mq).sub_(log1m_eps)
    term.div_(_cover_count(base, side, t.dtype))
    value = term.view(num_particles, batch, -1).sum(-1)
    if not (need_t or need_o):
        return value, None, None
    # f'(p) = (x - p) / (p (1 - p)) where the clamp is inactive (eps < p < 1 - eps; never off
    # the canvas), else 0: hardtanh's backward is exactly that mask, in one fused pass
    dp = (xv - q).div_(torch.addcmul(q, q, q, value=-1.0))
    dp = torch.ops.aten.hardtanh_backward(dp, p, eps, 1.0 - eps)
    d_rows = dp[..., :size] * (1.0 - fx)  # adjoint of the column blend
    d_rows.addcmul_(dp[..., 1:], fx)
    d_t = d_o = None
    if need_t:
        d_t = d_rows[..., :size, :] * (1.0 - fy)  # adjoint of the row blend
        d_t.addcmul_(d_rows[..., 1:, :], fy)
    if need_o:
        # d patch / d fx = rows shifted right minus rows; d rows / d fy likewise
        d_fx = (rows * (dp[..., 1:] - dp[..., :size])).sum((-2, -1))
        d_fy = (t * (d_rows[..., 1:, :] - d_rows[..., :size, :])).sum((-2, -1))
        d_o = torch.stack([d_fx, d_fy], -1)
    return value, d_t, d_o


def _cover_count(base: Tensor, side: int, dtype: torch.dtype) -> Tensor:
    """How many of the D patches cover each pixel of each patch, ``(..., D, side, side)``.

    Patches are axis-aligned squares at integer corners ``base (..., D, 2)``, so digit e
    covers pixel (r, c) of digit d's patch iff it covers its row and its column: a
    separable count.
    """
    delta = base.unsqueeze(-2) - base.unsqueeze(-3)  # (..., d, e, 2): corner of d minus corner of e
    ar = torch.arange(side, device=base.device)
    pos = delta.unsqueeze(-1) + ar  # (..., d, e, 2, side): pixel of d's patch in e's frame
    inside = ((pos >= 0) & (pos < side)).to(dtype)
    return torch.einsum("...der,...dec->...drc", inside[..., 1, :], inside[..., 0, :])
