"""Held-out scores of the GMM's inferred assignments that need the simulator's truth.

Legend: M datasets, N points, I clusters, D data dimensions.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from apg.tasks.gmm.conjugate import assignment_logits


def bayes_assignments(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """``argmax_i p(c_n = i | x_n, mu, tau)`` at the true ``mu, tau`` of each dataset, ``(M, N)``:
    the best any sampler can do per point (the prior on ``c`` is uniform, so the
    likelihood decides). ``arrays``: a held-out file's ``x (M, N, D)``, ``mu`` and
    ``tau (M, I, D)``."""
    x, mu, tau = (torch.from_numpy(arrays[k]).to(torch.float64) for k in ("x", "mu", "tau"))
    return assignment_logits(x, mu[None], tau[None])[0].argmax(-1).numpy()
