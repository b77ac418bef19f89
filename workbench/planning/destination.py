"""The destination folder: is it free to write, is it an interrupted run of the same plan, is there room.

An interrupted conversion leaves a small manifest (`.workbench-convert.json`) recording the plan's
layout fingerprint. Re-running the same plan into that folder keeps every shard that is already
complete: its size and header bytes equal the planned ones (shards are renamed into place only
after they are fully written and synced, so a shard under its final name is whole).

A finished conversion leaves a completion record (`.workbench-complete.json`, written after the
commit marker) with the same fingerprint and what it wrote. Re-running the same plan into that
folder is then a no-op; another plan (source, mapper or options) is refused, as before.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..display import format_bytes
from ..errors import WorkbenchError
from ..files import atomic_write, describe, open_regular, read_regular, remove_entry, temp_name
from ..mapper.groups import Problem
from ..output.lock import LOCK_NAME, holder
from ..output.safetensors import INDEX_NAME
from .sharding import OutputFile

MANIFEST_NAME = ".workbench-convert.json"
COMPLETE_NAME = ".workbench-complete.json"


@dataclass
class DestinationState:
    """What the planner found at the destination."""

    kept: set[str] = field(default_factory=set)  # complete shards of this plan already there
    resumable: bool = False
    complete: bool = False  # this very plan already finished here: nothing to do
    problems: list[Problem] = field(default_factory=list)


def read_manifest(dest: Path) -> dict | None:
    """The manifest of an interrupted conversion in `dest`, or None."""
    try:
        data = json.loads(read_regular(dest / MANIFEST_NAME))
    except (OSError, ValueError, WorkbenchError):
        return None
    return data if isinstance(data, dict) else None


def write_manifest(dest: Path, fingerprint: str, files: Iterable[OutputFile], sources: dict | None = None) -> None:
    """Record which plan is being written into `dest` (before any shard), atomically; `sources`: the source files'
    states (`fingerprint.source_states`), so a resume refused for a changed source names the file."""
    body = {
        "workbench_convert": 1,
        "fingerprint": fingerprint,
        "files": {f.name: {"size": f.size, "header_bytes": len(f.layout.header)} for f in files},
    }
    if sources is not None:
        body["sources"] = sources
    atomic_write(dest / MANIFEST_NAME, json.dumps(body, indent=1, sort_keys=True) + "\n", sync_dir=False)  # the caller syncs the folder


def write_completion_record(
    dest: Path, fingerprint: str, files: Iterable[OutputFile], others: Iterable[str], source_root: Path, extras: Iterable[str],
    code_digest: str,
) -> None:
    """Record, after the commit marker, that `dest` holds the finished output of the plan `fingerprint`.

    `others`: the commit files and extras written besides the shards (their sizes are recorded); `code_digest`
    covers the code the mapper's Functions ran (their JSON names them only);
    `extras` are also stamped with their source's size and modification time, so an edited config.json
    in the source makes the next run copy it again instead of calling the output complete.
    """
    body = {
        "workbench_convert": 1,
        "complete": True,
        "fingerprint": fingerprint,
        "code": code_digest,
        "files": {f.name: {"size": f.size, "header_bytes": len(f.layout.header)} for f in files},
        "others": {name: (dest / name).stat().st_size for name in others},
        "sources": {name: _source_stamp(source_root / name) for name in extras},
    }
    atomic_write(dest / COMPLETE_NAME, json.dumps(body, indent=1, sort_keys=True) + "\n", sync_dir=False)  # the caller syncs


def _source_stamp(path: Path) -> list[int]:
    try:
        info = path.stat()
    except OSError:
        return [-1, -1]
    return [info.st_size, info.st_mtime_ns]


def read_completion_record(dest: Path) -> dict | None:
    """The completion record of a finished conversion in `dest`, or None."""
    try:
        data = json.loads(read_regular(dest / COMPLETE_NAME))  # a planted link or FIFO is never a record
    except (OSError, ValueError, WorkbenchError):
        return None
    return data if isinstance(data, dict) and data.get("complete") is True else None


def remove_completion_record(dest: Path) -> None:
    """Drop the completion record: a run is about to change the folder."""
    remove_entry(dest / COMPLETE_NAME)


def _still_complete(dest: Path, record: dict, files: list[OutputFile], others: list[str], source_root: Path) -> bool:
    """True when everything the record lists is still there as recorded, and matches this plan's files."""
    listed = record.get("files")
    if not isinstance(listed, dict) or set(listed) != {f.name for f in files}:
        return False
    if not all(shard_is_complete(dest / f.name, f) for f in files):
        return False
    sizes = record.get("others")
    if not isinstance(sizes, dict) or set(sizes) != set(others):
        return False
    for name in others:
        try:
            if not (dest / name).is_file() or (dest / name).stat().st_size != sizes[name]:
                return False
        except OSError:
            return False
    stamps = record.get("sources")
    if not isinstance(stamps, dict):
        return False
    return all(_source_stamp(source_root / name) == list(stamp) for name, stamp in stamps.items() if isinstance(stamp, list))


def remove_manifest(dest: Path) -> None:
    """Drop the manifest once the conversion is complete."""
    remove_entry(dest / MANIFEST_NAME)


def shard_is_complete(path: Path, planned: OutputFile) -> bool:
    """True when the file at `path` has the planned size and exactly the planned header bytes."""
    try:
        fd = open_regular(path)  # a symlink or FIFO under a shard's name is never a kept shard
    except (OSError, WorkbenchError):
        return False
    try:
        return os.fstat(fd).st_size == planned.size and os.pread(fd, len(planned.layout.header), 0) == planned.layout.header
    except OSError:
        return False
    finally:
        os.close(fd)


def own_names(files: Iterable[OutputFile], extras: Iterable[str], dest: Path | None = None) -> set[str]:
    """Every name a conversion may create in its destination `dest`, temporary names included."""
    names = {MANIFEST_NAME, COMPLETE_NAME, INDEX_NAME, *(f.name for f in files), *(e.split("/", 1)[0] for e in extras)}
    return names | {temp_name(n, dest) for n in names}


def blocked_names(dest: Path, names: Iterable[str], lock_name: str) -> list[str]:
    """Entries in `dest` a conversion cannot write through: a folder under a name it writes, anything
    but a regular file under the lock's name (a run opens the lock as it exists; see `workbench.files`)."""
    blocked = []
    for name in sorted({*names, lock_name}):
        try:
            mode = os.lstat(dest / name).st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode) or (name == lock_name and not stat.S_ISREG(mode)):
            blocked.append(f"{name} is {describe(mode)} ({dest / name})")
    return blocked


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_destination(
    dest: Path,
    files: list[OutputFile],
    extras: list[str],
    fingerprint: str,
    *,
    overwrite: bool,
    source_root: Path,
    source_files: Iterable[Path],
    extra_bytes: int = 0,
    code_digest: str | None = "",
    changed: Callable[[object], list[str]] | None = None,
) -> DestinationState:
    """Problems with writing this plan to `dest`, and which planned shards are already complete there."""
    state = DestinationState()
    real_dest = os.path.realpath(dest)
    sources = {os.path.realpath(p) for p in source_files}
    outputs = {os.path.realpath(dest / n) for n in (*(f.name for f in files), INDEX_NAME, *extras)}
    if real_dest == os.path.realpath(source_root) or outputs & sources:
        state.problems.append(
            Problem("error", f"Cannot write to {dest}: it would overwrite the source checkpoint's files. Choose another destination.", kind="destination")
        )
        return state
    if dest.exists() and not dest.is_dir():
        state.problems.append(Problem("error", f"Cannot write to {dest}: it is a file, not a folder. Choose a folder path.", kind="destination"))
        return state
    running = holder(dest) if dest.is_dir() else None
    if running is not None:
        state.problems.append(
            Problem("error", f"Cannot write to {dest}: another conversion is writing there ({running}). Wait for it to "
                             "finish or stop it, or choose another destination.", kind="destination")
        )
        return state
    # The lock, and the temporary files of a run killed before its manifest was committed, are the workbench's own:
    # they do not make the folder someone else's (the run removes the temporaries before writing).
    entries = sorted(n for n in os.listdir(dest) if n != LOCK_NAME and n != temp_name(MANIFEST_NAME, dest)) if dest.is_dir() else []
    blocked = blocked_names(dest, own_names(files, extras, dest), LOCK_NAME) if dest.is_dir() else []
    if blocked:
        state.problems.append(
            Problem("error", f"Cannot write to {dest}: {'; '.join(blocked)}. Remove them or choose another destination.", kind="destination")
        )
        return state
    if entries and not overwrite:
        manifest = read_manifest(dest)
        record = read_completion_record(dest)
        # A manifest beside the record: killed between the two at commit; the resume below finishes in no time.
        if record is not None and manifest is None:
            same = record.get("fingerprint") == fingerprint and code_digest is not None and record.get("code") == code_digest
            if same and _still_complete(dest, record, files, extras, source_root):
                state.complete = True
                state.kept = {f.name for f in files}
                return state
            if not same:
                state.problems.append(
                    Problem(
                        "error",
                        f"Cannot write to {dest}: it holds a finished conversion of a different plan (another source, mapper, "
                        "code of the mapper's functions, or options such as dtype, shard size or output format). Choose "
                        "another destination, or pass overwrite=True (--overwrite) to replace it.", kind="destination",
                    )
                )
                return state
            manifest = {"fingerprint": fingerprint}  # this plan finished here, but a file was removed or changed since
        if manifest is not None and manifest.get("fingerprint") == fingerprint:
            state.resumable = True
            by_name = {f.name: f for f in files}
            state.kept = {n for n in entries if n in by_name and shard_is_complete(dest / n, by_name[n])}
            unrelated = [n for n in entries if n not in own_names(files, extras, dest)]
            if unrelated:
                state.problems.append(
                    Problem("warning", f"Destination {dest} also holds files this conversion does not write ({', '.join(unrelated[:5])}); they are left alone.", kind="destination")
                )
        elif manifest is not None:
            moved = changed(manifest.get("sources")) if changed is not None else []
            if moved:
                why = (f"a different plan: its source changed since that run began: {'; '.join(moved[:5])}"
                       + (f" ... ({len(moved)} files)" if len(moved) > 5 else "")
                       + ". Shards written from the old version are not kept")
            else:
                why = "a different plan (another source, mapper or shard size)"
            state.problems.append(
                Problem(
                    "error",
                    f"Cannot write to {dest}: it holds an unfinished conversion of {why}. Choose another destination, or "
                    "pass overwrite=True (--overwrite) to replace it.", kind="destination",
                )
            )
        else:
            shown = ", ".join(entries[:5]) + (" ..." if len(entries) > 5 else "")
            state.problems.append(
                Problem(
                    "error",
                    f"Cannot write to {dest}: destination not empty ({len(entries)} entries: {shown}). Choose an empty or new "
                    "folder, or pass overwrite=True (--overwrite) to replace the conversion's files there.", kind="destination",
                )
            )
    needed = sum(f.size for f in files if f.name not in state.kept) + extra_bytes
    free = shutil.disk_usage(_existing_ancestor(dest)).free
    if needed > free:
        state.problems.append(
            Problem(
                "error",
                f"Cannot write to {dest}: not enough free disk (the output needs {format_bytes(needed)}, "
                f"{format_bytes(free)} are free). Free some space or choose another destination.", kind="destination",
            )
        )
    return state


def check_remote(remote, files: list[OutputFile], *, overwrite: bool) -> DestinationState:
    """What a remote destination (`output.remote.RemoteDestination`) holds for this plan, as planning problems."""
    found = remote.state({f.name: f.size for f in files}, overwrite=overwrite)
    state = DestinationState(kept=set(found.kept), resumable=bool(found.kept), complete=found.complete)
    state.problems += [Problem("error", why, kind="destination") for why in found.errors]
    state.problems += [Problem("warning", why, kind="destination") for why in found.warnings]
    return state


def spool_problems(plan) -> list[Problem]:
    """An error when the local spool of a remote destination cannot get the disk `plan.spool_bytes` says it needs."""
    assert plan.dest is not None and plan.remote is not None
    needed = plan.spool_bytes + sum(e.size for e in plan.extra_files if e.written)
    usage = shutil.disk_usage(_existing_ancestor(plan.dest))
    free = usage.free
    if needed <= free or not usage.total:  # a file system stating no size at all (ramfs: RAM, no limit) cannot be checked
        return []
    return [Problem("error", f"Cannot spool the upload to {plan.remote.url} in {plan.dest}: the spool needs "
                             f"{format_bytes(needed)} per rank and {format_bytes(free)} are free. Lower --spool-size or "
                             "--shard-size, or point --spool-dir (WORKBENCH_SPOOL_DIR) at a larger disk.", kind="destination")]
