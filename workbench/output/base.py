"""What every output format tells the planner and the engine.

The planner lays files out through an `OutputFormat` (names, headers, what is written at commit) and
the engine fills them through it (writers, the commit itself), so neither branches on a format's name:
adding a format is one module that defines a subclass and registers it (see `workbench.output`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..catalog import TensorInfo

# The streaming writer of one data file: SafetensorsWriter or a subclass (write, commit, abort ...).
Writer = Any


@dataclass(frozen=True)
class FileLayout:
    """Everything needed to write one safetensors file: the header bytes and each tensor's placement."""

    file: str
    header: bytes  # the 8-byte length prefix plus the padded JSON
    tensors: tuple[TensorInfo, ...]  # with file and absolute begin/end set, in data order
    size: int

    def by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}


class OutputFormat:
    """One way to write a conversion's output folder. Subclasses fill in the layout, writer and commit."""

    name: str = ""  # what users pass as `to=` / `--to`
    title: str = ""  # how messages name it, e.g. "DCP"
    label: str = ""  # shown after the destination in plan summaries, e.g. " (DCP)"
    keeps_header_metadata: bool = False  # whether the source's safetensors `__metadata__` can travel
    copies_extras: bool = True  # whether config, tokenizer and other non-weight files are copied beside the output
    default_shard_size: int | str = "5GB"  # the split size when the user names none
    applies_dtype_policy: bool = True  # whether the planner casts float outputs to `dtype=` (False: `prepare` uses it)
    pads_header: bool = False  # whether `layout_file` takes `data_residue=` (a data start placed within a page, or a function choosing it)
    model_parallel: bool = False  # whether `nproc_mp=` (Meta's model-parallel files) means something for this format
    # whether the planner may make one step of many neighbouring whole copies or casts (`planning.copy_runs`,
    # `planning.cast_runs`): the format lays tensors out one after another in schedule order, one header per file
    plans_runs: bool = False
    # whether several ranks may write disjoint byte ranges of one file (`join_writer`; `planning.parts`): its file is
    # created whole (header, size) before the ranks start, each rank writes and syncs its ranges, the finish renames it
    shares_files: bool = False
    # whether a remote destination may upload its files part by part as their bytes are written (`sparse_writer`:
    # a spool file with blocks only where bytes were written, holes punched after each part's upload)
    streams_parts: bool = False

    def policy(self, dtype: Any) -> str:
        """The code a `dtype=` policy stands for in this format (default: a float dtype every tensor is cast to)."""
        from ..dtypes import policy_dtype

        return policy_dtype(dtype)

    def prepare(self, catalog: Any, mapper: Any, options: Any, preset: Any = None) -> tuple[Any, OutputFormat, Any]:
        """Bind the format to one source before planning: the mapper to plan, the format instance that lays out
        and commits, and the options (a format may fix some, e.g. GGUF drops what llama.cpp has no place for).
        `preset` is the mapper preset the planner registered for this format (`mapper.OUTPUT_PRESETS`), if any."""
        return mapper, self, options

    def statement(self) -> Any:
        """What the output must hold, stated apart from the plan's ops (`output.statement.Statement`), which `--verify`
        checks the written files against; None when the format states nothing beyond the plan (the default)."""
        return None

    def file_name(self, k: int, n: int) -> str:
        """Name of data file `k` (0-based) of `n`."""
        raise NotImplementedError

    def owns(self, name: str) -> bool:
        """Whether a file called `name` in a destination folder is one this format writes (a data file, index or
        commit marker of any output of it), so `overwrite=True` removes it as stale; a user's other files are kept."""
        return False

    def memory_terms(self, planned_here: bool) -> list[tuple[str, int, str]]:
        """What this format adds to a conversion process's predicted RSS (`planning.rss`): (part, bytes, detail) rows.
        `planned_here`: the process also planned (the CLI, or one process), rather than receiving a plan (a worker)."""
        return []

    def layout_file(self, name: str, tensors: Sequence[TensorInfo], metadata: Mapping[str, str] | None = None) -> FileLayout:
        """Place `tensors` (in schedule order) in the data file `name`: its header bytes and every offset."""
        raise NotImplementedError

    def open_writer(self, folder: str | os.PathLike, layout: FileLayout) -> Writer:
        """The streaming writer that fills one planned data file (temporary name until its commit)."""
        raise NotImplementedError

    def sparse_writer(self, folder: str | os.PathLike, layout: FileLayout) -> Writer:
        """A writer of one planned data file that preallocates nothing (a spool file uploaded part by part)."""
        raise NotImplementedError

    def create_shared(self, folder: str | os.PathLike, layout: FileLayout) -> None:
        """Create the temporary file of `layout` whole (header written, full size) for ranks to join."""
        raise NotImplementedError

    def join_writer(self, folder: str | os.PathLike, layout: FileLayout) -> Writer:
        """A writer into the temporary file `create_shared` made, for one rank's byte ranges; `release()` syncs and
        closes it without renaming (the finish renames the file once every rank is done: `commit_shared`)."""
        raise NotImplementedError

    def commit_shared(self, folder: str | os.PathLike, layout: FileLayout) -> None:
        """Rename a shared file, complete once every rank succeeded, to its final name."""
        raise NotImplementedError

    def carried_objects(self, reader: Any, rest: str) -> tuple[list[Any], list[str]]:
        """Non-tensor entries of the source this format carries over verbatim, and warnings about the rest."""
        return [], []

    def index(self, layouts: Sequence[FileLayout]) -> dict | None:
        """The index written at commit that maps tensors to files, if this format has one for these files."""
        return None

    def commit_files(self, layouts: Sequence[FileLayout], objects: bool) -> list[str]:
        """Files written at commit, after every data file is complete; the last one marks the output complete."""
        raise NotImplementedError

    def commit(self, dest: Path, layouts: Sequence[FileLayout], reader: Any, *, objects: bool) -> bool:
        """Write the commit files (the marker last); True when a marker file was written."""
        raise NotImplementedError

    def shard_of(self, name: str) -> int | None:
        """The data file an output tensor must go to, when the format decides it (None: shards by size)."""
        return None

    def details(self, layouts: Sequence[FileLayout]) -> list[tuple[str, list[str], list[tuple]]]:
        """Format-specific tables a plan shows: (title, columns, rows), e.g. GGUF types and metadata."""
        return []

    def lossy_errors(self, source: Any, written: Any) -> dict[str, float]:
        """For `--verify`: output tensor -> largest |value - source value| where the format stores values lossily
        (quantised), read back from `written` and de-quantised; empty for exact formats."""
        return {}

    def check_generated(self, layouts: Sequence[FileLayout], written: Any) -> list[tuple[str, str, str, float | None, int, str]]:
        """For `--verify`: rows (tensor, check, status, max_abs_diff, overflow, detail) for tensors the format writes
        without a plan step (e.g. GGUF's rope_freqs, made from config.json), read back from `written`; none by default."""
        return []

    def open_written(self, dest: Path, layouts: Sequence[FileLayout]) -> Any:
        """A catalog of the finished output for `--verify`, or None when the workbench reads the format itself."""
        return None

    def __repr__(self) -> str:
        return f"<output format {self.name}>"
