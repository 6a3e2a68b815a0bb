"""The rings' inference networks.

Proposals (``DGMMProposals``), with neural sufficient statistics (section 3, eq. 10):

- ``q(mu | x)`` (encoder) and ``q(mu | x, c, alpha)`` (APG kernel) are diagonal
  Gaussians of conjugate form. Each point contributes a learned location
  statistic ``s_n`` (2) and a learned precision ``lambda_n`` (2), pooled per cluster over
  the points assigned to it (soft assignments ``gamma_n`` in the encoder, the one-hot
  ``c_n`` in the kernel):

      prec_i = 1 / sigma0^2 + sum_n gamma_ni lambda_n,
      mean_i = sum_n gamma_ni lambda_n s_n / prec_i.

  The proposal therefore sharpens as a cluster collects points, for any N. With
  ``s_n = x_n - g_theta(alpha_n)`` and ``lambda_n = 1 / sigma_eps^2`` it *is* the exact
  conditional, which the kernel can represent (``s_n = x_n - h(alpha_n)``).
- ``q(c, alpha | x, mu) = prod_n q(c_n | x_n, mu) q(alpha_n | c_n, x_n, mu)``: per point
  and cluster, features of ``d_ni = x_n - mu_i`` give the assignment logit and the von
  Mises parameters of the angle under that cluster (``LocalProposal``).

Architectures: ``apg`` (MLP encoder plus both kernels), ``mlp`` and ``lstm`` (RWS
encoders with the same NSS parameterization whose point features come from an MLP or an
LSTM over the points; no kernels).

Legend: L particles, B datasets, N points, I clusters, H hidden units, F features.
Latents: ``mu (L, B, I, 2)``, ``c (L, B, N)`` (long), ``alpha (L, B, N)`` in [0, 2 pi).
Data ``x``: ``(B, N, 2)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from apg.blocks import Latents, Proposals
from apg.distributions import softmax_short
from apg.kernels import call
from apg.kernels.ops import KernelOp
from apg.nn import PointFeatures, pairwise_tanh_linear, pairwise_tanh_linear_op, tanh_mlp
from apg.tasks.dgmm.distributions import (
    LocalProposal,
    gaussian_mu,
    pool_assigned,
    pool_per_cluster,
)
from apg.tasks.dgmm.model import DATA_DIM, DGMM, DGMMConfig


class CentreEncoder(nn.Module):
    """``q(mu | x)``: per-point features give soft assignments ``gamma_n`` (softmax over I),
    a location statistic ``s_n = x_n + offset_n`` and a precision ``lambda_n``, pooled per
    cluster by ``pool_per_cluster`` (Appendix E's encoder with a conjugate-form head)."""

    def __init__(self, cfg: DGMMConfig, features: str, hidden: int):
        super().__init__()
        self.cfg = cfg
        self.features = PointFeatures(features, DATA_DIM, hidden)
        self.resp = nn.Linear(hidden, cfg.num_clusters)
        self.stat = nn.Linear(hidden, 2 * DATA_DIM)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.features(x / self.cfg.sigma0)  # O(1) inputs for the tanh units
        offset, raw = self.stat(h).chunk(2, -1)
        gamma = softmax_short(self.resp(h))
        return pool_per_cluster(gamma, x + offset, torch.exp(raw), self.cfg.sigma0**-2)


class CentreKernel(nn.Module):
    """``q(mu | x, c, alpha)``: each point's statistic ``s_n = x_n - h(alpha_n)`` and
    precision ``lambda_n(alpha_n)`` pooled over the points assigned to each cluster. The
    precision starts at ``1 / sigma_eps^2``, the exact conditional's, so training starts
    from sensible scales instead of crawling to them.

    ``h`` and ``log lambda`` come from one tanh layer of the angle's ``(cos, sin)``: the
    same class of function as ``g_theta`` (``DGMM.g``), which is all the exact conditional
    needs (its statistic is ``x_n - g_theta(alpha_n)``). A second 32 x 32 layer made this
    kernel most of a training step's arithmetic: it runs on every point of every particle.
    """

    def __init__(self, cfg: DGMMConfig, hidden: int):
        super().__init__()
        self.cfg = cfg
        self.hidden = nn.Linear(2, hidden)
        self.out = nn.Linear(hidden, 2 * DATA_DIM)
        with torch.no_grad():
            self.out.bias[DATA_DIM:] = -2.0 * math.log(cfg.noise)

    def forward(self, x: Tensor, c: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
        h = self.hidden
        per_point = tanh_mlp(alpha, h.weight, h.bias, self.out.weight, self.out.bias, angles=True)
        return pool_assigned(per_point, x, c, self.cfg.num_clusters, self.cfg.sigma0**-2)


class LocalNet(nn.Module):
    """Per point and cluster, from ``d = x_n - mu_i``: the assignment logit and the von Mises
    parameters of the angle under that cluster (Appendix E: FC 32 tanh on ``x_n - mu_i``).

    Two paths reach the four outputs (logit, direction (2), raw concentration):

    - a tanh layer on ``d / sigma0``. Its first layer is linear in ``d = x_n - mu_i``, so
      it is split into a per-point and a per-cluster part that broadcast against each
      other (``apg.nn.pairwise_tanh_linear``, fused with the output layer);
    - a linear skip from ``(|d|^2 / 2 sigma^2, |d| / sigma^2, log |d|, d / |d|)``. For a
      circular ring of radius r the exact conditional is *linear* in these (logit =
      -(|d| - r)^2 / 2 sigma^2 - log |d| / 2 + const, concentration = r |d| / sigma^2,
      direction = a rotation of d / |d|), so the tanh layer only has to learn how the
      shape departs from a circle. The skip starts at the exact conditional of the
      untrained model, whose g_theta is near 0 (logit = -|d|^2 / 2 sigma^2, other weights
      0): Adam moves a weight by about lr per step, so starting a weight of size 1 at 0
      would cost ~1/lr steps before assignments become sensible.
    """

    def __init__(self, cfg: DGMMConfig, hidden: int):
        super().__init__()
        self.cfg = cfg
        self.point = nn.Linear(DATA_DIM, hidden)
        self.cluster = nn.Linear(DATA_DIM, hidden, bias=False)
        self.out = nn.Linear(hidden, 4)
        self.skip = nn.Linear(5, 4, bias=False)
        with torch.no_grad():
            self.skip.weight.zero_()
            self.skip.weight[0, 0] = -1.0

    def forward(self, x: Tensor, mu: Tensor) -> LocalProposal:
        s0, s = self.cfg.sigma0, self.cfg.noise
        # The split first layer: point(x) - cluster(mu), broadcast over (point, cluster) pairs.
        point, cluster = self.point(x / s0), -self.cluster(mu / s0)
        weights = (self.out.weight, self.out.bias, self.skip.weight)
        return LocalProposal.from_params(local_net_op(x, mu, point, cluster, *weights, s))


def _skip_inputs(x: Tensor, mu: Tensor, s: float) -> Tensor:
    d = x.unsqueeze(-2) - mu.unsqueeze(-3)  # (L, B, N, I, 2)
    sq = (d**2).sum(-1, keepdim=True)
    norm = sq.clamp_min(1e-12).sqrt()
    return torch.cat([sq / (2 * s**2), norm / s**2, torch.log(norm), d / norm], -1)


def _local_net_twin(
    x: Tensor,
    mu: Tensor,
    point: Tensor,
    cluster: Tensor,
    w_out: Tensor,
    b_out: Tensor,
    w_skip: Tensor,
    s: float,
) -> Tensor:
    hidden_out = pairwise_tanh_linear(point, cluster, w_out.T)
    return hidden_out + b_out + torch.nn.functional.linear(_skip_inputs(x, mu, s), w_skip)  # (L, B, N, I, 4)


def _local_net_args(x, mu, point, cluster, w_out, b_out, w_skip, s):
    consts = x.new_tensor([0.5 / s**2, 1.0 / s**2])
    args = [t.contiguous() for t in (x, mu, point, cluster, w_out, b_out, w_skip, consts)]
    (num_particles, batch, clusters, width), num_points = cluster.shape, x.shape[1]
    return args, (num_particles, batch, num_points, clusters, width)


def _local_net_native(
    fn,
    x: Tensor,
    mu: Tensor,
    point: Tensor,
    cluster: Tensor,
    w_out: Tensor,
    b_out: Tensor,
    w_skip: Tensor,
    s: float,
) -> Tensor:
    """One compiled pass (``rings.c``: ``local_forward``), without the (L, B, N, I, H) hidden
    tensor or the skip features."""
    args, sizes = _local_net_args(x, mu, point, cluster, w_out, b_out, w_skip, s)
    out = x.new_empty(*sizes[:4], w_out.shape[0])
    call(fn, *args, out, *sizes)
    return out


def _local_net_backward_twin(
    x: Tensor,
    mu: Tensor,
    point: Tensor,
    cluster: Tensor,
    w_out: Tensor,
    b_out: Tensor,
    w_skip: Tensor,
    grad: Tensor,
    s: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grad_point, grad_cluster, grad_w_t = pairwise_tanh_linear_op.backward.twin(  # type: ignore[union-attr]
        point, cluster, w_out.T, grad
    )
    flat = grad.reshape(-1, grad.shape[-1])
    grad_w_skip = flat.T @ _skip_inputs(x, mu, s).reshape(-1, w_skip.shape[1])
    return grad_point, grad_cluster, grad_w_t.T.contiguous(), flat.sum(0), grad_w_skip


def _local_net_backward_native(
    fn,
    x: Tensor,
    mu: Tensor,
    point: Tensor,
    cluster: Tensor,
    w_out: Tensor,
    b_out: Tensor,
    w_skip: Tensor,
    grad: Tensor,
    s: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Recomputes the hidden layer and the skip features (``rings.c``: ``local_backward``)."""
    (x, mu, point, cluster, w_out, b_out, w_skip, consts), sizes = _local_net_args(
        x, mu, point, cluster, w_out, b_out, w_skip, s
    )
    grads = [torch.zeros_like(t) for t in (point, cluster, w_out, b_out, w_skip)]
    call(fn, x, mu, point, cluster, w_out, consts, grad, *grads, *sizes)
    return tuple(grads)  # type: ignore[return-value]


def _local_net_applies(x: Tensor, mu: Tensor, *_: object) -> bool:
    return x.dim() == 3 and mu.dim() == 4 and not (x.requires_grad or mu.requires_grad)


def _local_net_save(ctx, inputs: tuple, output) -> None:
    ctx.save_for_backward(*inputs[:7])
    ctx.noise = inputs[7]


# ``LocalNet``'s outputs ``(L, B, N, I, 4)`` from the data, the centres, the first layer's two
# parts, the output and skip layers and the noise scale ``s``; differentiable in the parts
# and the weights (``x`` and ``mu`` take no gradient: where they want one, the twin runs).
local_net_op = KernelOp(
    "local_net",
    _local_net_twin,
    kernel="local_forward",
    native=_local_net_native,
    applies=_local_net_applies,
    fake=lambda x, mu, point, cluster, w_out, *_: x.new_empty(
        *cluster.shape[:2], x.shape[1], cluster.shape[2], w_out.shape[0]
    ),
    backward=KernelOp(
        "local_net_backward",
        _local_net_backward_twin,
        kernel="local_backward",
        native=_local_net_backward_native,
        applies=_local_net_applies,
        checked=lambda x, *_: (x,),
        fake=lambda x, mu, point, cluster, w_out, b_out, w_skip, *_: tuple(
            t.new_empty(t.shape) for t in (point, cluster, w_out, b_out, w_skip)
        ),
    ),
    setup_context=_local_net_save,
    gradients=lambda ctx, grads, run, wants: (
        None,
        None,
        *run(*ctx.saved_tensors, grads[0], ctx.noise),
        None,
    ),
)


class DGMMProposals(Proposals):
    """Inference networks for one architecture.

    ``apg``: MLP NSS encoder q(mu | x), NSS kernel q(mu | x, c, alpha) and the local kernel
    q(c, alpha | x, mu). ``mlp`` / ``lstm``: RWS encoders q(mu | x) whose NSS point features
    come from an MLP or an LSTM, followed by the same local proposal; no kernels.
    """

    def __init__(self, cfg: DGMMConfig, architecture: str = "apg", hidden: int = 32):
        super().__init__()
        features = {"apg": "mlp", "mlp": "mlp", "lstm": "lstm"}.get(architecture)
        if features is None:
            raise ValueError(f"unknown DGMM architecture {architecture!r}; choose apg, mlp or lstm")
        self.cfg = cfg
        self.architecture = architecture
        self.encoder = CentreEncoder(cfg, features, hidden)
        self.local = LocalNet(cfg, hidden)
        if architecture == "apg":
            self.centre_kernel = CentreKernel(cfg, hidden)

    def initial(self, x: Tensor, num_particles: int) -> tuple[Latents, Tensor]:
        mean, prec = self.encoder(x)
        shape = (num_particles, *mean.shape)
        q_mu = gaussian_mu(mean.expand(shape), prec.expand(shape))
        mu = q_mu.sample()
        q_local = self.local(x, mu["mu"])
        local = q_local.sample()
        return {**mu, **local}, q_mu.log_prob(mu) + q_local.log_prob(local)

    def kernel(self, block: str, x: Tensor, z: Mapping[str, Tensor]):
        if block == "local":
            return self.local(x, z["mu"])
        if block == "mu" and self.architecture == "apg":
            return gaussian_mu(*self.centre_kernel(x, z["c"], z["alpha"]))
        return super().kernel(block, x, z)


def build_proposals(model: DGMM, architecture: str, hidden: int = 32) -> DGMMProposals:
    return DGMMProposals(model.cfg, architecture, hidden)
