"""Bouncing MNIST (paper section 5.5, Figures 3-4, Appendix E): unsupervised tracking.

Generative model of a video of T frames showing D digits on an H x H canvas (H = 96):

    z_what_d ~ Normal(0, I_10)
    z_where_{d,1} ~ Normal(0, I_2),   z_where_{d,t} ~ Normal(z_where_{d,t-1}, sigma0^2 I_2)
    x_t ~ Bernoulli(clamp(sum_d ST(mu_theta(z_what_d), z_where_{d,t}), eps, 1 - eps))

``mu_theta`` is the Appendix E decoder 10 -> 200 -> 400 -> 784 with a sigmoid, i.e. a
28 x 28 digit of ink intensities in (0, 1). Why a clamped sum and not the paper's
``sigmoid(sum of logits)``: outside every digit a sum of logits is 0, so the sigmoid
would put probability 1/2 of ink on the whole background; summing intensities keeps the
background at exactly 0 and lets overlapping digits add up to (at most) full ink, which
is also how the simulator composes frames. ``eps`` keeps every log-probability finite.
Frames hold grey levels in [0, 1]; the "Bernoulli" log-density of a grey level is the
usual cross-entropy ``x log p + (1 - x) log(1 - p)`` (as in the paper and its code).

``ST`` is a spatial transformer restricted to translations at unit scale, which is
exactly bilinear placement: a digit whose top-left corner lands at the continuous pixel
offset ``o = (z_where + 1) (H - 28) / 2`` is the blend of its four integer shifts around
``o``. ``z_where`` in [-1, 1] puts the digit inside the canvas (offsets 0..68);
coordinate 0 is horizontal (column), coordinate 1 vertical (row). Placement writes each
29 x 29 blended patch into the canvas with one ``scatter_add`` (no 96 x 96 sampling grid
per digit), and the likelihood is evaluated on the patches only: the background's
contribution is a per-frame constant of the data (see ``frame_log_likelihood``).

Blocks (T + 1 of them, in the paper's order): ``what`` = {z_what} and ``where_t`` =
{z_where_t} for t = 1..T. Their number depends on the video, so the model reports them
through ``blocks_for(x)``. The Markov blanket of ``where_t`` is frame t's likelihood and
the transitions into and out of t, so a block update costs the same for any T.

Cost of a training step (bench/bench_bmnist.py): the correlation of each frame with
the templates and the where network's 4761 -> 400 layer (forward and weight gradient)
are nearly all of the arithmetic. Resampling leaves copies of particles, and a copy's
templates, correlation maps, proposal and blankets are its original's, so they are
computed once per distinct particle and handed out by index (exactly the same values and
gradients; how much this saves depends on the ESS). The decoder runs once per fresh set
of codes. Gradients are flushed of subnormal floats before their matrix multiplies.

Simulator: each digit follows the model's random walk (its per-frame velocity is a fresh
Normal(0, sigma0^2 I) step) and bounces, i.e. is reflected, at the borders of [-1, 1],
so digits always stay inside the canvas. This matches the model except for the
reflection at the walls (the authors' simulator moved digits at constant speed, which the
random-walk prior does not describe).

Legend: L particles, B videos, T frames, F a subset (chunk) of frames, D digits,
H canvas side (96), S digit side (28), P = (S + 1)^2 patch pixels, Z = 10 (z_what dim).
Latents: ``z_what (L, B, D, Z)``, ``z_where_t (L, B, D, 2)`` for t = 1..T.
Data ``x``: ``(B, T, H, H)`` in [0, 1].
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.distributions import Normal

from apg.blocks import BlockWindow, Factorized, Latents, Model, Proposals, TaskSpec
from apg.host import values_on_host

CANVAS = 96
DIGIT = 28
# Frames are processed in chunks of this many so that memory stays bounded for long videos.
FRAME_CHUNK = 10


@dataclass(frozen=True)
class BMNISTConfig:
    """Model hyperparameters (paper / Appendix E defaults; sigma0 from the authors' code)."""

    canvas_size: int = CANVAS
    digit_size: int = DIGIT
    z_what_dim: int = 10
    sigma0: float = 0.2
    prob_eps: float = 1e-4


def where_key(t: int) -> str:
    """Name of frame t's position latent (t counts from 1, as in the paper)."""
    return f"z_where_{t}"


def _frame_of(block: str) -> int:
    try:
        kind, t = block.split("_")
        if kind == "where" and int(t) >= 1:
            return int(t)
    except ValueError:
        pass
    raise ValueError(f"unknown block {block!r}; blocks are 'what' and 'where_1' .. 'where_T'")


def stack_where(z: Mapping[str, Tensor], num_frames: int, start: int = 1) -> Tensor:
    """``(L, B, F, D, 2)`` positions of frames ``start .. start + F - 1``."""
    return torch.stack([z[where_key(t)] for t in range(start, start + num_frames)], dim=2)


# --------------------------------------------------------------------------- placement


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
    layer). Measured on a 2-core CPU (one thread, 10 videos x 30 templates): this loop
    ran at matrix-multiply speed, about as fast as an FFT correlation (which needs 10x
    fewer FLOPs but runs far below peak) and twice as fast as one grouped convolution.
    """
    num_particles, batch, digits, size = templates.shape[:4]
    out = [
        F.conv2d(frames[b][None, None], templates[:, b].reshape(num_particles * digits, 1, size, size))
        for b in range(batch)
    ]
    side = out[0].shape[-1]
    return torch.stack([o.reshape(num_particles, digits, side, side) for o in out], 1)


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
    num_particles, batch, digits, size = templates.shape[:4]
    distinct = first == torch.arange(num_particles, device=first.device)[:, None]  # (L, B)
    counts = distinct.sum(0)  # (B,)
    maps = []
    for b in range(batch):
        own = templates[distinct[:, b], b].reshape(-1, 1, size, size)  # (n_b x D, 1, S, S)
        maps.append(F.conv2d(frames[b][None, None], own)[0])
    # row of particle l's first digit: the video's start + the rank of its original
    rank = distinct.long().cumsum(0) - 1  # (L, B): rank among the video's distinct particles
    start = counts.cumsum(0) - counts  # (B,)
    first_row = (start + rank.gather(0, first)) * digits  # (L, B)
    rows = first_row[..., None] + torch.arange(digits, device=first.device)
    return torch.cat(maps), rows


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
                d_templates += dt
            if need_o:
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


# --------------------------------------------------------------------------- the model


class Decoder(nn.Module):
    """mu_theta: z_what ``(..., Z)`` -> digit intensities ``(..., S, S)`` (Appendix E)."""

    def __init__(self, z_dim: int = 10, digit_size: int = DIGIT):
        super().__init__()
        self.digit_size = digit_size
        self.net = nn.Sequential(
            nn.Linear(z_dim, 200), nn.ReLU(), nn.Linear(200, 400), nn.ReLU(), nn.Linear(400, digit_size**2)
        )

    def forward(self, z_what: Tensor) -> Tensor:
        return torch.sigmoid(_run(self.net, z_what)).unflatten(-1, (self.digit_size, self.digit_size))


class _FlushDenormalGrad(torch.autograd.Function):
    """The identity, whose backward pass sets subnormal gradient entries to zero.

    Gradients here are scaled by self-normalized importance weights, and a particle's
    weight can be 1e-40 and less: subnormal floats, which make a CPU matrix multiply
    about 100x slower (measured: a 300 x 400 gradient with subnormal entries turned the
    4761 x 400 weight gradient from 87 into 1 GFLOP/s). Flushing them to zero, as GPUs
    and fast-math CPU code do, changes each gradient entry by less than
    ``finfo.tiny`` (1.2e-38 in float32) per term.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return _flush_denormals(grad)


def _flush_denormals(t: Tensor) -> Tensor:
    return t.masked_fill(t.abs() < torch.finfo(t.dtype).tiny, 0.0)


def _run(net: nn.Sequential, u: Tensor) -> Tensor:
    """``net(u)``, with the gradient of every linear layer's output flushed of subnormals
    (``_FlushDenormalGrad``) before it reaches that layer's matrix multiplies."""
    for layer in net:
        u = layer(u)
        if isinstance(layer, nn.Linear) and torch.is_grad_enabled():
            u = _FlushDenormalGrad.apply(u)
    return u


class BouncingMNIST(Model):
    """``p_theta(x, z_what, z_where_{1:T})`` of the module docstring; theta = the decoder."""

    blocks: dict[str, tuple[str, ...]] = {"what": ("z_what",)}  # where_1..where_T: see blocks_for
    # The step unrolls K sweeps of T + 1 block updates: traced whole at the paper's sizes it
    # did not finish in 44 minutes, so it compiles one unit at a time (docs/kernels.md).
    compile_per_block = True

    def __init__(self, cfg: BMNISTConfig = BMNISTConfig()):
        super().__init__()
        self.cfg = cfg
        self.decoder = Decoder(cfg.z_what_dim, cfg.digit_size)
        self._memo: tuple[Any, ...] | None = None

    def blocks_for(self, x: Tensor) -> dict[str, tuple[str, ...]]:
        """``what``, then ``where_1 .. where_T`` for videos ``x (B, T, H, H)``."""
        _check_video(x, self.cfg)
        return {"what": ("z_what",), **{f"where_{t}": (where_key(t),) for t in range(1, x.shape[1] + 1)}}

    def block_window(self, block: str, x: Tensor) -> BlockWindow | None:
        """``where_t``'s update reads frame t, z_what and the positions of frames t - 1 .. t + 1:
        it is the update of the middle frame of the video ``x[:, t-2 : t+1]`` (of the first
        or last frame of a two-frame video at the ends). So a compiled step has three
        where-graphs (fewer for videos of one or two frames), the same for every length.
        ``what`` reads every frame: no window."""
        if block == "what":
            return None
        t, num_frames = _frame_of(block), x.shape[1]
        if t > num_frames:
            raise ValueError(f"block {block!r} does not exist in a video of {num_frames} frames")
        first, last = max(t - 1, 1), min(t + 1, num_frames)
        names = {
            "z_what": "z_what",
            **{where_key(s - first + 1): where_key(s) for s in range(first, last + 1)},
        }
        return BlockWindow(f"where_{t - first + 1}", x[:, first - 1 : last], names)

    def templates(self, z_what: Tensor) -> Tensor:
        """Decoded digits ``(L, B, D, S, S)``.

        The sampler scores the same codes many times: within one block update the same
        ``z_what`` tensor (proposal, old and new blanket), and across block updates copies
        of its particles (resampling gathers them). The decoder runs once per fresh set of
        codes: a tensor seen last time is answered from memory (checked by identity and
        version), and a tensor each of whose particles equals (exactly) a particle of
        the last decoded one, for the same video, gets that particle's decoded digits by
        indexing, so the gradient reaches the decoder through the same output. The key
        also holds the grad mode, train/eval mode and the decoder's parameter versions
        (an optimizer step bumps them).
        """
        if torch.compiler.is_compiling():  # the graph holds no tensor versions or weak references
            return self.decoder(z_what)
        key = (torch.is_grad_enabled(), self.training, tuple(p._version for p in self.decoder.parameters()))
        memo = self._memo
        if memo is not None and memo[0] == key:
            last, last_version, last_out = memo[1]
            if last() is z_what and last_version == z_what._version:
                return last_out
            source, source_version, source_out = memo[2]
            out = _gather_copies(z_what, source, source_out) if source._version == source_version else None
            if out is not None:
                self._memo = (key, (weakref.ref(z_what), z_what._version, out), memo[2])
                return out
        out = self.decoder(z_what)
        entry = (weakref.ref(z_what), z_what._version, out)
        self._memo = (key, entry, (z_what, z_what._version, out))
        return out

    def log_prior_what(self, z_what: Tensor) -> Tensor:
        return _std_normal_log_prob(z_what).sum((-2, -1))

    def log_transition(self, prev: Tensor | None, where: Tensor) -> Tensor:
        """``log p(z_where_t | z_where_{t-1})`` (``prev=None``: the N(0, I) initial state), ``(L, B)``."""
        if prev is None:
            return _std_normal_log_prob(where).sum((-2, -1))
        s = self.cfg.sigma0
        return (_std_normal_log_prob((where - prev) / s) - math.log(s)).sum((-2, -1))

    def log_likelihood(
        self, x: Tensor, templates: Tensor, z: Mapping[str, Tensor], start: int, stop: int
    ) -> Tensor:
        """``sum_{t=start}^{stop} log p(x_t | ...)``, ``(L, B)``, in chunks of frames."""
        total: Tensor | None = None
        for lo in range(start, stop + 1, FRAME_CHUNK):
            hi = min(stop, lo + FRAME_CHUNK - 1)
            part = frame_log_likelihood(
                x[:, lo - 1 : hi], templates, stack_where(z, hi - lo + 1, lo), self.cfg
            )
            total = part if total is None else total + part
        assert total is not None
        return total

    def log_joint(self, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
        num_frames = _check_video(x, self.cfg)
        templates = self.templates(z["z_what"])
        out = self.log_prior_what(z["z_what"]) + self.log_likelihood(x, templates, z, 1, num_frames)
        prev = None
        for t in range(1, num_frames + 1):
            out = out + self.log_transition(prev, z[where_key(t)])
            prev = z[where_key(t)]
        return out

    def log_blanket(self, block: str, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
        """Factors that involve ``block``: for ``what`` its prior and every frame; for
        ``where_t`` frame t and the transitions into and out of t (cost independent of T).

        Resampling leaves copies of particles, whose blankets are their originals': when
        a video has copies, the blanket is computed on ``L' < L`` particles per video (the
        distinct ones, padded with copies) and handed out by index (``_distinct_particles``).
        """
        num_frames = _check_video(x, self.cfg)
        if block == "what":
            names = ["z_what", *(where_key(t) for t in range(1, num_frames + 1))]
        else:
            t = _frame_of(block)
            if t > num_frames:
                raise ValueError(f"block {block!r} does not exist in a video of {num_frames} frames")
            names = ["z_what", *(where_key(s) for s in (t - 1, t, t + 1) if 1 <= s <= num_frames)]
        pick = _distinct_particles([z[name] for name in names])
        if pick is None:
            return self._log_blanket(block, x, z, num_frames)
        compact, position = pick
        videos = torch.arange(x.shape[0], device=x.device)
        small = {name: z[name][compact, videos] for name in names}
        return self._log_blanket(block, x, small, num_frames).gather(0, position)

    def _log_blanket(self, block: str, x: Tensor, z: Mapping[str, Tensor], num_frames: int) -> Tensor:
        templates = self.templates(z["z_what"])
        if block == "what":
            return self.log_prior_what(z["z_what"]) + self.log_likelihood(x, templates, z, 1, num_frames)
        t = _frame_of(block)
        here = z[where_key(t)]
        out = self.log_transition(z[where_key(t - 1)] if t > 1 else None, here)
        if t < num_frames:
            out = out + self.log_transition(here, z[where_key(t + 1)])
        return out + self.log_likelihood(x, templates, z, t, t)

    def reconstruct(self, z: Mapping[str, Tensor], num_frames: int) -> Tensor:
        """Canvas means ``clamp(sum of placed digits, 0, 1)``, ``(L, B, T, H, H)``."""
        templates = self.templates(z["z_what"]).unsqueeze(2)
        offset = pixel_offsets(stack_where(z, num_frames), self.cfg.canvas_size, self.cfg.digit_size)
        return render(templates, offset, self.cfg.canvas_size).clamp(0.0, 1.0)


def _std_normal_log_prob(v: Tensor) -> Tensor:
    return -0.5 * v * v - 0.5 * math.log(2 * math.pi)


def _check_video(x: Tensor, cfg: BMNISTConfig) -> int:
    if x.dim() != 4 or x.shape[-2:] != (cfg.canvas_size, cfg.canvas_size):
        raise ValueError(
            f"videos must be shaped (B, T, {cfg.canvas_size}, {cfg.canvas_size}), got {tuple(x.shape)}"
        )
    return x.shape[1]


def _gather_copies(z: Tensor, source: Tensor, source_out: Tensor) -> Tensor | None:
    """``source_out`` reindexed to ``z``'s particles when every particle of ``z (L, B, ...)``
    is an exact copy of a particle of ``source (L', B, ...)`` for the same video
    (``source_out[a(l, b), b]``); else ``None``."""
    if z.shape[1:] != source.shape[1:] or z.dtype != source.dtype or z.device != source.device:
        return None
    if not values_on_host(z):  # a device: decoding again costs less than a host read
        return None
    same = (z.unsqueeze(1) == source.unsqueeze(0)).flatten(3).all(-1)  # (L, L', B)
    if not bool(same.any(1).all()):
        return None
    ancestor = same.to(torch.uint8).argmax(1)  # (L, B)
    return source_out[ancestor, torch.arange(z.shape[1], device=z.device)]


# --------------------------------------------------------------------------- simulator


def reflect(u: Tensor) -> Tensor:
    """Fold the real line into [-1, 1] by reflection at the walls (a bounce)."""
    return 1.0 - torch.abs(torch.remainder(u + 1.0, 4.0) - 2.0)


def simulate_trajectories(
    num_videos: int, num_frames: int, num_digits: int, sigma0: float, generator: torch.Generator
) -> Tensor:
    """Positions ``(M, T, D, 2)`` in [-1, 1]: the model's random walk, reflected at the borders."""
    steps = torch.randn(num_videos, num_frames, num_digits, 2, generator=generator, dtype=torch.float64)
    steps[:, 1:] *= sigma0
    where = torch.empty_like(steps)
    where[:, 0] = reflect(steps[:, 0])
    for t in range(1, num_frames):
        where[:, t] = reflect(where[:, t - 1] + steps[:, t])
    return where


def simulate(
    model: BouncingMNIST,
    num_datasets: int,
    generator: torch.Generator,
    num_frames: int = 10,
    num_digits: int = 3,
    split: str = "train",
    mnist_dir: str | None = None,
) -> dict[str, Tensor]:
    """Simulate ``num_datasets`` videos of ``num_digits`` MNIST digits (from ``split``).

    Returns ``x (M, T, H, H)`` in [0, 1] (default dtype), the true positions
    ``z_where (M, T, D, 2)``, the centres of the digits' ink in their boxes ``centres
    (M, D, 2)`` (``ink_centres``), the digits' MNIST ``labels (M, D)`` and ``indices (M, D)``.
    """
    from apg.data.mnist import load_mnist

    cfg = model.cfg
    mnist = load_mnist(split, mnist_dir)
    images = torch.from_numpy(mnist.images)
    indices = torch.randint(len(images), (num_datasets, num_digits), generator=generator)
    where = simulate_trajectories(num_datasets, num_frames, num_digits, cfg.sigma0, generator)
    dtype = torch.get_default_dtype()
    frames = []
    for lo in range(0, num_datasets, 64):
        digits = images[indices[lo : lo + 64]].to(dtype) / 255.0  # (m, D, S, S)
        offset = pixel_offsets(where[lo : lo + 64].to(dtype), cfg.canvas_size, cfg.digit_size)
        frames.append(render(digits.unsqueeze(1), offset, cfg.canvas_size).clamp_(0.0, 1.0))
    x = torch.cat(frames) if frames else torch.zeros(0, num_frames, cfg.canvas_size, cfg.canvas_size)
    labels = torch.from_numpy(mnist.labels.astype(np.int64))[indices]
    centres = ink_centres(images[indices].to(torch.float64))
    return {
        "x": x,
        "z_where": where.to(dtype),
        "centres": centres.to(dtype),
        "labels": labels,
        "indices": indices,
    }


# --------------------------------------------------------------------------- tracking error

# A frame is "tracked" when every digit is within this many pixels of its true position.
TRACK_TOLERANCE_PX = 3.0


def ink_centres(images: Tensor) -> Tensor:
    """Centre of mass ``(..., 2)`` (column, row, in pixels from the box's top-left pixel) of
    the ink of digit images ``(..., S, S)``; an empty image's centre is the box's centre."""
    size = images.shape[-1]
    grid = torch.arange(size, dtype=images.dtype, device=images.device)
    mass = images.sum((-2, -1))
    cols = (images.sum(-2) * grid).sum(-1)
    rows = (images.sum(-1) * grid).sum(-1)
    centre = torch.stack([cols, rows], -1) / mass.clamp_min(1e-12)[..., None]
    return torch.where(mass[..., None] > 0, centre, torch.full_like(centre, 0.5 * (size - 1)))


def position_errors(
    true_where: Tensor | np.ndarray,
    where: Tensor | np.ndarray,
    cfg: BMNISTConfig = BMNISTConfig(),
    true_centres: Tensor | np.ndarray | None = None,
    centres: Tensor | np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """How far inferred digits are from the simulator's, per video.

    ``true_where`` and ``where``: ``(M, T, D, 2)`` box positions in model coordinates.
    Digits are exchangeable, so each video's inferred digits are matched to its true ones
    by the permutation with the smallest mean distance; one permutation per video, not
    per frame, because a tracked digit keeps its identity (its ``z_what``) through the video.

    A box position says where a digit is only together with where the digit sits in its
    box: the learned decoder need not centre its digits as MNIST does (a digit drawn 2 px
    to the right in a box 2 px to the left makes the same frame). With ``true_centres``
    and ``centres`` ``(M, D, 2)``, the ink centres of the true digits and of the decoded
    templates (``ink_centres``), digits are compared where their ink is: box corner plus
    ink centre. That is the position error; without centres it is the boxes' error.

    Returns, per video ``(M,)``: ``pos_err``, mean pixels between matched digits over
    frames and digits (one model unit is ``(H - 28) / 2`` pixels per coordinate);
    ``tracked``, the fraction of frames whose every digit is within
    ``TRACK_TOLERANCE_PX`` of its match; ``pos_err_aligned``, ``pos_err`` after removing
    each matched digit's mean offset over the video (the error of the tracked motion,
    blind to any constant offset); and with centres, ``box_err``, the boxes' error.

    Where the boxes are, whichever digit each follows: ``pos_err_frame`` and
    ``tracked_frame``, the same with each frame's digits matched on their own (a
    localization error, blind to identities); ``swapped``, the fraction of frames whose
    every box is within the tolerance of some digit but not of its own (boxes that traded
    digits, typically where two digits pass close by).
    """
    true_where = torch.as_tensor(np.asarray(true_where), dtype=torch.float64)
    where = torch.as_tensor(np.asarray(where), dtype=torch.float64)
    if true_where.shape != where.shape or true_where.dim() != 4 or true_where.shape[-1] != 2:
        raise ValueError(
            f"positions must both be (videos, frames, digits, 2); got {tuple(true_where.shape)} "
            f"and {tuple(where.shape)}"
        )
    px = 0.5 * (cfg.canvas_size - cfg.digit_size)
    out: dict[str, np.ndarray] = {}
    if (true_centres is None) != (centres is None):
        raise ValueError("give both true_centres and centres, or neither")
    if centres is not None:
        out["box_err"] = position_errors(true_where, where, cfg)["pos_err"]
        shape = (where.shape[0], where.shape[2], 2)
        mid = 0.5 * (cfg.digit_size - 1)
        moved = []
        for name, pos, c in (("true_centres", true_where, true_centres), ("centres", where, centres)):
            c = torch.as_tensor(np.asarray(c), dtype=torch.float64)
            if c.shape != shape:
                raise ValueError(f"{name} must be (videos, digits, 2) = {shape}; got {tuple(c.shape)}")
            moved.append(pos + ((c - mid) / px)[:, None])
        true_where, where = moved
    # dist[m, t, i, j]: pixels between inferred digit i and true digit j
    dist = torch.linalg.vector_norm(where.unsqueeze(3) - true_where.unsqueeze(2), dim=-1) * px
    digits = where.shape[2]
    perms = torch.tensor(list(itertools.permutations(range(digits))), dtype=torch.long)  # (P, D)
    rows = torch.arange(digits)
    matched = dist[:, :, rows[None, :], perms]  # (M, T, P, D)
    best = matched.mean((1, 3)).argmin(-1)  # (M,)
    videos = torch.arange(len(best))
    errors = matched[videos, :, best]  # (M, T, D)
    # signed differences of the matched pairs, (M, T, D, 2), for the aligned error
    diff = (where - true_where[videos[:, None], :, perms[best]].transpose(1, 2)) * px
    aligned = torch.linalg.vector_norm(diff - diff.mean(1, keepdim=True), dim=-1)
    tracked = (errors <= TRACK_TOLERANCE_PX).all(-1)  # (M, T)
    frame_best = matched.mean(3).argmin(2)  # (M, T): each frame's own permutation
    frame_errors = matched.gather(2, frame_best[:, :, None, None].expand(-1, -1, 1, digits))[:, :, 0]
    tracked_frame = (frame_errors <= TRACK_TOLERANCE_PX).all(-1)
    return {
        "pos_err": errors.mean((1, 2)).numpy(),
        "tracked": tracked.double().mean(1).numpy(),
        "pos_err_aligned": aligned.mean((1, 2)).numpy(),
        "pos_err_frame": frame_errors.mean((1, 2)).numpy(),
        "tracked_frame": tracked_frame.double().mean(1).numpy(),
        "swapped": (tracked_frame & ~tracked).double().mean(1).numpy(),
        **out,
    }


# --------------------------------------------------------------------------- proposals


def _mean_digit_blob(size: int = DIGIT) -> Tensor:
    """A smooth stand-in for the mean MNIST digit (measured on the training set: peak
    0.55 at the centre, standard deviations 5.5 px vertically and 4.1 px horizontally)."""
    r = torch.arange(size, dtype=torch.get_default_dtype()) - (size - 1) / 2
    return 0.55 * torch.exp(-0.5 * ((r[:, None] / 5.5) ** 2 + (r[None, :] / 4.1) ** 2))


def _softmax_no_denormals(logits: Tensor, floor: float = 50.0) -> Tensor:
    """Softmax over the last dim with logits clamped to within ``floor`` nats of the max.

    A correlation map of a real frame is so peaked that most softmax outputs underflow
    to denormal floats, which make the following 4761 x 400 matrix multiply about 10x
    slower on x86 CPUs; entries below e^-50 of the peak carry no information anyway.
    """
    top = logits.detach().amax(-1, keepdim=True)
    return torch.softmax(torch.maximum(logits, top - floor), -1)


class _SoftmaxLinear(torch.autograd.Function):
    """``_softmax_no_denormals(logits) @ weight.T + bias`` for rows ``logits (N, M)`` that
    need no gradient (correlation maps), fused.

    The softmax is computed in place in one buffer, the only tensor kept for the
    backward pass (for the weight gradient); the gradient is flushed of subnormals
    (``_FlushDenormalGrad``) before its matrix multiply.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, weight: Tensor, bias: Tensor, floor: float) -> Tensor:
        s = logits - logits.amax(-1, keepdim=True)
        s.clamp_(min=-floor).exp_()
        s.div_(s.sum(-1, keepdim=True))
        ctx.save_for_backward(s)
        return torch.addmm(bias, s, weight.T)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        (s,) = ctx.saved_tensors
        g = _flush_denormals(grad)
        grad_w = g.T @ s if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0) if ctx.needs_input_grad[2] else None
        return None, grad_w, grad_b, None


class WhereNet(nn.Module):
    """q(z_where_{d,t} | correlation map): softmax over the map, 4761 -> 400 tanh, then
    mean (200 tanh -> 2, tanh) and scale (200 tanh -> 2, softplus, plus ``min_scale``)
    heads (Appendix E)."""

    def __init__(
        self,
        map_size: int,
        hidden: int = 400,
        head: int = 200,
        read_coordinates: bool = False,
        min_scale: float = 1e-3,
    ):
        super().__init__()
        self.min_scale = min_scale
        self.body = nn.Sequential(nn.Linear(map_size, hidden), nn.Tanh())
        self.loc = nn.Sequential(nn.Linear(hidden, head), nn.Tanh(), nn.Linear(head, 2), nn.Tanh())
        self.scale = nn.Sequential(nn.Linear(hidden, head), nn.Tanh(), nn.Linear(head, 2))
        if read_coordinates:
            self._read_coordinates()

    @torch.no_grad()
    def _read_coordinates(self, gains: tuple[float, float, float] = (0.2, 2.0, 3.5)) -> None:
        """Start the mean head as a soft-argmax: two hidden units hold the softmaxed map's
        mean column and row (in model coordinates), passed through to the mean. Same layers
        as Appendix E, another initialization: from random weights each of the map's 4761
        positions is learned on its own, and reading positions took thousands of steps.
        ``gains`` make tanh(c tanh(b tanh(a u))) within 0.1 of u on [-1, 1]."""
        a, b, c = gains
        body, hidden, out = self.body[0], self.loc[0], self.loc[2]
        side = math.isqrt(body.in_features)
        grid = torch.arange(side, dtype=body.weight.dtype) / (0.5 * (side - 1)) - 1.0
        coords = torch.stack([grid.repeat(side), grid.repeat_interleave(side)])  # (column, row) per map entry
        body.weight[:2] = a * coords
        body.bias[:2] = 0.0
        hidden.weight[:2] = 0.0
        hidden.weight[0, 0] = hidden.weight[1, 1] = b
        hidden.bias[:2] = 0.0
        out.weight.zero_()
        out.weight[0, 0] = out.weight[1, 1] = c
        out.bias.zero_()

    def forward(self, corr: Tensor) -> Normal:
        logits = corr.flatten(-2)
        if logits.requires_grad:
            h = _run(self.body, _softmax_no_denormals(logits))
        else:
            first = self.body[0]
            rows = logits.reshape(-1, logits.shape[-1])
            pre = _SoftmaxLinear.apply(rows, first.weight, first.bias, 50.0)
            h = self.body[1:](pre).view(*logits.shape[:-1], -1)
        return Normal(
            _run(self.loc, h), F.softplus(_run(self.scale, h)) + self.min_scale, validate_args=False
        )


class WhatNet(nn.Module):
    """q(z_what_d | crops): per-frame features 784 -> 400 -> 200 (ReLU), averaged over
    frames (neural sufficient statistics over time), then mean and scale heads."""

    def __init__(self, digit_size: int, z_dim: int, hidden: int = 400, feature: int = 200):
        super().__init__()
        self.features = nn.Sequential(
            nn.Linear(digit_size**2, hidden), nn.ReLU(), nn.Linear(hidden, feature), nn.ReLU()
        )
        self.loc = nn.Linear(feature, z_dim)
        self.scale = nn.Linear(feature, z_dim)

    def forward(self, mean_feature: Tensor) -> Normal:
        loc, scale = self.loc(mean_feature), self.scale(mean_feature)
        if torch.is_grad_enabled():
            loc, scale = _FlushDenormalGrad.apply(loc), _FlushDenormalGrad.apply(scale)
        return Normal(loc, F.softplus(scale) + 1e-3, validate_args=False)


class ExplainingAwayWhere:
    """q(z_where_t | x_t, z_what): one frame's digits, proposed one after another.

    Digit d's correlation map is the frame's correlation with its own template minus what
    the digits before it contribute at their positions (``cross_correlations``): the map
    of the frame with those digits removed. Without it every digit's map peaks at the
    frame's brightest digit, and two digits' proposals lock onto the same one. Digit d's
    factor depends on the values of digits < d, so ``log_prob(value)`` (the reverse
    kernel) recomputes the maps at ``value``'s positions. Appendix E's network reads each
    map; the frame the map is taken of is the frame explained so far (as the authors'
    released code does, there with the reverse maps taken at the wrong positions).

    ``maps (L, B, D, side, side)`` the frame's correlations, ``cross (L, B, D, D, 2S-1,
    2S-1)`` from ``cross_correlations``.
    """

    def __init__(self, net: WhereNet, maps: Tensor, cross: Tensor, cfg: BMNISTConfig, name: str):
        self.net, self.maps, self.cross, self.cfg, self.name = net, maps, cross, cfg, name

    def _walk(self, value: Tensor | None, first: Normal | None = None) -> tuple[Tensor, Tensor, Normal]:
        """Sample (``value`` None) or score ``value (L, B, D, 2)`` digit by digit; returns
        ``(where, log_q (L, B), q of digit 0)``."""
        digits, side = self.maps.shape[2], self.maps.shape[-1]
        shift = self.cfg.digit_size - 1
        placed: list[Tensor] = []
        log_q: Tensor | None = None
        q0 = first
        for d in range(digits):
            corr = self.maps[:, :, d]
            if d:
                offset = pixel_offsets(torch.stack(placed, 2), self.cfg.canvas_size, self.cfg.digit_size)
                corr = corr - render(self.cross[:, :, :d, d], offset - shift, side)
            q = first if d == 0 and first is not None else self.net(corr)
            if d == 0:
                q0 = q
            w = q.sample() if value is None else value[:, :, d]
            lp = q.log_prob(w).sum(-1)
            log_q = lp if log_q is None else log_q + lp
            placed.append(w)
        assert log_q is not None and q0 is not None
        return torch.stack(placed, 2), log_q, q0

    def sample(self) -> Latents:
        with torch.no_grad():
            return {self.name: self._walk(None)[0]}

    def log_prob(self, value: Mapping[str, Tensor]) -> Tensor:
        return self._walk(value[self.name])[1]

    def propose(self, old: Mapping[str, Tensor]) -> tuple[Latents, Tensor, Tensor]:
        """``blocks.propose`` in one forward walk and one reverse walk (digit 0's map is
        the same for both, so its network runs once)."""
        new, log_q_new, q0 = self._walk(None)
        with torch.no_grad():
            q0 = Normal(q0.loc.detach(), q0.scale.detach(), validate_args=False)
            log_q_old = self._walk(old[self.name], q0)[1]
        return {self.name: new}, log_q_new, log_q_old


class BMNISTProposals(Proposals):
    """Inference networks.

    ``apg``: the initial encoder and the kernels q(z_what | x, z_where_{1:T}) and
    q(z_where_t | x_t, z_what). ``mlp``: the same encoder, no kernels (the RWS baseline).

    The encoder proposes the positions of frame t digit by digit from the frame's
    correlation with a mean-digit template, explaining away the digits already placed
    (their template's correlation is subtracted, which is an exact placement of the
    template's autocorrelation, so it costs no extra convolution), then z_what from crops.
    ``num_digits`` (D) is a property of the data, not of the networks: set it to evaluate
    on videos with another number of digits (the state dict is unchanged).

    Three choices differ from the authors' code, each measured (docs/decisions.md, "Model and
    proposals"): the encoder and the kernels have a position
    network each (``share_where_net=False``; with one shared network, sweeps made the
    encoder's positions worse), both start as a soft-argmax of the map (``read_coordinates``,
    ``WhereNet._read_coordinates``; from random weights, reading positions took thousands
    of steps), and the encoder's position scale has a floor of about a pixel
    (``encoder_min_scale``; without it the encoder could collapse into a corner). The
    layers are Appendix E's.
    """

    def __init__(
        self,
        model: BouncingMNIST,
        architecture: str = "apg",
        num_digits: int = 3,
        share_where_net: bool = False,
        read_coordinates: bool = True,
        encoder_min_scale: float = 0.03,
    ):
        super().__init__()
        if architecture not in ("apg", "mlp"):
            raise ValueError(f"unknown Bouncing MNIST architecture {architecture!r}; choose apg or mlp")
        self.model = [model]  # a plain list: the decoder is theta's, not a submodule of phi
        self.architecture = architecture
        self.num_digits = num_digits
        cfg = model.cfg
        side = cfg.canvas_size - cfg.digit_size + 1
        # The encoder reads maps of the mean-digit blob, the kernels maps of decoded digits:
        # one network each (the default; the kernel's then learns decoded digits' maps
        # alone) or one for both (the authors' code). RWS has no kernels: one network.
        own = not share_where_net and architecture == "apg"

        # The encoder's position scale has a floor of about a pixel (``encoder_min_scale``,
        # model units; 0.03 is 1.02 px). Without it the scale fell to 0.2 px while the
        # encoder was still 3-6 px off, its wake-phi gradient (~1/scale^2) grew a
        # hundredfold, and in 2 of 11 seeds (600 steps of the CPU default) its mean ran into
        # a corner of the frame, where the final tanh saturates and it never came back.
        # With the floor all 11 ended at 1.8-2.5 px (docs/decisions.md). The
        # kernels' networks keep WhereNet's own floor; with one network it is the encoder's.
        def where_net(min_scale: float) -> WhereNet:
            return WhereNet(side * side, read_coordinates=read_coordinates, min_scale=min_scale)

        self.where_net = where_net(1e-3 if own else encoder_min_scale)
        self.initial_where_net = where_net(encoder_min_scale) if own else None
        self.what_net = WhatNet(cfg.digit_size, cfg.z_what_dim)
        self.register_buffer("mean_template", _mean_digit_blob(cfg.digit_size))

    @property
    def cfg(self) -> BMNISTConfig:
        return self.model[0].cfg

    # -- pieces

    def _what(self, x: Tensor, where: Tensor) -> Normal:
        """q(z_what | x, z_where): ``where (L, B, T, D, 2)`` -> Normal over ``(L, B, D, Z)``."""
        cfg = self.cfg
        total: Tensor | None = None
        num_frames = x.shape[1]
        for lo in range(0, num_frames, FRAME_CHUNK):
            hi = min(num_frames, lo + FRAME_CHUNK)
            offset = pixel_offsets(where[:, :, lo:hi], cfg.canvas_size, cfg.digit_size)
            patches = crop(x[:, lo:hi], offset, cfg.digit_size)  # (L, B, F, D, S, S)
            part = _run(self.what_net.features, patches.flatten(-2)).sum(2)
            total = part if total is None else total + part
        assert total is not None
        return self.what_net(total / num_frames)

    def _initial_where(self, x: Tensor, num_particles: int) -> tuple[Latents, Tensor]:
        cfg = self.cfg
        batch, num_frames = x.shape[:2]
        tmpl = self.mean_template
        size = tmpl.shape[-1]
        corr_x = F.conv2d(x.reshape(batch * num_frames, 1, *x.shape[-2:]), tmpl[None, None])
        side = corr_x.shape[-1]
        corr_x = corr_x.reshape(batch, num_frames, side, side)
        # autocorrelation A(k) = sum_q m(q) m(q + k), k in [-(S-1), S-1], stored at k + S - 1
        auto = F.conv2d(F.pad(tmpl, (size - 1,) * 4)[None, None], tmpl[None, None])[0, 0]
        z: Latents = {}
        log_q = x.new_zeros(num_particles, batch)
        for lo in range(0, num_frames, FRAME_CHUNK):
            hi = min(num_frames, lo + FRAME_CHUNK)
            # The first digit's map is the same for every particle: run the network once.
            corr = corr_x[:, lo:hi].unsqueeze(0)  # (1 or L, B, F, side, side)
            digits = []
            for _ in range(self.num_digits):
                q = (self.where_net if self.initial_where_net is None else self.initial_where_net)(corr)
                shape = (num_particles, *q.loc.shape[1:])
                q = Normal(q.loc.expand(shape), q.scale.expand(shape), validate_args=False)
                where = q.sample()  # (L, B, F, 2)
                log_q = log_q + q.log_prob(where).sum((-2, -1))
                digits.append(where)
                # A placed digit's correlation with the template is A shifted to its offset.
                offset = pixel_offsets(where, cfg.canvas_size, cfg.digit_size) - (size - 1)
                corr = corr - render(
                    auto.expand(*where.shape[:-1], 1, *auto.shape), offset.unsqueeze(-2), side
                )
            stacked = torch.stack(digits, -2)  # (L, B, F, D, 2)
            for t in range(lo, hi):
                z[where_key(t + 1)] = stacked[:, :, t - lo]
        return z, log_q

    # -- the Proposals interface

    def initial(self, x: Tensor, num_particles: int) -> tuple[Latents, Tensor]:
        _check_video(x, self.cfg)
        z, log_q = self._initial_where(x, num_particles)
        q_what = self._what(x, stack_where(z, x.shape[1]))
        z_what = q_what.sample()
        z["z_what"] = z_what
        return z, log_q + q_what.log_prob(z_what).sum((-2, -1))

    def kernel(self, block: str, x: Tensor, z: Mapping[str, Tensor]) -> Factorized:
        if self.architecture != "apg":
            return super().kernel(block, x, z)
        if block == "what":
            where = stack_where(z, x.shape[1])  # (L, B, T, D, 2)
            pick = _distinct_particles([where])
            if pick is None:
                q = self._what(x, where)
            else:  # copies left by resampling: crop and encode their originals only
                compact, position = pick
                q = self._what(x, where[compact, torch.arange(x.shape[0], device=x.device)])
                index = position[..., None, None].expand(-1, -1, *q.loc.shape[2:])
                q = Normal(q.loc.gather(0, index), q.scale.gather(0, index), validate_args=False)
            return Factorized({"z_what": (q, 2)})
        t = _frame_of(block)
        # Templates are detached: eq. 5 trains phi only, the decoder belongs to theta.
        # (Subnormal ink, sigmoid(-88) and below, would slow the convolution down.)
        templates = _flush_denormals(self.model[0].templates(z["z_what"]).detach())
        # Resampling leaves copies of particles; a copy's z_what, hence its correlation
        # maps and proposal, are its original's: compute them once per distinct particle.
        if values_on_host(templates):
            corr, rows = _correlate_distinct(x[:, t - 1], templates, _first_copies(z["z_what"]))
        else:  # a device: every particle (the distinct ones' count would be a host read)
            corr, rows = _correlate_all(x[:, t - 1], templates)
        if templates.shape[2] == 1:  # nothing to explain away: one network pass per distinct particle
            q = self.where_net(corr)  # over (N distinct, 2)
            q = Normal(q.loc[rows], q.scale[rows], validate_args=False)
            return Factorized({where_key(t): (q, 2)})
        return ExplainingAwayWhere(
            self.where_net, corr[rows], cross_correlations(templates), self.cfg, where_key(t)
        )


# --------------------------------------------------------------------------- task spec


def build_model(**hparams) -> BouncingMNIST:
    return BouncingMNIST(BMNISTConfig(**hparams))


def build_proposals(
    model: BouncingMNIST,
    architecture: str,
    num_digits: int = 3,
    share_where_net: bool = False,
    read_coordinates: bool = True,
    encoder_min_scale: float = 0.03,
) -> BMNISTProposals:
    return BMNISTProposals(
        model, architecture, num_digits, share_where_net, read_coordinates, encoder_min_scale
    )


def reconstruct(model: BouncingMNIST, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
    """Reconstructions ``(L, B, T, H, H)`` of videos ``x (B, T, H, H)``."""
    return model.reconstruct(z, _check_video(x, model.cfg))


def sample_data(model: BouncingMNIST, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
    """``TaskSpec.sample_data``: each pixel ~ Bernoulli(its canvas mean, clamped to
    ``[eps, 1 - eps]``: the likelihood of ``frame_log_likelihood``), ``(L, B, T, H, H)`` of
    zeros and ones."""
    eps = model.cfg.prob_eps
    return torch.bernoulli(reconstruct(model, x, z).clamp(eps, 1.0 - eps))


_COLORS = np.array(
    [
        [230, 25, 75],
        [60, 180, 75],
        [0, 130, 200],
        [245, 130, 48],
        [145, 30, 180],
        [70, 240, 240],
        [240, 50, 230],
        [210, 245, 60],
    ],
    dtype=np.uint8,
)


def _boxes(z: Mapping[str, Any], num_frames: int, cfg: BMNISTConfig = BMNISTConfig()) -> np.ndarray:
    """Top-left pixel corners ``(T, D, 2)`` (column, row) of the digits of ``z``: its
    ``z_where_t`` blocks, or a ``z_where (T, D, 2)`` array (the simulator's truth)."""
    if "z_where" in z:
        where = np.asarray(z["z_where"])[:num_frames]
    else:
        where = np.stack([np.asarray(z[where_key(t)]) for t in range(1, num_frames + 1)])
    return (where + 1.0) * 0.5 * (cfg.canvas_size - cfg.digit_size)


def draw(ax, x, z, max_frames: int = 10) -> None:
    """Figure 3: a strip of the first ``max_frames`` frames with the inferred digit boxes
    and, below it, the model's reconstructions of the same frames with the same boxes.

    ``x (T, H, H)`` numpy; ``z`` numpy dict without particle or batch dims. The
    reconstruction row needs the decoder, which ``z`` does not carry: it is drawn from
    ``z["recon"]`` (``(T, H, H)``, the model's ``reconstruct`` of this sample), when given.
    With ``z["true_where"]`` (``(T, D, 2)``, the simulator's positions), each frame also
    shows every digit's path so far: inferred (solid, the box's colour) and true (dotted white).
    """
    from matplotlib.patches import Rectangle

    x = np.asarray(x)
    frames = min(max_frames, x.shape[0])
    side = x.shape[-1]
    corners = _boxes(z, frames)
    strips = [np.concatenate(list(x[:frames]), axis=1)]
    if "recon" in z:
        gap = np.ones((4, strips[0].shape[1]))
        strips += [gap, np.concatenate(list(np.clip(np.asarray(z["recon"])[:frames], 0, 1)), axis=1)]
    ax.imshow(np.concatenate(strips, axis=0), cmap="gray", vmin=0, vmax=1)
    true_corners = _boxes({"z_where": z["true_where"]}, frames) if "true_where" in z else None
    centre = DIGIT / 2 - 0.5
    for top in (0, side + 4)[: 1 if len(strips) == 1 else 2]:
        for t in range(frames):
            for d, (cx, cy) in enumerate(corners[t]):
                color = _COLORS[d % len(_COLORS)] / 255.0
                corner = (t * side + cx - 0.5, top + cy - 0.5)
                ax.add_patch(Rectangle(corner, DIGIT, DIGIT, fill=False, lw=1, edgecolor=color))
                if true_corners is not None and top == 0:
                    path = corners[: t + 1, d] + centre
                    ax.plot(t * side + path[:, 0], path[:, 1], color=color, lw=0.8)
            if true_corners is not None and top == 0:
                for d in range(true_corners.shape[1]):
                    path = true_corners[: t + 1, d] + centre
                    ax.plot(t * side + path[:, 0], path[:, 1], color="white", lw=0.8, ls=":")
                    ax.plot(t * side + path[-1, 0], path[-1, 1], "+", color="white", ms=4, mew=0.8)
    ax.set_axis_off()
    # What the colours and lines are, beside the strip (on a dark ground: the true paths are white).
    from matplotlib.lines import Line2D

    handles = [
        Rectangle(
            (0, 0), 1, 1, fill=False, edgecolor=_COLORS[d % len(_COLORS)] / 255.0, label=f"digit {d + 1}"
        )
        for d in range(corners.shape[1])
    ]
    if true_corners is not None:
        handles += [
            Line2D([], [], color="0.85", lw=0.8, label="inferred path"),
            Line2D([], [], color="white", lw=0.8, ls=":", marker="+", ms=4, label="true path, centre"),
        ]
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=6,
        facecolor="0.25",
        labelcolor="white",
    )


@torch.no_grad()
def animate(model: BouncingMNIST, x: Tensor, z: Mapping[str, Tensor]) -> np.ndarray:
    """Frames ``(T, H, 2H + 4, 3)`` uint8: the video | its reconstruction, with boxes.

    ``x (T, H, H)`` and ``z`` without particle or batch dims (torch). With
    ``z["true_where"]`` (``(T, D, 2)``), the video panel also marks each digit's true
    centre (a white cross) and the path of every inferred centre so far (the box's colour).
    """
    z = dict(z)
    truth = z.pop("true_where", None)
    num_frames, side = x.shape[0], x.shape[-1]
    zb = {k: v[None, None] for k, v in z.items()}
    recon = model.reconstruct(zb, num_frames)[0, 0]
    corners = np.round(_boxes({k: v.cpu().numpy() for k, v in z.items()}, num_frames, model.cfg)).astype(int)
    true_corners = None
    if truth is not None:
        true_corners = np.round(_boxes({"z_where": truth.cpu().numpy()}, num_frames, model.cfg)).astype(int)
    gap = np.full((num_frames, side, 4, 3), 255, np.uint8)
    panels = []
    half = DIGIT // 2
    for i, img in enumerate((x, recon)):
        rgb = np.repeat((img.clamp(0, 1).cpu().numpy() * 255).astype(np.uint8)[..., None], 3, -1)
        for t in range(num_frames):
            for d, (cx, cy) in enumerate(corners[t]):
                color = _COLORS[d % len(_COLORS)]
                _box(rgb[t], cx, cy, DIGIT, color)
                if i == 0 and true_corners is not None:
                    for px, py in corners[: t + 1, d] + half:
                        _dot(rgb[t], px, py, color)
            if i == 0 and true_corners is not None:
                for px, py in true_corners[t] + half:
                    _cross(rgb[t], px, py, np.array([255, 255, 255], np.uint8))
        panels.append(rgb)
    return np.concatenate([panels[0], gap, panels[1]], axis=2)


def _dot(img: np.ndarray, x: int, y: int, color: np.ndarray) -> None:
    h, w = img.shape[:2]
    img[max(y - 1, 0) : min(y + 1, h - 1) + 1, max(x - 1, 0) : min(x + 1, w - 1) + 1] = color


def _cross(img: np.ndarray, x: int, y: int, color: np.ndarray, arm: int = 3) -> None:
    h, w = img.shape[:2]
    if 0 <= y < h:
        img[y, max(x - arm, 0) : min(x + arm, w - 1) + 1] = color
    if 0 <= x < w:
        img[max(y - arm, 0) : min(y + arm, h - 1) + 1, x] = color


def _box(img: np.ndarray, x0: int, y0: int, size: int, color: np.ndarray) -> None:
    h, w = img.shape[:2]
    x1, y1 = x0 + size - 1, y0 + size - 1
    xs, ys = slice(max(x0, 0), min(x1, w - 1) + 1), slice(max(y0, 0), min(y1, h - 1) + 1)
    for y in (y0, y1):
        if 0 <= y < h:
            img[y, xs] = color
    for xc in (x0, x1):
        if 0 <= xc < w:
            img[ys, xc] = color


TASK = TaskSpec(
    "bmnist",
    build_model,
    build_proposals,
    simulate,
    ("apg", "mlp"),
    ("T", "H", "W"),
    reconstruct=reconstruct,
    sample_data=sample_data,
    draw=draw,
    animate=animate,
)
