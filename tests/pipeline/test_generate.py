"""The generate stage: sets written in chunks hold the chunks in order, byte-reproducibly."""

from __future__ import annotations

import copy
import functools
import zipfile

import numpy as np

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
