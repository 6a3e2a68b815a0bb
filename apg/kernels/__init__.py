"""Native CPU kernels, compiled on first use with the system C compiler and cached.

Only hot loops that PyTorch's eager ops cannot fuse live here (``tanh_layers.c``). Each has
a pure-PyTorch twin that runs on GPUs, on machines without a compiler, and when the
environment sets ``APG_NATIVE_KERNELS=0``; tests check the two agree.

The shared library is built into ``$APG_KERNEL_CACHE`` (default ``~/.cache/apg/kernels``)
under a name that hashes the source, the flags and the CPU, so nodes of a heterogeneous
cluster sharing a home directory never load each other's ``-march=native`` builds.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

_SOURCE = Path(__file__).with_name("tanh_layers.c")
# -ffast-math only when compiling: linking a shared object with it (GCC < 13) would add
# crtfastmath.o, which flushes denormals to zero for the whole process on load.
_COMPILE_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC"]


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("APG_KERNEL_CACHE") or Path.home() / ".cache" / "apg" / "kernels"
    return Path(root)


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / target.name
        subprocess.run(
            [compiler, *_COMPILE_FLAGS, "-c", str(_SOURCE), "-o", str(obj)], check=True, capture_output=True
        )
        subprocess.run(
            [compiler, "-shared", "-fopenmp", str(obj), "-o", str(lib), "-lm"],
            check=True,
            capture_output=True,
        )
        os.replace(lib, target)  # atomic: concurrent builders (Ray trials) never see half a file


_FUNCTIONS = tuple(
    f"{kind}_{direction}_{dtype}"
    for kind in ("pairwise", "pointwise")
    for direction in ("forward", "backward")
    for dtype in ("f32", "f64")
)


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled ``tanh_layers.c``, or ``None`` (with one warning) where it cannot be built."""
    if os.environ.get("APG_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.system() != "Linux":
        return None
    key = hashlib.sha256(
        b"\0".join(
            [_SOURCE.read_bytes(), " ".join(_COMPILE_FLAGS).encode(), compiler.encode(), _cpu_id().encode()]
        )
    ).hexdigest()[:16]
    target = _cache_dir() / f"tanh_layers-{key}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        warnings.warn(
            f"apg: native kernel build failed ({err}; {detail.decode(errors='replace')[:200]}); "
            "using the PyTorch implementation",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    for name in _FUNCTIONS:
        getattr(lib, name).restype = None
    return lib
