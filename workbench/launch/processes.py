"""Signalling worker processes by pid without ever hitting a process the launcher did not start.

A worker's pid is known from its "start" line; by the time a cancel or a clean-up signals it, the worker may have
ended and its number been handed to an unrelated process (pids wrap at 32768 on many machines; a test suite forks
thousands). So each worker also reports when it started (`start_time`, the kernel's start tick, which differs for
every process a pid number names), and `signal_worker` signals a pid only while the process holding it started at
that tick: through a pidfd when the platform has one (the check and the signal then name the same process), else
by pid right after the check.
"""

from __future__ import annotations

import os
import signal


def start_time(pid: int | None = None) -> int | None:
    """The start tick of process `pid` (this process by default), or None when it has ended or cannot be read."""
    try:
        with open(f"/proc/{pid or 'self'}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[-1].split()
    except (OSError, ValueError):
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):  # a zombie has ended: nothing to signal
        return None
    try:
        return int(fields[19])  # field 22 of stat(5); fields[0] is field 3 (the state)
    except ValueError:
        return None


def is_running(pid: int, started: int | None) -> bool:
    """True while the process that reported (`pid`, `started`) still runs. A pid whose start tick was not reported
    (None: no /proc here) counts as running while the pid exists and is not a zombie."""
    if started is not None:
        return start_time(pid) == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start_time(pid) is not None or not os.path.exists("/proc/self/stat")


def signal_worker(pid: int, started: int | None, sig: int) -> bool:
    """Send `sig` to the worker that reported (`pid`, `started`) if it still runs; False when it has ended (or
    its pid now names another process, which is left alone)."""
    pidfd = None
    if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError:  # an old kernel: fall back to the pid
            pidfd = None
    try:
        if not is_running(pid, started):
            return False
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
            else:
                os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    finally:
        if pidfd is not None:
            os.close(pidfd)
