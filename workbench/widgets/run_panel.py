"""`RunPanel`: run a conversion from a notebook — here or on torchrun workers — with one live progress
bar per rank, a cancel button that stops every rank cleanly, and the run report (predicted next to
measured) when it ends.

`start()` runs the conversion in a background thread, so the cell returns at once and the bars move
while other cells run; the thread only sets widget values (never `with out:`), which a kernel sends
to the page from any thread. `wait()` blocks until the end (use it where later cells need the output).
In a Jupyter kernel, `wb.convert(...)` also shows a RunPanel instead of a text bar (see `live_display`).
"""

from __future__ import annotations

import html
import threading
import time
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
from IPython.display import display

from ..api_types import Launcher
from ..display import format_bytes, format_count
from ..errors import PlanError, WorkbenchError
from ..launch.launcher import resolve_launcher
from .background import BackgroundTask, format_seconds
from .common import Panel, labelled, message_html

if TYPE_CHECKING:  # pragma: no cover
    from ..engine.progress import ProgressCallback
    from ..engine.report import RunReport
    from ..planning.model import Plan

PLAN_OPTIONS = ("shard_size", "rest", "dtype", "extras", "overwrite", "chunk_size")
READY, RUNNING, CANCELLING, DONE, CANCELLED, FAILED = "ready", "running", "cancelling", "done", "cancelled", "failed"
# Scoped to the panel: its HTML widgets sit outside JupyterLab's rendered-HTML styles.
RUN_STYLE = (
    "<style>.wb-run-lines{font-size:12px;color:var(--jp-ui-font-color2,#555);line-height:1.45}"
    ".wb-run-report table{border-collapse:collapse;font-size:12px;margin:4px 0 8px}"
    ".wb-run-report th,.wb-run-report td{padding:1px 12px 1px 0;line-height:1.45;text-align:left;white-space:nowrap}"
    ".wb-run-report th{border-bottom:1px solid #ccc}</style>"
)
BAR_STYLES = {RUNNING: "info", CANCELLING: "warning", DONE: "success", CANCELLED: "warning", FAILED: "danger"}
# What a run is doing, in order; shown as a strip with the current phase marked.
PLANNING, STARTING, COPYING, COMMITTING, FINISHED = "planning", "starting workers", "copying", "committing", "done"
PHASES = (PLANNING, STARTING, COPYING, COMMITTING, FINISHED)
VERIFYING = "verifying"  # after a run, while Verify re-reads the outputs
TICK_SECONDS = 0.5  # elapsed time, speed and time left refresh this often while a run is under way
PHASE_STYLE = (
    "<style>.wb-run-phases{font-size:12px;margin:2px 0}.wb-run-phases span{padding:1px 6px;margin-right:2px;"
    "border-radius:3px;color:var(--jp-ui-font-color2,#666)}"
    ".wb-run-phases span.wb-phase-now{background:#1565c0;color:#fff;font-weight:bold}"  # 5.7:1 in both themes
    ".wb-run-phases span.wb-phase-past{color:var(--jp-ui-font-color1,#222)}</style>"
)


AGAIN_TOOLTIP = ("run the conversion again, as `workbench convert` run twice does: a destination that holds this "
                 "conversion's finished output is left as it is (nothing written); one with shards missing is completed; "
                 "a changed source is converted again")


def done_text(report: RunReport) -> str:
    """The status line of a finished run, in words that say what happened."""
    if report.already_complete:
        return (f"Already complete, nothing written: {report.where} holds this conversion's finished output "
                f"({format_count(len(report.files), 'file')}, same source, mapper and options).")
    index = "index written" if report.index_written else "single file, no index"
    kept = f", {len(report.kept)} already there" if report.kept else ""
    written = len(report.files) - len(report.kept)
    return f"Done in {report.seconds:.2f}s: {format_count(written, 'file')} written{kept} ({index})."


def launcher_label(launcher: str, nproc: int) -> str:
    """How the workers are started, for people: 'in this process', 'on 2 torchrun ranks', 'on 2 processes (local launcher)'."""
    if nproc == 1:
        return "in this process"
    if launcher == "torchrun":
        return f"on {nproc} torchrun ranks"
    return f"on {nproc} processes ({launcher} launcher)"


class RunPanel(Panel):
    """A conversion run as a notebook panel: `RunPanel(source, dest, mapper=None, nproc=1, **options)`.

    `options` are `wb.convert`'s (`shard_size`, `rest`, `dtype`, `extras`, `overwrite`, `chunk_size`,
    `on_progress`, `launcher`); or pass an existing `plan=` made with a destination. The plan is made at
    once, so its problems show before anything runs. `start()` runs it in the background (nproc > 1:
    under torchrun, or `launcher="local"`), `cancel()` stops every rank (no index written, temporary
    files removed; starting again resumes), `wait(timeout)` blocks and returns the `RunReport` (or
    raises the run's error), `report` and `error` hold the outcome. While it runs, `phase` says what it does
    (planning, starting workers, copying, committing, done; `phases_seen` lists them) and `timing` shows
    elapsed time, throughput and time left. After a run, `verify()` re-reads every output against its
    sources in the background (`verify_task`, verdict in `output_check`) and `open_in_explorer()` shows an
    `Explorer` of the output. Controls: `start_button`, `cancel_button`, `bars` (one per rank),
    `verify_button`, `explore_button`.
    """

    def __init__(
        self,
        source: Any = None,
        dest: Any = None,
        mapper: Any = None,
        nproc: int = 1,
        *,
        plan: Plan | None = None,
        on_progress: ProgressCallback | None = None,
        launcher: Launcher = "auto",
        **options: Any,
    ) -> None:
        options.pop("quiet", None)  # the panel is the progress display
        unknown = sorted(set(options) - set(PLAN_OPTIONS))
        if unknown:
            raise PlanError(
                f"Cannot make a RunPanel: unknown option(s) {', '.join(map(repr, unknown))}. "
                f"It takes wb.convert's options: {', '.join(PLAN_OPTIONS)}, on_progress, launcher."
            )
        if plan is None:
            if source is None or dest is None:
                raise PlanError("Cannot make a RunPanel without a source and a destination: RunPanel(source, dest, mapper, ...), "
                                "or RunPanel(plan=wb.plan(source, mapper, dest=...)).")
            from ..planning.build import plan as make_plan

            plan = make_plan(source, mapper, nproc=nproc, dest=dest, **options)
        elif plan.dest is None:
            raise PlanError("Cannot run a plan without a destination in a RunPanel: make it with wb.plan(..., dest=...).")
        self.plan = plan
        self.launcher = resolve_launcher(launcher)
        self.report: RunReport | None = None
        self.error: BaseException | None = None
        self.state = READY
        self._user_progress = on_progress
        self._cancel_requested = threading.Event()
        self._state_lock = threading.Lock()  # cancel() (any thread) must not overwrite the state of a run that ended
        self._thread: threading.Thread | None = None
        self._launch: Any = None
        self._runs = 0

        self.header = labelled(widgets.HTML(), "wb-run-header")
        self.problems_view = labelled(widgets.HTML(), "wb-run-problems")
        self.rank_rows = labelled(widgets.VBox(), "wb-run-ranks")
        self.status = labelled(widgets.HTML(), "wb-run-status")
        self.start_button = labelled(widgets.Button(description="Start", icon="play", button_style="primary"), "wb-run-start")
        self.cancel_button = labelled(
            widgets.Button(description="Cancel", icon="stop", button_style="warning", disabled=True,
                           tooltip="stop every rank: no index is written, temporary files are removed"),
            "wb-run-cancel",
        )
        self.report_view = labelled(widgets.HTML(), "wb-run-report")
        self.phase = ""
        self.phases_seen: list[str] = []
        self._phase_lock = threading.Lock()  # the run's thread and the clock's both move the phase
        self.phase_view = labelled(widgets.HTML(), "wb-run-phase")
        self.timing = labelled(widgets.HTML(), "wb-run-timing")
        self._started_at = 0.0
        self._run_started_at = 0.0  # when the plan went to the runner: throughput counts from here, as the report's does
        self._ticker: threading.Thread | None = None
        self.verify_button = labelled(widgets.Button(description="Verify", icon="check", tooltip="re-read every output "
                                                     "and compare it with what its sources make it"), "wb-run-verify")
        self.explore_button = labelled(widgets.Button(description="Open in Explorer", icon="search",
                                                      tooltip="browse the converted checkpoint"), "wb-run-explore")
        self.after_row = widgets.HBox([self.verify_button, self.explore_button])
        self.after_row.layout.display = "none"
        self.verify_task = labelled(BackgroundTask(), "wb-run-verify-task")
        self.verify_view = labelled(widgets.HTML(), "wb-run-verified")
        self.output_check: Any = None
        self.explorer: Any = None
        self.explorer_box = widgets.VBox()
        self._show_plan()
        self._set_status(READY, "Ready: press Start (or call start()).")
        super().__init__([self.header, self.problems_view, self.phase_view, self.rank_rows,
                          widgets.HBox([self.start_button, self.cancel_button]), self.status, self.timing, self.report_view,
                          self.after_row, self.verify_task, self.verify_view, self.explorer_box])
        self.add_class("wb-run")
        self.start_button.on_click(lambda _: self._start_clicked())
        self.cancel_button.on_click(lambda _: self.cancel())
        self.verify_button.on_click(lambda _: self.verify())
        self.explore_button.on_click(lambda _: self.open_in_explorer())

    # --- identity ----------------------------------------------------------------------------------
    @property
    def launcher_used(self) -> str:
        """The launcher that starts (or started) the workers: the running launch's own, else the one asked for."""
        return getattr(self._launch, "launcher", None) or self.launcher

    def _describe(self) -> str:
        where = "here" if self.plan.nproc == 1 else launcher_label(self.launcher_used, self.plan.nproc)
        return f"RunPanel: {self.plan.source.root.name} -> {self.plan.dest} ({where}), {self.state}"

    @property
    def running(self) -> bool:
        """True from `start()` until the run has ended (successfully or not)."""
        return self.state in (RUNNING, CANCELLING)

    # --- what is shown -------------------------------------------------------------------------------
    def _show_header(self) -> None:
        """The plan's headline under 'Conversion in this process / on N ranks of <launcher>'."""
        lines = self.plan.headline()
        where = launcher_label(self.launcher_used, self.plan.nproc)
        self.header.value = (f"{RUN_STYLE}<b>Conversion</b> {where}<div class='wb-run-lines'>"
                             + "<br>".join(html.escape(line) for line in [lines[0], *lines[2:]]) + "</div>")

    def _show_plan(self) -> None:
        plan = self.plan
        self._show_header()
        self.problems_view.value = "".join(message_html(f"{p.severity}: {p.message}", p.severity) for p in plan.problems)
        self.totals = {r: plan.rank_output_bytes(r) for r in range(plan.nproc)}
        self.done = dict.fromkeys(self.totals, 0)
        self.bars: list[widgets.IntProgress] = []
        self.bar_labels: list[widgets.HTML] = []
        rows = []
        for rank, total in self.totals.items():
            bar = labelled(widgets.IntProgress(value=0, min=0, max=max(total, 1), description=f"rank {rank}",
                                               layout=widgets.Layout(width="420px")), "wb-run-bar")
            label = labelled(widgets.HTML(self._bar_text(rank)), "wb-run-bar-label")
            self.bars.append(bar)
            self.bar_labels.append(label)
            rows.append(labelled(widgets.HBox([bar, label]), "wb-run-rank"))
        self.rank_rows.children = rows
        self.start_button.disabled = not plan.ok

    def _bar_text(self, rank: int) -> str:
        total = self.totals[rank]
        if total == 0:
            return "<span class='wb-note'>nothing to write</span>"
        done = self.done[rank]
        return f"<span class='wb-note'>{format_bytes(done)} of {format_bytes(total)} ({done / total:.0%})</span>"

    def _set_status(self, state: str, text: str, kind: str = "info") -> None:
        self.state = state
        self.status.value = message_html(text, kind)
        self.cancel_button.disabled = state != RUNNING
        self.cancel_button.button_style = "warning" if state == RUNNING else ""  # a disabled Cancel looks inert
        if state in BAR_STYLES:
            for bar in self.bars:
                bar.bar_style = BAR_STYLES[state]

    def _set_phase(self, phase: str, detail: str = "") -> None:
        """Mark `phase` as the current one in the strip (a detail such as '1 of 2 up' follows its name)."""
        with self._phase_lock:
            if phase != self.phase:
                self.phases_seen.append(phase)
            self.phase = phase
            self._draw_phases(phase, detail)

    def _draw_phases(self, phase: str, detail: str) -> None:
        now = PHASES.index(phase) if phase in PHASES else len(PHASES) if phase == VERIFYING else -1
        cells = []
        for k, name in enumerate(PHASES):
            if name == STARTING and self.plan.nproc == 1:
                name = "starting"
            css = "wb-phase-now" if k == now else "wb-phase-past" if k < now else ""
            text = f"{name} ({detail})" if k == now and detail else name
            cells.append(f"<span class='{css}'>{html.escape(text)}</span>")
        if phase not in PHASES:
            cells.append(f"<span class='wb-phase-now'>{html.escape(phase)}</span>")
        self.phase_view.value = PHASE_STYLE + "<div class='wb-run-phases'>" + "›".join(cells) + "</div>"

    def _timing_text(self, now: float) -> str:
        """'elapsed 4.2 s · 35.1 MiB/s · about 3.0 s left' (speed and time left once bytes flow).

        The speed is the report's throughput (`RunReport.throughput`) measured so far: bytes written over the wall
        time since the run started (worker start-up included), not since the first bytes arrived, so that the
        live figure ends where the report's begins."""
        done, total = sum(self.done.values()), sum(self.totals.values())
        parts = [f"elapsed {format_seconds(now - self._started_at)}"]
        if self._run_started_at and done:
            speed = done / max(now - self._run_started_at, 1e-6)
            parts.append(f"{format_bytes(done)} of {format_bytes(total)} · {format_bytes(int(speed))}/s")
            if done < total and self.running:
                parts.append(f"about {format_seconds((total - done) / speed)} left")
        return " · ".join(parts)

    def _final_timing_text(self, report: RunReport) -> str:
        """The timing line once the run ended: the report's own figures (elapsed, bytes written, throughput)."""
        if report.already_complete:
            return "nothing read or written"
        return (f"elapsed {format_seconds(report.seconds)} · {format_bytes(report.bytes_written)} written · "
                f"{format_bytes(int(report.throughput))}/s")

    def _tick(self) -> None:
        """While the run is under way: refresh elapsed time, speed and time left, and count started workers."""
        while self.running:
            now = time.monotonic()
            launch = self._launch
            if launch is not None and self.plan.nproc > 1:
                with self._phase_lock:
                    if self.phase == STARTING:
                        self._draw_phases(STARTING, f"{len(launch.worker_pids)} of {self.plan.nproc} up")
            with self._state_lock:  # not after the run ended: the final timing (`_show_outcome`) must stay
                if self.running:
                    self.timing.value = f"<span class='wb-note'>{html.escape(self._timing_text(now))}</span>"
            time.sleep(TICK_SECONDS)

    def _repr_html_(self) -> str:
        rows = []
        for rank, total in self.totals.items():
            share = 1.0 if total == 0 and self.state == DONE else (self.done[rank] / total if total else 0.0)
            rows.append(
                f"<div style='display:flex;align-items:center;gap:8px;margin:2px 0'><span style='width:56px'>rank {rank}</span>"
                f"<div style='width:300px;height:10px;background:var(--jp-layout-color2,#eee)'><div style='width:{share:.0%};height:10px;"
                f"background:#4C72B0'></div></div>{self._bar_text(rank)}</div>"
            )
        return (f"<div class='wb-run-static'>{self.header.value}{self.problems_view.value}{''.join(rows)}"
                f"{self.status.value}{self.timing.value}<div class='wb-run-report'>{self.report_view.value}</div></div>")

    # --- running -----------------------------------------------------------------------------------
    def _start_clicked(self) -> None:
        try:
            self.start()
        except WorkbenchError as exc:
            self.status.value = message_html(str(exc), "error")

    def _begin(self) -> None:
        """Check and reset for a run; a second run re-plans (finished shards of a cancelled run are kept)."""
        from ..engine.finalize import require_runnable

        if self.running:
            raise PlanError(f"Cannot start the conversion into {self.plan.dest}: it is already running. Wait for it or cancel it.")
        if self.verify_task.running:
            raise PlanError(f"Cannot start the conversion into {self.plan.dest}: its outputs are being verified. "
                            "Wait for the check or cancel it.")
        self._started_at, self._run_started_at = time.monotonic(), 0.0
        self.phases_seen = []
        self._set_phase(PLANNING)
        if self._runs:
            from ..planning.build import build_plan

            plan = self.plan
            self.plan = build_plan(plan.source, plan.mapper, plan.options, plan.dest)
            self._show_plan()
        require_runnable(self.plan)
        self._runs += 1
        self.report = self.error = None
        self._launch = None
        self._cancel_requested.clear()
        self.report_view.value = ""
        self.after_row.layout.display = "none"
        self.verify_view.value = ""
        self.output_check = None
        self.explorer_box.children = ()
        where = "here" if self.plan.nproc == 1 else launcher_label(self.launcher_used, self.plan.nproc)
        self._set_status(RUNNING, f"Running {where}…")
        self._set_phase(STARTING)
        self.start_button.disabled = True
        self._ticker = threading.Thread(target=self._tick, name="workbench-run-clock", daemon=True)
        self._ticker.start()

    def start(self) -> RunPanel:
        """Start the conversion in a background thread and return at once (the bars move as it runs)."""
        self._begin()
        self._thread = threading.Thread(target=self._run_in_background, name="workbench-run", daemon=True)
        self._thread.start()
        return self

    def run(self) -> RunReport:
        """Run the conversion in this thread and return its report (what `wb.convert` does in a notebook).

        The kernel is busy meanwhile, so the cancel button cannot be clicked: interrupt the kernel instead.
        """
        self._begin()
        self.cancel_button.tooltip = "the cell is busy running the conversion: interrupt the kernel to cancel"
        self.cancel_button.disabled = True
        try:
            report = self._execute()
        except BaseException as exc:
            self._finish(error=exc)
            raise
        self._finish(report=report)
        return report

    def _run_in_background(self) -> None:
        try:
            report = self._execute()
        except BaseException as exc:  # shown in the panel, re-raised by wait()
            self._finish(error=exc)
        else:
            self._finish(report=report)

    def _execute(self) -> RunReport:
        from ..engine import Cancelled
        from ..launch import Launch
        from ..launch.in_process import run_local

        if self.plan.complete:  # the destination holds this very conversion, finished: nothing to run (the CLI's no-op)
            from ..engine.report import RunReport

            return RunReport.nothing_to_do(self.plan)
        self._run_started_at = time.monotonic()
        if self.plan.nproc == 1:
            try:
                return run_local(self.plan, quiet=True, on_progress=self._on_progress)
            except Cancelled as exc:
                raise Cancelled(self._cancelled_message()) from exc
        self._launch = Launch(self.plan, quiet=True, on_progress=self._on_progress, launcher=self.launcher)
        self._show_header()  # the launcher the launch settled on (a default may choose one)
        if self._cancel_requested.is_set():
            self._launch.cancel()
        return self._launch.start().wait()

    def _on_progress(self, rank: int, done: int, total: int) -> bool:
        self.done[rank] = done
        if self.phase in (STARTING, COPYING):
            copied_all = sum(self.done.values()) >= sum(self.totals.values())
            self._set_phase(COMMITTING if copied_all else COPYING)
        bar = self.bars[rank]
        bar.value = min(done, bar.max)
        self.bar_labels[rank].value = self._bar_text(rank)
        if self._user_progress is not None and self._user_progress(rank, done, total) is False:
            self._cancel_requested.set()
        return not self._cancel_requested.is_set()

    def _cancelled_message(self) -> str:
        return (f"Cannot finish the conversion into {self.plan.dest}: it was cancelled. No index was written and "
                "temporary files were removed; start it again to resume (finished shards are kept).")

    def _finish(self, *, report: RunReport | None = None, error: BaseException | None = None) -> None:
        with self._state_lock:
            self._show_outcome(report, error)

    def _show_outcome(self, report: RunReport | None, error: BaseException | None) -> None:
        from ..engine import Cancelled

        self.report, self.error = report, error
        self.start_button.disabled = False
        timing = self._timing_text(time.monotonic()) if report is None else self._final_timing_text(report)
        self.timing.value = f"<span class='wb-note'>{html.escape(timing)}</span>"
        if report is not None:
            self._set_phase(FINISHED)
            # done: running it again is no longer the next step, and does what the CLI does run twice
            self.start_button.button_style = ""
            self.start_button.description, self.start_button.icon = "Run again", "repeat"
            self.start_button.tooltip = AGAIN_TOOLTIP
            self.after_row.layout.display = None
            for rank, bar in enumerate(self.bars):
                self.done[rank] = self.totals[rank]
                bar.value = bar.max
                self.bar_labels[rank].value = self._bar_text(rank)
            self._set_status(DONE, done_text(report), "ok")
            self.report_view.value = RUN_STYLE + report._repr_html_()
        elif isinstance(error, Cancelled):
            self._set_phase(CANCELLED)
            self._set_status(CANCELLED, "Cancelled: every rank stopped, no index was written and temporary files were "
                             "removed. Start again to resume (finished shards are kept).", "warning")
        elif isinstance(error, KeyboardInterrupt):
            self._set_phase(CANCELLED)
            self._set_status(CANCELLED, "Interrupted: every rank was stopped, no index was written.", "warning")
        else:
            self._set_phase(FAILED)
            text = str(error) if isinstance(error, WorkbenchError) else f"{type(error).__name__}: {error}"
            self._set_status(FAILED, f"Failed. {text}", "error")

    def cancel(self) -> None:
        """Stop the run: every rank ends, no index is written, temporary files are removed (thread-safe).

        Takes effect at the next progress report of a rank (after its current step). No-op when not running.
        """
        with self._state_lock:
            if not self.running:
                return
            self._set_status(CANCELLING, "Cancelling: stopping every rank…", "warning")
            self._cancel_requested.set()
        launch = self._launch
        if launch is not None:
            launch.cancel()

    # --- after a run -------------------------------------------------------------------------------------
    def verify(self) -> bool:
        """Re-read every output of the finished run and compare it with its sources (`wb.convert(verify=True)`'s
        check), in the background with a bar and Cancel (`verify_task`); the verdict shows below and lands in
        `output_check`. True when started."""
        from ..engine.output_check import check_bytes, check_outputs

        if self.report is None:
            self.verify_view.value = message_html("Cannot verify: the conversion has not finished. Run it first.", "warning")
            return False
        plan = self.plan

        def done(check: Any) -> None:
            self._set_phase(FINISHED)
            self.output_check = check
            if self.report is not None:
                self.report.output_check = check
            lines = check.summary().splitlines()
            self.verify_view.value = "".join(message_html(line, "ok" if check.ok else "error") for line in lines)

        def failed(exc: BaseException) -> None:
            self._set_phase(FINISHED)
            text = str(exc) if isinstance(exc, WorkbenchError) else f"{type(exc).__name__}: {exc}"
            self.verify_view.value = message_html(f"Cannot verify {plan.dest}: {text}", "error")

        def work(on_read: Any) -> Any:
            self._set_phase(VERIFYING)
            try:
                return check_outputs(plan, on_read=on_read)
            except BaseException:
                self._set_phase(FINISHED)  # cancelled (or failed): the run itself is still done
                raise

        self.verify_view.value = ""
        return self.verify_task.run(work, total_bytes=check_bytes(plan), what=f"the outputs in {plan.dest}",
                                    on_done=done, on_error=failed)

    def open_in_explorer(self) -> Any:
        """Show an `Explorer` of the converted checkpoint below the panel (and return it)."""
        from .explorer import Explorer

        if self.report is None:
            self.verify_view.value = message_html("Cannot open the output: the conversion has not finished. Run it first.", "warning")
            return None
        try:
            self.explorer = Explorer(self.plan.dest)
        except WorkbenchError as exc:
            self.verify_view.value = message_html(exc.message, "error")
            return None
        self.explorer_box.children = (self.explorer,)
        return self.explorer

    def wait(self, timeout: float | None = None) -> RunReport:
        """Block until the run ends and return its report; raise its error if it failed (`Cancelled` after
        a cancel), or `TimeoutError` if it still runs after `timeout` seconds."""
        thread = self._thread
        if thread is None:
            raise PlanError("Cannot wait for this RunPanel: it was not started. Call start() first.")
        try:
            thread.join(timeout)
        except KeyboardInterrupt:  # an interrupted wait stops the run too
            self.cancel()
            thread.join()
            raise
        if thread.is_alive():
            raise TimeoutError(f"The conversion into {self.plan.dest} is still running after {timeout}s: "
                               "call wait() again, or cancel().")
        if self.error is not None:
            raise self.error
        assert self.report is not None
        return self.report


def live_display(plan: Plan, on_progress: ProgressCallback | None = None, launcher: Launcher = "auto") -> RunPanel:
    """Show a RunPanel for `plan` in the current cell; `wb.convert` then runs it with `panel.run()`.

    This is the notebook display the engine's progress module looks up instead of a tqdm bar.
    """
    panel = RunPanel(plan=plan, on_progress=on_progress, launcher=launcher)
    panel.start_button.layout.display = "none"
    display(panel)
    return panel


__all__ = ["RunPanel", "live_display"]
