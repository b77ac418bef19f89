"""Leaving the `workbench` process without the interpreter's tear-down once nothing is left to do.

At exit Python frees every module and object one by one and runs several garbage collections over them:
30-60 ms of a `workbench convert` that copies 1 GiB in under a second (the files it wrote are already synced
and renamed by then). `exit_now` flushes the standard streams and ends the process at once, but only when
nothing else could want the interpreter afterwards: it was started for this command (`python -m workbench`,
or the console script calling `cli.entry`, with no other Python code around it: not under `cProfile`,
`runpy.run_module` from a script, a tracer or a profiler), no `atexit` callback is registered (logging's flush,
coverage, a caller's handler), no non-daemon thread is alive and no `threading` exit hook (thread pools) is
set. Otherwise it exits the ordinary way. `cli.main` itself always returns its status.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from types import FrameType

_RUNPY_MAIN = ("_run_code", "_run_module_as_main")  # what `python -m` runs a module's code under


def _started_for_this(caller: FrameType | None) -> bool:
    """True when the frames above `caller` are only `python -m`'s own (runpy's), or a console script's module."""
    above = []
    frame = caller.f_back if caller is not None else None
    while frame is not None:
        above.append(frame)
        frame = frame.f_back
    if all(f.f_globals.get("__name__") == "runpy" and f.f_code.co_name in _RUNPY_MAIN for f in above):  # runpy may be frozen
        return True
    return len(above) == 1 and above[0].f_code.co_name == "<module>"  # bin/workbench: sys.exit(entry())


def _quiet_exit_possible(caller: FrameType | None) -> bool:
    """True when leaving without tear-down skips nothing anyone registered or runs after us."""
    if sys.gettrace() is not None or sys.getprofile() is not None or not _started_for_this(caller):
        return False
    if atexit._ncallbacks():  # noqa: SLF001 - the only way to ask whether exit callbacks are registered
        return False
    main = threading.main_thread()
    if any(thread is not main and not thread.daemon for thread in threading.enumerate()):
        return False  # the interpreter would wait for it (daemon threads it abandons either way)
    return not getattr(threading, "_threading_atexits", None)  # concurrent.futures' pools register here


def exit_now(status: int | None) -> None:
    """End the process with `status` (0 for None), skipping the interpreter's tear-down where that is safe
    (see the module's text); otherwise raise SystemExit(status) as `sys.exit` does."""
    code = 0 if status is None else int(status)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken stream: let the ordinary exit report it
        raise SystemExit(code) from None
    if not _quiet_exit_possible(sys._getframe(1)):  # noqa: SLF001 - who called us decides whether we may
        raise SystemExit(code)
    os._exit(code)


__all__ = ["exit_now"]
