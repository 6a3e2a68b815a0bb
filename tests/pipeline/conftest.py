"""Fixtures of the pipeline tests."""

import pytest

from tests.pipeline import harness


@pytest.fixture
def tiny():
    """The tiny params as a factory: ``tiny(**{"gmm.train.lr": 0.1})`` (dotted keys changed)."""
    return harness.tiny
