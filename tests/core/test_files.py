"""Every file the workbench creates is created without following what a hostile folder planted there.

For each name a conversion, a DCP conversion, a two-rank local launch or `verify --checksums` writes, a
symlink to a file outside, a FIFO and a directory are planted under that name; the operation must leave
the outside file as it was and either succeed (the planted entry replaced or removed, never written
through) or fail with a WorkbenchError naming the path, and never hang on the FIFO.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

import workbench as wb
from workbench.cli import main as cli_main
from workbench.conversion import execute
from workbench.errors import UnsafeFileError, WorkbenchError
from workbench.explore.verify import verify
from workbench.files import AtomicWriter, atomic_write, claim_temp, create_exclusive, open_regular
from workbench.output.lock import LOCK_NAME, DestinationLock
from workbench.planning.destination import MANIFEST_NAME

OUTSIDE = b"the outside file: must never change\n"
SHARD = "model-00001-of-00003.safetensors"
INDEX = "model.safetensors.index.json"
SIDECAR = "checksums.sha256.json"

# (operation, name planted in the folder the operation writes)
CONVERT_NAMES = [LOCK_NAME, SHARD + ".partial", SHARD, INDEX + ".partial", INDEX, MANIFEST_NAME + ".partial",
                 MANIFEST_NAME, "config.json.partial", "config.json"]
CASES = (
    [("convert", n) for n in CONVERT_NAMES]
    + [("dcp", n) for n in ["__0_0.distcp.partial", "__0_0.distcp", ".metadata.partial", ".metadata", LOCK_NAME]]
    + [("local2", n) for n in [LOCK_NAME, SHARD + ".partial", INDEX + ".partial"]]
    + [("checksums", n) for n in [SIDECAR + ".partial", SIDECAR]]
)
PLANTS = ["symlink", "fifo", "directory"]


@pytest.fixture
def source(tiny_checkpoint) -> Path:
    folder = tiny_checkpoint(layers=4, hidden=16, shards=2)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    return folder


def _plant(at: Path, kind: str, outside: Path) -> None:
    if kind == "symlink":
        at.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(at)
    else:
        at.mkdir()
        (at / "inside").write_bytes(OUTSIDE)


def _run(operation: str, source: Path, folder: Path) -> None:
    if operation == "checksums":
        report = verify(folder, checksums=True)
        if not report.ok:
            raise WorkbenchError(" ".join(p.message for p in report.errors))
        assert report.checksums is not None and report.checksums.action in ("recorded", "checked")
        return
    options = {"shard_size": "16KB", "overwrite": True, "quiet": True}
    if operation == "dcp":
        wb.convert(source, folder, to="dcp", **options)
    elif operation == "local2":
        wb.convert(source, folder, nproc=2, launcher="local", **options)
    else:
        wb.convert(source, folder, **options)
    assert verify(folder).ok


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plant", PLANTS)
@pytest.mark.parametrize(("operation", "name"), CASES, ids=[f"{op}:{n}" for op, n in CASES])
def test_a_planted_entry_is_never_written_through(tmp_path: Path, source: Path, operation: str, name: str, plant: str) -> None:
    outside = tmp_path / "elsewhere"
    outside.write_bytes(OUTSIDE)
    if operation == "checksums":
        folder = source  # verify writes the sidecar beside the checkpoint it checks
    else:
        folder = tmp_path / "out"
        folder.mkdir()
    planted = folder / name
    _plant(planted, plant, outside)
    try:
        _run(operation, source, folder)
    except WorkbenchError as exc:
        assert str(planted) in str(exc), exc  # a clear refusal names the entry
    else:  # the planted entry was removed (a temporary name) or replaced by the workbench's own regular file
        assert not os.path.lexists(planted) or stat.S_ISREG(os.lstat(planted).st_mode)
    assert outside.read_bytes() == OUTSIDE
    if plant == "directory" and planted.is_dir():
        assert (planted / "inside").read_bytes() == OUTSIDE
    assert not any(p.is_symlink() for p in folder.iterdir() if p != planted), "no output is a link"


@pytest.mark.timeout(60)
def test_verify_checksums_with_a_symlinked_partial_records_a_real_sidecar(tmp_path: Path, source: Path) -> None:
    """The issue's report: `checksums.sha256.json.partial -> /elsewhere` made verify write /elsewhere and trust it."""
    outside = tmp_path / "elsewhere"
    outside.write_bytes(OUTSIDE)
    (source / (SIDECAR + ".partial")).symlink_to(outside)
    assert cli_main(["verify", str(source), "--checksums"]) == 0
    assert outside.read_bytes() == OUTSIDE
    sidecar = source / SIDECAR
    assert not sidecar.is_symlink() and json.loads(sidecar.read_text())["kind"] == "workbench-checksums"
    assert cli_main(["verify", str(source), "--checksums"]) == 0  # checked against the real sidecar


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plant", ["symlink", "fifo", "directory"])
def test_a_planted_sidecar_is_refused_when_checked(tmp_path: Path, source: Path, plant: str) -> None:
    outside = tmp_path / "elsewhere"
    outside.write_bytes(OUTSIDE)
    _plant(source / SIDECAR, plant, outside)
    report = verify(source, checksums=True)
    assert not report.ok
    assert any(f"{plant if plant != 'fifo' else 'FIFO'}" in p.message and SIDECAR in p.message for p in report.errors), report.errors
    assert outside.read_bytes() == OUTSIDE


@pytest.mark.timeout(60)
def test_a_planted_lock_is_refused_before_anything_is_written(tmp_path: Path, source: Path, capsys) -> None:
    """The issue's report: `<dest>/.workbench.lock -> /elsewhere` was truncated and overwritten by convert."""
    outside, dest = tmp_path / "elsewhere", tmp_path / "out"
    outside.write_bytes(OUTSIDE)
    dest.mkdir()
    (dest / LOCK_NAME).symlink_to(outside)
    assert cli_main(["convert", str(source), str(dest), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{LOCK_NAME} is a symlink ({dest / LOCK_NAME})" in err
    assert outside.read_bytes() == OUTSIDE
    assert sorted(os.listdir(dest)) == [LOCK_NAME]
    with pytest.raises(UnsafeFileError, match="it is a symlink"):  # the lock itself refuses too (a plan made before)
        DestinationLock(dest).acquire()


@pytest.mark.timeout(60)
def test_a_hard_linked_lock_is_refused(tmp_path: Path) -> None:
    outside, dest = tmp_path / "elsewhere", tmp_path / "out"
    outside.write_bytes(OUTSIDE)
    dest.mkdir()
    os.link(outside, dest / LOCK_NAME)
    with pytest.raises(UnsafeFileError, match="other hard link"):
        DestinationLock(dest).acquire()
    assert outside.read_bytes() == OUTSIDE


@pytest.mark.timeout(60)
def test_a_symlinked_shard_is_never_kept_on_resume(tmp_path: Path, source: Path) -> None:
    """An interrupted run's folder with a shard name linked to a complete copy elsewhere: rewritten, not trusted."""
    reference, dest = tmp_path / "reference", tmp_path / "out"
    wb.convert(source, reference, shard_size="16KB", quiet=True)
    plan = wb.plan(source, dest=dest, shard_size="16KB")
    from workbench.engine.finalize import prepare_destination

    prepare_destination(plan)  # what an interrupted run leaves: the manifest, no shards yet
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copyfile(reference / SHARD, outside)
    before = outside.read_bytes()
    (dest / SHARD).symlink_to(outside)
    plan = wb.plan(source, dest=dest, shard_size="16KB")
    assert SHARD not in plan.kept
    execute(plan, quiet=True)
    assert not (dest / SHARD).is_symlink() and (dest / SHARD).read_bytes() == before
    assert outside.read_bytes() == before and verify(dest).ok


@pytest.mark.timeout(60)
def test_a_fifo_under_a_shard_name_does_not_hang_planning(tmp_path: Path, source: Path) -> None:
    dest = tmp_path / "out"
    plan = wb.plan(source, dest=dest, shard_size="16KB")
    from workbench.engine.finalize import prepare_destination

    prepare_destination(plan)
    os.mkfifo(dest / SHARD)
    plan = wb.plan(source, dest=dest, shard_size="16KB")
    assert SHARD not in plan.kept
    execute(plan, quiet=True)
    assert verify(dest).ok


@pytest.mark.timeout(60)
def test_a_folder_planted_after_planning_is_refused_by_name(tmp_path: Path, source: Path) -> None:
    """A plan made before the folder appeared: the writer itself refuses the name, cleanup does not mask it."""
    dest = tmp_path / "out"
    plan = wb.plan(source, dest=dest, shard_size="16KB")
    dest.mkdir()
    (dest / (SHARD + ".partial")).mkdir()
    with pytest.raises(UnsafeFileError, match=f"it is a directory \\({dest / SHARD}.partial\\)"):
        execute(plan, quiet=True)
    assert (dest / (SHARD + ".partial")).is_dir() and not (dest / INDEX).exists()


# ------------------------------------------------------------------------------ the policy module itself


def test_create_exclusive_refuses_every_existing_entry(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.write_bytes(OUTSIDE)
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    for name in ["dangling", "elsewhere"]:
        with pytest.raises(UnsafeFileError, match=f"Cannot write {name}"):
            create_exclusive(tmp_path / name)
    assert not (tmp_path / "nothing").exists() and outside.read_bytes() == OUTSIDE


def test_claim_temp_unlinks_a_planted_link_and_refuses_a_directory(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.write_bytes(OUTSIDE)
    (tmp_path / "x.partial").symlink_to(outside)
    os.close(claim_temp(tmp_path / "x.partial"))
    assert not (tmp_path / "x.partial").is_symlink() and outside.read_bytes() == OUTSIDE
    (tmp_path / "d.partial").mkdir()
    with pytest.raises(UnsafeFileError, match=r"Cannot write d.partial: it is a directory \(.*\)\. Remove it"):
        claim_temp(tmp_path / "d.partial")


@pytest.mark.timeout(30)
def test_open_regular_refuses_links_fifos_and_folders_without_blocking(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.write_bytes(OUTSIDE)
    (tmp_path / "link").symlink_to(outside)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for name, what in [("link", "a symlink"), ("fifo", "a FIFO"), ("dir", "a directory")]:
        with pytest.raises(UnsafeFileError, match=f"it is {what}"):
            open_regular(tmp_path / name)
    os.close(open_regular(outside))


def test_atomic_write_replaces_the_entry_and_leaves_no_temporary(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.write_bytes(OUTSIDE)
    target = tmp_path / "target.json"
    target.symlink_to(outside)
    atomic_write(target, "new\n")
    assert not target.is_symlink() and target.read_text() == "new\n" and outside.read_bytes() == OUTSIDE
    with pytest.raises(RuntimeError), AtomicWriter(target) as writer:
        writer.write(b"half")
        raise RuntimeError("stop")
    assert target.read_text() == "new\n" and sorted(os.listdir(tmp_path)) == ["elsewhere", "target.json"]
