"""Issue 29 D18, the launcher's leftovers: the run report's rank balance when a rank idles, the lock
message after the launcher was killed (it names the live workers that hold the lock), and the
`workbench-job-*` folders of dead launchers (removed by the next launch)."""

from __future__ import annotations

from pathlib import Path

from workbench.engine.report import RankResult, RunReport


def report(*ranks: tuple[int, float]) -> RunReport:
    results = [RankResult(rank=i, bytes_written=written, seconds=seconds) for i, (written, seconds) in enumerate(ranks)]
    return RunReport(dest=Path("out"), ranks=results, seconds=1.0, predicted_peak_bytes=0, predicted_files=[],
                     predicted_bytes_read=0, predicted_bytes_written=0, files=[], launcher="local")


def test_an_idle_rank_is_named_not_an_infinite_ratio() -> None:
    line = report((1000, 2.0), (0, 0.1)).summary()
    assert "inf" not in line
    assert "rank balance: rank 1 of 2 wrote nothing" in line and "smaller --nproc" in line
    line = report((1000, 2.0), (500, 1.0), (0, 0.1), (0, 0.1)).summary()
    assert "ranks 2, 3 of 4 wrote nothing" in line and "among the others (largest / smallest): bytes written 2.00x, seconds 2.00x" in line
    assert "rank balance (largest / smallest rank): bytes written 1.25x, seconds 1.50x" in report((1000, 3.0), (800, 2.0)).summary()
    assert "inf" not in report((1000, 0.0), (800, 0.0)).summary()


# ------------------------------------------------------------- a launcher killed with SIGKILL

import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# A launcher in miniature: takes the destination lock and makes its job folder, starts one "worker" that
# inherits both descriptors (as the real launcher's pass_fds do), prints the worker's pid, then dies by SIGKILL.
KILLED_LAUNCHER = """
import os, signal, subprocess, sys
from workbench.launch.jobdir import make_jobdir
from workbench.output.lock import DestinationLock
lock = DestinationLock(sys.argv[1]).acquire()
folder, job_lock = make_jobdir()
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(lock.fileno(), job_lock),
                          start_new_session=True)
print(worker.pid, folder, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(") ", 1)[-1][:1] != "Z"
    except OSError:
        return False


@pytest.fixture
def killed_launcher(tmp_path: Path):
    """(destination, the orphaned worker's pid, its job folder) after the launcher was killed; the worker is
    stopped at the end by its pid."""
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PYTHONPATH": str(REPO)}
    (tmp_path / "tmp").mkdir()
    dest = tmp_path / "out"
    launcher = subprocess.run([sys.executable, "-c", KILLED_LAUNCHER, str(dest)], capture_output=True, text=True,
                              env=env, timeout=60)
    assert launcher.returncode == -signal.SIGKILL, launcher.stderr
    pid_text, folder = launcher.stdout.split()
    worker = int(pid_text)
    try:
        yield dest, worker, Path(folder)
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.01)


def test_the_lock_message_names_the_orphaned_workers(killed_launcher) -> None:
    from workbench.errors import PlanError
    from workbench.output.lock import DestinationLock, holder

    dest, worker, _ = killed_launcher
    with pytest.raises(PlanError, match=rf"which has exited, but processes it started still hold the lock: pid {worker} "
                                        rf".*\(kill {worker}\)"):
        DestinationLock(dest).acquire()
    assert f"pid {worker} (" in holder(dest)


def test_job_folders_of_dead_launchers_are_swept_and_live_ones_kept(killed_launcher, tmp_path: Path) -> None:
    from workbench.launch.jobdir import sweep_stale_jobs

    dest, worker, folder = killed_launcher
    assert folder.parent == tmp_path / "tmp" and folder.is_dir()
    assert sweep_stale_jobs(folder.parent) == []  # its worker still runs: kept
    os.kill(worker, signal.SIGKILL)
    while alive(worker):
        time.sleep(0.01)
    assert sweep_stale_jobs(folder.parent) == [folder] and not folder.exists()


def test_a_launch_removes_a_dead_launchers_job_folder(killed_launcher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from safetensors.numpy import save_file

    import workbench as wb

    _, worker, folder = killed_launcher
    os.kill(worker, signal.SIGKILL)
    while alive(worker):
        time.sleep(0.01)
    monkeypatch.setattr(tempfile, "tempdir", str(folder.parent))
    source = tmp_path / "src"
    source.mkdir()
    save_file({f"t{i}": np.full(1000, i, np.float32) for i in range(4)}, str(source / "model.safetensors"))
    wb.convert(source, tmp_path / "converted", nproc=2, shard_size="8KB", quiet=True)
    assert os.listdir(folder.parent) == []  # the dead launcher's folder, and this run's own, are gone


def test_a_job_folder_being_made_is_not_swept(tmp_path: Path) -> None:
    """Between creating its owner lock and locking it, a new job folder's lock file is empty and unlocked: a
    concurrent sweep must keep it (it is being made, its owner is not dead)."""
    from workbench.launch.jobdir import JOB_PREFIX, OWNER_LOCK, sweep_stale_jobs

    folder = tmp_path / f"{JOB_PREFIX}new"
    folder.mkdir()
    (folder / OWNER_LOCK).touch()  # created, not yet locked nor written
    assert sweep_stale_jobs(tmp_path) == [] and folder.is_dir()
    (folder / OWNER_LOCK).write_text("12345\n")  # a written owner that holds no lock: dead
    assert sweep_stale_jobs(tmp_path) == [folder]
