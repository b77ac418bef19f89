"""One conversion per destination: a second one is refused, naming the run that holds the lock."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from workbench.cli import main as cli_main
from workbench.conversion import execute
from workbench.errors import PlanError
from workbench.explore.verify import verify
from workbench.launch import Launch
from workbench.output.lock import LOCK_NAME, DestinationLock, holder

# A conversion that pauses as it hands its first finished file to the committer, until the test writes a line
# to its stdin. There nothing of it moves: the main thread waits here and the committer thread (started by this
# first hand-over) and copy lanes do not run, so the destination's listing holds still while the test looks.
# (Pausing at a progress report instead raced: a file committed just before the report was still being renamed
# from .partial on the committer's thread while the test listed the folder twice.)
PAUSED_CONVERSION = r"""
import sys, threading
import workbench as wb
from workbench.engine.committer import Committer
source, dest = sys.argv[1:3]
submit = Committer.submit
paused = []

def pause_then_submit(self, name, writer):
    if not paused:
        paused.append(name)
        others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        print("RUNNING" if not others else f"OTHER THREADS {others}", flush=True)
        sys.stdin.readline()
    submit(self, name, writer)

Committer.submit = pause_then_submit
wb.convert(source, dest, shard_size="300KB", quiet=True)
print("DONE", flush=True)
"""


def _wait_for(process: subprocess.Popen, word: str) -> None:
    line = process.stdout.readline()
    assert word in line, (line, process.stderr.read() if process.poll() is not None else "")


def test_second_conversion_is_refused_while_one_runs(llama_sample: Path, tmp_path: Path, capsys) -> None:
    dest = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-c", PAUSED_CONVERSION, str(llama_sample), str(dest)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(first, "RUNNING")
        who = f"pid {first.pid} on host {socket.gethostname()}"
        assert holder(dest).startswith(who)
        # Planned now, the destination check names the running conversion ...
        with pytest.raises(PlanError, match=f"another conversion is writing there \\({who}") as caught:
            wb.convert(llama_sample, dest, shard_size="300KB", quiet=True)
        assert str(dest) in str(caught.value)
        # ... and a plan made before it started is refused by the lock itself, before touching anything.
        before = sorted(os.listdir(dest))
        stale_plan = _plan_ignoring_the_lock(llama_sample, dest)
        with pytest.raises(PlanError, match=f"another conversion is writing there \\({who}"):
            execute(stale_plan, quiet=True)
        launch = Launch(_plan_ignoring_the_lock(llama_sample, dest, nproc=2), quiet=True)
        with pytest.raises(PlanError, match="another conversion is writing there"):
            launch.start()
        assert launch.process is None  # no worker was started
        assert sorted(os.listdir(dest)) == before
        assert cli_main(["convert", str(llama_sample), str(dest), "--shard-size", "300KB", "--quiet"]) == 2
        assert f"another conversion is writing there ({who}" in capsys.readouterr().err
    finally:
        out, err = first.communicate("go\n", timeout=60)  # the paused run goes on
    assert first.returncode == 0 and "DONE" in out, err
    assert verify(dest).ok and not (dest / LOCK_NAME).exists()


def _plan_ignoring_the_lock(source: Path, dest: Path, nproc: int = 1):
    """A plan made as if the lock were free (what a run planned a moment before the other started sees)."""
    import workbench.planning.destination as destination

    real = destination.holder
    destination.holder = lambda dest: None
    try:
        plan = wb.plan(source, shard_size="300KB", dest=dest, nproc=nproc)
    finally:
        destination.holder = real
    assert plan.ok, plan.problems
    return plan


def test_lock_of_a_killed_run_does_not_block_the_next(llama_sample: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    code = f"from workbench.output.lock import lock_destination; lock_destination({str(dest)!r}); print('LOCKED', flush=True); input()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    _wait_for(child, "LOCKED")
    assert holder(dest) is not None
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert (dest / LOCK_NAME).exists() and holder(dest) is None  # the kernel dropped the lock with the process
    report = wb.convert(llama_sample, dest, shard_size="300KB", quiet=True)
    assert report.index_written and not (dest / LOCK_NAME).exists()


def test_lock_records_its_holder_and_is_exclusive(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    assert holder(dest) is None
    with DestinationLock(dest) as lock:
        assert lock.held and (dest / LOCK_NAME).exists()
        assert holder(dest).startswith(f"pid {os.getpid()} on host ")
        # Another open file description of the same file is refused at once (a blocking wait would hang here).
        with pytest.raises(PlanError, match=f"pid {os.getpid()}"):
            DestinationLock(dest).acquire()
    assert not (dest / LOCK_NAME).exists() and holder(dest) is None


def test_acquire_retries_when_the_file_it_opened_was_removed(tmp_path: Path, monkeypatch) -> None:
    """A run that opened the lock file just before the holder removed it must not lock the dead file."""
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / LOCK_NAME).write_text("{}")
    real_flock = fcntl.flock
    calls = []

    def flock(fd, operation):
        calls.append(operation)
        if len(calls) == 1:  # the previous holder finishes between our open and our flock
            os.unlink(dest / LOCK_NAME)
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    lock = DestinationLock(dest).acquire()
    monkeypatch.undo()
    try:
        assert len(calls) == 2  # the first lock was on a removed file, so it tried again
        assert os.fstat(lock._fd).st_ino == os.stat(dest / LOCK_NAME).st_ino
    finally:
        lock.release()
