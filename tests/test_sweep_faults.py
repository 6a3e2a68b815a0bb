"""A sweep's own state under faults: damaged finished cells, a damaged resume file, two
drivers at once; and the pipeline's modules importing each other in one direction only."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch

from apg.checkpoint import save_checkpoint
from pipeline.common import file_digest
from pipeline.config import grid_cells
from pipeline.driver import DONE, MODEL
from pipeline.errors import SweepError
from pipeline.sweep import acquire_lock, check_finished
from pipeline.trial import RESUME, _resume_state

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline import tiny  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def finished_cells(sweep_dir: Path) -> dict:
    """Every cell of the tiny grid, each with a model.pt and the done.json that records it."""
    cells = {}
    for cell in grid_cells(tiny(**{"gmm.grid.0.seeds": [0, 1]}), "gmm"):
        cell_id = cell.name.replace("/", "-")
        cells[cell_id] = cell
        cell_dir = sweep_dir / "cells" / cell_id
        cell_dir.mkdir(parents=True)
        model = save_checkpoint(cell_dir / MODEL, {"cell": cell_id}, {"w": torch.arange(4.0)})
        (cell_dir / DONE).write_text(json.dumps({"checkpoint_sha256": file_digest(model)}))
    return cells


def test_a_damaged_finished_cell_is_trained_again(tmp_path):
    cells = finished_cells(tmp_path)
    first, second, third = list(cells)[:3]
    model = tmp_path / "cells" / first / MODEL
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the archive
    model.write_bytes(bytes(data))
    (tmp_path / "cells" / second / MODEL).unlink()
    (tmp_path / "cells" / third / DONE).write_text("{not json")
    damaged = check_finished(tmp_path, cells)
    assert damaged == [cells[first].name, cells[second].name, cells[third].name]
    for cell_id in cells:
        assert (tmp_path / "cells" / cell_id / DONE).is_file() == (cell_id not in (first, second, third))
    assert check_finished(tmp_path, cells) == []  # the rest stay finished


def test_a_damaged_resume_file_is_removed_and_the_cell_starts_over(tmp_path, capsys):
    resume = tmp_path / RESUME
    resume.write_bytes(b"PK\x03\x04 not a checkpoint")
    assert _resume_state(None, resume) is None
    assert not resume.exists()
    assert "is damaged" in capsys.readouterr().out
    good = save_checkpoint(tmp_path / RESUME, {"a": 1}, {"trainer": {"step": 3}})
    assert _resume_state(None, good) == {"trainer": {"step": 3}}


def test_a_second_driver_on_the_same_cells_exits_at_once(tmp_path):
    held = acquire_lock(tmp_path, "gmm")
    with pytest.raises(SweepError, match=r"another sweep of gmm is running on .* \(pid \d+ on "):
        acquire_lock(tmp_path, "gmm")
    held.close()
    acquire_lock(tmp_path, "gmm").close()  # free again once the first has ended


def _imports(path: Path) -> set[str]:
    """The pipeline modules a file imports, at its top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pipeline")}
    return found


def test_pipeline_modules_import_each_other_without_circles():
    files = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (REPO / "pipeline").rglob("*.py")
    }
    graph = {name: {m for m in _imports(path) if m in files and m != name} for name, path in files.items()}
    # A package's modules may use each other through the package: only edges between
    # modules count, and a package's __init__ re-exporting its modules is not a circle.
    graph = {
        name: {m for m in deps if not (name.startswith(m + ".") or m.startswith(name + "."))}
        for name, deps in graph.items()
    }
    seen, stack = set(), []

    def visit(node: str) -> None:
        if node in stack:
            cycle = stack[stack.index(node) :] + [node]
            raise AssertionError(f"import circle: {' -> '.join(cycle)}")
        if node in seen:
            return
        stack.append(node)
        for dep in sorted(graph[node]):
            visit(dep)
        stack.pop()
        seen.add(node)

    for name in sorted(graph):
        visit(name)


def test_runs_carry_the_commit_the_stage_and_the_params_digest(tmp_path):
    import subprocess

    from pipeline import tracking

    tags = tracking.source_tags(REPO, "pipeline.sweep", {"gmm": {"train": {"lr": 0.01}}})
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert tags["mlflow.source.git.commit"] == head and tags[tracking.TAG_STAGE] == "pipeline.sweep"
    other = tracking.source_tags(REPO, "pipeline.sweep", {"gmm": {"train": {"lr": 0.02}}})
    assert other[tracking.TAG_PARAMS] != tags[tracking.TAG_PARAMS]
    client = tracking.client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("apg")
    parent = tracking.open_parent(client, exp, "gmm-abc", "sweep/gmm-abc", {"task": "gmm"}, tags)
    child = tracking.open_child(client, exp, parent, "cell", "gmm/apg/K5/L10/seed0", {"lr": 0.01}, tags)
    for run_id in (parent, child):
        assert client.get_run(run_id).data.tags["mlflow.source.git.commit"] == head
    # a resumed sweep reopens its parent and updates where this run of it comes from
    client.set_terminated(parent, "KILLED")
    again = tracking.open_parent(client, exp, "gmm-abc", "sweep/gmm-abc", {"task": "gmm"}, other)
    run = client.get_run(again)
    assert again == parent and run.info.status == "RUNNING"
    assert run.data.tags[tracking.TAG_PARAMS] == other[tracking.TAG_PARAMS]
