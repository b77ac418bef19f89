"""Finished files are committed on a background thread: the run goes on while a file is synced, a failed
commit still fails the run cleanly (no index, no partial file) and a resumed run gives the same bytes."""

from __future__ import annotations

import errno
import filecmp
import os
import threading
from pathlib import Path

import pytest

import workbench as wb
from workbench.engine.committer import Committer
from workbench.errors import PlanError
from workbench.output.safetensors import SafetensorsWriter

SHARD_SIZE = "120KB"  # tiny-llama -> 7 shards


class _SlowWriter:
    def __init__(self, release: threading.Event, fail: bool = False) -> None:
        self.release, self.fail = release, fail
        self.committed = self.aborted = False

    def commit(self, *, sync_dir: bool = True) -> None:
        if not self.release.wait(10):
            raise AssertionError("the committer ran the commit on the caller's thread")
        if self.fail:
            raise OSError(errno.EIO, "Input/output error")
        self.committed = True

    def abort(self) -> None:
        self.aborted = True


def test_commits_run_behind_the_caller_and_finish_in_order() -> None:
    release = threading.Event()
    committer = Committer()
    first, second = _SlowWriter(release), _SlowWriter(release)
    committer.submit("a", first)  # returns while the commit waits: inline it would block until the timeout
    committer.submit("b", second)
    assert not first.committed
    release.set()
    assert committer.finish() == ["a", "b"]
    assert first.committed and second.committed
    committer.close()


def test_a_failed_background_commit_aborts_its_file_and_is_raised() -> None:
    release = threading.Event()
    committer = Committer()
    bad = _SlowWriter(release, fail=True)
    committer.submit("a", bad)
    release.set()
    with pytest.raises(OSError, match="Input/output error"):
        committer.finish()
    assert bad.aborted and not bad.committed
    committer.close()


def test_fsync_failure_of_one_shard_fails_the_run_and_resume_gives_the_same_bytes(llama_sample: Path, tmp_path: Path,
                                                                                   monkeypatch) -> None:
    clean = tmp_path / "clean"
    wb.convert(llama_sample, clean, shard_size=SHARD_SIZE, quiet=True)
    real_commit = SafetensorsWriter.commit
    commits = [0]

    def failing_commit(self, *args, **kwargs):
        commits[0] += 1
        if commits[0] == 2:  # the disk refuses the second shard's fsync
            raise OSError(errno.EIO, "Input/output error", str(self.partial_path))
        return real_commit(self, *args, **kwargs)

    monkeypatch.setattr(SafetensorsWriter, "commit", failing_commit)
    dest = tmp_path / "out"
    with pytest.raises(PlanError, match="Input/output error") as caught:
        wb.convert(llama_sample, dest, shard_size=SHARD_SIZE, quiet=True)
    assert "no index was written" in str(caught.value)
    left = os.listdir(dest)
    assert "model.safetensors.index.json" not in left
    assert not [n for n in left if n.endswith(".partial")], left  # the failed shard's partial file was removed
    monkeypatch.undo()
    report = wb.convert(llama_sample, dest, shard_size=SHARD_SIZE, quiet=True)
    assert report.kept  # the shard committed before the failure is resumed from
    names = sorted(n for n in os.listdir(clean) if not n.startswith("."))
    assert names == sorted(n for n in os.listdir(dest) if not n.startswith("."))
    assert all(filecmp.cmp(clean / n, dest / n, shallow=False) for n in names)
