"""Dataset files: ``.npz`` archives with ``x`` shaped ``(M, ...)`` (M datasets) and,
when known, the true latents under the names the task uses (e.g. ``c``, ``mu``, ``tau``).

Users can bring their own files: only ``x`` is required. Writes are atomic (a temporary
file in the same directory, then ``os.replace``), so an interrupted write never leaves a
half-written file under the final name.

A training set too large to hold in memory (Bouncing MNIST at the paper's scale: 60,000
videos, 11 GB as float16) is read a batch at a time with :class:`StoredRows`: the archive is
uncompressed, so each row of ``x`` is a fixed byte range of the file, read with ``os.pread``.
Nothing is memory-mapped: mapped pages a trial has touched count in its resident memory,
and random batches over 200,000 steps touch all of them.
"""

from __future__ import annotations

import os
import struct
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

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


def save_dataset(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write ``arrays`` (must include ``x``) to ``path`` as an uncompressed ``.npz``."""
    if "x" not in arrays:
        raise DatasetError("a dataset needs an array named 'x'")

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            # numpy's stub (numpy/lib/_npyio_impl.pyi) puts a keyword-only ``allow_pickle: bool``
            # beside savez's ``**kwds: ArrayLike``, so mypy matches a dict of arrays against both.
            np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()})  # type: ignore[arg-type]

    return atomic_write(path, write)


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
