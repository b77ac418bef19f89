"""A torch-free stand-in for torchrun on one machine: `python -m workbench.launch.local_run N JOBDIR`.

Conversion workers need no process group: ranks own whole output files and meet through status files
in the job folder. What torchrun adds on one machine is start-up (its agent imports torch and
rendezvous, about 1.6 s here, more than converting a 1 GB shard). This starts the N workers directly
with torchrun's environment variables and keeps its failure behaviour: when one worker fails the
others are stopped, SIGTERM and SIGINT are passed on, and the exit code is non-zero.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

WORKER_MODULE = "workbench.launch.worker"


def worker_env(rank: int, world: int) -> dict[str, str]:
    """The environment torchrun would give rank `rank` of a one-node job of `world` processes."""
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world))
    return env


def run_workers(world: int, jobdir: str) -> int:
    """Start `world` workers on `jobdir`, wait for all; 0 only when every worker exited with 0."""
    workers: dict[int, subprocess.Popen] = {}
    stopped: list[int] = []

    def pass_on(signum: int, _frame: object) -> None:
        stopped.append(signum)
        for worker in workers.values():
            if worker.returncode is None:
                worker.send_signal(signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    for rank in range(world):
        if stopped:
            break
        # close_fds=False: the workers too hold the destination lock the launcher passed down.
        process = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, jobdir], env=worker_env(rank, world),
                                   close_fds=False)
        workers[process.pid] = process
    exit_code = 1 if stopped else 0
    running = set(workers)
    while running:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid not in running:
            continue
        running.discard(pid)
        workers[pid].returncode = code = os.waitstatus_to_exitcode(status)
        if code != 0 and exit_code == 0:
            exit_code = 1
            for other in running:  # like torchrun: one failure stops the job
                os.kill(other, signal.SIGTERM)
    return exit_code


def main(argv: list[str] | None = None) -> int:
    """Entry point: `N JOBDIR`."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[0].isdigit() or int(args[0]) < 1:
        print("usage: python -m workbench.launch.local_run NPROC JOBDIR (started by workbench's launcher)",
              file=sys.stderr)
        return 2
    return run_workers(int(args[0]), args[1])


if __name__ == "__main__":
    sys.exit(main())
