"""Start a throw-away JupyterLab server for browser tests (token-less, loopback only, temp state), launch
headless chromium, and open a notebook in it the same way for every browser test.

One server serves every browser-test module (its start-up takes seconds): each module works in its own folder
under the server's root, with its own notebooks, sample copies and kernels (shut down when the module is done),
and starts from the same user settings as a fresh server (see `lab_folder`)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
# JupyterLab's wheel ships its in-page test helpers (window.galata); loading them needs only this path.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PANEL = ".jp-NotebookPanel:visible"  # the notebook in view (JupyterLab keeps hidden panels in the DOM)


def galata_path() -> Path:
    """JupyterLab's wheel ships its in-page test helpers (window.galata); loading them needs only this path."""
    import jupyterlab

    return Path(jupyterlab.__file__).parent / "galata"


def screenshot_dir() -> Path:
    """Where browser tests save screenshots: $WORKBENCH_SCREENSHOTS (`make screenshots` points it at docs/),
    else a temporary folder, so that `make test` never rewrites tracked files."""
    folder = Path(os.environ.get("WORKBENCH_SCREENSHOTS") or Path(tempfile.gettempdir()) / "workbench-screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """A JupyterLab server over a copy of the notebooks; `url(path)` opens a notebook."""

    def __init__(self, root: Path, state: Path) -> None:
        self.root = root
        self.state = state
        self.port = free_port()
        self.reset_settings()
        self.log = open(state / "server.log", "wb")  # noqa: SIM115
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(state / "config"), JUPYTER_RUNTIME_DIR=str(state / "runtime"))
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={self.port}",
                "--ServerApp.token=", "--ServerApp.password=", "--ServerApp.ip=127.0.0.1", "--ServerApp.port_retries=0",
                f"--ServerApp.root_dir={root}", f"--LabApp.user_settings_dir={state / 'settings'}",
                f"--LabApp.workspaces_dir={state / 'workspaces'}", "--ServerApp.disable_check_xsrf=True",
                f"--LabApp.extra_labextensions_path={galata_path()}", "--LabApp.expose_app_in_browser=True",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"JupyterLab did not start; log:\n{(state / 'server.log').read_text()[-3000:]}")

    def url(self, notebook: str) -> str:
        return f"http://127.0.0.1:{self.port}/lab/tree/{notebook}?reset"

    def reset_settings(self, overrides: dict[str, dict] | None = None) -> None:
        """Put the user settings back to a fresh server's (no news, no update checks) plus `overrides`
        ("@jupyterlab/plugin-package/plugin" -> settings). The server reads them from disk at each request, so a
        page opened afterwards sees them; what a test changed (the theme it chose) is gone."""
        folder = self.state / "settings"
        shutil.rmtree(folder, ignore_errors=True)
        wanted = {"@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False}, **(overrides or {})}
        for plugin, values in wanted.items():
            path = folder / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))

    def api(self, method: str, path: str) -> object:
        """Call the server's REST API (`path` after /api/); the decoded JSON answer, or None when it has none."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/api/{path}", method=method)
        with urllib.request.urlopen(request, timeout=30) as answer:
            body = answer.read()
        return json.loads(body) if body else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


@contextmanager
def launched_chromium() -> Iterator[object]:
    """Headless chromium driven by playwright, closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def open_notebook(page: object, lab: JupyterLab | LabFolder, notebook: str) -> None:
    """Load `notebook` (a path under the server's root) in `page` and wait until JupyterLab shows it.

    The left sidebar is closed to give the notebook more room; the kernel may still be starting.
    """
    page.goto(lab.url(notebook))  # type: ignore[attr-defined]
    page.wait_for_selector(".jp-NotebookPanel", timeout=60_000)  # type: ignore[attr-defined]
    page.wait_for_function("() => window.galata && window.galata.app", timeout=30_000)  # type: ignore[attr-defined]
    page.evaluate("() => { window.galata.app.commands.execute('application:toggle-left-area'); }")  # type: ignore[attr-defined]


def browser_available() -> str | None:
    """None when the browser tests can run, else the reason they cannot."""
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} is not installed (make test installs Debian's chromium when it runs as root)"
    # found, not imported: every pytest worker collects these modules, only the one running them needs the imports
    if importlib.util.find_spec("playwright") is None or importlib.util.find_spec("playwright.sync_api") is None:
        return "python playwright is not installed"
    if importlib.util.find_spec("jupyterlab") is None:
        return "jupyterlab is not installed (pip install -e '.[notebook]')"
    if shutil.which("jupyter-lab") is None and not (Path(sys.executable).parent / "jupyter-lab").exists():
        return "jupyterlab is not installed"
    return None


REPO = Path(__file__).resolve().parents[2]

# The open notebook's kernel is started, connected and idle (the toolbar's indicator says idle too early).
KERNEL_READY = """() => {
  const panel = window.galata.app.shell.currentWidget;
  const context = panel && panel.sessionContext;
  const kernel = context && context.isReady && context.session && context.session.kernel;
  return !!kernel && kernel.connectionStatus === 'connected' && kernel.status === 'idle';
}"""
# Every code cell of the open notebook has an execution count and the kernel is idle. Read from the notebook
# model, not the DOM: JupyterLab renders cells lazily, so the DOM may hold only the cells in view.
ALL_RAN = """() => {
  const panel = window.galata.app.shell.currentWidget;
  const model = panel && panel.content && panel.content.model;
  if (!model) return false;
  const counts = [];
  for (let k = 0; k < model.cells.length; k++) { const cell = model.cells.get(k); if (cell.type === 'code') counts.push(cell.executionCount); }
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  return counts.length > 0 && counts.every(c => c !== null && c !== undefined) && kernel && kernel.status === 'idle';
}"""


def code_notebook(cells: list[str]) -> dict:
    """An nbformat 4 notebook (as JSON data) of code cells with the python3 kernel."""
    return {"cells": [{"cell_type": "code", "execution_count": None, "id": f"cell-{k}", "metadata": {}, "outputs": [],
                       "source": source} for k, source in enumerate(cells)],
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


class LabFolder:
    """One test module's folder in the shared JupyterLab: `root` is the folder (notebooks open relative to it),
    `url(path)` opens a notebook under it, `state` is the server's state folder (for failure screenshots)."""

    def __init__(self, server: JupyterLab, name: str) -> None:
        self.server = server
        self.name = name
        self.root = server.root / name
        self.state = server.state

    def url(self, notebook: str) -> str:
        return self.server.url(f"{self.name}/{notebook}")

    def shut_down_kernels(self) -> None:
        """End the sessions (and so the kernels) of this folder's notebooks."""
        for session in self.server.api("GET", "sessions"):  # type: ignore[union-attr]
            if session["path"].startswith(f"{self.name}/"):
                self.server.api("DELETE", f"sessions/{session['id']}")


@contextmanager
def lab_folder(server: JupyterLab, name: str, notebooks: dict[str, dict] | None = None, samples: tuple[str, ...] = ("tiny-llama",),
               settings: dict[str, dict] | None = None) -> Iterator[LabFolder]:
    """A new folder `name` under the shared server's root holding `notebooks` (relative path -> notebook data) and
    copies of the named sample checkpoints under `sample_checkpoints/`, with the user settings of a fresh server
    plus `settings` (see `JupyterLab.reset_settings`); its kernels are shut down on exit."""
    folder = LabFolder(server, name)
    folder.root.mkdir()
    for rel, notebook in (notebooks or {}).items():
        (folder.root / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder.root / rel).write_text(json.dumps(notebook))
    for sample in samples:
        shutil.copytree(REPO / "sample_checkpoints" / sample, folder.root / "sample_checkpoints" / sample)
    server.reset_settings(settings)
    try:
        yield folder
    finally:
        folder.shut_down_kernels()


def set_theme(page: object, theme: str) -> None:
    """Switch JupyterLab to `theme` ("JupyterLab Light" / "JupyterLab Dark") and wait until the page shows it."""
    page.evaluate(f"() => window.galata.app.commands.execute('apputils:change-theme', {{theme: {json.dumps(theme)}}})")  # type: ignore[attr-defined]
    page.wait_for_function(f"() => document.body.dataset.jpThemeName === {json.dumps(theme)}", timeout=30_000)  # type: ignore[attr-defined]

# WCAG contrast of an element's text colour against the first opaque background behind it: {ratio, fg, bg}.
CONTRAST = """(el) => {
  const rgb = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => {
    const f = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : Math.pow((c + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  let node = el, bg = null;
  while (node && node.nodeType === 1) {
    const c = rgb(getComputedStyle(node).backgroundColor);
    if (c.length >= 3 && (c.length < 4 || c[3] > 0.5)) { bg = c; break; }
    node = node.parentElement;
  }
  bg = bg || [255, 255, 255];
  const fg = rgb(getComputedStyle(el).color);
  const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
  return {ratio: (a + 0.05) / (b + 0.05), fg: getComputedStyle(el).color, bg: bg.join(',')};
}"""
