"""Small distributions the tasks share, written for the sampler's hot loop.

``torch.distributions.Categorical`` samples through ``softmax`` + ``multinomial``, which
costs several times more than an inverse-CDF draw on the many short rows (one per point)
that assignment blocks have; argument validation costs more than the arithmetic too.
On CPU, draws and log-probabilities of such rows run as single passes in the compiled
kernels (``apg/kernels/categorical.c``); the PyTorch formulas below are their twins.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from apg.blocks import Latents, propose_separately
from apg.kernels import call, native_function
from apg.random import new_key, uniform


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
    u = uniform(cdf.shape[:-1], cdf.dtype, cdf.device).unsqueeze(-1)
    # Scale u by the last cdf entry so round-off can never push it past the end.
    return (cdf[..., :-1] < u * cdf[..., -1:]).sum(-1)


def categorical_sample(logits: Tensor) -> Tensor:
    """One draw per row of unnormalized ``logits (..., I)``, ``(...)`` (long)."""
    logits = logits.detach()
    native = native_function("categorical_sample", logits)
    if native is None:
        return sample_categorical(log_softmax_short(logits))
    u = uniform(logits.shape[:-1], logits.dtype)
    out = torch.empty(logits.shape[:-1], dtype=torch.long)
    call(native, logits, u, out, out.numel(), logits.shape[-1])
    return out


class _CategoricalLogProb(torch.autograd.Function):
    """``log_softmax(logits)[..., index]`` in one pass per row, forward and backward."""

    @staticmethod
    def forward(ctx, logits: Tensor, index: Tensor, forward_fn, backward_fn) -> Tensor:
        logits, index = logits.contiguous(), index.contiguous()
        out, lse = (logits.new_empty(index.shape) for _ in range(2))
        call(forward_fn, logits, index, out, lse, index.numel(), logits.shape[-1])
        ctx.save_for_backward(logits, index, lse)
        ctx.backward_fn = backward_fn
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, index, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        call(ctx.backward_fn, logits, index, lse, grad, grad_logits, index.numel(), logits.shape[-1])
        return grad_logits, None, None, None


def categorical_log_prob(logits: Tensor, index: Tensor) -> Tensor:
    """``log p(index)`` per row under ``softmax(logits (..., I))``, ``(...)``; differentiable
    in ``logits``."""
    if index.dtype != torch.long:
        raise TypeError(f"categorical indices must be int64, got {index.dtype}")
    native = native_function("categorical_log_prob", logits)
    if native is None:
        return log_softmax_short(logits).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    backward = native_function("categorical_log_prob_backward", logits)
    return _CategoricalLogProb.apply(logits, index, native, backward)


class _CategoricalRowsLogProb(torch.autograd.Function):
    """``sum_n log_softmax(logits)[..., n, index_n]`` per group of rows, one pass forward
    and backward, from the rows' log-normalizers ``lse`` (computed here where not given)."""

    @staticmethod
    def forward(ctx, logits: Tensor, index: Tensor, lse: Tensor | None, forward_fn, backward_fn) -> Tensor:
        logits, index = logits.contiguous(), index.contiguous()
        have_lse = lse is not None
        lse = lse if lse is not None else logits.new_empty(index.shape)
        out = logits.new_empty(index.shape[:-1])
        sizes = (out.numel(), index.shape[-1], logits.shape[-1])
        call(forward_fn, logits, index, lse, out, int(have_lse), *sizes)
        ctx.save_for_backward(logits, index, lse)
        ctx.backward_fn, ctx.sizes = backward_fn, sizes
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, index, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        call(ctx.backward_fn, logits, index, lse, grad.contiguous(), grad_logits, *ctx.sizes)
        return grad_logits, None, None, None, None


class _CategoricalPropose(torch.autograd.Function):
    """``CategoricalBlock.propose``: the draw, its rows' lse and both groups' log q in one
    compiled pass; differentiable in the logits through log q of the new values only."""

    @staticmethod
    def forward(ctx, logits: Tensor, old: Tensor, key: int, forward_fn, backward_fn):
        logits, old = logits.contiguous(), old.contiguous()
        new = torch.empty(old.shape, dtype=torch.long)
        lse = logits.new_empty(old.shape)
        log_q_new, log_q_old = (logits.new_empty(old.shape[:-1]) for _ in range(2))
        ctx.sizes = (log_q_new.numel(), old.shape[-1], logits.shape[-1])
        call(forward_fn, logits, old, key, new, lse, log_q_new, log_q_old, *ctx.sizes)
        ctx.save_for_backward(logits, new, lse)
        ctx.mark_non_differentiable(new, log_q_old)
        ctx.backward_fn = backward_fn
        return log_q_new, new, log_q_old

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_new, _grad_old):
        logits, new, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        call(ctx.backward_fn, logits, new, lse, grad.contiguous(), grad_logits, *ctx.sizes)
        return grad_logits, None, None, None, None


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

    def _native(self, name: str):
        logits = self.logits
        if logits.dim() < 2 or logits.shape[-1] > 64:  # categorical.c's MAX_K
            return None
        return native_function(name, logits)

    def sample(self) -> Latents:
        native = self._native("categorical_sample_rows")
        if native is None:
            return {self.name: categorical_sample(self.logits)}
        logits = self.logits.detach().contiguous()
        out = torch.empty(logits.shape[:-1], dtype=torch.long)
        lse = logits.new_empty(logits.shape[:-1])
        # the uniforms categorical_sample would draw (apg.random.uniform), drawn in the kernel
        call(native, logits, new_key(), out, lse, out.numel(), logits.shape[-1])
        self._lse = lse
        return {self.name: out}

    def log_prob(self, value: Mapping[str, Tensor]) -> Tensor:
        index = value[self.name]
        native = self._native("categorical_rows_log_prob")
        if native is None or index.shape != self.logits.shape[:-1]:
            return categorical_log_prob(self.logits, index).sum(-1)
        if index.dtype != torch.long:
            raise TypeError(f"categorical indices must be int64, got {index.dtype}")
        backward = native_function("categorical_rows_log_prob_backward", self.logits)
        return _CategoricalRowsLogProb.apply(self.logits, index, self._lse, native, backward)

    def propose(self, old: Mapping[str, Tensor]) -> tuple[Latents, Tensor, Tensor]:
        """``apg.blocks.propose``: on CPU the draw and both scores are one pass."""
        index = old[self.name]
        native = self._native("categorical_propose_rows")
        if native is None or index.shape != self.logits.shape[:-1] or index.dtype != torch.long:
            return propose_separately(self, old)
        backward = native_function("categorical_rows_log_prob_backward", self.logits)
        # the key sample() would take, so that both paths draw the same values
        log_q_new, new, log_q_old = _CategoricalPropose.apply(self.logits, index, new_key(), native, backward)
        return {self.name: new}, log_q_new, log_q_old
