"""One rank's memory for chunked casts, and writing converted pieces behind the next piece's work.

A rank keeps a single byte arena for all its cast steps, sized to the largest step seen so far (one
input chunk plus one output chunk: exactly what the plan predicts for that step), so later tensors
reuse memory that is already mapped instead of faulting in fresh zeroed pages for every tensor.

Input bytes are read into the front of the arena; converted pieces go to one of two output slots
and are written to disk by one background thread while the main thread reads and converts the next
piece (pread, pwrite, numpy's and torch's conversions all release the GIL). A region still being written is never
reused: whoever needs it waits for that write first. Pieces are sized so that the input and both
slots fit in the arena, which keeps the held bytes equal to the plan's prediction.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..dtypes import dtype_bits, to_torch
from ..output.safetensors import SafetensorsWriter
from ..overflow import count_torch
from .bf16 import BLOCK, Float32ToBFloat16, numpy_castable
from .memory import HeldBytes

if TYPE_CHECKING:  # pragma: no cover
    from concurrent.futures import Future, ThreadPoolExecutor

PREFER_TORCH_ONCE_IMPORTED = True  # when both can, torch converts 2x faster than numpy
WRITE_BEHIND_MIN = 1 << 20  # smaller pieces are written at once: a thread hand-off would cost more than it saves


def _unit(src_bits: int, out_bits: int) -> int:
    """Fewest elements that fill whole bytes in both dtypes (1 unless a dtype is sub-byte)."""
    unit = 1
    while (unit * src_bits) % 8 or (unit * out_bits) % 8:
        unit += 1
    return unit


def _write_through(writer: SafetensorsWriter, name: str, view: memoryview, at: int) -> None:
    """Write a piece and start its writeback at once: the commit's fsync then finds it (nearly) on disk."""
    writer.write(name, view, at)
    writer.start_writeback(name, at, len(view))


class CastBuffers:
    """The arena, its two output slots, and the one write in flight (if any)."""

    def __init__(self, held: HeldBytes) -> None:
        self._held = held
        self._arena: bytearray | None = None
        self._view: memoryview | None = None
        self._pending: Future | None = None
        self._pending_span = (0, 0)  # arena bytes [begin, end) the write in flight reads from
        self._executor: ThreadPoolExecutor | None = None
        self._torch_threads: int | None = None  # torch's intra-op threads before the first cast, restored by close()
        self._bf16: Float32ToBFloat16 | None = None

    @property
    def size(self) -> int:
        """Bytes of the arena (counted as held while it exists)."""
        return 0 if self._arena is None else len(self._arena)

    def reserve(self, nbytes: int) -> None:
        """Make the arena at least `nbytes` long (a larger step replaces it, after its last write)."""
        if nbytes <= self.size:
            return
        self.release()
        self._arena = bytearray(nbytes)
        self._view = memoryview(self._arena)
        self._held.hold(nbytes)

    def piece_elements(self, per: int, src_dtype: str, out_dtype: str) -> int:
        """Elements per piece: at most one planned chunk, small enough for the input and both output slots."""
        src_bits, out_bits = dtype_bits(src_dtype), dtype_bits(out_dtype)
        unit = _unit(src_bits, out_bits)
        fit = self.size * 8 // (src_bits + 2 * out_bits) // unit * unit
        return min(per, fit) if fit > 0 else per

    def converter(self, src_dtype: str, out_dtype: str) -> Callable[[int, int, memoryview, int], tuple[int, float] | None] | None:
        """The torch-free conversion for this dtype pair, or None when torch converts: it cannot, or torch is
        imported already (then torch is faster: 2 GiB in 0.4 s vs 0.8 s).

        It is called as `convert(fd, offset, slot, count)`: it reads the `count` source values at byte `offset` of
        file `fd` block by block through the arena's front (see `Float32ToBFloat16.convert_file`) and returns the
        overflow count and largest magnitude, or None: that piece holds a NaN, use torch for it."""
        if not numpy_castable(src_dtype, out_dtype) or (PREFER_TORCH_ONCE_IMPORTED and "torch" in sys.modules):
            return None
        return self.bf16_converter()

    def bf16_converter(self) -> Callable[[memoryview, memoryview, int], tuple[int, float] | None]:
        """The numpy float32 -> bfloat16 conversion whether or not torch is imported (bit for bit torch's on
        values that are not NaN): a batch of small casts is converted by one call (`engine.cast_batch`)."""
        if self._bf16 is None:
            self._bf16 = Float32ToBFloat16()
        bf16 = self._bf16

        def convert(fd: int, offset: int, slot: memoryview, count: int) -> tuple[int, float] | None:
            staging = self.input(min(4 * count, 4 * BLOCK))  # inside the piece's input bytes: never its output slot
            return bf16.convert_file(fd, offset, staging, slot, count)

        return convert

    def input(self, nbytes: int) -> memoryview:
        """The arena's first `nbytes`, free to be filled."""
        self._claim(0, nbytes)
        assert self._view is not None
        return self._view[:nbytes]

    def output(self, nbytes: int, after: int) -> tuple[int, memoryview]:
        """A free output slot of `nbytes` beyond the input's first `after` bytes: (offset in the arena, view).

        Two places can hold it: the arena's end, or right after the input when both fit. The one the
        write in flight does not read from is taken; when neither is free, that write is waited for.
        """
        end_slot = self.size - nbytes
        for begin in (end_slot, after):
            fits = begin == end_slot or begin + nbytes <= end_slot
            if fits and not self._in_flight(begin, begin + nbytes):
                break
        else:
            self.wait()
            begin = end_slot
        assert self._view is not None
        return begin, self._view[begin : begin + nbytes]

    def write(self, writer: SafetensorsWriter, name: str, offset: int, view: memoryview, at: int) -> None:
        """Write `view` (arena bytes from `offset`) as bytes [at, ...) of tensor `name`; large pieces in the background."""
        if len(view) < WRITE_BEHIND_MIN:
            writer.write(name, view, at)
            return
        self.wait()
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor  # only runs with large casts import it

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="workbench-cast-write")
        self._pending = self._executor.submit(_write_through, writer, name, view, at)
        self._pending_span = (offset, offset + len(view))

    def wait(self) -> None:
        """Wait for the write in flight; re-raise its error here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def release(self) -> None:
        """Finish the write in flight and free the arena (it stops counting as held)."""
        self.wait()
        if self._arena is not None:
            self._held.release(len(self._arena))
            self._arena = self._view = None

    def close(self) -> None:
        """Stop after a failure or at the end of a rank: wait for the write in flight (its error, if any, is
        dropped: the first failure is what the caller reports), free the arena, stop the thread."""
        try:
            self.wait()
        except BaseException:  # noqa: BLE001  (the caller is already failing, or has already waited)
            pass
        self.release()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._torch_threads is not None:
            import torch

            torch.set_num_threads(self._torch_threads)
            self._torch_threads = None

    def torch_cast(self, data: memoryview, src_dtype: str, slot: memoryview, out_dtype: str, count: int,
                   *, counted: bool = False) -> tuple[int, float]:
        """Convert `count` elements from `data` into `slot` with torch; with `counted`, also return how many
        values did not fit `out_dtype` and the largest magnitude among them (`workbench.overflow`)."""
        import torch

        if self._torch_threads is None:
            # One core converts while another writes: on 2 cores this measured faster than 2 intra-op
            # threads competing with the writer thread (2 GiB fp32->bf16: 1.9-2.4 s vs 2.4-4.3 s).
            self._torch_threads = torch.get_num_threads()
            torch.set_num_threads(1)
        converted = torch.frombuffer(slot, dtype=to_torch(out_dtype), count=count)
        source = torch.frombuffer(data, dtype=to_torch(src_dtype), count=count)
        converted.copy_(source)
        return count_torch(source, src_dtype, out_dtype, converted) if counted else (0, 0.0)

    def _claim(self, begin: int, end: int) -> None:
        if self._in_flight(begin, end):
            self.wait()

    def _in_flight(self, begin: int, end: int) -> bool:
        """True when the write in flight reads arena bytes in [begin, end)."""
        first, last = self._pending_span
        return self._pending is not None and begin < last and first < end
