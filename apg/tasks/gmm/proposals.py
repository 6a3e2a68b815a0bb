"""The GMM's inference networks (section 3, eq. 10; Appendix E): the NSS encoder and
globals kernel q(mu, tau | x[, c]) and the assignment kernel q(c | x, mu, tau).

Legend: L particles, B datasets, N points, I clusters, D data dimensions, H hidden units.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from apg.blocks import Latents, Proposals
from apg.kernels import call
from apg.kernels.ops import KernelOp
from apg.nn import PointFeatures, pairwise_tanh_linear, pairwise_tanh_linear_op, scaled_pairwise_tanh_linear
from apg.tasks.gmm.conjugate import (
    NormalGamma,
    NormalGammaFromSums,
    assignment_posterior,
    cluster_sums,
    normal_gamma_from_sums,
    normal_gamma_posterior,
)
from apg.tasks.gmm.model import GMM, GMMConfig, one_hot_points_last

GLOBALS_INITS = ("conjugate", "default")


class GlobalsProposal(nn.Module):
    """Neural sufficient statistics for {mu, tau} (section 3, eq. 10).

    Each point contributes soft assignments ``gamma_n`` (softmax over I) and a learned
    statistic ``t_n`` (D dims); their sums enter the conjugate NormalGamma update in place
    of the counts and sums of the exact conditional. The posterior therefore sharpens as
    a cluster collects points, for any dataset size N.

    ``init="conjugate"`` (linear features only) starts both heads at the conjugate update
    (below); ``"default"`` keeps PyTorch's initialization of the two layers, the start that
    measures what the conjugate one does (docs/decisions.md, "GMM globals kernel and encoder
    start from the conjugate update"). Either way the layers draw their default weights
    first, so the draws that follow are the same.
    """

    def __init__(self, cfg: GMMConfig, in_dim: int, features: str, hidden: int = 32, init: str = "conjugate"):
        super().__init__()
        if init not in GLOBALS_INITS:
            raise ValueError(f"unknown globals-network start {init!r}; choose {' or '.join(GLOBALS_INITS)}")
        self.cfg = cfg
        self.features = PointFeatures(features, in_dim, hidden)
        self.resp = nn.Linear(self.features.out_dim, cfg.num_clusters)
        self.stat = nn.Linear(self.features.out_dim, cfg.data_dim)
        if features == "linear" and init == "conjugate":
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
        return assignment_logits_op(x, mu, tau, *weights)[0]

    def _standardized(self, x: Tensor, mu: Tensor, tau: Tensor) -> Tensor:
        # W ((x_n - mu_i) s_i) + V log tau_i + b = (W s_i) x_n + (V log tau_i - W (mu_i s_i) + b),
        # s_i = sqrt(tau_i): a first layer scaled per cluster, plus a per-cluster part.
        s = tau.sqrt()
        scale = s.unsqueeze(-1) * self.offset.weight.T  # (L, B, I, D, H)
        per_cluster = self.log_precision(torch.log(tau)) - (mu * s) @ self.offset.weight.T + self.offset.bias
        return scaled_pairwise_tanh_linear(x, scale, per_cluster, self.out.weight[0]) + self.out.bias


def _assignment_applies(x: Tensor, mu: Tensor, tau: Tensor, *weights: Tensor) -> bool:
    """Where the compiled assignment network applies: data ``(B, N, D)`` and latents
    ``(L, B, I, D)`` without gradients, one output unit."""
    if x.dim() != 3 or mu.dim() != 4 or tau.shape != mu.shape or weights[3].shape[0] != 1:
        return False
    return mu.shape[-1] <= 256 and not any(t.requires_grad for t in (x, mu, tau))


def _assignment_parts(
    x: Tensor, mu: Tensor, tau: Tensor, w_off: Tensor, b_off: Tensor, w_prec: Tensor
) -> tuple[Tensor, Tensor]:
    # W (x_n - mu_i) + V log tau_i + b = (W x_n + b) + (V log tau_i - W mu_i)
    per_point = torch.nn.functional.linear(x, w_off, b_off)  # (B, N, H)
    per_cluster = torch.nn.functional.linear(torch.log(tau), w_prec) - mu @ w_off.T  # (L, B, I, H)
    return per_point, per_cluster


def _assignment_twin(
    x: Tensor,
    mu: Tensor,
    tau: Tensor,
    w_off: Tensor,
    b_off: Tensor,
    w_prec: Tensor,
    w_out: Tensor,
    b_out: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    per_point, per_cluster = _assignment_parts(x, mu, tau, w_off, b_off, w_prec)
    logits = pairwise_tanh_linear(per_point, per_cluster, w_out.T) + b_out
    return logits.squeeze(-1), per_point.unsqueeze(0), per_cluster  # (L, B, N, I) and the parts


def _assignment_native(
    fns,
    x: Tensor,
    mu: Tensor,
    tau: Tensor,
    w_off: Tensor,
    b_off: Tensor,
    w_prec: Tensor,
    w_out: Tensor,
    b_out: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """The first layer's two parts (``gmm.c``: ``gmm_assignment_inputs``), the fused pairwise
    tanh layer (``tanh_layers.c``) and the output bias in a handful of ops instead of ~20."""
    x, mu, tau = x.contiguous(), mu.contiguous(), tau.contiguous()
    (num_particles, batch, clusters, dim), num_points, width = mu.shape, x.shape[1], w_off.shape[0]
    point, cluster = (
        x.new_empty(1, batch, num_points, width),
        x.new_empty(num_particles, batch, clusters, width),
    )
    sizes = (num_particles, batch, num_points, clusters, dim, width)
    call(fns[0], x, mu, tau, *(t.contiguous() for t in (w_off, b_off, w_prec)), point, cluster, *sizes)
    logits = x.new_empty(num_particles, batch, num_points, clusters)
    call(fns[1], point, cluster, w_out.contiguous(), logits, *_pair_sizes(mu, point))
    return logits.add_(b_out), point, cluster


def _pair_sizes(mu: Tensor, point: Tensor) -> tuple[int, ...]:
    (num_particles, batch, clusters, _), (_, _, num_points, width) = mu.shape, point.shape
    return num_particles, 1, batch, num_points, clusters, width, 1


def _assignment_backward_twin(
    x: Tensor, mu: Tensor, tau: Tensor, point: Tensor, cluster: Tensor, w_out: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grad_point, grad_cluster, grad_w_t = pairwise_tanh_linear_op.backward.twin(  # type: ignore[union-attr]
        point, cluster, w_out.T, grad.unsqueeze(-1)
    )
    width, dim = point.shape[-1], x.shape[-1]
    flat_point, flat_cluster = grad_point.reshape(-1, width), grad_cluster.reshape(-1, width)
    grad_w_off = flat_point.T @ x.reshape(-1, dim) - flat_cluster.T @ mu.reshape(-1, dim)
    grad_w_prec = flat_cluster.T @ torch.log(tau).reshape(-1, dim)
    return grad_w_off, flat_point.sum(0), grad_w_prec, grad_w_t.T.contiguous(), grad.sum().reshape(1)


def _assignment_backward_native(
    fns, x: Tensor, mu: Tensor, tau: Tensor, point: Tensor, cluster: Tensor, w_out: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The pairwise layer's backward, then the first layer's."""
    point, cluster, w_out, grad = (t.contiguous() for t in (point, cluster, w_out, grad))
    grad_point, grad_cluster, grad_w_out = (torch.zeros_like(t) for t in (point, cluster, w_out))
    call(fns[0], point, cluster, w_out, grad, grad_point, grad_cluster, grad_w_out, *_pair_sizes(mu, point))
    width, dim = point.shape[-1], x.shape[-1]
    grad_w_off, grad_b_off, grad_w_prec = x.new_zeros(width, dim), x.new_zeros(width), x.new_zeros(width, dim)
    inputs = (x.contiguous(), mu.contiguous(), tau.contiguous(), grad_point, grad_cluster)
    sizes = (*mu.shape[:2], x.shape[1], mu.shape[2], dim, width)
    call(fns[1], *inputs, grad_w_off, grad_b_off, grad_w_prec, *sizes)
    return grad_w_off, grad_b_off, grad_w_prec, grad_w_out, grad.sum().reshape(1)


def _assignment_save(ctx, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(*inputs[:3], output[1], output[2], inputs[6])
    ctx.mark_non_differentiable(output[1], output[2])


def _assignment_fake(
    x: Tensor, mu: Tensor, tau: Tensor, w_off: Tensor, *_: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    (num_particles, batch, clusters, _dim), num_points, width = mu.shape, x.shape[1], w_off.shape[0]
    return (
        x.new_empty(num_particles, batch, num_points, clusters),
        x.new_empty(1, batch, num_points, width),
        x.new_empty(num_particles, batch, clusters, width),
    )


# ``AssignmentProposal``'s logits ``(L, B, N, I)`` (offset inputs) and its first layer's two
# parts ``(1, B, N, H)``, ``(L, B, I, H)`` (kept for the backward): differentiable in the five
# weights ``(w_off, b_off, w_prec, w_out, b_out)`` through the logits, not in the data or the
# latents.
assignment_logits_op = KernelOp(
    "gmm_assignment_logits",
    _assignment_twin,
    kernel=("gmm_assignment_inputs", "pairwise_forward"),
    native=_assignment_native,
    applies=_assignment_applies,
    fake=_assignment_fake,
    backward=KernelOp(
        "gmm_assignment_logits_backward",
        _assignment_backward_twin,
        kernel=("pairwise_backward", "gmm_assignment_inputs_backward"),
        native=_assignment_backward_native,
        applies=lambda x, mu, tau, point, cluster, w_out, grad: x.dim() == 3 and mu.dim() == 4,
        fake=lambda x, mu, tau, point, cluster, w_out, grad: (
            x.new_empty(point.shape[-1], x.shape[-1]),
            x.new_empty(point.shape[-1]),
            x.new_empty(point.shape[-1], x.shape[-1]),
            w_out.new_empty(w_out.shape),
            w_out.new_empty(1),
        ),
    ),
    setup_context=_assignment_save,
    gradients=lambda ctx, grads, run, wants: (None, None, None, *run(*ctx.saved_tensors, grads[0])),
)


class GMMProposals(Proposals):
    """Inference networks for one architecture.

    ``apg``: linear NSS encoder q(mu, tau | x), NSS kernel q(mu, tau | x, c) and the
    assignment kernel q(c | x, mu, tau). ``mlp`` / ``lstm``: RWS encoders whose NSS
    point features come from an MLP or an LSTM; they have no kernels.
    """

    def __init__(
        self,
        cfg: GMMConfig,
        architecture: str = "apg",
        hidden: int = 32,
        c_inputs: str = "offset",
        globals_init: str = "conjugate",
    ):
        super().__init__()
        self.cfg = cfg
        self.architecture = architecture
        encoder_features = {"apg": "linear", "mlp": "mlp", "lstm": "lstm"}.get(architecture)
        if encoder_features is None:
            raise ValueError(f"unknown GMM architecture {architecture!r}; choose apg, mlp or lstm")
        self.encoder = GlobalsProposal(cfg, cfg.data_dim, encoder_features, hidden, globals_init)
        self.assign = AssignmentProposal(cfg, hidden, c_inputs)
        if architecture == "apg":
            self.globals_kernel = GlobalsProposal(
                cfg, cfg.data_dim + cfg.num_clusters, "linear", hidden, globals_init
            )

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
            heads = self.globals_kernel.resp, self.globals_kernel.stat
            weights = (heads[0].weight, heads[0].bias, heads[1].weight, heads[1].bias)
            return normal_gamma_from_sums(self.cfg, soft_moments_op(x, z["c"], *weights))
        return super().kernel(block, x, z)


def _soft_moments_applies(
    x: Tensor, c: Tensor, w_resp: Tensor, b_resp: Tensor, w_stat: Tensor, b_stat: Tensor, *_: Tensor
) -> bool:
    """Where the compiled statistics apply: data ``(B, N, D)`` without a gradient,
    assignments ``(L, B, N)``, heads of I and D outputs on inputs ``[x_n, one-hot(c_n)]``,
    I + D <= 16 (gmm.c: MAX_OUTPUTS)."""
    num_clusters, dim = w_resp.shape[0], x.shape[-1]
    if x.dim() != 3 or c.dim() != 3 or num_clusters + dim > 16 or x.requires_grad:
        return False
    return w_stat.shape[0] == dim and w_resp.shape[1] == dim + num_clusters


def _soft_moments_inputs(x: Tensor, c: Tensor, num_clusters: int) -> Tensor:
    """Inputs ``[x_n, one-hot(c_n)]`` ``(L, B, D + I, N)``, built point-axis-last (see
    ``GlobalsProposal.forward``)."""
    one_hot_t = one_hot_points_last(c, num_clusters, x.dtype)
    x_t = x.transpose(-1, -2).expand(c.shape[0], *x.shape[:-2], x.shape[-1], x.shape[-2])
    return torch.cat([x_t, one_hot_t], -2)


def _soft_moments_twin(
    x: Tensor, c: Tensor, w_resp: Tensor, b_resp: Tensor, w_stat: Tensor, b_stat: Tensor
) -> Tensor:
    """``GlobalsProposal.forward`` (linear features) up to the sums of its NormalGamma update."""
    num_clusters = w_resp.shape[0]
    h_t = _soft_moments_inputs(x, c, num_clusters)
    out = torch.matmul(torch.cat([w_resp, w_stat]), h_t) + torch.cat([b_resp, b_stat]).unsqueeze(-1)
    resp_t = torch.softmax(out[..., :num_clusters, :], dim=-2)
    return cluster_sums(resp_t.transpose(-1, -2), out[..., num_clusters:, :].transpose(-1, -2))


def _soft_moments_sizes(x: Tensor, c: Tensor, w_resp: Tensor) -> tuple[int, ...]:
    return (*c.shape, w_resp.shape[0], x.shape[-1])


def _soft_moments_native(
    fn, x: Tensor, c: Tensor, w_resp: Tensor, b_resp: Tensor, w_stat: Tensor, b_stat: Tensor
) -> Tensor:
    """One compiled pass: no one-hot, no (L, B, I + D, N) outputs."""
    heads = tuple(t.contiguous() for t in (w_resp, b_resp, w_stat, b_stat))
    sizes = _soft_moments_sizes(x, c, w_resp)
    sums = x.new_zeros(*c.shape[:2], sizes[3], 1 + 2 * sizes[4])
    call(fn, x, c, *heads, sums, *sizes)
    return sums


def _soft_moments_backward_twin(
    x: Tensor, c: Tensor, w_resp: Tensor, b_resp: Tensor, w_stat: Tensor, b_stat: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    num_clusters, dim = w_resp.shape[0], x.shape[-1]
    h_t = _soft_moments_inputs(x, c, num_clusters)  # (L, B, D + I, N)
    out = torch.matmul(torch.cat([w_resp, w_stat]), h_t) + torch.cat([b_resp, b_stat]).unsqueeze(-1)
    resp_t = torch.softmax(out[..., :num_clusters, :], dim=-2)  # (L, B, I, N)
    stat_t = out[..., num_clusters:, :]  # (L, B, D, N)
    g0, g1, g2 = grad[..., :1], grad[..., 1 : 1 + dim], grad[..., 1 + dim :]  # (L, B, I, 1 | D | D)
    grad_resp = g0 + g1 @ stat_t + g2 @ (stat_t * stat_t)  # (L, B, I, N)
    grad_stat = g1.transpose(-1, -2) @ resp_t + 2 * stat_t * (g2.transpose(-1, -2) @ resp_t)  # (L, B, D, N)
    grad_logits = resp_t * (grad_resp - (resp_t * grad_resp).sum(-2, keepdim=True))
    grad_out = torch.cat([grad_logits, grad_stat], -2)  # (L, B, I + D, N)
    grad_w = (grad_out @ h_t.transpose(-1, -2)).reshape(-1, num_clusters + dim, h_t.shape[-2]).sum(0)
    grad_b = grad_out.sum(-1).reshape(-1, num_clusters + dim).sum(0)
    parts = grad_w[:num_clusters], grad_b[:num_clusters], grad_w[num_clusters:], grad_b[num_clusters:]
    return tuple(t.clone() for t in parts)  # type: ignore[return-value]


def _soft_moments_backward_native(
    fn, x: Tensor, c: Tensor, w_resp: Tensor, b_resp: Tensor, w_stat: Tensor, b_stat: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    heads = tuple(t.contiguous() for t in (w_resp, b_resp, w_stat, b_stat))
    grads = tuple(torch.zeros_like(t) for t in heads)
    call(fn, x, c, *heads, grad.contiguous(), *grads, *_soft_moments_sizes(x, c, w_resp))
    return grads  # type: ignore[return-value]


# The globals kernel's per-cluster sums ``(sum r, sum r t, sum r t^2)`` ``(L, B, I, 1 + 2D)``
# from inputs ``[x_n, one-hot(c_n)]`` (``GlobalsProposal`` with linear features);
# differentiable in the two heads' weights and biases, not in the data.
soft_moments_op = KernelOp(
    "gmm_soft_moments",
    _soft_moments_twin,
    kernel="gmm_soft_moments",
    native=_soft_moments_native,
    applies=_soft_moments_applies,
    checked=lambda x, c, w_resp, b_resp, w_stat, b_stat: (x, w_resp, w_stat),
    fake=lambda x, c, w_resp, *_: x.new_empty(*c.shape[:2], w_resp.shape[0], 1 + 2 * x.shape[-1]),
    backward=KernelOp(
        "gmm_soft_moments_backward",
        _soft_moments_backward_twin,
        kernel="gmm_soft_moments_backward",
        native=_soft_moments_backward_native,
        applies=_soft_moments_applies,
        checked=lambda x, c, w_resp, b_resp, w_stat, b_stat, grad: (x,),
        fake=lambda x, c, *heads_and_grad: tuple(t.new_empty(t.shape) for t in heads_and_grad[:4]),
    ),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs),
    gradients=lambda ctx, grads, run, wants: (None, None, *run(*ctx.saved_tensors, grads[0])),
)


def build_proposals(
    model: GMM, architecture: str, hidden: int = 32, c_inputs: str = "offset", globals_init: str = "conjugate"
) -> GMMProposals:
    return GMMProposals(model.cfg, architecture, hidden, c_inputs, globals_init)
