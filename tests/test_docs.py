"""The documentation's example runs: the first ```python block of docs/library.md; the
README's test command is the one CI runs; every command line of README.md and docs/ is run in a
clone or listed with why it is not (tests/doc_commands.py), and ``dvc pull`` is given only
beside the remote it needs."""

from __future__ import annotations

import re
from pathlib import Path

from tests.doc_commands import NOT_RUN, RUN, block_commands, doc_commands, doc_pages
from tests.support import REPO as ROOT


def first_python_block(path: Path) -> str:
    match = re.search(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)
    assert match, f"{path} has no ```python block"
    return match.group(1)


def test_library_example_runs():
    code = first_python_block(ROOT / "docs" / "library.md")
    exec(compile(code, "docs/library.md", "exec"), {"__name__": "docs_library_example"})


def test_ci_runs_the_readmes_test_command_verbatim():
    block = re.search(
        r"^## Quick start\n.*?^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M
    )
    assert block, "README.md's Quick start has no ```bash block"
    commands = [line for line in block.group(1).splitlines() if "pytest" in line and not line.startswith("#")]
    assert len(commands) == 1, commands
    assert f"({commands[0]})" in (ROOT / ".ci" / "run").read_text()


def test_every_documented_command_is_run_in_a_clone_or_listed_with_its_reason():
    given = doc_commands()
    neither = [
        f"{command}   ({', '.join(sorted(set(pages)))})"
        for command, pages in given.items()
        if command not in RUN and command not in NOT_RUN
    ]
    assert not neither, (
        "run these in tests/pipeline/test_clone.py or list them in tests/doc_commands.py:\n"
        + "\n".join(neither)
    )
    gone = [command for command in [*RUN, *NOT_RUN] if command not in given]
    assert not gone, f"tests/doc_commands.py lists commands the docs no longer give: {gone}"
    assert not set(RUN) & set(NOT_RUN)
    clone_tests = (ROOT / "tests" / "pipeline" / "test_clone.py").read_text()
    named = [line.split("::")[1] for line in RUN.values() if line.startswith("test_clone.py::")]
    assert all(f"def {name}(" in clone_tests for name in named), named


def test_dvc_pull_is_given_only_beside_the_remote_it_needs():
    """A clone has no DVC remote: a block that pulls sits in the section that sets one up."""
    pulling = []
    for page in doc_pages():
        for section in re.split(r"^## ", page.read_text(), flags=re.M):
            lines = block_commands(section)
            if any(line.startswith("dvc pull") for line in lines):
                pulling.append(page.name)
                assert any(line.startswith("dvc remote add") for line in lines), (page, section[:80])
    assert pulling == ["reproduce.md"], pulling
