"""The stages' numerics fingerprints (pipeline.provenance.numerics): the same code gives the same
digests, and a change in what a stage computes changes exactly its own."""

from __future__ import annotations

import copy

import pytest

from pipeline.config import profiles
from pipeline.config.params import grid_cells
from pipeline.provenance import numerics

pytestmark = pytest.mark.slow


def test_the_same_code_gives_the_same_digests_and_a_moved_number_moves_its_own():
    params = profiles.load("smoke")
    base = numerics.task_numerics(params, "gmm")
    assert numerics.task_numerics(params, "gmm") == base
    assert set(base["evaluate"]) == {c.method for c in grid_cells(params, "gmm")}

    data = copy.deepcopy(params)
    data["gmm"]["model"]["nu0"] = 0.3 * 1.05
    moved = numerics.differences({"gmm": base}, {"gmm": numerics.task_numerics(data, "gmm")})
    assert "gmm/data" in moved

    lr = copy.deepcopy(params)
    lr["gmm"]["train"]["lr"] = params["gmm"]["train"]["lr"] * 1.5
    moved = numerics.differences({"gmm": base}, {"gmm": numerics.task_numerics(lr, "gmm")})
    assert "gmm/data" not in moved and any(m.startswith("gmm/train/") for m in moved)
