"""Bouncing MNIST's proposal kernels and blankets: resampled copies read once, explaining away,
the fused where network, the incremental weights, and each block's cost in T."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from apg.tasks import bmnist
from apg.tasks.bmnist import (
    BMNISTConfig,
    BouncingMNIST,
    correlate,
    pixel_offsets,
    render,
    where_key,
)
from tests.apg.tasks.bmnist_support import random_latents


def _with_copies(z: dict, L: int, B: int) -> dict:
    """Particles resampled with repeats (as the sampler's resampling leaves them)."""
    ancestors = torch.randint(0, L, (L, B))
    ancestors[:, 0] = 1  # video 0: all copies of one particle
    return {k: v[ancestors, torch.arange(B)] for k, v in z.items()}


def test_blanket_of_copies_equals_per_particle(f64):
    """Computing the blanket once per distinct particle changes neither values nor theta's gradient."""
    L, B, T, D = 4, 3, 3, 2
    model = BouncingMNIST(BMNISTConfig(canvas_size=48))
    x = torch.rand(B, T, 48, 48) * (torch.rand(B, T, 48, 48) < 0.2)
    z = _with_copies(random_latents(L, B, T, D), L, B)
    assert bmnist.likelihood._distinct_particles([z["z_what"]]) is not None
    for block in ("what", "where_1", "where_2"):
        got = model.log_blanket(block, x, z)
        model._memo = None  # decode afresh: the per-particle reference shares nothing
        want = model._log_blanket(block, x, z, T)
        assert torch.allclose(got, want, atol=1e-9), block
        weights = torch.rand(L, B)
        g_got = torch.autograd.grad((weights * got).sum(), list(model.parameters()))
        g_want = torch.autograd.grad((weights * want).sum(), list(model.parameters()))
        model._memo = None
        for a, b in zip(g_got, g_want, strict=True):
            assert torch.allclose(a, b, atol=1e-9), block


def test_templates_of_resampled_codes_reuse_the_decoder(f64):
    L, B, D = 4, 3, 2
    model = BouncingMNIST()
    calls = []
    model.decoder.register_forward_hook(lambda *args: calls.append(1))
    z_what = torch.randn(L, B, D, 10)
    first = model.templates(z_what)
    copies = _with_copies({"z_what": z_what}, L, B)["z_what"]
    again = model.templates(copies)
    assert len(calls) == 1
    assert torch.equal(again, model.decoder(copies))
    assert first.grad_fn is not None and again.grad_fn is not None
    model.templates(torch.randn(L, B, D, 10))  # fresh codes: decoded
    assert len(calls) == 3


def _where_kernel_of_copies(L: int, B: int, T: int, D: int):
    """A fresh model and proposals, random videos, random latents with copies, and the
    where kernel of frame 2."""
    model = BouncingMNIST()
    prop = bmnist.BMNISTProposals(model, "apg", D)
    x = torch.rand(B, T, 96, 96)
    z = _with_copies(random_latents(L, B, T, D), L, B)
    return model, prop, x, z, prop.kernel("where_2", x, z)


def test_where_kernel_explains_away_the_digits_before(f64):
    """Digit d's map is the frame minus the digits before it, placed at the positions being
    proposed or scored: checked against rendering those digits into the frame and
    correlating, particle by particle (copies included); propose's scores are log_prob's."""
    L, B, T, D = 4, 2, 2, 3
    model, prop, x, z, kernel = _where_kernel_of_copies(L, B, T, D)
    templates = model.decoder(z["z_what"]).detach()  # (L, B, D, S, S)
    value = z[where_key(2)]
    want = torch.zeros(L, B)
    for l in range(L):
        for b in range(B):
            frame = x[b, 1].clone()
            for d in range(D):
                corr = F.conv2d(frame[None, None], templates[l, b, d][None, None])[0, 0]
                q = prop.where_net(corr)
                want[l, b] += q.log_prob(value[l, b, d]).sum()
                offset = bmnist.pixel_offsets(value[l, b, d])
                frame = frame - bmnist.render(templates[l, b, d][None], offset[None], 96)
    got = kernel.log_prob({where_key(2): value})
    assert torch.allclose(got, want, atol=1e-8)
    torch.manual_seed(3)
    new, log_q_new, log_q_old = kernel.propose({where_key(2): value})
    assert new[where_key(2)].shape == (L, B, D, 2) and log_q_new.requires_grad
    assert torch.allclose(log_q_old, want, atol=1e-8)
    assert torch.allclose(log_q_new, kernel.log_prob(new), atol=1e-8)


def test_where_kernel_reads_copies_once_with_the_same_numbers_and_gradients(f64):
    """propose runs digit 0's network and the reverse walk once per distinct particle
    (the forward walk's later digits once per particle); its density and the networks'
    gradient are log_prob's, which scores every particle."""
    L, B, T, D = 4, 2, 2, 3
    model, prop, x, z, kernel = _where_kernel_of_copies(L, B, T, D)
    old = {where_key(2): z[where_key(2)]}
    distinct = int(max(len(set(map(tuple, z["z_what"][:, b].flatten(1).tolist()))) for b in range(B)))
    assert distinct < L
    rows: list[int] = []
    hook = prop.where_net.register_forward_pre_hook(lambda _, args: rows.append(args[0][..., 0, 0].numel()))
    torch.manual_seed(3)
    new, log_q_new, log_q_old = kernel.propose(old)
    hook.remove()
    # digit 0 (both walks), digits 1..D-1 forward (every particle), then reverse (distinct)
    assert rows == [distinct * B] + [L * B] * (D - 1) + [distinct * B] * (D - 1)
    params = list(prop.where_net.parameters())
    got = torch.autograd.grad(log_q_new.sum(), params)
    want_new = kernel.log_prob(new)
    want = torch.autograd.grad(want_new.sum(), params)
    assert torch.allclose(log_q_new, want_new, atol=1e-10)
    assert torch.allclose(log_q_old, kernel.log_prob(old), atol=1e-10)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=1e-10)


def test_where_kernel_of_copies_equals_per_particle(f64):
    L, B, T, D = 4, 3, 2, 1  # one digit: a factorized kernel, one network pass per distinct particle
    model = BouncingMNIST()
    prop = bmnist.BMNISTProposals(model, "apg", D)
    x = torch.rand(B, T, 96, 96)
    z = _with_copies(random_latents(L, B, T, D), L, B)
    got = prop.kernel("where_2", x, z).parts[where_key(2)][0]
    templates = model.decoder(z["z_what"]).detach()
    want = prop.where_net(correlate(x[:, 1], templates))
    assert got.loc.shape == (L, B, D, 2)
    assert torch.allclose(got.loc, want.loc, atol=1e-9)
    assert torch.allclose(got.scale, want.scale, atol=1e-9)


def test_the_encoders_maps_by_fft_on_a_cpu_equal_the_device_paths_convolution(f64, monkeypatch):
    L, B, T, D = 3, 2, 4, 2
    prop = bmnist.BMNISTProposals(BouncingMNIST(), "apg", D)
    x = torch.rand(B, T, 96, 96)

    def initial(on_host: bool):
        monkeypatch.setattr(bmnist.proposals, "values_on_host", lambda t: on_host)
        torch.manual_seed(0)
        return prop.initial(x, L)

    (z_fft, log_q_fft), (z_conv, log_q_conv) = initial(True), initial(False)
    assert z_fft.keys() == z_conv.keys()
    for name in z_fft:
        assert torch.allclose(z_fft[name], z_conv[name], atol=1e-9), name
    assert torch.allclose(log_q_fft, log_q_conv, atol=1e-8)


def test_what_kernel_of_copies_equals_per_particle(f64):
    L, B, T, D = 4, 3, 3, 2
    model = BouncingMNIST()
    prop = bmnist.BMNISTProposals(model, "apg", D)
    x = torch.rand(B, T, 96, 96)
    z = _with_copies(random_latents(L, B, T, D), L, B)
    got = prop.kernel("what", x, z).parts["z_what"][0]
    want = prop._what(x, torch.stack([z[where_key(t)] for t in range(1, T + 1)], 2))
    assert got.loc.shape == (L, B, D, 10)
    assert torch.allclose(got.loc, want.loc, atol=1e-9)
    assert torch.allclose(got.scale, want.scale, atol=1e-9)


def test_where_net_fused_softmax_linear_matches_autograd(f64):
    """The fused softmax + first layer gives autograd's output and parameter gradients;
    gradient entries below the smallest normal float are flushed to zero."""
    net = bmnist.WhereNet(49)
    corr = torch.randn(5, 3, 7, 7) * 20
    weights = torch.rand(5, 3, 2)
    value = torch.randn(5, 3, 2)
    fused = net(corr)
    (fused.log_prob(value) * weights).sum().backward()
    g_fused = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    plain = net(corr.clone().requires_grad_())  # the autograd path
    (plain.log_prob(value) * weights).sum().backward()
    assert torch.allclose(fused.loc, plain.loc) and torch.allclose(fused.scale, plain.scale)
    for a, b in zip(g_fused, [p.grad for p in net.parameters()], strict=True):
        assert torch.allclose(a, b, atol=1e-12)
    tiny = torch.finfo(torch.float64).tiny
    g = torch.tensor([tiny / 4, -tiny / 8, tiny, 1.0])
    assert torch.equal(bmnist.model._flush_denormals(g), torch.tensor([0.0, 0.0, tiny, 1.0]))


def test_explaining_away_is_correlation_of_residual(f64):
    """The encoder's residual map equals the correlation of (frame - placed template)."""
    cfg = BMNISTConfig()
    model = BouncingMNIST(cfg)
    prop = bmnist.BMNISTProposals(model, "apg", 1)
    tmpl = prop.mean_template
    frame = torch.rand(96, 96)
    where = torch.tensor([0.31, -0.47])
    off = pixel_offsets(where)
    placed = render(tmpl[None], off[None], 96)
    want = F.conv2d((frame - placed)[None, None], tmpl[None, None])[0, 0]
    size = tmpl.shape[-1]
    auto = F.conv2d(F.pad(tmpl, (size - 1,) * 4)[None, None], tmpl[None, None])[0, 0]
    corr = F.conv2d(frame[None, None], tmpl[None, None])[0, 0]
    got = corr - render(auto[None], (off - (size - 1))[None], corr.shape[-1])
    assert torch.allclose(got, want, atol=1e-9)


# --------------------------------------------------------------------------- model and blankets


def test_blocks_depend_on_video_length():
    model = BouncingMNIST()
    blocks = model.blocks_for(torch.zeros(1, 4, 96, 96))
    assert list(blocks) == ["what", "where_1", "where_2", "where_3", "where_4"]
    assert blocks["where_3"] == ("z_where_3",)
    with pytest.raises(ValueError, match=r"\(B, T, 96, 96\)"):
        model.blocks_for(torch.zeros(4, 96, 96))
    with pytest.raises(ValueError, match="unknown block"):
        model.log_blanket("where_x", torch.zeros(1, 2, 96, 96), random_latents(1, 1, 2, 1))


def test_incremental_weight_from_blanket_equals_full_joint(f64):
    """For every block, blanket(new) - blanket(old) = log_joint(new) - log_joint(old)."""
    L, B, T, D = 3, 2, 4, 2
    model = BouncingMNIST(BMNISTConfig(canvas_size=48))
    x = torch.rand(B, T, 48, 48) * (torch.rand(B, T, 48, 48) < 0.2)
    z = random_latents(L, B, T, D)
    for block, names in model.blocks_for(x).items():
        new = dict(z)
        for name in names:
            new[name] = random_latents(L, B, T, D)[name]
        local = model.log_blanket(block, x, new) - model.log_blanket(block, x, z)
        full = model.log_joint(x, new) - model.log_joint(x, z)
        assert torch.allclose(local, full, rtol=0, atol=1e-8), block
        assert local.abs().min() > 1e-3  # the test is not vacuous


def test_log_joint_matches_direct_formula(f64):
    L, B, T, D = 2, 1, 3, 2
    cfg = BMNISTConfig(sigma0=0.3)
    model = BouncingMNIST(cfg)
    x = torch.rand(B, T, 96, 96) * (torch.rand(B, T, 96, 96) < 0.2)
    z = random_latents(L, B, T, D)
    where = torch.stack([z[where_key(t)] for t in range(1, T + 1)], 2)
    std = torch.distributions.Normal(0.0, 1.0)
    prior = std.log_prob(z["z_what"]).sum((-2, -1)) + std.log_prob(where[:, :, 0]).sum((-2, -1))
    prior = prior + torch.distributions.Normal(where[:, :, :-1], 0.3).log_prob(where[:, :, 1:]).sum(
        (-3, -2, -1)
    )
    canvas = model.reconstruct(z, T).clamp(cfg.prob_eps, 1 - cfg.prob_eps)
    lik = (x * canvas.log() + (1 - x) * torch.log1p(-canvas)).sum((-3, -2, -1))
    assert torch.allclose(model.log_joint(x, z), prior + lik, atol=1e-8)


class _OpCounter(TorchDispatchMode):
    """Counts aten calls and the elements they output (a proxy for work done)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls[str(func.overloadpacket)] += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.elements += t.numel()
        return out


def _block_cost(block: str, num_frames: int) -> tuple[Counter, int]:
    torch.manual_seed(0)
    model = BouncingMNIST()
    prop = bmnist.BMNISTProposals(model, "apg", 2)
    x = torch.rand(1, num_frames, 96, 96)
    z = random_latents(2, 1, num_frames, 2)
    counter = _OpCounter()
    with counter:  # what one block update of run_apg does
        kernel = prop.kernel(block, x, z)
        new = kernel.sample()
        kernel.log_prob(new)
        kernel.log_prob({k: z[k] for k in new})
        z_new = {**z, **new}
        model.log_blanket(block, x, z_new) - model.log_blanket(block, x, z)
    return counter.calls, counter.elements


def test_where_block_cost_does_not_grow_with_T():
    calls10, elems10 = _block_cost("where_5", 10)
    calls100, elems100 = _block_cost("where_5", 100)
    assert calls10 == calls100
    assert elems10 == elems100
    # the what block touches every frame once: linear, not quadratic
    _, what10 = _block_cost("what", 10)
    _, what100 = _block_cost("what", 100)
    assert 5 < what100 / what10 < 11
