"""Running a plan on N local processes (torchrun, or the torch-free local launcher), watching progress,
and cancelling cleanly.

`Launch(plan).start()` prepares the destination, writes the job, and starts
`python -m workbench.launch.local_run N JOBDIR` (the default, "auto"; torch-free) or, with
`launcher="torchrun"`, `python -m torch.distributed.run --standalone --nproc-per-node N -m
workbench.launch.worker JOBDIR`: the same workers.
`wait()` turns the workers' JSON lines into `on_progress(rank, done, total)` calls (in the caller's
thread) and one tqdm bar, then collects each rank's status into a `RunReport`, or raises an error
naming the failed rank. `cancel()` (or `on_progress` returning False, or Ctrl-C) kills the launcher and
every worker, removes temporary files and writes no index.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from ..api_types import Launcher
from ..engine.finalize import prepare_destination, remove_partials, require_runnable
from ..engine.progress import PROGRESS_TAG, ProgressCallback, make_bar, parse_progress_line
from ..engine.report import RankResult, RunReport, remote_names
from ..engine.source_guard import snapshot_for
from ..engine.status import FINAL_FILE, JOB_FILE, Cancelled, failure_message, read_json, status_path
from ..errors import PlanError
from ..files import atomic_write
from ..output.lock import DestinationLock, lock_destination
from ..planning.model import Plan
from .job import job_for
from .jobdir import make_jobdir
from .launchers import LAUNCHERS, check_launcher
from .local_run import WORKER_MODULE
from .processes import is_running, signal_worker

KILL_GRACE_SECONDS = 5.0


def torchrun_command(nproc: int, jobdir: Path, python: str = sys.executable) -> list[str]:
    """The command line that starts the workers under torchrun."""
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", WORKER_MODULE, str(jobdir)]


def worker_command(launcher: str, nproc: int, jobdir: Path, python: str = sys.executable) -> list[str]:
    """The command line that starts the workers: torchrun's, or workbench's torch-free local one."""
    if resolve_launcher(launcher) == "local":
        return [python, "-m", "workbench.launch.local_run", str(nproc), str(jobdir)]
    return torchrun_command(nproc, jobdir, python)


def resolve_launcher(launcher: str) -> str:
    """The launcher that really starts the workers: "auto" means the local one.

    The workers use no process group, so on one machine torchrun's agent adds only its start-up (~1.6 s
    of importing torch). Multi-node jobs run in place under the user's own torchrun (see `launch.inplace`),
    never through this launcher, so "auto" has no multi-node case to send to torchrun.
    """
    check_launcher(launcher)
    return "local" if launcher == "auto" else launcher


class Launch:
    """A running multi-process conversion of one plan."""

    def __init__(self, plan: Plan, *, quiet: bool = False, on_progress: ProgressCallback | None = None,
                 env: dict[str, str] | None = None, launcher: Launcher = "auto") -> None:
        self.plan = plan
        self.launcher = resolve_launcher(launcher)
        self.quiet = quiet
        self.on_progress = on_progress
        self.env = env
        self.totals = {r: plan.rank_output_bytes(r) for r in range(plan.nproc)}
        self.done = dict.fromkeys(self.totals, 0)
        self.worker_pids: dict[int, int] = {}
        self.worker_started: dict[int, int | None] = {}  # each worker's start tick: its pid is signalled only while it runs
        self.jobdir: Path | None = None
        self.process: subprocess.Popen | None = None
        self._events: queue.Queue = queue.Queue()
        self._stderr_tail: deque[str] = deque(maxlen=40)
        self._other_lines: deque[str] = deque(maxlen=40)
        self._threads: list[threading.Thread] = []
        self._cancelled = threading.Event()
        self._started_at = 0.0
        self._lock: DestinationLock | None = None
        self._job_lock: int = -1

    def start(self) -> Launch:
        """Prepare the destination, write the job, start the workers."""
        require_runnable(self.plan)
        job = job_for(self.plan)
        snapshot_for(self.plan)
        self._lock = lock_destination(self.plan.dest)  # held until wait() cleans up
        try:
            prepare_destination(self.plan)
            self.jobdir, self._job_lock = make_jobdir()  # (removes the job folders of killed launchers first)
            atomic_write(self.jobdir / JOB_FILE, job.to_json())
            env = dict(os.environ if self.env is None else self.env)
            env["PYTHONUNBUFFERED"] = "1"
            env.setdefault("OMP_NUM_THREADS", "1")
            self._started_at = time.perf_counter()
            self.process = subprocess.Popen(
                worker_command(self.launcher, self.plan.nproc, self.jobdir), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=env, start_new_session=True, text=True, errors="replace",
                # The workers keep the destination locked, and their job folder owned, while they run.
                pass_fds=(self._lock.fileno(), self._job_lock),
            )
        except BaseException:
            self._cleanup()
            raise
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def _read_stdout(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            record = parse_progress_line(line)
            if record is None:
                self._other_lines.append(line.rstrip())
            else:
                self._events.put(record)

    def _read_stderr(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for line in self.process.stderr:
            self._stderr_tail.append(line.rstrip())

    def cancel(self) -> None:
        """Stop every process of the job (thread-safe); `wait()` then raises `Cancelled`."""
        self._cancelled.set()
        self._kill(signal.SIGTERM)

    def _kill(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for rank, pid in list(self.worker_pids.items()):  # torchrun's workers run in sessions of their own
            signal_worker(pid, self.worker_started.get(rank), sig)  # never a process that took an ended worker's pid

    def _handle(self, record: dict, bar) -> None:
        rank = int(record.get("rank", 0))
        if record[PROGRESS_TAG] == "start":
            started = record.get("started")
            self.worker_started[rank] = started if isinstance(started, int) else None
            self.worker_pids[rank] = int(record["pid"])
            if self._cancelled.is_set():
                self._kill(signal.SIGTERM)
            return
        self.done[rank] = int(record.get("done", 0))
        if bar is not None:
            bar.n = sum(self.done.values())
            bar.refresh()
        if self.on_progress is not None and self.on_progress(rank, self.done[rank], self.totals.get(rank, 0)) is False:
            self.cancel()

    def _pump(self, bar) -> None:
        assert self.process is not None
        while True:
            try:
                self._handle(self._events.get(timeout=0.05), bar)
            except queue.Empty:
                if self.process.poll() is not None and not any(t.is_alive() for t in self._threads):
                    break
        while not self._events.empty():
            self._handle(self._events.get_nowait(), bar)

    def _stop_hard(self) -> None:
        assert self.process is not None
        try:
            self.process.wait(timeout=KILL_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self._kill(signal.SIGKILL)
            self.process.wait()
        deadline = time.monotonic() + KILL_GRACE_SECONDS
        for rank, pid in list(self.worker_pids.items()):  # do not clean up under a still-writing worker
            started = self.worker_started.get(rank)
            while is_running(pid, started) and time.monotonic() < deadline:
                time.sleep(0.02)
            signal_worker(pid, started, signal.SIGKILL)

    def wait(self) -> RunReport:
        """Follow progress until the workers exit; return the report or raise naming the failed rank."""
        assert self.process is not None and self.jobdir is not None, "call start() first"
        bar = None if self.quiet else make_bar(sum(self.totals.values()))
        try:
            self._pump(bar)
        except BaseException:
            self.cancel()
            self._stop_hard()
            self._cleanup()
            raise
        finally:
            if bar is not None:
                bar.close()
        if self._cancelled.is_set():
            self._stop_hard()
        seconds = time.perf_counter() - self._started_at
        statuses = [read_json(status_path(self.jobdir, r)) for r in range(self.plan.nproc)]
        results = [RankResult.from_dict(s) for s in statuses if s is not None]
        final = read_json(self.jobdir / FINAL_FILE)
        finished = final is not None and final.get("ok") and self.process.returncode == 0
        try:
            if self._cancelled.is_set() and not finished:  # a cancel that came after the commit changes nothing
                raise Cancelled(
                    f"Cannot finish the conversion into {self.plan.dest}: it was cancelled. No index was written and "
                    "temporary files were removed; run it again to resume (finished shards are kept)."
                )
            if not finished:
                missing = [r for r, s in enumerate(statuses) if s is None]
                detail = f" ({self.launcher} exit code {self.process.returncode}{self._tail()})"
                if final is not None and final.get("error"):
                    detail = f"; finishing failed: {final['error']}"
                raise PlanError(failure_message(self.plan.dest, results, missing=missing, detail=detail))
        except BaseException:
            self._cleanup()
            raise
        self._cleanup(partials=False)
        return RunReport(
            dest=self.plan.dest, ranks=sorted(results, key=lambda r: r.rank), seconds=seconds,
            predicted_peak_bytes=self.plan.peak_bytes, predicted_files=self.plan.source_paths(),
            predicted_bytes_read=self.plan.bytes_read, predicted_bytes_written=self.plan.bytes_written,
            files=[f.name for f in self.plan.output_file_list] + (self.plan.commit_files if final.get("index_written") else []),
            kept=sorted(self.plan.kept), extras=list(self.plan.extras), index_written=bool(final.get("index_written")),
            launcher=self.launcher, **remote_names(self.plan),
        )

    def _tail(self) -> str:
        lines = [line for line in self._stderr_tail if line.strip()][-3:]
        return (": " + " | ".join(lines)) if lines else ""

    def _cleanup(self, *, partials: bool = True) -> None:
        if partials:
            remove_partials(self.plan)
        if self.jobdir is not None:
            shutil.rmtree(self.jobdir, ignore_errors=True)
        if self._job_lock >= 0:
            os.close(self._job_lock)
            self._job_lock = -1
        if self._lock is not None:
            self._lock.release()


def launch(plan: Plan, *, quiet: bool = False, on_progress: ProgressCallback | None = None,
           launcher: Launcher = "auto") -> RunReport:
    """Run `plan` on `plan.nproc` processes and wait for it."""
    return Launch(plan, quiet=quiet, on_progress=on_progress, launcher=launcher).start().wait()


__all__ = ["LAUNCHERS", "Launch", "launch", "resolve_launcher", "torchrun_command", "worker_command"]
