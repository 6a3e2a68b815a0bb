"""Every test starts from the same seed and a small thread pool (entry-point seeding)."""

import os

import pytest
import torch

import apg.kernels
from tests.support import MNIST_DIR

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(2)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture
def f64():
    """Float64 as torch's default dtype for one test (``_seed_and_threads`` restores it)."""
    torch.set_default_dtype(torch.float64)


@pytest.fixture(params=["native", "torch"])
def kernel_path(request, monkeypatch):
    """Run a test on both paths of the native kernels: compiled, and the PyTorch twins."""
    if request.param == "native":
        if apg.kernels.native_library() is None:
            pytest.skip("no C compiler: the native kernels cannot be built here")
    else:
        monkeypatch.setattr(apg.kernels, "native_library", lambda: None)
    return request.param


@pytest.fixture
def mnist_env(monkeypatch):
    """``APG_MNIST_DIR`` set to the real MNIST files (the test is skipped without them)."""
    if MNIST_DIR is None:
        pytest.skip("MNIST IDX files not available (set APG_MNIST_DIR)")
    monkeypatch.setenv("APG_MNIST_DIR", str(MNIST_DIR))
