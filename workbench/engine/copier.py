"""Byte-level steps: output bytes are runs of source bytes, moved by kernel copies without tensors.

Pieces are queued and flushed in batches. A flush first takes every long run that is contiguous in the
destination (at least `direct_io.MIN_RUN` bytes, from any number of source runs) and assembles its whole pages
in buffers written with O_DIRECT (`SafetensorsWriter.assemble_span`, `output.direct_io`): one memory copy per
byte and no page cache for the output. The rest is sorted by source position, and pieces adjacent both in the
source and in the destination become one `copy_file_range`, so a checkpoint of many small tensors costs a few
large copies rather than one syscall per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..output import direct_io
from ..output.safetensors import WRITE_CALL_MAX, SafetensorsWriter

FLUSH_PIECES = 65536
FLUSH_BYTES = 256 << 20
GATHER_RUN = 64 << 10  # runs shorter than this are assembled with their neighbours in the output (`_gather`)


@dataclass(slots=True)
class Piece:
    """`length` bytes at `src_offset` of `src_fd` go to tensor `name` at byte `at` (file offset `dst`)."""

    writer_order: int
    src_fd: int
    src_offset: int
    dst: int
    name: str
    at: int
    length: int


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
        order = self._order.get(id(writer))
        if order is None:
            order = self._order[id(writer)] = len(self._writers)
            self._writers.append(writer)
        self._pieces.append(Piece(order, src_fd, src_offset, dst, name, at, length))
        self.queued_bytes += length

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
        pieces = sorted(pieces, key=lambda p: (p.writer_order, p.src_fd, p.src_offset))
        small: list[list[Piece]] = []  # runs left to `_gather`
        run: list[Piece] = [pieces[0]]
        run_bytes = pieces[0].length
        for piece in pieces[1:]:
            last = run[-1]
            if (
                piece.writer_order == last.writer_order
                and piece.src_fd == last.src_fd
                and piece.src_offset == last.src_offset + last.length
                and piece.dst == last.dst + last.length
            ):
                run.append(piece)
                run_bytes += piece.length
            else:
                if run_bytes < GATHER_RUN:
                    small.append(run)
                else:
                    total += self._copy(run)
                run = [piece]
                run_bytes = piece.length
        if run_bytes < GATHER_RUN:
            small.append(run)
        else:
            total += self._copy(run)
        if small:
            total += self._gather(small)
        return total

    def _assemble_long_runs(self, pieces: list[Piece]) -> tuple[list[Piece], int]:
        """Write every run of pieces contiguous in one destination file and at least MIN_RUN long with direct writes;
        returns the pieces left (shorter runs, files that refuse O_DIRECT) and the bytes written."""
        pieces = sorted(pieces, key=lambda p: (p.writer_order, p.dst))
        left: list[Piece] = []
        total = 0
        start = 0
        while start < len(pieces):
            first = pieces[start]
            end, position = start + 1, first.dst + first.length
            while end < len(pieces) and pieces[end].writer_order == first.writer_order and pieces[end].dst == position:
                position += pieces[end].length
                end += 1
            run = pieces[start:end]
            if position - first.dst >= direct_io.MIN_RUN and self._assemble(run):
                total += position - first.dst
            else:
                left.extend(run)
            start = end
        return left, total

    def _assemble(self, run: list[Piece]) -> bool:
        writer = self._writers[run[0].writer_order]
        if not writer.takes_direct_writes():
            return False
        if self._direct is None:
            self._direct = direct_io.DirectWrites()
        origin = run[0].dst
        reads = [(p.src_fd, p.src_offset, p.dst - origin, p.length) for p in run]
        writer.assemble_span(self._direct, origin, reads, [(p.name, p.at, p.length) for p in run])
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
        self._writers[first.writer_order].copy_span(
            first.src_fd, first.src_offset, first.dst, [(p.name, p.at, p.length) for p in run]
        )
        self.copy_calls += 1
        return sum(p.length for p in run)

    def _gather(self, runs: list[list[Piece]]) -> int:
        """Write small runs that are adjacent in the output (not in the source) in windows of up to WRITE_CALL_MAX
        bytes, each assembled in the writer's buffer (`gather_span`); a run with no such neighbour is copied alone."""
        runs.sort(key=lambda r: (r[0].writer_order, r[0].dst))
        total = 0
        window: list[list[Piece]] = []
        window_end = window_bytes = 0
        for run in runs + [[]]:
            if run:
                first = run[0]
                length = first.length if len(run) == 1 else sum(p.length for p in run)
                if (window and first.writer_order == window[0][0].writer_order and first.dst == window_end
                        and window_bytes + length <= WRITE_CALL_MAX):
                    window.append(run)
                    window_bytes += length
                    window_end += length
                    continue
            if len(window) == 1:
                total += self._copy(window[0])
            elif window:
                reads, parts, at = [], [], 0
                for piece_run in window:
                    head = piece_run[0]
                    start = at
                    for p in piece_run:
                        parts.append((p.name, p.at, p.length))
                        at += p.length
                    reads.append((head.src_fd, head.src_offset, start, at - start))
                self._writers[window[0][0].writer_order].gather_span(window[0][0].dst, reads, parts)
                self.copy_calls += 1
                total += at
            if run:
                window, window_bytes = [run], length
                window_end = first.dst + length
        return total

    def clear(self) -> None:
        """Drop queued copies (after a failure, or once flushed)."""
        self._pieces = []
        self._writers = []
        self._order = {}
        self.queued_bytes = 0
