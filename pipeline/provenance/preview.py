"""What ``dvc repro`` would run now, and about how long it would take: ``apg-pipeline preview``.

DVC says which stages of ``dvc.yaml`` are out of date (their results absent, or an input
changed); the committed report says how long each stage took on the machine that made the
committed results (``reports/data/stage_times.json``, ``reports/provenance.json``). A stage
absent from those times (a new task) shows no estimate. ``dvc repro --dry`` is no substitute:
it stops at the first input that is not there yet (a clone's ``data/``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import checks

TIMES = Path("reports/data/stage_times.json")
RECORD = Path("reports/provenance.json")
SAID = {"deleted": "absent", "not in cache": "absent", "modified": "changed"}  # DVC's words, a reader's


def out_of_date(root: Path) -> dict[str, str]:
    """``{stage: why}`` for each stage of ``root/dvc.yaml`` that ``dvc repro`` would run."""
    from pipeline.provenance.record import dvc_repo

    repo = dvc_repo(root)
    try:
        status = repo.status(targets=[str(root / "dvc.yaml")])
    finally:
        repo.close()
    out = {}
    for stage, changes in status.items():
        why = []
        for change in changes:
            if isinstance(change, dict):
                for paths in change.values():
                    items = paths.items() if isinstance(paths, dict) else [(str(paths), "")]
                    why += [f"{path} {SAID.get(state, state)}".strip() for path, state in items]
            else:
                why.append(str(change))
        out[stage] = "; ".join(why[:2]) + (f" and {len(why) - 2} more" if len(why) > 2 else "")
    return out


def preview(root: Path) -> str:
    """The lines ``apg-pipeline preview`` prints."""
    from pipeline.provenance.record import machine_line

    stages = out_of_date(root)
    times: dict[str, Any] = checks.read_json(root / TIMES) if (root / TIMES).is_file() else {}
    made_on = checks.read_json(root / RECORD).get("machine") if (root / RECORD).is_file() else None
    if not stages:
        return "dvc repro has nothing to run: every stage is up to date"
    known = [times[s] for s in stages if s in times]
    where = f"on {machine_line(made_on)}" if made_on else "on the machine that made the committed results"
    lines = [
        f"dvc repro would run {len(stages)} stages, about {sum(known) / 60:.0f} minutes {where} "
        "(each stage's time in the committed run):"
    ]
    width = max(len(s) for s in stages)
    for stage, why in stages.items():
        minutes = f"{times[stage] / 60:6.1f} min" if stage in times else "     ? min"
        lines.append(f"  {stage:<{width}}  {minutes}  {why}")
    return "\n".join(lines)
