"""A rank's uploads to a remote destination: finished spool files (or, streamed, each finished part) uploaded and
removed from the spool.

The engine writes into the spool folder (`plan.dest`) as into any folder; this hooks the moments a remote
destination needs. A file uploaded whole: before it is opened (`opening`: wait while finished files awaiting
upload fill the spool, `output/remote/spool.SpoolGate`) and after it is committed (`upload`, on the committer's
thread: SHA-256, `file_done`, delete the spool copy). A streamed file (`planning.spool.streamed_files`: S3
multipart parts): its preallocated blocks are freed when it is opened (`opened`), each part is accounted for before
the first step writing into it (`before`), and once the last such step ran and its writes were flushed (`after`)
the part is read back, uploaded on a part thread and its blocks freed (a hole punched); the committer's `upload`
then completes the object. So the spool holds parts, not files.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import PlanError
from ..output.remote.spool import SpoolGate, file_sha256, punch
from ..planning.model import Plan
from ..planning.schedule import Step
from ..planning.spool import deferred_names, streamed_files


def punch_hole(fd: int, offset: int, length: int, path: object = None) -> None:
    """Free the disk blocks of bytes [offset, offset+length) of a spool file (they read back as zeros; its size stays).
    Planning streams parts only into a spool folder that can (`output.remote.spool.can_punch_holes`)."""
    if length <= 0:
        return
    code = punch(fd, offset, length)
    if code:
        raise PlanError(f"Cannot free uploaded parts of the spool file {path}: {os.strerror(code)} [errno {code}]. The spool "
                        "must be on a file system that can punch holes (ext4, xfs, btrfs, tmpfs): choose one with "
                        "--spool-dir.", file=str(path)) from OSError(code, os.strerror(code))


class _Stream:
    """One streamed file's state on this rank: steps still to run per part, its read descriptor, its part uploads."""

    def __init__(self, plan_file) -> None:
        self.file = plan_file
        self.left = list(plan_file.steps_per_part)
        self.fd: int | None = None
        self.path = None
        self.futures: list[Future] = []


class SpoolUploads:
    """The spool gate and upload hooks of one rank of a plan with a remote destination."""

    def __init__(self, plan: Plan, rank: int = 0) -> None:
        assert plan.remote is not None and plan.dest is not None
        self.plan = plan
        self.gate = SpoolGate(plan.options.spool_size)
        self.sizes = {f.name: f.size for f in plan.output_file_list}
        self.uploaded: list[str] = []
        plan.remote.defer(deferred_names(plan))  # an output without an index: its file appears at the finish
        self.streams = {name: _Stream(f) for name, f in streamed_files(plan, rank).items()}
        self._pool: ThreadPoolExecutor | None = None
        if self.streams:
            threads = int(getattr(plan.remote, "part_threads", 1) or 1)
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="workbench-part")
        self._lock = threading.Lock()

    # -- the lane's hooks ----------------------------------------------------------------------------------------

    def breaks(self, steps: list[Step]) -> set[int]:
        """Step indices after which a lane's stretch of copies must stop: before a step opening a part (its room is
        waited for) and after a step closing one (its upload starts)."""
        if not self.streams:
            return set()
        stops: set[int] = set()
        for position, step in enumerate(steps):
            for name in step.files:
                s = self.streams.get(name)
                if s is None:
                    continue
                if position and step.index in s.file.first_step:
                    stops.add(steps[position - 1].index)
                if step.index in s.file.parts_of_step:
                    stops.add(step.index)
        return stops

    def opening(self, name: str, stop: threading.Event | None = None) -> None:
        """`name` is about to be written: wait for room in the spool (a streamed file: for its parts no step writes)."""
        s = self.streams.get(name)
        if s is None:
            self.gate.open(self.sizes.get(name, 0), stop)
            return
        empty = [k for k, n in enumerate(s.left) if not n]
        if empty:
            self.gate.open(sum(s.file.part_bytes(k) for k in empty), stop)

    def open_writer(self, name: str, layout: object) -> object | None:
        """The writer of a streamed file: a sparse spool file (no preallocated blocks), its upload started, the parts
        no step writes (header or padding only) sent; None for a file uploaded whole (the format opens it)."""
        s = self.streams.get(name)
        if s is None:
            return None
        assert self.plan.dest is not None and self.plan.remote is not None
        writer = self.plan.output_format.sparse_writer(self.plan.dest, layout)  # type: ignore[arg-type]
        s.path = writer.partial_path
        s.fd = os.open(s.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))  # punching holes needs write access
        self.plan.remote.open_stream(name, s.file.size)
        for k, n in enumerate(s.left):
            if not n:
                s.left[k] = -1
                self._send(s, k)
        return writer

    def before(self, step: Step, stop: threading.Event | None = None) -> None:
        """`step` is about to run: wait for room for the parts it is the first to write."""
        for name in step.files:
            s = self.streams.get(name)
            if s is not None:
                for k in s.file.first_step.get(step.index, ()):
                    self.gate.open(s.file.part_bytes(k), stop)

    def after(self, steps: Iterable[Step], flush: Callable[[], None]) -> None:
        """`steps` ran: the parts whose last step was among them are complete once the lane's queued writes are
        flushed (`flush`); then each is uploaded on a part thread."""
        ready: list[tuple[_Stream, int]] = []
        for step in steps:
            for name in step.files:
                s = self.streams.get(name)
                if s is None:
                    continue
                for k in s.file.parts_of_step.get(step.index, ()):
                    s.left[k] -= 1
                    if s.left[k] == 0:
                        ready.append((s, k))
        if not ready:
            return
        flush()
        for s, k in ready:
            s.left[k] = -1
            self._send(s, k)

    def finished(self, name: str) -> None:
        """`name` is complete; its commit and upload are queued (a streamed file's parts are accounted already)."""
        if name not in self.streams:
            self.gate.finished(self.sizes.get(name, 0))

    # -- uploads -------------------------------------------------------------------------------------------------

    def _send(self, s: _Stream, k: int) -> None:
        length = s.file.part_bytes(k)
        self.gate.finished(length)
        assert self._pool is not None
        s.futures.append(self._pool.submit(self._put, s, k, length))

    def _put(self, s: _Stream, k: int, length: int) -> None:
        try:
            begin = s.file.bounds[k][0]
            data = os.pread(s.fd, length, begin)
            if len(data) != length:
                raise PlanError(f"Cannot upload {s.file.name}: its spool copy {s.path} has {len(data)} bytes at {begin} "
                                f"where {length} were written.", file=s.file.name)
            self.plan.remote.put_part(s.file.name, k + 1, data)
            del data
            punch_hole(s.fd, begin, length, s.path)
        finally:
            self.gate.released(length)

    def upload(self, name: str) -> None:
        """Upload the committed spool file `name` (a streamed one: wait for its parts and complete the object), then
        delete it (the committer thread calls this)."""
        assert self.plan.dest is not None and self.plan.remote is not None
        path = self.plan.dest / name
        s = self.streams.get(name)
        if s is not None:
            try:
                for future in s.futures:
                    future.result()
                self.plan.remote.close_stream(name, s.file.size)
                os.unlink(path)
                self.uploaded.append(name)
            finally:
                self._close_fd(s)
            return
        try:
            size = os.stat(path).st_size
            self.plan.remote.file_done(name, path, size, file_sha256(path))
            os.unlink(path)
            self.uploaded.append(name)
        finally:
            self.gate.released(self.sizes.get(name, 0))  # also on failure: a lane waiting for room must not hang

    def _close_fd(self, s: _Stream) -> None:
        with self._lock:
            fd, s.fd = s.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    raise

    def close(self) -> None:
        """Stop: parts not yet started are dropped, running ones waited for (before the uploads are aborted)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for s in self.streams.values():
            self._close_fd(s)
