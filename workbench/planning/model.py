"""`Plan`: the dry-run of a conversion, computed from metadata alone, and what the engine executes.

A plan holds the schedule (one step per dependency group), the output layout (every output tensor's
file and offset, the index), the rank assignment, the source files each rank opens and the bytes it
reads, the predicted memory, and every problem found. Tables are pandas DataFrames built on first
access, so the engine, which only needs the plain data, never imports pandas.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..catalog import Catalog
from ..display import format_bytes, format_count, format_decimal, html_table, text_table
from ..dtypes import numpy_castable
from ..mapper.groups import Binding, Problem
from ..output import OutputFormat, output_format
from .extras import COPIED, SKIPPED, UPDATED, Extra
from .header_metadata import HeaderMetadata
from .schedule import CAST, COMPUTE, COPY, ROWS, Step
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
        if not any(f.kept for f in self.output_file_list) and {f.rank for f in self.output_file_list} <= {0}:
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
        return [f for f in self.output_file_list if f.rank == rank and not f.kept]

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

    @property
    def rss_breakdown(self) -> pd.DataFrame:
        """The predicted RSS part by part (rows: interpreter, workbench, imports (none, numpy or torch), metadata,
        buffers, tensor peak, intermediates), one bytes column per rank and a `detail` column for the largest rank."""
        import pandas as pd

        from .rss import rss_parts

        per_rank = {r: rss_parts(self, r) for r in range(self.nproc)}
        largest = max(per_rank, key=lambda r: sum(p.bytes for p in per_rank[r]))
        frame = pd.DataFrame({f"rank {r}" if self.nproc > 1 else "bytes": [p.bytes for p in parts] for r, parts in per_rank.items()},
                             index=pd.Index([p.part for p in per_rank[largest]], name="part"))
        frame["detail"] = [p.detail for p in per_rank[largest]]
        return frame

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
        if self.needs_torch:
            return "torch needed"
        if any(s.kind == ROWS for s in self.steps):
            return "tensors converted by numpy in row chunks (no torch)"
        if any(s.kind != COPY for s in self.steps):
            return "casts by numpy (torch only for chunks holding NaN)"
        from .lanes import rank_lanes

        lanes = max((len(lanes) for r in range(self.nproc) if (lanes := rank_lanes(self, r)) is not None), default=1)
        return "byte copies only (no torch)" + (f", {lanes} copy lanes per rank" if lanes > 1 else "")

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

    # -- DataFrames (pandas imported on first access) ----------------------------------------------

    @cached_property
    def outputs(self) -> pd.DataFrame:
        """One row per output tensor: dtype, shape, nbytes, file, offset, rank, group label."""
        import pandas as pd

        rows = []
        for step in self.steps:
            for t in step.group.outputs:
                file, offset = self.placement[t.name]
                rows.append((t.name, t.dtype, t.shape, t.nbytes, file, offset, step.rank, step.group.label))
        frame = pd.DataFrame(rows, columns=["name", "dtype", "shape", "nbytes", "file", "offset", "rank", "group"])
        return frame.set_index("name")

    @cached_property
    def files_read(self) -> pd.DataFrame:
        """One row per (source file, rank) the run opens: bytes read and tensors used from it."""
        import pandas as pd

        rows: dict[tuple[str, int], list[int]] = {}
        for step in self.steps:
            if not self.step_active(step):
                continue
            used: dict[str, int] = {}
            for t in step.group.inputs:
                used[t.file] = used.get(t.file, 0) + 1
            for rel, n in step.reads.items():
                row = rows.setdefault((rel, step.rank), [0, 0])
                row[0] += n
                row[1] += used.get(rel, 0)
        data = [
            (rel, rank, n, k, self.source.files[rel].size if rel in self.source.files else None, self.source_location(rel))
            for (rel, rank), (n, k) in sorted(rows.items())
        ]
        frame = pd.DataFrame(data, columns=["file", "rank", "bytes_read", "tensors", "file_size", "path"])
        file_sources = getattr(self.source, "file_sources", None)
        if file_sources:  # several sources (workbench.formats.multi): say which one each file belongs to
            frame.insert(0, "source", frame["file"].map(file_sources))
        return frame

    @cached_property
    def extras_table(self) -> pd.DataFrame:
        """One row per non-tensor file or folder beside the weights: path, action (copy, update, skip), bytes, reason."""
        import pandas as pd

        data = [(e.path, e.action, e.size, e.reason) for e in self.extra_files]
        return pd.DataFrame(data, columns=["path", "action", "bytes", "reason"])

    @cached_property
    def output_files(self) -> pd.DataFrame:
        """One row per output shard: size, tensors, rank, and whether it is kept from an earlier run."""
        import pandas as pd

        data = [(f.name, f.size, f.n_tensors, f.rank, f.kept) for f in self.output_file_list]
        return pd.DataFrame(data, columns=["file", "size", "tensors", "rank", "kept"])

    @cached_property
    def groups(self) -> pd.DataFrame:
        """The schedule: one row per step (group) in execution order with its bytes and memory.

        `reads_from` lists the source files the step reads (e.g. which rank files of a ZeRO checkpoint).
        """
        import pandas as pd

        data = [
            (
                s.index, s.rank, s.group.label, s.kind, len(s.group.inputs), len(s.group.outputs), s.group.bytes_in,
                s.group.bytes_out, s.bytes_read, s.held_bytes, ", ".join(s.files), ", ".join(s.reads), self.step_active(s),
            )
            for s in self.steps
        ]
        columns = ["step", "rank", "label", "kind", "inputs", "outputs", "bytes_in", "bytes_out", "bytes_read",
                   "held_bytes", "files", "reads_from", "runs"]
        return pd.DataFrame(data, columns=columns).set_index("step")

    @cached_property
    def memory(self) -> pd.DataFrame:
        """The memory timeline per rank: tensor bytes held during each step and the running peak."""
        import pandas as pd

        data, peaks = [], {}
        for s in self.steps:
            if not self.step_active(s):
                continue
            peaks[s.rank] = max(peaks.get(s.rank, 0), s.held_bytes)
            data.append((s.index, s.rank, s.group.label, s.kind, s.held_bytes, peaks[s.rank]))
        return pd.DataFrame(data, columns=["step", "rank", "label", "kind", "held_bytes", "peak_bytes"])

    @cached_property
    def ranks(self) -> pd.DataFrame:
        """One row per rank: files it writes and opens, bytes it moves, its predicted peak memory."""
        import pandas as pd

        return pd.DataFrame([self._rank_row(r) for r in range(self.nproc)], columns=list(_RANK_COLUMNS))

    def _rank_row(self, rank: int) -> tuple:
        files = self.rank_files(rank)
        reads = self.reads(rank)
        return (
            rank, [f.name for f in files], list(reads), sum(reads.values()), sum(f.size for f in files),
            self.rank_peak_bytes(rank), len(self.rank_steps(rank)),
        )

    def problems_frame(self) -> pd.DataFrame:
        """Problems as a table: severity, op, tensor, message."""
        import pandas as pd

        return pd.DataFrame(
            [(p.severity, p.op, p.tensor, p.message) for p in self.problems], columns=["severity", "op", "tensor", "message"]
        )

    # -- summaries ----------------------------------------------------------------------------------

    def headline(self) -> list[str]:
        """The summary's first lines (source, status, groups, reads and writes, memory): what panels show on top."""
        src = self.source
        kinds: dict[str, int] = {}
        for s in self.steps:
            kinds[s.kind] = kinds.get(s.kind, 0) + 1
        kind_text = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        n_files = len(self.output_file_list)
        reads = self.reads()
        status = "OK" if self.ok else f"{len(self.errors)} error(s): cannot run"
        if self.ok and self.complete:
            status = f"OK: already complete, nothing to do ({self.dest} holds this conversion's finished output)"
        lines = [
            f"Plan: {src.location} ({src.format}, {len(src.files)} files, {len(src)} tensors, {format_bytes(src.total_bytes)})"
            f" -> {self.dest if self.dest is not None else '(no destination)'}" + self.output_format.label,
            f"status: {status}",
            f"groups: {len(self.steps)} ({kind_text or 'none'}); outputs: {sum(f.n_tensors for f in self.output_file_list)} "
            f"tensors, {format_bytes(self.total_size)} in {format_count(n_files, 'file')} "
            + (f"(shard size {format_decimal(self.options.shard_size)})" if self.options.shard_size < 1 << 60 else "(no size limit)"),
            f"reads: {len(reads)} of {len(src.files)} source files, {format_bytes(sum(reads.values()))}; "
            f"writes: {format_bytes(self.bytes_written)}"
            + (f" ({len(self.kept)} shard(s) kept from an interrupted run)" if self.kept else ""),
            *self._download_lines(),
            f"RAM to provision: {format_bytes(self.rss_bytes)} per process (predicted RSS); "
            f"peak tensor memory: {format_bytes(self.peak_bytes)} per process; ranks: {self.nproc}"
            + f"; {self.library_note}",
        ]
        lines += self._extras_lines()
        lines += self._metadata_lines()
        if self.copied_objects:
            lines.append(f"non-tensor entries copied verbatim: {len(self.copied_objects)}")
        return lines

    def _download_lines(self) -> list[str]:
        downloads = self.downloads
        if downloads is None:
            return []
        total = sum(n for n, _ in downloads.values())
        requests = sum(k for _, k in downloads.values())
        per_file = ", ".join(f"{rel} {format_bytes(n)} in {k}" for rel, (n, k) in list(downloads.items())[:6])
        more = f" ... ({len(downloads)} files)" if len(downloads) > 6 else ""
        return [f"downloads: {format_bytes(total)} in {requests} range request(s) from {len(downloads)} file(s)"
                + (f" ({per_file}{more})" if per_file else "")]

    def _extras_lines(self) -> list[str]:
        lines = []
        copied = [e.path for e in self.extra_files if e.action == COPIED and not e.reason]
        if copied:
            shown = ", ".join(copied[:20]) + (f" ... ({len(copied)} files)" if len(copied) > 20 else "")
            lines.append(f"extras copied: {shown}")
        lines += [f"extra copied unchanged: {e.path} ({e.reason})" for e in self.extra_files if e.action == COPIED and e.reason]
        lines += [f"extra updated: {e.path} ({e.reason})" for e in self.extra_files if e.action == UPDATED]
        skipped = [e for e in self.extra_files if e.action == SKIPPED]
        if skipped:
            lines.append("extras skipped: " + "; ".join(f"{e.path} ({e.reason})" for e in skipped[:10])
                         + (f" ... ({len(skipped)} in all)" if len(skipped) > 10 else ""))
        return lines

    def _metadata_lines(self) -> list[str]:
        meta = self.header_metadata
        if meta is None or not meta.interesting:
            return []
        if not self.output_format.keeps_header_metadata:
            return [f"source header metadata: dropped (a {self.output_format.title} output has no header metadata)"]
        kept = sorted(k for k in meta.kept if k != "format")
        lines = [f"source header metadata kept: {', '.join(kept) if kept else 'none'}"]
        if meta.dropped:
            lines.append("source header metadata dropped: " + "; ".join(f"{k} ({why})" for k, why in sorted(meta.dropped.items())))
        return lines

    def _file_rows(self) -> list[tuple]:
        return [(f.name, format_bytes(f.size), f.n_tensors, f.rank, "kept" if f.kept else "") for f in self.output_file_list]

    def _read_rows(self) -> list[tuple]:
        rows = []
        for rank in range(self.nproc):
            for rel, n in self.reads(rank).items():
                rows.append((rel, rank, format_bytes(n)))
        return rows

    def summary(self) -> str:
        """A text summary: headline numbers, output files, source files read, problems."""
        parts = ["\n".join(self.headline())]
        if self.output_file_list:
            parts.append("output files:\n" + text_table(["file", "size", "tensors", "rank", ""], self._file_rows()))
        reads = self._read_rows()
        if reads:
            parts.append("source files read:\n" + text_table(["file", "rank", "bytes read"], reads))
        for title, columns, rows in self.output_details:
            parts.append(f"{title}:\n" + text_table(columns, rows))
        if self.problems:
            parts.append("problems:\n" + "\n".join(f"  {p.severity}: {p.message}" for p in self.problems))
        return "\n".join(parts)

    @property
    def output_details(self) -> list[tuple[str, list[str], list[tuple]]]:
        """Tables the output format adds (title, columns, rows): GGUF tensor types and sizes, its metadata ..."""
        return self.output_format.details([f.layout for f in self.output_file_list])

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"<Plan {len(self.steps)} groups -> {len(self.output_file_list)} files, {'ok' if self.ok else 'not ok'}>"

    def _repr_html_(self) -> str:
        head = "".join(f"<div>{html.escape(line)}</div>" for line in self.headline())
        parts = [f"<div><b>Conversion plan</b>{head}</div>"]
        if self.problems:
            items = "".join(
                f"<li style='color:{'#b00' if p.severity == 'error' else '#a60'}'>{html.escape(p.severity)}: "
                f"{html.escape(p.message)}</li>"
                for p in self.problems
            )
            parts.append(f"<ul>{items}</ul>")
        parts.append("<details open><summary>output files</summary>"
                     + html_table(["file", "size", "tensors", "rank", ""], self._file_rows()) + "</details>")
        parts.append("<details><summary>source files read</summary>"
                     + html_table(["file", "rank", "bytes read"], self._read_rows()) + "</details>")
        for title, columns, rows in self.output_details:
            parts.append(f"<details><summary>{html.escape(title)}</summary>" + html_table(columns, rows) + "</details>")
        compute = [s for s in self.steps if s.kind == COMPUTE][:20]
        if compute:
            rows = [(s.index, s.group.label, format_bytes(s.held_bytes)) for s in compute]
            parts.append("<details><summary>compute groups</summary>" + html_table(["step", "group", "held"], rows) + "</details>")
        return "".join(parts)


_RANK_COLUMNS = ("rank", "files", "source_files", "bytes_read", "bytes_written", "peak_bytes", "groups")
