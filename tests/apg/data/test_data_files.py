"""Dataset files at any size: sets simulated and written in chunks (bounded memory), and
training sets read from disk a batch at a time (``apg.data.StoredRows``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apg.data import IN_MEMORY_MAX_BYTES, DatasetError, StoredRows, load_dataset, save_dataset, training_rows
from apg.tasks.simulation import simulate_chunks, simulate_set
from apg.training import TrainConfig, Trainer

SIZES = {"num_points": 7}


def test_chunked_set_is_the_chunks_in_order_and_one_chunk_is_the_whole_set(tmp_path):
    whole = simulate_set("gmm", {}, 10, 5, SIZES)
    one = list(simulate_chunks("gmm", {}, 10, 5, SIZES))  # 10 tiny datasets: one chunk
    assert len(one) == 1 and all(np.array_equal(one[0][k], whole[k]) for k in whole)
    per_dataset = sum(a.nbytes for a in simulate_set("gmm", {}, 1, 5, SIZES).values())
    chunks = list(simulate_chunks("gmm", {}, 10, 5, SIZES, chunk_bytes=3 * per_dataset))
    assert [len(c["x"]) for c in chunks] == [3, 3, 3, 1]
    path = save_dataset(tmp_path / "set.npz", iter(chunks))
    stored = load_dataset(path)
    assert set(stored) == set(whole)
    for name in whole:  # the file holds the chunks concatenated, dtypes kept
        assert np.array_equal(stored[name], np.concatenate([c[name] for c in chunks]))
        assert stored[name].dtype == whole[name].dtype
    # the same bytes as writing the concatenation at once
    at_once = save_dataset(tmp_path / "at_once.npz", {k: stored[k] for k in stored})
    assert path.read_bytes() == at_once.read_bytes()


def test_chunks_must_agree(tmp_path):
    a = {"x": np.zeros((2, 3), np.float32)}
    with pytest.raises(ValueError, match="trailing shape"):
        save_dataset(tmp_path / "bad.npz", iter([a, {"x": np.zeros((2, 4), np.float32)}]))
    with pytest.raises(ValueError, match="different arrays"):
        save_dataset(tmp_path / "bad.npz", iter([a, {"x": a["x"], "c": a["x"]}]))
    with pytest.raises(DatasetError, match="named 'x'"):
        save_dataset(tmp_path / "bad.npz", {"c": a["x"]})
    assert not list(tmp_path.iterdir())  # nothing half-written left behind


def test_stored_rows_read_the_rows_asked_for(tmp_path):
    x = np.arange(6 * 4 * 3, dtype=np.float16).reshape(6, 4, 3)
    path = save_dataset(tmp_path / "d.npz", {"x": x, "c": np.arange(6)})
    rows = StoredRows(path, event_shape=(4, 3))
    assert len(rows) == 6 and rows.shape == (6, 4, 3) and rows.dtype == np.float16
    idx = torch.tensor([5, 0, 3, 3, -1])
    got = rows[idx]
    assert got.dtype == torch.float16 and torch.equal(got, torch.from_numpy(x)[idx])
    assert rows[np.array([], dtype=np.int64)].shape == (0, 4, 3)
    with pytest.raises(IndexError, match="out of range"):
        rows[torch.tensor([6])]
    with pytest.raises(DatasetError, match=r"shaped \(M, 4, 2\)"):
        StoredRows(path, event_shape=(4, 2))
    np.savez_compressed(tmp_path / "z.npz", x=x)
    with pytest.raises(DatasetError, match="compressed"):
        StoredRows(tmp_path / "z.npz")
    np.savez(tmp_path / "nox.npz", c=x)
    with pytest.raises(DatasetError, match="no array 'x'"):
        StoredRows(tmp_path / "nox.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DatasetError, match="corrupt"):
        StoredRows(tmp_path / "junk.npz")
    with pytest.raises(DatasetError, match="not found"):
        StoredRows(tmp_path / "missing.npz")


def test_training_from_disk_takes_the_same_steps_as_from_memory(tmp_path):
    x = simulate_set("gmm", {}, 12, 3, SIZES)["x"].astype(np.float16)
    path = save_dataset(tmp_path / "train.npz", {"x": x})
    cfg = TrainConfig(task="gmm", method="apg", sweeps=2, particles=3, batch_size=5, iterations=4, lr=1e-4)
    cfg.network = {"hidden": 8}
    runs = []
    for data in (torch.from_numpy(x), StoredRows(path)):
        torch.manual_seed(0)
        trainer = Trainer(cfg, data)
        runs.append([m["log_joint"] for m in trainer.run()])  # 4 steps: crosses an epoch
    assert runs[0] == runs[1]


def test_large_training_sets_stay_on_disk(tmp_path, monkeypatch):
    path = save_dataset(tmp_path / "train.npz", {"x": np.zeros((4, 7, 2), np.float16)})
    assert isinstance(training_rows(path), torch.Tensor)
    monkeypatch.setattr("apg.data.files.IN_MEMORY_MAX_BYTES", path.stat().st_size - 1)
    assert isinstance(training_rows(path), StoredRows)
    assert IN_MEMORY_MAX_BYTES == 256 * 2**20


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_atomic_writes_take_the_users_umask(tmp_path, umask):
    # mkstemp makes its temporary file 0600; the file in place has the mode open() gives.
    import os

    from apg.data import atomic_write

    old = os.umask(umask)
    try:
        path = atomic_write(tmp_path / "out.txt", lambda tmp: tmp.write_text("x"))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
