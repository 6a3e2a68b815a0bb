"""Dataset files: ``.npz`` archives with ``x`` shaped ``(M, ...)`` (M datasets) and,
when known, the true latents under the names the task uses (e.g. ``c``, ``mu``, ``tau``).

Users can bring their own files: only ``x`` is required. Writes are atomic (a temporary
file in the same directory, then ``os.replace``), so an interrupted write never leaves a
half-written file under the final name, and byte-reproducible (:func:`save_dataset`: the
same arrays give the same bytes), so a file's digest names its data. A set too large for
memory is written from chunks, each spooled to disk as it comes.

A training set too large to hold in memory (Bouncing MNIST at the paper's scale: 60,000
videos, 11 GB as float16) is read a batch at a time with :class:`StoredRows` (what
:func:`training_rows` gives for a file over ``IN_MEMORY_MAX_BYTES``): the archive is
uncompressed, so each row of ``x`` is a fixed byte range of the file, read with ``os.pread``.
Nothing is memory-mapped: mapped pages a trial has touched count in its resident memory,
and random batches over 200,000 steps touch all of them.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import torch


class DatasetError(ValueError):
    """A dataset file is missing, unreadable, or holds data of the wrong shape or values."""


def _file_mode() -> int:
    """The mode ``open()`` gives a new file under the process's umask (0644 under 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp_path)`` and move the result to ``path`` atomically, with the mode a
    plain ``open()`` would have given it (the temporary file is created 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno is not None and err.filename is None:
            # A write through a file object (torch.save, np.savez) names no file, and a
            # full disk's one line must say where.
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    return path


def save_dataset(
    path: str | os.PathLike, arrays: Mapping[str, np.ndarray] | Iterator[Mapping[str, np.ndarray]]
) -> Path:
    """Write ``arrays`` (must include ``x``) to ``path`` as an uncompressed ``.npz``, atomically.

    The bytes depend only on the arrays (``np.savez`` stamps each member with the write
    time; here members come in sorted order with a fixed date), so the same data give the
    same file digest.

    ``arrays``: the arrays, or an iterator of chunks of them (mappings with the same names,
    concatenated along the first axis), spooled to disk one at a time: memory stays one
    chunk, whatever the file's size.
    """
    path = Path(path)
    chunks = iter([arrays]) if isinstance(arrays, Mapping) else arrays
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as spool_dir:
        spool, layout = _spool(chunks, Path(spool_dir))
        if "x" not in layout:
            raise DatasetError("a dataset needs an array named 'x'")

        def write(tmp: Path) -> None:
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
                for name in sorted(layout):
                    info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                    with archive.open(info, "w", force_zip64=True) as member:
                        _write_npy_header(member, layout[name])
                        with open(spool[name], "rb") as body:
                            shutil.copyfileobj(body, member, 16 * 2**20)

        return atomic_write(path, write)


def _spool(
    chunks: Iterator[Mapping[str, np.ndarray]], spool_dir: Path
) -> tuple[dict[str, Path], dict[str, dict[str, Any]]]:
    """Append each chunk's arrays (C order) to one file per name; return the files and each
    array's ``.npy`` header fields for the whole."""
    spool: dict[str, Path] = {}
    layout: dict[str, dict[str, Any]] = {}
    for chunk in chunks:
        if layout and set(chunk) != set(layout):
            raise ValueError(f"chunks hold different arrays: {sorted(chunk)} vs {sorted(layout)}")
        for name, value in chunk.items():
            array = np.ascontiguousarray(value)
            header = np.lib.format.header_data_from_array_1_0(array)
            if name not in layout:
                layout[name], spool[name] = header, spool_dir / f"{name}.bin"
            else:
                rows, *rest = layout[name]["shape"]
                if (header["descr"], tuple(rest)) != (layout[name]["descr"], array.shape[1:]):
                    raise ValueError(f"chunks of {name!r} differ in dtype or trailing shape")
                layout[name]["shape"] = (rows + array.shape[0], *rest)
            with open(spool[name], "ab") as f:
                f.write(array.data)
    return spool, layout


def _write_npy_header(member: IO[bytes], header: dict[str, Any]) -> None:
    """The header ``np.lib.format.write_array`` would write for the whole array (version
    1.0 unless the header needs 2.0)."""
    try:
        np.lib.format.write_array_header_1_0(member, header)
    except ValueError:
        np.lib.format.write_array_header_2_0(member, header)


def load_dataset(
    path: str | os.PathLike, event_shape: tuple[int | None, ...] | None = None
) -> dict[str, np.ndarray]:
    """Read and check a dataset file.

    ``event_shape``: the expected trailing shape of ``x`` after its dataset axis, with
    ``None`` for free sizes (the GMM takes ``(None, 2)``: any number of 2-D points).
    Raises ``DatasetError`` with a one-line reason.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {k: archive[k] for k in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise DatasetError(f"dataset file {path} is corrupt or not an .npz archive ({err})") from None
    if "x" not in arrays:
        raise DatasetError(f"dataset file {path} has no array 'x' (found {sorted(arrays)})")
    x = arrays["x"]
    _check_x(path, x.shape, x.dtype, event_shape)
    if not np.isfinite(x).all():
        raise DatasetError(f"dataset file {path}: 'x' contains NaN or infinite values")
    return arrays


def _check_x(
    path: Path, shape: tuple[int, ...], dtype: np.dtype, event_shape: tuple[int | None, ...] | None
) -> None:
    if not np.issubdtype(dtype, np.number):
        raise DatasetError(f"dataset file {path}: 'x' must be numeric, got dtype {dtype}")
    if event_shape is not None:
        ok = len(shape) == 1 + len(event_shape) and all(
            want is None or want == got for want, got in zip(event_shape, shape[1:], strict=True)
        )
        if not ok:
            want = ", ".join("*" if s is None else str(s) for s in event_shape)
            raise DatasetError(f"dataset file {path}: 'x' must be shaped (M, {want}), got {tuple(shape)}")
    if len(shape) == 0 or shape[0] == 0:
        raise DatasetError(f"dataset file {path} holds no datasets")
    if 0 in shape[1:]:  # no points (frames, pixels): every metric of it would mean nothing
        raise DatasetError(f"dataset file {path}: 'x' shaped {tuple(shape)} has datasets of no entries")


class Rows(Protocol):
    """Training datasets read a batch at a time: ``len(rows)`` datasets, ``rows[idx]`` (a 1-D
    integer tensor) a CPU tensor ``(len(idx), ...)`` in the order of ``idx``. Kept by
    :class:`StoredRows` (a file) and ``apg.tasks.bmnist.simulator.VideoRows`` (made when read)."""

    def __len__(self) -> int: ...

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor: ...


class StoredRows:
    """The datasets ``x[i]`` of a dataset file, read from disk when indexed.

    ``rows[idx]`` (``idx`` a 1-D integer tensor or array) returns a CPU tensor shaped
    ``(len(idx), ...)`` in the stored dtype, in the order of ``idx``; ``len(rows)`` is M.
    Memory use is one batch, whatever the file's size. Checks the shape and dtype like
    :func:`load_dataset`, but not that every value is finite (that would read the whole
    file); a non-finite batch shows up as a non-finite training loss.
    """

    def __init__(self, path: str | os.PathLike, event_shape: tuple[int | None, ...] | None = None):
        self._fd: int | None = None
        self.path = Path(path)
        if not self.path.is_file():
            raise DatasetError(f"dataset file not found: {self.path}")
        try:
            with zipfile.ZipFile(self.path) as archive:
                info = archive.getinfo("x.npy")
            if info.compress_type != zipfile.ZIP_STORED:
                raise DatasetError(
                    f"dataset file {self.path} is compressed: its rows cannot be read in place"
                )
            with open(self.path, "rb") as f:
                # The member's data follows its local header (30 bytes, then its name and
                # extra field, whose lengths sit at bytes 26-29), then the .npy header.
                f.seek(info.header_offset)
                local = f.read(30)
                if local[:4] != b"PK\x03\x04":
                    raise ValueError("bad local file header")
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                f.seek(info.header_offset + 30 + name_len + extra_len)
                version = np.lib.format.read_magic(f)
                read_header = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, fortran_order, dtype = read_header(f)
                self._offset = f.tell()
        except DatasetError:
            raise
        except KeyError:
            raise DatasetError(f"dataset file {self.path} has no array 'x'") from None
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
            raise DatasetError(
                f"dataset file {self.path} is corrupt or not an .npz archive ({err})"
            ) from None
        if fortran_order:
            raise DatasetError(f"dataset file {self.path}: 'x' is stored in Fortran order")
        _check_x(self.path, shape, dtype, event_shape)
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self._row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx: torch.Tensor | np.ndarray) -> torch.Tensor:
        index = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64).reshape(-1)
        if index.size and (index.min() < -len(self) or index.max() >= len(self)):
            raise IndexError(f"row index out of range for {len(self)} datasets")
        index = np.where(index < 0, index + len(self), index)
        if self._fd is None:  # opened on first use, so the object pickles before then
            self._fd = os.open(self.path, os.O_RDONLY)
        out = np.empty((index.size, *self.shape[1:]), dtype=self.dtype)
        flat = out.reshape(index.size, self._row_bytes // self.dtype.itemsize).view(np.uint8)
        for j, i in enumerate(index):
            got = os.preadv(self._fd, [flat[j]], self._offset + int(i) * self._row_bytes)
            if got != self._row_bytes:
                raise DatasetError(f"dataset file {self.path} ended inside row {i}")
        return torch.from_numpy(out)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None}


# A training set up to this size is held in memory (and travels with a sweep's trials
# through Ray's object store); a larger one is read from disk a batch at a time.
IN_MEMORY_MAX_BYTES = 256 * 2**20


def training_rows(path: str | os.PathLike) -> torch.Tensor | StoredRows:
    """A training set's ``x`` as a trainer reads it: in memory in its stored dtype when the
    file is at most ``IN_MEMORY_MAX_BYTES``, else :class:`StoredRows` (Bouncing MNIST at the
    paper's scale is 11 GB per trial otherwise)."""
    if Path(path).is_file() and Path(path).stat().st_size > IN_MEMORY_MAX_BYTES:
        return StoredRows(path)
    return torch.from_numpy(load_dataset(path)["x"])
