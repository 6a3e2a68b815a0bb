"""Small distributions the tasks share, written for the sampler's hot loop.

``torch.distributions.Categorical`` samples through ``softmax`` + ``multinomial``, which
costs several times more than an inverse-CDF draw on the many short rows (one per point)
that assignment blocks have; argument validation costs more than the arithmetic too.
On CPU, draws and log-probabilities of such rows run as single passes in the compiled
kernels (``apg/kernels/categorical.c``); the PyTorch formulas below are their twins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from apg.blocks import Latents, propose_separately
from apg.kernels import call
from apg.kernels.ops import KernelOp
from apg.random import new_key, philox_uniform_op, uniform


def log_softmax_short(logits: Tensor) -> Tensor:
    """``log_softmax`` over a short last axis (a handful of clusters), ``(..., I)``.

    With I of 3 or 4 and tens of thousands of rows, this build's softmax kernel runs one
    scalar row at a time; over the second-to-last axis it vectorizes across rows, so
    transposing first costs a copy and still runs about 3x faster, backward included.
    """
    return torch.log_softmax(logits.transpose(-1, -2).contiguous(), -2).transpose(-1, -2)


def softmax_short(logits: Tensor) -> Tensor:
    """``softmax`` over a short last axis; see ``log_softmax_short``."""
    return torch.softmax(logits.transpose(-1, -2).contiguous(), -2).transpose(-1, -2)


def sample_categorical(log_probs: Tensor) -> Tensor:
    """One draw per row of normalized log-probabilities ``(..., I)`` (inverse CDF)."""
    cdf = log_probs.detach().exp().cumsum(-1)
    return _inverse_cdf(cdf, uniform(cdf.shape[:-1], cdf.dtype, cdf.device))


def _inverse_cdf(cdf: Tensor, u: Tensor) -> Tensor:
    # Scale u by the last cdf entry so round-off can never push it past the end.
    return (cdf[..., :-1] < u.unsqueeze(-1) * cdf[..., -1:]).sum(-1)


def categorical_sample(logits: Tensor) -> Tensor:
    """One draw per row of unnormalized ``logits (..., I)``, ``(...)`` (long)."""
    logits = logits.detach()
    return categorical_sample_op(logits, uniform(logits.shape[:-1], logits.dtype, logits.device))


def _sample_twin(logits: Tensor, u: Tensor) -> Tensor:
    return _inverse_cdf(log_softmax_short(logits).exp().cumsum(-1), u)


def _sample_native(fn, logits: Tensor, u: Tensor) -> Tensor:
    out = torch.empty(logits.shape[:-1], dtype=torch.long)
    call(fn, logits, u, out, out.numel(), logits.shape[-1])
    return out


def _long_rows(logits: Tensor, *_: object) -> Tensor:
    return torch.empty(logits.shape[:-1], dtype=torch.long, device=logits.device)


# One draw per row of ``logits (..., I)`` from the uniforms ``u (...)`` (inverse CDF).
categorical_sample_op = KernelOp(
    "categorical_sample",
    _sample_twin,
    kernel="categorical_sample",
    native=_sample_native,
    checked=lambda logits, u: (logits,),
    fake=_long_rows,
)


def categorical_log_prob(logits: Tensor, index: Tensor) -> Tensor:
    """``log p(index)`` per row under ``softmax(logits (..., I))``, ``(...)``; differentiable
    in ``logits``."""
    if index.dtype != torch.long:
        raise TypeError(f"categorical indices must be int64, got {index.dtype}")
    return categorical_log_prob_op(logits, index)


def _log_prob_twin(logits: Tensor, index: Tensor) -> Tensor:
    return log_softmax_short(logits).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def _log_prob_pass(fn, logits: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """``log_softmax(logits)[..., index]`` and the rows' log-normalizers in one pass."""
    out, lse = (logits.new_empty(index.shape) for _ in range(2))
    call(fn, logits, index, out, lse, index.numel(), logits.shape[-1])
    return out, lse


def _log_prob_backward_twin(logits: Tensor, index: Tensor, grad: Tensor) -> Tensor:
    one_hot = torch.nn.functional.one_hot(index, logits.shape[-1]).to(logits.dtype)
    return grad.unsqueeze(-1) * (one_hot - torch.softmax(logits, -1))


def _log_prob_backward_native(fns, logits: Tensor, index: Tensor, grad: Tensor) -> Tensor:
    """The forward pass again for the log-normalizers (the forward keeps only its inputs),
    then the backward pass."""
    logits, index = logits.contiguous(), index.contiguous()
    _, lse = _log_prob_pass(fns[0], logits, index)
    grad_logits = torch.empty_like(logits)
    call(fns[1], logits, index, lse, grad, grad_logits, index.numel(), logits.shape[-1])
    return grad_logits


# ``log_softmax(logits)[..., index]`` per row, one pass forward and backward.
categorical_log_prob_op = KernelOp(
    "categorical_log_prob",
    _log_prob_twin,
    kernel="categorical_log_prob",
    native=lambda fn, logits, index: _log_prob_pass(fn, logits, index)[0],
    checked=lambda logits, index: (logits,),
    fake=lambda logits, index: logits.new_empty(index.shape),
    eager_twin=_log_prob_twin,
    backward=KernelOp(
        "categorical_log_prob_backward",
        _log_prob_backward_twin,
        kernel=("categorical_log_prob", "categorical_log_prob_backward"),
        native=_log_prob_backward_native,
        checked=lambda logits, index, grad: (logits,),
        fake=lambda logits, index, grad: logits.new_empty(logits.shape),
    ),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs),
    gradients=lambda ctx, grads, run, wants: (run(*ctx.saved_tensors, grads[0]), None),
)


def _rows_applies(logits: Tensor, *_: object) -> bool:
    return logits.dim() >= 2 and logits.shape[-1] <= 64  # categorical.c's MAX_K


def _philox_draws(logits: Tensor) -> bool:
    """Whether ``apg.random.uniform`` draws these logits' uniforms from a Philox key."""
    return (
        logits.dtype in (torch.float32, torch.float64) and logits.is_cpu and not torch.compiler.is_compiling()
    )


def _sample_rows_twin(logits: Tensor, key: int) -> tuple[Tensor, Tensor]:
    u = philox_uniform_op.twin(key, list(logits.shape[:-1]), logits.dtype, logits.device)
    return _sample_twin(logits, u), torch.logsumexp(logits, -1)


def _sample_rows_eager(logits: Tensor, key: int) -> tuple[Tensor, Tensor]:
    """Where the rows' pass does not apply: ``categorical_sample`` from ``key``'s uniforms."""
    u = philox_uniform_op(key, list(logits.shape[:-1]), logits.dtype, logits.device)
    return categorical_sample_op(logits, u), torch.logsumexp(logits, -1)


def _sample_rows_native(fn, logits: Tensor, key: int) -> tuple[Tensor, Tensor]:
    logits = logits.contiguous()
    out = torch.empty(logits.shape[:-1], dtype=torch.long)
    lse = logits.new_empty(logits.shape[:-1])
    # the uniforms categorical_sample would draw (apg.random.uniform), drawn in the kernel
    call(fn, logits, key, out, lse, out.numel(), logits.shape[-1])
    return out, lse


# One draw per row of ``logits (..., I)`` from the Philox key ``key`` (the uniforms
# ``apg.random.uniform`` draws from it), and the rows' log-normalizers.
categorical_sample_rows_op = KernelOp(
    "categorical_sample_rows",
    _sample_rows_twin,
    kernel="categorical_sample_rows",
    native=_sample_rows_native,
    applies=_rows_applies,
    fake=lambda logits, key: (_long_rows(logits), logits.new_empty(logits.shape[:-1])),
    eager_twin=_sample_rows_eager,
)


def _rows_log_prob_twin(logits: Tensor, index: Tensor, lse: Tensor | None) -> Tensor:
    return _log_prob_twin(logits, index).sum(-1)


def _rows_log_prob_eager(logits: Tensor, index: Tensor, lse: Tensor | None) -> Tensor:
    return categorical_log_prob_op(logits, index).sum(-1)


def _rows_sizes(logits: Tensor, index: Tensor) -> tuple[int, int, int]:
    return math.prod(index.shape[:-1]), index.shape[-1], logits.shape[-1]


def _rows_log_prob_native(fn, logits: Tensor, index: Tensor, lse: Tensor | None) -> Tensor:
    logits, index = logits.contiguous(), index.contiguous()
    out = logits.new_empty(index.shape[:-1])
    have_lse = lse is not None
    lse = lse if lse is not None else logits.new_empty(index.shape)
    call(fn, logits, index, lse, out, int(have_lse), *_rows_sizes(logits, index))
    return out


def _rows_log_prob_backward_twin(logits: Tensor, index: Tensor, lse: Tensor | None, grad: Tensor) -> Tensor:
    return _log_prob_backward_twin(logits, index, grad.unsqueeze(-1).expand(index.shape))


def _rows_log_prob_backward_native(
    fns, logits: Tensor, index: Tensor, lse: Tensor | None, grad: Tensor
) -> Tensor:
    """The rows' log-normalizers where not given (the forward pass again: the forward keeps
    only its inputs), then the backward pass."""
    logits, index = logits.contiguous(), index.contiguous()
    sizes = _rows_sizes(logits, index)
    if lse is None:
        lse = logits.new_empty(index.shape)
        call(fns[0], logits, index, lse, logits.new_empty(index.shape[:-1]), 0, *sizes)
    grad_logits = torch.empty_like(logits)
    call(fns[1], logits, index, lse, grad.contiguous(), grad_logits, *sizes)
    return grad_logits


def _rows_applies_with_index(logits: Tensor, index: Tensor, *_: object) -> bool:
    return _rows_applies(logits) and index.shape == logits.shape[:-1]


# ``sum_n log_softmax(logits)[..., n, index_n]`` per group of rows ``(...)`` from the rows'
# log-normalizers ``lse`` where given (a draw's), one pass forward and backward.
categorical_rows_log_prob_op = KernelOp(
    "categorical_rows_log_prob",
    _rows_log_prob_twin,
    kernel="categorical_rows_log_prob",
    native=_rows_log_prob_native,
    applies=_rows_applies_with_index,
    checked=lambda logits, index, lse: (logits,),
    fake=lambda logits, index, lse: logits.new_empty(index.shape[:-1]),
    eager_twin=_rows_log_prob_eager,
    backward=KernelOp(
        "categorical_rows_log_prob_backward",
        _rows_log_prob_backward_twin,
        kernel=("categorical_rows_log_prob", "categorical_rows_log_prob_backward"),
        native=_rows_log_prob_backward_native,
        applies=_rows_applies_with_index,
        checked=lambda logits, index, lse, grad: (logits,),
        fake=lambda logits, index, lse, grad: logits.new_empty(logits.shape),
    ),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs),
    gradients=lambda ctx, grads, run, wants: (run(*ctx.saved_tensors, grads[0]), None, None),
)


def _propose_twin(logits: Tensor, old: Tensor, key: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    new, lse = _sample_rows_twin(logits, key)
    return _rows_log_prob_twin(logits, new, lse), new, _rows_log_prob_twin(logits, old, lse), lse


def _propose_eager(logits: Tensor, old: Tensor, key: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``propose_separately`` with the draw from ``key``."""
    new, lse = _sample_rows_eager(logits.detach(), key)
    log_q_new = _rows_log_prob_eager(logits, new, None)
    with torch.no_grad():
        log_q_old = _rows_log_prob_eager(logits, old, None)
    return log_q_new, new, log_q_old, lse


def _propose_native(fn, logits: Tensor, old: Tensor, key: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    logits, old = logits.contiguous(), old.contiguous()
    new = torch.empty(old.shape, dtype=torch.long)
    lse = logits.new_empty(old.shape)
    log_q_new, log_q_old = (logits.new_empty(old.shape[:-1]) for _ in range(2))
    call(fn, logits, old, key, new, lse, log_q_new, log_q_old, *_rows_sizes(logits, old))
    return log_q_new, new, log_q_old, lse


def _propose_save(ctx, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(inputs[0], output[1], output[3])
    ctx.mark_non_differentiable(output[1], output[2], output[3])


def _propose_fake(logits: Tensor, old: Tensor, key: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    log_q = (logits.new_empty(old.shape[:-1]) for _ in range(2))
    return (
        next(log_q),
        torch.empty(old.shape, dtype=torch.long, device=old.device),
        next(log_q),
        logits.new_empty(old.shape),
    )


# ``CategoricalBlock.propose``: the draw from the Philox key ``key``, its rows' lse and both
# groups' log q ``(log_q_new, new, log_q_old, lse)`` in one pass; differentiable in the
# logits through log q of the new values only.
categorical_propose_rows_op = KernelOp(
    "categorical_propose_rows",
    _propose_twin,
    kernel="categorical_propose_rows",
    native=_propose_native,
    applies=_rows_applies_with_index,
    checked=lambda logits, old, key: (logits,),
    fake=_propose_fake,
    eager_twin=_propose_eager,
    backward=categorical_rows_log_prob_op.backward,
    setup_context=_propose_save,
    gradients=lambda ctx, grads, run, wants: (run(*ctx.saved_tensors, grads[0]), None, None),
)


class CategoricalBlock:
    """A block of one categorical variable per point: ``name`` shaped ``(L, B, N)`` with
    logits ``(L, B, N, I)``; ``log_prob`` sums over the N points to ``(L, B)``.

    On CPU a draw also keeps each row's log-normalizer, so that scoring the drawn values
    (``log q`` of the forward kernel) and the old ones (the reverse kernel) are each one
    gather-and-sum pass over the rows (``categorical.c``: ``*_rows`` functions).
    """

    def __init__(self, name: str, logits: Tensor):
        self.name = name
        self.logits = logits
        self._lse: Tensor | None = None

    def sample(self) -> Latents:
        if not _philox_draws(self.logits):  # uniform() draws with torch's generators here
            return {self.name: categorical_sample(self.logits)}
        out, self._lse = categorical_sample_rows_op(self.logits.detach(), new_key())
        return {self.name: out}

    def log_prob(self, value: Mapping[str, Tensor]) -> Tensor:
        index = value[self.name]
        if index.dtype != torch.long:
            raise TypeError(f"categorical indices must be int64, got {index.dtype}")
        return categorical_rows_log_prob_op(self.logits, index, self._lse)

    def propose(self, old: Mapping[str, Tensor]) -> tuple[Latents, Tensor, Tensor]:
        """``apg.blocks.propose``: on CPU the draw and both scores are one pass."""
        index = old[self.name]
        if (
            not _philox_draws(self.logits)
            or index.shape != self.logits.shape[:-1]
            or index.dtype != torch.long
        ):
            return propose_separately(self, old)
        # the key sample() would take, so that both paths draw the same values
        log_q_new, new, log_q_old, _ = categorical_propose_rows_op(self.logits, index, new_key())
        return {self.name: new}, log_q_new, log_q_old
