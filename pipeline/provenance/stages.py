"""What ``dvc.yaml`` says each stage reads, the digest of that code, each stage's time, and
the commit the code came from.

The digests say which source made a result (:mod:`pipeline.provenance.record`, the recorded runs'
manifests); they are not part of any cell id, which holds what the training code computes
(:mod:`apg.fingerprint`) instead. Paths that are not code (``data/``, ``results/``) are
left out of a stage's code.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import subprocess
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import checks

CODE_PREFIXES = ("apg", "pipeline")
TIMINGS = "results/timings"  # one {stage}@{task}.json per stage run: its wall time


def package_root() -> Path:
    """The directory holding ``apg/`` and ``pipeline/`` as imported (the repo, when
    installed with ``pip install -e``)."""
    return Path(__file__).resolve().parents[2]


def stage_specs(root: Path, dvc_file: str = "dvc.yaml") -> dict[str, Any] | None:
    path = root / dvc_file
    if not path.is_file():
        return None
    return yaml.safe_load(path.read_text())["stages"]


def _expand(value: Any, task: str | None) -> Any:
    return value.replace("${item}", task) if isinstance(value, str) and task is not None else value


def stage_code(root: Path, stage: str, task: str | None = None, dvc_file: str = "dvc.yaml") -> list[str]:
    """Code paths (files or folders, relative to ``root``) that ``stage`` of ``dvc_file``
    depends on.

    Without a ``dvc.yaml`` (the package installed without its repo) every code folder counts.
    """
    stages = stage_specs(root, dvc_file)
    if stages is None:
        return list(CODE_PREFIXES)
    spec = stages[stage]
    spec = spec.get("do", spec)
    # DVC reads deps relative to the stage's wdir, itself relative to the dvc file's folder
    base = Path(dvc_file).parent / spec.get("wdir", ".")
    deps = [posixpath.normpath((base / _expand(d, task)).as_posix()) for d in spec.get("deps", [])]
    return [d for d in deps if d.split("/", 1)[0] in CODE_PREFIXES]


def stage_params(root: Path, stage: str, task: str | None = None) -> list[str]:
    """The params keys ``stage`` reads, as dotted names."""
    stages = stage_specs(root)
    if stages is None:
        return []
    spec = stages[stage]
    spec = spec.get("do", spec)
    return [_expand(p, task) for p in spec.get("params", []) if isinstance(p, str)]


def code_files(root: Path, paths: list[str]) -> list[str]:
    """The files under ``paths``, sorted; bytecode and caches excluded."""
    out: set[str] = set()
    for rel in paths:
        path = root / rel
        candidates = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
        for f in candidates:
            if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc", ".so", ".o"):
                out.add(f.relative_to(root).as_posix())
    return sorted(out)


def file_digests(root: Path, paths: list[str]) -> dict[str, str]:
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest()[:16] for f in code_files(root, paths)}


def code_digest(stage: str = "sweep", task: str | None = None, root: Path | None = None) -> str:
    """One digest of the code ``stage`` runs for ``task`` (12 hex digits)."""
    root = root or package_root()
    digests = file_digests(root, stage_code(root, stage, task))
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:12]


def record_stage_time(root: Path, stage: str, task: str | None, seconds: float) -> None:
    """Note how long a stage took (the README's per-stage breakdown; never a metric)."""
    from apg.data import atomic_write

    name = f"{stage}@{task}" if task else stage
    text = json.dumps({"stage": name, "seconds": round(seconds, 1)})
    atomic_write(root / TIMINGS / f"{name}.json", lambda tmp: tmp.write_text(text + "\n"))


def stage_times(root: Path) -> dict[str, float]:
    """``{stage@task: seconds}`` recorded by the stages of the last run in ``root``, in
    pipeline order (generate, sweep, evaluate per task, then the report)."""
    folder = root / TIMINGS
    if not folder.is_dir():
        return {}
    order = {"generate": 0, "sweep": 1, "evaluate": 2}
    times = {p.stem: checks.read_json(p)["seconds"] for p in folder.glob("*.json")}
    return dict(sorted(times.items(), key=lambda kv: (order.get(kv[0].split("@")[0], 3), kv[0])))


def git_commit(root: Path, short: bool = True) -> str:
    """``root``'s HEAD (10 hex digits, or whole), "unknown" outside git."""
    proc = subprocess.run(
        ["git", "rev-parse", *(["--short=10"] if short else []), "HEAD"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def source_commit(root: Path, short: bool = True) -> str:
    """The project's commit the code running in ``root`` came from: ``APG_COMMIT`` where a
    sandbox (smoke, a recorded profile) or a copy without git history (a GPU machine's)
    names it, its own repo's commit naming nothing a reader has; else ``git_commit``."""
    return os.environ.get("APG_COMMIT") or git_commit(root, short)
