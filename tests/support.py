"""What tests across the tree share: the repository's root and the real MNIST files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _mnist_dir() -> Path | None:
    """``$APG_MNIST_DIR``, else ``../shared/data/mnist`` beside the repository, when it holds
    the IDX files (gzipped or not); ``None`` otherwise."""
    for where in (os.environ.get("APG_MNIST_DIR"), REPO.parent / "shared" / "data" / "mnist"):
        if where and any((Path(where) / f"t10k-images-idx3-ubyte{ext}").is_file() for ext in (".gz", "")):
            return Path(where).resolve()
    return None


MNIST_DIR = _mnist_dir()
needs_mnist = pytest.mark.skipif(
    MNIST_DIR is None, reason="MNIST IDX files not available (set APG_MNIST_DIR)"
)
