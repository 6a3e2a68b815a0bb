"""Checks of values where they enter (command-line flags and params keys), before torch,
the filesystem or a loop sees them: counts and sizes positive and bounded, floats finite,
seeds in torch's range, devices that exist on this machine, what a dataset will take in
memory and on disk, output paths that stay inside the project, and files that parse.

A value refused raises ``ParamsError`` (a ``ValueError``) with one line naming the flag or
key; ``pipeline.errors.run_guarded`` turns it into ``apg-pipeline: error: ...`` and exit
status 2.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# torch.manual_seed and torch.Generator.manual_seed take seeds in this range (inclusive).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Minutes of training or a deadline: finite and at most ten million (19 years), so that the
# clock arithmetic on them (a deadline, iterations that fit) stays finite.
MAX_MINUTES = 1e7
# A simulated dataset's sizes above this are probed at this and scaled up (see dataset_bytes).
PROBE_CAP = 1024


class ParamsError(ValueError):
    """A value refused where it enters (a params key, an overlay, a command-line flag); the
    message is one line naming the key or flag and the reason."""


def is_kind(value: Any, kind: Any) -> bool:
    """``isinstance``, except that a bool is no number (YAML's ``true`` is no count)."""
    return isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)


def is_number(value: Any) -> bool:
    return is_kind(value, (int, float))


def integer(value: Any, where: str, low: int | None = None, high: int | None = None) -> int:
    """``value`` if it is an integer in ``[low, high]``; else ``ParamsError`` naming ``where``."""
    if not is_kind(value, int):
        raise ParamsError(f"{where}: must be an integer, got {value!r}")
    _bounds(value, where, low, high)
    return value


def _bounds(value: float, where: str, low: float | None, high: float | None) -> None:
    if low is not None and value < low:
        raise ParamsError(f"{where}: must be at least {low:g}, got {value!r}")
    if high is not None and value > high:
        raise ParamsError(f"{where}: must be at most {high:g}, got {value!r}")


def number(
    value: Any,
    where: str,
    low: float | None = None,
    high: float | None = None,
    positive: bool = False,
) -> float:
    """``value`` if it is a finite number in ``[low, high]`` (``positive``: above 0)."""
    if not is_number(value) or not math.isfinite(value):
        raise ParamsError(f"{where}: must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ParamsError(f"{where}: must be positive, got {value!r}")
    _bounds(value, where, low, high)
    return value


def minutes(value: float | None, where: str) -> float | None:
    """A duration in minutes (``None``: not given): finite, positive, at most ``MAX_MINUTES``."""
    if value is None:
        return None
    return number(value, where, high=MAX_MINUTES, positive=True)


def seed(value: Any, where: str) -> int:
    """A seed torch's generators accept."""
    if not SEED_MIN <= integer(value, where) <= SEED_MAX:
        raise ParamsError(f"{where}: must be in [-2**63, 2**64 - 1] (torch's seeds), got {value!r}")
    return value


def threads(value: Any, where: str = "--threads") -> int:
    """Torch threads: 0 (torch's default) up to four per CPU core of this machine."""
    return integer(value, where, 0, 4 * (os.cpu_count() or 1))


def finite_values(values: Mapping[str, Any], where: str) -> None:
    """Every number in ``values`` (model or network keywords, dataset sizes; nested lists
    and mappings included) is finite: a NaN hyperparameter simulates a dataset of NaN."""
    for key, value in values.items():
        _finite(value, f"{where}.{key}")


def _finite(value: Any, where: str) -> None:
    if isinstance(value, Mapping):
        finite_values(value, where)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _finite(item, f"{where}[{i}]")
    elif is_number(value) and not math.isfinite(value):
        raise ParamsError(f"{where}: must be a finite number, got {value!r}")


def network_values(values: Mapping[str, Any], where: str) -> None:
    """Proposal-network keywords: numbers finite, integers (widths, counts) at least 1."""
    finite_values(values, where)
    for key, value in values.items():
        if is_kind(value, int):  # a width or a count
            integer(value, f"{where}.{key}", low=1)


def size_values(task: str, sizes: Mapping[str, Any], where: str) -> None:
    """A dataset's sizes (the task simulator's keywords): known keys, the type of the
    simulator's default (an integer where it takes one), numbers finite and positive."""
    import inspect

    from apg.tasks import get_task

    params = inspect.signature(get_task(task).simulate).parameters
    known = {name: p.default for name, p in list(params.items())[3:] if p.kind is p.POSITIONAL_OR_KEYWORD}
    for key, value in sizes.items():
        if key not in known:
            raise ParamsError(f"{where}.{key}: unknown size of task {task}; known: {sorted(known)}")
        if is_number(value):  # a dataset of no points would train and score meaningless numbers
            number(value, f"{where}.{key}", positive=True)
        like_default(known[key], value, f"{where}.{key}")


# --------------------------------------------------------------------------- devices


def device(name: Any, flag: str = "--device") -> str:
    """``name`` if it names a device this machine has (``cpu``, ``cuda``, ``cuda:1``,
    ``mps``...); else one line saying why not. Returns the name unchanged."""
    import torch

    if not isinstance(name, str) or not name:
        raise ValueError(f"{flag}: give a device (cpu, cuda, cuda:N or mps), got {name!r}")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag} {name}: unknown device (cpu, cuda, cuda:N or mps)") from None
    if dev.type == "cpu":
        return name
    if dev.type == "cuda" and torch.version.cuda is None and torch.version.hip is None:
        raise ValueError(f"{flag} {name}: this torch build has no CUDA")
    backend = torch.backends.mps if dev.type == "mps" else getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if available is None:
        raise ValueError(f"{flag} {name}: not a device this pipeline runs on (cpu, cuda, cuda:N or mps)")
    if not available():
        raise ValueError(f"{flag} {name}: no {dev.type} device is available on this machine")
    count = getattr(getattr(torch, dev.type, None), "device_count", lambda: 1)()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{flag} {name}: this machine has {count} {dev.type} device(s)")
    return name


# --------------------------------------------------------------------------- room


def dataset_bytes(
    task: str, model_hparams: Mapping[str, Any], sizes: Mapping[str, Any], x_dtype: Any = None
) -> dict[str, int]:
    """Bytes of one simulated dataset (``x`` and the latents): ``simulated`` as the simulator
    returns them, ``stored`` with ``x`` cast to ``x_dtype`` (``None``: as simulated).

    A size above ``PROBE_CAP`` is probed at ``PROBE_CAP`` and its bytes scaled up in
    proportion (arrays grow at most linearly in each size), so that the estimate of a set
    too large for the machine never allocates it. Raises ``ValueError`` for model
    hyperparameters or sizes the task cannot simulate with.
    """
    import numpy as np
    import torch

    from apg.tasks import get_task

    spec = get_task(task)
    model = build_model(task, model_hparams)
    probe, scale = dict(sizes), 1.0
    for key, value in sizes.items():
        if is_kind(value, int) and value > PROBE_CAP:
            probe[key], scale = PROBE_CAP, scale * value / PROBE_CAP
    try:
        with torch.no_grad():
            arrays = spec.simulate(model, 1, torch.Generator().manual_seed(0), **probe)
    except (TypeError, ValueError, RuntimeError, IndexError, OverflowError) as err:
        raise ValueError(
            f"task {task} cannot simulate with model {dict(model_hparams)} and sizes {dict(sizes)}: "
            f"{first_line(err)}"
        ) from None
    simulated = sum(a.nbytes for a in arrays.values())
    x = arrays["x"]
    x_stored = x.nbytes if x_dtype is None else x.numel() * np.dtype(x_dtype).itemsize
    return {
        "simulated": math.ceil(simulated * scale),
        "stored": math.ceil((simulated - x.nbytes + x_stored) * scale),
    }


def build_model(task: str, model_hparams: Mapping[str, Any], where: str = "--model"):
    """The task's model from its keyword arguments: keys its config knows, each of the type
    of the config's default (an integer one a count, at least 1), numbers finite;
    ``ParamsError`` naming ``where``."""
    import dataclasses

    from apg.tasks import get_task

    finite_values(model_hparams, where)
    try:
        model = get_task(task).build_model(**model_hparams)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ParamsError(f"{where}: {first_line(err)}") from None
    cfg = getattr(model, "cfg", None)
    if dataclasses.is_dataclass(cfg):
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
        for key, value in model_hparams.items():
            default = defaults.get(key)
            if is_kind(default, int):  # a count
                integer(value, f"{where}.{key}", low=1)
            like_default(default, value, f"{where}.{key}")
    return model


def like_default(default: Any, value: Any, where: str) -> None:
    """``value`` of the kind of ``default``: a number where it is one, an integer where it is one."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ParamsError(f"{where}: must be true or false, got {value!r}")
    elif isinstance(default, int):
        integer(value, where)
    elif isinstance(default, float) and not is_number(value):
        raise ParamsError(f"{where}: must be a number, got {value!r}")


def networks(cfg: Any, model_flag: str = "--model", network_flag: str = "--network") -> None:
    """A ``TrainConfig``'s model and proposal networks build (on the CPU, thrown away):
    model keys the task knows, network keywords in range. Draws the initial weights from
    torch's generator: call it before an entry point seeds."""
    from apg.tasks import get_task
    from apg.training import make_method

    model = build_model(cfg.task, cfg.model, model_flag)
    network_values(cfg.network, network_flag)
    try:
        make_method(cfg).build_proposals(get_task(cfg.task), model, **cfg.network)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{network_flag}: {first_line(err)}") from None


def available_memory(device: str = "cpu") -> int:
    """Bytes free on ``device``: the machine's available memory, or a GPU's free memory."""
    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:  # Linux: what can be had without swapping (free plus reclaimable caches)
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def step_room(particles: int, batch_size: int, x: Any, device: str = "cpu") -> None:
    """Refuse ``particles`` x ``batch_size`` that one step cannot hold on ``device``: every
    particle holds at least a copy's worth of its dataset (a floor; a step needs several)."""
    import torch

    rows = min(batch_size, len(x))
    entries = math.prod(x.shape[1:])
    need = particles * rows * entries * torch.empty((), dtype=torch.get_default_dtype()).element_size()
    have = available_memory(device)
    if need > have:
        raise ValueError(
            f"L={particles} particles x {rows} datasets shaped {tuple(x.shape[1:])}: at least "
            f"{human(need)} of memory on {device} a step, more than the {human(have)} available"
        )


def free_disk(folder: Path) -> int:
    """Free bytes on the filesystem of ``folder`` (or of its nearest existing parent)."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def room(what: str, memory: int = 0, disk: int = 0, folder: Path | None = None) -> None:
    """Refuse ``what`` when it needs more than this machine's available memory, or more
    than the free disk under ``folder``, with the estimate and what is there."""
    have = available_memory() if memory else 0  # the machine's: datasets are made on the CPU
    if memory > have:
        raise ValueError(f"{what}: about {human(memory)} in memory, more than the {human(have)} available")
    if disk and folder is not None:
        free = free_disk(folder)
        if disk > free:
            raise ValueError(
                f"{what}: about {human(disk)} on disk, more than the {human(free)} free under {folder}"
            )


def human(nbytes: float) -> str:
    """``1234567`` -> ``1.2 MB`` (powers of 1000, as disk sizes are quoted)."""
    if nbytes < 1000:
        return f"{nbytes:.0f} B"
    for unit in ("kB", "MB", "GB", "TB"):
        nbytes /= 1000
        if nbytes < 1000:
            return f"{nbytes:.1f} {unit}"
    return f"{nbytes / 1000:.1f} PB"


# --------------------------------------------------------------------------- paths


def inside_project(value: Any, where: str) -> str:
    """A relative output path that stays inside the project (no absolute path, no ``..``
    climbing out of it): where a params key writes. A folder elsewhere is named on the
    command line (``--out``, ``--dir``), never in params."""
    if not isinstance(value, str) or not value.strip():
        raise ParamsError(f"{where}: must be a path inside the project, got {value!r}")
    if os.path.isabs(value) or os.path.normpath(value).split(os.sep)[0] == os.pardir:
        raise ParamsError(f"{where}: {value!r} is outside the project; give a path relative to it")
    return value


def relative_stays_inside(value: Any, where: str) -> str:
    """A path that may be absolute or a URI (a cluster's shared storage), but a relative one
    must stay inside the project."""
    if not isinstance(value, str) or not value.strip():
        raise ParamsError(f"{where}: must be a path, got {value!r}")
    if "://" in value or os.path.isabs(value):
        return value
    return inside_project(value, where)


# --------------------------------------------------------------------------- files


def read_text(path: str | Path) -> str:
    """A text file's contents; ``ValueError`` naming the file when it is not UTF-8 text."""
    path = Path(path)
    try:
        return path.read_text()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None


def read_json(path: str | Path) -> Any:
    """A JSON file's contents; ``ValueError`` naming the file when it does not parse."""
    path = Path(path)
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON ({err.msg}: line {err.lineno} column {err.colno})"
        ) from None


def read_csv(path: str | Path, **kwargs: Any):
    """A CSV file as a pandas DataFrame; ``ValueError`` naming the file when it does not parse."""
    import pandas as pd

    path = Path(path)
    try:
        return pd.read_csv(path, **kwargs)
    except (UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise ValueError(f"{path} is not a readable CSV table ({first_line(err)})") from None


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
