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

import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributions import Normal

from apg.blocks import Factorized, Latents, Model, Proposals, TaskSpec

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


def frame_log_likelihood(x: Tensor, templates: Tensor, where: Tensor, cfg: BMNISTConfig) -> Tensor:
    """``sum_{t in chunk} log p(x_t | z_what, z_where_t)`` for a chunk of frames, ``(L, B)``.

    ``x (B, F, H, H)``, ``templates (L, B, D, S, S)``, ``where (L, B, F, D, 2)``.
    With ``p = clamp(canvas, eps, 1 - eps)`` and ``f(p) = x log p + (1 - x) log(1 - p)``,
    every pixel no digit touches has ``p = eps``; so the sum over the frame is the data
    constant ``sum f(eps)`` plus ``f(p) - f(eps)`` over the union of the digits' patches,
    where a pixel covered by m patches is counted m times with weight 1/m. This costs
    O(D S^2) per frame and particle instead of O(H^2), forward and backward.
    """
    num_particles, batch, frames_n, digits = where.shape[:4]
    size = cfg.canvas_size
    n = size * size
    eps = cfg.prob_eps
    offset = pixel_offsets(where, size, cfg.digit_size)
    index, valid, patch = place(templates.unsqueeze(2), offset, size)  # (L, B, F, D, P)
    m = _cover_count(offset, cfg.digit_size + 1)
    flat_x = F.pad(x.flatten(-2), (0, 1))  # (B, F, n + 1), the dump slot holds 0
    xv = flat_x.unsqueeze(0).expand(num_particles, -1, -1, -1).gather(-1, index.flatten(-2)).reshape(index.shape)
    log_eps, log1m_eps = math.log(eps), math.log1p(-eps)
    share = valid.to(patch.dtype) / m  # a pixel covered by m patches counts 1/m in each
    local = _PatchBernoulli.apply(patch, index, xv * share, (1.0 - xv) * share, eps, n)
    local = local - (share * (xv * log_eps + (1.0 - xv) * log1m_eps)).sum((-3, -2, -1))
    background = (x * log_eps + (1.0 - x) * log1m_eps).flatten(1).sum(-1)  # (B,)
    return local + background


class _PatchBernoulli(torch.autograd.Function):
    """``sum_{F, D, P} a log p + b log(1 - p)``, reduced to ``(L, B)``, where ``p`` is the
    canvas (sum of all patches, clamped to [eps, 1 - eps]) read back at each patch pixel.

    ``patch``, ``index``, ``a``, ``b``: ``(L, B, F, D, P)``; ``index`` points into a flat
    canvas of ``n + 1`` pixels per frame (slot n collects off-canvas pixels, where
    ``a = b = 0``). The map patch -> canvas -> read-back is ``G = S^T S`` with S the
    scatter, so the gradient is ``G(dL/dp)``, computed here in the forward pass. Only
    that one tensor is kept for the backward pass: autograd would keep the canvas (the
    read-back saves it), the int64 indices and several intermediates of every block's
    likelihood until the theta loss (which spans all K sweeps) is differentiated.
    """

    @staticmethod
    def forward(ctx, patch: Tensor, index: Tensor, a: Tensor, b: Tensor, eps: float, n: int) -> Tensor:
        shape = patch.shape
        flat_index = index.reshape(-1, shape[-2] * shape[-1])
        rows = flat_index.shape[0]

        def scatter_gather(v: Tensor) -> Tensor:
            canvas = v.new_zeros(rows, n + 1).scatter_add_(1, flat_index, v.reshape(rows, -1))
            return canvas.gather(1, flat_index).reshape(shape)

        p = scatter_gather(patch)
        q = p.clamp(eps, 1.0 - eps)
        out = (a * torch.log(q) + b * torch.log1p(-q)).sum((-3, -2, -1))
        if ctx.needs_input_grad[0]:
            inside = (p > eps) & (p < 1.0 - eps)
            ctx.save_for_backward(scatter_gather(torch.where(inside, a / q - b / (1.0 - q), 0.0)))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (dpatch,) = ctx.saved_tensors
        return dpatch * grad[:, :, None, None, None], None, None, None, None, None


def _cover_count(offset: Tensor, patch_size: int) -> Tensor:
    """How many of the D patches cover each pixel of each patch, ``(..., D, P)``.

    Patches are axis-aligned squares at integer corners, so digit e covers pixel (r, c)
    of digit d's patch iff it covers its row and its column: a separable count.
    """
    base = torch.floor(offset.detach())  # (..., D, 2)
    delta = base.unsqueeze(-2) - base.unsqueeze(-3)  # (..., d, e, 2): corner of d minus corner of e
    ar = torch.arange(patch_size, device=offset.device, dtype=offset.dtype)
    pos = delta.unsqueeze(-1) + ar  # (..., d, e, 2, p): pixel of d's patch in e's frame
    inside = ((pos >= 0) & (pos < patch_size)).to(offset.dtype)
    count = torch.einsum("...der,...dec->...drc", inside[..., 1, :], inside[..., 0, :])
    return count.flatten(-2)


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
        return torch.sigmoid(self.net(z_what)).unflatten(-1, (self.digit_size, self.digit_size))


class BouncingMNIST(Model):
    """``p_theta(x, z_what, z_where_{1:T})`` of the module docstring; theta = the decoder."""

    blocks: dict[str, tuple[str, ...]] = {"what": ("z_what",)}  # where_1..where_T: see blocks_for

    def __init__(self, cfg: BMNISTConfig = BMNISTConfig()):
        super().__init__()
        self.cfg = cfg
        self.decoder = Decoder(cfg.z_what_dim, cfg.digit_size)
        self._memo: tuple[Any, ...] | None = None

    def blocks_for(self, x: Tensor) -> dict[str, tuple[str, ...]]:
        """``what``, then ``where_1 .. where_T`` for videos ``x (B, T, H, H)``."""
        _check_video(x, self.cfg)
        return {"what": ("z_what",), **{f"where_{t}": (where_key(t),) for t in range(1, x.shape[1] + 1)}}

    def templates(self, z_what: Tensor) -> Tensor:
        """Decoded digits ``(L, B, D, S, S)``.

        Within one block update the sampler scores the same ``z_what`` tensor several
        times (proposal, old and new blanket); the last result is remembered by the
        tensor's identity and version (and the decoder's parameter versions, which an
        optimizer step bumps) so the decoder runs once per block.
        """
        key = (z_what._version, torch.is_grad_enabled(), self.training,
               tuple(p._version for p in self.decoder.parameters()))
        if self._memo is not None and self._memo[0]() is z_what and self._memo[1] == key:
            return self._memo[2]
        out = self.decoder(z_what)
        self._memo = (weakref.ref(z_what), key, out)
        return out

    def log_prior_what(self, z_what: Tensor) -> Tensor:
        return _std_normal_log_prob(z_what).sum((-2, -1))

    def log_transition(self, prev: Tensor | None, where: Tensor) -> Tensor:
        """``log p(z_where_t | z_where_{t-1})`` (``prev=None``: the N(0, I) initial state), ``(L, B)``."""
        if prev is None:
            return _std_normal_log_prob(where).sum((-2, -1))
        s = self.cfg.sigma0
        return (_std_normal_log_prob((where - prev) / s) - math.log(s)).sum((-2, -1))

    def log_likelihood(self, x: Tensor, templates: Tensor, z: Mapping[str, Tensor], start: int, stop: int) -> Tensor:
        """``sum_{t=start}^{stop} log p(x_t | ...)``, ``(L, B)``, in chunks of frames."""
        total: Tensor | None = None
        for lo in range(start, stop + 1, FRAME_CHUNK):
            hi = min(stop, lo + FRAME_CHUNK - 1)
            part = frame_log_likelihood(x[:, lo - 1 : hi], templates, stack_where(z, hi - lo + 1, lo), self.cfg)
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
        ``where_t`` frame t and the transitions into and out of t (cost independent of T)."""
        num_frames = _check_video(x, self.cfg)
        templates = self.templates(z["z_what"])
        if block == "what":
            return self.log_prior_what(z["z_what"]) + self.log_likelihood(x, templates, z, 1, num_frames)
        t = _frame_of(block)
        if t > num_frames:
            raise ValueError(f"block {block!r} does not exist in a video of {num_frames} frames")
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
    ``z_where (M, T, D, 2)``, the digits' MNIST ``labels (M, D)`` and ``indices (M, D)``.
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
    return {"x": x, "z_where": where.to(dtype), "labels": labels, "indices": indices}


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


class WhereNet(nn.Module):
    """q(z_where_{d,t} | correlation map): softmax over the map, 4761 -> 400 tanh, then
    mean (200 tanh -> 2, tanh) and scale (200 tanh -> 2, softplus) heads (Appendix E)."""

    def __init__(self, map_size: int, hidden: int = 400, head: int = 200):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(map_size, hidden), nn.Tanh())
        self.loc = nn.Sequential(nn.Linear(hidden, head), nn.Tanh(), nn.Linear(head, 2), nn.Tanh())
        self.scale = nn.Sequential(nn.Linear(hidden, head), nn.Tanh(), nn.Linear(head, 2))

    def forward(self, corr: Tensor) -> Normal:
        h = self.body(_softmax_no_denormals(corr.flatten(-2)))
        return Normal(self.loc(h), F.softplus(self.scale(h)) + 1e-3, validate_args=False)


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
        return Normal(self.loc(mean_feature), F.softplus(self.scale(mean_feature)) + 1e-3, validate_args=False)


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
    """

    def __init__(self, model: BouncingMNIST, architecture: str = "apg", num_digits: int = 3):
        super().__init__()
        if architecture not in ("apg", "mlp"):
            raise ValueError(f"unknown Bouncing MNIST architecture {architecture!r}; choose apg or mlp")
        self.model = [model]  # a plain list: the decoder is theta's, not a submodule of phi
        self.architecture = architecture
        self.num_digits = num_digits
        cfg = model.cfg
        side = cfg.canvas_size - cfg.digit_size + 1
        self.where_net = WhereNet(side * side)
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
            part = self.what_net.features(patches.flatten(-2)).sum(2)
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
                q = self.where_net(corr)
                shape = (num_particles, *q.loc.shape[1:])
                q = Normal(q.loc.expand(shape), q.scale.expand(shape), validate_args=False)
                where = q.sample()  # (L, B, F, 2)
                log_q = log_q + q.log_prob(where).sum((-2, -1))
                digits.append(where)
                # A placed digit's correlation with the template is A shifted to its offset.
                offset = pixel_offsets(where, cfg.canvas_size, cfg.digit_size) - (size - 1)
                corr = corr - render(auto.expand(*where.shape[:-1], 1, *auto.shape), offset.unsqueeze(-2), side)
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
            q = self._what(x, stack_where(z, x.shape[1]))
            return Factorized({"z_what": (q, 2)})
        t = _frame_of(block)
        # Templates are detached: eq. 5 trains phi only, the decoder belongs to theta.
        templates = self.model[0].templates(z["z_what"]).detach()
        q = self.where_net(correlate(x[:, t - 1], templates))
        return Factorized({where_key(t): (q, 2)})


# --------------------------------------------------------------------------- task spec


def build_model(**hparams) -> BouncingMNIST:
    return BouncingMNIST(BMNISTConfig(**hparams))


def build_proposals(model: BouncingMNIST, architecture: str, num_digits: int = 3) -> BMNISTProposals:
    return BMNISTProposals(model, architecture, num_digits)


def reconstruct(model: BouncingMNIST, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
    """Reconstructions ``(L, B, T, H, H)`` of videos ``x (B, T, H, H)``."""
    return model.reconstruct(z, _check_video(x, model.cfg))


_COLORS = np.array([[230, 25, 75], [60, 180, 75], [0, 130, 200], [245, 130, 48], [145, 30, 180],
                    [70, 240, 240], [240, 50, 230], [210, 245, 60]], dtype=np.uint8)


def _boxes(z: Mapping[str, Any], num_frames: int, cfg: BMNISTConfig = BMNISTConfig()) -> np.ndarray:
    """Top-left pixel corners ``(T, D, 2)`` (column, row) of the inferred digits."""
    where = np.stack([np.asarray(z[where_key(t)]) for t in range(1, num_frames + 1)])
    return (where + 1.0) * 0.5 * (cfg.canvas_size - cfg.digit_size)


def draw(ax, x, z, max_frames: int = 10) -> None:
    """A strip of the first ``max_frames`` frames with the inferred digit boxes (Figure 3).

    ``x (T, H, H)`` numpy; ``z`` numpy dict without particle or batch dims."""
    from matplotlib.patches import Rectangle

    x = np.asarray(x)
    frames = min(max_frames, x.shape[0])
    side = x.shape[-1]
    corners = _boxes(z, frames)
    ax.imshow(np.concatenate(list(x[:frames]), axis=1), cmap="gray", vmin=0, vmax=1)
    for t in range(frames):
        for d, (cx, cy) in enumerate(corners[t]):
            ax.add_patch(Rectangle((t * side + cx - 0.5, cy - 0.5), DIGIT, DIGIT, fill=False, lw=1,
                                   edgecolor=_COLORS[d % len(_COLORS)] / 255.0))
    ax.set_axis_off()


@torch.no_grad()
def animate(model: BouncingMNIST, x: Tensor, z: Mapping[str, Tensor]) -> np.ndarray:
    """Frames ``(T, H, 2H + 4, 3)`` uint8: the video | its reconstruction, with boxes.

    ``x (T, H, H)`` and ``z`` without particle or batch dims (torch)."""
    num_frames, side = x.shape[0], x.shape[-1]
    zb = {k: v[None, None] for k, v in z.items()}
    recon = model.reconstruct(zb, num_frames)[0, 0]
    corners = np.round(_boxes({k: v.cpu().numpy() for k, v in z.items()}, num_frames, model.cfg)).astype(int)
    gap = np.full((num_frames, side, 4, 3), 255, np.uint8)
    panels = []
    for img in (x, recon):
        rgb = np.repeat((img.clamp(0, 1).cpu().numpy() * 255).astype(np.uint8)[..., None], 3, -1)
        for t in range(num_frames):
            for d, (cx, cy) in enumerate(corners[t]):
                _box(rgb[t], cx, cy, DIGIT, _COLORS[d % len(_COLORS)])
        panels.append(rgb)
    return np.concatenate([panels[0], gap, panels[1]], axis=2)


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
    "bmnist", build_model, build_proposals, simulate, ("apg", "mlp"),
    reconstruct=reconstruct, draw=draw, animate=animate,
)
