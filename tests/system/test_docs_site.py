"""The documentation site (mkdocs.yml, docs/, the docstrings) builds in strict mode, so a broken link, a page left
out of the nav or an API name that no longer resolves fails `make test`; and the README stays a manual: short, with
working links into docs/."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

import workbench
import workbench.mapper as M

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


class _Loader(yaml.SafeLoader):
    """mkdocs.yml may hold `!!python/name:` tags (Material's extensions); the test reads plain keys only."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def _config() -> dict:
    return yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_Loader)


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def _build(out: Path) -> Path:
    """The site built as `make docs` builds it (strict), into a temporary folder."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def _ids(page: Path) -> set[str]:
    return set(re.findall(r'id="([^"]+)"', page.read_text(encoding="utf-8")))


def test_every_docs_page_is_in_the_nav_and_the_build_is_strict() -> None:
    config = _config()
    assert config.get("strict") is True
    # the link checks stay at "warn", which --strict turns into failures
    for key in ("omitted_files", "absolute_links", "unrecognized_links", "anchors"):
        assert config["validation"][key] == "warn", key
    nav = set(_nav_pages(config["nav"]))
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert pages - nav == set(), "docs pages missing from mkdocs.yml's nav"
    assert nav - pages == set(), "nav entries without a page"
    assert {"api/workbench.md", "api/mapper.md", "api/presets.md", "cli.md", "reliability.md"} <= nav


def test_site_builds_strict_with_api_and_cli_pages(tmp_path: Path) -> None:
    """One build (about 20 s) feeds every check of the built site, so parallel workers never build it twice."""
    site = _build(tmp_path / "site")
    _check_api_pages(site)
    _check_api_docstrings(site)
    _check_cli_page(site)


def _check_api_pages(site: Path) -> None:
    wb_ids = _ids(site / "api" / "workbench" / "index.html")
    for name in workbench.__all__:
        if name in ("__version__", "mapper"):
            continue
        assert f"workbench.{name}" in wb_ids, name
    assert {"workbench.convert", "workbench.open_checkpoint", "workbench.plan"} <= wb_ids

    m_ids = _ids(site / "api" / "mapper" / "index.html")
    for name in M.__all__:
        if name == "presets":
            continue
        assert f"workbench.mapper.{name}" in m_ids, name
    assert "workbench.mapper.Sequential" in m_ids

    p_ids = _ids(site / "api" / "presets" / "index.html")
    for name in M.presets.PRESETS:
        assert f"workbench.mapper.presets.{name}" in p_ids, name
    # the reference names public paths only: no internal module of the package is a heading
    for ids in (wb_ids, m_ids, p_ids):
        internal = {i for i in ids if re.match(r"workbench\.(explore|planning|engine|output|formats|conversion)\b", i)}
        assert internal == set()


def _check_api_docstrings(site: Path) -> None:
    text = html.unescape((site / "api" / "workbench" / "index.html").read_text(encoding="utf-8"))
    convert_doc = workbench.convert.__doc__.strip().splitlines()[0]
    assert convert_doc.split("`")[0].strip()[:40] in text


def _check_cli_page(site: Path) -> None:
    text = html.unescape((site / "cli" / "index.html").read_text(encoding="utf-8"))
    for command in ("inspect", "diff", "verify", "plan", "convert"):
        assert f"usage: workbench {command}" in text, command
    for flag in ("--on-overflow", "--nproc-mp", "--zero-moments", "--checksums"):
        assert flag in text, flag


def test_readme_is_a_short_manual_with_working_links() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 350
    for command in ("make lab", "make test", "make bench"):
        assert command in readme
    assert re.search(r"make test` takes ~[\d.]+ min", readme), "the suite-time line the lead keeps current"
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert targets
    for target in targets:
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to missing {target}"
    for page in ("explore", "formats", "mappers", "planning", "model_families", "adapters", "remote", "outputs",
                 "model_io", "reliability"):
        assert f"(docs/{page}.md)" in readme, page


def test_reliability_page_keeps_the_full_tables() -> None:
    text = (DOCS / "reliability.md").read_text(encoding="utf-8")
    for heading in ("## Inputs tried", "## Wrong outputs and hostile folders", "## Faults injected"):
        assert heading in text
    wrong = text.split("## Wrong outputs and hostile folders")[1].split("\n## ")[0]
    rows = [line for line in wrong.splitlines() if line.startswith("| ") and not line.startswith("| input")]
    assert len(rows) >= 79  # every row the README held at issue 30
    faults = text.split("## Faults injected")[1].split("\n## ")[0]
    assert sum(line.startswith("| ") for line in faults.splitlines()) >= 11
