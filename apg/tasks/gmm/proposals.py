"""The GMM's inference networks (section 3, eq. 10; Appendix E): the NSS encoder and
globals kernel q(mu, tau | x[, c]) and the assignment kernel q(c | x, mu, tau).

Legend: L particles, B datasets, N points, I clusters, D data dimensions, H hidden units.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from apg.blocks import Latents, Proposals
from apg.kernels import call, native_function
from apg.nn import PointFeatures, pairwise_tanh_linear, scaled_pairwise_tanh_linear
from apg.tasks.gmm.conjugate import (
    NormalGamma,
    NormalGammaFromSums,
    assignment_posterior,
    normal_gamma_from_sums,
    normal_gamma_posterior,
)
from apg.tasks.gmm.model import GMM, GMMConfig, one_hot_points_last


class GlobalsProposal(nn.Module):
    """Neural sufficient statistics for {mu, tau} (section 3, eq. 10).

    Each point contributes soft assignments ``gamma_n`` (softmax over I) and a learned
    statistic ``t_n`` (D dims); their sums enter the conjugate NormalGamma update in place
    of the counts and sums of the exact conditional. The posterior therefore sharpens as
    a cluster collects points, for any dataset size N.
    """

    def __init__(self, cfg: GMMConfig, in_dim: int, features: str, hidden: int = 32):
        super().__init__()
        self.cfg = cfg
        self.features = PointFeatures(features, in_dim, hidden)
        self.resp = nn.Linear(self.features.out_dim, cfg.num_clusters)
        self.stat = nn.Linear(self.features.out_dim, cfg.data_dim)
        if features == "linear":
            # Start from the conjugate update with uniform assignments and t_n = x_n: a broad
            # proposal around the data (section 3 suggests initializing the statistics so
            # that the first proposals are close to the prior's breadth), rather than one
            # centred wherever a random projection of the data happens to fall.
            nn.init.zeros_(self.resp.weight)
            nn.init.zeros_(self.resp.bias)
            nn.init.zeros_(self.stat.bias)
            with torch.no_grad():
                self.stat.weight.zero_()
                self.stat.weight[:, : cfg.data_dim].copy_(torch.eye(cfg.data_dim))
                if in_dim > cfg.data_dim:
                    # The kernel also reads one-hot assignments: lean (softly) on them, as
                    # the exact update does, so training starts near the conjugate form.
                    self.resp.weight[:, cfg.data_dim :].copy_(2.0 * torch.eye(cfg.num_clusters))

    def heads(self) -> tuple[Tensor, Tensor]:
        """Both heads as one layer: weight ``(I + D, F_in)`` and bias ``(I + D,)``."""
        weight = torch.cat([self.resp.weight, self.stat.weight])
        return weight, torch.cat([self.resp.bias, self.stat.bias])

    def forward(self, u: Tensor) -> NormalGamma | NormalGammaFromSums:
        """The proposal from point inputs ``u (..., N, F_in)`` (for speed, ideally a
        transposed view of a point-axis-last ``(..., F_in, N)`` tensor)."""
        h_t = self.features(u).transpose(-1, -2)  # (..., F, N)
        # Both heads in one product, point axis last: this build multiplies (F, N) blocks
        # several times faster than (N, F) rows of a handful of features, and the softmax
        # over clusters then runs along contiguous rows of N.
        weight, bias = self.heads()
        out = torch.matmul(weight, h_t) + bias.unsqueeze(-1)  # (..., I + D, N)
        num_clusters = self.cfg.num_clusters
        resp_t = torch.softmax(out[..., :num_clusters, :], dim=-2)
        return normal_gamma_posterior(
            self.cfg, resp_t.transpose(-1, -2), out[..., num_clusters:, :].transpose(-1, -2)
        )


C_INPUTS = ("offset", "standardized")


class AssignmentProposal(nn.Module):
    """q(c_n | x_n, mu, tau): an MLP on (x_n - mu_i, log tau_i) gives one logit per cluster.

    ``inputs="standardized"`` gives it (x_n - mu_i) sqrt(tau_i) in place of the offset, the
    point's distance from the centre in the cluster's own units, in which the exact logit,
    sum_d (log tau_id - tau_id (x_nd - mu_id)^2) / 2, is a quadratic of bounded inputs. On
    raw offsets the network must form tau (x - mu)^2 itself, and datasets with a wide cluster
    (small tau, large offsets) fall outside what it learnt, which is where most of its
    inclusive KL of {c} came from (docs/decisions.md, "GMM assignment network reads
    standardized offsets").
    Same layers and width either way (Appendix E's).

    Local neural sufficient statistics (section 3): the logits are the prior's (uniform,
    so a constant) plus ``T(x_n, z_global)``. The inputs are the point's offset from each
    centre and the log precision, on which the exact conditional depends smoothly (log
    because precisions span orders of magnitude). The first layer is split into a per-point
    and a per-cluster part that broadcast against each other, so the (L, B, N, I, H) hidden
    tensor is formed by one addition instead of by expanding and concatenating inputs
    (``apg.nn.pairwise_tanh_linear``, fused with the output layer and a faster backward).
    """

    def __init__(self, cfg: GMMConfig, hidden: int = 32, inputs: str = "offset"):
        super().__init__()
        if inputs not in C_INPUTS:
            raise ValueError(f"unknown assignment-network inputs {inputs!r}; choose {' or '.join(C_INPUTS)}")
        self.inputs = inputs
        self.offset = nn.Linear(cfg.data_dim, hidden)
        self.log_precision = nn.Linear(cfg.data_dim, hidden, bias=False)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: Tensor, mu: Tensor, tau: Tensor) -> Tensor:
        if self.inputs == "standardized":
            return self._standardized(x, mu, tau)
        weights = (
            self.offset.weight,
            self.offset.bias,
            self.log_precision.weight,
            self.out.weight,
            self.out.bias,
        )
        native = _native_assignment(x, mu, tau, *weights)
        if native is not None:
            return _AssignmentLogits.apply(x, mu, tau, *weights, native)
        # W (x_n - mu_i) + V log tau_i + b = (W x_n + b) + (V log tau_i - W mu_i)
        per_point = self.offset(x)  # (B, N, H)
        per_cluster = self.log_precision(torch.log(tau)) - mu @ self.offset.weight.T  # (L, B, I, H)
        logits = pairwise_tanh_linear(per_point, per_cluster, self.out.weight.T) + self.out.bias
        return logits.squeeze(-1)  # (L, B, N, I)

    def _standardized(self, x: Tensor, mu: Tensor, tau: Tensor) -> Tensor:
        # W ((x_n - mu_i) s_i) + V log tau_i + b = (W s_i) x_n + (V log tau_i - W (mu_i s_i) + b),
        # s_i = sqrt(tau_i): a first layer scaled per cluster, plus a per-cluster part.
        s = tau.sqrt()
        scale = s.unsqueeze(-1) * self.offset.weight.T  # (L, B, I, D, H)
        per_cluster = self.log_precision(torch.log(tau)) - (mu * s) @ self.offset.weight.T + self.offset.bias
        return scaled_pairwise_tanh_linear(x, scale, per_cluster, self.out.weight[0]) + self.out.bias


def _native_assignment(x: Tensor, mu: Tensor, tau: Tensor, *weights: Tensor):
    """The compiled assignment network's functions where they apply: data ``(B, N, D)`` and
    latents ``(L, B, I, D)`` without gradients, one output unit."""
    if x.dim() != 3 or mu.dim() != 4 or tau.shape != mu.shape or weights[3].shape[0] != 1:
        return None
    if mu.shape[-1] > 256 or any(t.requires_grad for t in (x, mu, tau)):
        return None
    names = (
        "gmm_assignment_inputs",
        "pairwise_forward",
        "pairwise_backward",
        "gmm_assignment_inputs_backward",
    )
    fns = tuple(native_function(name, x, mu, tau, *weights) for name in names)
    return None if fns[0] is None else fns


class _AssignmentLogits(torch.autograd.Function):
    """``AssignmentProposal``'s logits ``(L, B, N, I)`` compiled: the first layer's two parts
    (``gmm.c``: ``gmm_assignment_inputs``), the fused pairwise tanh layer (``tanh_layers.c``)
    and the output bias, forward and backward, in a handful of ops instead of ~20 and a
    dozen autograd nodes per assignment update. Differentiable in the five weights."""

    @staticmethod
    def forward(ctx, x, mu, tau, w_off, b_off, w_prec, w_out, b_out, fns):
        x, mu, tau = x.contiguous(), mu.contiguous(), tau.contiguous()
        weights = tuple(t.contiguous() for t in (w_off, b_off, w_prec, w_out))
        (num_particles, batch, clusters, dim), num_points, width = mu.shape, x.shape[1], w_off.shape[0]
        point, cluster = (
            x.new_empty(1, batch, num_points, width),
            x.new_empty(num_particles, batch, clusters, width),
        )
        ctx.sizes = (num_particles, batch, num_points, clusters, dim, width)
        call(fns[0], x, mu, tau, *weights[:3], point, cluster, *ctx.sizes)
        logits = x.new_empty(num_particles, batch, num_points, clusters)
        ctx.pair_sizes = (num_particles, 1, batch, num_points, clusters, width, 1)
        call(fns[1], point, cluster, weights[3], logits, *ctx.pair_sizes)
        ctx.save_for_backward(x, mu, tau, point, cluster, weights[3])
        ctx.fns = fns
        return logits.add_(b_out)

    @staticmethod
    def backward(ctx, grad):
        x, mu, tau, point, cluster, w_out = ctx.saved_tensors
        grad = grad.contiguous()
        grad_point, grad_cluster, grad_w_out = (torch.zeros_like(t) for t in (point, cluster, w_out))
        call(ctx.fns[2], point, cluster, w_out, grad, grad_point, grad_cluster, grad_w_out, *ctx.pair_sizes)
        width, dim = point.shape[-1], mu.shape[-1]
        grad_w_off, grad_b_off, grad_w_prec = (
            x.new_zeros(width, dim),
            x.new_zeros(width),
            x.new_zeros(width, dim),
        )
        inputs = (x, mu, tau, grad_point, grad_cluster, grad_w_off, grad_b_off, grad_w_prec)
        call(ctx.fns[3], *inputs, *ctx.sizes)
        return None, None, None, grad_w_off, grad_b_off, grad_w_prec, grad_w_out, grad.sum().reshape(1), None


class GMMProposals(Proposals):
    """Inference networks for one architecture.

    ``apg``: linear NSS encoder q(mu, tau | x), NSS kernel q(mu, tau | x, c) and the
    assignment kernel q(c | x, mu, tau). ``mlp`` / ``lstm``: RWS encoders whose NSS
    point features come from an MLP or an LSTM; they have no kernels.
    """

    def __init__(self, cfg: GMMConfig, architecture: str = "apg", hidden: int = 32, c_inputs: str = "offset"):
        super().__init__()
        self.cfg = cfg
        self.architecture = architecture
        encoder_features = {"apg": "linear", "mlp": "mlp", "lstm": "lstm"}.get(architecture)
        if encoder_features is None:
            raise ValueError(f"unknown GMM architecture {architecture!r}; choose apg, mlp or lstm")
        self.encoder = GlobalsProposal(cfg, cfg.data_dim, encoder_features, hidden)
        self.assign = AssignmentProposal(cfg, hidden, c_inputs)
        if architecture == "apg":
            self.globals_kernel = GlobalsProposal(cfg, cfg.data_dim + cfg.num_clusters, "linear", hidden)

    def initial(self, x: Tensor, num_particles: int) -> tuple[Latents, Tensor]:
        q_globals = self.encoder(x).expand(num_particles)
        globals_ = q_globals.sample()
        q_c = self.kernel("c", x, globals_)
        c = q_c.sample()
        return {**globals_, **c}, q_globals.log_prob(globals_) + q_c.log_prob(c)

    def kernel(self, block: str, x: Tensor, z: Mapping[str, Tensor]):
        if block == "c":
            return assignment_posterior(self.assign(x, z["mu"], z["tau"]))
        if block == "globals" and self.architecture == "apg":
            c = z["c"]
            heads = self.globals_kernel.resp, self.globals_kernel.stat
            native = _native_soft_moments(x, c, *heads)
            if native is not None:
                weights = (heads[0].weight, heads[0].bias, heads[1].weight, heads[1].bias)
                sums = _SoftMoments.apply(x, c, *weights, *native)
                return normal_gamma_from_sums(self.cfg, sums)
            # Inputs [x_n, one-hot(c_n)], built point-axis-last (see GlobalsProposal.forward).
            one_hot_t = one_hot_points_last(c, self.cfg.num_clusters, x.dtype)
            x_t = x.transpose(-1, -2).expand(c.shape[0], *x.shape[:-2], x.shape[-1], x.shape[-2])
            return self.globals_kernel(torch.cat([x_t, one_hot_t], -2).transpose(-1, -2))
        return super().kernel(block, x, z)


def _native_soft_moments(x: Tensor, c: Tensor, resp: nn.Linear, stat: nn.Linear):
    """The compiled globals-kernel statistics ``(forward, backward)`` (``apg/kernels/gmm.c``)
    where they apply: data ``(B, N, D)`` without a gradient, assignments ``(L, B, N)``, the
    heads ``resp`` (I outputs) and ``stat`` (D outputs) on inputs ``[x_n, one-hot(c_n)]``."""
    num_clusters, dim = resp.out_features, x.shape[-1]
    # the kernel's bound: I + D outputs <= 16 (gmm.c: MAX_OUTPUTS)
    if x.dim() != 3 or c.dim() != 3 or num_clusters + dim > 16:
        return None
    if x.requires_grad or stat.out_features != dim or resp.in_features != dim + num_clusters:
        return None
    forward = native_function("gmm_soft_moments", x, resp.weight, stat.weight)
    return None if forward is None else (forward, native_function("gmm_soft_moments_backward", x))


class _SoftMoments(torch.autograd.Function):
    """The globals kernel's per-cluster sums ``(sum r, sum r t, sum r t^2)`` ``(L, B, I, 1 + 2D)``
    from inputs ``[x_n, one-hot(c_n)]`` (``GlobalsProposal`` with linear features), in one
    compiled pass: no one-hot, no (L, B, I + D, N) outputs. Differentiable in the two heads'
    weights and biases ``(w_resp, b_resp, w_stat, b_stat)``."""

    @staticmethod
    def forward(ctx, x, c, w_resp, b_resp, w_stat, b_stat, forward_fn, backward_fn):
        x, c = x.contiguous(), c.contiguous()
        heads = tuple(t.contiguous() for t in (w_resp, b_resp, w_stat, b_stat))
        (num_particles, batch, num_points), (num_clusters, dim) = c.shape, (w_resp.shape[0], x.shape[-1])
        sums = x.new_zeros(num_particles, batch, num_clusters, 1 + 2 * dim)
        ctx.sizes = (num_particles, batch, num_points, num_clusters, dim)
        call(forward_fn, x, c, *heads, sums, *ctx.sizes)
        ctx.save_for_backward(x, c, *heads)
        ctx.backward_fn = backward_fn
        return sums

    @staticmethod
    def backward(ctx, grad):
        x, c, *heads = ctx.saved_tensors
        grads = [torch.zeros_like(t) for t in heads]
        call(ctx.backward_fn, x, c, *heads, grad.contiguous(), *grads, *ctx.sizes)
        return None, None, *grads, None, None


def build_proposals(
    model: GMM, architecture: str, hidden: int = 32, c_inputs: str = "offset"
) -> GMMProposals:
    return GMMProposals(model.cfg, architecture, hidden, c_inputs)
