"""Getting the destination ready before any shard is written, and committing it after the last one.

Before: the folder exists, leftovers an overwrite replaces are gone, the manifest names the plan.
After (rank 0, once every rank succeeded): extras copied, the index written last as the commit
marker, the manifest removed. On failure or cancel: temporary `.partial` files removed.
"""

from __future__ import annotations

import os
import re
import shutil

from ..errors import PlanError
from ..formats.safetensors_writer import PARTIAL_SUFFIX, write_index
from ..planning.destination import (
    COMPLETE_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    remove_completion_record,
    remove_manifest,
    write_completion_record,
    write_manifest,
)
from ..planning.model import Plan
from .source_guard import snapshot_for

DCP_METADATA = ".metadata"  # a DCP folder's commit marker
_SHARD_NAME = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^__\d+_\d+\.distcp$")


def _unlink(path: os.PathLike | str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(folder: os.PathLike | str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    remove_completion_record(dest)  # first: from here on the folder no longer holds a finished output
    planned = {f.name for f in plan.output_file_list}
    if plan.options.overwrite:  # an older conversion's shards and index would contradict the new ones
        for name in os.listdir(dest):
            if (_SHARD_NAME.match(name) and name not in plan.kept) or name in (INDEX_NAME, MANIFEST_NAME, DCP_METADATA):
                _unlink(dest / name)
    for name in {INDEX_NAME, *plan.commit_files}:  # the index / .metadata marks a complete output: it reappears last
        _unlink(dest / name)
    for name in planned - plan.kept:
        _unlink(dest / name)
    remove_partials(plan)
    write_manifest(dest, plan.layout_fingerprint, plan.output_file_list)
    _fsync_dir(dest)


def remove_partials(plan: Plan) -> None:
    """Delete temporary files this plan's writers may have left (after a failure or a cancel)."""
    assert plan.dest is not None
    for name in [*(f.name for f in plan.output_file_list), INDEX_NAME, MANIFEST_NAME, COMPLETE_NAME, *plan.commit_files, *plan.extras]:
        _unlink(plan.dest / (name + PARTIAL_SUFFIX))


def copy_extras(plan: Plan) -> list[str]:
    """Copy the non-tensor files beside the source (config.json, tokenizer ...) into the destination."""
    assert plan.dest is not None
    copied = []
    for name in plan.extras:
        source = plan.source.root / name
        partial = plan.dest / (name + PARTIAL_SUFFIX)
        shutil.copyfile(source, partial)
        with open(partial, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(partial, plan.dest / name)
        copied.append(name)
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
    copy_extras(plan)
    if plan.options.to == "dcp":
        from ..formats.dcp_writer import commit_dcp

        commit_dcp(plan.dest, [f.layout for f in plan.output_file_list], plan.source.reader, objects=bool(plan.copied_objects))
        _record_completion(plan, plan.commit_files)
        remove_manifest(plan.dest)
        _fsync_dir(plan.dest)
        return True
    index = plan.index
    if index is not None:
        write_index(plan.dest, index["weight_map"], index["metadata"]["total_size"])
    _record_completion(plan, [INDEX_NAME] if index is not None else [])
    remove_manifest(plan.dest)
    _fsync_dir(plan.dest)
    return index is not None
