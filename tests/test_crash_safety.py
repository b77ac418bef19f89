"""Crash safety of conversions: kill -9 anywhere, a full disk, a source that changes under the run.

The invariant after any fault: the destination never holds an index naming incomplete data, nothing
unfinished opens as a checkpoint, and running the same conversion again resumes to output
byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import filecmp
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from workbench.conversion import execute
from workbench.engine.committer import Committer
from workbench.errors import CheckpointError, PlanError
from workbench.explore.verify import verify
from workbench.formats import open_catalog

INDEX = "model.safetensors.index.json"
MANIFEST = ".workbench-convert.json"
LOCK = ".workbench.lock"
COMPLETE = ".workbench-complete.json"
SHARD_SIZE = "120KB"  # tiny-llama (723 KB) -> 7 shards: many commit points
KILL_POINTS = 12

# The child converts with every file-system mutation counted; at event number `kill_at` it SIGKILLs
# itself (no cleanup, no finally, exactly like a kill -9 from outside at that moment). The rank's thread and
# the committer's thread both make events: the count is taken under a lock, so no event is lost or counted
# twice whichever thread makes it, and the run always reaches the last event the clean run counted.
CHILD = r"""
import os, signal, sys, threading
import workbench as wb
kill_at, events, counting = int(sys.argv[3]), [0], threading.Lock()

def counted(fn):
    def call(*args, **kwargs):
        with counting:
            events[0] += 1
            if events[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return call

for name in ("open", "pwrite", "copy_file_range", "ftruncate", "posix_fallocate", "fsync", "replace", "unlink"):
    setattr(os, name, counted(getattr(os, name)))
wb.convert(sys.argv[1], sys.argv[2], shard_size=sys.argv[4], quiet=True)
print("EVENTS", events[0])
"""


def run_child(source: Path, dest: Path, kill_at: int, shard_size: str = SHARD_SIZE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(source), str(dest), str(kill_at), shard_size],
        capture_output=True, text=True, timeout=120,
    )


def assert_nothing_incomplete_is_presented(dest: Path, clean: Path) -> None:
    """An index may only exist when every shard it names is complete; otherwise nothing opens as complete."""
    if (dest / INDEX).exists():
        for name in set(os.listdir(clean)) - {COMPLETE}:  # the record follows the index: it may not be there yet
            assert filecmp.cmp(clean / name, dest / name, shallow=False), f"{name} differs while the index exists"
        return
    with pytest.raises(CheckpointError):
        open_catalog(dest)
    assert not verify(dest).ok


def assert_same_files(dest: Path, clean: Path) -> None:
    assert sorted(os.listdir(dest)) == sorted(os.listdir(clean))
    for name in os.listdir(clean):
        assert filecmp.cmp(clean / name, dest / name, shallow=False), name


@pytest.fixture(scope="module")
def clean_run(llama_sample: Path, tmp_path_factory) -> tuple[Path, int]:
    """An uninterrupted conversion, and how many file-system events it takes (counted in a child)."""
    base = tmp_path_factory.mktemp("clean")
    counted = run_child(llama_sample, base / "counted", kill_at=-1)
    assert counted.returncode == 0, counted.stderr
    events = int(counted.stdout.split("EVENTS")[1])
    assert events > 3 * KILL_POINTS
    clean = base / "clean"
    wb.convert(llama_sample, clean, shard_size=SHARD_SIZE, quiet=True)
    assert_same_files(base / "counted", clean)
    return clean, events


def test_kill_9_at_any_point_then_resume_gives_identical_output(llama_sample: Path, tmp_path: Path, clean_run) -> None:
    clean, events = clean_run
    rng = random.Random(8)
    # Evenly spread points plus random ones, always including the first and the very last events.
    points = sorted({1, events, *range(2, events, max(1, events // 8)), *rng.sample(range(2, events), 4)})
    assert len(points) >= KILL_POINTS - 2
    for k in points:
        dest = tmp_path / f"kill-{k}"
        child = run_child(llama_sample, dest, kill_at=k)
        assert child.returncode == -signal.SIGKILL, (k, child.returncode, child.stderr[-400:])
        if dest.exists():
            assert_nothing_incomplete_is_presented(dest, clean)
        if (dest / INDEX).exists() and not (dest / MANIFEST).exists():
            # Killed after the commit (while releasing the lock): the output is complete; an unlocked lock
            # file may remain, which nothing reads as data and the next run ignores.
            (dest / LOCK).unlink(missing_ok=True)
            assert_same_files(dest, clean)
            continue
        report = wb.convert(llama_sample, dest, shard_size=SHARD_SIZE, quiet=True)
        assert report.index_written
        assert_same_files(dest, clean)  # no .partial, no manifest, no lock file left


# The child limits its own file size before converting. (A preexec_fn would run Python between fork and exec
# in a copy of pytest, whose other threads may hold locks the child then waits on forever.)
LIMITED_CHILD = r"""
import resource, signal, sys
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over-limit writes fail with EFBIG instead of killing
import workbench as wb
wb.convert(sys.argv[1], sys.argv[2], shard_size="400KB", quiet=True)
"""


def test_file_size_limit_fails_clearly_and_leaves_nothing_that_looks_complete(llama_sample: Path, tmp_path: Path, clean_run) -> None:
    clean, _ = clean_run
    dest = tmp_path / "out"
    child = subprocess.run([sys.executable, "-c", LIMITED_CHILD, str(llama_sample), str(dest), "300000"],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 1
    last = child.stderr.strip().splitlines()[-1]
    assert last.startswith("workbench.errors.PlanError: Cannot write the conversion into") and "file size limit" in last
    assert "EFBIG" not in last and "no index was written" in last
    assert not [n for n in os.listdir(dest) if n.endswith(".partial")]
    assert not (dest / INDEX).exists() and not (dest / ".workbench.lock").exists()
    assert_nothing_incomplete_is_presented(dest, clean)
    wb.convert(llama_sample, dest, shard_size="400KB", quiet=True)  # with room again, the same run finishes
    assert verify(dest).ok and open_catalog(dest).total_bytes == open_catalog(llama_sample).total_bytes


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True).returncode == 0


def test_disk_full_midway_on_a_small_filesystem(llama_sample: Path, tmp_path: Path, clean_run) -> None:
    clean, _ = clean_run
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "1m"):
        pytest.skip("cannot mount a small tmpfs here (needs root); the RLIMIT_FSIZE test covers the error path")
    try:
        dest = mnt / "out"
        plan = wb.plan(llama_sample, shard_size=SHARD_SIZE, dest=dest)
        assert plan.ok  # there was room when it was planned ...
        (mnt / "filler").write_bytes(b"\0" * 600_000)  # ... then something else took most of it
        with pytest.raises(PlanError, match="the disk is full") as caught:
            execute(plan, quiet=True)
        assert "no index was written" in str(caught.value) and "resume" in str(caught.value)
        written = os.listdir(dest)
        assert not [n for n in written if n.endswith(".partial")] and INDEX not in written
        assert any(n.startswith("model-") for n in written)  # the disk filled after some shards were committed
        assert_nothing_incomplete_is_presented(dest, clean)
        (mnt / "filler").unlink()
        report = wb.convert(llama_sample, dest, shard_size=SHARD_SIZE, quiet=True)
        assert report.kept  # finished shards were kept
        assert_same_files(dest, clean)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _change_source_at_commit(monkeypatch, source_file: Path, at_commit: int, how: str) -> None:
    # When the rank hands its file to the committer (on the rank's thread: the commit itself runs on another).
    real_commit = Committer.submit
    commits = [0]

    def commit(self, *args, **kwargs):
        commits[0] += 1
        if commits[0] == at_commit:
            if how == "touch":
                st = source_file.stat()
                os.utime(source_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            else:
                with open(source_file, "ab") as fh:
                    fh.write(b"\0" * 8)
        return real_commit(self, *args, **kwargs)

    monkeypatch.setattr(Committer, "submit", commit)


@pytest.mark.parametrize(("at_commit", "how", "when"), [(1, "touch", "committing"), (7, "grow", "writing the index")])
def test_source_changing_during_the_run_is_detected(llama_sample: Path, tmp_path: Path, monkeypatch, at_commit, how, when) -> None:
    source = tmp_path / "src"
    shutil.copytree(llama_sample, source)
    dest = tmp_path / "out"
    _change_source_at_commit(monkeypatch, source / "model-00001-of-00003.safetensors", at_commit, how)
    with pytest.raises(PlanError, match="the source changed during the conversion") as caught:
        wb.convert(source, dest, shard_size=SHARD_SIZE, quiet=True)
    assert "model-00001-of-00003.safetensors" in str(caught.value) and when in str(caught.value)
    assert not (dest / INDEX).exists() and not [n for n in os.listdir(dest) if n.endswith(".partial")]
    monkeypatch.undo()
    if how == "grow":
        return  # the source is now a damaged file: nothing more to convert
    # Shards made from the old bytes are never resumed from: the source's mtime is part of the plan.
    again = wb.plan(source, shard_size=SHARD_SIZE, dest=dest)
    assert not again.ok and "different plan" in again.errors[0].message
    wb.convert(source, dest, shard_size=SHARD_SIZE, quiet=True, overwrite=True)
    assert verify(dest).ok


# -- re-running a conversion that already finished ---------------------------------------------------------------
def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {name: (os.stat(folder / name).st_ino, os.stat(folder / name).st_mtime_ns) for name in os.listdir(folder)}


@pytest.mark.parametrize(("to", "shard_size"), [("safetensors", SHARD_SIZE), ("safetensors", "5GB"), ("dcp", "5GB")])
def test_rerunning_a_finished_conversion_is_a_no_op(llama_sample: Path, tmp_path: Path, to: str, shard_size: str) -> None:
    dest = tmp_path / "out"
    first = wb.convert(llama_sample, dest, shard_size=shard_size, to=to, quiet=True)
    assert not first.already_complete
    before = _snapshot(dest)
    again = wb.convert(llama_sample, dest, shard_size=shard_size, to=to, quiet=True, verify=True)
    assert again.already_complete and again.ok and again.verified
    assert "already complete, nothing to do" in again.summary().lower()
    assert again.bytes_written == 0 and _snapshot(dest) == before  # not one file touched
    plan = wb.plan(llama_sample, dest=dest, shard_size=shard_size, to=to)
    assert plan.ok and plan.complete and "already complete, nothing to do" in plan.summary()
    # Another plan into the same finished folder is still refused, naming why.
    with pytest.raises(PlanError, match="holds a finished conversion of a different plan"):
        wb.convert(llama_sample, dest, shard_size=shard_size, to=to, dtype="bf16", quiet=True)
    from workbench import mapper as M

    same_bytes_other_mapper = M.Rename("model.norm.weight", "model.norm.weight")
    with pytest.raises(PlanError, match="different plan"):
        wb.convert(llama_sample, dest, same_bytes_other_mapper, shard_size=shard_size, to=to, quiet=True)
    assert _snapshot(dest) == before


def test_no_op_from_the_cli_and_what_breaks_it(llama_sample: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    command = [sys.executable, "-m", "workbench", "convert", str(llama_sample), str(dest), "--shard-size", SHARD_SIZE, "--quiet"]
    assert subprocess.run(command, capture_output=True, text=True, timeout=120).returncode == 0
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Already complete, nothing to do" in done.stdout and "destination not empty" not in done.stderr
    other = subprocess.run([*command, "--dtype", "fp16"], capture_output=True, text=True, timeout=120)
    assert other.returncode == 2 and "finished conversion of a different plan" in other.stderr
    # A shard removed from the finished output: the same conversion writes it again (a resume, not a no-op).
    shard = sorted(n for n in os.listdir(dest) if n.endswith(".safetensors"))[2]
    reference = (dest / shard).read_bytes()
    os.unlink(dest / shard)
    report = wb.convert(llama_sample, dest, shard_size=SHARD_SIZE, quiet=True)
    assert not report.already_complete and shard not in report.kept and (dest / shard).read_bytes() == reference
    # A config edited in the source after the run: copied again.
    source = tmp_path / "source"
    shutil.copytree(llama_sample, source)
    wb.convert(source, tmp_path / "second", shard_size=SHARD_SIZE, quiet=True)
    (source / "config.json").write_text((source / "config.json").read_text().replace("}", ', "edited": true}', 1))
    report = wb.convert(source, tmp_path / "second", shard_size=SHARD_SIZE, quiet=True)
    assert not report.already_complete and (tmp_path / "second" / "config.json").read_text() == (source / "config.json").read_text()
    assert verify(tmp_path / "second").ok
