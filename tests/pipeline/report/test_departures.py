"""Numbers far from the paper's: the 2x rule in both directions, signed and missing values,
the footnotes Table 1 and the claims table print, and the reasons recorded for the committed
report's flags (pipeline/paper_numbers.yaml, ``departure_notes``) with their pointers into
docs/decisions.md.

Fast: hand-made frames and the committed Table 1 CSVs (no evaluation rows are loaded).
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pandas as pd
import pytest
import yaml

from pipeline.report.claims import ClaimResult, claims_markdown
from pipeline.report.data import PAPER_NUMBERS
from pipeline.report.departures import (
    FLAG,
    NO_REASON,
    claim_departure,
    departure_note,
    flagged_cells,
    is_far,
    note_pointers,
    paper_ratio,
    with_paper_ratios,
)
from pipeline.report.tables import table_markdown
from tests.support import REPO

PAPER = yaml.safe_load(PAPER_NUMBERS.read_text())

# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    ("ours", "paper", "far"),
    [
        (0.994, 0.398, True),  # better than the paper by 2.5x: flagged as much as worse
        (0.0157, 0.004, True),  # 3.9x the paper's KL
        (0.0017, 0.004, True),  # 0.43 of it
        (0.941, 0.760, False),
        (0.8, 0.4, False),  # exactly 2x: not more than 2x
        (0.2, 0.4, False),  # exactly half
        (0.81, 0.4, True),
        (0.19, 0.4, True),
    ],
)
def test_more_than_twice_or_less_than_half_is_far_either_way(ours, paper, far):
    assert is_far(paper_ratio(ours, paper)) is far


def test_signed_quantities_take_the_quotient_as_printed():
    # Δ log joint: both differences to the first row; ours 16.5 against 211.9.
    assert paper_ratio(16.5, 211.9) == pytest.approx(0.0779, abs=1e-4)
    assert is_far(paper_ratio(16.5, 211.9))
    # A KL estimate below 0 (Monte Carlo noise) against a positive one: opposite signs, far.
    assert paper_ratio(-0.0003, 0.004) < 0 and is_far(paper_ratio(-0.0003, 0.004))
    # A negative Δ against a negative one of similar size is not far.
    assert not is_far(paper_ratio(-150.0, -200.0))
    # The baseline row against a paper row that is not 0: ours 0 is far (ratio 0).
    assert paper_ratio(0.0, 2538.0) == 0 and is_far(0.0)


@pytest.mark.parametrize(
    ("ours", "paper"), [(0.0, 0.0), (5.0, 0.0), (np.nan, 0.4), (0.4, np.nan), (None, 0.4), (0.4, None)]
)
def test_no_ratio_where_the_paper_has_0_or_either_value_is_missing(ours, paper):
    assert math.isnan(paper_ratio(ours, paper)) and not is_far(paper_ratio(ours, paper))


def test_notes_per_metric_per_method_default_and_missing():
    notes = {
        "kl_c": {"reason": "inputs", "see": "docs/decisions.md#gmm-c-inputs"},
        "sweep_ess": {"apg": {"reason": "near-exact"}, "*": {"reason": "particles", "see": "x#y"}},
    }
    assert departure_note(notes, "kl_c", "rws-mlp") == "inputs (docs/decisions.md#gmm-c-inputs)"
    assert departure_note(notes, "sweep_ess", "apg") == "near-exact"
    assert departure_note(notes, "sweep_ess", "apg [network.hidden=64]") == "near-exact"
    assert departure_note(notes, "sweep_ess", "rws-lstm") == "particles (x#y)"
    assert departure_note(notes, "ess_c", "apg") == NO_REASON
    assert departure_note(None, "kl_c", "apg") == NO_REASON
    assert sorted(note_pointers(notes)) == ["docs/decisions.md#gmm-c-inputs", "x#y"]


# --------------------------------------------------------------------------- tables


def _table() -> pd.DataFrame:
    """A Table 1 as ``tables.table1`` makes it: means, stds, the paper's column."""
    return pd.DataFrame(
        {
            "method": ["rws-mlp", "apg", "apg", "gibbs"],
            "K": [10, 5, 10, 10],
            "L": [10, 10, 10, 10],
            "d_log_joint": [0.0, 14.9, 16.5, 15.3],
            "d_log_joint_std": [10.0, 20.0, 19.0, 19.0],
            "paper_d_log_joint": [0.0, 198.5, 211.9, np.nan],
            "sweep_ess": [0.04, 0.30, 0.994, 1.0],
            "sweep_ess_std": [0.03, 0.1, 0.007, 0.0],
            "paper_sweep_ess": [0.001, 0.261, 0.398, np.nan],
        }
    )


def test_table_flags_far_numbers_beside_ours_with_ratio_and_reason():
    paper = {
        "departure_notes": {
            "sweep_ess": {"apg": {"reason": "near-exact kernels", "see": "docs/decisions.md#a"}}
        }
    }
    table = with_paper_ratios(_table(), paper)
    # rws-mlp's Δ is against a paper 0 (no ratio); gibbs has no paper row; apg K=5 ESS is 1.15x.
    assert [(pos, m) for pos, m, _, _ in flagged_cells(table)] == [
        (0, "sweep_ess"),
        (1, "d_log_joint"),
        (2, "d_log_joint"),
        (2, "sweep_ess"),
    ]
    assert table["paper_ratio_sweep_ess"].iloc[2] == pytest.approx(0.994 / 0.398)
    assert math.isnan(table["paper_ratio_d_log_joint"].iloc[0])
    md = table_markdown(table)
    lines = md.splitlines()
    assert "| apg | 10 | 10 | 16.5 ± 19.0 ⚑2 | 211.9 | 0.994 ± 0.007 ⚑3 | 0.398 |" in lines
    assert "| apg | 5 | 10 | 14.9 ± 20.0 ⚑2 | 198.5 | 0.300 ± 0.100 | 0.261 |" in lines
    assert "| gibbs | 10 | 10 | 15.3 ± 19.0 |  | 1.000 ± 0.000 |  |" in lines
    assert f"- {FLAG}3 ESS/L all blocks (per-sweep resampling): ratio 2.5 (apg K=10) to the paper: " in md
    assert "near-exact kernels (docs/decisions.md#a)." in md
    # No note recorded for rws-mlp's ESS or for the Δ column: the footnote says so.
    assert (
        f"- {FLAG}1 ESS/L all blocks (per-sweep resampling): ratio 40 (rws-mlp K=10) to the paper: {NO_REASON}."
        in md
    )
    assert f"- {FLAG}2 Δ log p(x,z): ratio 0.075 (apg K=5), 0.078 (apg K=10) to the paper: {NO_REASON}." in md


def test_a_table_with_nothing_far_keeps_its_layout():
    table = _table().iloc[[1]].assign(d_log_joint=150.0, sweep_ess=0.3)
    md = table_markdown(with_paper_ratios(table, None))
    assert FLAG not in md and md.count("\n") == 2


def test_a_threshold_claim_at_the_papers_number_is_flagged_when_far():
    spec = {
        "id": "ess",
        "kind": "threshold",
        "metric": "sweep_ess",
        "method": "apg",
        "pair": [10, 10],
        "op": ">=",
        "target": 0.398,
    }
    paper = {
        "rows": [{"method": "apg", "K": 10, "sweep_ess": 0.398}],
        "departure_notes": {"sweep_ess": {"reason": "near-exact", "see": "d#a"}},
    }
    assert claim_departure(spec, 0.994, paper) == "ratio 2.5 to the paper's 0.398: near-exact (d#a)"
    assert claim_departure(spec, 0.6, paper) == ""
    assert claim_departure(spec, None, paper) == ""  # not run
    assert claim_departure({**spec, "pair": [50, 10]}, 0.994, paper) == ""  # the paper has no K=50
    assert claim_departure({**spec, "kind": "above", "other": "rws-mlp"}, 0.994, paper) == ""
    result = ClaimResult(
        "gmm",
        "ess",
        "overall ESS",
        "5.3",
        "apg K=10 L=10: 0.994",
        "≥ 0.398",
        True,
        "",
        0.994,
        0.99,
        0.996,
        0.398,
        ("c0",),
        departure=claim_departure(spec, 0.994, paper),
    )
    md = claims_markdown([result], {}, [])
    assert "| apg K=10 L=10: 0.994 ⚑1 |" in md
    assert "- ⚑1 gmm, ess: ratio 2.5 to the paper's 0.398: near-exact (d#a)." in md


# --------------------------------------------------------------------------- the committed report


def _anchors(markdown: str) -> set[str]:
    """Explicit ``<a id="...">`` anchors and GitHub's slugs of the headings."""
    ids = set(re.findall(r'<a id="([^"]+)"', markdown))
    for heading in re.findall(r"^#+ (.+)$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        ids.add(slug)
    return ids


def test_every_recorded_reason_points_to_an_entry_of_decisions_md():
    pointers = [
        p
        for task in PAPER.values()
        if isinstance(task, dict)
        for p in note_pointers(task.get("departure_notes"))
    ]
    assert pointers
    for pointer in pointers:
        path, _, anchor = pointer.partition("#")
        target = REPO / path
        assert target.is_file(), pointer
        assert anchor in _anchors(target.read_text()), f"{pointer}: no such anchor"


COMMITTED_TABLES = sorted(
    [
        *(REPO / "reports" / "tables").glob("*_table1.csv"),
        *(REPO / "reports" / "recorded").glob("*/tables/*_table1.csv"),
    ]
)


@pytest.mark.parametrize("csv", COMMITTED_TABLES, ids=lambda p: str(p.relative_to(REPO / "reports")))
def test_every_flag_of_the_committed_tables_has_a_reason(csv):
    task = csv.name.removesuffix("_table1.csv")
    table = with_paper_ratios(pd.read_csv(csv), PAPER.get(task))
    missing = [
        (table["method"][pos], table["K"][pos], metric)
        for pos, metric, _, note in flagged_cells(table)
        if note == NO_REASON
    ]
    assert not missing, f"flagged without a reason in {csv.name}: {missing}"


def test_every_flag_of_the_committed_claims_has_a_reason():
    claims = json.loads((REPO / "reports" / "data" / "metrics-full.json").read_text())["claims"]
    for task, paper in PAPER.items():
        for spec in (paper.get("claims") or []) + (paper.get("paper_scale_claims") or []):
            found = claims.get(f"{task}/{spec['id']}")
            if found is None:
                continue
            assert NO_REASON not in claim_departure(spec, found["value"], paper), f"{task}/{spec['id']}"
