"""Resampling schemes: pure functions with one signature, looked up by name.

A resampler maps log-weights ``(L, B)`` to ancestor indices ``(L, B)`` (long), drawn
per dataset with probabilities proportional to the weights. ``resample`` applies them
to a dict of ``(L, B, ...)`` tensors and resets the log-weights to their log-mean-exp,
so that the evidence estimate survives resampling.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from apg.host import values_on_host
from apg.kernels import call
from apg.kernels.ops import KernelOp
from apg.smc.weights import log_mean_exp, normalized_weights, sanitize

Resampler = Callable[[Tensor], Tensor]


def multinomial(log_w: Tensor) -> Tensor:
    """L independent draws from Cat(w) per dataset."""
    num_particles = log_w.shape[0]
    w = normalized_weights(log_w).T  # (B, L)
    if not values_on_host(w):
        # A dataset without a finite weight (unchecked on a device, apg.host) has NaN
        # weights, on which CUDA's multinomial stops the process with a device-side assert:
        # draw it uniformly instead; its loss is non-finite and the next logged step says so.
        w = torch.where(torch.isfinite(w).all(-1, keepdim=True), w, torch.ones_like(w))
    return torch.multinomial(w, num_particles, replacement=True).T


def systematic(log_w: Tensor) -> Tensor:
    """Systematic resampling: one uniform offset per dataset, L evenly spaced points."""
    if log_w.dim() != 2:
        return _systematic_twin(log_w, torch.rand(log_w.shape[1], 1, dtype=log_w.dtype, device=log_w.device))
    num_particles, batch = log_w.shape
    return systematic_resample_op(log_w, torch.rand(batch, 1, dtype=log_w.dtype, device=log_w.device))


def _systematic_twin(log_w: Tensor, offset: Tensor) -> Tensor:
    num_particles = log_w.shape[0]
    w = normalized_weights(log_w).T  # (B, L)
    cdf = torch.cumsum(w, dim=1)
    points = (offset + torch.arange(num_particles, dtype=w.dtype, device=w.device)) / num_particles
    # Clamp: float round-off can leave cdf[-1] slightly below the last point.
    idx = torch.searchsorted(cdf.contiguous(), points).clamp_(max=num_particles - 1)
    return idx.T.contiguous()


def _systematic_native(fn, log_w: Tensor, offset: Tensor) -> Tensor:
    """The ancestors ``(L, B)`` in one compiled pass (``apg/kernels/smc.c``). (The pass also
    writes the flat rows and outgoing log-weights that ``systematic_resample_gather`` uses.)"""
    num_particles, batch = log_w.shape
    ancestors = torch.empty(num_particles, batch, dtype=torch.long)
    flat = torch.empty(num_particles * batch, dtype=torch.long)
    out_log_w = torch.empty_like(log_w, memory_format=torch.contiguous_format)
    call(fn, log_w, offset, ancestors, flat, out_log_w, num_particles, batch)
    return ancestors


# The ancestors of systematic resampling from the offsets ``offset (B, 1)`` on [0, 1).
systematic_resample_op = KernelOp(
    "systematic_resample",
    _systematic_twin,
    kernel="systematic_resample",
    native=_systematic_native,
    checked=lambda log_w, offset: (log_w,),
    fake=lambda log_w, offset: torch.empty(log_w.shape, dtype=torch.long, device=log_w.device),
)


RESAMPLERS: dict[str, Resampler] = {"multinomial": multinomial, "systematic": systematic}


def get_resampler(name: str) -> Resampler:
    """The resampler registered as ``name``; raises ``ValueError`` for unknown names."""
    try:
        return RESAMPLERS[name]
    except KeyError:
        raise ValueError(f"unknown resampler {name!r}; choose one of {sorted(RESAMPLERS)}") from None


def gather(t: Tensor, ancestors: Tensor) -> Tensor:
    """Select particles: ``out[l, b, ...] = t[ancestors[l, b], b, ...]`` for any trailing dims."""
    return _gather_flat(t, _flat_index(ancestors))


def _flat_index(ancestors: Tensor) -> Tensor:
    """Row ``ancestors[l, b] * B + b`` of a ``(L * B, ...)`` view, flattened to ``(L * B,)``."""
    batch = ancestors.shape[1]
    return (ancestors * batch + torch.arange(batch, device=ancestors.device)).flatten()


def _gather_flat(t: Tensor, flat: Tensor) -> Tensor:
    # One index_select on the (L * B, ...) view; a 2-D advanced index costs several ops more.
    return t.flatten(0, 1).index_select(0, flat).view(-1, t.shape[1], *t.shape[2:])


def resample(
    log_w: Tensor, tensors: Mapping[str, Tensor], resampler: Resampler, *, sanitized: bool = False
) -> tuple[Tensor, dict[str, Tensor]]:
    """Resample a population.

    Returns the outgoing log-weights, every one equal to the log-mean-exp of the
    incoming ones (shape ``(L, B)``), and the tensors gathered by ancestor. ``sanitized``:
    the caller has already passed ``log_w`` through ``sanitize`` (the sampler does after
    every update), so it is not checked again.
    """
    log_w = log_w.detach() if sanitized else sanitize(log_w.detach())
    if resampler is systematic and log_w.dim() == 2 and log_w.numel() > 0:
        if all(t.device == log_w.device and t.shape[:2] == log_w.shape for t in tensors.values()):
            return _systematic_gather(log_w, tensors)
    ancestors = resampler(log_w)
    new_log_w = log_mean_exp(log_w, dim=0).expand_as(log_w).clone()
    flat = _flat_index(ancestors)
    return new_log_w, {name: _gather_flat(t, flat) for name, t in tensors.items()}


def _systematic_gather(log_w: Tensor, tensors: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """``resample`` with the systematic draw and the gathers of the contiguous tensors that
    need no gradient in one op (``systematic_resample_gather``); any other tensor is gathered
    by ``_gather_flat``. The same offsets and ancestors as ``systematic``. In a training step
    on CPU ~17 small ops per resampling become ~7."""
    copied = {k: t for k, t in tensors.items() if t.is_contiguous() and not t.requires_grad}
    offset = torch.rand(log_w.shape[1], 1, dtype=log_w.dtype, device=log_w.device)
    new_log_w, flat, out = systematic_resample_gather_op(log_w, offset, list(copied.values()))
    gathered = dict(zip(copied, out, strict=True))
    return new_log_w, {
        name: gathered[name] if name in gathered else _gather_flat(t, flat) for name, t in tensors.items()
    }


def _systematic_gather_twin(
    log_w: Tensor, offset: Tensor, tensors: list[Tensor]
) -> tuple[Tensor, Tensor, list[Tensor]]:
    new_log_w = log_mean_exp(log_w, dim=0).expand_as(log_w).clone()
    flat = _flat_index(_systematic_twin(log_w, offset))
    return new_log_w, flat, [_gather_flat(t, flat) for t in tensors]


def _systematic_gather_native(
    fn, log_w: Tensor, offset: Tensor, tensors: list[Tensor]
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``smc.c``'s ``systematic_resample_gather``: copies each tensor's rows in C."""
    tensors = [t.contiguous() for t in tensors]
    out = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    rows = log_w.numel()
    # each copied tensor's source and destination addresses and row size in bytes
    meta = torch.tensor(
        [
            [t.data_ptr(), o.data_ptr(), t.numel() // rows * t.element_size()]
            for t, o in zip(tensors, out, strict=True)
        ]
        or [[0, 0, 0]]
    )
    flat = torch.empty(rows, dtype=torch.long)
    new_log_w = torch.empty_like(log_w, memory_format=torch.contiguous_format)
    call(fn, log_w, offset, flat, new_log_w, meta, len(out), *log_w.shape)
    return new_log_w, flat, out


def _systematic_gather_fake(log_w: Tensor, offset: Tensor, tensors: list[Tensor]):
    flat = torch.empty(log_w.numel(), dtype=torch.long, device=log_w.device)
    return log_w.new_empty(log_w.shape), flat, [t.new_empty(t.shape) for t in tensors]


# ``resample`` by systematic resampling from the offsets ``offset (B, 1)``: the outgoing
# log-weights, the flat rows ``ancestors * B + b`` and ``tensors (L, B, ...)`` gathered.
systematic_resample_gather_op = KernelOp(
    "systematic_resample_gather",
    _systematic_gather_twin,
    kernel="systematic_resample_gather",
    native=_systematic_gather_native,
    applies=lambda log_w, offset, tensors: log_w.numel() > 0,
    checked=lambda log_w, offset, tensors: (log_w,),
    fake=_systematic_gather_fake,
)
