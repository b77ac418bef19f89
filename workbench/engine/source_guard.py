"""Noticing a source checkpoint that changes while it is being converted.

The size and modification time of every source file are recorded when the engine first sees a plan
(and sizes are compared with what the headers said when the checkpoint was opened); they are checked
again before each output file is committed and before the index. A change means the output may mix
old and new bytes, so the run stops with an error and writes no index. The plan's fingerprint includes
the same facts, so a later run never resumes from shards made of the old bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import PlanError

_ATTRIBUTE = "_workbench_source_snapshot"


class SourceChanged(PlanError):
    """A source file changed (size or modification time) during the conversion."""


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


@dataclass
class SourceSnapshot:
    """(size, mtime_ns) of each source file, and the size its headers promised."""

    stats: dict[str, tuple[int, int] | None]
    promised_sizes: dict[str, int]
    # How a file's state is read: os.stat locally; a remote reader's `file_state` (size, version tag).
    state: Callable[[str], tuple | None] = field(default=_stat)

    def changes(self) -> list[str]:
        """One phrase per source file that differs from the snapshot (or from its headers)."""
        found = []
        for path, before in self.stats.items():
            now = self.state(path)
            promised = self.promised_sizes.get(path)
            if now is None:
                found.append(f"{path} was removed")
            elif before is not None and now != before:
                what = f"size {before[0]} -> {now[0]}" if now[0] != before[0] else "modified, same size"
                found.append(f"{path} changed ({what})")
            elif promised is not None and now[0] != promised:
                found.append(f"{path} changed since it was opened (size {promised} -> {now[0]})")
        return found

    def check(self, dest: object, when: str) -> None:
        """Raise `SourceChanged` when any source file changed; `when` says what was about to happen."""
        changes = self.changes()
        if changes:
            more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
            raise SourceChanged(
                f"Cannot convert into {dest}: the source changed during the conversion ({changes[0]}{more}), detected "
                f"before {when}. The output would mix old and new data, so nothing more was committed and no index "
                "was written. Let the source settle, then run the conversion again (with overwrite=True / --overwrite).",
                file=changes[0].split(" ", 1)[0],
            )


def snapshot_for(plan) -> SourceSnapshot:
    """The snapshot of `plan`'s source files, taken on the first call and kept with the plan."""
    snapshot = getattr(plan, _ATTRIBUTE, None)
    if snapshot is None:
        catalog = plan.source
        remote_state = getattr(catalog.reader, "file_state", None)
        if remote_state is not None:  # a remote source: its reads are pinned to the listed versions
            paths = {rel: info.size for rel, info in sorted(catalog.files.items())}
            snapshot = SourceSnapshot({p: remote_state(p) for p in paths}, paths, remote_state)
        else:
            paths = {str(plan.source_path(rel)): info.size for rel, info in sorted(catalog.files.items())}
            snapshot = SourceSnapshot({p: _stat(p) for p in paths}, paths)
        setattr(plan, _ATTRIBUTE, snapshot)
    return snapshot
