"""MNIST from the standard IDX files, with checksum verification.

The four files are looked up, in order, in the ``directory`` argument, in the directory
named by the environment variable ``APG_MNIST_DIR``, and in ``~/.cache/apg/mnist``.
Files may be gzip-compressed (the published ``*.gz`` names) or raw. A published
``.gz`` file is checked against its published SHA-256; a raw file against the MD5 of
the decompressed published file. When no directory holds the files, ``load_mnist``
downloads them from the public mirrors into the cache directory (checking every
byte) and, if that fails, raises ``MNISTNotFound`` saying where to put them.

IDX format (all integers big-endian): images are ``uint32 magic 2051, count, rows,
cols`` then ``count * rows * cols`` uint8 pixels; labels are ``uint32 magic 2049,
count`` then ``count`` uint8 labels.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import struct
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from apg.data.files import DatasetError, atomic_write

ENV_VAR = "APG_MNIST_DIR"
DEFAULT_CACHE = Path("~/.cache/apg/mnist")

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049


class MNISTFile(NamedTuple):
    """One published file: its gzip name, the SHA-256 of the ``.gz`` and the MD5 of its
    decompressed content (values from the published list, see the shared data README)."""

    gz_name: str
    sha256_gz: str
    md5_raw: str
    magic: int
    num_items: int  # not ``count``: that would hide tuple.count


FILES: dict[str, MNISTFile] = {
    "train_images": MNISTFile(
        "train-images-idx3-ubyte.gz",
        "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
        "6bbc9ace898e44ae57da46a324031adb",
        IMAGES_MAGIC,
        60000,
    ),
    "train_labels": MNISTFile(
        "train-labels-idx1-ubyte.gz",
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
        "a25bea736e30d166cdddb491f175f624",
        LABELS_MAGIC,
        60000,
    ),
    "test_images": MNISTFile(
        "t10k-images-idx3-ubyte.gz",
        "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
        "2646ac647ad5339dbf082846283269ea",
        IMAGES_MAGIC,
        10000,
    ),
    "test_labels": MNISTFile(
        "t10k-labels-idx1-ubyte.gz",
        "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
        "27ae3e4e09519cfbb04c329615203637",
        LABELS_MAGIC,
        10000,
    ),
}

# Public mirrors of the original files (yann.lecun.com no longer serves them reliably).
MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)


class IDXError(DatasetError):
    """An IDX file is truncated, has the wrong magic number or shape, or fails its checksum."""


class MNISTNotFound(FileNotFoundError):
    """The MNIST files are in none of the searched places and could not be downloaded."""


class MNIST(NamedTuple):
    """One split: ``images (M, 28, 28)`` uint8 (0 background, 255 full ink), ``labels (M,)``."""

    images: np.ndarray
    labels: np.ndarray


# --------------------------------------------------------------------------- IDX parsing


def parse_idx(data: bytes, magic: int | None = None, source: str = "IDX data") -> np.ndarray:
    """Decode the bytes of an uncompressed IDX file of unsigned bytes.

    The magic number is ``0x00 0x00 0x08 ndim`` (type 0x08 = uint8); ``magic`` (e.g.
    2051 for images) pins the expected value. Raises ``IDXError`` for a wrong magic
    number, a header or payload shorter than the header announces, or trailing bytes.
    """
    if len(data) < 4:
        raise IDXError(f"{source}: truncated IDX file ({len(data)} bytes, no header)")
    (found,) = struct.unpack(">I", data[:4])
    if magic is not None and found != magic:
        raise IDXError(f"{source}: wrong magic number {found} (expected {magic})")
    if found >> 8 != 0x08:
        raise IDXError(f"{source}: magic number {found:#010x} is not an unsigned-byte IDX file")
    ndim = found & 0xFF
    header = 4 + 4 * ndim
    if ndim == 0 or len(data) < header:
        raise IDXError(f"{source}: truncated IDX header ({len(data)} bytes, {ndim} dims)")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    size = int(np.prod(shape))
    if len(data) - header < size:
        raise IDXError(
            f"{source}: truncated IDX file: shape {shape} needs {size} bytes of data, found {len(data) - header}"
        )
    if len(data) - header > size:
        raise IDXError(f"{source}: {len(data) - header - size} unexpected trailing bytes after shape {shape}")
    return np.frombuffer(data, dtype=np.uint8, count=size, offset=header).reshape(shape).copy()


def read_idx(
    path: str | os.PathLike,
    magic: int | None = None,
    *,
    sha256: str | None = None,
    md5: str | None = None,
) -> np.ndarray:
    """Read an IDX file, gzip-compressed or raw (detected from its first bytes).

    ``sha256`` / ``md5`` are checked against the bytes of the file as stored (a
    compressed file's checksum is that of the ``.gz``). Raises ``IDXError``.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise IDXError(f"cannot read {path}: {err}") from None
    for name, expected in (("sha256", sha256), ("md5", md5)):
        if expected is not None:
            got = hashlib.new(name, raw).hexdigest()
            if got != expected.lower():
                raise IDXError(
                    f"{path}: wrong {name} checksum {got} (expected {expected}); the file is corrupt"
                )
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise IDXError(f"{path}: truncated or corrupt gzip stream ({err})") from None
    return parse_idx(raw, magic, source=str(path))


def write_idx(path: str | os.PathLike, array: np.ndarray, compress: bool | None = None) -> Path:
    """Write a uint8 array as an IDX file (gzip when ``compress``, default: name ends in .gz)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    data = (
        struct.pack(">I", 0x0800 | array.ndim)
        + struct.pack(f">{array.ndim}I", *array.shape)
        + array.tobytes()
    )
    path = Path(path)
    if compress if compress is not None else path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


# --------------------------------------------------------------------------- the dataset


def search_dirs(directory: str | os.PathLike | None = None) -> list[Path]:
    """The directories searched for the files, in order."""
    dirs = [Path(directory)] if directory is not None else []
    if os.environ.get(ENV_VAR):
        dirs.append(Path(os.environ[ENV_VAR]))
    dirs.append(DEFAULT_CACHE.expanduser())
    return dirs


def _locate(spec: MNISTFile, dirs: list[Path]) -> tuple[Path, dict[str, str]] | None:
    """The first stored copy of ``spec`` (``.gz`` or raw) and the checksum it must match."""
    raw_name = spec.gz_name[: -len(".gz")]
    for d in dirs:
        if (d / spec.gz_name).is_file():
            return d / spec.gz_name, {"sha256": spec.sha256_gz}
        if (d / raw_name).is_file():
            return d / raw_name, {"md5": spec.md5_raw}
    return None


def download(target: str | os.PathLike, mirrors: tuple[str, ...] = MIRRORS, timeout: float = 60.0) -> Path:
    """Download the four published ``.gz`` files into ``target``, checking each SHA-256.

    A file is written under its final name only after its checksum matched. Raises
    ``MNISTNotFound`` listing every failed attempt.
    """
    target = Path(target)
    errors: list[str] = []
    for spec in FILES.values():
        if (target / spec.gz_name).is_file():
            continue
        for mirror in mirrors:
            url = mirror + spec.gz_name
            try:
                with urllib.request.urlopen(url, timeout=timeout) as response:
                    data = response.read()
            except OSError as err:
                errors.append(f"{url}: {err}")
                continue
            got = hashlib.sha256(data).hexdigest()
            if got != spec.sha256_gz:
                errors.append(f"{url}: wrong sha256 {got}")
                continue
            atomic_write(target / spec.gz_name, _writer(data))
            break
        else:
            raise MNISTNotFound(_missing_message([target]) + "\nDownload failed:\n  " + "\n  ".join(errors))
    return target


def _writer(data: bytes) -> Callable[[Path], int]:
    """``atomic_write``'s ``write`` for ``data`` (bound now, not to the loop's variable)."""
    return lambda tmp: tmp.write_bytes(data)


def _missing_message(dirs: list[Path]) -> str:
    names = ", ".join(spec.gz_name for spec in FILES.values())
    looked = ", ".join(str(d) for d in dirs)
    return (
        f"MNIST files not found (looked in: {looked}). Put the four files {names} "
        f"(gzip or decompressed) in one directory and pass it as mnist_dir or set {ENV_VAR}."
    )


def mnist_files(
    directory: str | os.PathLike | None = None, allow_download: bool = True
) -> dict[str, tuple[Path, dict[str, str]]]:
    """Find every file (downloading into the cache when missing and allowed)."""
    dirs = search_dirs(directory)
    found = {key: _locate(spec, dirs) for key, spec in FILES.items()}
    if any(v is None for v in found.values()):
        if not allow_download:
            raise MNISTNotFound(_missing_message(dirs))
        try:
            cache = download(DEFAULT_CACHE.expanduser())
        except MNISTNotFound as err:
            raise MNISTNotFound(_missing_message(dirs) + "\n" + str(err).split("\n", 1)[-1]) from None
        found = {key: _locate(spec, [cache]) for key, spec in FILES.items()}
    return {key: v for key, v in found.items() if v is not None}


def load_mnist(
    split: str = "train", directory: str | os.PathLike | None = None, allow_download: bool = True
) -> MNIST:
    """Load one split (``"train"``: 60,000 images; ``"test"``: 10,000) after verifying checksums.

    Raises ``IDXError`` for a corrupt file and ``MNISTNotFound`` when the files are missing.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    files = mnist_files(directory, allow_download)
    arrays = {}
    for part in ("images", "labels"):
        spec = FILES[f"{split}_{part}"]
        path, checksum = files[f"{split}_{part}"]
        arr = read_idx(path, spec.magic, **checksum)
        if arr.shape[0] != spec.num_items:
            raise IDXError(f"{path}: expected {spec.num_items} items, found {arr.shape[0]}")
        arrays[part] = arr
    if arrays["images"].shape[1:] != (28, 28):
        raise IDXError(f"MNIST images must be 28x28, got {arrays['images'].shape[1:]}")
    return MNIST(arrays["images"], arrays["labels"])
