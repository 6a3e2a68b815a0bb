"""A sweep's own state under faults: damaged finished cells, a damaged resume file, two
drivers at once; and the pipeline's modules importing each other in one direction only."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from apg.checkpoint import save_checkpoint
from pipeline.common import file_digest
from pipeline.config.params import grid_cells
from pipeline.errors import SweepError
from pipeline.runs.loop import DONE, MODEL
from pipeline.runs.trial import RESUME, resume_state
from pipeline.sweep.stage import acquire_lock, check_finished, estimated_cost
from tests.pipeline.harness import tiny
from tests.support import REPO


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
    assert resume_state(None, resume) is None
    assert not resume.exists()
    assert "is damaged" in capsys.readouterr().out
    good = save_checkpoint(tmp_path / RESUME, {"a": 1}, {"trainer": {"step": 3}})
    assert resume_state(None, good) == {"trainer": {"step": 3}}


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


@pytest.mark.slow
def test_runs_carry_the_commit_the_stage_and_the_params_digest(tmp_path):
    import subprocess

    from pipeline import tracking

    tags = tracking.source_tags(REPO, "pipeline.sweep.stage", {"gmm": {"train": {"lr": 0.01}}})
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert tags["mlflow.source.git.commit"] == head and tags[tracking.TAG_STAGE] == "pipeline.sweep.stage"
    other = tracking.source_tags(REPO, "pipeline.sweep.stage", {"gmm": {"train": {"lr": 0.02}}})
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


def test_a_full_disk_at_the_write_layer_is_one_line_naming_the_path_and_the_space_left(
    tmp_path, monkeypatch, capsys
):
    import errno

    import apg.checkpoint
    from pipeline.diskfull import DiskFull, as_disk_full
    from pipeline.errors import run_guarded

    def full(payload, handle):  # what torch.save raises on a full disk: no file named
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(apg.checkpoint.torch, "save", full)
    target = tmp_path / "cell" / MODEL
    with pytest.raises(SystemExit) as info:
        run_guarded(lambda: save_checkpoint(target, {}, {}))
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"apg-pipeline: error: No space left on device: {target} (")
    assert re.search(r"\(\d+(\.\d)? (bytes|KiB|MiB|GiB) free there\)", line), line
    assert list((tmp_path / "cell").iterdir()) == []  # nothing half-written
    # Wrapped as Ray and Tune wrap a trial's or a callback's error, it is still found.
    try:
        try:
            raise DiskFull(line)
        except DiskFull as inner:
            raise RuntimeError("The Ray Tune run failed.") from inner
    except RuntimeError as outer:
        assert str(as_disk_full(outer, tmp_path)) == line
    assert as_disk_full(RuntimeError("other"), tmp_path) is None


@pytest.mark.slow
def test_a_full_disk_stops_the_sweep_at_once_without_retries(tmp_path, tiny):
    import subprocess

    from tests.pipeline.harness import env, make_repo, run

    # max_failures 3: before, Ray tried the cell four times and then started the others.
    params = tiny(**{"sweep.max_failures": 3, "sweep.max_concurrent": 1, "gmm.train.iterations": 12})
    root = make_repo(tmp_path, params)
    run([sys.executable, "-m", "pipeline.generate", "--task", "gmm"], root)
    first = max(grid_cells(params, "gmm"), key=estimated_cost).name  # the one that starts first
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.sweep.stage", "--task", "gmm"],
        cwd=root,
        env={**env(), "APG_FAULT_INJECT": f"{first}:3:disk-full"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    cells = root / "results" / "sweeps" / "gmm" / "cells"
    assert re.fullmatch(
        rf"apg-pipeline: error: No space left on device: {cells}/[^/]+/{RESUME} \(.+ free there\); .*", last
    ), last
    attempts = {p.parent.name: p.read_text().splitlines() for p in cells.glob("*/attempts.jsonl")}
    assert len(attempts) == 1 and len(next(iter(attempts.values()))) == 1, attempts  # ran once, nothing after
    assert not list(cells.glob("*/done.json")) and "Traceback" not in proc.stderr.split("\n")[-1]


def _alive(pid: int, start: int) -> bool:
    from pipeline.sweep.reaper import _stat

    info = _stat(pid)
    return info is not None and info[1] == start


def _wait_gone(procs: dict[int, int], seconds: float) -> dict[int, int]:
    import time

    deadline = time.time() + seconds
    while time.time() < deadline and any(_alive(p, t) for p, t in procs.items()):
        time.sleep(0.1)
    return {p: t for p, t in procs.items() if _alive(p, t)}


def test_the_reaper_kills_what_a_killed_driver_left_and_nothing_else(tmp_path):
    import signal
    import subprocess
    import time

    from pipeline.sweep.reaper import _processes, descendants

    # A stand-in driver: a child that forks a grandchild (as raylet forks workers), then sleeps.
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import subprocess, sys, time; subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(600)\"]); time.sleep(600)']); time.sleep(600)"
    driver = subprocess.Popen([sys.executable, "-c", code])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        deadline = time.time() + 30
        while len(descendants({driver.pid}, _processes())) < 2 and time.time() < deadline:
            time.sleep(0.05)
        watcher = subprocess.Popen([sys.executable, "-m", "pipeline.sweep.reaper", str(driver.pid)], cwd=REPO)
        time.sleep(1.5)  # the watcher has noted the driver's descendants
        left = descendants({driver.pid}, _processes())
        assert len(left) == 2
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        assert watcher.wait(timeout=30) == 0
        assert _wait_gone(left, 5) == {}
        assert bystander.poll() is None  # not the driver's: untouched
    finally:
        for proc in (driver, bystander):
            proc.kill()


@pytest.mark.slow
def test_a_killed_sweep_driver_takes_ray_s_processes_with_it(tmp_path, tiny):
    import signal
    import time

    from pipeline.sweep.reaper import _processes, descendants
    from tests.pipeline.harness import make_repo, start_sweep

    root = make_repo(tmp_path, tiny(**{"gmm.train.iterations": 4000}))
    driver = start_sweep(root)
    try:
        deadline = time.time() + 300
        trials = root / "results" / "sweeps" / "gmm" / "cells"
        while time.time() < deadline and driver.poll() is None and not list(trials.glob("*/attempts.jsonl")):
            time.sleep(0.2)
        time.sleep(2)
        ray = {
            p: t
            for p, t in descendants({driver.pid}, _processes()).items()
            if "ray" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
        }
        assert len(ray) >= 3, ray  # GCS, raylet, workers...
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        assert _wait_gone(ray, 30) == {}
    finally:
        if driver.poll() is None:
            driver.kill()
