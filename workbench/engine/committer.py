"""Commits of finished output files, on one background thread.

A file's commit (completeness check, fsync, rename) waits for the disk; done in line, every multi-file output
stalls its copies once per file (a 1 GiB re-shard into 256MB shards: five waits, 0.2-0.3 s in all here). A
committer lets the next file's copies run while the previous file is being synced. Nothing changes for crash
safety: a file still gets its final name only after its own fsync, and the index is written only after every
commit has finished (`finish`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol


class Committable(Protocol):
    def commit(self, *, sync_dir: bool = True) -> object: ...

    def abort(self) -> None: ...


def _commit(writer: Committable) -> None:
    try:
        writer.commit(sync_dir=False)
    except BaseException:
        writer.abort()  # a failed fsync or rename leaves no partial file behind (a no-op when commit removed it)
        raise


class Committer:
    """Runs `writer.commit` for finished files in the background, in submission order; errors reach the caller
    at its next `submit` or at `finish`."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[tuple[str, Future]] = []
        self.committed: list[str] = []

    def submit(self, name: str, writer: Committable) -> None:
        """Commit `writer` (whose file is complete) while the caller goes on with other files."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="workbench-commit")
        self._pending.append((name, self._pool.submit(_commit, writer)))
        self._collect(wait=False)

    def finish(self) -> list[str]:
        """Wait for every commit; raises the first failure. Returns the committed file names in order."""
        self._collect(wait=True)
        return self.committed

    def close(self) -> None:
        """Wait for commits still running (a failure is already being raised, so theirs are dropped) and stop
        the thread. Called before the remaining writers are aborted."""
        for _, future in self._pending:
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - the run is failing already; that file was aborted by `_commit`
                pass
        self._pending = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _collect(self, *, wait: bool) -> None:
        while self._pending and (wait or self._pending[0][1].done()):
            name, future = self._pending.pop(0)
            future.result()
            self.committed.append(name)
