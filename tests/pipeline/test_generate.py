"""The generate stage: sets written in chunks hold the chunks in order, byte-reproducibly."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from apg.data import StoredRows, load_dataset
from apg.tasks.simulation import simulate_chunks, simulate_set
from pipeline.generate import generate
from tests.pipeline.harness import TINY


def test_generate_writes_large_sets_in_chunks(tmp_path, monkeypatch):
    params = copy.deepcopy(TINY)
    train = params["gmm"]["data"]["train"]
    whole = {p.name: p.read_bytes() for p in generate("gmm", params, tmp_path / "a")}
    one = simulate_set("gmm", {}, train["num_datasets"], train["seed"], train["sizes"])
    stored_x = load_dataset(tmp_path / "a" / "train.npz")["x"]
    assert np.array_equal(stored_x, one["x"].astype(np.float32))  # one chunk: the whole set
    # Several chunks draw in another order (the chunking changes the set, not the bytes'
    # dependence on the arrays): the file is their concatenation, the same on every run.
    small = functools.partial(simulate_chunks, chunk_bytes=200)  # one dataset per chunk
    monkeypatch.setattr("pipeline.generate.simulate_chunks", small)
    chunked = {p.name: p for p in generate("gmm", params, tmp_path / "b")}
    assert set(chunked) == set(whole)
    chunks = list(small("gmm", {}, train["num_datasets"], train["seed"], train["sizes"]))
    assert len(chunks) == train["num_datasets"]
    stored = load_dataset(chunked["train.npz"])
    for name in one:  # x as stored (data.x_dtype: float32)
        want = np.concatenate([c[name] for c in chunks])
        assert np.array_equal(stored[name], want.astype(np.float32) if name == "x" else want)
    again = {p.name: p.read_bytes() for p in generate("gmm", params, tmp_path / "c")}
    assert again == {name: path.read_bytes() for name, path in chunked.items()}
    with zipfile.ZipFile(chunked["train.npz"]) as archive:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in archive.infolist())
    rows = StoredRows(chunked["train.npz"])
    assert len(rows) == train["num_datasets"]


# The CPU code paths that differ between the CPU types a run meets and that can be forced on
# any x86-64 machine: torch's kernel dispatch (ATen's vector ISA) and the ISA MKL, oneDNN and
# OpenBLAS may use. The simulators' bytes must not depend on them.
CODE_PATHS = (
    {"ATEN_CPU_CAPABILITY": "default"},
    {"ATEN_CPU_CAPABILITY": "avx2"},
    {"ATEN_CPU_CAPABILITY": "avx512"},
    {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41", "OPENBLAS_CORETYPE": "Nehalem"},
)

_DIGEST = """
import hashlib, sys
import numpy as np
from apg.tasks.simulation import simulate_set
sizes = {"gmm": {"num_points": 60}, "dgmm": {"num_points": 200, "radius": 2.0},
         "bmnist": {"num_frames": 5, "num_digits": 2}}[sys.argv[1]]
arrays = simulate_set(sys.argv[1], {}, 20, 7, sizes)
print(hashlib.sha256(b"".join(np.ascontiguousarray(arrays[k]).tobytes() for k in sorted(arrays))).hexdigest())
"""


@pytest.mark.slow
@pytest.mark.parametrize("task", ["gmm", "dgmm", "bmnist"])
def test_simulated_sets_are_the_same_bytes_on_every_cpu_code_path(task, request):
    """A set's arrays hashed in fresh processes, one per forced code path: one digest. (On
    the AMD EPYC the committed data/ hashes also come out of every one of these paths.)"""
    if task == "bmnist":
        request.getfixturevalue("mnist_env")  # skipped without MNIST
    digests = set()
    for forced in CODE_PATHS:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **forced}
        out = subprocess.run(
            [sys.executable, "-c", _DIGEST, task], env=env, capture_output=True, text=True, check=True
        )
        digests.add(out.stdout.strip())
    assert len(digests) == 1, digests
