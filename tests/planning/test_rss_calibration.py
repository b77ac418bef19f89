"""scripts/calibrate_rss.py, the logic behind `workbench/planning/rss_calibration.py`: the private mirror of
site-packages it measures in (shared objects written whole, the rest linked), the page-cache eviction it checks,
and the module text it writes (no timing: the measurements themselves are checked by tests/system/test_rss_cases.py)."""

from __future__ import annotations

import importlib.util
import mmap
import os
from pathlib import Path

import pytest

from workbench.planning import rss_calibration as calibrated

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("calibrate_rss", REPO / "scripts" / "calibrate_rss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _site(root: Path) -> Path:
    """A small site-packages: a package with a shared object (in a subfolder and a `.libs` folder beside it), a
    pure-Python package, a module and a .pth file."""
    site = root / "site"
    (site / "native" / "lib").mkdir(parents=True)
    (site / "native" / "__pycache__").mkdir()
    (site / "native" / "__init__.py").write_text("X = 1\n")
    (site / "native" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"pyc")
    (site / "native" / "lib" / "libnative.so").write_bytes(bytes(range(256)) * 4096)
    os.chmod(site / "native" / "lib" / "libnative.so", 0o755)
    (site / "native" / "lib" / "libnative.so.1").symlink_to("libnative.so")
    (site / "native.libs").mkdir()
    (site / "native.libs" / "libdep-1a2b.so.3").write_bytes(b"\x7fELF" * 10)
    (site / "pure").mkdir()
    (site / "pure" / "__init__.py").write_text("")
    (site / "single.py").write_text("")
    (site / "extra.pth").write_text("")
    return site


def test_the_mirror_copies_shared_objects_and_links_everything_else(script, tmp_path: Path) -> None:
    site = _site(tmp_path)
    mirror = tmp_path / "mirror"
    copied = script.mirror_site_packages(mirror, site)
    lib = mirror / "native" / "lib" / "libnative.so"
    assert sorted(copied) == sorted([lib, mirror / "native.libs" / "libdep-1a2b.so.3"])
    assert not lib.is_symlink() and lib.read_bytes() == (site / "native" / "lib" / "libnative.so").read_bytes()
    assert os.stat(lib).st_mode == os.stat(site / "native" / "lib" / "libnative.so").st_mode  # still executable
    assert (mirror / "native" / "lib" / "libnative.so.1").is_symlink()  # a link to a copied object stays a link
    assert (mirror / "native").is_dir() and not (mirror / "native").is_symlink()  # $ORIGIN resolves in the mirror
    assert (mirror / "native" / "__init__.py").resolve() == (site / "native" / "__init__.py").resolve()
    assert (mirror / "native" / "__pycache__").is_symlink()  # compiled modules reused, nothing compiled again
    for name in ("pure", "single.py", "extra.pth"):
        assert (mirror / name).is_symlink() and (mirror / name).resolve() == (site / name).resolve()


def test_library_files_are_the_packages_and_their_libs_folder(script, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    copied = script.mirror_site_packages(mirror, _site(tmp_path))
    assert script.library_files(copied, mirror, "native") == copied
    assert script.library_files(copied, mirror, "pure") == []


@pytest.mark.parametrize(("name", "shared"), [("libtorch_cpu.so", True), ("libgomp-a34b3233.so.1", True),
                                              ("_C.cpython-311-x86_64-linux-gnu.so", True), ("solver.py", False),
                                              ("socket.sock", False)])
def test_shared_objects_are_told_by_name(script, name: str, shared: bool) -> None:
    assert script.is_shared_object(Path(name)) is shared


def test_eviction_empties_the_page_cache_of_a_private_file(script, tmp_path: Path) -> None:
    path = tmp_path / "lib.so"
    path.write_bytes(os.urandom(1 << 20))
    path.read_bytes()
    assert script.resident_bytes(path) == 1 << 20
    try:
        script.evict([path])
    except SystemExit:
        pytest.skip("this file system keeps its pages in memory (tmpfs)")
    assert script.resident_bytes(path) == 0


def test_rewriting_puts_a_file_back_in_the_page_cache_whole(script, tmp_path: Path) -> None:
    path = tmp_path / "lib.so"
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    os.chmod(path, 0o755)
    try:
        script.evict([path])
    except SystemExit:
        pytest.skip("this file system keeps its pages in memory (tmpfs)")
    script.rewrite_large([path])
    assert script.resident_bytes(path) == 3 << 20 and not list(tmp_path.glob("*.rewrite"))  # before any read
    assert path.read_bytes() == data and os.stat(path).st_mode & 0o777 == 0o755


def test_eviction_fails_when_a_process_maps_the_file(script, tmp_path: Path) -> None:
    """A mapped page cannot be dropped: measuring the 'faulted' state would then measure the mapped one (what made
    the previous script write the same state twice in a venv other processes use)."""
    path = tmp_path / "lib.so"
    path.write_bytes(os.urandom(4 << 20))
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as view:
        assert sum(view[i] for i in range(0, len(view), mmap.PAGESIZE)) >= 0  # every page faulted in and mapped
        with pytest.raises(SystemExit, match="stay cached after eviction"):
            script.evict([path])


def test_the_calibration_script_writes_a_module_planning_can_load(script) -> None:
    values = {"INTERPRETER": 1, "WORKBENCH": {"cli": 2, "worker": 3}, "LIBRARY": {"numpy": 4, "torch": 5},
              "LIBRARY_SPREAD": {"numpy": 0, "torch": 7}, "PER_TENSOR": 6,
              "REMOTE_LIBRARIES": {"http": 8, "hf": 9, "s3": 10}, "TRANSFORMERS_BYTES": 11}
    scope: dict = {}
    # the text --write puts in workbench/planning/rss_calibration.py
    exec(script.module_text({**values, "ROW_LIBRARIES": {"ml_dtypes": 12}}, 3), scope)
    assert {k: scope[k] for k in values} == values
    assert scope["ML_DTYPES_BYTES"] == 12
    assert scope["MEASURED_WITH"] == script.measured_with()


def test_planning_reads_every_library_constant_from_the_calibration(script) -> None:
    from workbench.planning import rss

    assert rss.REMOTE_LIBRARIES is calibrated.REMOTE_LIBRARIES and set(calibrated.REMOTE_LIBRARIES) == set(script.SCHEMES)
    assert rss.TRANSFORMERS_BYTES == calibrated.TRANSFORMERS_BYTES > 0
    assert all(calibrated.LIBRARY[name] > calibrated.LIBRARY_SPREAD[name] >= 0 for name in calibrated.LIBRARY)
