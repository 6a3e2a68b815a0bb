"""Evaluate-side rows the report reads: which cells feed which table (the scores
themselves: tests/apg/test_metrics.py and tests/apg/test_particles.py)."""

from __future__ import annotations


def test_cell_roles_split_pairs_from_budget_entries(tiny):
    from pipeline.evaluate.stage import cell_pairs, cell_roles

    params = tiny(
        **{
            "gmm.grid": [
                {"methods": ["apg", "rws-mlp"], "pairs": [[2, 3]], "seeds": [0]},
                {"methods": ["apg"], "budget": {"total": 6, "sweeps": [2, 3]}, "seeds": [0]},
            ]
        }
    )
    roles = cell_roles(params, "gmm")
    assert roles == {
        "gmm/apg/K2/L3/seed0": ["budget", "main"],
        "gmm/rws-mlp/K2/L3/seed0": ["main"],
        "gmm/apg/K3/L2/seed0": ["budget"],
    }
    everything = [(2, 3), (3, 2), (4, 3)]
    assert cell_pairs(["budget"], {"K": 3, "L": 2}, everything) == [(3, 2)]
    assert cell_pairs(["budget", "main"], {"K": 2, "L": 3}, everything) == everything
