"""Network pieces shared by the tasks' proposals."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor, nn

from apg.kernels import pairwise_library


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


_NATIVE_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def _native_pairwise(point: Tensor, cluster: Tensor, weight: Tensor):
    """The compiled kernel's library and dtype suffix when it applies to these tensors."""
    if point.device.type != "cpu" or point.dtype not in _NATIVE_SUFFIX:
        return None
    if not (point.dtype == cluster.dtype == weight.dtype) or point.dim() != 4 or cluster.dim() != 4:
        return None
    if point.shape[0] not in (1, cluster.shape[0]) or point.shape[1] != cluster.shape[1] or weight.dim() != 2:
        return None
    lib = pairwise_library()
    return None if lib is None else (lib, _NATIVE_SUFFIX[point.dtype])


def _dims(point: Tensor, cluster: Tensor, weight: Tensor) -> list[ctypes.c_long]:
    lp, _, num_points, _ = point.shape
    num_particles, batch, num_clusters, width = cluster.shape
    return [
        ctypes.c_long(v) for v in (num_particles, lp, batch, num_points, num_clusters, width, weight.shape[1])
    ]


def _ptr(t: Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


class _PairwiseTanhLinear(torch.autograd.Function):
    """``tanh(point + cluster) @ weight`` over every (point, cluster) pair, fused.

    The (L, B, N, I, H) hidden tensor is the largest in a mixture model's training step.
    On CPU the compiled kernel (``apg/kernels/pairwise.c``) never forms it: the forward
    keeps only the inputs and the backward recomputes each row's tanh. Elsewhere the
    PyTorch path keeps only the hidden tensor and works in one buffer in place, because
    autograd would keep several same-sized temporaries and, for the broadcast addition,
    reduce over the particle and cluster dims in one multi-dim ``sum`` that this torch
    build runs about 14x slower than two single-dim sums.
    """

    @staticmethod
    def forward(ctx, point: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
        ctx.point_dims = point.dim()
        native = _native_pairwise(point.unsqueeze(0) if point.dim() == 3 else point, cluster, weight)
        if native is not None:
            lib, suffix = native
            p = (point.unsqueeze(0) if point.dim() == 3 else point).contiguous()
            c, w_t = cluster.contiguous(), weight.T.contiguous()
            out = p.new_empty(c.shape[0], c.shape[1], p.shape[2], c.shape[2], w_t.shape[0])
            getattr(lib, f"pairwise_forward_{suffix}")(
                _ptr(p), _ptr(c), _ptr(w_t), _ptr(out), *_dims(p, c, weight)
            )
            ctx.native = native
            ctx.save_for_backward(p, c, w_t)
            return out
        hidden = torch.add(point.unsqueeze(-2), cluster.unsqueeze(-3)).tanh_()
        ctx.native = None
        ctx.save_for_backward(hidden, weight)
        return hidden @ weight

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if ctx.native is not None:
            lib, suffix = ctx.native
            p, c, w_t = ctx.saved_tensors
            g = grad.contiguous()
            grad_p, grad_c, grad_w_t = torch.zeros_like(p), torch.zeros_like(c), torch.zeros_like(w_t)
            getattr(lib, f"pairwise_backward_{suffix}")(
                _ptr(p),
                _ptr(c),
                _ptr(w_t),
                _ptr(g),
                _ptr(grad_p),
                _ptr(grad_c),
                _ptr(grad_w_t),
                *_dims(p, c, w_t.T),
            )
            return (grad_p.squeeze(0) if ctx.point_dims == 3 else grad_p), grad_c, grad_w_t.T
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
