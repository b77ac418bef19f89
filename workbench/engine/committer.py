"""Commits of finished output files, on one background thread.

A file's commit (completeness check, fsync, rename) waits for the disk; done in line, every multi-file output
stalls its copies once per file (a 1 GiB re-shard into 256MB shards: five waits, 0.2-0.3 s in all here). A
committer lets the next file's copies run while the previous file is being synced. Nothing changes for crash
safety: a file still gets its final name only after its own fsync, and the index is written only after every
commit has finished (`finish`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol


class Committable(Protocol):
    def commit(self, *, sync_dir: bool = True) -> object: ...

    def abort(self) -> None: ...


class _Job:
    __slots__ = ("name", "writer", "then", "done", "error")

    def __init__(self, name: str, writer: Committable, then: Callable[[str], None] | None) -> None:
        self.name, self.writer, self.then = name, writer, then
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.writer.commit(sync_dir=False)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self.error = exc
            try:
                self.writer.abort()  # a failed fsync or rename leaves no partial file (a no-op when commit removed it)
            except BaseException:  # noqa: BLE001 - the commit's own error is the one to report
                pass
            self.done.set()
            return
        try:
            if self.then is not None:  # a remote destination: upload the committed file (spool.py)
                self.then(self.name)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self.error = exc
        finally:
            self.done.set()


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        job.run()


class Committer:
    """Runs `writer.commit` for finished files in the background, in submission order; errors reach the caller
    at its next `submit` or at `finish`. `then(name)` runs after each commit on the same thread (a remote
    destination's upload of the finished file)."""

    def __init__(self, then: Callable[[str], None] | None = None) -> None:
        self._then = then
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started with the first commit
        self._pending: list[_Job] = []
        self._lock = threading.Lock()  # copy lanes submit from two threads
        self.committed: list[str] = []

    def submit(self, name: str, writer: Committable) -> None:
        """Commit `writer` (whose file is complete) while the caller goes on with other files."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=_serve, args=(self._jobs,), name="workbench-commit", daemon=True)
                self._thread.start()
            job = _Job(name, writer, self._then)
            self._pending.append(job)
            self._jobs.put(job)
            self._collect(wait=False)

    def finish(self) -> list[str]:
        """Wait for every commit; raises the first failure. Returns the committed file names in order."""
        with self._lock:
            self._collect(wait=True)
        return self.committed

    def close(self) -> None:
        """Wait for commits still running (a failure is already being raised, so theirs are dropped) and stop
        the thread. Called before the remaining writers are aborted."""
        with self._lock:
            pending, self._pending = self._pending, []
        for job in pending:
            job.done.wait()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _collect(self, *, wait: bool) -> None:
        while self._pending and (wait or self._pending[0].done.is_set()):
            job = self._pending.pop(0)
            job.done.wait()
            if job.error is not None:
                raise job.error
            self.committed.append(job.name)
