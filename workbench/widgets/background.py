"""`BackgroundTask`: run one long read (value stats, a histogram, a value diff, checksums) in a thread
with a progress bar, bytes done, speed, time left and a Cancel button, so the notebook stays usable.

The work is a function of one argument, a `ReadHook` (`workbench.explore.stats`): the chunked readers
call it with the bytes of each chunk they read. The hook moves the bar (at most every `UPDATE_SECONDS`)
and, once Cancel is clicked, raises `ReadCancelled`, which unwinds the read at its next chunk (files
are closed by the readers' `finally`). Reads larger than `confirm_above` wait for a "Read anyway" click.

Only widget values are set from the thread (never `with out:`); the kernel's main thread stays free to
handle the Cancel click, as for the RunPanel.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets

from ..display import format_bytes
from ..errors import WorkbenchError
from .common import labelled, message_html

LARGE_READ_BYTES = 1 << 30  # reads above this ask first
UPDATE_SECONDS = 0.1  # the bar and text change at most this often (each change is a message to the page)
BAR_STEPS = 1000  # the bar counts permille: byte counts of huge reads exceed what a slider trait should hold
IDLE, CONFIRM, RUNNING, CANCELLING, DONE, CANCELLED, FAILED = (
    "idle", "confirm", "running", "cancelling", "done", "cancelled", "failed")


class ReadCancelled(WorkbenchError):
    """A background read stopped because its Cancel button was clicked (or `cancel()` was called)."""


def format_seconds(seconds: float) -> str:
    """'0.4 s', '42 s', '3 min 05 s', '1 h 02 min': a duration as people read it."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def rate_text(done: int, total: int, elapsed: float) -> str:
    """'1.2 GiB of 3.9 GiB (31%) · 85.0 MiB/s · about 32 s left' (speed and time left once measurable)."""
    share = done / total if total else 0.0
    text = f"{format_bytes(done)} of {format_bytes(total)} ({share:.0%})"
    if elapsed > 0.2 and done > 0:
        speed = done / elapsed
        text += f" · {format_bytes(int(speed))}/s"
        if total > done:
            text += f" · about {format_seconds((total - done) / speed)} left"
    return text


class BackgroundTask(widgets.VBox):
    """A progress line for one background read at a time: `run(work, total_bytes=..., what=..., on_done=...)`.

    Shows nothing while idle. `state` is 'idle', 'confirm' (waiting for "Read anyway"), 'running',
    'cancelling', 'done', 'cancelled' or 'failed'; `result` / `error` hold the outcome, `done_bytes` the
    bytes read, `updates` each bytes count the bar showed (for tests: it only grows). `wait()` blocks.
    Controls: `bar`, `text`, `cancel_button`, `confirm_button`, `dismiss_button`.
    `on_state(callback)` calls `callback(running)` each time the state changes (from the read's thread when
    it ends): the owner disables the buttons that start reads while one runs, so reads go one at a time.
    """

    def __init__(self, *, confirm_above: int = LARGE_READ_BYTES) -> None:
        self.confirm_above = confirm_above
        self.state = IDLE
        self.what = ""
        self.total_bytes = 0
        self.done_bytes = 0
        self.updates: list[int] = []
        self.result: Any = None
        self.error: BaseException | None = None
        self._cancel = threading.Event()
        self._lock = threading.Lock()  # cancel() (the page's thread) must not overwrite the state of a read that ended
        self._thread: threading.Thread | None = None
        self._pending: tuple[Any, ...] | None = None
        self._started = 0.0
        self._shown_at = 0.0
        self._observers: list[Callable[[bool], None]] = []

        self.bar = labelled(widgets.IntProgress(value=0, min=0, max=BAR_STEPS, bar_style="info",
                                                layout=widgets.Layout(width="260px")), "wb-task-bar")
        self.text = labelled(widgets.HTML(), "wb-task-text")
        self.cancel_button = labelled(widgets.Button(description="Cancel", icon="stop", button_style="warning",
                                                     tooltip="stop reading (within a fraction of a second)",
                                                     layout=widgets.Layout(width="100px")), "wb-task-cancel")
        self.confirm_button = labelled(widgets.Button(description="Read anyway", icon="play", button_style="primary",
                                                      layout=widgets.Layout(width="130px")), "wb-task-confirm")
        self.dismiss_button = labelled(widgets.Button(description="Not now", layout=widgets.Layout(width="100px")), "wb-task-dismiss")
        self.running_row = widgets.HBox([self.bar, self.cancel_button])
        self.confirm_row = widgets.HBox([self.confirm_button, self.dismiss_button])
        super().__init__([self.running_row, self.confirm_row, self.text])
        self.add_class("wb-task")
        self.cancel_button.on_click(lambda _: self.cancel())
        self.confirm_button.on_click(lambda _: self.confirm())
        self.dismiss_button.on_click(lambda _: self.dismiss())
        self._show_rows()

    @property
    def running(self) -> bool:
        """True while a read is under way (including while it is being cancelled)."""
        return self.state in (RUNNING, CANCELLING)

    def _show_rows(self) -> None:
        self.running_row.layout.display = None if self.running else "none"
        self.confirm_row.layout.display = None if self.state == CONFIRM else "none"
        self.cancel_button.disabled = self.state != RUNNING
        self.cancel_button.button_style = "warning" if self.state == RUNNING else ""
        for callback in self._observers:
            callback(self.running)

    def on_state(self, callback: Callable[[bool], None]) -> None:
        """Call `callback(running)` now and after every change of state (start, cancel, end, confirm)."""
        self._observers.append(callback)
        callback(self.running)

    # --- starting -----------------------------------------------------------------------------------
    def run(
        self,
        work: Callable[[Callable[[int], None]], Any],
        *,
        total_bytes: int,
        what: str,
        on_done: Callable[[Any], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        confirmed: bool = False,
    ) -> bool:
        """Start `work(hook)` in a thread; True when started, False when it waits for confirmation or
        another read is running (the text says which). `on_done(result)` / `on_error(exc)` run in the thread
        when the work ends (not after a cancel)."""
        if self.running:
            self.text.value = message_html(f"Still reading {self.what}: wait for it or cancel it first.", "warning")
            return False
        job = (work, total_bytes, what, on_done, on_error)
        if total_bytes > self.confirm_above and not confirmed:
            self._pending = job
            self.what = what
            self.state = CONFIRM
            self.text.value = message_html(
                f"Reading {what} reads {format_bytes(total_bytes)} from disk, which can take minutes. "
                "It runs in the background with a Cancel button.", "warning")
            self._show_rows()
            return False
        self._start(*job)
        return True

    def confirm(self) -> bool:
        """Start the read that waits for confirmation (the "Read anyway" button)."""
        if self.state != CONFIRM or self._pending is None:
            return False
        job, self._pending = self._pending, None
        self._start(*job)
        return True

    def dismiss(self) -> None:
        """Forget the read that waits for confirmation (the "Not now" button)."""
        if self.state == CONFIRM:
            self._pending = None
            self.state = IDLE
            self.text.value = ""
            self._show_rows()

    def _start(self, work: Callable, total_bytes: int, what: str, on_done: Callable | None, on_error: Callable | None) -> None:
        self.what, self.total_bytes = what, max(int(total_bytes), 0)
        self.done_bytes = 0
        self.updates = []
        self.result = self.error = None
        self._cancel.clear()
        self.state = RUNNING
        self.bar.value = 0
        self.bar.bar_style = "info"
        self._started = self._shown_at = time.monotonic()
        self.text.value = message_html(f"Reading {what}: starting…")
        self._show_rows()
        self._thread = threading.Thread(target=self._main, args=(work, on_done, on_error), name="workbench-read", daemon=True)
        self._thread.start()

    # --- the thread ----------------------------------------------------------------------------------
    def _hook(self, nbytes: int) -> None:
        if self._cancel.is_set():
            raise ReadCancelled(f"Cannot finish reading {self.what}: it was cancelled after {format_bytes(self.done_bytes)}.")
        self.done_bytes += int(nbytes)
        now = time.monotonic()
        if now - self._shown_at >= UPDATE_SECONDS:
            self._shown_at = now
            self._show_progress(now)

    def _show_progress(self, now: float) -> None:
        total = max(self.total_bytes, 1)
        self.bar.value = min(BAR_STEPS, self.done_bytes * BAR_STEPS // total)
        self.updates.append(self.done_bytes)
        self.text.value = message_html(f"Reading {self.what}: {rate_text(self.done_bytes, self.total_bytes, now - self._started)}")

    def _main(self, work: Callable, on_done: Callable | None, on_error: Callable | None) -> None:
        try:
            result = work(self._hook)
        except ReadCancelled as exc:
            self.error = exc
            self._end(CANCELLED, f"Cancelled reading {self.what} after {format_bytes(self.done_bytes)} of "
                                 f"{format_bytes(self.total_bytes)}.", "warning")
            return
        except BaseException as exc:  # shown, handed to on_error, re-raised by wait()
            self.error = exc
            text = exc.message if isinstance(exc, WorkbenchError) else f"{type(exc).__name__}: {exc}"
            self._end(FAILED, text, "error")
            if on_error is not None:
                on_error(exc)
            return
        self.result = result
        seconds = time.monotonic() - self._started
        self._end(DONE, f"Read {format_bytes(self.done_bytes)} ({self.what}) in {format_seconds(seconds)}.", "ok")
        if on_done is not None:
            on_done(result)

    def _end(self, state: str, text: str, kind: str) -> None:
        with self._lock:
            self.state = state
            self.text.value = message_html(text, kind)
            self._show_rows()

    # --- stopping and waiting ----------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the running read at its next chunk (thread-safe; no-op when nothing runs)."""
        with self._lock:
            if self.state == RUNNING:
                self._cancel.set()
                self.state = CANCELLING
                self.text.value = message_html(f"Cancelling the read of {self.what}…", "warning")
                self._show_rows()
                return
        if self.state == CONFIRM:
            self.dismiss()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the read ends; return its result, or raise its error (`ReadCancelled` after a cancel),
        or `TimeoutError` if it still runs after `timeout` seconds."""
        thread = self._thread
        if thread is None:
            raise WorkbenchError("Cannot wait for a background read: none was started.")
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"Reading {self.what} is still running after {timeout}s: call wait() again, or cancel().")
        if self.error is not None:
            raise self.error
        return self.result


__all__ = ["LARGE_READ_BYTES", "BackgroundTask", "ReadCancelled", "format_seconds", "rate_text"]
