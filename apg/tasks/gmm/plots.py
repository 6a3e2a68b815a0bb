"""Pictures of the GMM: one dataset with one sample of its latents (Figure 1).

Legend: N points, I clusters; numpy arrays of one dataset (no particle or batch dims).
"""

from __future__ import annotations


def draw(ax, x, z) -> None:
    """``TaskSpec.draw``: points ``x (N, 2)`` coloured by ``z["c"] (N,)``, each cluster's
    mean ``z["mu"] (I, 2)`` and its 2-sd axis-aligned ellipse from ``z["tau"] (I, 2)``."""
    from matplotlib.patches import Ellipse

    c, mu, tau = z["c"], z["mu"], z["tau"]
    colours = [f"C{i % 10}" for i in range(len(mu))]
    ax.scatter(x[:, 0], x[:, 1], s=6, c=[colours[i] for i in c], alpha=0.7, linewidths=0)
    for i, (m, t) in enumerate(zip(mu, tau, strict=True)):
        sd = 1.0 / (t**0.5)
        ax.add_patch(Ellipse(m[:2], 4 * sd[0], 4 * sd[-1], fill=False, color=colours[i], lw=1.0))
        ax.scatter([m[0]], [m[1]], marker="x", color=colours[i], s=30)
    ax.set_aspect("equal")
