"""Native CPU kernels, compiled on first use with the system C compiler and cached.

Only hot loops that PyTorch's eager ops cannot fuse live here (``tanh_layers.c``: fused tanh
networks; ``categorical.c``: draws and log-probabilities over a short last axis; ``gmm.c``
and ``rings.c``: one task's block-update arithmetic each; ``smc.c``: systematic
resampling). Each has
a pure-PyTorch twin that runs on GPUs, on machines without a compiler, and when the
environment sets ``APG_NATIVE_KERNELS=0``; tests check the two agree. The math modules reach
the C functions only through the registered ops of ``apg/kernels/ops.py``
(``torch.ops.apg.<name>``), never through ``native_function`` directly.

All sources are built into one shared library, into ``$APG_KERNEL_CACHE`` (default ``~/.cache/apg/kernels``)
under a name that hashes the source, the flags and the CPU, so nodes of a heterogeneous
cluster sharing a home directory never load each other's ``-march=native`` builds. Beside
each build its sha256 (``<name>.so.sha256``, written after the library); a library whose
bytes do not match it, or that has none, is built again into place and never loaded.
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

import torch
from torch import Tensor

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # part of the cache key, not compiled alone
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
        objects = [Path(tmp) / f"{source.stem}.o" for source in _SOURCES]
        for source, obj in zip(_SOURCES, objects, strict=True):
            subprocess.run(
                [compiler, *_COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
                check=True,
                capture_output=True,
            )
        lib = Path(tmp) / target.name
        subprocess.run(
            [compiler, "-shared", "-fopenmp", *map(str, objects), "-o", str(lib), "-lm"],
            check=True,
            capture_output=True,
        )
        digest = Path(tmp) / _digest_file(target).name
        digest.write_text(hashlib.sha256(lib.read_bytes()).hexdigest() + "\n")
        # Each atomic, so concurrent builders (Ray trials) never see half a file; the digest
        # last, so a library is never recorded before it is in place.
        os.replace(lib, target)
        os.replace(digest, _digest_file(target))


def _digest_file(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _load_verified(target: Path) -> ctypes.CDLL | None:
    """The library at ``target`` if its bytes match the sha256 recorded beside it, else ``None``.

    Loaded through the descriptor whose bytes were hashed (``/proc/self/fd``), so a file
    replaced between the check and the load is not the one loaded. The descriptor stays
    open: the loader returns the library it already holds under a name it has seen, so a
    closed descriptor's number, reused by a later load, would load nothing new.
    """
    try:
        recorded = _digest_file(target).read_text().strip()
        handle = open(target, "rb")  # noqa: SIM115 - kept open, see above
    except FileNotFoundError:
        return None
    if hashlib.sha256(handle.read()).hexdigest() != recorded:
        handle.close()
        return None
    _LOADED.append(handle)
    return ctypes.CDLL(f"/proc/self/fd/{handle.fileno()}")


_LOADED: list = []  # the descriptors of the loaded libraries


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernels, or ``None`` (with one warning) where it cannot be built."""
    if os.environ.get("APG_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.system() != "Linux":
        return None
    key = hashlib.sha256(
        b"\0".join(
            [
                *(source.read_bytes() for source in (*_SOURCES, *_HEADERS)),
                " ".join(_COMPILE_FLAGS).encode(),
                compiler.encode(),
                _cpu_id().encode(),
            ]
        )
    ).hexdigest()[:16]
    target = _cache_dir() / f"apg_kernels-{key}.so"
    try:
        lib = _load_verified(target)
        if lib is None:
            _build(compiler, target)
            lib = _load_verified(target)
        if lib is None:  # replaced again by another builder's different bytes: not ours to trust
            raise OSError(f"{target} does not match its recorded sha256 after building it")
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        warnings.warn(
            f"apg: native kernel build failed ({err}; {detail.decode(errors='replace')[:200]}); "
            "using the PyTorch implementation",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return lib


_DTYPE_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_FUNCTIONS: dict[tuple[str, torch.dtype], object] = {}


def native_function(name: str, *tensors: Tensor):
    """The compiled function ``name`` for these floating tensors' dtype, or ``None`` where
    the PyTorch path must run (GPU tensors, other or mixed dtypes, no compiler, and inside
    ``torch.compile``, which compiles the PyTorch path).

    Called a few hundred times per training step, so the checks are plain attribute reads
    and the functions are looked up once per (name, dtype).
    """
    if torch.compiler.is_compiling():
        return None
    dtype = tensors[0].dtype
    if dtype not in _DTYPE_SUFFIX:
        return None
    for t in tensors:
        if t.dtype is not dtype or not t.is_cpu:
            return None
    lib = native_library()  # cached; looked up each time, so tests can switch it off
    if lib is None:
        return None
    fn = _FUNCTIONS.get((name, dtype))
    if fn is None:
        fn = getattr(lib, f"{name}_{_DTYPE_SUFFIX[dtype]}")
        fn.restype = None  # every kernel writes its outputs in place and returns void
        _FUNCTIONS[name, dtype] = fn
    return fn


def call(fn, *values: Tensor | int) -> None:
    """Call a compiled function: tensors by data pointer, sizes as C longs.

    Outputs must already be contiguous (they are written in place); inputs are made so
    here, and ``held`` keeps any such copies alive until the call returns. The first call
    fixes the function's argument types (a kernel's arguments are always tensors and sizes
    in the same places); ctypes then converts plain ints itself, about 3x less overhead
    per call than wrapping each argument in a ctypes object, at ~170 calls per GMM step.
    """
    held = [v.contiguous() if isinstance(v, Tensor) else v for v in values]
    if fn.argtypes is None:
        fn.argtypes = [ctypes.c_void_p if isinstance(v, Tensor) else ctypes.c_long for v in held]
    fn(*[v.data_ptr() if isinstance(v, Tensor) else v for v in held])  # a list: faster than a generator
