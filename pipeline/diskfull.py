"""A full disk stops a sweep at once, with one line naming the path and the space left.

Ray retries a failed trial (``sweep.max_failures``) and starts the pending ones, and on a
full disk each of them fails again at its first write: minutes of retries, then a list of
unfinished cells. Instead, a trial whose write fails with ``ENOSPC`` reports it
(:data:`DISK_FULL`) before it fails, and the driver's callback ends the Tune loop on that
result, before Ray handles the failure. Tune's state is left as the loop last saved it,
so a rerun after freeing space resumes every unfinished cell.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

DISK_FULL = "disk_full"  # the key of the result by which a trial reports a full disk


class DiskFull(RuntimeError):
    """A write failed for want of space; the message names the path and the space left."""


def as_disk_full(err: BaseException, where: str | os.PathLike) -> DiskFull | None:
    """``err`` as a ``DiskFull`` when it, or an error behind it (Ray and Tune wrap what a
    trial or a callback raised), is one or an ``ENOSPC`` ``OSError``; else ``None``.
    ``where``: the path to name when the error names none."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, DiskFull):
            return DiskFull(str(cause))
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return DiskFull(disk_full_message(cause, where))
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def disk_full_message(err: OSError, where: str | os.PathLike | None = None) -> str:
    path = Path(err.filename or where or ".")
    return (
        f"{os.strerror(errno.ENOSPC)}: {path} ({_free_space(path)} free there); "
        "free some space and run it again to resume"
    )


def _free_space(path: Path) -> str:
    """The space left on the filesystem that holds ``path`` (its nearest existing folder)."""
    for folder in (path, *path.absolute().parents):
        try:
            free = float(shutil.disk_usage(folder).free)
        except OSError:
            continue
        for unit in ("bytes", "KiB", "MiB", "GiB"):
            if free < 1024 or unit == "GiB":
                return f"{free:.0f} bytes" if unit == "bytes" else f"{free:.1f} {unit}"
            free /= 1024
    return "unknown space"


def disk_full_callback():
    """A Tune callback that raises ``DiskFull`` on a trial's :data:`DISK_FULL` result,
    which ends ``Tuner.fit`` at once. Holds no state, so the copy Tune pickles with its
    experiment and restores on a rerun works the same."""
    from ray.tune import Callback

    class _StopOnFullDisk(Callback):
        def on_trial_result(self, iteration, trials, trial, result, **info):
            if result.get(DISK_FULL):
                raise DiskFull(result[DISK_FULL])

    return _StopOnFullDisk()


def report_disk_full(err: BaseException, where: str | os.PathLike) -> None:
    """In a trial: when ``err`` is a full disk, report it to the driver (a result travels
    through Ray, not the disk) and raise it as ``DiskFull``; else return."""
    full = as_disk_full(err, where)
    if full is None:
        return
    from ray import tune

    tune.report({DISK_FULL: str(full)})
    raise full from err
