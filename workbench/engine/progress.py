"""Progress of a conversion in output bytes: a tqdm bar, a callback, and JSON lines from workers.

Workers print one JSON object per line (`{"workbench": "progress", "rank": r, "done": d, "total": t}`)
on stdout; the launcher parses them, calls `on_progress(rank, done, total)` and drives one bar for
the whole job. Updates are throttled so millions of tiny tensors do not cost millions of callbacks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

from .status import Cancelled

ProgressCallback = Callable[[int, int, int], object]
PROGRESS_TAG = "workbench"
MIN_INTERVAL = 0.1


def make_bar(total: int, *, desc: str = "convert"):
    """A tqdm.auto bar counting bytes (a widget in notebooks, a line in terminals)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=True)


def in_jupyter_kernel() -> bool:
    """True when running inside a Jupyter (ipykernel) kernel."""
    if "ipykernel" not in sys.modules or "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def progress_line(rank: int, done: int, total: int, event: str = "progress") -> str:
    """One machine-readable progress line (what workers print)."""
    return json.dumps({PROGRESS_TAG: event, "rank": rank, "done": done, "total": total}) + "\n"


def parse_progress_line(line: str) -> dict | None:
    """The progress record in a worker output line, or None for any other line."""
    line = line.strip()
    if not line.startswith("{") or PROGRESS_TAG not in line:
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and PROGRESS_TAG in record else None


class Progress:
    """One rank's progress sink: optional bar, optional callback, optional JSON lines on stdout."""

    def __init__(
        self,
        total: int,
        *,
        rank: int = 0,
        bar: bool = False,
        callback: ProgressCallback | None = None,
        json_lines: bool = False,
    ) -> None:
        self.total = total
        self.rank = rank
        self.done = 0
        self._callback = callback
        self._json = json_lines
        self._bar = make_bar(total) if bar else None
        self._shown = 0
        self._last = 0.0
        self._waiting = False
        self._remote = sys.modules.get("workbench.formats.remote_limits")  # loaded only when a source is remote
        if self._bar is not None and self._remote is not None:
            self._remote.set_wait_hook(self._show_wait)

    def _show_wait(self, host: str, seconds: float) -> None:
        """A remote read has had no data for a while: say so on the bar until bytes move again."""
        bar = self._bar
        if bar is not None:
            bar.set_postfix_str(f"waiting for {host} ({seconds:.0f} s without data)")
            self._waiting = True

    def update(self, done: int, *, force: bool = False) -> None:
        """Record that `done` bytes of `total` are produced; reports at most every MIN_INTERVAL s."""
        self.done = done
        now = time.monotonic()
        if not force and now - self._last < MIN_INTERVAL:
            return
        self._last = now
        if self._bar is not None and done > self._shown:
            if self._waiting:
                self._waiting = False
                self._bar.set_postfix_str("", refresh=False)
            self._bar.update(done - self._shown)
            self._shown = done
        if self._callback is not None and self._callback(self.rank, done, self.total) is False:
            self._callback = None
            raise Cancelled(
                "Cannot finish the conversion: it was cancelled (on_progress returned False). No index was written "
                "and temporary files were removed; run it again to resume (finished shards are kept)."
            )
        if self._json:
            os.write(1, progress_line(self.rank, done, self.total).encode())

    def close(self) -> None:
        """Report the final count and close the bar."""
        self.update(self.done, force=True)
        if self._bar is not None:
            if self._remote is not None:
                self._remote.set_wait_hook(None)
            self._bar.close()
            self._bar = None
