"""Leaving the `workbench` process without the interpreter's tear-down once nothing is left to do.

At exit Python frees every module and object one by one and runs several garbage collections over them:
30-60 ms of a `workbench convert` that copies 1 GiB in under a second (the file it wrote is already synced
and renamed by then). `exit_now` flushes the standard streams and ends the process at once, but only when
no exit work is registered: no `atexit` callback (logging's flush, coverage, a profiler, a caller's handler), no thread
the interpreter would wait for (a non-daemon one) still alive, no `threading` exit hook (thread pools). Otherwise it exits the ordinary way.
Only the process entry points (`python -m workbench`, the console script) call it; `cli.main` itself
returns its status, so code calling `main()` keeps running.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def _quiet_exit_possible() -> bool:
    """True when leaving without tear-down skips nothing anyone registered."""
    if atexit._ncallbacks():  # noqa: SLF001 - the only way to ask whether exit callbacks are registered
        return False
    main = threading.main_thread()
    if any(thread is not main and not thread.daemon for thread in threading.enumerate()):
        return False  # the interpreter would wait for it (daemon threads it abandons either way)
    return not getattr(threading, "_threading_atexits", None)  # concurrent.futures' pools register here


def exit_now(status: int | None) -> None:
    """End the process with `status` (0 for None), skipping the interpreter's tear-down where that is safe."""
    code = 0 if status is None else int(status)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken stream: let the ordinary exit report it
        raise SystemExit(code) from None
    if not _quiet_exit_possible():
        raise SystemExit(code)
    os._exit(code)


__all__ = ["exit_now"]
