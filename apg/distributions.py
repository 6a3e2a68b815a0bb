"""Small distributions the tasks share, written for the sampler's hot loop.

``torch.distributions.Categorical`` samples through ``softmax`` + ``multinomial``, which
costs several times more than an inverse-CDF draw on the many short rows (one per point)
that assignment blocks have; argument validation costs more than the arithmetic too.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from apg.blocks import Latents


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
    u = torch.rand(cdf.shape[:-1], dtype=cdf.dtype, device=cdf.device).unsqueeze(-1)
    # Scale u by the last cdf entry so round-off can never push it past the end.
    return (cdf[..., :-1] < u * cdf[..., -1:]).sum(-1)


class CategoricalBlock:
    """A block of one categorical variable per point: ``name`` shaped ``(L, B, N)`` with
    logits ``(L, B, N, I)``; ``log_prob`` sums over the N points to ``(L, B)``."""

    def __init__(self, name: str, logits: Tensor):
        self.name = name
        self.log_probs = log_softmax_short(logits)

    def sample(self) -> Latents:
        return {self.name: sample_categorical(self.log_probs)}

    def log_prob(self, value: Mapping[str, Tensor]) -> Tensor:
        return self.log_probs.gather(-1, value[self.name].unsqueeze(-1)).squeeze(-1).sum(-1)
