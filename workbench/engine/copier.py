"""Byte-level steps: output bytes are runs of source bytes, moved by kernel copies without tensors.

Pieces are queued and flushed in batches; a flush sorts them by source position and merges pieces
that are adjacent both in the source and in the destination into one `copy_file_range`, so a
checkpoint of many small tensors costs a few large copies rather than one syscall per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        pieces = sorted(self._pieces, key=lambda p: (p.writer_order, p.src_fd, p.src_offset))
        total = 0
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
        self.clear()
        self.copied_bytes += total
        return total

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
