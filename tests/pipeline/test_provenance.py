"""Results are the code's own: code digests in cell ids, and the committed reports' record.

The last test is the CI check of the issue "results are HEAD's": the committed
``reports/provenance.json`` must match this checkout's code and params, or the results
sections of README.md and reports/README.md must open with the stale line that
``python -m pipeline.provenance mark`` writes (naming what changed since).
"""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import yaml

from pipeline.provenance import record as provenance
from pipeline.provenance import stages
from tests.support import REPO

DVC = {
    "stages": {
        "sweep": {
            "foreach": ["a", "b"],
            "do": {
                "cmd": "x",
                "deps": ["apg/tasks/${item}.py", "apg/core.py", "data/${item}/train.npz"],
                "params": ["${item}.train", "sweep"],
            },
        },
        "report": {"cmd": "y", "deps": ["pipeline/report.py", "results/eval"], "params": ["report"]},
    }
}
PARAMS = {
    "tasks": ["a", "b"],
    "sweep": {"n": 1},
    "a": {"train": {"lr": 1}},
    "b": {"train": {"lr": 2}},
    "report": {},
}


def make_project(root: Path) -> Path:
    for rel, text in (
        ("apg/tasks/a.py", "A = 1\n"),
        ("apg/tasks/b.py", "B = 1\n"),
        ("apg/core.py", "CORE = 1\n"),
        ("pipeline/report.py", "R = 1\n"),
        ("README.md", "# x\n\n## Results\n\nnumbers\n"),
        ("reports/README.md", "# Reproduction report\n\ntable\n"),
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "dvc.yaml").write_text(yaml.safe_dump(DVC))
    (root / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    return root


def test_stage_code_is_the_code_deps_of_dvc_yaml(tmp_path):
    root = make_project(tmp_path)
    assert stages.stage_code(root, "sweep", "a") == ["apg/tasks/a.py", "apg/core.py"]
    assert stages.stage_params(root, "sweep", "b") == ["b.train", "sweep"]


def test_stage_code_reads_deps_relative_to_the_stages_wdir(tmp_path):
    """A dvc file in a subfolder names its deps from there, or from its ``wdir``."""
    root = make_project(tmp_path)
    (root / "sub").mkdir()
    local = {"stages": {"s": {"cmd": "x", "deps": ["../apg/core.py", "notes.txt"]}}}
    (root / "sub/dvc.yaml").write_text(yaml.safe_dump(local))
    assert stages.stage_code(root, "s", dvc_file="sub/dvc.yaml") == ["apg/core.py"]
    up = {
        "stages": {
            "s": {"foreach": ["a"], "do": {"wdir": "..", "cmd": "x", "deps": ["apg/tasks/${item}.py"]}}
        }
    }
    (root / "sub/dvc.yaml").write_text(yaml.safe_dump(up))
    assert stages.stage_code(root, "s", "a", dvc_file="sub/dvc.yaml") == ["apg/tasks/a.py"]


def test_code_digest_follows_exactly_the_stage_code(tmp_path):
    root = make_project(tmp_path)
    a, b = (stages.code_digest("sweep", t, root) for t in "ab")
    (root / "apg/tasks/b.py").write_text("B = 2\n")  # task b's code: a's cells keep their id
    assert stages.code_digest("sweep", "a", root) == a
    assert stages.code_digest("sweep", "b", root) != b
    (root / "apg/core.py").write_text("CORE = 2\n")  # shared code: every cell changes
    assert stages.code_digest("sweep", "a", root) != a
    # a folder dep (dvc.yaml lists apg/baselines, apg/smc, ...) counts its files but not
    # bytecode or built extensions
    before = stages.file_digests(root, ["apg"])
    assert set(before) == {"apg/core.py", "apg/tasks/a.py", "apg/tasks/b.py"}
    (root / "apg/__pycache__").mkdir()
    (root / "apg/__pycache__/core.cpython-311.pyc").write_bytes(b"\0")
    (root / "apg/core.pyc").write_bytes(b"\0")
    (root / "apg/_kernels.so").write_bytes(b"\0")
    assert stages.file_digests(root, ["apg"]) == before
    (root / "apg/extra.py").write_text("X = 1\n")  # while a new source file is code
    assert set(stages.file_digests(root, ["apg"])) == set(before) | {"apg/extra.py"}


def test_check_names_what_changed_and_mark_writes_then_clears_the_stale_line(tmp_path):
    root = make_project(tmp_path)
    provenance.write_record(PARAMS, root, root / "reports")
    assert provenance.check(root)[0]
    (root / "apg/core.py").write_text("CORE = 2\n")
    params = {**PARAMS, "a": {"train": {"lr": 5}}}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    current, message = provenance.check(root)
    assert not current
    assert "`apg/core.py`" in message and "`a.train`" in message and "`b.train`" not in message
    provenance.mark(root, message)
    assert set(provenance.current_banners(root).values()) == {message}
    readme = (root / "README.md").read_text()
    assert readme.index("## Results") < readme.index(message) < readme.index("numbers")
    provenance.mark(root, message)  # idempotent: one stale line, not two
    assert (root / "README.md").read_text().count(provenance.BANNER_START) == 1
    provenance.write_record(params, root, root / "reports")  # regenerated: current again
    assert provenance.check(root)[0]
    provenance.mark(root, None)
    assert set(provenance.current_banners(root).values()) == {None}
    assert (root / "README.md").read_text() == "# x\n\n## Results\n\nnumbers\n"


def test_a_rebuild_from_the_committed_rows_refreshes_only_the_report_stages_own_inputs(tmp_path):
    root = make_project(tmp_path)
    path = provenance.write_record(PARAMS, root, root / "reports")
    assert provenance.report_only_inputs(root, PARAMS["tasks"]) == (["pipeline/report.py"], ["report"])
    (root / "pipeline/report.py").write_text("R = 2\n")  # report code: the rebuild runs it
    refreshed = provenance.refresh_report_inputs(PARAMS, root, path)
    assert refreshed is not None and provenance.check(root)[0]
    (root / "apg/core.py").write_text("CORE = 2\n")  # training code: only retraining makes it current
    provenance.refresh_report_inputs(PARAMS, root, path)
    current, message = provenance.check(root)
    assert not current and "`apg/core.py`" in message and "pipeline/report.py" not in message
    assert provenance.refresh_report_inputs(PARAMS, root, root / "none.json") is None


def test_the_record_names_uncommitted_code_by_its_full_path(tmp_path):
    root = make_project(tmp_path)
    for cmd in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
    ):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
    (root / "apg" / "core.py").write_text("CORE = 2\n")  # git status: " M apg/core.py"
    assert provenance.record(PARAMS, root)["uncommitted"] == ["apg/core.py"]


def test_committed_results_are_this_checkouts_or_say_they_are_stale():
    current, message = provenance.check(REPO)
    banners = provenance.current_banners(REPO)
    if current:
        assert set(banners.values()) == {None}, f"results are current but a stale line remains: {banners}"
    else:
        assert set(banners.values()) == {message}, (
            f"committed results are stale and not marked so ({message}); run `dvc repro`, or "
            "`python -m pipeline.provenance mark` to say so in README.md and reports/README.md"
        )


def _module_file(name: str) -> Path | None:
    path = REPO / Path(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_code(module: str) -> set[str]:
    """The project files ``module`` imports at module level, transitively (imports inside
    functions are left out: they run only on the paths that need them)."""
    seen: set[Path] = set()
    main = REPO / Path(*module.split(".")) / "__main__.py"  # `python -m` of a package runs this
    todo = [main if main.is_file() else _module_file(module)]
    while todo:
        path = todo.pop()
        if path is None or path in seen:
            continue
        seen.add(path)
        package = path.relative_to(REPO).parent.parts
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = list(package[: len(package) - node.level + 1]) if node.level else []
                module_name = ".".join(base + ([node.module] if node.module else []))
                names = [module_name, *(f"{module_name}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] in stages.CODE_PREFIXES:
                    todo += [_module_file(".".join(parts[: i + 1])) for i in range(len(parts))]
    return {p.relative_to(REPO).as_posix() for p in seen}


def test_each_stage_lists_the_code_it_imports():
    """A code file a stage imports but does not list would change its results without DVC,
    the cell ids or the provenance check noticing. Each task's stages list only their own
    task package (``apg/tasks/${item}``), so the other tasks' packages are left out by design."""
    all_tasks = yaml.safe_load((REPO / "params.yaml").read_text())["tasks"]
    for dvc_file in ("dvc.yaml", "tuning/dvc.yaml"):
        for stage, spec in yaml.safe_load((REPO / dvc_file).read_text())["stages"].items():
            body = spec.get("do", spec)
            module = body["cmd"].split("python -m ", 1)[1].split()[0]
            foreach = spec.get("foreach")
            tasks = (all_tasks if foreach == "${tasks}" else foreach) if foreach else [None]
            for task in tasks:
                listed = set(stages.code_files(REPO, stages.stage_code(REPO, stage, task, dvc_file)))
                others = set(
                    stages.code_files(REPO, [f"apg/tasks/{t}" for t in all_tasks if task and t != task])
                )
                missing = _imported_code(module) - others - listed
                assert not missing, (
                    f"{dvc_file}: {stage} ({task or 'all tasks'}) does not list {sorted(missing)}"
                )


def test_the_record_names_the_machine_the_results_were_made_on(tmp_path):
    root = make_project(tmp_path)
    made = provenance.record(PARAMS, root)["machine"]
    assert set(made) == {"cpu", "vector", "cores", "torch", "python"}
    assert made["cores"] >= 1 and made["torch"] and made["cpu"]
    line = provenance.machine_line(
        {"cpu": "X", "vector": ["avx2"], "cores": 2, "torch": "2.13", "python": "3.11"}
    )
    assert line == "X (avx2), 2 cores; torch 2.13, Python 3.11"


NUMBERS = {"a": {"data": "d1", "train": {"c": "t1"}, "evaluate": {"apg": "e1"}}}


def test_refresh_takes_code_that_computes_the_recorded_numbers(tmp_path, monkeypatch):
    from pipeline.provenance import numerics

    root = make_project(tmp_path)
    provenance.write_record(PARAMS, root, root / "reports", NUMBERS)
    (root / "apg/core.py").write_text("CORE = 1  # moved, same numbers\n")
    assert not provenance.check(root)[0]
    monkeypatch.setattr(numerics, "numerics", lambda params: NUMBERS)
    kept, message = provenance.refresh(root)
    assert kept and "1 code files changed" in message, message
    assert provenance.check(root)[0]


def test_refresh_changes_nothing_when_a_number_moved_or_the_params_did(tmp_path, monkeypatch):
    from pipeline.provenance import numerics

    root = make_project(tmp_path)
    path = provenance.write_record(PARAMS, root, root / "reports", NUMBERS)
    before = path.read_bytes()
    (root / "apg/core.py").write_text("CORE = 2\n")
    moved = {"a": {**NUMBERS["a"], "evaluate": {"apg": "e2"}}}
    monkeypatch.setattr(numerics, "numerics", lambda params: moved)
    kept, message = provenance.refresh(root)
    assert not kept and "a/evaluate/apg" in message and path.read_bytes() == before
    monkeypatch.setattr(numerics, "numerics", lambda params: NUMBERS)
    (root / "params.yaml").write_text(yaml.safe_dump({**PARAMS, "a": {"train": {"lr": 5}}}))
    kept, message = provenance.refresh(root)
    assert not kept and "a.train" in message and path.read_bytes() == before


def test_refresh_leaves_the_report_stages_own_code_to_a_rebuild_of_the_report(tmp_path, monkeypatch):
    from pipeline.provenance import numerics

    root = make_project(tmp_path)
    provenance.write_record(PARAMS, root, root / "reports", NUMBERS)
    (root / "pipeline/report.py").write_text("R = 2\n")  # what a rebuild runs, not the numerics
    monkeypatch.setattr(numerics, "numerics", lambda params: NUMBERS)
    assert provenance.refresh(root)[0]
    current, message = provenance.check(root)
    assert not current and "`pipeline/report.py`" in message


def test_refresh_on_a_new_cpu_type_checks_against_what_the_recorded_code_computes_there(
    tmp_path, monkeypatch
):
    """The numerics of another CPU type differ in their last bits: on a CPU type the record
    has not seen, the recorded code's own numbers here are the baseline, kept beside the
    others'."""
    from pipeline.provenance import numerics

    root = make_project(tmp_path)
    other = {"a": {**NUMBERS["a"], "evaluate": {"apg": "e-other-cpu"}}}
    path = provenance.write_record(PARAMS, root, root / "reports", other)
    recorded = json.loads(path.read_text())
    recorded["numerics"] = {"Other CPU (avx2); torch 2.13": other}
    path.write_text(json.dumps(recorded))
    (root / "apg/core.py").write_text("CORE = 1  # moved, same numbers\n")
    monkeypatch.setattr(numerics, "numerics", lambda params: NUMBERS)
    monkeypatch.setattr(provenance, "recorded_code_numerics", lambda root, recorded, params: NUMBERS)
    kept, message = provenance.refresh(root)
    assert kept and "checked on 2 CPU types" in message, message
    table = json.loads(path.read_text())["numerics"]
    assert table["Other CPU (avx2); torch 2.13"] == other and NUMBERS in table.values()
    # the same baseline against moved numbers: refused, nothing written
    before = path.read_bytes()
    (root / "apg/core.py").write_text("CORE = 2\n")
    monkeypatch.setattr(numerics, "numerics", lambda params: other)
    kept, message = provenance.refresh(root)
    assert not kept and "a/evaluate/apg" in message and path.read_bytes() == before


def test_numerics_keys_name_the_cpu_type_and_torch_alone():
    key = provenance.numerics_key
    line = "AMD EPYC (avx512f, avx2, fma), 2 cores; torch 2.13.0+cpu, Python 3.11.7"
    assert key(line) == "AMD EPYC (avx512f, avx2, fma); torch 2.13.0+cpu"
    assert key(line.replace("2 cores", "16 cores").replace("3.11.7", "3.12.1")) == key(line)


def test_numerics_differences_name_each_moved_number():
    from pipeline.provenance.numerics import differences

    moved = {"a": {"data": "d2", "train": {"c": "t1", "n": "t9"}, "evaluate": {"apg": "e1"}}}
    assert differences(NUMBERS, NUMBERS) == []
    assert differences(NUMBERS, moved) == ["a/data", "a/train/n"]


def test_refresh_that_cannot_compute_the_numerics_is_one_line_and_changes_nothing(tmp_path, monkeypatch):
    from pipeline.provenance import numerics

    root = make_project(tmp_path)
    path = provenance.write_record(PARAMS, root, root / "reports", NUMBERS)
    before = path.read_bytes()
    (root / "apg/core.py").write_text("CORE = 1  # moved\n")

    def missing(params):
        raise FileNotFoundError("MNIST files not found\nsecond line")

    monkeypatch.setattr(numerics, "numerics", missing)
    kept, message = provenance.refresh(root)
    assert not kept and message.startswith(
        "the numerics could not be computed here (FileNotFoundError: MNIST"
    )
    assert "second line" not in message and path.read_bytes() == before
