"""Running one scheduled step: byte copy, chunked cast, tensor compute, or a row job by row chunks (`engine.rows`).

Each runner reads only the byte ranges its group needs, writes only into planned slots, and keeps
the `HeldBytes` ledger exactly as the planner's cost rules predict (see `planning.schedule`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..catalog import Catalog, TensorInfo
from ..dtypes import nbytes_of, to_torch
from ..errors import CastOverflowError, PlanError, WorkbenchError
from ..iostats import IO, read_into
from ..mapped_inputs import map_tensor, maps_inputs, unmap
from ..mapper.groups import ByteSlice
from ..output.safetensors import SafetensorsWriter
from ..overflow import OverflowCounts, attributed, collect, count_torch, describe, may_overflow
from ..planning.model import Plan
from ..planning.rss import NUMPY, TORCH, libraries_for, row_libraries
from ..planning.schedule import CAST, COPY, PIECES, ROWS, Step, cast_chunk
from ..planning.span_runs import SpanRun
from .cast_batch import run_cast_batch
from .cast_buffers import CastBuffers
from .copier import FLUSH_BYTES, FLUSH_PIECES, CopyQueue, Piece
from .memory import HeldBytes
from .sources import SourceFiles

WRITEBACK_PIECE = 1 << 20  # written pieces at least this large start their writeback at once (the commit fsync finds them on disk)


@dataclass
class RankContext:
    """Everything a rank's steps share: the plan, open writers and sources, the copy queue, ledgers."""

    plan: Plan
    writers: dict[str, SafetensorsWriter] = field(default_factory=dict)
    sources: SourceFiles = field(default_factory=SourceFiles)
    queue: CopyQueue = field(default_factory=CopyQueue)
    held: HeldBytes = field(default_factory=HeldBytes)
    cast: CastBuffers = field(init=False)  # the cast steps' reusable memory (counted in `held`)
    done_bytes: int = 0  # output tensor bytes produced so far
    overflow: OverflowCounts = field(default_factory=OverflowCounts)  # values casts could not represent, per output

    def __post_init__(self) -> None:
        self.cast = CastBuffers(self.held)
        # Asked once per output tensor and per input tensor (100k times on big checkpoints): looked up once here.
        self._placement = self.plan.placement
        reader = self.plan.source.reader
        self._locate = reader.locate if reader is not None else None
        # A reader whose tensors lie raw at their `begin` in their `file`: a descriptor per file name, no `locate` per tensor.
        self._raw_in_place = getattr(reader, "raw_in_place", False) is True and self._locate is not None
        self._fd_of_file: dict[str, int] = {}

    @property
    def catalog(self) -> Catalog:
        """The source catalog."""
        return self.plan.source

    @property
    def dest(self) -> Path:
        """The destination folder."""
        assert self.plan.dest is not None
        return self.plan.dest

    def target(self, name: str) -> tuple[SafetensorsWriter, int] | None:
        """The open writer and absolute offset of output tensor `name`; None when its file is kept."""
        file, begin = self._placement[name]
        writer = self.writers.get(file)
        return None if writer is None else (writer, begin)

    def overflowed(self, name: str, dtype: str, count: int, largest: float) -> None:
        """Record values of output `name` that did not fit `dtype`; fail the step at once when the plan says so."""
        if not count:
            return
        self.overflow.add(name, count, largest, dtype)
        if self.plan.options.on_overflow == "error":
            raise CastOverflowError(
                f"Cannot cast {name!r} to {dtype}: {describe(dtype, count, largest)}. The run stopped before writing "
                "its index. Keep a wider dtype (e.g. bf16), rescale the tensor in a mapper, or accept the overflow with "
                "on_overflow='warn' (--on-overflow warn).",
                tensor=name,
            )

    def locate(self, info: TensorInfo) -> tuple[int, int] | None:
        """(descriptor, absolute offset) of a source tensor's raw bytes, or None when not raw on disk."""
        if self._raw_in_place:
            fd = self._fd_of_file.get(info.file)
            if fd is None:
                fd = self._fd_of_file[info.file] = self.sources.fd(self._locate(info)[0])  # type: ignore[misc]
            return fd, info.begin
        where = self._locate(info) if self._locate is not None else None
        if where is None:
            return None
        path, begin, _ = where
        return self.sources.fd(path), begin


def read_buffer(ctx: RankContext, info: TensorInfo) -> bytearray:
    """A tensor's bytes in a fresh buffer (counted as held by the caller)."""
    where = ctx.locate(info)
    if where is None:
        data = ctx.catalog.read_bytes(info.name)
        return data if type(data) is bytearray else bytearray(data)  # a reader's fresh buffer is used as it is
    buffer = bytearray(info.nbytes)
    if info.nbytes:
        read_into(where[0], memoryview(buffer), where[1])
    return buffer


def run_copy(ctx: RankContext, step: Step) -> None:
    """Queue kernel copies for every output piece of one copy step; unlocated inputs are read once and written.
    The general path: `run_copies` queues the common copies of raw on-disk inputs itself."""
    group = step.group
    single = group.inputs[0] if len(group.inputs) == 1 else None
    inputs = {} if single is not None else {t.name: t for t in group.inputs}
    whole: dict[str, bytearray] = {}
    low, high = step.part or (0, step.bytes_out)  # a part (`planning.parts`): only these bytes of the one output
    try:
        for out_name, pieces in group.recipe.items():
            target = ctx.target(out_name)
            if target is None:
                continue
            writer, begin = target
            at = 0
            for piece in pieces:
                if step.part is not None:
                    if at + piece.length <= low or at >= high:
                        at += piece.length
                        continue
                    cut = max(low - at, 0)
                    piece = ByteSlice(piece.source, piece.begin + cut, piece.begin + min(piece.length, high - at))
                    at += cut
                if piece.end > piece.begin:
                    info = single if single is not None else inputs[piece.source]
                    where = ctx.locate(info)
                    if where is not None:
                        ctx.queue.add(writer, begin + at, out_name, at, where[0], where[1] + piece.begin, piece.length)
                    else:
                        data = whole.get(piece.source)
                        if data is None:
                            data = whole[piece.source] = read_buffer(ctx, info)
                            ctx.held.hold(len(data))
                        writer.write(out_name, memoryview(data)[piece.begin : piece.end], at)
                        if piece.length >= WRITEBACK_PIECE:  # bytes that came from a reader (a URL): on disk by commit
                            start = getattr(writer, "start_writeback", None)
                            if start is not None:
                                start(out_name, at, piece.length)
                at += piece.length
            ctx.done_bytes += at if step.part is None else high - low
    finally:
        ctx.held.release(sum(len(d) for d in whole.values()))


STRETCH_STEPS = 4096  # copy steps queued per call of `run_copies` (the rank reports progress and flushes between calls)


class StepFailed(Exception):
    """An unexpected error in one step of a stretch run by `run_copies`, or in one tensor of a run (`tensor`): the
    rank reports it against that step and tensor."""

    def __init__(self, step: Step, cause: Exception, tensor: str | None = None) -> None:
        super().__init__(str(cause))
        self.step = step
        self.cause = cause
        self.tensor = tensor


def run_copies(ctx: RankContext, steps: list[Step], start: int, commit_at: set[int]) -> int:
    """Run the copy steps from `steps[start]` that write the same files, up to the first that completes a file
    (its index in `commit_at`), at most STRETCH_STEPS of them; returns the index after the last one run.

    What `run_step` does for each, with the common copy (one slice of one input raw on disk) queued from here
    as a plain tuple: a checkpoint of 100k tiny tensors is 100k such steps, and their per-step calls were most
    of its conversion time.
    """
    ctx.cast.wait()
    queue = ctx.queue
    placement, writers, fd_of_file = ctx._placement, ctx.writers, ctx._fd_of_file
    raw = ctx._raw_in_place
    files = steps[start].files
    batch: list[Piece] = []
    queued = done = 0
    last_writer, last_order = None, 0
    end = min(len(steps), start + max(1, STRETCH_STEPS))  # at least one step per call, whatever a test sets
    index = start
    step = steps[start]
    name = None  # the tensor of a copy run being queued
    try:
        while index < end:
            step = steps[index]
            if step.kind != COPY or (step.files is not files and step.files != files):
                break
            index += 1
            if step.held_bytes:
                ctx.cast.release()
            group = step.group
            recipe = group.recipe
            piece = None  # the one slice of the common copy: one input, one output
            if raw and step.part is None and len(group.inputs) == 1 and len(recipe) == 1:
                ((out_name, pieces),) = recipe.items()
                if len(pieces) == 1:
                    piece = pieces[0]
            if piece is not None:
                file, dst = placement[out_name]
                writer = writers.get(file)
                length = piece.end - piece.begin
                if writer is not None:  # else the file is not this rank's to write
                    if length > 0:
                        info = group.inputs[0]
                        fd = fd_of_file.get(info.file)
                        if fd is None:
                            fd = ctx.locate(info)[0]  # type: ignore[index]  # opens the file, remembered per name
                        if writer is not last_writer:
                            last_writer, last_order = writer, queue.order_of(writer)
                        batch.append((last_order, fd, info.begin + piece.begin, dst, out_name, 0, length))
                        queued += length
                    done += length
            elif raw and type(recipe) is SpanRun:  # neighbours of one file copied in byte ranges (`planning.span_runs`)
                name = None
                fd = None  # opened at the first byte copied: every input lies in one file
                for out, pieces in zip(recipe.outputs, recipe.pieces(), strict=True):
                    name = out.name
                    file, dst = placement[name]
                    writer = writers.get(file)
                    if writer is None:  # the file is not this rank's to write
                        continue
                    if writer is not last_writer:
                        last_writer, last_order = writer, queue.order_of(writer)
                    at = 0
                    for info, piece_begin, piece_end in pieces:
                        length = piece_end - piece_begin
                        if length > 0:
                            if fd is None:
                                fd = fd_of_file.get(info.file)
                                if fd is None:
                                    fd = ctx.locate(info)[0]  # type: ignore[index]
                            batch.append((last_order, fd, info.begin + piece_begin, dst + at, name, at, length))
                            queued += length
                        at += length
                    done += at
            elif raw and step.run:  # neighbours of one file copied whole, maybe renamed (`planning.runs`)
                name = None
                inputs = group.inputs
                fd = fd_of_file.get(inputs[0].file)  # opened at the first byte copied (a run of empty tensors reads nothing)
                for info, out, length in zip(inputs, recipe.outputs, recipe.sizes, strict=True):
                    name = out.name
                    file, dst = placement[name]
                    writer = writers.get(file)
                    if writer is None:  # the file is not this rank's to write
                        continue
                    if length > 0:
                        if fd is None:
                            fd = ctx.locate(info)[0]  # type: ignore[index]
                        if writer is not last_writer:
                            last_writer, last_order = writer, queue.order_of(writer)
                        batch.append((last_order, fd, info.begin, dst, name, 0, length))
                        queued += length
                    done += length
            elif raw and step.part is None and (spans := None if type(recipe) is dict else getattr(recipe, "spans", None)) is not None:
                # a shared recipe (`LazyRecipe`, e.g. a fused q/k/v): its spans, no ByteSlices
                by_name = {t.name: t for t in group.inputs}
                for out_name in recipe:
                    file, dst = placement[out_name]
                    writer = writers.get(file)
                    if writer is None:
                        continue
                    if writer is not last_writer:
                        last_writer, last_order = writer, queue.order_of(writer)
                    at = 0
                    for source, piece_begin, piece_end in spans(out_name):
                        length = piece_end - piece_begin
                        if length > 0:
                            info = by_name[source]
                            fd = fd_of_file.get(info.file)
                            if fd is None:
                                fd = ctx.locate(info)[0]  # type: ignore[index]
                            batch.append((last_order, fd, info.begin + piece_begin, dst + at, out_name, at, length))
                            queued += length
                        at += length
                    done += at
            else:  # the general path, queued through `ctx.queue` itself
                run_copy(ctx, step)
                if step.index in commit_at or queue.full:
                    break
                continue
            if step.index in commit_at or queued >= FLUSH_BYTES or len(batch) >= FLUSH_PIECES:
                break
    except (WorkbenchError, OSError):
        raise
    except Exception as exc:
        raise StepFailed(step, exc, name if step.run else None) from exc
    finally:
        queue.extend(batch, queued)
        ctx.done_bytes += done
    return index


def run_cast(ctx: RankContext, step: Step) -> None:
    """Convert one tensor to another dtype chunk by chunk (bounded memory whatever its size); a batch of
    small casts at once (`engine.cast_batch`); a cast run's tensors by the batches the plan marked."""
    group = step.group
    if step.run:  # a cast run (`planning.runs`): its batches, or each tensor alone when unmarked
        pairs = list(zip(group.inputs, group.outputs, strict=True))
        for start, end in step.spans if step.spans is not None else [(k, k + 1) for k in range(len(pairs))]:
            try:
                if end - start > 1:
                    run_cast_batch(ctx, pairs[start:end], cast_one)
                else:
                    cast_one(ctx, *pairs[start])
            except (WorkbenchError, OSError):
                raise
            except Exception as exc:  # named by its tensor (a batch's first), as one step per tensor would be
                raise StepFailed(step, exc, pairs[start][1].name) from exc
    elif step.batch is None:
        cast_one(ctx, group.inputs[0], group.outputs[0])
    else:
        run_cast_batch(ctx, [(g.inputs[0], g.outputs[0]) for g in step.batch], cast_one)


def cast_one(ctx: RankContext, src: TensorInfo, out: TensorInfo) -> None:
    """Convert one tensor (`src`, written as `out`) to another dtype chunk by chunk."""
    target = ctx.target(out.name)
    numel = src.numel
    if target is None or numel == 0:
        return
    writer, _ = target
    per, need = cast_chunk(numel, src.dtype, out.dtype, ctx.plan.options.chunk_bytes)
    where = ctx.locate(src)
    if where is None:
        ctx.cast.release()  # this step holds the whole input instead (see planning.schedule.step_cost)
        _cast_whole(ctx, src, out, writer, per)
        return
    buffers = ctx.cast
    buffers.reserve(need)
    piece = buffers.piece_elements(per, src.dtype, out.dtype)
    convert = buffers.converter(src.dtype, out.dtype)
    counted = may_overflow(src.dtype, out.dtype)
    fd, begin = where
    for start in range(0, numel, piece):
        count = min(piece, numel - start)
        n_in = nbytes_of(src.dtype, count)
        position = begin + nbytes_of(src.dtype, start)
        offset, slot = buffers.output(nbytes_of(out.dtype, count), n_in)
        found = None if convert is None else convert(fd, position, slot, count)  # reads as it converts
        if found is None:
            data = buffers.input(n_in)
            read_into(fd, data, position)
            found = buffers.torch_cast(data, src.dtype, slot, out.dtype, count, counted=counted)
        ctx.overflowed(out.name, out.dtype, *found)
        buffers.write(writer, out.name, offset, slot, nbytes_of(out.dtype, start))
        ctx.done_bytes += len(slot)


def _cast_whole(ctx: RankContext, src: TensorInfo, out: TensorInfo, writer: SafetensorsWriter, per: int) -> None:
    """A cast whose input is not raw on disk: read it whole, convert it chunk by chunk."""
    import torch

    src_dtype, out_dtype = to_torch(src.dtype), to_torch(out.dtype)
    counted = may_overflow(src.dtype, out.dtype)
    data = read_buffer(ctx, src)
    converted = torch.empty(per, dtype=out_dtype)
    held = len(data) + nbytes_of(out.dtype, per)
    ctx.held.hold(held)
    try:
        for start in range(0, src.numel, per):
            count = min(per, src.numel - start)
            chunk = torch.frombuffer(data, dtype=src_dtype, count=count, offset=nbytes_of(src.dtype, start))
            piece = converted[:count]
            piece.copy_(chunk)
            if counted:
                ctx.overflowed(out.name, out.dtype, *count_torch(chunk, src.dtype, out.dtype, piece))
            writer.write(out.name, piece.view(torch.uint8).numpy(), nbytes_of(out.dtype, start))
            ctx.done_bytes += nbytes_of(out.dtype, count)
    finally:
        ctx.held.release(held)


def _as_tensor(buffer: bytearray, info: TensorInfo) -> Any:
    import torch

    dtype = to_torch(info.dtype)
    if info.numel == 0:
        return torch.empty(info.shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).reshape(info.shape)


def run_compute(ctx: RankContext, step: Step) -> None:
    """Read the inputs as tensors, apply the group's op, write the declared outputs."""
    group = step.group
    held = 0
    tensors: dict[str, Any] = {}
    mapped = []
    try:
        mappable = maps_inputs(group.op, group.inputs, lambda info: ctx.locate(info) is not None)  # as the plan counted
        for info in group.inputs:
            tensor = _mapped_input(ctx, info) if mappable else None
            if tensor is not None:
                mapped.append(tensor)
                size = info.nbytes
            else:
                buffer = read_buffer(ctx, info)
                tensor = _as_tensor(buffer, info)
                size = len(buffer)
            held += size
            ctx.held.hold(size)
            tensors[info.name] = tensor
        with collect() as found:
            results = group.apply(tensors)
        _record_overflow(ctx, group, found)
        ctx.held.hold(group.bytes_out)
        held += group.bytes_out
        missing = [t.name for t in group.outputs if t.name not in results]
        if missing:
            raise PlanError(
                f"Cannot write output {missing[0]!r}: the group {group.label or group.op!r} did not produce it. "
                "The mapper's apply and its inference disagree.",
                tensor=missing[0],
            )
        for info in group.outputs:
            target = ctx.target(info.name)
            if target is not None:
                target[0].write_tensor(info.name, results[info.name])
                ctx.done_bytes += info.nbytes
    finally:
        unmap(mapped)
        ctx.held.release(held)


def _mapped_input(ctx: RankContext, info: TensorInfo) -> Any | None:
    """A group input (raw on disk) mapped from its file (`mapped_inputs`); None to read it as usual (bytes that
    cannot be viewed in place)."""
    where = ctx.locate(info)
    tensor = None if where is None else map_tensor(where[0], where[1], info.nbytes, to_torch(info.dtype), tuple(info.shape))
    if tensor is not None:
        IO.add_read(info.nbytes)  # counted once, as the read it replaces (pages faulted in again are not re-counted)
    return tensor


def _record_overflow(ctx: RankContext, group: Any, found: OverflowCounts) -> None:
    """Attribute the overflow counted by a group's casts to its outputs (an unnamed cast: the only output, or the group)."""
    for name, (count, largest, dtype) in attributed(found, [t.name for t in group.outputs], group.label).items():
        ctx.overflowed(name, dtype, count, largest)


def preload_libraries(plan: Plan, steps: list[Step]) -> None:
    """Import what `steps` will use (`planning.rss.libraries_for`: torch, numpy or neither).

    Called before a rank measures its memory baseline, so a library's own RSS is not counted as the run's;
    byte copies import neither, and a rank whose casts are all float32 -> bfloat16 never imports torch.
    """
    needed = libraries_for(plan, steps)
    if needed == TORCH:
        import torch  # noqa: F401
    elif needed == NUMPY:
        import numpy  # noqa: F401
    for module in row_libraries(steps):  # what row jobs' kernels import (counted in planning.rss's imports part)
        importlib.import_module(module)


def _run_rows(ctx: RankContext, step: Step) -> None:
    from .rows import run_rows  # here: byte copies and casts never import the row-chunk code

    run_rows(ctx, step)


def _run_pieces(ctx: RankContext, step: Step) -> None:
    from .pieces import run_pieces  # here, as the row runner: imported by plans that have such steps

    run_pieces(ctx, step)


# The runner of each step kind (`planning.schedule`); any other kind is a tensor compute.
RUNNERS = {COPY: run_copy, CAST: run_cast, ROWS: _run_rows, PIECES: _run_pieces}


def run_step(ctx: RankContext, step: Step) -> None:
    """Run a step by the runner of its kind (`RUNNERS`)."""
    kind = step.kind
    if kind != CAST:
        ctx.cast.wait()
        if step.held_bytes:  # the plan counts this step's own buffers alone: free the cast arena first
            ctx.cast.release()
    RUNNERS.get(kind, run_compute)(ctx, step)
