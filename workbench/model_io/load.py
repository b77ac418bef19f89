"""`wb.load_into(model, source, mapper)`: stream a checkpoint into a module's parameters and buffers in place.

The mapper is bound to the source and its outputs checked against the module's state keys first
(metadata only; a strict load refuses before reading a byte). A meta module is then given storage
(`to_empty`), and each group that fills some key is read, one at a time: byte-level groups read just
the bytes of the part this rank holds (whole tensor, or the rows of a `Shard(0)` DTensor), straight
into the parameter's memory when dtype and device allow; other groups are computed on their inputs
and the rank's part of each output is copied in. Only source files holding needed bytes are opened.
Non-persistent buffers are filled when the source holds them; those of a meta module it does not hold
are then recomputed by the module's own initialisation (`buffers.py`), as `from_pretrained` does.
"""

from __future__ import annotations

import html
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..api_types import CheckpointLike, Rest
from ..catalog import Catalog, TensorInfo
from ..display import format_bytes
from ..dtypes import to_torch
from ..engine.memory import HeldBytes, reset_rss_peak, rss_peak_bytes
from ..engine.progress import ProgressCallback
from ..errors import PlanError
from ..iostats import IO
from ..mapper.base import Mapper
from ..mapper.groups import Binding, Group
from ..module_state import StateEntry
from ..planning.schedule import SourceAccess
from ..planning.sources import bind, resolve_catalog
from .buffers import (
    OnUninitialized,
    check_on_uninitialized,
    compute_buffers,
    keep_on_meta,
    plan_buffer_inits,
    uninitialized_error,
    write_buffers,
)
from .check import LoadCheck, check_load
from .comm import Comm, stage_of
from .local_part import LocalPart, local_part, local_tensor
from .module_keys import load_state, materialize, on_meta
from .progress import rank_progress
from .reading import GroupReader, pieces_in_range

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


@dataclass
class LoadReport:
    """What a load did on this rank: the key check, what was filled, and what it read and held."""

    check: LoadCheck
    rank: int = 0
    stage: int | None = None
    loaded: list[str] = field(default_factory=list)  # state keys filled
    uninitialized: list[str] = field(default_factory=list)  # materialised but not filled (garbage until set)
    recomputed: dict[str, str] = field(default_factory=dict)  # buffer -> the initialisation that recomputed it
    kept_on_meta: list[str] = field(default_factory=list)  # buffers nothing could set, left on meta (on_uninitialized='meta')
    predicted_files: list[str] = field(default_factory=list)
    files_opened: list[str] = field(default_factory=list)
    predicted_bytes_read: int = 0
    bytes_read: int = 0
    bytes_loaded: int = 0  # bytes of this rank's parts of the filled keys
    largest_group_bytes: int = 0  # the memory bound: inputs + outputs of the largest group read
    peak_tensor_bytes: int = 0  # measured: buffers held beside the module's own storage
    rss_peak: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the key check found no error."""
        return self.check.ok

    @property
    def frame(self) -> pd.DataFrame:
        """The key check as a table (see LoadCheck.frame)."""
        return self.check.frame

    @property
    def files_match_plan(self) -> bool:
        """True when exactly the predicted source files were opened."""
        return sorted(self.files_opened) == sorted(self.predicted_files)

    def summary(self) -> str:
        """A short text report."""
        lines = [
            f"Loaded {len(self.loaded)} keys ({format_bytes(self.bytes_loaded)}) into {self.check.module_name} from "
            f"{self.check.source_name} on rank {self.rank} in {self.seconds:.2f}s",
            f"  read {format_bytes(self.bytes_read)} from {len(self.files_opened)} file(s) "
            f"(predicted {format_bytes(self.predicted_bytes_read)} from {len(self.predicted_files)})",
            f"  peak tensor bytes {format_bytes(self.peak_tensor_bytes)} (largest group {format_bytes(self.largest_group_bytes)}), "
            f"RSS peak {format_bytes(self.rss_peak)}",
        ]
        if self.recomputed:
            lines.append(f"  recomputed {len(self.recomputed)} non-persistent buffer(s) the source does not hold, by the "
                         "module's own initialisation: " + _listed(f"{key} ({how})" for key, how in self.recomputed.items()))
        if self.uninitialized:
            lines.append(f"  left uninitialised (garbage until set): {_listed(self.uninitialized)}")
        if self.kept_on_meta:
            lines.append(f"  left on the meta device (set them before use): {_listed(self.kept_on_meta)}")
        lines += [f"  {p.severity}: {p.message}" for p in self.check.problems if p.severity != "info"]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"<LoadReport rank {self.rank}: {len(self.loaded)} keys loaded, {len(self.check.errors)} error(s)>"

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.summary())}</pre>"


def _listed(items: Any, limit: int = 5) -> str:
    items = list(items)
    return ", ".join(items[:limit]) + (f" ... and {len(items) - limit} more" if len(items) > limit else "")


def _source_name(catalog: Catalog) -> str:
    return str(catalog.root)


def plan_load(
    model: Any, source: Any, mapper: Any = None, *, rest: str = "keep", elsewhere: Any = ()
) -> tuple[Catalog, Binding, LoadCheck]:
    """The dry-run of a load: bind the mapper to the source and check its outputs against the module."""
    catalog = resolve_catalog(source)
    binding = bind(catalog, mapper, rest)
    state = load_state(model)
    check = check_load(
        state, binding.outputs, mapper_problems=binding.problems, elsewhere=elsewhere,
        module_name=type(model).__name__, source_name=_source_name(catalog),
    )
    return catalog, binding, check


def dry_run_load(model: Any, source: Any, mapper: Any = None, *, rest: str = "keep") -> LoadCheck:
    """Would `source` (through `mapper`) load into `model`? Missing, unexpected, shape and dtype findings."""
    return plan_load(model, source, mapper, rest=rest)[2]


class Filler:
    """Fills state keys from groups, counting bytes read into buffers and bytes loaded."""

    def __init__(self, catalog: Catalog, held: HeldBytes) -> None:
        self.held = held
        self.reader = GroupReader(catalog, held)
        self.loaded = 0

    def from_recipe(self, group: Group, out: TensorInfo, entry: StateEntry) -> None:
        """Read only the bytes of this rank's part of a byte-level output."""
        import torch

        dest = local_tensor(entry.tensor)
        part = local_part(entry.tensor, entry.key)
        if part.numel == 0:
            return
        span = part.byte_range(out.dtype)
        begin, end = span if span is not None else (0, out.nbytes)
        if (span is not None and to_torch(out.dtype) == dest.dtype and dest.device.type == "cpu"
                and dest.is_contiguous()):
            self.reader.read_range(group, out.name, begin, end, memoryview(dest.reshape(-1).view(torch.uint8).numpy()))
        else:
            buffer = bytearray(end - begin)
            self.held.hold(len(buffer))
            try:
                self.reader.read_range(group, out.name, begin, end, memoryview(buffer))
                values = torch.frombuffer(buffer, dtype=to_torch(out.dtype))
                if span is not None:
                    dest.copy_(values.reshape(part.shape))
                else:
                    dest.copy_(part.take(values.reshape(out.shape)))
            finally:
                self.held.release(len(buffer))
        self.loaded += dest.numel() * dest.element_size()

    def from_tensor(self, value: Any, entry: StateEntry) -> None:
        """Copy this rank's part of a computed output into the key's storage."""
        dest = local_tensor(entry.tensor)
        part = local_part(entry.tensor, entry.key)
        if part.numel:
            dest.copy_(part.take(value))
            self.loaded += dest.numel() * dest.element_size()

    def group(self, group: Group, wanted: dict[str, str], state: dict[str, StateEntry]) -> None:
        """Fill every wanted output of one group, then drop what was read for it."""
        try:
            if group.recipe is not None:
                for out in group.outputs:
                    if out.name in wanted:
                        self.from_recipe(group, out, state[wanted[out.name]])
                return
            results = group.apply(self.reader.tensors(group))
            self.held.hold(group.bytes_out)
            try:
                for out in group.outputs:
                    if out.name in wanted:
                        self.from_tensor(results[out.name], state[wanted[out.name]])
            finally:
                self.held.release(group.bytes_out)
        finally:
            self.reader.release()


def predicted_reads(catalog: Catalog, groups: list[Group], wanted: dict[str, str], state: dict[str, StateEntry]) -> dict[str, int]:
    """Source file (absolute) -> bytes this rank reads, by the same rules the filler follows."""
    access = SourceAccess(catalog.reader)
    located = catalog.reader.locate if catalog.reader is not None else (lambda info: None)
    reads: dict[str, int] = {}
    whole: dict[str, int] = {}  # relative file -> bytes of inputs read whole (through the reader)
    for group in groups:
        if group.recipe is None:
            for info in group.inputs:
                access.add_whole_read(whole, info)
            continue
        read_whole: set[str] = set()
        for out in group.outputs:
            if out.name not in wanted:
                continue
            entry = state[wanted[out.name]]
            part = local_part(entry.tensor, entry.key)
            if part.numel == 0:
                continue
            for info, _, _, length in pieces_in_range(group, out.name, *(part.byte_range(out.dtype) or (0, out.nbytes))):
                where = located(info)
                if where is not None:
                    path = os.path.abspath(where[0])
                    reads[path] = reads.get(path, 0) + length
                elif info.name not in read_whole:
                    read_whole.add(info.name)
                    access.add_whole_read(whole, info)
    for rel, n in whole.items():
        path = os.path.abspath(catalog.root / rel if catalog.root.is_dir() else catalog.root)
        reads[path] = reads.get(path, 0) + n
    return reads


def _other_ranks_keys(state: dict[str, StateEntry], mesh: Any, pp_dim: Any, comm: Comm) -> tuple[int, set[str]]:
    stage = stage_of(mesh, pp_dim, comm.rank)
    everyone = comm.all_gather(list(state))
    return stage, {key for rank, keys in enumerate(everyone) if rank != comm.rank for key in keys}


def _part_bytes(entry: StateEntry) -> int:
    part: LocalPart = local_part(entry.tensor, entry.key)
    return part.numel * entry.tensor.element_size()


def load_into(
    model: Any,
    source: CheckpointLike,
    mapper: Mapper | Binding | None = None,
    *,
    device: Any = None,
    strict: bool = True,
    rest: Rest = "keep",
    mesh: Any = None,
    pp_dim: int | str | None = None,
    quiet: bool = False,
    on_progress: ProgressCallback | None = None,
    on_uninitialized: OnUninitialized = "error",
) -> LoadReport:
    """Load `source` (a checkpoint path, Checkpoint or Catalog) through `mapper` into `model`, in place.

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        report = wb.load_into(model, "llama/")

    Keys are checked first from metadata: with `strict=True` any missing, unexpected or wrongly shaped
    key raises a MapperError listing them all before anything is read or allocated; with
    `strict=False` only the keys that fit are loaded and the report lists the rest. A module on the
    meta device is materialised on `device` (default 'cpu') and then filled; modules elsewhere are
    filled where they are (`device` is ignored). Non-persistent buffers (rotary frequencies,
    `position_ids`) are filled when the source holds them; those of a meta module it does not hold
    are recomputed by the module's own initialisation (transformers' `_init_weights`, else
    `reset_parameters()` / `init_weights()`) and listed with how in `report.recomputed`. Buffers that
    nothing sets raise UninitializedBufferError before anything is read or allocated, unless
    `on_uninitialized` is 'meta' (left on the meta device, so a forward pass fails;
    `report.kept_on_meta`) or 'empty' (left uninitialised; `report.uninitialized`).
    DTensor parameters (FSDP2, tensor parallel) receive only this rank's part; for row-sharded ones
    only those rows' bytes are read. With a `mesh` and its pipeline dimension `pp_dim` (all ranks
    call load_into together), keys held by other stages are not unexpected.
    `on_progress(rank, done_bytes, total_bytes)` follows the bytes loaded; the bar shows on rank 0.
    """
    check_on_uninitialized(on_uninitialized)
    comm = Comm()
    stage, elsewhere = (None, set())
    if pp_dim is not None:
        if mesh is None:
            raise PlanError("Cannot load with pp_dim but no mesh: pass the DeviceMesh the pipeline dimension belongs to.")
        stage, elsewhere = _other_ranks_keys(load_state(model), mesh, pp_dim, comm)
    catalog, binding, check = plan_load(model, source, mapper, rest=rest, elsewhere=elsewhere)
    if strict and not check.ok:
        raise check.error()
    report = LoadReport(check, rank=comm.rank, stage=stage)
    target = "cpu" if device is None else device
    # computed on copies whose weights stay on meta, so what nothing sets is refused before reading anything
    buffers, failed = compute_buffers(model, plan_buffer_inits(model, check.recompute), target)
    if failed and on_uninitialized == "error":
        raise uninitialized_error(check.module_name, check.source_name, failed)
    if on_meta(model):  # what stays unfilled after to_empty holds garbage: say so
        materialize(model, target)
        report.uninitialized = [key for key in check.missing + check.mismatched if key not in check.recompute]
    state = load_state(model)
    wanted = check.fill
    groups = [g for g in binding.groups if any(o.name in wanted for o in g.outputs)]
    reads = predicted_reads(catalog, groups, wanted, state)
    report.predicted_files = sorted(reads)
    report.predicted_bytes_read = sum(reads.values())
    report.largest_group_bytes = max((g.bytes_in + g.bytes_out for g in groups), default=0)
    progress = rank_progress(sum(_part_bytes(state[k]) for k in wanted.values()), rank=comm.rank, quiet=quiet,
                             callback=on_progress, desc="load")
    import torch

    held = HeldBytes()
    filler = Filler(catalog, held)
    IO.reset()
    reset_rss_peak()
    started = time.perf_counter()
    try:
        with torch.no_grad():
            for group in groups:
                filler.group(group, wanted, state)
                progress.update(filler.loaded)
    finally:
        filler.reader.close()
        progress.close()
    report.recomputed = write_buffers(model, buffers)
    if on_uninitialized == "empty":
        report.uninitialized += list(failed)
    else:
        keep_on_meta(model, list(failed))
        report.kept_on_meta = list(failed)
    io = IO.snapshot()
    report.loaded = [wanted[o.name] for g in groups for o in g.outputs if o.name in wanted]
    report.files_opened = io["files_opened"]
    report.bytes_read = io["bytes_read"]
    report.bytes_loaded = filler.loaded
    report.peak_tensor_bytes = held.peak
    report.rss_peak = rss_peak_bytes()
    report.seconds = time.perf_counter() - started
    return report
