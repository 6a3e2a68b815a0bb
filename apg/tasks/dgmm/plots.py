"""Pictures of the rings: one dataset with one sample of its latents (Figure 1).

Legend: N points, I clusters; numpy arrays of one dataset (no particle or batch dims).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from apg.tasks.dgmm.model import DGMM, TWO_PI


def draw(ax, x: np.ndarray, z: Mapping[str, np.ndarray], model: DGMM | None = None) -> None:
    """Scatter one dataset ``x (N, 2)`` coloured by ``z["c"] (N,)`` and mark the centres
    ``z["mu"] (I, 2)``; draw the learned ring around each centre.

    The ring is ``mu_i + g_theta`` over a grid of angles when ``model`` is given; otherwise,
    when ``z`` carries ``"recon" (N, 2)`` (this particle's ``reconstruct`` output), each
    point's reconstruction is marked, a ring of dots on the learned shape (joining ~N/I
    dots into a polygon would draw a shape the model does not have). With neither, only
    points and centres are drawn (``TaskSpec.draw`` gets no model).
    """
    c, mu = np.asarray(z["c"]), np.asarray(z["mu"])
    colours = [f"C{i % 10}" for i in range(len(mu))]
    ax.scatter(x[:, 0], x[:, 1], s=6, c=[colours[i] for i in c], alpha=0.7, linewidths=0)
    shape = None
    if model is not None:
        with torch.no_grad():
            grid = torch.linspace(0.0, TWO_PI, 101, dtype=next(model.parameters()).dtype)
            shape = model.g(grid).numpy()
    for i, centre in enumerate(mu):
        if shape is not None:
            curve = centre + shape
            ax.plot(curve[:, 0], curve[:, 1], color=colours[i], lw=1.0)
        elif "recon" in z:
            recon = np.asarray(z["recon"])[c == i]
            ax.scatter(
                recon[:, 0], recon[:, 1], s=5, marker="o", facecolors="none", edgecolors=colours[i], lw=0.6
            )
        ax.scatter([centre[0]], [centre[1]], marker="x", color=colours[i], s=30)
    ax.set_aspect("equal")
