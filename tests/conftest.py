"""Every test starts from the same seed and a small thread pool (entry-point seeding)."""

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(2)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
