"""Presets given a folder's path read its tensor list once per recipe (`mapper/presets/folder_infos.py`), reuse a
catalog the caller holds open (`formats/recent.py`), and read again when the folder changed."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import workbench.formats as formats
from workbench.formats.recent import recent
from workbench.mapper.presets import folder_infos as F


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    save_file({f"layers.{i}.weight": np.zeros((2, 3), np.float32) for i in range(3)}, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every folder `open_catalog` reads (the headers parsed), in order."""
    seen: list[Path] = []
    real = formats.open_catalog
    monkeypatch.setattr(formats, "open_catalog", lambda path, **kw: (seen.append(Path(path)), real(path, **kw))[1])
    F.forget()
    yield seen
    F.forget()


def _touch_later(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_a_folder_is_read_once_until_it_changes_or_planning_starts(folder: Path, opens: list[Path]) -> None:
    first = F.folder_infos(folder)
    assert [i.name for i in first] == ["layers.0.weight", "layers.1.weight", "layers.2.weight"] and len(opens) == 1
    again = F.folder_infos(folder / ".")
    assert again == first and again is not first and len(opens) == 1  # the second preset of a recipe: no reading
    _touch_later(folder / "model.safetensors")
    F.folder_infos(folder)
    assert len(opens) == 2  # a changed file: read again
    F.forget()  # what wb.plan does first
    F.folder_infos(folder)
    assert len(opens) == 3


def test_a_catalog_the_caller_holds_is_reused_while_alive_and_unchanged(folder: Path, opens: list[Path]) -> None:
    catalog = formats.open_catalog(folder)
    assert recent(folder) is catalog and len(opens) == 1
    assert [i.name for i in F.folder_infos(folder)] == list(catalog) and len(opens) == 1  # not read again
    _touch_later(folder / "model.safetensors")
    assert recent(folder) is None  # the folder changed since it was opened
    catalog = formats.open_catalog(folder)
    del catalog
    gc.collect()
    assert recent(folder) is None  # held weakly: nothing kept alive for it
