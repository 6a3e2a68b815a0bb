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

Legend: L particles, B videos, T frames, F a subset (chunk) of frames, D digits,
H canvas side (96), S digit side (28), P = (S + 1)^2 patch pixels, Z = 10 (z_what dim).
Latents: ``z_what (L, B, D, Z)``, ``z_where_t (L, B, D, 2)`` for t = 1..T.
Data ``x``: ``(B, T, H, H)`` in [0, 1].
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from apg.blocks import BlockWindow, Model
from apg.host import values_on_host
from apg.tasks.bmnist.config import DIGIT, FRAME_CHUNK, BMNISTConfig, _frame_of, stack_where, where_key
from apg.tasks.bmnist.likelihood import _distinct_particles, frame_log_likelihood, pixel_offsets, render


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

    def __getstate__(self) -> dict[str, Any]:
        # The memo is a cache of the last decode (a weak reference, autograd outputs): a
        # pickled model (MLflow's format) leaves it behind; weak references do not pickle.
        return {**super().__getstate__(), "_memo": None}

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
        key = (torch.is_grad_enabled(), self.training, weights_key(self.decoder))
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


def weights_key(module: nn.Module) -> tuple[tuple[int, int], ...]:
    """Each parameter's storage and version: equal only while no weight has changed (an
    optimizer step or a loaded state bumps the versions; a copied module has new storage)."""
    return tuple((p.data_ptr(), p._version) for p in module.parameters())


def _copy_ancestors(z: Tensor, source: Tensor) -> Tensor | None:
    """``a (L, B)`` such that particle l of video b of ``z (L, B, ...)`` is an exact copy of
    particle ``a[l, b]`` of ``source (L', B, ...)``, when every particle is one; else ``None``
    (and on a device, where computing again costs less than the host read this needs)."""
    if z.shape[1:] != source.shape[1:] or z.dtype != source.dtype or z.device != source.device:
        return None
    if not values_on_host(z):
        return None
    same = (z.unsqueeze(1) == source.unsqueeze(0)).flatten(3).all(-1)  # (L, L', B)
    if not bool(same.any(1).all()):
        return None
    return same.to(torch.uint8).argmax(1)


def _gather_copies(z: Tensor, source: Tensor, source_out: Tensor) -> Tensor | None:
    """``source_out`` reindexed to ``z``'s particles (``source_out[a(l, b), b]``, ``a`` from
    :func:`_copy_ancestors`); ``None`` where ``z`` is not all copies of ``source``."""
    ancestor = _copy_ancestors(z, source)
    if ancestor is None:
        return None
    return source_out[ancestor, torch.arange(z.shape[1], device=z.device)]


def build_model(**hparams) -> BouncingMNIST:
    return BouncingMNIST(BMNISTConfig(**hparams))


def reconstruct(model: BouncingMNIST, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
    """Reconstructions ``(L, B, T, H, H)`` of videos ``x (B, T, H, H)``."""
    return model.reconstruct(z, _check_video(x, model.cfg))


def sample_data(model: BouncingMNIST, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
    """``TaskSpec.sample_data``: each pixel ~ Bernoulli(its canvas mean, clamped to
    ``[eps, 1 - eps]``: the likelihood of ``frame_log_likelihood``), ``(L, B, T, H, H)`` of
    zeros and ones."""
    eps = model.cfg.prob_eps
    return torch.bernoulli(reconstruct(model, x, z).clamp(eps, 1.0 - eps))
