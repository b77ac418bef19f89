"""The PlanPanel in a real JupyterLab, light and dark: a plan on 8 ranks over 48 shards of three sizes. The headline
(RAM to provision first) must be visible, its text must contrast with what is behind it in both themes,
the Memory tab must say in a sentence that every step holds the same, and the Files read tab must draw
the 48 alike shards as one bar (a short figure). Screenshots of both themes go to
the screenshot folder (`make screenshots` refreshes docs/)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_harness import (
    CONTRAST,
    PANEL,
    JupyterLab,
    LabFolder,
    browser_available,
    code_notebook,
    lab_folder,
    launched_chromium,
    open_notebook,
    screenshot_dir,
    set_theme,
)

REPO = Path(__file__).resolve().parents[2]
UNAVAILABLE = browser_available()

pytestmark = [pytest.mark.browser, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"browser tests need chromium: {UNAVAILABLE}")]

SETUP = """import json
from pathlib import Path

import torch

import workbench as wb
from workbench.output.safetensors import save_tensors
from workbench.widgets import PlanPanel

src = Path("many-shards")
src.mkdir(exist_ok=True)
weight_map = {}
for k in range(48):
    name = f"model-{k + 1:05d}-of-00048.safetensors"
    save_tensors(src / name, {f"model.layers.{k}.mlp.weight": torch.zeros(64 * (1 + k % 3), 64)})
    weight_map[f"model.layers.{k}.mlp.weight"] = name
(src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
plan = wb.plan(src, shard_size="40KB", nproc=8, dtype="bf16")
PlanPanel(plan)"""

@pytest.fixture(scope="module")
def lab(lab_server: JupyterLab) -> Iterator[LabFolder]:
    with lab_folder(lab_server, Path(__file__).stem, {"plan.ipynb": code_notebook([SETUP])}, samples=()) as folder:
        yield folder


THEMES = ("JupyterLab Light", "JupyterLab Dark")


def test_plan_panel_headline_is_readable_in_both_themes(lab: LabFolder) -> None:
    """The panel is built once (light theme) and then read in each theme on the same page: the headline's order and
    figures do not depend on the theme, its contrast and the screenshots do."""
    with launched_chromium() as chromium:
        page = chromium.new_page(viewport={"width": 1400, "height": 1400})
        try:
            open_notebook(page, lab, "plan.ipynb")
            set_theme(page, THEMES[0])
            page.wait_for_function(
                "() => { const p = window.galata.app.shell.currentWidget; const k = p && p.sessionContext.session"
                " && p.sessionContext.session.kernel; return k && k.status === 'idle'; }", timeout=60_000)
            page.evaluate("() => window.galata.app.commands.execute('notebook:run-all-cells')")
            panel = page.locator(f"{PANEL} .wb-plan")
            panel.wait_for(timeout=120_000)
            headline = panel.locator(".wb-plan-headline")
            text = headline.inner_text()
            assert text.index("RAM to provision") < text.index("Peak step") < text.index("Rank balance")
            assert "× 8 ranks" in text and "shards" in text
            tabs = panel.locator(".lm-TabBar-tab, .p-TabBar-tab")
            for theme in THEMES:
                set_theme(page, theme)
                for cell in (headline.locator(".wb-plan-facts td").first, headline.locator(".wb-plan-facts th").first):
                    assert cell.is_visible()
                    contrast = cell.evaluate(CONTRAST)
                    assert contrast["ratio"] >= 4.5, f"{theme}: headline text {contrast} is hard to read"
                tabs.filter(has_text="Memory").first.click()
                memory = panel.locator(".wb-plan-memory-plot").first
                memory.wait_for(state="visible", timeout=30_000)  # the Memory tab is open first: its chart is drawn
                assert memory.evaluate("(img) => img.complete && img.naturalWidth > 0")
                name = "dark" if "Dark" in theme else "light"
                panel.scroll_into_view_if_needed()
                panel.screenshot(path=str(screenshot_dir() / f"plan_panel_{name}.png"))
                tabs.filter(has_text="Files read").first.click()
                files = panel.locator(".wb-plan-files-read-plot").first
                files.wait_for(state="visible", timeout=30_000)
                # three bars (16 alike shards each), not 40 bars: a short figure
                assert files.evaluate("(img) => img.complete && img.naturalWidth > 0 && img.naturalHeight < 300")
                panel.screenshot(path=str(screenshot_dir() / f"plan_panel_files_{name}.png"))
        finally:
            page.close()
