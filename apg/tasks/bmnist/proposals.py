"""Bouncing MNIST's inference networks (Appendix E): the what and where networks, the
where kernel that explains away the digits already placed, and ``BMNISTProposals``.

Legend: L particles, B videos, T frames, F a subset (chunk) of frames, D digits,
H canvas side (96), S digit side (28), P = (S + 1)^2 patch pixels, Z = 10 (z_what dim).
Latents: ``z_what (L, B, D, Z)``, ``z_where_t (L, B, D, 2)`` for t = 1..T.
Data ``x``: ``(B, T, H, H)`` in [0, 1].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.distributions import Normal

from apg.blocks import BlockDistribution, Factorized, Latents, Proposals
from apg.host import values_on_host
from apg.nn import linear
from apg.tasks.bmnist.config import DIGIT, FRAME_CHUNK, BMNISTConfig, _frame_of, stack_where, where_key
from apg.tasks.bmnist.likelihood import (
    _correlate_all,
    _correlate_distinct,
    _distinct_particles,
    _first_copies,
    correlate_spectra,
    crop,
    cross_correlations,
    pixel_offsets,
    render,
)
from apg.tasks.bmnist.model import (
    BouncingMNIST,
    _check_video,
    _copy_ancestors,
    _flush_denormals,
    _FlushDenormalGrad,
    _run,
    weights_key,
)


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
        body, hidden, out = linear(self.body[0]), linear(self.loc[0]), linear(self.loc[2])
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

    ``corr (N, side, side)`` the frame's correlations with each distinct particle's
    templates and ``rows (L, B, D)`` (``_correlate_distinct``: digit d of particle l in
    video b reads map ``corr[rows[l, b, d]]``), ``cross (L, B, D, D, 2S-1, 2S-1)`` from
    ``cross_correlations``.
    """

    def __init__(
        self, net: WhereNet, corr: Tensor, rows: Tensor, cross: Tensor, cfg: BMNISTConfig, name: str
    ):
        self.net, self.corr, self.rows, self.cross, self.cfg, self.name = net, corr, rows, cross, cfg, name

    def _walk(
        self, rows: Tensor, cross: Tensor, value: Tensor | None, first: Normal | None = None
    ) -> tuple[Tensor, Tensor, Normal]:
        """Sample (``value`` None) or score ``value (L', B, D, 2)`` digit by digit, for the
        particles whose ``rows`` and ``cross`` are given; returns ``(where, log_q (L', B),
        q of digit 0)``."""
        digits, side = rows.shape[-1], self.corr.shape[-1]
        shift = self.cfg.digit_size - 1
        placed: list[Tensor] = []
        log_q: Tensor | None = None
        q0 = first
        for d in range(digits):
            if d == 0 and first is not None:
                q = first
            else:
                corr = self.corr[rows[:, :, d]]
                if d:
                    offset = pixel_offsets(torch.stack(placed, 2), self.cfg.canvas_size, self.cfg.digit_size)
                    corr = corr - render(cross[:, :, :d, d], offset - shift, side)
                q = self.net(corr)
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
            return {self.name: self._walk(self.rows, self.cross, None)[0]}

    def log_prob(self, value: Mapping[str, Tensor]) -> Tensor:
        return self._walk(self.rows, self.cross, value[self.name])[1]

    def propose(self, old: Mapping[str, Tensor]) -> tuple[Latents, Tensor, Tensor]:
        """``blocks.propose`` in one forward walk and one reverse walk.

        Resampling leaves copies: particles with the same maps and the same old positions.
        Digit 0's map is the same in both walks and the reverse walk's maps are a function
        of the maps and the old positions, so digit 0's network and the whole reverse walk
        run once per distinct particle; the forward walk's later digits read freshly sampled
        positions, every particle its own.
        """
        old_where = old[self.name]
        pick = _distinct_particles([self.rows.to(old_where.dtype), old_where])
        if pick is None:
            rows, cross, value = self.rows, self.cross, old_where
        else:
            compact, position = pick
            videos = torch.arange(self.rows.shape[1], device=self.rows.device)
            rows, cross, value = (t[compact, videos] for t in (self.rows, self.cross, old_where))
        q0 = self.net(self.corr[rows[:, :, 0]])
        if pick is None:
            first = q0
        else:
            index = position[..., None].expand(-1, -1, q0.loc.shape[-1])
            first = Normal(q0.loc.gather(0, index), q0.scale.gather(0, index), validate_args=False)
        new, log_q_new, _ = self._walk(self.rows, self.cross, None, first)
        with torch.no_grad():
            q0 = Normal(q0.loc.detach(), q0.scale.detach(), validate_args=False)
            log_q_old = self._walk(rows, cross, value, q0)[1]
            if pick is not None:
                log_q_old = log_q_old.gather(0, position)
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

    mean_template: Tensor  # a buffer (register_buffer in __init__)

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
        self._where_memo: tuple[Any, ...] | None = None  # see _where_inputs

    def __getstate__(self) -> dict[str, Any]:
        # the where-inputs memo is a cache of the last sweep's tensors: not part of a pickle
        return {**super().__getstate__(), "_where_memo": None}

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
        if values_on_host(x):  # the FFT: see correlate_spectra
            corr_x = correlate_spectra(torch.fft.rfft2(x), tmpl)
        else:
            corr_x = F.conv2d(x.reshape(batch * num_frames, 1, *x.shape[-2:]), tmpl[None, None])
            corr_x = corr_x.reshape(batch, num_frames, *corr_x.shape[-2:])
        side = corr_x.shape[-1]
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

    def _where_inputs(self, z_what: Tensor) -> tuple[Tensor, Tensor | None]:
        """The where kernels' templates ``(L, B, D, S, S)`` (detached: eq. 5 trains phi only,
        the decoder belongs to theta; subnormal ink, sigmoid(-88) and below, would slow the
        convolutions down) and, for more than one digit, their ``cross_correlations``.

        Between the where blocks of a sweep z_what changes only by the copies and drops
        resampling makes, so both are computed once per fresh set of codes, as
        ``BouncingMNIST.templates`` decodes: a ``z_what`` each of whose particles equals a
        particle of the last computed one, for the same video, gets that particle's templates
        and maps by indexing (the same numbers: each is its particle's own). The key holds
        the decoder's weights (``weights_key``) and its train/eval mode.
        """
        kept = values_on_host(z_what)  # a device or torch.compile: nothing kept (see _copy_ancestors)
        decoder = self.model[0].decoder
        key = (decoder.training, weights_key(decoder)) if kept else None
        if kept and self._where_memo is not None:
            kept_key, source, source_version, kept_templates, kept_cross = self._where_memo
            ancestor = (
                _copy_ancestors(z_what, source)
                if kept_key == key and source._version == source_version
                else None
            )
            if ancestor is not None:
                videos = torch.arange(z_what.shape[1], device=z_what.device)
                cross = None if kept_cross is None else kept_cross[ancestor, videos]
                return kept_templates[ancestor, videos], cross
        templates = _flush_denormals(self.model[0].templates(z_what).detach())
        cross = cross_correlations(templates) if templates.shape[2] > 1 else None
        if kept:
            self._where_memo = (key, z_what, z_what._version, templates, cross)
        return templates, cross

    # -- the Proposals interface

    def initial(self, x: Tensor, num_particles: int) -> tuple[Latents, Tensor]:
        _check_video(x, self.cfg)
        z, log_q = self._initial_where(x, num_particles)
        q_what = self._what(x, stack_where(z, x.shape[1]))
        z_what = q_what.sample()
        z["z_what"] = z_what
        return z, log_q + q_what.log_prob(z_what).sum((-2, -1))

    def kernel(self, block: str, x: Tensor, z: Mapping[str, Tensor]) -> BlockDistribution:
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
        templates, cross = self._where_inputs(z["z_what"])
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
        assert cross is not None
        return ExplainingAwayWhere(self.where_net, corr, rows, cross, self.cfg, where_key(t))


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
