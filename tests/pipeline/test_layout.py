"""pipeline/'s arrows point one way: planners (the sweep, the search, recorded profiles, the
CLI) call the run layer and the stages; the run layer, the stages' own packages and the
report never import a planner. Every import counts, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import REPO

PLANNERS = (
    "pipeline.cli",
    "pipeline.smoke",
    "pipeline.sweep",
    "pipeline.search",
    "pipeline.recorded.record",
    "pipeline.recorded.direct",
)
# package -> what it may never import
NEVER = {
    "pipeline/report": PLANNERS + ("apg.checkpoint", "apg.training"),  # rows and figures' data, no model
    "pipeline/runs": PLANNERS + ("pipeline.report",),
    "pipeline/evaluate": PLANNERS + ("pipeline.report", "pipeline.runs"),
    "pipeline/config": PLANNERS + ("pipeline.report", "pipeline.runs", "pipeline.evaluate"),
}


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return out


@pytest.mark.parametrize("package", sorted(NEVER))
def test_a_package_never_imports_what_sits_above_it(package):
    wrong = {
        f"{path.relative_to(REPO)}: {name}"
        for path in sorted((REPO / package).glob("*.py"))
        for name in imports(path)
        if any(name == p or name.startswith(p + ".") for p in NEVER[package])
    }
    assert not wrong, sorted(wrong)


def test_no_flat_module_list():
    """pipeline/ is its packages plus a few shared modules, not a flat list of stages."""
    flat = sorted(p.name for p in (REPO / "pipeline").glob("*.py"))
    assert len(flat) <= 12, flat
