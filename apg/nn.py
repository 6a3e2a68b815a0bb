"""Network pieces shared by the tasks' proposals."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from apg.kernels import call, native_function


def linear(layer: nn.Module) -> nn.Linear:
    """``layer``, an item of an ``nn.Sequential`` (which types its items ``Module``), as the
    ``nn.Linear`` it is."""
    assert isinstance(layer, nn.Linear), type(layer)
    return layer


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


def _native_pairwise(point: Tensor, cluster: Tensor, weight: Tensor):
    """The compiled pairwise functions ``(forward, backward)`` when they apply."""
    if point.dim() != 4 or cluster.dim() != 4 or weight.dim() != 2:
        return None
    if point.shape[0] not in (1, cluster.shape[0]) or point.shape[1] != cluster.shape[1]:
        return None
    forward = native_function("pairwise_forward", point, cluster, weight)
    return None if forward is None else (forward, native_function("pairwise_backward", point))


class _PairwiseTanhLinear(torch.autograd.Function):
    """``tanh(point + cluster) @ weight`` over every (point, cluster) pair, fused.

    The (L, B, N, I, H) hidden tensor is the largest in a mixture model's training step.
    On CPU the compiled kernel (``apg/kernels/tanh_layers.c``, on torch's OpenMP threads)
    never forms it: the forward
    keeps only the inputs and the backward recomputes each row's tanh. Elsewhere the
    PyTorch path keeps only the hidden tensor and works in one buffer in place, because
    autograd would keep several same-sized temporaries and, for the broadcast addition,
    reduce over the particle and cluster dims in one multi-dim ``sum`` that this torch
    build runs about 14x slower than two single-dim sums.
    """

    @staticmethod
    def forward(ctx, point: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
        ctx.point_dims = point.dim()
        p = point.unsqueeze(0) if point.dim() == 3 else point
        native = _native_pairwise(p, cluster, weight)
        if native is not None:
            p, c, w_t = p.contiguous(), cluster.contiguous(), weight.T.contiguous()
            (num_particles, batch, num_clusters, width), lp = c.shape, p.shape[0]
            out = p.new_empty(num_particles, batch, p.shape[2], num_clusters, w_t.shape[0])
            sizes = (num_particles, lp, batch, p.shape[2], num_clusters, width, w_t.shape[0])
            call(native[0], p, c, w_t, out, *sizes)
            ctx.native, ctx.sizes = native, sizes
            ctx.save_for_backward(p, c, w_t)
            return out
        hidden = torch.add(point.unsqueeze(-2), cluster.unsqueeze(-3)).tanh_()
        ctx.native = None
        ctx.save_for_backward(hidden, weight)
        return hidden @ weight

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if ctx.native is not None:
            p, c, w_t = ctx.saved_tensors
            grad_p, grad_c, grad_w_t = torch.zeros_like(p), torch.zeros_like(c), torch.zeros_like(w_t)
            call(ctx.native[1], p, c, w_t, grad, grad_p, grad_c, grad_w_t, *ctx.sizes)
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


def _native_scaled_pairwise(x: Tensor, scale: Tensor, cluster: Tensor, weight: Tensor):
    """The compiled scaled-pairwise functions ``(forward, backward)`` when they apply: sizes
    that agree without broadcasting (the kernel reads them from ``scale`` and ``x``), no
    gradient for ``x``, and D <= 256, H <= 1024 (its per-thread arrays are on the stack)."""
    if x.dim() != 3 or scale.dim() != 5 or cluster.dim() != 4 or weight.dim() != 1 or x.requires_grad:
        return None
    num_particles, batch, num_clusters, dim, width = scale.shape
    if (batch, dim) != (x.shape[0], x.shape[2]) or dim > 256 or width > 1024:
        return None
    if cluster.shape != (num_particles, batch, num_clusters, width) or weight.shape != (width,):
        return None
    forward = native_function("scaled_pairwise_forward", x, scale, cluster, weight)
    return None if forward is None else (forward, native_function("scaled_pairwise_backward", x))


class _ScaledPairwise(torch.autograd.Function):
    """``scaled_pairwise_tanh_linear`` on CPU: the compiled kernel (``tanh_layers.c``) never
    forms the (L, B, N, I, H) hidden tensor and recomputes its tanh in the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor, cluster: Tensor, weight: Tensor, fns) -> Tensor:
        x, scale, cluster, weight = (t.contiguous() for t in (x, scale, cluster, weight))
        (num_particles, batch, num_clusters, dim, width), num_points = scale.shape, x.shape[1]
        ctx.sizes = (num_particles, batch, num_points, num_clusters, dim, width)
        out = x.new_empty(num_particles, batch, num_points, num_clusters)
        call(fns[0], x, scale, cluster, weight, out, *ctx.sizes)
        ctx.fns = fns
        ctx.save_for_backward(x, scale, cluster, weight)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, scale, cluster, weight = ctx.saved_tensors
        grads = torch.zeros_like(scale), torch.zeros_like(cluster), torch.zeros_like(weight)
        call(ctx.fns[1], x, scale, cluster, weight, grad.contiguous(), *grads, *ctx.sizes)
        return None, *grads, None


def scaled_pairwise_tanh_linear(x: Tensor, scale: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
    """A one-hidden-layer tanh network on every (point, cluster) pair whose first layer is
    scaled per cluster: ``out[l,b,n,i] = sum_h weight[h] tanh(sum_d x[b,n,d] scale[l,b,i,d,h]
    + cluster[l,b,i,h])``, ``(L, B, N, I)``.

    ``x (B, N, D)``: the points (no gradient); ``scale (L, B, I, D, H)``; ``cluster (L, B, I, H)``;
    ``weight (H,)`` the single output unit (add its bias outside). Unlike
    ``pairwise_tanh_linear``'s, the pre-activation is no sum of a point part and a cluster
    part, so the pair tensor must be formed; on CPU the compiled kernel forms it a block of
    points at a time and never keeps it.
    """
    native = _native_scaled_pairwise(x, scale, cluster, weight)
    if native is not None:
        return _ScaledPairwise.apply(x, scale, cluster, weight, native)
    pre = torch.einsum("...nd,...idh->...nih", x, scale) + cluster.unsqueeze(-3)
    return torch.tanh(pre) @ weight


class _TanhMLP(torch.autograd.Function):
    """``tanh_mlp`` fused on CPU (``tanh_layers.c``: no saved hidden tensor, tanh recomputed
    in backward, angle features formed in the kernel)."""

    @staticmethod
    def forward(ctx, u: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, angles: bool) -> Tensor:
        lead = u.shape if angles else u.shape[:-1]
        rows = (u.reshape(-1) if angles else u.reshape(-1, u.shape[-1])).contiguous()
        w1_t, w2_t = w1.T.contiguous(), w2.contiguous()
        sizes = (rows.shape[0], w1.shape[1], w1.shape[0], w2.shape[0])
        out = rows.new_empty(rows.shape[0], w2.shape[0])
        ctx.backward_fn = native_function("pointwise_backward", rows, w1, b1, w2)
        forward_fn = native_function("pointwise_forward", rows, w1, b1, w2)
        call(forward_fn, rows, w1_t, b1, w2_t, b2, out, *sizes, int(angles))
        ctx.save_for_backward(rows, w1_t, b1.contiguous(), w2_t)
        ctx.sizes, ctx.in_shape, ctx.angles = sizes, u.shape, angles
        return out.reshape(*lead, w2.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, w1_t, b1, w2_t = ctx.saved_tensors
        want_u = ctx.needs_input_grad[0]
        grad_u = torch.empty_like(rows) if want_u else rows.new_empty(0)
        grads = [
            torch.zeros_like(w1_t),
            torch.zeros_like(b1),
            torch.zeros_like(w2_t),
            b1.new_zeros(w2_t.shape[0]),
        ]
        grad_out = grad.reshape(rows.shape[0], -1)
        call(
            ctx.backward_fn,
            rows,
            w1_t,
            b1,
            w2_t,
            grad_out,
            grad_u,
            *grads,
            *ctx.sizes,
            int(want_u),
            int(ctx.angles),
        )
        grad_w1_t, grad_b1, grad_w2, grad_b2 = grads
        return grad_u.reshape(ctx.in_shape) if want_u else None, grad_w1_t.T, grad_b1, grad_w2, grad_b2, None


def tanh_mlp(u: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, *, angles: bool = False) -> Tensor:
    """A one-hidden-layer tanh MLP on every row of ``u (..., D)``: ``(..., O)``.

    ``w1 (H, D)``, ``b1 (H,)``, ``w2 (O, H)``, ``b2 (O,)`` as in ``nn.Linear``. With
    ``angles``, ``u`` holds angles ``(...)`` and the rows are their ``(cos u, sin u)``
    (``D = 2``). On CPU the compiled kernel never forms the ``(..., H)`` hidden tensor, which
    for a network of a per-point latent (the rings' g_theta(alpha)) is the step's largest,
    nor the features or the output before its bias.
    """
    if angles and w1.shape[1] != 2:
        raise ValueError(
            f"a network of angles reads (cos, sin): w1 must have 2 columns, got {tuple(w1.shape)}"
        )
    if native_function("pointwise_forward", u, w1, b1, w2, b2) is None:
        rows = torch.stack([torch.cos(u), torch.sin(u)], -1) if angles else u
        return torch.tanh(torch.nn.functional.linear(rows, w1, b1)) @ w2.T + b2
    return _TanhMLP.apply(u, w1, b1, w2, b2, angles)
