"""Every test starts from the same seed and a small thread pool (entry-point seeding)."""

import os

import pytest
import torch

import apg.kernels

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(2)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture(params=["native", "torch"])
def kernel_path(request, monkeypatch):
    """Run a test on both paths of the native kernels: compiled, and the PyTorch twins."""
    if request.param == "native":
        if apg.kernels.native_library() is None:
            pytest.skip("no C compiler: the native kernels cannot be built here")
    else:
        monkeypatch.setattr(apg.kernels, "native_library", lambda: None)
    return request.param
