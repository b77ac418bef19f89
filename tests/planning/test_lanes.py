"""Copy lanes: a byte-copy rank writing several files runs them on two threads, with the bytes of a one-lane
run, and a failure in either lane leaves nothing that looks complete."""

from __future__ import annotations

import errno
import filecmp
import os
from pathlib import Path

import pytest

import workbench as wb
from workbench.engine import rank
from workbench.errors import PlanError
from workbench.formats import open_catalog
from workbench.output.safetensors import SafetensorsWriter
from workbench.planning import lanes

SHARD_SIZE = "120KB"  # tiny-llama -> 7 shards
INDEX = "model.safetensors.index.json"


@pytest.fixture
def lanes_on(monkeypatch) -> list[int]:
    """Lanes for any size on any machine; the list counts the runs that used them."""
    monkeypatch.setattr(lanes, "LANE_MIN_BYTES", 0)
    monkeypatch.setattr(lanes, "available_cpus", lambda ranks_here=1: 2)
    used: list[int] = []
    real = rank._run_lanes

    def counted(*args, **kwargs):
        used.append(len(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(rank, "_run_lanes", counted)
    return used


def _same_folders(a: Path, b: Path) -> None:
    names = sorted(n for n in os.listdir(a) if not n.startswith("."))
    assert names == sorted(n for n in os.listdir(b) if not n.startswith("."))
    assert all(filecmp.cmp(a / n, b / n, shallow=False) for n in names), names


def _partials(folder: Path) -> list[str]:
    return [n for n in os.listdir(folder) if n.endswith(".partial")]


def test_split_gives_whole_files_to_lanes_balanced_and_in_order(llama_sample: Path, monkeypatch) -> None:
    real_cpus = lanes.available_cpus
    monkeypatch.setattr(lanes, "available_cpus", lambda ranks_here=1: 2)
    plan = wb.plan(llama_sample, shard_size=SHARD_SIZE)
    steps, files = plan.rank_steps(0), {f.name: f for f in plan.rank_files(0)}
    monkeypatch.setattr(lanes, "LANE_MIN_BYTES", 0)
    split = lanes.split_lanes(steps, files, local_raw=True)
    assert split is not None and len(split) == 2
    owner = {name: k for k, lane in enumerate(split) for step in lane for name in step.files}
    assert all(owner[name] == k for k, lane in enumerate(split) for step in lane for name in step.files)  # whole files
    assert sorted(s.index for lane in split for s in lane) == sorted(s.index for s in steps)  # every step once
    assert all([s.index for s in lane] == sorted(s.index for s in lane) for lane in split)  # schedule order kept
    load = [sum(files[n].size for n in files if owner[n] == k) for k in range(2)]
    assert max(load) - min(load) <= max(f.size for f in files.values())  # balanced to within one file
    # One lane where two do not pay or cannot work:
    assert lanes.split_lanes(steps, files, local_raw=False) is None  # a reader in between (remote, pickled ...)
    first = next(iter(files))
    assert lanes.split_lanes([s for s in steps if s.files == (first,)], {first: files[first]}, local_raw=True) is None
    monkeypatch.setattr(lanes, "available_cpus", lambda ranks_here=1: 1)
    assert lanes.split_lanes(steps, files, local_raw=True) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on a 2-processor machine: a processor each
    monkeypatch.setattr(lanes, "available_cpus", real_cpus)
    monkeypatch.setattr(lanes.os, "sched_getaffinity", lambda pid: {0, 1})
    assert lanes.split_lanes(steps, files, local_raw=True) is None
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # planned for two local ranks, before any launcher
    assert lanes.split_lanes(steps, files, local_raw=True, ranks_here=2) is None
    assert lanes.split_lanes(steps, files, local_raw=True, ranks_here=1) is not None
    monkeypatch.setattr(lanes, "available_cpus", lambda ranks_here=1: 2)
    monkeypatch.setattr(lanes, "LANE_MIN_BYTES", 1 << 40)
    assert lanes.split_lanes(steps, files, local_raw=True) is None
    cast = wb.plan(llama_sample, shard_size=SHARD_SIZE, dtype="bf16")
    monkeypatch.setattr(lanes, "LANE_MIN_BYTES", 0)
    assert lanes.split_lanes(cast.rank_steps(0), {f.name: f for f in cast.rank_files(0)}, local_raw=True) is None


def test_two_lanes_write_the_bytes_of_one(llama_sample: Path, tmp_path: Path, lanes_on: list[int]) -> None:
    report = wb.convert(llama_sample, tmp_path / "two", shard_size=SHARD_SIZE, quiet=True)
    assert lanes_on == [2]
    lanes.LANE_MIN_BYTES = 1 << 40  # (undone by the fixture's monkeypatch)
    one = wb.convert(llama_sample, tmp_path / "one", shard_size=SHARD_SIZE, quiet=True)
    assert lanes_on == [2]
    assert report.bytes_written == one.bytes_written > 0 and report.bytes_read == one.bytes_read  # counted across lanes
    _same_folders(tmp_path / "two", tmp_path / "one")


def test_a_failure_in_a_lane_stops_both_and_resume_completes(llama_sample: Path, tmp_path: Path, lanes_on, monkeypatch) -> None:
    clean = tmp_path / "clean"
    wb.convert(llama_sample, clean, shard_size=SHARD_SIZE, quiet=True)
    dest = tmp_path / "out"
    monkeypatch.setenv(rank.FAIL_RANK_ENV, "0")  # fails just before committing the rank's last file
    with pytest.raises(PlanError, match="failure injected"):
        wb.convert(llama_sample, dest, shard_size=SHARD_SIZE, quiet=True)
    assert INDEX not in os.listdir(dest) and not _partials(dest)
    monkeypatch.delenv(rank.FAIL_RANK_ENV)
    wb.convert(llama_sample, dest, shard_size=SHARD_SIZE, quiet=True)
    _same_folders(clean, dest)
    assert lanes_on[:2] == [2, 2]  # the clean run and the failing one (the resume has one file left)


def test_a_failed_commit_in_either_lane_fails_the_run_cleanly(llama_sample: Path, tmp_path: Path, lanes_on, monkeypatch) -> None:
    clean = tmp_path / "clean"
    wb.convert(llama_sample, clean, shard_size=SHARD_SIZE, quiet=True)
    real_commit = SafetensorsWriter.commit
    for failing in (1, 2):  # the first file committed by each lane
        commits = [0]

        def commit(self, *args, _failing=failing, _commits=commits, **kwargs):
            _commits[0] += 1
            if _commits[0] == _failing:
                raise OSError(errno.ENOSPC, "No space left on device", str(self.partial_path))
            return real_commit(self, *args, **kwargs)

        monkeypatch.setattr(SafetensorsWriter, "commit", commit)
        dest = tmp_path / f"out{failing}"
        with pytest.raises(PlanError, match="the disk is full"):
            wb.convert(llama_sample, dest, shard_size=SHARD_SIZE, quiet=True)
        assert INDEX not in os.listdir(dest) and not _partials(dest)
        monkeypatch.setattr(SafetensorsWriter, "commit", real_commit)
        wb.convert(llama_sample, dest, shard_size=SHARD_SIZE, quiet=True)
        _same_folders(clean, dest)


def _second_lane_waits_for_a_report_after_the_first(monkeypatch) -> tuple:
    """Lane 1 holds at its first copy until the first lane has finished and the rank's thread has reported progress
    since (states, not times: the first lane always finishes first, and the rank reports while lane 1 still runs).
    Returns (first_done, reported_after): the events, the second set by the test's progress callback."""
    import threading

    first_done, reported_after = threading.Event(), threading.Event()
    real_lane, real_copy = rank._run_lane, SafetensorsWriter.copy_span

    def lane(*args, **kwargs):
        try:
            return real_lane(*args, **kwargs)
        finally:
            if threading.current_thread() is threading.main_thread():  # the first lane runs on the rank's thread
                first_done.set()

    def copy_span(self, *args, **kwargs):
        if threading.current_thread().name == "workbench-lane-1":
            assert reported_after.wait(60), "the rank never reported progress after its first lane finished"
        return real_copy(self, *args, **kwargs)

    monkeypatch.setattr(rank, "_run_lane", lane)
    monkeypatch.setattr(SafetensorsWriter, "copy_span", copy_span)
    return first_done, reported_after


def test_progress_counts_both_lanes_and_a_cancel_stops_them(llama_sample: Path, tmp_path: Path, lanes_on, monkeypatch) -> None:
    from workbench.engine.progress import Cancelled

    first_done, reported_after = _second_lane_waits_for_a_report_after_the_first(monkeypatch)
    seen: list[int] = []

    def record(rank: int, done: int, total: int) -> None:
        seen.append(done)
        if first_done.is_set():
            reported_after.set()

    total = wb.convert(llama_sample, tmp_path / "full", shard_size=SHARD_SIZE, quiet=True, on_progress=record).bytes_written
    # Reported while the second lane went on after the first had finished (the rank's thread keeps reporting):
    assert seen == sorted(seen) and len(seen) >= 3 and seen[-1] == open_catalog(llama_sample).total_bytes
    assert lanes_on == [2]

    first_done, reported_after = _second_lane_waits_for_a_report_after_the_first(monkeypatch)

    def cancel_while_the_second_lane_runs(rank: int, done: int, total: int) -> bool:
        if first_done.is_set():
            reported_after.set()
            return False
        return True

    dest = tmp_path / "cancelled"
    with pytest.raises(Cancelled, match="cancelled"):
        wb.convert(llama_sample, dest, shard_size=SHARD_SIZE, quiet=True, on_progress=cancel_while_the_second_lane_runs)
    assert INDEX not in os.listdir(dest) and not _partials(dest)
    assert len([n for n in os.listdir(dest) if n.endswith(".safetensors")]) < 7  # the second lane stopped early
    assert total > 0


def test_a_failing_lane_run_leaves_no_source_descriptor_open(llama_sample: Path, tmp_path: Path, lanes_on, monkeypatch) -> None:
    def open_fds() -> set[str]:
        found = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                found.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return found

    source = str(llama_sample.resolve())
    monkeypatch.setenv(rank.FAIL_RANK_ENV, "0")
    with pytest.raises(PlanError, match="failure injected"):
        wb.convert(llama_sample, tmp_path / "out", shard_size=SHARD_SIZE, quiet=True)
    assert lanes_on == [2]
    assert not [p for p in open_fds() if p.startswith(source)]
