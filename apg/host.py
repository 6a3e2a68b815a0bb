"""Whether a tensor's values can be read on the host for free.

On a CPU, ``bool(t)`` or ``t.item()`` costs a few nanoseconds; on a GPU each one waits for
every queued kernel (a host synchronization), and inside ``torch.compile`` it breaks the
graph. The samplers use such reads for checks (finite parameters, degenerate weights) and
for CPU shortcuts (computing a block once per distinct particle after resampling). Each
site asks :func:`values_on_host` first and, where it says no, takes the device path: no
check (a bad value surfaces as a non-finite loss when the training loop logs) and no
shortcut (every particle computed).
"""

from __future__ import annotations

import torch
from torch import Tensor


def values_on_host(t: Tensor) -> bool:
    """True for a CPU tensor outside ``torch.compile``: reading its values syncs nothing."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()
