"""The documentation's example runs: the first ```python block of docs/library.md."""

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
