"""Byte-level steps: output bytes are runs of source bytes, moved by kernel copies without tensors.

Pieces are queued and flushed in batches. A flush first takes every long run that is contiguous in the
destination (at least `direct_io.MIN_RUN` bytes, from any number of source runs) and assembles its whole pages
in buffers written with O_DIRECT (`SafetensorsWriter.assemble_span`, `output.direct_io`): one memory copy per
byte and no page cache for the output. The rest is sorted by source position, and pieces adjacent both in the
source and in the destination become one `copy_file_range`, so a checkpoint of many small tensors costs a few
large copies rather than one syscall per tensor.
"""

from __future__ import annotations

from operator import itemgetter

from ..output import direct_io
from ..output.safetensors import WRITE_CALL_MAX, SafetensorsWriter

FLUSH_PIECES = 65536
FLUSH_BYTES = 256 << 20
GATHER_RUN = 64 << 10  # runs shorter than this are assembled with their neighbours in the output (`_gather`)


# A queued piece is a plain tuple (100k of them for a checkpoint of tiny tensors; a tuple is the cheapest record to make
# and sorts by source position as it is): `length` bytes at `src_offset` of `src_fd` go to tensor `name` at byte `at`,
# absolute offset `dst` of the file of writer number `writer_order`.
Piece = tuple[int, int, int, int, str, int, int]  # (writer_order, src_fd, src_offset, dst, name, at, length)
_BY_DESTINATION = itemgetter(0, 3)


class CopyQueue:
    """Pending kernel copies, merged and executed on `flush()`."""

    def __init__(self) -> None:
        self._pieces: list[Piece] = []
        self._writers: list[SafetensorsWriter] = []
        self._order: dict[int, int] = {}
        self.queued_bytes = 0
        self.copied_bytes = 0
        self.copy_calls = 0
        self._direct: direct_io.DirectWrites | None = None  # made on the first long run
        self._direct_on = direct_io.enabled()

    def add(self, writer: SafetensorsWriter, dst: int, name: str, at: int, src_fd: int, src_offset: int, length: int) -> None:
        """Queue a copy of `length` source bytes into tensor `name` (absolute file offset `dst`)."""
        self._pieces.append((self.order_of(writer), src_fd, src_offset, dst, name, at, length))
        self.queued_bytes += length

    def order_of(self, writer: SafetensorsWriter) -> int:
        """The number pieces for `writer` carry (see `extend`)."""
        order = self._order.get(id(writer))
        if order is None:
            order = self._order[id(writer)] = len(self._writers)
            self._writers.append(writer)
        return order

    def extend(self, pieces: list[Piece], nbytes: int) -> None:
        """Queue many pieces at once, made by the caller with `order_of` (a stretch of small copies, `engine.steps`)."""
        self._pieces.extend(pieces)
        self.queued_bytes += nbytes

    @property
    def full(self) -> bool:
        """True when enough is queued that it should be flushed (bounds bookkeeping and keeps progress moving)."""
        return len(self._pieces) >= FLUSH_PIECES or self.queued_bytes >= FLUSH_BYTES

    def flush(self) -> int:
        """Run every queued copy (merged where possible); returns the bytes copied."""
        if not self._pieces:
            return 0
        total, pieces = 0, self._pieces
        if self._direct_on:
            pieces, total = self._assemble_long_runs(pieces)
        if pieces:
            total += self._copy_runs(pieces)
        if self._direct is not None:
            self._direct.drain()
        self.clear()
        self.copied_bytes += total
        return total

    def _copy_runs(self, pieces: list[Piece]) -> int:
        """Kernel-copy pieces adjacent in both source and destination as one run each; short runs are gathered."""
        total = 0
        pieces = sorted(pieces)  # by writer, source descriptor and source offset
        small: list[tuple[int, int, int, list[Piece]]] = []  # (writer, destination, bytes, run) left to `_gather`
        first = pieces[0]
        run: list[Piece] = [first]
        order, fd, src_end, dst_end = first[0], first[1], first[2] + first[6], first[3] + first[6]
        run_bytes = first[6]
        for piece in pieces[1:]:
            if piece[2] == src_end and piece[3] == dst_end and piece[1] == fd and piece[0] == order:
                run.append(piece)
                run_bytes += piece[6]
                src_end += piece[6]
                dst_end += piece[6]
                continue
            if run_bytes < GATHER_RUN:
                small.append((run[0][0], run[0][3], run_bytes, run))
            else:
                total += self._copy(run)
            run = [piece]
            order, fd, src_end, dst_end = piece[0], piece[1], piece[2] + piece[6], piece[3] + piece[6]
            run_bytes = piece[6]
        if run_bytes < GATHER_RUN:
            small.append((run[0][0], run[0][3], run_bytes, run))
        else:
            total += self._copy(run)
        if small:
            total += self._gather(small)
        return total

    def _assemble_long_runs(self, pieces: list[Piece]) -> tuple[list[Piece], int]:
        """Write every run of pieces contiguous in one destination file and at least MIN_RUN long with direct writes;
        returns the pieces left (shorter runs, files that refuse O_DIRECT) and the bytes written."""
        pieces = sorted(pieces, key=_BY_DESTINATION)
        left: list[Piece] = []
        total = 0
        start = 0
        while start < len(pieces):
            first = pieces[start]
            end, position = start + 1, first[3] + first[6]
            while end < len(pieces) and pieces[end][0] == first[0] and pieces[end][3] == position:
                position += pieces[end][6]
                end += 1
            run = pieces[start:end]
            if position - first[3] >= direct_io.MIN_RUN and self._assemble(run):
                total += position - first[3]
            else:
                left.extend(run)
            start = end
        return left, total

    def _assemble(self, run: list[Piece]) -> bool:
        writer = self._writers[run[0][0]]
        if not writer.takes_direct_writes():
            return False
        if self._direct is None:
            self._direct = direct_io.DirectWrites()
        origin = run[0][3]
        reads = [(p[1], p[2], p[3] - origin, p[6]) for p in run]
        writer.assemble_span(self._direct, origin, reads, [(p[4], p[5], p[6]) for p in run])
        self.copy_calls += 1
        return True

    def close(self) -> None:
        """Wait for direct writes still running (their errors ignored: the run is ending) and free their buffers.
        Called before any writer is aborted, so no write can land in a descriptor number reused by then."""
        if self._direct is not None:
            try:
                self._direct.drain()
            except Exception:  # noqa: BLE001 - a failure is already being raised, or the run finished cleanly
                pass
            self._direct.close()
            self._direct = None

    def _copy(self, run: list[Piece]) -> int:
        first = run[0]
        self._writers[first[0]].copy_span(first[1], first[2], first[3], [(p[4], p[5], p[6]) for p in run])
        self.copy_calls += 1
        return sum(p[6] for p in run)

    def _gather(self, runs: list[tuple[int, int, int, list[Piece]]]) -> int:
        """Write small runs that are adjacent in the output (not in the source) in windows of up to WRITE_CALL_MAX
        bytes, each assembled in the writer's buffer (`gather_span`); a run with no such neighbour is copied alone.
        `runs` are (writer number, destination offset, bytes, run): they sort by where they land."""
        runs.sort()  # no two runs share a destination, so the runs themselves are never compared
        total = 0
        window: list[list[Piece]] = []
        window_order = window_end = window_bytes = 0
        for order, dst, length, run in runs:
            if window and dst == window_end and order == window_order and window_bytes + length <= WRITE_CALL_MAX:
                window.append(run)
                window_bytes += length
                window_end += length
                continue
            total += self._write_window(window, window_order)
            window, window_bytes, window_order = [run], length, order
            window_end = dst + length
        return total + self._write_window(window, window_order)

    def _write_window(self, window: list[list[Piece]], order: int) -> int:
        """One gathered write of runs adjacent in the output (a single run: a copy of its own); returns its bytes."""
        if not window:
            return 0
        if len(window) == 1:
            return self._copy(window[0])
        reads, parts, at = [], [], 0
        for run in window:
            head = run[0]
            start = at
            for p in run:
                parts.append((p[4], p[5], p[6]))
                at += p[6]
            reads.append((head[1], head[2], start, at - start))
        self._writers[order].gather_span(window[0][0][3], reads, parts)
        self.copy_calls += 1
        return at

    def clear(self) -> None:
        """Drop queued copies (after a failure, or once flushed)."""
        self._pieces = []
        self._writers = []
        self._order = {}
        self.queued_bytes = 0
