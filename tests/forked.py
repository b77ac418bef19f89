"""Run a child's Python code in a process forked from a server that has the workbench imported already.

Tests that kill their child (kill -9 at every commit point) start it many times; `python -c CODE` re-imports
workbench, numpy and friends every time (about a second each). multiprocessing's forkserver imports them once in a
single-threaded server of its own and forks each child from it, so a child starts with them loaded. Forking
pytest itself instead would copy its threads' held locks (pytest-xdist's channel thread), which the child could
then wait on forever; the server has no other threads.

    done = run_code(CODE, ["arg1", "arg2"], timeout=120)   # CODE sees sys.argv[1:] == ["arg1", "arg2"]
    done.returncode, done.stdout, done.stderr              # as subprocess.run(..., capture_output=True, text=True)
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = ["workbench", "forked"]
_CONTEXT: list[multiprocessing.context.BaseContext] = []


def _context() -> multiprocessing.context.BaseContext:
    if not _CONTEXT:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _CONTEXT.append(context)
    return _CONTEXT[0]


def _child(code: str, argv: list[str], out: str, err: str) -> None:
    """In the forked child: stdout/stderr to files, then CODE as `python -c` would run it."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the child's whole life
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    sys.argv = ["-c", *argv]
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit.code if isinstance(exit.code, int) else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_code(code: str, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run CODE with `sys.argv[1:] == argv` in a child forked from the preloaded server (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="workbench-forked-") as tmp:
        out, err = str(Path(tmp) / "stdout"), str(Path(tmp) / "stderr")
        process = _context().Process(target=_child, args=(code, [str(a) for a in argv], out, err))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(["forked", *argv], timeout)
        read = lambda path: Path(path).read_text() if os.path.exists(path) else ""  # noqa: E731
        return subprocess.CompletedProcess(["forked", *argv], process.exitcode, read(out), read(err))
