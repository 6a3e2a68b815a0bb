"""How every command and stage fails on bad input: one line on stderr, exit status 2.

Its own module so that the stages (``python -m pipeline.sweep`` and the rest) and the
``apg-pipeline`` command line share it without importing each other.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable
from typing import Any

from apg.training import TrainingDiverged
from pipeline.diskfull import DiskFull, disk_full_message

EXIT_BAD_INPUT = 2


def run_guarded(work: Callable[[], Any]) -> Any:
    """Run ``work``; turn expected failures into one line on stderr and exit status 2."""
    try:
        return work()
    except TrainingDiverged as err:
        fail(f"training diverged: {err}")
    except DiskFull as err:  # a sweep's trial or driver: the path and the space left
        fail(str(err))
    except (ValueError, FileNotFoundError, KeyError) as err:
        # ParamsError, DatasetError, CheckpointError and ValueErrors from the library
        # all carry a one-line message naming the problem.
        text = str(err).strip().splitlines()
        fail(text[0] if text else type(err).__name__)
    except OSError as err:  # a full disk, a directory where a file goes, no permission
        if err.errno == errno.ENOSPC:
            fail(disk_full_message(err))
        where = f": {err.filename}" if err.filename else ""
        fail(f"{err.strerror or type(err).__name__}{where}")
    except KeyboardInterrupt:
        fail("interrupted")


def fail(message: str) -> None:
    """Print ``apg-pipeline: error: <message>`` and exit with status 2."""
    print(f"apg-pipeline: error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


class SweepError(ValueError):
    """The sweep could not run or some cells did not finish (one-line message; a
    ``ValueError`` so entry points report it like any other bad input)."""
