"""Writing whole pages of an output file with O_DIRECT: from a buffer straight to the disk, past the page cache.

A buffered copy (`copy_file_range`, or read + write) makes the kernel allocate a page-cache page for every output
byte, copy into it, and later write it back; `cp -r` + `sync` pays the same. On the VM this project measures on,
allocating those pages is most of the system time. An O_DIRECT write moves a page-aligned buffer to the device
without a cache page, so assembling output bytes in a buffer (one copy out of the source's cached pages) and
writing the buffer directly costs one memory copy per byte and no page-cache growth (the written model does not
evict what the machine had cached either). Several writes are kept in flight by a few threads, because one
synchronous write at a time leaves the device idle between requests.

Only page-aligned ranges of a file go this way (`engine.copier` cuts each contiguous run of output into a
buffered head, whole pages, and a buffered tail); headers, small pieces and casts stay buffered writes.
Filesystems that refuse O_DIRECT (some network filesystems) keep the buffered path. Off unless
`WORKBENCH_DIRECT_IO=1` (see `enabled`).
"""

from __future__ import annotations

import functools
import mmap
import os
import queue
import threading
from typing import Any

PAGE = 4096
BLOCK = 4 << 20  # bytes per direct write: large requests, few system calls
IN_FLIGHT = 4  # direct writes running at once (threads); one more buffer is being filled meanwhile
MIN_RUN = 1 << 20  # contiguous output runs shorter than this stay buffered
_ENV = "WORKBENCH_DIRECT_IO"  # '1' turns direct writes on; off by default (see `enabled`)


def enabled() -> bool:
    """Whether direct writes may be used (`WORKBENCH_DIRECT_IO=1`).

    Off by default: on this project's VM they cut the system CPU of a 1 GiB re-shard by about half (0.31-0.34 s
    against 0.57-0.68 s) but did not make it faster than buffered copies in paired runs (wall times swung 1.1-2.1 s
    either way with the VM's memory state), and a file written past the page cache is read from disk by whoever
    loads it next. Worth trying on bare metal and for outputs much larger than memory."""
    return os.environ.get(_ENV, "0") == "1" and hasattr(os, "O_DIRECT")


def pool_bytes() -> int:
    """Memory the buffers of one `DirectWrites` hold (what `planning.rss` adds for a run that copies bytes)."""
    return (IN_FLIGHT + 1) * BLOCK


@functools.cache
def supported(folder: str) -> bool:
    """Whether files made in `folder` (or, while it does not exist yet, its nearest existing parent) take O_DIRECT
    writes: asked of the filesystem with an unnamed temporary file, so nothing appears in the folder."""
    if not enabled():
        return False
    path = os.path.abspath(folder)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        fd = os.open(path, os.O_TMPFILE | os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    return True


def reopen_direct(fd: int) -> int | None:
    """A second descriptor of the same open file (not of its path, which could have been swapped) with O_DIRECT,
    or None where the filesystem refuses it."""
    if not enabled():
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return None


class DirectWrites:
    """A few page-aligned buffers and threads that write whole pages to files opened with O_DIRECT.

    `buffer()` hands out a free buffer (waiting for a write to finish when all are busy), `submit()` queues it,
    `drain()` waits for every queued write. A write's error is raised by the next of these calls, so a failed
    write stops the run before its files are committed.
    """

    def __init__(self, in_flight: int = IN_FLIGHT, block: int = BLOCK) -> None:
        self.block = block
        self._buffers = [mmap.mmap(-1, block) for _ in range(in_flight + 1)]  # anonymous maps are page-aligned
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        for buffer in self._buffers:
            self._free.put(buffer)
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._work, name=f"workbench-direct-{k}", daemon=True) for k in range(in_flight)]
        for thread in self._threads:
            thread.start()

    def buffer(self) -> mmap.mmap:
        """A free page-aligned buffer of `block` bytes."""
        self._raise()
        buffer = self._free.get()
        self._raise()
        return buffer

    def submit(self, fd: int, buffer: mmap.mmap, offset: int, length: int) -> None:
        """Write `length` bytes (a multiple of the page) of `buffer` at `offset` (page-aligned) of O_DIRECT `fd`."""
        if offset % PAGE or length % PAGE:
            raise ValueError(f"direct write of {length} bytes at {offset} is not page-aligned")
        with self._done:
            self._pending += 1
        self._jobs.put((fd, buffer, offset, length))

    def drain(self) -> None:
        """Wait until every submitted write has finished; raise the first write error."""
        with self._done:
            while self._pending:
                self._done.wait()
        self._raise()

    def close(self) -> None:
        """Stop the threads and free the buffers (after `drain`, or after a failure)."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
        for buffer in self._buffers:
            try:
                buffer.close()
            except BufferError:  # a view is still held by a failed write's traceback: freed with it
                pass
        self._buffers = []

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fd, buffer, offset, length = job
            try:
                if self._error is None:
                    with memoryview(buffer) as view:
                        done = 0
                        while done < length:
                            done += os.pwrite(fd, view[done:length], offset + done)
            except BaseException as exc:  # raised in the run's thread by its next call
                self._error = exc
            finally:
                self._free.put(buffer)
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()


__all__ = ["BLOCK", "DirectWrites", "MIN_RUN", "enabled", "pool_bytes", "reopen_direct", "supported"]
