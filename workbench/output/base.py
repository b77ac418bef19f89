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

    def file_name(self, k: int, n: int) -> str:
        """Name of data file `k` (0-based) of `n`."""
        raise NotImplementedError

    def layout_file(self, name: str, tensors: Sequence[TensorInfo], metadata: Mapping[str, str] | None = None) -> FileLayout:
        """Place `tensors` (in schedule order) in the data file `name`: its header bytes and every offset."""
        raise NotImplementedError

    def open_writer(self, folder: str | os.PathLike, layout: FileLayout) -> Writer:
        """The streaming writer that fills one planned data file (temporary name until its commit)."""
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

    def __repr__(self) -> str:
        return f"<output format {self.name}>"
