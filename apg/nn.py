"""Network pieces shared by the tasks' proposals."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from apg.kernels import call
from apg.kernels.ops import KernelOp


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


def _pairwise_applies(point: Tensor, cluster: Tensor, weight: Tensor, *_: Tensor) -> bool:
    """Whether the compiled pairwise functions take these sizes."""
    if point.dim() == 3:
        point = point.unsqueeze(0)
    if point.dim() != 4 or cluster.dim() != 4 or weight.dim() != 2:
        return False
    return point.shape[0] in (1, cluster.shape[0]) and point.shape[1] == cluster.shape[1]


def _pairwise_sizes(point: Tensor, cluster: Tensor, weight: Tensor):
    p = point.unsqueeze(0) if point.dim() == 3 else point
    p, c, w_t = p.contiguous(), cluster.contiguous(), weight.T.contiguous()
    (num_particles, batch, num_clusters, width), lp = c.shape, p.shape[0]
    return p, c, w_t, (num_particles, lp, batch, p.shape[2], num_clusters, width, w_t.shape[0])


def _pairwise_twin(point: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
    return torch.add(point.unsqueeze(-2), cluster.unsqueeze(-3)).tanh_() @ weight


def _pairwise_native(fn, point: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
    p, c, w_t, sizes = _pairwise_sizes(point, cluster, weight)
    out = p.new_empty(sizes[0], sizes[2], sizes[3], sizes[4], sizes[6])
    call(fn, p, c, w_t, out, *sizes)
    return out


def _pairwise_fake(point: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
    *lead, num_clusters, _ = cluster.shape
    return point.new_empty(*lead, point.shape[-2], num_clusters, weight.shape[1])


def _pairwise_backward_formula(
    hidden: Tensor, weight: Tensor, grad: Tensor, point_dims: int
) -> tuple[Tensor, Tensor, Tensor]:
    width = hidden.shape[-1]
    grad_weight = hidden.reshape(-1, width).T @ grad.reshape(-1, weight.shape[-1])
    # d out / d pre-activation: (grad @ weight^T) * (1 - hidden^2)
    pre = grad @ weight.T
    pre.mul_(torch.mul(hidden, hidden).sub_(1.0)).neg_()
    grad_cluster = pre.sum(-3)  # (..., B, I, H)
    grad_point = pre.sum(-2)  # (..., B, N, H)
    while grad_point.dim() > point_dims:
        grad_point = grad_point.sum(0)
    return grad_point, grad_cluster, grad_weight


def _pairwise_backward_twin(
    point: Tensor, cluster: Tensor, weight: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    hidden = torch.add(point.unsqueeze(-2), cluster.unsqueeze(-3)).tanh_()
    grad_point, grad_cluster, grad_weight = _pairwise_backward_formula(hidden, weight, grad, point.dim())
    return grad_point.sum_to_size(point.shape).contiguous(), grad_cluster.contiguous(), grad_weight


def _pairwise_backward_native(
    fn, point: Tensor, cluster: Tensor, weight: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    p, c, w_t, sizes = _pairwise_sizes(point, cluster, weight)
    grad_p, grad_c, grad_w_t = torch.zeros_like(p), torch.zeros_like(c), torch.zeros_like(w_t)
    call(fn, p, c, w_t, grad, grad_p, grad_c, grad_w_t, *sizes)
    return (grad_p.squeeze(0) if point.dim() == 3 else grad_p), grad_c, grad_w_t.T.contiguous()


def _pairwise_backward_fake(point: Tensor, cluster: Tensor, weight: Tensor, grad: Tensor):
    return point.new_empty(point.shape), cluster.new_empty(cluster.shape), weight.new_empty(weight.shape)


class _PairwiseTanhLinear(torch.autograd.Function):
    """``tanh(point + cluster) @ weight`` over every (point, cluster) pair, the PyTorch
    twin of the ``apg::pairwise_tanh_linear`` op with its own autograd.

    The (L, B, N, I, H) hidden tensor is the largest in a mixture model's training step.
    On CPU the compiled kernel (``apg/kernels/tanh_layers.c``, on torch's OpenMP threads)
    never forms it: the forward keeps only the inputs and the backward recomputes each
    row's tanh. Elsewhere this path keeps only the hidden tensor and works in one buffer in
    place, because autograd would keep several same-sized temporaries and, for the
    broadcast addition, reduce over the particle and cluster dims in one multi-dim ``sum``
    that this torch build runs about 14x slower than two single-dim sums.
    """

    @staticmethod
    def forward(ctx, point: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
        ctx.point_dims = point.dim()
        hidden = torch.add(point.unsqueeze(-2), cluster.unsqueeze(-3)).tanh_()
        ctx.save_for_backward(hidden, weight)
        return hidden @ weight

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden, weight = ctx.saved_tensors
        return _pairwise_backward_formula(hidden, weight, grad, ctx.point_dims)


def _save_inputs(ctx, inputs: tuple, output) -> None:
    ctx.save_for_backward(*(t for t in inputs if isinstance(t, Tensor)))


pairwise_tanh_linear_op = KernelOp(
    "pairwise_tanh_linear",
    _pairwise_twin,
    kernel="pairwise_forward",
    native=_pairwise_native,
    applies=_pairwise_applies,
    fake=_pairwise_fake,
    eager_twin=_PairwiseTanhLinear.apply,
    backward=KernelOp(
        "pairwise_tanh_linear_backward",
        _pairwise_backward_twin,
        kernel="pairwise_backward",
        native=_pairwise_backward_native,
        applies=_pairwise_applies,
        fake=_pairwise_backward_fake,
    ),
    setup_context=_save_inputs,
    gradients=lambda ctx, grads, run, wants: run(*ctx.saved_tensors, grads[0]),
)


def pairwise_tanh_linear(point: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
    """A one-hidden-layer tanh MLP on every (point, cluster) pair, ``(L, B, N, I, O)``.

    ``point``: ``(B, N, H)`` (or ``(L, B, N, H)``) the first layer's per-point part, bias
    included; ``cluster``: ``(L, B, I, H)`` its per-cluster part; ``weight``: ``(H, O)``
    the output layer (add its bias outside). Splitting the first layer this way forms the
    pair tensor with one broadcast addition instead of expanding and concatenating inputs;
    tanh, the activation of Appendix E, costs less per element than sigmoid in this build.
    The op ``apg::pairwise_tanh_linear``.
    """
    return pairwise_tanh_linear_op(point, cluster, weight)


def _scaled_pairwise_applies(x: Tensor, scale: Tensor, cluster: Tensor, weight: Tensor, *_: Tensor) -> bool:
    """Sizes that agree without broadcasting (the kernel reads them from ``scale`` and ``x``),
    no gradient for ``x``, and D <= 256, H <= 1024 (its per-thread arrays are on the stack)."""
    if x.dim() != 3 or scale.dim() != 5 or cluster.dim() != 4 or weight.dim() != 1 or x.requires_grad:
        return False
    num_particles, batch, num_clusters, dim, width = scale.shape
    if (batch, dim) != (x.shape[0], x.shape[2]) or dim > 256 or width > 1024:
        return False
    return cluster.shape == (num_particles, batch, num_clusters, width) and weight.shape == (width,)


def _scaled_pairwise_twin(x: Tensor, scale: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
    pre = torch.einsum("...nd,...idh->...nih", x, scale) + cluster.unsqueeze(-3)
    return torch.tanh(pre) @ weight


def _scaled_pairwise_native(fn, x: Tensor, scale: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
    x, scale, cluster, weight = (t.contiguous() for t in (x, scale, cluster, weight))
    (num_particles, batch, num_clusters, dim, width), num_points = scale.shape, x.shape[1]
    out = x.new_empty(num_particles, batch, num_points, num_clusters)
    call(fn, x, scale, cluster, weight, out, num_particles, batch, num_points, num_clusters, dim, width)
    return out


def _scaled_pairwise_fake(x: Tensor, scale: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
    return torch.empty(
        torch.broadcast_shapes(scale.shape[:-3], x.shape[:-2]) + (x.shape[-2], scale.shape[-3]),
        dtype=x.dtype,
        device=x.device,
    )


def _scaled_pairwise_backward_twin(
    x: Tensor, scale: Tensor, cluster: Tensor, weight: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    hidden = torch.tanh(torch.einsum("...nd,...idh->...nih", x, scale) + cluster.unsqueeze(-3))
    grad_weight = (hidden * grad.unsqueeze(-1)).reshape(-1, weight.shape[0]).sum(0)
    pre = grad.unsqueeze(-1) * weight * (1 - hidden * hidden)  # (..., N, I, H)
    grad_cluster = pre.sum(-3).sum_to_size(cluster.shape)
    grad_scale = torch.einsum("...nd,...nih->...idh", x, pre).sum_to_size(scale.shape)
    return grad_scale.contiguous(), grad_cluster.contiguous(), grad_weight


def _scaled_pairwise_backward_native(
    fn, x: Tensor, scale: Tensor, cluster: Tensor, weight: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    x, scale, cluster, weight = (t.contiguous() for t in (x, scale, cluster, weight))
    (num_particles, batch, num_clusters, dim, width), num_points = scale.shape, x.shape[1]
    grads = torch.zeros_like(scale), torch.zeros_like(cluster), torch.zeros_like(weight)
    sizes = (num_particles, batch, num_points, num_clusters, dim, width)
    call(fn, x, scale, cluster, weight, grad.contiguous(), *grads, *sizes)
    return grads


scaled_pairwise_tanh_linear_op = KernelOp(
    "scaled_pairwise_tanh_linear",
    _scaled_pairwise_twin,
    kernel="scaled_pairwise_forward",
    native=_scaled_pairwise_native,
    applies=_scaled_pairwise_applies,
    fake=_scaled_pairwise_fake,
    backward=KernelOp(
        "scaled_pairwise_tanh_linear_backward",
        _scaled_pairwise_backward_twin,
        kernel="scaled_pairwise_backward",
        native=_scaled_pairwise_backward_native,
        applies=_scaled_pairwise_applies,
        fake=lambda x, scale, cluster, weight, grad: (
            scale.new_empty(scale.shape),
            cluster.new_empty(cluster.shape),
            weight.new_empty(weight.shape),
        ),
    ),
    setup_context=_save_inputs,
    # no gradient for x: the op is for points that take none
    gradients=lambda ctx, grads, run, wants: (None, *run(*ctx.saved_tensors, grads[0])),
)


def scaled_pairwise_tanh_linear(x: Tensor, scale: Tensor, cluster: Tensor, weight: Tensor) -> Tensor:
    """A one-hidden-layer tanh network on every (point, cluster) pair whose first layer is
    scaled per cluster: ``out[l,b,n,i] = sum_h weight[h] tanh(sum_d x[b,n,d] scale[l,b,i,d,h]
    + cluster[l,b,i,h])``, ``(L, B, N, I)``.

    ``x (B, N, D)``: the points; ``scale (L, B, I, D, H)``; ``cluster (L, B, I, H)``;
    ``weight (H,)`` the single output unit (add its bias outside). Unlike
    ``pairwise_tanh_linear``'s, the pre-activation is no sum of a point part and a cluster
    part, so the pair tensor must be formed; on CPU the compiled kernel forms it a block of
    points at a time and never keeps it. The op ``apg::scaled_pairwise_tanh_linear``, which
    gives ``x`` no gradient (a differentiable ``x`` runs the twin here).
    """
    return scaled_pairwise_tanh_linear_op(x, scale, cluster, weight)


def _tanh_mlp_twin(u: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, angles: bool) -> Tensor:
    rows = torch.stack([torch.cos(u), torch.sin(u)], -1) if angles else u
    return torch.tanh(torch.nn.functional.linear(rows, w1, b1)) @ w2.T + b2


def _tanh_mlp_rows(u: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, angles: bool):
    rows = (u.reshape(-1) if angles else u.reshape(-1, u.shape[-1])).contiguous()
    return rows, w1.T.contiguous(), w2.contiguous(), (rows.shape[0], w1.shape[1], w1.shape[0], w2.shape[0])


def _tanh_mlp_native(fn, u: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, angles: bool) -> Tensor:
    lead = u.shape if angles else u.shape[:-1]
    rows, w1_t, w2_t, sizes = _tanh_mlp_rows(u, w1, b1, w2, angles)
    out = rows.new_empty(rows.shape[0], w2.shape[0])
    call(fn, rows, w1_t, b1, w2_t, b2, out, *sizes, int(angles))
    return out.reshape(*lead, w2.shape[0])


def _tanh_mlp_fake(u: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, angles: bool) -> Tensor:
    return u.new_empty(*(u.shape if angles else u.shape[:-1]), w2.shape[0])


def _tanh_mlp_backward_twin(
    u: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, grad: Tensor, want_u: bool, angles: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows = torch.stack([torch.cos(u), torch.sin(u)], -1) if angles else u
    hidden = torch.tanh(torch.nn.functional.linear(rows, w1, b1))
    flat_grad, flat_hidden = grad.reshape(-1, w2.shape[0]), hidden.reshape(-1, w1.shape[0])
    pre = (grad @ w2) * (1 - hidden * hidden)  # (..., H)
    flat_pre = pre.reshape(-1, w1.shape[0])
    grad_w1 = flat_pre.T @ rows.reshape(-1, w1.shape[1])
    grad_u = u.new_empty(0)
    if want_u:
        grad_rows = pre @ w1
        grad_u = grad_rows[..., 1] * torch.cos(u) - grad_rows[..., 0] * torch.sin(u) if angles else grad_rows
    return grad_u.contiguous(), grad_w1, flat_pre.sum(0), flat_grad.T @ flat_hidden, flat_grad.sum(0)


def _tanh_mlp_backward_native(
    fn, u: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, grad: Tensor, want_u: bool, angles: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows, w1_t, w2_t, sizes = _tanh_mlp_rows(u, w1, b1, w2, angles)
    b1 = b1.contiguous()
    grad_u = torch.empty_like(rows) if want_u else rows.new_empty(0)
    grads = [
        torch.zeros_like(w1_t),
        torch.zeros_like(b1),
        torch.zeros_like(w2_t),
        b1.new_zeros(w2_t.shape[0]),
    ]
    grad_out = grad.reshape(rows.shape[0], -1)
    call(fn, rows, w1_t, b1, w2_t, grad_out, grad_u, *grads, *sizes, int(want_u), int(angles))
    grad_w1_t, grad_b1, grad_w2, grad_b2 = grads
    return grad_u.reshape(u.shape) if want_u else grad_u, grad_w1_t.T.contiguous(), grad_b1, grad_w2, grad_b2


def _tanh_mlp_backward_fake(
    u: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, grad: Tensor, want_u: bool, angles: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grad_u = u.new_empty(u.shape) if want_u else u.new_empty(0)
    return (
        grad_u,
        w1.new_empty(w1.shape),
        b1.new_empty(b1.shape),
        w2.new_empty(w2.shape),
        w2.new_empty(w2.shape[0]),
    )


def _tanh_mlp_save(ctx, inputs: tuple, output) -> None:
    u, w1, b1, w2, _b2, angles = inputs
    ctx.save_for_backward(u, w1, b1, w2)
    ctx.angles = angles


def _tanh_mlp_gradients(ctx, grads, run, wants):
    want_u = bool(wants[0])
    grad_u, *rest = run(*ctx.saved_tensors, grads[0], want_u, ctx.angles)
    return grad_u if want_u else None, *rest, None


tanh_mlp_op = KernelOp(
    "tanh_mlp",
    _tanh_mlp_twin,
    kernel="pointwise_forward",
    native=_tanh_mlp_native,
    fake=_tanh_mlp_fake,
    backward=KernelOp(
        "tanh_mlp_backward",
        _tanh_mlp_backward_twin,
        kernel="pointwise_backward",
        native=_tanh_mlp_backward_native,
        fake=_tanh_mlp_backward_fake,
    ),
    setup_context=_tanh_mlp_save,
    gradients=_tanh_mlp_gradients,
)


def tanh_mlp(u: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, *, angles: bool = False) -> Tensor:
    """A one-hidden-layer tanh MLP on every row of ``u (..., D)``: ``(..., O)``.

    ``w1 (H, D)``, ``b1 (H,)``, ``w2 (O, H)``, ``b2 (O,)`` as in ``nn.Linear``. With
    ``angles``, ``u`` holds angles ``(...)`` and the rows are their ``(cos u, sin u)``
    (``D = 2``). On CPU the compiled kernel never forms the ``(..., H)`` hidden tensor, which
    for a network of a per-point latent (the rings' g_theta(alpha)) is the step's largest,
    nor the features or the output before its bias. The op ``apg::tanh_mlp``.
    """
    if angles and w1.shape[1] != 2:
        raise ValueError(
            f"a network of angles reads (cos, sin): w1 must have 2 columns, got {tuple(w1.shape)}"
        )
    return tanh_mlp_op(u, w1, b1, w2, b2, angles)
