"""What produced the results: digests of the code and params behind every stage.

Two uses:

- **Which numbers.** A sweep cell's id holds the numerics fingerprint of its training
  (:mod:`apg.fingerprint`), not the source text. The record keeps every cell's fingerprint,
  and when the code has changed since, ``check`` also says how many of the recorded cells
  ``dvc repro`` would retrain (none after a refactor that kept the numbers).
- **Committed results are HEAD's.** The report stage writes ``reports/provenance.json``:
  the digest of every code file and params key any stage reads, and the commit they were
  made at. ``python -m pipeline.provenance check`` compares that record with the working
  tree and says either that the results are current or ``stale since <commit>: <what
  changed>``; ``mark`` writes that line at the top of the results sections of
  ``README.md`` and ``reports/README.md`` (and removes it once the results are current
  again), and the test suite fails when the two disagree. So a commit that changes code
  without regenerating either says so where the numbers are read, or does not pass CI.

A rebuild of the report from its committed rows (``apg-pipeline report --from-committed``)
runs only the report stage: the record then takes the digests of the code only that stage
reads (``refresh_report_inputs``) and keeps the rest as the training and evaluation left it.

- **Code that computes the same numbers keeps the results.** The record also holds the
  numerics fingerprint of every stage (:mod:`pipeline.provenance.numerics`: a few datasets generated,
  trained on and scored by the stages' own code). After a change to the code that should
  not move a number (a refactor, a new input check), ``python -m pipeline.provenance
  refresh`` recomputes those fingerprints; when every one is unchanged, it takes the code's
  new digests into the record (and into ``dvc.lock``, so DVC sees no changed stage either),
  and the results stay current without retraining. When any differs it changes nothing,
  names the numbers that moved and exits 1: ``dvc repro`` regenerates them.

The code each stage reads is taken from ``dvc.yaml`` by :mod:`pipeline.provenance.stages` (one list,
so the provenance record and DVC's own change detection agree).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import checks
from pipeline.provenance.stages import (
    CODE_PREFIXES,
    code_files,
    file_digests,
    git_commit,
    stage_code,
    stage_params,
    stage_specs,
)

RECORD = "provenance.json"
# The results sections the stale line is written into: (file, heading it follows).
BANNER_PLACES = (("README.md", "## Results"), ("reports/README.md", "# Reproduction report"))
BANNER_START, BANNER_END = "<!-- provenance:stale -->", "<!-- /provenance:stale -->"


def _lookup(params: dict[str, Any], dotted: str) -> Any:
    node: Any = params
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def params_digests(params: dict[str, Any], keys: list[str]) -> dict[str, str]:
    return {
        k: hashlib.sha256(json.dumps(_lookup(params, k), sort_keys=True).encode()).hexdigest()[:16]
        for k in sorted(set(keys))
    }


def _all_stage_inputs(root: Path, tasks: list[str]) -> tuple[list[str], list[str]]:
    stages = stage_specs(root) or {}
    code, keys = [], []
    for stage, spec in stages.items():
        for task in tasks if "foreach" in spec else [None]:
            code += stage_code(root, stage, task)
            keys += stage_params(root, stage, task)
    return code, keys


REPORT_STAGE = "report"


def report_only_inputs(root: Path, tasks: list[str]) -> tuple[list[str], list[str]]:
    """The code files and params keys that the report stage reads and no other stage does:
    what a rebuild from the committed rows runs afresh (``apg-pipeline report --from-committed``)."""
    stages = stage_specs(root) or {}
    code, keys = [], []
    for stage, spec in stages.items():
        if stage != REPORT_STAGE:
            for task in tasks if "foreach" in spec else [None]:
                code += stage_code(root, stage, task)
                keys += stage_params(root, stage, task)
    if REPORT_STAGE not in stages:
        return [], []
    mine = set(code_files(root, stage_code(root, REPORT_STAGE))) - set(code_files(root, code))
    return sorted(mine), sorted(set(stage_params(root, REPORT_STAGE)) - set(keys))


def refresh_report_inputs(params: dict[str, Any], root: Path, path: Path) -> dict[str, Any] | None:
    """After a rebuild from the committed rows, the record at ``path`` with the report stage's
    own inputs (``report_only_inputs``) at this checkout's digests, written back; what
    trained and evaluated stays as recorded, its commit included (``None``: no record
    there). The same rows and code give the same record, byte for byte."""
    from apg.data import atomic_write

    if not path.is_file():
        return None
    recorded = checks.read_json(path)
    files, keys = report_only_inputs(root, params["tasks"])
    others = set(code_files(root, _all_stage_inputs(root, params["tasks"])[0])) - set(files)
    now = file_digests(root, sorted(others))
    # A file the record names that is gone now was the report's alone when every other
    # stage's code is as recorded (their imports of it would have changed them): drop it.
    # Otherwise keep it, and the results stay stale until the stages that read it rerun.
    unchanged = all(recorded.get("code", {}).get(k) == v for k, v in now.items())
    code = {
        k: v
        for k, v in recorded.get("code", {}).items()
        if (root / k).is_file() or (k not in files and not unchanged)
    }
    recorded["code"] = {**code, **file_digests(root, files)}
    recorded["params"] = {**recorded.get("params", {}), **params_digests(params, keys)}
    # No commit of the rebuild: the checkout's HEAD is the parent of the commit the record
    # goes into, so it would change at every rebuild of the same rows; the digests above
    # say what the report was made from, and stay as they are while that code does.
    recorded.pop("report_commit", None)
    text = json.dumps(recorded, indent=2, sort_keys=True)
    atomic_write(path, lambda tmp: tmp.write_text(text + "\n"))
    return recorded


def machine() -> dict[str, Any]:
    """The machine these results are being made on: CPU model, the vector extensions that
    change float arithmetic (the native kernels are built for the host), cores, and the
    versions of torch and Python. Results differ across CPUs, so every record names its own."""
    import platform

    import torch

    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    vector = [f for f in ("avx512f", "avx2", "fma", "amx_tile", "neon", "asimd") if f in flags]
    return {
        "cpu": model,
        "vector": vector,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def machine_line(m: dict[str, Any]) -> str:
    """``machine()`` in one line, as the report prints it."""
    vector = f" ({', '.join(m['vector'])})" if m.get("vector") else ""
    return f"{m['cpu']}{vector}, {m['cores']} cores; torch {m['torch']}, Python {m['python']}"


def device_line(device: str | Any) -> str:
    """A device as the records of runs name it: the GPU's name, or this machine's CPU line."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return machine_line(machine())


def utc_now() -> str:
    """Now, as the records of runs write it (``2026-11-27T09:30:00Z``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def uncommitted(root: Path, paths: list[str]) -> list[str]:
    """The code files under ``paths`` that differ from the commit (``git status``)."""
    files = code_files(root, paths)
    if not files:  # `git status --` with no paths would report the whole tree
        return []
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", *files],
        cwd=root,
        capture_output=True,
        text=True,
    ).stdout  # not stripped: each line starts with its two status columns, the first may be a space
    return [line[3:] for line in dirty.splitlines() if line]


def cell_fingerprints(root: Path, tasks: list[str]) -> dict[str, dict[str, dict[str, str]]]:
    """``{task: {cell name: {cell_id, fingerprint}}}`` of the trained cells the results were
    made from (each task's ``results/<task>/sweep.json``; a task without one is left out)."""
    out = {}
    for task in tasks:
        path = root / "results" / task / "sweep.json"
        if path.is_file():
            rows = checks.read_json(path)["cells"]
            out[task] = {
                row["name"]: {"cell_id": row["cell_id"], "fingerprint": row.get("fingerprint")}
                for row in rows
            }
    return out


def record(params: dict[str, Any], root: Path, numbers: dict[str, Any] | None = None) -> dict[str, Any]:
    """What produced the results of ``params`` in ``root``: commit, code and params digests,
    the numerics fingerprint each trained cell was trained under and, given, the stages'
    numerics (``pipeline.provenance.numerics.numerics``)."""
    code, keys = _all_stage_inputs(root, params["tasks"])
    digests = file_digests(root, code)
    out = {
        "commit": git_commit(root),
        # Code that differed from that commit when the results were made.
        "uncommitted": uncommitted(root, code),
        "code": digests,
        "params": params_digests(params, keys),
        "fingerprints": cell_fingerprints(root, params["tasks"]),
        "machine": machine(),
    }
    if numbers is not None:
        out["numerics"] = {numerics_key(machine_line(out["machine"])): numbers}
    return out


def numerics_key(line: str) -> str:
    """The part of a machine line (``machine_line``) that the numerics depend on: the CPU with
    its vector extensions, and torch. Float results differ across CPU types in their last
    bits, and some fingerprints keep those, so a record keeps the numerics of each CPU type
    it was checked on; the count of cores and the Python version change none of them."""
    found = re.match(r"(?P<cpu>.*), \d+ cores; torch (?P<torch>[^,]+)", line)
    return f"{found['cpu']}; torch {found['torch']}" if found else line


def numerics_by_cpu(recorded: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``recorded``'s numerics per CPU type; a record that kept one machine's numerics flat
    (``numerics`` by task, ``numerics_machine`` its line) reads as that machine's."""
    table = recorded.get("numerics") or {}
    if "numerics_machine" in recorded:
        return {numerics_key(recorded["numerics_machine"]): table}
    return dict(table)


def recorded_code_numerics(root: Path, recorded: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The numerics that the recorded code computes on this machine: the last commit that
    wrote the record (whose stage code must be the recorded code) is exported to a temporary
    folder and runs there. Raises ``ValueError`` with one line where it cannot."""
    import tempfile

    commit = subprocess.run(
        ["git", "log", "-1", "--format=%H", "--", str(Path("reports") / RECORD)],
        cwd=root,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not commit:
        raise ValueError(f"no commit of reports/{RECORD} in git to take the recorded code from")
    report_files = set(report_only_inputs(root, params["tasks"])[0])
    with tempfile.TemporaryDirectory(prefix="apg-recorded-code-") as tmp:
        archive = subprocess.run(["git", "archive", commit], cwd=root, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        then = {k: v for k, v in record(params, Path(tmp))["code"].items() if k not in report_files}
        kept = {k: v for k, v in recorded.get("code", {}).items() if k not in report_files}
        if then != kept:
            raise ValueError(
                f"the stage code of {commit[:10]} (the record's last commit) is not the recorded code"
            )
        script = (
            "import json, sys, yaml; from pipeline.provenance.numerics import numerics; "
            "print(json.dumps(numerics(yaml.safe_load(open('params.yaml')))))"
        )
        env = {**os.environ, "PYTHONPATH": tmp}
        proc = subprocess.run(
            [sys.executable, "-c", script], cwd=tmp, env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ValueError(f"the recorded code ({commit[:10]}) could not compute its numerics here: {last}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def retraining(root: Path, params: dict[str, Any], recorded: dict[str, Any]) -> str:
    """What ``dvc repro`` would retrain now: the recorded cells whose id the code and params in
    ``root`` no longer give, and of those how many for their numerics fingerprint (one line).
    Recomputes the fingerprints, so it needs each task's training data."""
    from pipeline.sweep.stage import plan

    old = recorded.get("fingerprints") or {}
    if not old:
        return "Training numerics: not recorded with these results."
    changed, numerics, total, unchecked = [], [], 0, {}
    for task, cells in sorted(old.items()):
        if task not in params.get("tasks", []):
            unchecked[task] = "not in params.yaml's tasks"
            continue
        if not (root / "data" / task / "train.npz").is_file():
            unchecked[task] = "no training data: run the generate stage"
            continue
        try:
            now = {cell.name: (cid, cell.fingerprint) for cid, cell in plan(params, task, root)[0].items()}
        except Exception as err:  # noqa: BLE001 - one task's failure must not hide the others
            unchecked[task] = f"{type(err).__name__}: {checks.first_line(err)}"
            continue
        total += len(cells)
        for name, was in sorted(cells.items()):
            cell_id, print_ = now.get(name, (None, None))
            if cell_id != was["cell_id"]:
                changed.append(name)
                if print_ != was["fingerprint"]:
                    numerics.append(name)
    line = f"Training: {len(changed)} of {total} recorded cells would retrain"
    if changed:
        shown = ", ".join(changed[:5]) + (" and more" if len(changed) > 5 else "")
        by_numerics = ", ".join(numerics[:8]) + (" and more" if len(numerics) > 8 else "")
        line += f" ({shown}; {len(numerics)} for their numerics fingerprint"
        line += f" ({by_numerics})" if numerics else ""
        line += ", the rest for their config or data)"
    else:
        line += ": every cell id, fingerprint included, is unchanged"
    line += "".join(f"; not checked for {task} ({why})" for task, why in unchecked.items())
    return line + "."


def write_record(
    params: dict[str, Any], root: Path, out: Path, numbers: dict[str, Any] | None = None
) -> Path:
    from apg.data import atomic_write

    text = json.dumps(record(params, root, numbers), indent=2, sort_keys=True)
    path = out / RECORD
    atomic_write(path, lambda tmp: tmp.write_text(text + "\n"))
    return path


def dvc_repo(root: Path):
    """DVC's repo at ``root``, its INFO lines (a line per lock file written) left out."""
    import logging

    from dvc.repo import Repo

    logging.getLogger("dvc").setLevel(logging.WARNING)
    return Repo(str(root))


def lock_inputs(root: Path, only: str | None = None, paths: tuple[str, ...] = ()) -> int:
    """Write the hashes of the stages' code (and of ``paths``, where a stage lists them as
    inputs or outputs) as they are in ``root`` into ``dvc.lock`` (and every other lock file),
    as ``dvc commit`` would for those paths alone; ``only``: that stage alone. Inputs that
    are not here (``data/``, ``results/``) keep their recorded hashes. Returns how many
    entries moved. Only for code whose numbers are checked unchanged (:func:`refresh`), and
    for a report rebuilt from its committed rows: a fresh clone's ``dvc status`` then lists
    the absent results and no changed stage."""
    moved = 0
    repo = dvc_repo(root)
    try:
        with repo.lock:
            for stage in repo.index.stages:
                if only is not None and stage.name != only:
                    continue
                entries = [d for d in stage.deps if type(d).__name__ == "Dependency"] + (
                    list(stage.outs) if paths else []
                )
                touched = False
                for entry in entries:
                    path = entry.def_path
                    if not (
                        path.split("/", 1)[0] in CODE_PREFIXES
                        or path in paths
                        or any(path.startswith(p + "/") for p in paths)
                    ):
                        continue
                    if not entry.exists:
                        continue
                    before = (entry.hash_info, entry.meta.size if entry.meta else None)
                    entry.save()
                    moved += (entry.hash_info, entry.meta.size if entry.meta else None) != before
                    touched = True
                if touched:
                    stage.dump(update_pipeline=False)
    finally:
        repo.close()
    return moved


def refresh(root: Path, params_file: str = "params.yaml", reports: str = "reports") -> tuple[bool, str]:
    """Take this checkout's code into the committed record when it computes the recorded
    numbers (``(True, what it checked)``); else change nothing (``(False, why)``).

    The params must be the recorded ones: other params are other results. Where the code
    is exactly the recorded code, the numerics it computes now are the results' own and
    are written in (a record made before numerics were kept gains them that way)."""
    from apg.data import atomic_write
    from pipeline.provenance.numerics import differences, numerics

    path = root / reports / RECORD
    if not path.is_file():
        return False, f"no {reports}/{RECORD}: the results were not made by the report stage"
    recorded = checks.read_json(path)
    params = yaml.safe_load((root / params_file).read_text())
    now = record(params, root)
    moved_params = sorted(
        k
        for k in set(recorded.get("params", {})) | set(now["params"])
        if recorded.get("params", {}).get(k) != now["params"].get(k)
    )
    if moved_params:
        return (
            False,
            f"params changed ({', '.join(moved_params)}): other params are other results; `dvc repro`",
        )
    # The report stage's own code is taken by a rebuild of the report, which runs it.
    report_files = set(report_only_inputs(root, params["tasks"])[0])
    old_code = {k: v for k, v in recorded.get("code", {}).items() if k not in report_files}
    new_code = {k: v for k, v in now["code"].items() if k not in report_files}
    code_changed = sorted(k for k in set(old_code) | set(new_code) if old_code.get(k) != new_code.get(k))
    try:
        numbers = numerics(params)
    except Exception as err:  # noqa: BLE001 - any stage's refusal (no MNIST here, say): one line, nothing written
        return (
            False,
            f"the numerics could not be computed here ({type(err).__name__}: {checks.first_line(err)}); nothing changed",
        )
    table, here = numerics_by_cpu(recorded), numerics_key(machine_line(machine()))
    if code_changed:
        if "numerics" not in recorded:
            return False, "the record holds no numerics to compare with: `dvc repro` regenerates the results"
        if here not in table:
            # First check on this CPU type: what the recorded code computes here is the
            # baseline (the numbers of another CPU type differ in their last bits).
            try:
                table[here] = recorded_code_numerics(root, recorded, params)
            except (ValueError, subprocess.CalledProcessError) as err:
                return (
                    False,
                    f"no numerics recorded for {here}, and {checks.first_line(err)}; nothing changed",
                )
        moved = differences(table[here], numbers)
        if moved:
            shown = ", ".join(moved[:8]) + (f" and {len(moved) - 8} more" if len(moved) > 8 else "")
            return False, f"the code computes other numbers ({shown}): `dvc repro` regenerates the results"
    recorded["code"] = {
        **{k: v for k, v in recorded.get("code", {}).items() if k in report_files},
        **new_code,
    }
    recorded["numerics"] = {**table, here: numbers}
    recorded.pop("numerics_machine", None)
    text = json.dumps(recorded, indent=2, sort_keys=True)
    atomic_write(path, lambda tmp: tmp.write_text(text + "\n"))
    if (root / "dvc.yaml").is_file() and (root / ".dvc").is_dir():
        lock_inputs(root)
    count = sum(len(v["train"]) + len(v["evaluate"]) + 1 for v in numbers.values())
    cpus = f" (checked on {len(recorded['numerics'])} CPU types)" if len(recorded["numerics"]) > 1 else ""
    if not code_changed:
        return (
            True,
            f"the code is the recorded code: its {count} numerics fingerprints written into {reports}/{RECORD}",
        )
    return True, (
        f"{len(code_changed)} code files changed and all {count} numerics fingerprints are unchanged{cpus}: "
        f"their digests taken into {reports}/{RECORD}"
    )


def changes(root: Path, params: dict[str, Any], recorded: dict[str, Any]) -> list[str]:
    """Code files and params keys whose digests differ from ``recorded`` (sorted)."""
    now = record(params, root)
    out = []
    for kind in ("code", "params"):
        old, new = recorded.get(kind, {}), now[kind]
        out += sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return out


def stale_line(recorded: dict[str, Any], changed: list[str]) -> str:
    shown = ", ".join(f"`{c}`" for c in changed[:8]) + (
        f" and {len(changed) - 8} more" if len(changed) > 8 else ""
    )
    return (
        f"**Stale since {recorded.get('commit', 'unknown')}:** {shown} changed after these results "
        "were made; `dvc repro` regenerates them (`python -m pipeline.provenance refresh` keeps them "
        "where the code still computes the same numbers)."
    )


def check(root: Path, params_file: str = "params.yaml", reports: str = "reports") -> tuple[bool, str]:
    """``(current, message)`` for the committed results of ``root``."""
    path = root / reports / RECORD
    if not path.is_file():
        return False, f"no {reports}/{RECORD}: the results were not made by the report stage"
    recorded = checks.read_json(path)
    params = yaml.safe_load((root / params_file).read_text())
    changed = changes(root, params, recorded)
    if not changed:
        return True, f"results are current (made at {recorded.get('commit')})"
    return False, stale_line(recorded, changed)


def banner(text: str) -> str:
    return f"{BANNER_START}\n> {text}\n{BANNER_END}\n"


def current_banners(root: Path) -> dict[str, str | None]:
    """The stale line each results section opens with now (None: none)."""
    out: dict[str, str | None] = {}
    for rel, _ in BANNER_PLACES:
        text = (root / rel).read_text() if (root / rel).is_file() else ""
        start, end = text.find(BANNER_START), text.find(BANNER_END)
        out[rel] = (
            text[start + len(BANNER_START) : end].strip().removeprefix("> ") if 0 <= start < end else None
        )
    return out


def mark(root: Path, message: str | None) -> None:
    """Put ``message`` (or nothing, when None) right under each results section's heading."""
    for rel, heading in BANNER_PLACES:
        set_banner(root / rel, heading, message)


def set_banner(path: Path, heading: str, message: str | None) -> None:
    """Replace the stale line of one file by ``message`` (none when None), under ``heading``."""
    text = path.read_text()
    start, end = text.find(BANNER_START), text.find(BANNER_END)
    if 0 <= start < end:
        text = text[:start] + text[end + len(BANNER_END) :].lstrip("\n")
    if message is not None:
        at = text.find(heading)
        if at < 0:
            raise ValueError(f"{path.name} has no '{heading}' heading to put the stale line under")
        at = text.index("\n", at) + 1
        text = text[:at] + "\n" + banner(message) + text[at:].lstrip("\n")
        text = text.replace(BANNER_END + "\n", BANNER_END + "\n\n", 1)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="are the committed results the code's own?")
    parser.add_argument(
        "action",
        choices=["check", "mark", "refresh"],
        help="check: say; mark: also write the stale line; refresh: take changed code that "
        "computes the recorded numbers into the record",
    )
    parser.add_argument("--root", default=".")
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    if args.action == "refresh":
        kept, message = refresh(root)
        print(message)
        if not kept:
            return 1
    current, message = check(root)
    if args.action in ("mark", "refresh"):
        mark(root, None if current else message)
    print(message)
    if not current and (root / "reports" / RECORD).is_file():
        # Not part of the stale line: it depends on the data present here, the line must not.
        recorded = checks.read_json(root / "reports" / RECORD)
        print(retraining(root, yaml.safe_load((root / "params.yaml").read_text()), recorded))
    return 0 if current or args.action != "check" else 1


if __name__ == "__main__":
    sys.exit(main())
