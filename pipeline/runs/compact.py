"""A trainer's state in about a third of its bytes, for a run kept in git.

``apg.training.Trainer.state_dict`` holds float32 weights and Adam's two moments: 59 MB for
the paper's Bouncing MNIST networks (4.9 M numbers). :func:`compact` stores

- the weights in float16 (a relative error of 2^-11, about what a tenth of one Adam step
  at lr 1e-4 moves them; a test shows evaluation unchanged);
- Adam's first moment in int8, linearly in blocks of ``BLOCK`` numbers scaled by the block's
  largest magnitude (an average over the last ~10 steps at beta1 = 0.9: what it loses is
  forgotten as fast);
- Adam's second moment as the log of its square root in uint8, per block between the block's
  extremes, roots below ``ROOT_FLOOR`` raised to it (relative error at most half a code
  step: under 6% on a block spanning 40 octaves; forgotten over ~100 steps at beta2 =
  0.99); code 0 is an exact zero;
- the data order as uint16 (int32 past 65,536 rows); the step count, cursor and random
  state as they are,

1 + 1 + 2 bytes a number in place of 12: 20 MB for those networks. :func:`expand` makes a
state ``Trainer.load_state_dict`` takes. A continuation from it is the run with its moments
and weights perturbed once, by the amounts above; one from the full state is exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

BLOCK = 4096
# log2 of the smallest square root of a second moment kept apart from smaller ones: 1/16 of
# Adam's eps (1e-8), below which the root no longer changes an update (it is divided by
# root + eps). Without the floor, subnormal moments stretch a block's range to ~90 octaves.
ROOT_FLOOR = math.log2(1e-8 / 16)
FORMAT = "apg-compact-state-1"


def compact(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a ``Trainer.state_dict()``) with its large tensors quantized (see the module)."""
    optimizer = state["optimizer"]
    moments = {}
    for key, entry in optimizer.get("state", {}).items():
        moments[key] = {
            name: _encode_moment(name, value) if name in ("exp_avg", "exp_avg_sq") else value
            for name, value in entry.items()
        }
    return {
        "format": FORMAT,
        "model": _half(state["model"]),
        "proposals": _half(state["proposals"]),
        "optimizer": {**optimizer, "state": moments} if optimizer else {},
        "iteration": state["iteration"],
        "order": state["order"].to(torch.uint16 if len(state["order"]) <= 2**16 else torch.int32),
        "cursor": state["cursor"],
        "rng": state["rng"],
    }


def expand(stored: dict[str, Any]) -> dict[str, Any]:
    """The ``Trainer.state_dict()`` a :func:`compact` state stands for (float32 again)."""
    if stored.get("format") != FORMAT:
        raise ValueError(
            f"not a compact trainer state (format {stored.get('format')!r}, expected {FORMAT!r})"
        )
    optimizer = stored["optimizer"]
    moments = {
        key: {
            name: _decode_moment(value) if isinstance(value, dict) else value for name, value in entry.items()
        }
        for key, entry in optimizer.get("state", {}).items()
    }
    return {
        "model": _full(stored["model"]),
        "proposals": _full(stored["proposals"]),
        "optimizer": {**optimizer, "state": moments} if optimizer else {},
        "iteration": stored["iteration"],
        "order": stored["order"].to(torch.int64),
        "cursor": stored["cursor"],
        "rng": stored["rng"],
    }


def _half(weights: dict[str, Tensor]) -> dict[str, Any]:
    return {k: (v.to(torch.float16), v.dtype) if v.is_floating_point() else v for k, v in weights.items()}


def _full(weights: dict[str, Any]) -> dict[str, Tensor]:
    return {k: v[0].to(v[1]) if isinstance(v, tuple) else v for k, v in weights.items()}


def _blocks(t: Tensor) -> tuple[Tensor, int]:
    """``t`` flattened, in float64 (float32's subnormal second moments have exact logs there),
    zero-padded to whole blocks: ``(blocks, BLOCK)``, and its size."""
    flat = t.detach().reshape(-1).to(torch.float64)
    pad = (-flat.numel()) % BLOCK
    return torch.nn.functional.pad(flat, (0, pad)).reshape(-1, BLOCK), flat.numel()


def _unblock(blocks: Tensor, size: int) -> Tensor:
    return blocks.reshape(-1)[:size].clone()  # the padding is not stored


def _encode_moment(name: str, t: Tensor) -> dict[str, Any]:
    blocks, size = _blocks(t)
    meta = {"kind": name, "shape": tuple(t.shape), "dtype": t.dtype, "size": size}
    if name == "exp_avg":  # signed: linear in the block's largest magnitude
        scale = blocks.abs().amax(1, keepdim=True) / 127.0
        codes = torch.round(blocks / torch.where(scale > 0, scale, 1.0)).to(torch.int8)
        return {**meta, "codes": _unblock(codes, size), "scale": scale.to(torch.float32)}
    # exp_avg_sq >= 0: the log of its root, between each block's extremes; 0 stays 0
    nonzero = blocks > 0
    log_root = torch.where(nonzero, 0.5 * torch.log2(torch.where(nonzero, blocks, 1.0)), 0.0).clamp_min(
        ROOT_FLOOR
    )
    lo = torch.where(nonzero, log_root, torch.inf).amin(1, keepdim=True)
    hi = torch.where(nonzero, log_root, -torch.inf).amax(1, keepdim=True)
    lo, hi = torch.where(torch.isfinite(lo), lo, 0.0), torch.where(torch.isfinite(hi), hi, 0.0)
    span = torch.where(hi > lo, hi - lo, 1.0)
    codes = torch.where(nonzero, 1.0 + torch.round((log_root - lo) / span * 254.0), 0.0).to(torch.uint8)
    return {**meta, "codes": _unblock(codes, size), "lo": lo, "span": span}


def _decode_moment(stored: dict[str, Any]) -> Tensor:
    size = stored["size"]
    codes = torch.nn.functional.pad(stored["codes"], (0, (-size) % BLOCK)).reshape(-1, BLOCK)
    if stored["kind"] == "exp_avg":
        values = codes.to(torch.float64) * stored["scale"].to(torch.float64)
    else:
        log_root = stored["lo"] + (codes.to(torch.float64) - 1.0) / 254.0 * stored["span"]
        values = torch.where(codes > 0, torch.exp2(2.0 * log_root), 0.0)
    return values.reshape(-1)[:size].reshape(stored["shape"]).to(stored["dtype"])
