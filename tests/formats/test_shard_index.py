"""HF sharded checkpoints: the index is untrusted input, opening reads headers only, and it scales.

Each broken index or shard set must be refused with a message naming the file, the tensor and what
to do; opening a sound one must read exactly the shard headers and nothing of the tensor data.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from workbench.errors import CheckpointError
from workbench.explore.verify import verify
from workbench.formats import open_catalog
from workbench.iostats import IO

INDEX = "model.safetensors.index.json"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


def write_sharded(folder: Path, shards: dict[str, dict[str, np.ndarray]], weight_map: dict | None = None) -> Path:
    """Shards written by the reference writer plus an index (derived from the shards unless given)."""
    folder.mkdir(parents=True, exist_ok=True)
    derived: dict[str, str] = {}
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        derived.update(dict.fromkeys(tensors, file))
    total = sum(t.nbytes for tensors in shards.values() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": derived if weight_map is None else weight_map}
    (folder / INDEX).write_text(json.dumps(index))
    return folder


def two_shards() -> dict[str, dict[str, np.ndarray]]:
    return {
        SHARD1: {"a.weight": np.arange(64, dtype=np.float32).reshape(8, 8), "a.bias": np.zeros(8, np.float32)},
        SHARD2: {"b.weight": np.ones((4, 8), np.float16), "b.bias": np.ones(4, np.float16)},
    }


def refused(folder: Path) -> CheckpointError:
    with pytest.raises(CheckpointError) as caught:
        open_catalog(folder)
    assert not verify(folder).ok  # verify reports the same fault instead of raising
    return caught.value


def test_sound_checkpoint_opens_and_maps_every_tensor(tmp_path: Path) -> None:
    folder = write_sharded(tmp_path / "ck", two_shards())
    catalog = open_catalog(folder)
    assert catalog.format == "hf-sharded"
    assert {n: t.file for n, t in catalog.tensors.items()} == {
        "a.weight": SHARD1, "a.bias": SHARD1, "b.weight": SHARD2, "b.bias": SHARD2,
    }
    assert catalog.read_bytes("a.weight") == np.arange(64, dtype=np.float32).tobytes()
    report = verify(folder)
    assert report.ok and not report.findings
    assert (report.files_checked, report.tensors, report.tensor_bytes) == (2, 4, catalog.total_bytes)


def test_opening_reads_only_the_shard_headers(tmp_path: Path) -> None:
    big = {f"layer.{i}.weight": np.full((256, 256), i, np.float32) for i in range(6)}
    shards = {f"model-0000{k}-of-00003.safetensors": dict(list(big.items())[2 * (k - 1) : 2 * k]) for k in (1, 2, 3)}
    folder = write_sharded(tmp_path / "ck", shards)
    IO.reset()
    catalog = open_catalog(folder)
    io = IO.snapshot()
    header_bytes = sum(f.header_bytes for f in catalog.files.values())
    assert io["bytes_read"] == header_bytes
    assert io["bytes_read"] < catalog.total_bytes / 1000
    assert len(io["files_opened"]) == 3
    assert header_bytes == sum(8 + int.from_bytes((folder / f).read_bytes()[:8], "little") for f in shards)


def test_missing_shard(tmp_path: Path) -> None:
    folder = write_sharded(tmp_path / "ck", two_shards())
    (folder / SHARD2).unlink()
    error = refused(folder)
    assert SHARD2 in str(error) and "missing" in str(error) and "Download the missing shard" in str(error)
    assert error.tensor in {"b.weight", "b.bias"} and repr(error.tensor) in str(error)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_shard_that_is_not_a_regular_file_is_named_so_without_blocking(tmp_path: Path, kind: str) -> None:
    folder = write_sharded(tmp_path / "ck", two_shards())
    (folder / SHARD2).unlink()
    os.mkfifo(folder / SHARD2) if kind == "fifo" else (folder / SHARD2).mkdir()
    error = refused(folder)  # a FIFO opened for reading would block here
    expected = "a FIFO" if kind == "fifo" else "a directory"
    assert f"{SHARD2} named by {INDEX} is not a regular file ({expected})" in str(error), str(error)
    assert "missing" not in str(error)
    messages = " ".join(e.message for e in verify(folder).errors)
    assert f"is not a regular file ({expected})" in messages and "missing" not in messages


def test_index_with_an_integer_of_thousands_of_digits_is_refused_clearly(tmp_path: Path) -> None:
    folder = write_sharded(tmp_path / "ck", two_shards())
    (folder / INDEX).write_text('{"metadata": {"total_size": ' + "9" * 5000 + '}, "weight_map": {}}')
    error = refused(folder)
    assert "integer of more than 4300 digits" in str(error) and INDEX in str(error)
    assert "set_int_max_str_digits" not in str(error)


def test_tensor_absent_from_the_shard_the_index_names(tmp_path: Path) -> None:
    weight_map = {"a.weight": SHARD1, "a.bias": SHARD1, "b.weight": SHARD2, "b.bias": SHARD2, "ghost": SHARD1}
    folder = write_sharded(tmp_path / "ck", two_shards(), weight_map)
    error = refused(folder)
    assert "'ghost'" in str(error) and SHARD1 in str(error) and "no shard holds it" in str(error)
    assert error.tensor == "ghost"


def test_index_names_the_wrong_shard(tmp_path: Path) -> None:
    weight_map = {"a.weight": SHARD2, "a.bias": SHARD1, "b.weight": SHARD2, "b.bias": SHARD2}
    folder = write_sharded(tmp_path / "ck", two_shards(), weight_map)
    error = refused(folder)
    assert "'a.weight'" in str(error) and f"it is in {SHARD1}" in str(error)


def test_tensor_present_in_two_shards(tmp_path: Path) -> None:
    shards = two_shards()
    shards[SHARD2]["a.bias"] = np.zeros(8, np.float32)
    weight_map = {"a.weight": SHARD1, "a.bias": SHARD1, "b.weight": SHARD2, "b.bias": SHARD2}
    folder = write_sharded(tmp_path / "ck", shards, weight_map)
    error = refused(folder)
    assert "'a.bias'" in str(error) and "two shards" in str(error)
    assert SHARD1 in str(error) and SHARD2 in str(error)


@pytest.mark.parametrize(
    "bad_path",
    ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors", "..\\outside.safetensors", "C:\\x.safetensors"],
)
def test_index_paths_that_escape_the_folder_are_refused(tmp_path: Path, bad_path: str) -> None:
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "outside.safetensors"))
    weight_map = {"a.weight": SHARD1, "a.bias": SHARD1, "b.weight": SHARD2, "b.bias": SHARD2, "x": bad_path}
    folder = write_sharded(tmp_path / "ck", two_shards(), weight_map)
    IO.reset()
    error = refused(folder)
    assert "outside the checkpoint folder" in str(error) and repr(bad_path) in str(error)
    assert "'x'" in str(error)
    assert not any("outside" in f or f == "/etc/passwd" for f in IO.snapshot()["files_opened"])


def test_symlink_leading_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "outside.safetensors"))
    weight_map = {"a.weight": SHARD1, "a.bias": SHARD1, "b.weight": SHARD2, "b.bias": SHARD2, "x": "linked.safetensors"}
    folder = write_sharded(tmp_path / "ck", two_shards(), weight_map)
    os.symlink(tmp_path / "outside.safetensors", folder / "linked.safetensors")
    error = refused(folder)
    assert "link that leads outside" in str(error) and "linked.safetensors" in str(error)


def test_symlink_inside_the_folder_is_fine(tmp_path: Path) -> None:
    folder = write_sharded(tmp_path / "ck", two_shards())
    (folder / "store").mkdir()
    os.replace(folder / SHARD2, folder / "store" / SHARD2)
    os.symlink(Path("store") / SHARD2, folder / SHARD2)
    assert len(open_catalog(folder)) == 4


@pytest.mark.parametrize(
    ("index_text", "expected"),
    [
        ("{not json", "not valid JSON"),
        ('{"metadata": {}}', 'no "weight_map" object'),
        ('{"weight_map": ["a"]}', 'no "weight_map" object'),
        ('["weight_map"]', 'no "weight_map" object'),
        ('{"weight_map": {"a.weight": ["model.safetensors"]}}', "is not a file name"),
        ('{"weight_map": {"a.weight": ""}}', "is not a file name"),
        ('{"weight_map": {"a.weight": 7}}', "is not a file name"),
    ],
)
def test_malformed_index(tmp_path: Path, index_text: str, expected: str) -> None:
    folder = write_sharded(tmp_path / "ck", two_shards())
    (folder / INDEX).write_text(index_text)
    error = refused(folder)
    assert expected in str(error)
    assert INDEX in str(error) or str(folder) in str(error)


def test_corrupt_shard_names_the_shard(tmp_path: Path) -> None:
    folder = write_sharded(tmp_path / "ck", two_shards())
    data = (folder / SHARD2).read_bytes()
    (folder / SHARD2).write_bytes(data[:-3])  # truncated download
    error = refused(folder)
    assert SHARD2 in str(error) and "truncated" in str(error)


def test_verify_lists_every_problem_at_once(tmp_path: Path) -> None:
    shards = two_shards()
    shards["model-00003-of-00003.safetensors"] = {"c": np.zeros(3, np.int64)}
    folder = write_sharded(tmp_path / "ck", shards)
    (folder / SHARD1).unlink()
    data = (folder / SHARD2).read_bytes()
    (folder / SHARD2).write_bytes(data + b"extra")
    (folder / "model-00003-of-00003.safetensors.partial").write_bytes(b"")
    report = verify(folder)
    assert not report.ok
    assert [f.file for f in report.errors] == [SHARD1, SHARD2]
    assert "missing" in report.errors[0].message and "trailing" in report.errors[1].message
    assert any("unfinished write" in w.message for w in report.warnings)


def test_verify_warns_about_stale_shards_and_wrong_total_size(tmp_path: Path) -> None:
    folder = write_sharded(tmp_path / "ck", two_shards())
    index = json.loads((folder / INDEX).read_text())
    index["metadata"]["total_size"] = 1
    (folder / INDEX).write_text(json.dumps(index))
    save_file({"old": np.zeros(1, np.float32)}, str(folder / "model-00001-of-00005.safetensors"))
    report = verify(folder)
    assert report.ok
    messages = " ".join(w.message for w in report.warnings)
    assert "total_size 1" in messages and "model-00001-of-00005.safetensors" in messages


def test_unlisted_tensor_is_a_warning_not_an_error(tmp_path: Path) -> None:
    weight_map = {"a.weight": SHARD1, "b.weight": SHARD2, "b.bias": SHARD2}
    folder = write_sharded(tmp_path / "ck", two_shards(), weight_map)
    catalog = open_catalog(folder)
    assert "a.bias" not in catalog and len(catalog.warnings) == 1 and "'a.bias'" in catalog.warnings[0]
    report = verify(folder)
    assert report.ok
    assert [w.tensor for w in report.warnings if "not listed" in w.message] == ["a.bias"]


# ------------------------------------------------------------------------------------- at scale


def _load_make_sparse():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "make_sparse.py"
    spec = importlib.util.spec_from_file_location("make_sparse", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_sparse"] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def llama_parameters(hidden: int, intermediate: int, heads: int, kv_heads: int, layers: int, vocab: int) -> int:
    """Parameter count of a Llama with untied embeddings, written out independently of make_sparse."""
    kv = kv_heads * (hidden // heads)
    per_layer = 2 * hidden * hidden + 2 * kv * hidden + 3 * hidden * intermediate + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


def test_sparse_llama_405b_shapes_open_from_headers(tmp_path: Path) -> None:
    make_sparse = _load_make_sparse()
    full = make_sparse.LLAMA_405B
    full_params = llama_parameters(full.hidden, full.intermediate, full.heads, full.kv_heads, full.layers, full.vocab)
    assert 405e9 < full_params < 406e9
    assert sum(math.prod(s) for _, s in full.tensors()) == full_params

    from dataclasses import replace

    small = replace(full, layers=3)
    stamp = make_sparse.make_sparse_llama(tmp_path / "ck", small, n_shards=7)
    folder = tmp_path / "ck"
    IO.reset()
    catalog = open_catalog(folder)
    params = llama_parameters(small.hidden, small.intermediate, small.heads, small.kv_heads, small.layers, small.vocab)
    assert len(catalog) == 9 * 3 + 3 == stamp["tensors"]
    assert catalog.total_bytes == 2 * params == stamp["bytes"]
    assert len(catalog.files) == 7
    assert {t.dtype for t in catalog.tensors.values()} == {"BF16"}
    assert catalog["model.layers.2.mlp.down_proj.weight"].shape == (16384, 53248)
    assert catalog["model.layers.0.self_attn.k_proj.weight"].shape == (1024, 16384)
    assert catalog["lm_head.weight"].shape == (128256, 16384)
    assert IO.snapshot()["bytes_read"] == sum(f.header_bytes for f in catalog.files.values())
    # The files are holes: gigabytes apparent, almost nothing on disk.
    assert sum(f.size for f in catalog.files.values()) > 2 * params
    assert sum(os.stat(folder / f).st_blocks * 512 for f in catalog.files) < 10 << 20
    assert verify(folder).ok


def test_fifo_named_like_an_index_is_never_read(tmp_path: Path) -> None:
    import contextlib
    import threading

    folder = tmp_path / "ck"
    folder.mkdir()
    save_file({"w": np.ones(2, np.float32)}, str(folder / "model.safetensors"))
    fifo = folder / "other.safetensors.index.json"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer
    # Opened on a thread, not under SIGALRM: the alarm timer is the one pytest-timeout arms for every test, and
    # taking it over cancelled the suite's own time limit for this test.
    opened: list = []

    def open_it() -> None:
        try:
            opened.append(open_catalog(folder))
        except BaseException as exc:  # noqa: BLE001 - raised on the test's thread below
            opened.append(exc)

    opening = threading.Thread(target=open_it, daemon=True)
    opening.start()
    opening.join(20)
    if opening.is_alive():  # blocked on the FIFO: a writer end lets that open return, then fail the test
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        opening.join(20)
        pytest.fail("opening the checkpoint blocked on a FIFO")
    (catalog,) = opened
    if isinstance(catalog, BaseException):
        raise catalog
    assert list(catalog.tensors) == ["w"]
