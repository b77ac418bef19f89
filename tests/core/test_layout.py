"""The suite's own layout: `tests/<package>/test_<module>.py` mirrors `workbench/` (scripts/place_test.py)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_file_sits_at_the_top_of_tests() -> None:
    """A test written at the top (test_<package>_<module>.py) is placed with `python scripts/place_test.py --move`."""
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == []


def test_every_folder_of_tests_is_a_package_except_the_browser_tests() -> None:
    """Test modules import as tests.<folder>.test_<module>, so two folders may hold the same file name; the browser
    tests import their harness by its plain name and stay outside the package."""
    folders = {p.parent for p in TESTS.rglob("test_*.py")}
    assert sorted(f.name for f in folders if not (f / "__init__.py").exists()) == ["browser"]
    assert (TESTS / "__init__.py").exists()
