"""What a remote destination provides: the interface `s3://` and `hf://` destinations implement.

A conversion into a remote destination writes each output file into a local *spool* folder (the plan's
`dest`, one per rank or node, bounded by `--spool-size`), exactly as into a local folder. The engine then
drives the destination through five calls, always in this order:

1. `state(files)` (rank 0, while planning): what the destination already holds: this very conversion
   finished (`complete`), files of an interrupted run of this plan that are finished and recognised
   (`kept`: name, size, digest in the destination's own records), or a refusal (another plan, not empty).
2. `begin(files, kept, markers)` (rank 0, under the lock, before any file is written): take the destination's lock,
   remove the commit marker (index / `.metadata` / completion record) so nothing looks complete while the
   run changes it, clean up what an interrupted run left (e.g. unfinished S3 multipart uploads), and record
   the plan (the manifest).
3. `file_done(name, local_path, size, sha256)` (any rank, its own files, from the committer thread): the spool
   file is complete (closed, synced, renamed); upload it. When the call returns the object is finished in the
   destination and recognisable by `completed()` on any node; the engine then deletes the spool copy.
   A destination that uploads byte ranges as they are written (`stream_part_size` not None: S3) gets instead,
   for a file larger than one part: `open_stream` when the file is opened, `put_part` for each part once every
   byte of it was written (from upload threads, in any order; the engine then frees the part's blocks in the
   spool), and `close_stream` once the file is complete (the object appears only then).
4. `finish(uploads)` (rank 0, after every rank reported success): check that every planned file is there
   (`completed()`: size and digest as recorded), then publish `uploads` -- the extras (config.json ...) and the
   commit files, in the order given, the index last -- so the output becomes visible at once (S3: the index
   object last; Hub: one commit or PR holding everything); then release the lock.
5. `abort()` (any rank, on failure or cancel): stop and clean up this process's unfinished uploads. Finished
   objects stay: a re-run recognises them (`state(...).kept`). Rank 0 also releases the lock.

Destinations are built from the URL in every process (`open_destination`), never pickled; everything they
need travels in the URL and `options` (plain JSON values, `PlanOptions.remote`). The fingerprint names the
plan: objects are recorded with it, so a re-run of another plan never mistakes them for its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


@dataclass(frozen=True)
class FinishedFile:
    """One file finished in the destination, as its records state it."""

    name: str
    size: int
    sha256: str


@dataclass
class RemoteState:
    """What planning found at a remote destination (see `RemoteDestination.state`)."""

    complete: bool = False  # this very plan finished there: nothing to do
    kept: dict[str, FinishedFile] = field(default_factory=dict)  # finished files of an interrupted run of this plan
    errors: list[str] = field(default_factory=list)  # why the conversion cannot write there ("Cannot write to URL: ...")
    warnings: list[str] = field(default_factory=list)


class RemoteDestination(ABC):
    """A destination that is not a local folder. Subclasses set `scheme` and implement the methods below.

    `url`: as the user wrote it (`s3://bucket/prefix/`, `hf://org/repo@rev`); `fingerprint`: the plan's layout
    fingerprint (`Plan.layout_fingerprint`), the same on every rank; `options`: JSON values from the caller
    (`wb.convert(..., remote_options={...})`, e.g. the Hub's commit message), empty by default.
    """

    scheme: ClassVar[str]  # "s3://", "hf://"

    def __init__(self, url: str, fingerprint: str, options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.fingerprint = fingerprint
        self.options = dict(options or {})

    @property
    def read_url(self) -> str:
        """The URL `wb.open_checkpoint` reads the finished output from (and `--verify` re-reads, by range)."""
        return self.url

    def memory_terms(self) -> list[tuple[str, int, str]]:
        """What uploading adds to a rank's predicted RSS (`plan.rss_bytes`): (part, bytes, detail) rows, e.g. the
        part buffer. The transport's libraries are counted by planning (`planning.rss.REMOTE_LIBRARIES`)."""
        return []

    def stream_part_size(self, size: int) -> int | None:
        """The part size a file of `size` bytes is uploaded in while it is written, or None: uploaded whole once
        finished (`file_done`). Planning asks it too (`planning.spool.streamed_files`), so it must not call out."""
        return None

    def open_stream(self, name: str, size: int) -> None:
        """Start the upload of `name` (`size` bytes) whose parts `put_part` sends as they are written."""
        raise NotImplementedError(f"{type(self).__name__} uploads whole files")

    def put_part(self, name: str, number: int, data: bytes) -> None:
        """Upload part `number` (1-based, `stream_part_size` bytes but the last) of `name`; any thread, any order."""
        raise NotImplementedError(f"{type(self).__name__} uploads whole files")

    def close_stream(self, name: str, size: int) -> None:
        """Every part of `name` was put: make the object appear, check it and record it (as `file_done` does)."""
        raise NotImplementedError(f"{type(self).__name__} uploads whole files")

    def defer(self, names: Sequence[str]) -> None:
        """Files that must not appear before `finish` (every process of the job is told, before any upload): an
        output with no index or other marker (one safetensors or GGUF file) is complete as soon as its one file is
        readable, so that file itself is the marker. Default: nothing to do (a Hub commit shows everything at once)."""
        return None

    def records(self) -> list[dict]:
        """What this process (node) recorded locally about its finished uploads, as JSON values, for rank 0 to
        `adopt` (a destination whose own store records every upload, like S3, has none: [])."""
        return []

    def adopt(self, records: Sequence[dict]) -> None:
        """Rank 0, before `finish`: take over the other ranks' `records` (gathered over the process group), so a
        job on nodes without a shared folder publishes every rank's files. Default: nothing to take over."""
        return None

    @abstractmethod
    def state(self, files: Mapping[str, int], *, overwrite: bool) -> RemoteState:
        """What the destination holds for this plan; `files`: planned output file name -> size in bytes.

        With `overwrite=False` a destination holding anything but this plan's own records and files is refused
        (`errors`); with `overwrite=True` this plan's names are replaced (the others are left alone).
        """

    @abstractmethod
    def begin(self, files: Mapping[str, int], kept: Sequence[str], markers: Sequence[str] = (),
              stale: Callable[[str], bool] | None = None) -> None:
        """Lock, hide the commit marker, clean up an interrupted run's leftovers, record the plan (rank 0).

        `files`: planned name -> size; `kept`: the names `state` recognised as finished (not written again);
        `markers`: the names whose presence says "complete" (the index, `.metadata`): removed first;
        `stale` (overwrite=True only): whether a name is an output file some format writes (`output.owned`):
        such files of an older conversion that this plan does not write are removed too.

        Raises `PlanError` naming the URL when another conversion holds the lock, or when the store cannot
        take a lock safely (then the message says how to proceed).
        """

    @abstractmethod
    def file_done(self, name: str, local_path: Path, size: int, sha256: str) -> None:
        """Upload the finished spool file `local_path` as `name`; return once it is complete and recorded.

        Called from a background thread (one call at a time per process); must not delete `local_path`.
        """

    @abstractmethod
    def completed(self) -> dict[str, FinishedFile]:
        """The files finished in the destination for this fingerprint (any rank's), from the destination's records."""

    @abstractmethod
    def finish(self, uploads: Sequence[tuple[str, Path]], planned: Mapping[str, int]) -> None:
        """Publish: check every `planned` file (name -> size) is in `completed()`, upload `uploads` (name, local
        path) in order, the last being the commit marker, record completion, release the lock (rank 0)."""

    @abstractmethod
    def abort(self, *, keep_lock: bool = False) -> None:
        """Abandon this process's unfinished uploads and release a lock it holds (unless `keep_lock`: a rank's own
        failure, reported to rank 0, which ends the job); never raises for cleanup."""
