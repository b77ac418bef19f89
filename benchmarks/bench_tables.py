"""How fast the Explorer's table answers on a 100k-tensor checkpoint: in the kernel (build, unfold, page turn,
header sort, filter) and, with --browser, in a real JupyterLab in headless chromium (from running the cell to
the first rows drawn, and the round trip of each click).

    python benchmarks/bench_tables.py [--tensors 100000] [--repeat 5] [--browser]

The table sorts and pages in the kernel and sends one page of formatted cells, so every click costs a page,
whatever the row count. For scale, the last line times one static HTML table of every row (what a table
without paging would have to draw). Prints a markdown table of medians; timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

CATALOG_CODE = """
from workbench.catalog import Catalog, TensorInfo
def sparse_catalog(n):
    experts = max(1, -(-n // (40 * 3)))
    infos = [TensorInfo(f"model.layers.{l}.mlp.experts.{e}.w{k}.weight", "BF16", (64 * k, 32), f"model-{l:05d}.safetensors")
             for l in range(40) for e in range(experts) for k in (1, 2, 3)]
    return Catalog.from_infos(infos[:n], root="/nowhere/sparse")
"""


def sparse_catalog(n: int):
    namespace: dict = {}
    exec(CATALOG_CODE, namespace)
    return namespace["sparse_catalog"](n)


def median_seconds(action: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_rows(n: int, repeat: int) -> list[tuple[str, float]]:
    from workbench.display import format_bytes, format_shape
    from workbench.widgets import Explorer
    from workbench.widgets.common import frame_table

    catalog = sparse_catalog(n)
    rows = [("build Explorer (folded: 3 patterns)", median_seconds(lambda: Explorer(catalog), repeat))]
    explorer = Explorer(catalog)

    def fold(value: bool) -> Callable[[], None]:
        return lambda: setattr(explorer.fold_toggle, "value", value)

    rows.append((f"unfold: {n:,} rows into the table", median_seconds(fold(False), repeat, setup=fold(True))))
    explorer.fold_toggle.value = False
    last = explorer.table.last_page
    rows.append(("page turn (to the last page)", median_seconds(lambda: setattr(explorer.table, "page", last), repeat,
                                                               setup=lambda: setattr(explorer.table, "page", 0))))

    def sort_by(column: str, descending: bool) -> Callable[[], None]:
        def click() -> None:
            explorer.table.sort_descending = descending
            explorer.table.sort_column = column
        return click

    rows.append(("header click: sort by bytes", median_seconds(sort_by("nbytes", True), repeat, setup=sort_by("name", False))))
    rows.append(("header click: sort by shape (table-side)", median_seconds(sort_by("shape", True), repeat, setup=sort_by("name", False))))
    rows.append(("filter '*.w2.*' (on Enter)", median_seconds(lambda: setattr(explorer.filter_box, "value", "*.w2.*"), repeat,
                                                             setup=lambda: setattr(explorer.filter_box, "value", ""))))
    explorer.filter_box.value = ""
    page_bytes = len(json.dumps({"cells": explorer.table.cells, "row_keys": explorer.table.row_keys}))
    rows.append((f"one page sent to the browser: {page_bytes:,} bytes of JSON", float("nan")))
    frame = explorer.rows
    rows.append((f"for scale: one static HTML table of all {n:,} rows",
                 median_seconds(lambda: frame_table(frame, max_rows=n, formatters={"nbytes": format_bytes, "shape": format_shape}), 1)))
    return rows


BROWSER_CELLS = [
    CATALOG_CODE + "\nimport time\nfrom workbench.widgets import Explorer\ncatalog = sparse_catalog({n})",
    "start = time.perf_counter()\nexplorer = Explorer(catalog)\nbuilt = time.perf_counter() - start\nexplorer",
]


def browser_rows(n: int) -> list[tuple[str, float]]:
    sys.path.insert(0, str(HERE.parent / "tests" / "browser"))
    from lab_harness import JupyterLab, launched_chromium, open_notebook

    root, state = Path(tempfile.mkdtemp(prefix="wb-bench-tables-")), Path(tempfile.mkdtemp(prefix="wb-bench-lab-"))
    cells = [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": s.replace("{n}", str(n))}
             for s in BROWSER_CELLS]
    notebook = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
                "nbformat": 4, "nbformat_minor": 5}
    (root / "tables.ipynb").write_text(json.dumps(notebook))
    table = ".jp-NotebookPanel:not(.lm-mod-hidden) .wb-explorer-table"
    lab = JupyterLab(root, state)
    rows: list[tuple[str, float]] = []
    try:
        with launched_chromium() as chromium:
            page = chromium.new_page(viewport={"width": 1400, "height": 1200})
            open_notebook(page, lab, "tables.ipynb")
            page.wait_for_function("() => { const p = window.galata.app.shell.currentWidget; const k = p && p.sessionContext.session"
                                   " && p.sessionContext.session.kernel; return !!k && k.status === 'idle'; }", timeout=60_000)
            page.evaluate("() => window.galata.app.commands.execute('notebook:run-cell-and-select-next')")  # cell 1: the catalog
            page.wait_for_function("() => { const p = window.galata.app.shell.currentWidget;"
                                   " return p.content.model.cells.get(0).executionCount && p.content.activeCellIndex === 1"
                                   " && p.sessionContext.session.kernel.status === 'idle'; }", timeout=120_000)
            time.sleep(1)

            def timed(action: Callable[[], None], done: str) -> float:
                start = time.perf_counter()
                action()
                try:
                    page.wait_for_function(done, timeout=120_000)
                except Exception:
                    page.screenshot(path=str(Path(tempfile.gettempdir()) / "bench-tables-timeout.png"))
                    print(f"timed out waiting for {done}; screenshot in {tempfile.gettempdir()}", file=sys.stderr)
                    raise
                return time.perf_counter() - start

            rows.append(("run the cell → first rows drawn (folded)", timed(
                lambda: page.evaluate("() => window.galata.app.commands.execute('notebook:run-cell')"),
                f"() => !!document.querySelector('{table} tbody tr')")))
            rows.append((f"uncheck 'fold layers' → {n:,} rows, first page drawn", timed(
                lambda: page.locator(".wb-explorer-fold input").uncheck(),
                f"() => (document.querySelector('{table} .wb-page-where') || {{}}).textContent?.includes('of {n:,} tensors')"
                f" && document.querySelectorAll('{table} tbody tr').length === 50")))
            first = page.eval_on_selector(f"{table} tbody tr", "r => r.dataset.key")
            rows.append(("click 'last page' → rows drawn", timed(
                lambda: page.locator(f"{table} .wb-page-last").click(),
                f"() => document.querySelector('{table} tbody tr').dataset.key !== {first!r}")))
            last_first = page.eval_on_selector(f"{table} tbody tr", "r => r.dataset.key")
            rows.append(("click header 'nbytes' → sorted rows drawn", timed(
                lambda: page.locator(f"{table} th[data-column='nbytes']").click(),
                f"() => document.querySelector('{table} tbody tr').dataset.key !== {last_first!r}")))
            time.sleep(1)
            name = page.eval_on_selector(f"{table} tbody tr:nth-child(3)", "r => r.dataset.key")
            rows.append(("click a row → its details shown", timed(
                lambda: page.locator(f"{table} tbody tr:nth-child(3)").click(),
                f"() => (document.querySelector('.wb-explorer-details') || {{}}).innerText?.includes({name!r})")))
    finally:
        lab.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--browser", action="store_true", help="also time clicks in JupyterLab (headless chromium)")
    args = parser.parse_args()
    print(f"| Explorer table, {args.tensors:,} tensors | ms |\n|---|---:|")
    for what, seconds in kernel_rows(args.tensors, args.repeat):
        print(f"| kernel: {what} | {'' if seconds != seconds else f'{seconds * 1000:,.1f}'} |", flush=True)
    if args.browser:
        for what, seconds in browser_rows(args.tensors):
            print(f"| browser: {what} | {seconds * 1000:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
