"""`Plan`: the dry-run of a conversion, computed from metadata alone, and what the engine executes.

A plan holds the schedule (one step per dependency group), the output layout (every output tensor's
file and offset, the index), the rank assignment, the source files each rank opens and the bytes it
reads, the predicted memory, and every problem found: data and per-rank queries. Its tables are pandas
DataFrames built on first access by `planning.plan_frames`, its text and HTML summaries by `planning.plan_report`,
both imported when first asked for, so the engine and the command line, which only need the plain data, never
import pandas.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..catalog import Catalog
from ..dtypes import numpy_castable
from ..mapper.groups import Binding, Problem
from ..output import OutputFormat, output_format
from .extras import COPIED, Extra
from .header_metadata import HeaderMetadata
from .schedule import CAST, COPY, ROWS, Step
from .sharding import OutputFile

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


@dataclass(frozen=True)
class PlanOptions:
    """The knobs a plan was made with (what a worker needs to re-plan identically)."""

    shard_size: int
    nproc: int = 1
    rest: str = "keep"
    dtype: str | None = None
    extras: bool = True
    overwrite: bool = False
    chunk_bytes: int = 32 << 20
    to: str = "safetensors"  # output format: 'safetensors' (HF shards + index) or 'dcp' (torch.distributed.checkpoint)
    on_overflow: str = "warn"  # a cast meeting values its dtype cannot hold: 'warn' (count and report) or 'error' (fail the run)
    page_align: bool = True  # pad safetensors headers so kernel copies are page-congruent (planning.page_align)
    nproc_mp: int = 1  # model-parallel files of a Meta `.pth` output (consolidated.00 .. NN)
    spool_size: int = 4 << 30  # a remote destination: bytes of finished files a rank's local spool may hold
    spool_dir: str | None = None  # a remote destination: where the spool lives (else $WORKBENCH_SPOOL_DIR, else temp)
    remote: dict = field(default_factory=dict)  # a remote destination's own options (JSON values, e.g. part_size)


class Plan:
    """A conversion's dry-run: schedule, layout, ranks, files and bytes read, memory, problems.

    Contract names: `ok`, `problems`, `outputs`, `files_read`, `peak_bytes`, `rss_bytes` (predicted process
    memory per rank, part by part in `rss_breakdown`); more tables:
    `output_files`, `groups`, `memory`, `ranks`, `extras_table` (every extra, copied, updated or skipped,
    and why); `output_metadata` is each shard's header metadata; `index` is the HF index the run writes
    (None for a single-file output). `str(plan)` / `summary()` give a text summary, notebooks show HTML.
    """

    def __init__(
        self,
        *,
        source: Catalog,
        dest: Path | None,
        options: PlanOptions,
        binding: Binding,
        steps: list[Step],
        files: list[OutputFile],
        problems: list[Problem],
        extras: list[str],
        layout_fingerprint: str,
        fingerprint: str,
        mapper: Any = None,
        mapper_json: str | None = None,
        extra_files: list[Extra] | None = None,
        header_metadata: HeaderMetadata | None = None,
        output: OutputFormat | None = None,
        complete: bool = False,
        code_digest: str | None = None,
        remote: Any = None,
    ) -> None:
        self.source = source
        self.dest = dest
        self.options = options
        self.binding = binding
        self.steps = steps
        self.output_file_list = files
        self.problems = problems
        self.extras = extras  # paths (relative, '/'-separated) of the extras the run writes
        self.extra_files = list(extra_files) if extra_files is not None else [Extra(p, COPIED) for p in extras]
        self.layout_fingerprint = layout_fingerprint
        self.fingerprint = fingerprint
        self.mapper = mapper
        self.mapper_json = mapper_json
        self.header_metadata = header_metadata
        self._output = output  # the format bound to this source (see OutputFormat.prepare)
        # The destination already holds this plan's finished output (same fingerprint): running it does nothing.
        self.complete = complete
        # What the mapper's Functions run (mapper.files.code_digest): recorded with a finished output.
        self.code_digest = code_digest
        # A remote destination (output.remote.RemoteDestination): `dest` is then the local spool folder.
        self.remote = remote

    # -- plain data (no pandas) -------------------------------------------------------------------

    @property
    def ok(self) -> bool:
        """True when no problem is an error: the conversion can run."""
        return not any(p.severity == "error" for p in self.problems)

    @property
    def errors(self) -> list[Problem]:
        """Problems that block the conversion."""
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        """Problems worth knowing that do not block the conversion."""
        return [p for p in self.problems if p.severity == "warning"]

    @property
    def nproc(self) -> int:
        """Number of processes (ranks) the plan is made for."""
        return self.options.nproc

    @property
    def kept(self) -> set[str]:
        """Output files already complete at the destination (an interrupted run of this plan)."""
        return {f.name for f in self.output_file_list if f.kept}

    def step_active(self, step: Step) -> bool:
        """False for steps whose every output file is kept from an earlier run."""
        return step.index in self._active_indexes

    @cached_property
    def _active_indexes(self) -> frozenset[int]:
        kept = {f.name for f in self.output_file_list if f.kept}
        if not kept:
            return frozenset(s.index for s in self.steps)
        return frozenset(s.index for s in self.steps if not all(name in kept for name in s.files))

    @cached_property
    def _steps_by_rank(self) -> dict[int, list[Step]]:
        if not any(f.kept or f.ranks for f in self.output_file_list) and {f.rank for f in self.output_file_list} <= {0}:
            return {0: list(self.steps)} if self.steps else {}  # one rank, nothing kept: every step, no walk
        by_rank: dict[int, list[Step]] = {}
        active = self._active_indexes
        for step in self.steps:
            if step.index in active:
                by_rank.setdefault(step.rank, []).append(step)
        return by_rank

    def rank_steps(self, rank: int) -> list[Step]:
        """The steps `rank` runs, in schedule order."""
        return list(self._steps_by_rank.get(rank, ()))

    def rank_files(self, rank: int) -> list[OutputFile]:
        """The output files `rank` writes (kept ones excluded)."""
        return [f for f in self.output_file_list if (rank in f.ranks if f.ranks else f.rank == rank) and not f.kept]

    def rank_output_bytes(self, rank: int) -> int:
        """Tensor bytes `rank` writes: its files' whole, and its own ranges of files it shares (`planning.ranks`)."""
        total = 0
        shared = set()
        for f in self.rank_files(rank):
            if f.ranks:
                shared.add(f.name)
            else:
                total += f.tensor_bytes
        if shared:
            total += sum(s.bytes_out for s in self._steps_by_rank.get(rank, ()) if shared.intersection(s.files))
        return total

    def rank_bytes_written(self, rank: int) -> int:
        """Bytes `rank` writes: its own files whole, its ranges of files it shares, and the headers of the files it
        owns (a shared file's is written before the ranks start, counted for its first rank): the ranks add up to
        `bytes_written`."""
        return self.rank_output_bytes(rank) + sum(len(f.layout.header) for f in self.rank_files(rank) if f.rank == rank)

    @cached_property
    def _file_by_name(self) -> dict[str, OutputFile]:
        return {f.name: f for f in self.output_file_list}

    def source_path(self, rel: str) -> Path:
        """Absolute path of a source file named relative to the catalog root."""
        root = self.source.root
        return Path(os.path.abspath(root / rel if root.is_dir() else root))

    @cached_property
    def _reads_by_rank(self) -> dict[int, dict[str, int]]:
        by_rank: dict[int, dict[str, int]] = {}
        for rank, steps in self._steps_by_rank.items():
            totals = by_rank.setdefault(rank, {})
            for step in steps:
                for rel, n in step.reads.items():
                    totals[rel] = totals.get(rel, 0) + n
        return by_rank

    def reads(self, rank: int | None = None) -> dict[str, int]:
        """Source file (relative) -> bytes read from it, for one rank or all; only files opened appear."""
        if rank is not None:
            return dict(sorted(self._reads_by_rank.get(rank, {}).items()))
        totals: dict[str, int] = {}
        for per_rank in self._reads_by_rank.values():
            for rel, n in per_rank.items():
                totals[rel] = totals.get(rel, 0) + n
        return dict(sorted(totals.items()))

    def source_location(self, rel: str) -> str:
        """Where a source file is, for reports: its absolute path, or its URL for a remote source."""
        if self.source.url:
            where = getattr(getattr(self.source.reader, "store", None), "where", None)
            return where(rel) if where is not None else f"{self.source.url.rstrip('/')}/{rel}"
        return str(self.source_path(rel))

    def source_paths(self, rank: int | None = None) -> list[str]:
        """Absolute paths (URLs for a remote source) of the source files the run opens (for one rank or all)."""
        return sorted(self.source_location(rel) for rel in self.reads(rank))

    @cached_property
    def downloads(self) -> dict[str, tuple[int, int]] | None:
        """For a remote source: file -> (bytes to download, range requests) of the run; None for local sources."""
        estimate = getattr(self.source.reader, "download_plan", None)
        if estimate is None:
            return None
        return estimate(info for step in self.steps if self.step_active(step) for info in step.group.inputs)

    @property
    def bytes_read(self) -> int:
        """Tensor bytes the run reads from the source."""
        return sum(self.reads().values())

    @property
    def bytes_written(self) -> int:
        """Bytes of the shard files the run writes (headers included, kept files excluded)."""
        return sum(f.size for f in self.output_file_list if not f.kept)

    def rank_peak_bytes(self, rank: int) -> int:
        """Predicted peak of tensor bytes held by one rank."""
        return max((s.held_bytes for s in self._steps_by_rank.get(rank, ())), default=0)

    @property
    def peak_bytes(self) -> int:
        """Predicted peak of tensor bytes held in memory by one process (the largest over ranks)."""
        return max((self.rank_peak_bytes(r) for r in self._steps_by_rank), default=0)

    # -- process memory (planning.rss) ------------------------------------------------------------

    def rank_rss_bytes(self, rank: int) -> int:
        """Predicted peak RSS of the process running `rank`: interpreter, imports, metadata, buffers, tensor peak."""
        from .rss import rank_rss_bytes

        return rank_rss_bytes(self, rank)

    @property
    def rss_bytes(self) -> int:
        """Predicted peak process memory (RSS) per rank, the largest over ranks: the RAM to provision per process.

        Not only tensor bytes (`peak_bytes`): a fresh process's interpreter, the libraries its steps import
        (none, numpy or torch), the catalog and plan, reader and writer buffers. Parts: `rss_breakdown`.
        """
        return max((self.rank_rss_bytes(r) for r in range(self.nproc)), default=0)

    def rank_spool_bytes(self, rank: int) -> int:
        """Local disk `rank` needs for a remote destination's spool (0 for a local destination): see `spool_bytes`."""
        if self.remote is None:
            return 0
        from .spool import rank_spool_bytes

        return rank_spool_bytes(self, rank)

    @property
    def spool_bytes(self) -> int:
        """Local disk a remote destination needs per rank: the spool's bound, the largest over ranks (0 for a local
        destination). Finished files (S3: finished parts of a file still being written) wait there for their upload
        within `spool_size`; a rank never waits on files (parts) it is still writing, so those open at once can raise
        the bound above the spool size (`planning.spool`)."""
        return max((self.rank_spool_bytes(r) for r in range(self.nproc)), default=0)

    @property
    def rss_breakdown(self) -> pd.DataFrame:
        """The predicted RSS part by part (rows: interpreter, workbench, imports (none, numpy or torch), metadata,
        buffers, tensor peak, intermediates), one bytes column per rank and a `detail` column for the largest rank."""
        from .plan_frames import rss_frame

        return rss_frame(self)

    @property
    def needs_torch(self) -> bool:
        """True when some step needs torch: a tensor op or a cast numpy does not do (byte copies need neither)."""
        return any(self._step_needs_torch(s) for steps in self._steps_by_rank.values() for s in steps)

    def _step_needs_torch(self, step: Step) -> bool:
        if step.kind in (COPY, ROWS):  # ROWS: row jobs run with numpy (mapper.row_jobs)
            return False
        if step.kind == CAST:
            src, out = step.group.inputs[0], step.group.outputs[0]
            reader = self.source.reader
            return not (numpy_castable(src.dtype, out.dtype) and reader is not None and reader.locate(src) is not None)
        return True

    @property
    def library_note(self) -> str:
        """Which libraries the run imports, for the summary: start-up of torch costs seconds per process."""
        from .plan_report import library_note

        return library_note(self)

    @property
    def total_size(self) -> int:
        """Tensor bytes of all outputs (the index's metadata.total_size)."""
        return sum(f.tensor_bytes for f in self.output_file_list)

    @cached_property
    def placement(self) -> dict[str, tuple[str, int]]:
        """Output tensor name -> (file, absolute byte offset of its data)."""
        return {t.name: (f.name, t.begin) for f in self.output_file_list for t in f.layout.tensors}

    @property
    def output_format(self) -> OutputFormat:
        """The format the run writes (`options.to`): it names and lays out files and commits them."""
        return self._output if self._output is not None else output_format(self.options.to)

    @property
    def index(self) -> dict | None:
        """The HF index the run writes last (None when the output is a single `model.safetensors`, or DCP)."""
        return self.output_format.index([f.layout for f in self.output_file_list])

    @property
    def output_metadata(self) -> dict[str, dict[str, str]]:
        """Each output shard's header `__metadata__` as the run writes it (empty for DCP outputs)."""
        if not self.output_format.keeps_header_metadata:
            return {}
        out = {}
        for f in self.output_file_list:
            header = json.loads(f.layout.header[8:])
            out[f.name] = dict(header.get("__metadata__", {}))
        return out

    @cached_property
    def copied_objects(self) -> list[str]:
        """Non-tensor entries (step counters, param_groups ...) a DCP output copies from a DCP source."""
        return [o.name for o in self.output_format.carried_objects(self.source.reader, self.options.rest)[0]]

    @property
    def commit_files(self) -> list[str]:
        """Files written last, once every shard is complete: the HF index, or DCP's objects file and `.metadata`."""
        return self.output_format.commit_files([f.layout for f in self.output_file_list], bool(self.copied_objects))

    # -- tables (pandas, built on first access by planning.plan_frames) ----------------------------

    @cached_property
    def outputs(self) -> pd.DataFrame:
        """One row per output tensor: dtype, shape, nbytes, file, offset, rank, group label."""
        from .plan_frames import outputs_frame

        return outputs_frame(self)

    @cached_property
    def files_read(self) -> pd.DataFrame:
        """One row per (source file, rank) the run opens: bytes read and tensors used from it."""
        from .plan_frames import files_read_frame

        return files_read_frame(self)

    @cached_property
    def extras_table(self) -> pd.DataFrame:
        """One row per non-tensor file or folder beside the weights: path, action (copy, update, skip), bytes, reason."""
        from .plan_frames import extras_frame

        return extras_frame(self)

    @cached_property
    def output_files(self) -> pd.DataFrame:
        """One row per output shard: size, tensors, rank, and whether it is kept from an earlier run."""
        from .plan_frames import output_files_frame

        return output_files_frame(self)

    @cached_property
    def groups(self) -> pd.DataFrame:
        """The schedule: one row per step (group) in execution order with its bytes and memory.

        `reads_from` lists the source files the step reads (e.g. which rank files of a ZeRO checkpoint).
        """
        from .plan_frames import groups_frame

        return groups_frame(self)

    @cached_property
    def memory(self) -> pd.DataFrame:
        """The memory timeline per rank: tensor bytes held during each step and the running peak."""
        from .plan_frames import memory_frame

        return memory_frame(self)

    @cached_property
    def ranks(self) -> pd.DataFrame:
        """One row per rank: files it writes and opens, bytes it moves, its predicted peak memory."""
        from .plan_frames import ranks_frame

        return ranks_frame(self)

    def problems_frame(self) -> pd.DataFrame:
        """Problems as a table: severity, op, tensor, message."""
        from .plan_frames import problems_frame

        return problems_frame(self)

    # -- summaries (text and HTML by planning.plan_report) ------------------------------------------

    def headline(self) -> list[str]:
        """The summary's first lines (source, status, groups, reads and writes, memory): what panels show on top."""
        from .plan_report import headline

        return headline(self)

    def summary(self) -> str:
        """A text summary: headline numbers, output files, source files read, problems."""
        from .plan_report import summary

        return summary(self)

    @property
    def output_details(self) -> list[tuple[str, list[str], list[tuple]]]:
        """Tables the output format adds (title, columns, rows): GGUF tensor types and sizes, its metadata ..."""
        return self.output_format.details([f.layout for f in self.output_file_list])

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"<Plan {len(self.steps)} groups -> {len(self.output_file_list)} files, {'ok' if self.ok else 'not ok'}>"

    def _repr_html_(self) -> str:
        from .plan_report import plan_html

        return plan_html(self)
