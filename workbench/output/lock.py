"""One conversion at a time per destination: an exclusive `flock` on `<dest>/.workbench.lock`.

The lock is held for the whole run (prepare, every shard, commit) by the process that drives it: the
local run, the torchrun launcher (whose torchrun child inherits the locked descriptor, so workers that
outlive a killed launcher still hold it), or rank 0 of an in-place torchrun job. The file records who holds it
(pid, host, start time) so a refused second run can say so; when that process has died but the processes it
started still hold the lock (a launcher killed with SIGKILL), the message names them instead. The kernel drops the lock when its holder
dies, even by kill -9, so a stale file never blocks anyone; a clean run removes the file when it ends.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path

from ..errors import PlanError, UnsafeFileError
from ..files import open_or_create, open_regular

LOCK_NAME = ".workbench.lock"
_RETRY_SECONDS = 0.25  # a probe (`holder`) holds the lock for microseconds; do not mistake it for a run


def _host() -> str:
    """This machine's name, as `socket.gethostname()` gives it (uname's node name on POSIX, without importing
    `socket`: a byte-copy conversion's start-up is measured against `cp -r`)."""
    try:
        return os.uname().nodename
    except AttributeError:  # not POSIX
        import socket

        return socket.gethostname()


def _holder_text(fd: int) -> str:
    """Who holds the lock open on `fd`: the recorded run, and, when that process has died (a launcher killed with
    SIGKILL), the live processes that inherited the lock from it (its workers), which are what to stop."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "a process that has not yet recorded itself"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    text = f"pid {info.get('pid')} on host {info.get('host', '?')}, started {started}"
    pid = info.get("pid")
    if info.get("host") != _host() or not isinstance(pid, int) or _alive(pid):
        return text
    holders = _processes_holding(fd)
    if not holders:
        return f"{text}, which has exited; the processes it started still hold the lock"
    listed = ", ".join(f"pid {p} ({command})" for p, command in holders[:8])
    pids = " ".join(str(p) for p, _ in holders)
    return (f"{text}, which has exited, but processes it started still hold the lock: {listed}; stop them "
            f"(kill {pids}) if that run is abandoned")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    try:  # a zombie (exited, not yet reaped) holds nothing
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(") ", 1)[-1][:1] != "Z"
    except OSError:
        return True


def _processes_holding(fd: int) -> list[tuple[int, str]]:
    """(pid, command line) of the other processes of this user with the file of `fd` open (Linux's /proc);
    [] where /proc cannot tell."""
    try:
        target = os.fstat(fd)
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    except OSError:
        return []
    found = []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # another user's process, or gone
            continue
        for entry in fds:
            try:
                info = os.stat(f"/proc/{pid}/fd/{entry}")
            except OSError:
                continue
            if (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino):
                found.append((pid, _command(pid)))
                break
    return found


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            parts = fh.read(4096).split(b"\0")
    except OSError:
        return "?"
    return " ".join(p.decode("utf-8", "replace") for p in parts[:5] if p)[:120]


def holder(dest: str | os.PathLike) -> str | None:
    """Who holds the lock of `dest` ('pid 123 on host h, started ...'), or None when no run holds it."""
    path = Path(dest) / LOCK_NAME
    try:
        fd = open_regular(path)
    except (OSError, UnsafeFileError):  # not a lock a run holds; acquire() refuses a planted entry by name
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder_text(fd)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class DestinationLock:
    """The exclusive lock of one destination; use as a context manager around a whole conversion."""

    def __init__(self, dest: str | os.PathLike) -> None:
        self.dest = Path(dest)
        self.path = self.dest / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def fileno(self) -> int:
        """The locked descriptor: a child process that inherits it keeps the lock held while it lives."""
        assert self._fd is not None, "acquire() first"
        return self._fd

    def acquire(self) -> DestinationLock:
        """Take the lock or raise a PlanError naming the run that holds it."""
        self.dest.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + _RETRY_SECONDS
        while True:
            fd = open_or_create(self.path, os.O_RDWR, verb="lock")  # never a planted symlink, FIFO or hard link
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() < deadline:
                    os.close(fd)
                    time.sleep(0.02)
                    continue
                who = _holder_text(fd)
                os.close(fd)
                raise PlanError(
                    f"Cannot convert into {self.dest}: another conversion is writing there ({who}). Wait for it to "
                    f"finish or stop it, or choose another destination. ({self.path} is its lock.)",
                    file=str(self.path),
                ) from None
            # The previous holder may have removed the file between our open and our flock: lock the live file.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        record = json.dumps({"pid": os.getpid(), "host": _host(), "started": time.time(), "argv": sys.argv[:4]})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode("utf-8"), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file, then drop the lock (a run that opened the old file sees it gone and retries)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> DestinationLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_destination(dest: str | os.PathLike) -> DestinationLock:
    """Acquire the lock of `dest` for a conversion (see `DestinationLock`)."""
    return DestinationLock(dest).acquire()
