"""Network pieces shared by the tasks' proposals."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class PointFeatures(nn.Module):
    """Per-point features of a dataset, ``(..., N, F_in) -> (..., N, out_dim)``.

    ``linear``: the identity (Appendix E's APG encoders read x_n directly); ``mlp``: two
    tanh layers applied to each point; ``lstm``: an LSTM over the point sequence (the
    RWS-LSTM baselines of section 5.1).
    """

    def __init__(self, kind: str, in_dim: int, hidden: int):
        super().__init__()
        self.kind = kind
        self.out_dim = in_dim if kind == "linear" else hidden
        if kind == "mlp":
            self.net: nn.Module = nn.Sequential(
                nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh()
            )
        elif kind == "lstm":
            self.net = nn.LSTM(in_dim, hidden, batch_first=True)
        elif kind != "linear":
            raise ValueError(f"unknown point-feature network {kind!r}; choose linear, mlp or lstm")

    def forward(self, u: Tensor) -> Tensor:
        if self.kind == "linear":
            return u
        if self.kind == "mlp":
            return self.net(u)
        lead = u.shape[:-2]
        out, _ = self.net(u.reshape(-1, *u.shape[-2:]))
        return out.reshape(*lead, *out.shape[-2:])


class _PairwiseTanhLinear(torch.autograd.Function):
    """``tanh(point + cluster) @ weight`` over every (point, cluster) pair, fused.

    The (L, B, N, I, H) hidden tensor is the largest in a mixture model's training step.
    Autograd would keep it plus several same-sized temporaries and, for the broadcast
    addition, reduce over the particle and cluster dims in one multi-dim ``sum`` that this
    torch build runs about 14x slower than two single-dim sums. Here the forward keeps only
    the hidden tensor and the backward works in one buffer, in place.
    """

    @staticmethod
    def forward(ctx, point: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
        hidden = torch.add(point.unsqueeze(-2), cluster.unsqueeze(-3)).tanh_()
        ctx.save_for_backward(hidden, weight)
        ctx.point_dims = point.dim()
        return hidden @ weight

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden, weight = ctx.saved_tensors
        width = hidden.shape[-1]
        grad_weight = hidden.reshape(-1, width).T @ grad.reshape(-1, weight.shape[-1])
        # d out / d pre-activation: (grad @ weight^T) * (1 - hidden^2)
        pre = grad @ weight.T
        pre.mul_(torch.mul(hidden, hidden).sub_(1.0)).neg_()
        grad_cluster = pre.sum(-3)  # (..., B, I, H)
        grad_point = pre.sum(-2)  # (..., B, N, H)
        while grad_point.dim() > ctx.point_dims:
            grad_point = grad_point.sum(0)
        return grad_point, grad_cluster, grad_weight


def pairwise_tanh_linear(point: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
    """A one-hidden-layer tanh MLP on every (point, cluster) pair, ``(L, B, N, I, O)``.

    ``point``: ``(B, N, H)`` (or ``(L, B, N, H)``) the first layer's per-point part, bias
    included; ``cluster``: ``(L, B, I, H)`` its per-cluster part; ``weight``: ``(H, O)``
    the output layer (add its bias outside). Splitting the first layer this way forms the
    pair tensor with one broadcast addition instead of expanding and concatenating inputs;
    tanh, the activation of Appendix E, costs less per element than sigmoid in this build.
    """
    return _PairwiseTanhLinear.apply(point, cluster, weight)
