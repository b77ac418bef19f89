"""Getting the destination ready before any shard is written, and committing it after the last one.

Before: the folder exists, leftovers an overwrite replaces are gone, the manifest names the plan.
After (rank 0, once every rank succeeded): extras copied, the index written last as the commit
marker, the manifest removed. On failure or cancel: temporary `.partial` files removed.
A remote destination (`plan.remote`): `plan.dest` is the local spool; the destination's `begin` and `finish`
do the same there (lock, manifest, checked files, the index uploaded last; see output/remote/base.py).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import PlanError, UnsafeFileError
from ..files import atomic_write, copy_atomic, fsync_dir, remove_entry, temp_path
from ..formats.links import leads_inside
from ..planning.destination import (
    COMPLETE_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    remove_completion_record,
    remove_manifest,
    write_completion_record,
    write_manifest,
)
from ..planning.extras import GENERATED, updated_bytes
from ..planning.fingerprint import source_states
from ..planning.model import Plan
from .source_guard import snapshot_for


def require_runnable(plan: Plan) -> None:
    """Raise a PlanError listing the plan's errors, if it has any (or no destination)."""
    if plan.dest is None:
        raise PlanError("Cannot run a plan without a destination. Pass dest=... to wb.plan or use wb.convert(source, dest, ...).")
    if not plan.ok:
        listed = " ".join(f"({k}) {p.message}" for k, p in enumerate(plan.errors, 1))
        raise PlanError(f"Cannot convert into {plan.dest}: the plan has {len(plan.errors)} error(s). {listed}")


def prepare_destination(plan: Plan) -> None:
    """Create the destination, clear what this run replaces, and record the plan in the manifest."""
    require_runnable(plan)
    dest = plan.dest
    assert dest is not None
    dest.mkdir(parents=True, exist_ok=True)
    if plan.remote is not None:
        _prepare_remote(plan)
        return
    remove_completion_record(dest)  # first: from here on the folder no longer holds a finished output
    planned = {f.name for f in plan.output_file_list}
    if plan.options.overwrite:  # an older conversion's files (any format's) would contradict the new ones
        from ..output import owned

        for name in os.listdir(dest):
            if (owned(name) and name not in plan.kept) or name in (INDEX_NAME, MANIFEST_NAME):
                remove_entry(dest / name)
    for name in {INDEX_NAME, *plan.commit_files}:  # the index / .metadata marks a complete output: it reappears last
        remove_entry(dest / name)
    for name in planned - plan.kept:
        remove_entry(dest / name)
    remove_partials(plan)
    for file in plan.output_file_list:  # files several ranks write: made whole now, before any rank joins them
        if file.ranks and not file.kept:
            plan.output_format.create_shared(dest, file.layout)
    write_manifest(dest, plan.layout_fingerprint, plan.output_file_list, source_states(plan.source))
    fsync_dir(dest)


def _spool_names(plan: Plan) -> list[str]:
    """Every name a run may leave in its spool folder (files, commit files, extras' top names)."""
    return [*(f.name for f in plan.output_file_list), INDEX_NAME, *plan.commit_files,
            *{e.split("/", 1)[0] for e in plan.extras}]


def _clear_spool(plan: Plan) -> None:
    """Remove this plan's names from its spool folder (the workbench's own folder: subfolders of extras too)."""
    import shutil

    assert plan.dest is not None
    for name in _spool_names(plan):
        path = plan.dest / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            remove_entry(path)


def tidy_spool(plan: Plan) -> None:
    """A remote destination that already holds this conversion (`plan.complete`): remove what a run killed after
    its publication left in this plan's spool folder (its copies, temporary files, records and lock file). Skipped
    while another run holds the spool's lock: its files are its own."""
    from ..output.lock import DestinationLock

    if plan.remote is None or plan.dest is None or not plan.dest.is_dir():
        return
    try:
        lock = DestinationLock(plan.dest).acquire()
    except PlanError:
        return
    try:
        _clear_spool(plan)
        remove_partials(plan, abort=False)
        for name in (MANIFEST_NAME, COMPLETE_NAME):
            remove_entry(plan.dest / name)
    finally:
        lock.release()  # removes the lock file a killed run left


def _prepare_remote(plan: Plan) -> None:
    """Empty the spool of this plan's names (a killed run's copies are uploaded again, never trusted), then let the
    destination lock, hide its marker, clean up and record the plan."""
    assert plan.dest is not None and plan.remote is not None
    _clear_spool(plan)
    remove_partials(plan, abort=False)
    stale = None
    if plan.options.overwrite:  # an older conversion's files (any format's) would contradict the new ones
        from ..output import owned

        stale = owned
    plan.remote.begin({f.name: f.size for f in plan.output_file_list}, sorted(plan.kept), [INDEX_NAME, *plan.commit_files],
                      stale)


def remove_partials(plan: Plan, *, abort: bool = True) -> None:
    """Delete temporary files this plan's writers may have left (after a failure or a cancel); a remote destination
    also abandons this process's unfinished uploads and releases its lock (`abort=False`: only the files)."""
    assert plan.dest is not None
    if plan.remote is not None and abort:
        plan.remote.abort()
    extras = [e for e in plan.extras if not e.endswith("/")]
    for name in [*(f.name for f in plan.output_file_list), INDEX_NAME, MANIFEST_NAME, COMPLETE_NAME, *plan.commit_files, *extras]:
        try:
            remove_entry(temp_path(plan.dest / name))
        except UnsafeFileError:  # a folder planted there: left alone (a writer refuses that name by itself)
            pass
        except NotADirectoryError:  # an extra's subfolder that was never made
            pass


def _extra_source(plan: Plan, rel: str) -> str:
    """The source path of an extra, checked again now: a regular file whose real path is inside the source folder."""
    path = os.path.join(plan.source.root, *rel.split("/"))
    real = os.path.realpath(path)
    if not leads_inside(plan.source.root, path) or not os.path.isfile(real):
        raise PlanError(f"Cannot copy extra {rel} from {plan.source.root}: it is no longer a regular file inside the source "
                        f"folder (it leads to {real}). Check the source folder and convert again.", file=path)
    return real


def _extra_folder(dest: Path, rel: str) -> Path:
    """The destination folder of an extra, made one level at a time; an existing level must be a real folder."""
    folder = dest
    for part in rel.split("/")[:-1]:
        folder = folder / part
        try:
            os.mkdir(folder)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                raise PlanError(f"Cannot copy extra {rel} into {dest}: {folder} exists and is not a folder (a file or a "
                                "link). Remove it and convert again.", file=str(folder)) from None
    return folder


def copy_extras(plan: Plan) -> list[str]:
    """Copy the non-tensor files beside the source (config.json, tokenizer, subfolders without tensors) into the
    destination; a config.json the plan updates (dtype after a cast) is written with its new bytes, one it generates
    (a Meta folder's, from params.json) with the bytes the plan states."""
    assert plan.dest is not None
    copied = []
    for extra in plan.extra_files:
        if not extra.written:
            continue
        folder = _extra_folder(plan.dest, extra.path)
        if extra.path.endswith("/"):  # an empty folder
            copied.append(extra.path)
            continue
        source = _extra_source(plan, extra.path) if extra.action != GENERATED else None  # generated: no source file
        target = folder / extra.path.rsplit("/", 1)[-1]
        new = updated_bytes(plan.source.root, extra, plan.options.dtype)
        if new is None:
            assert source is not None
            copy_atomic(source, target, sync_dir=False)
        else:
            atomic_write(target, new, sync_dir=False)
        if folder != plan.dest:  # the index's commit syncs the top folder
            fsync_dir(folder)
        copied.append(extra.path)
    return copied


def _record_completion(plan: Plan, committed: list[str]) -> None:
    """Mark the output finished, when a re-run could tell it is the same conversion (see destination.py).

    Not for sources held in memory (`save_from`): their tensors can change without any file changing, and
    not when the code of the mapper's Functions cannot be read.
    """
    assert plan.dest is not None
    if plan.source.reader is None or not plan.source.root.exists() or plan.code_digest is None:
        return
    write_completion_record(plan.dest, plan.layout_fingerprint, plan.output_file_list, [*plan.extras, *committed],
                            plan.source.root, plan.extras, plan.code_digest)


def finalize_destination(plan: Plan) -> bool:
    """Commit a completed run: extras, then the index (last), then drop the manifest; True if an index was written."""
    assert plan.dest is not None
    snapshot_for(plan).check(plan.dest, "writing the index")
    if plan.remote is not None:
        return _finalize_remote(plan)
    copy_extras(plan)
    for file in plan.output_file_list:  # every rank synced its ranges of a shared file: it is complete
        if file.ranks and not file.kept:
            plan.output_format.commit_shared(plan.dest, file.layout)
    committed = plan.output_format.commit(plan.dest, [f.layout for f in plan.output_file_list], plan.source.reader,
                                          objects=bool(plan.copied_objects))
    _record_completion(plan, plan.commit_files)
    remove_manifest(plan.dest)
    fsync_dir(plan.dest)
    return committed


def _finalize_remote(plan: Plan) -> bool:
    """Publish a remote destination: extras and commit files written into the spool, then handed to the
    destination's `finish` (which checks every planned file is there and uploads the marker last)."""
    assert plan.dest is not None and plan.remote is not None
    copied = [e for e in copy_extras(plan) if not e.endswith("/")]  # an empty folder is no object
    committed = plan.output_format.commit(plan.dest, [f.layout for f in plan.output_file_list], plan.source.reader,
                                          objects=bool(plan.copied_objects))
    names = [*copied, *(n for n in plan.commit_files if (plan.dest / n).is_file())]
    from ..planning.spool import deferred_names

    plan.remote.defer(deferred_names(plan))  # (this process may have run no rank: the launcher's)
    plan.remote.finish([(n, plan.dest / n) for n in names], {f.name: f.size for f in plan.output_file_list})
    _clear_spool(plan)
    return committed
