"""Ends the processes an embedded Ray instance leaves behind when its driver dies.

A sweep or search that starts Ray on this machine (``ray.init(address="local")``) owns
Ray's helper processes (GCS, raylet, log monitor, workers): ``ray.shutdown()`` ends them on
a normal exit or Ctrl+C, but a driver killed with ``kill -9`` cannot, and they linger for
minutes holding cores, memory and ports. ``watch(pid)`` starts a small watcher process in
a session of its own (a Ctrl+C in the terminal does not reach it) that notes the driver's
descendants twice a second and, once the driver is gone, kills the ones still alive, with
their own descendants. Linux only (it reads ``/proc``); elsewhere it does nothing.

A process is known by its pid and start time together, so a pid reused after a process
ended is never killed. Ray clusters the driver attached to are never touched: the watcher
is started only for the embedded instance (``pipeline.sweep.ray_setup.start_ray``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5
PROC = Path("/proc")


def watch(pid: int | None = None) -> subprocess.Popen | None:
    """Start the watcher of process ``pid`` (default: this one); ``None`` off Linux."""
    if not (PROC / "self" / "stat").is_file():
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.sweep.reaper", str(pid or os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time)`` of a live process, or ``None``."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields after its last ")".
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has ended; only its parent's wait remains
        return None
    return int(fields[1]), int(fields[19])


def _processes() -> dict[int, tuple[int, int]]:
    out = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (info := _stat(int(entry.name))) is not None:
            out[int(entry.name)] = info
    return out


def descendants(roots: set[int], table: dict[int, tuple[int, int]]) -> dict[int, int]:
    """``{pid: start time}`` of every process below ``roots`` in ``table``."""
    found: dict[int, int] = {}
    frontier = set(roots)
    while frontier:
        children = {pid for pid, (parent, _) in table.items() if parent in frontier and pid not in found}
        found.update({pid: table[pid][1] for pid in children})
        frontier = children
    return found


def reap(driver: int, poll_s: float = POLL_S) -> int:
    """Watch ``driver``; when it is gone, kill what it left. Returns how many were killed."""
    me = os.getpid()
    first = _stat(driver)
    if first is None:
        return 0
    started = first[1]
    known: dict[int, int] = {}
    while (info := _stat(driver)) is not None and info[1] == started:
        table = _processes()
        known.update({p: t for p, t in descendants({driver}, table).items() if p != me})
        known = {p: t for p, t in known.items() if p in table and table[p][1] == t}
        time.sleep(poll_s)
    table = _processes()
    alive = {p: t for p, t in known.items() if p in table and table[p][1] == t}
    alive.update(descendants(set(alive), table))
    alive.pop(me, None)
    for pid, start in alive.items():
        now = _stat(pid)
        if now is not None and now[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return len(alive)


if __name__ == "__main__":
    reap(int(sys.argv[1]))
