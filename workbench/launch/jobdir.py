"""The launcher's job folder (`<tmp>/workbench-job-*`): made with an owner lock, and swept when its owner died.

A launcher killed with SIGKILL cannot remove its job folder, so each folder holds `.owner.lock`, flocked by
the launcher and inherited by the processes it starts (the local launcher's workers, torchrun's agent): the
kernel drops that lock only when the last of them has exited. Each new launch first removes the job folders
of this user whose owner lock nobody holds, never one whose workers still run. A folder without an owner
lock, or with an empty one (left by an older workbench, or being made this instant), is removed only once it is an
hour old.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from ..errors import UnsafeFileError
from ..files import create_exclusive, open_regular

JOB_PREFIX = "workbench-job-"
OWNER_LOCK = ".owner.lock"
UNLOCKED_GRACE_SECONDS = 3600.0


def make_jobdir() -> tuple[Path, int]:
    """Sweep stale job folders, then make a new one; returns it and the descriptor of its held owner lock
    (pass it to the processes the job starts; close it after removing the folder)."""
    sweep_stale_jobs()
    folder = Path(tempfile.mkdtemp(prefix=JOB_PREFIX))
    fd = create_exclusive(folder / OWNER_LOCK, flags=os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return folder, fd


def _stale(folder: Path, now: float) -> bool:
    try:
        fd = open_regular(folder / OWNER_LOCK)
    except FileNotFoundError:
        try:
            return now - os.lstat(folder).st_mtime > UNLOCKED_GRACE_SECONDS
        except OSError:
            return False
    except (OSError, UnsafeFileError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Its maker writes its pid only once it holds the lock: an empty lock file is a folder being made this
        # instant (created, not yet locked), not one whose owner died.
        if not os.pread(fd, 32, 0):
            return now - os.fstat(fd).st_mtime > UNLOCKED_GRACE_SECONDS
    except BlockingIOError:
        return False  # the launcher or its workers still run
    finally:
        os.close(fd)  # (closing drops the probe's lock)
    return True


def sweep_stale_jobs(parent: str | os.PathLike | None = None) -> list[Path]:
    """Remove this user's `workbench-job-*` folders in `parent` (the temp directory) that no live process
    owns; returns the folders removed."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    now = time.time()
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(JOB_PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        folder = Path(entry.path)
        if _stale(folder, now):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
