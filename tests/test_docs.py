"""The documentation's example runs: the first ```python block of docs/library.md; and the
README's test command is the one CI runs."""

from __future__ import annotations

import re
from pathlib import Path

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
