"""The native-kernel cache: a library is loaded only when its bytes match the sha256
recorded beside it; a tampered or unrecorded one is built again into place."""

from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path

import pytest

import apg.kernels


@pytest.fixture()
def probe_kernels(tmp_path, monkeypatch):
    """The kernel cache in a temporary folder, building one tiny source (a real compile,
    in a second rather than the full kernels' minute); ``native_library`` uncached."""
    if apg.kernels.native_library() is None:
        pytest.skip("no C compiler: no native kernels")
    source = tmp_path / "src" / "probe.c"
    source.parent.mkdir()
    source.write_text("long apg_probe(void) { return 7; }\n")
    monkeypatch.setattr(apg.kernels, "_SOURCES", [source])
    monkeypatch.setattr(apg.kernels, "_HEADERS", [])
    monkeypatch.setenv("APG_KERNEL_CACHE", str(tmp_path / "cache"))
    apg.kernels.native_library.cache_clear()
    yield tmp_path / "cache"
    apg.kernels.native_library.cache_clear()  # the next caller loads the real kernels again


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_tampered_cached_library_is_rebuilt_not_loaded(probe_kernels, monkeypatch):
    loaded = []
    real_cdll = ctypes.CDLL

    def spy(name, *args, **kwargs):
        loaded.append(sha256(Path(name)))  # the bytes behind the name, as the loader sees them
        return real_cdll(name, *args, **kwargs)

    monkeypatch.setattr(apg.kernels.ctypes, "CDLL", spy)
    apg.kernels.native_library().apg_probe.restype = ctypes.c_long
    (library,) = probe_kernels.glob("*.so")
    digest = library.with_name(library.name + ".sha256")
    assert digest.read_text().strip() == sha256(library) == loaded[-1]

    # A changed byte (as another user of a shared cache could leave it): rebuilt, never loaded.
    # Written as a new file put in place: rewriting the loaded file itself would change the
    # pages this process has mapped, and its code would crash at exit.
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    swap = library.with_name("tampered.tmp")
    swap.write_bytes(bytes(data))
    swap.replace(library)
    tampered = sha256(library)
    apg.kernels.native_library.cache_clear()
    lib = apg.kernels.native_library()
    assert lib is not None and tampered not in loaded
    assert sha256(library) != tampered and digest.read_text().strip() == sha256(library) == loaded[-1]

    # A library with no recorded digest is not trusted either.
    digest.unlink()
    apg.kernels.native_library.cache_clear()
    before = len(loaded)
    apg.kernels.native_library()
    assert digest.read_text().strip() == sha256(library) == loaded[-1] and len(loaded) == before + 1
