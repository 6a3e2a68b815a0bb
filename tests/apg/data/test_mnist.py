"""MNIST IDX loader: tiny files written here, and the real files when available."""

from __future__ import annotations

import gzip
import hashlib
import struct

import numpy as np
import pytest

from apg.data import mnist
from apg.data.mnist import IDXError, MNISTNotFound, load_mnist, parse_idx, read_idx, write_idx
from tests.support import MNIST_DIR, needs_mnist


@pytest.fixture
def images() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(5, 28, 28), dtype=np.uint8)


@pytest.mark.parametrize("name", ["imgs-idx3-ubyte.gz", "imgs-idx3-ubyte"])
def test_idx_roundtrip_gzip_and_raw(tmp_path, images, name):
    path = write_idx(tmp_path / name, images)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")
    out = read_idx(path, mnist.IMAGES_MAGIC)
    assert out.dtype == np.uint8 and out.shape == (5, 28, 28)
    np.testing.assert_array_equal(out, images)


def test_idx_labels_header_layout(tmp_path):
    labels = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    path = write_idx(tmp_path / "labels", labels)
    raw = path.read_bytes()
    assert struct.unpack(">II", raw[:8]) == (mnist.LABELS_MAGIC, 5)  # magic 2049, count
    np.testing.assert_array_equal(read_idx(path, mnist.LABELS_MAGIC), labels)


def test_truncated_files_raise(tmp_path, images):
    raw = (write_idx(tmp_path / "a", images)).read_bytes()
    with pytest.raises(IDXError, match="truncated"):
        parse_idx(raw[:-1], mnist.IMAGES_MAGIC)
    with pytest.raises(IDXError, match="truncated"):
        parse_idx(raw[:10], mnist.IMAGES_MAGIC)
    with pytest.raises(IDXError, match="truncated"):
        parse_idx(raw[:2])
    gz = tmp_path / "b.gz"
    gz.write_bytes(gzip.compress(raw)[:-20])
    with pytest.raises(IDXError, match="truncated|corrupt"):
        read_idx(gz, mnist.IMAGES_MAGIC)


def test_trailing_bytes_raise(tmp_path, images):
    raw = write_idx(tmp_path / "a", images).read_bytes()
    with pytest.raises(IDXError, match="trailing"):
        parse_idx(raw + b"\x00", mnist.IMAGES_MAGIC)


def test_wrong_magic_raises(tmp_path, images):
    path = write_idx(tmp_path / "a", images)
    with pytest.raises(IDXError, match="wrong magic number 2051 \\(expected 2049\\)"):
        read_idx(path, mnist.LABELS_MAGIC)
    bad = struct.pack(">I", 0x0D03) + path.read_bytes()[4:]  # float32 type code
    with pytest.raises(IDXError, match="unsigned-byte"):
        parse_idx(bad)


def test_checksums(tmp_path, images):
    path = write_idx(tmp_path / "a.gz", images)
    data = path.read_bytes()
    sha, md5 = hashlib.sha256(data).hexdigest(), hashlib.md5(data).hexdigest()
    np.testing.assert_array_equal(read_idx(path, sha256=sha, md5=md5), images)
    with pytest.raises(IDXError, match="wrong sha256"):
        read_idx(path, sha256="0" * 64)
    with pytest.raises(IDXError, match="wrong md5"):
        read_idx(path, md5="0" * 32)


def test_missing_files_say_where_to_put_them(tmp_path, monkeypatch):
    monkeypatch.setattr(mnist, "DEFAULT_CACHE", tmp_path / "cache")
    monkeypatch.delenv(mnist.ENV_VAR, raising=False)
    with pytest.raises(MNISTNotFound, match=f"set {mnist.ENV_VAR}") as err:
        load_mnist("train", tmp_path / "empty", allow_download=False)
    assert str(tmp_path / "empty") in str(err.value)
    assert "train-images-idx3-ubyte.gz" in str(err.value)


def test_failed_download_says_where_to_put_them(tmp_path, monkeypatch):
    monkeypatch.setattr(mnist, "DEFAULT_CACHE", tmp_path / "cache")
    monkeypatch.setattr(mnist, "MIRRORS", ("http://127.0.0.1:9/",))  # discard port: refused
    monkeypatch.delenv(mnist.ENV_VAR, raising=False)
    with pytest.raises(MNISTNotFound, match="Download failed"):
        mnist.mnist_files(tmp_path / "empty")
    assert not any((tmp_path / "cache").glob("*.gz"))


def test_corrupt_file_in_directory_fails_checksum(tmp_path, monkeypatch, images):
    monkeypatch.setattr(mnist, "DEFAULT_CACHE", tmp_path / "cache")
    for spec in mnist.FILES.values():
        write_idx(tmp_path / spec.gz_name, images if spec.magic == mnist.IMAGES_MAGIC else images[:, 0, 0])
    with pytest.raises(IDXError, match="wrong sha256"):
        load_mnist("test", tmp_path, allow_download=False)


def test_bad_split():
    with pytest.raises(ValueError, match="split"):
        load_mnist("valid")


@needs_mnist
@pytest.mark.parametrize("split,count", [("test", 10000), ("train", 60000)])
def test_real_files(split, count):
    data = load_mnist(split, MNIST_DIR, allow_download=False)
    assert data.images.shape == (count, 28, 28) and data.images.dtype == np.uint8
    assert data.labels.shape == (count,) and set(np.unique(data.labels)) == set(range(10))
    assert data.images.max() == 255 and data.images.min() == 0
    expected_first = {"test": [7, 2, 1, 0, 4], "train": [5, 0, 4, 1, 9]}[split]
    assert data.labels[:5].tolist() == expected_first
