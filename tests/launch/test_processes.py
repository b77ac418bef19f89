"""What a launcher signals: only processes it started, never a process group it did not create.

A test run started from a non-interactive parent (`make test` under CI: no job control) shares one process group
with make and pytest; a SIGINT reaching that group ends pytest as "interrupted" (exit status 2). These tests run
conversions the way the suite does, beside a sentinel process that logs every signal reaching it:
- the sentinel shares the process group of a driver that runs 2-rank conversions (to the end, cancelled, failing,
  a rank killed, the launcher interrupted as Ctrl-C would, torchrun cancelled): nothing may reach that group;
- the sentinel holds a pid that a worker's start line names, as when a worker ended and its pid was handed to
  another process (pids wrap at 32768 here): a cancel must not signal it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from workbench.engine import Cancelled
from workbench.launch import Launch

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]

# Logs the name of every catchable signal that reaches it, one a line, and goes on; READY once listening.
SENTINEL = r"""
import signal, sys
log = sys.argv[1]

def note(signum, frame):
    with open(log, "a") as fh:
        fh.write(signal.Signals(signum).name + "\n")

for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGALRM, signal.SIGPIPE):
    signal.signal(sig, note)
print("READY", flush=True)
while True:
    signal.pause()
"""

# Started as a session (and group) leader, like pytest under make without job control. Its sentinel shares its
# group; every conversion it runs must leave that group alone. Prints the sentinel's log at the end.
DRIVER = r"""
import os, signal, subprocess, sys, time
import workbench as wb
from workbench.errors import WorkbenchError
from workbench.launch import Launch

source, out, log, sentinel_code = sys.argv[1:5]
sentinel = subprocess.Popen([sys.executable, "-c", sentinel_code, log], stdout=subprocess.PIPE, text=True)
assert sentinel.stdout.readline().strip() == "READY"
assert os.getpgid(sentinel.pid) == os.getpgrp() == os.getpid(), "the sentinel must share this run's group"

def run(name, launcher="local", on_progress=None, env=None, **options):
    os.environ.pop("WORKBENCH_FAIL_RANK", None)
    os.environ.pop("WORKBENCH_KILL_RANK", None)
    os.environ.update(env or {})
    plan = wb.plan(source, dest=os.path.join(out, name), shard_size="100KB", nproc=2, **options)
    launch = Launch(plan, quiet=True, launcher=launcher, on_progress=on_progress and on_progress(lambda: launch))
    try:
        launch.start().wait()
        return "ok"
    except WorkbenchError as exc:
        return type(exc).__name__

def cancel(_launch):
    return lambda rank, done, total: False

def interrupt(launch):  # what Ctrl-C in a terminal sends the launcher's foreground group
    sent = []
    def on_progress(rank, done, total):
        if not sent:
            sent.append(os.killpg(launch().process.pid, signal.SIGINT))
    return on_progress

slow = {"dtype": "bf16", "chunk_size": "16B"}
outcomes = [
    run("done"),
    run("cancelled", on_progress=cancel, **slow),
    run("failed", env={"WORKBENCH_FAIL_RANK": "1"}),
    run("killed", env={"WORKBENCH_KILL_RANK": "1"}),
    run("interrupted", on_progress=interrupt, **slow),
    run("torchrun-cancelled", launcher="torchrun", on_progress=cancel, **slow),
]
sentinel.send_signal(signal.SIGUSR1)  # the control: what reaches the sentinel does show in its log
deadline = time.monotonic() + 30
while "SIGUSR1" not in (open(log).read() if os.path.exists(log) else ""):
    assert time.monotonic() < deadline, "the sentinel logged nothing"
    time.sleep(0.01)
alive = sentinel.poll() is None
sentinel.kill()
sentinel.wait()
print(outcomes, alive, repr(open(log).read()))
"""


def _start_tick(pid: int) -> int:
    """The kernel's start tick of process `pid` (field 22 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        return int(fh.read().rsplit(")", 1)[-1].split()[19])


def _sentinel(log: Path) -> subprocess.Popen:
    """A sentinel in a session of its own: a signal the code under test sends it by mistake hits nothing else."""
    sentinel = subprocess.Popen([sys.executable, "-c", SENTINEL, str(log)], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    assert sentinel.stdout.readline().strip() == "READY"
    return sentinel


def test_conversions_never_signal_the_process_group_of_the_run_that_started_them(llama_sample: Path, tmp_path: Path) -> None:
    log = tmp_path / "group-signals.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", DRIVER, str(llama_sample), str(tmp_path / "out"), str(log), SENTINEL],
                          capture_output=True, text=True, timeout=240, env=env, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes, alive, seen = done.stdout.strip().splitlines()[-1].rsplit(" ", 2)
    assert outcomes == "['ok', 'Cancelled', 'PlanError', 'PlanError', 'PlanError', 'Cancelled']"
    assert alive == "True" and seen == repr("SIGUSR1\n")  # only the control signal reached the group


def test_a_cancel_never_signals_a_process_that_took_an_ended_workers_pid(llama_sample: Path, tmp_path: Path) -> None:
    log = tmp_path / "signals.log"
    sentinel = _sentinel(log)
    try:
        started = _start_tick(sentinel.pid)
        plan = wb.plan(llama_sample, dest=tmp_path / "out", shard_size="100KB", nproc=2, dtype="bf16", chunk_size="16B")
        replayed: list[int] = []

        def stop(rank: int, done: int, total: int) -> bool:
            if not replayed:  # the start line of a worker that has ended; its pid now names the sentinel
                replayed.append(sentinel.pid)
                launch._handle({"workbench": "start", "rank": 2, "pid": sentinel.pid, "started": started - 1}, None)
            return False

        launch = Launch(plan, quiet=True, on_progress=stop, launcher="local").start()
        with pytest.raises(Cancelled):
            launch.wait()
        assert replayed and launch.worker_pids[2] == sentinel.pid
        assert sentinel.poll() is None, "the launcher killed a process it did not start"
        assert not log.exists() or log.read_text() == "", log.read_text()
    finally:
        sentinel.kill()
        sentinel.wait()
    assert (tmp_path / "out").exists() and not list((tmp_path / "out").glob("*.partial"))


def test_start_time_tells_a_running_process_from_an_ended_one() -> None:
    from workbench.launch.processes import is_running, start_time

    assert start_time() == start_time(os.getpid()) == _start_tick(os.getpid())
    assert is_running(os.getpid(), start_time()) and not is_running(os.getpid(), start_time() - 1)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert start_time(child.pid) is None  # reaped: no such process
