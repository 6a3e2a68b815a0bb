"""Every test starts from the same seed and a small thread pool (entry-point seeding)."""

import os

# Set before torch loads its OpenMP runtime, which reads it once: threads with no work sleep
# instead of spinning. On two cores shared with other work (a run in the background, another
# test process) spinning threads starve the one they wait for: five gradchecks of test_nn.py
# took 84 s instead of 5 on this project's loaded 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

import apg.kernels
from tests.support import MNIST_DIR

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Two torch threads, or one per worker when pytest-xdist runs several (.ci/run's slow tier:
# two workers on two cores); more threads than cores leave each waiting on the others.
THREADS = 1 if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else 2


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(THREADS)
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
