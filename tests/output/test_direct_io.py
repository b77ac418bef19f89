"""Direct writes (`output.direct_io`): long output runs assembled in buffers and written with O_DIRECT.

The bytes must not depend on the path taken (direct, buffered kernel copies, a filesystem that refuses O_DIRECT),
a failing direct write must fail the run with nothing committed, and the plan must count the buffers.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
from pathlib import Path

import pytest

import workbench as wb
from tests.conftest import assert_same_folder, llama_like_tensors, load_safetensors_folder
from workbench.errors import WorkbenchError
from workbench.mapper import presets
from workbench.output import direct_io
from workbench.output.safetensors import _ReadCursor

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")

HIDDEN = 512  # q is 512 KiB in float32, a fused q/k/v 1 MiB: long runs, partial pages at the shards' header ends
CONFIG = {"model_type": "llama", "hidden_size": HIDDEN, "num_attention_heads": 8, "num_key_value_heads": 4,
          "intermediate_size": 2 * HIDDEN, "num_hidden_layers": 2}


@pytest.fixture
def sharded(tiny_checkpoint) -> Path:
    import json

    folder = tiny_checkpoint(llama_like_tensors(layers=2, hidden=HIDDEN), name="src", shards=3)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


@pytest.fixture(autouse=True)
def direct_on(monkeypatch) -> None:
    """Direct writes are opt-in (`WORKBENCH_DIRECT_IO=1`): on for every test here unless a test turns them off."""
    monkeypatch.setenv("WORKBENCH_DIRECT_IO", "1")
    direct_io.supported.cache_clear()
    yield
    direct_io.supported.cache_clear()


@pytest.fixture
def submitted(monkeypatch) -> list[tuple[int, int]]:
    """(offset, length) of every direct write the run submits."""
    calls: list[tuple[int, int]] = []
    original = direct_io.DirectWrites.submit

    def counting(self, fd, buffer, offset, length):
        calls.append((offset, length))
        return original(self, fd, buffer, offset, length)

    monkeypatch.setattr(direct_io.DirectWrites, "submit", counting)
    return calls


def _needs_direct(folder: Path) -> None:
    if not direct_io.supported(str(folder)):
        pytest.skip(f"the filesystem of {folder} refuses O_DIRECT")


@pytest.mark.parametrize("case", ["one-file", "fuse"])
def test_direct_writes_give_the_bytes_of_buffered_copies(sharded: Path, tmp_path: Path, submitted, monkeypatch, case: str) -> None:
    _needs_direct(tmp_path)
    mapper = presets.hf_to_fused(sharded / "config.json") if case == "fuse" else None
    direct = wb.convert(sharded, tmp_path / "direct", mapper=mapper, shard_size="5GB")
    assert submitted, "no run was long enough for direct writes"
    assert all(offset % 4096 == 0 and length % 4096 == 0 for offset, length in submitted)
    monkeypatch.setenv("WORKBENCH_DIRECT_IO", "0")
    count = len(submitted)
    buffered = wb.convert(sharded, tmp_path / "buffered", mapper=mapper, shard_size="5GB")
    assert len(submitted) == count  # the switch turns them off
    assert direct.ranks[0].bytes_written == buffered.ranks[0].bytes_written > 0  # direct writes are counted too
    assert_same_folder(tmp_path / "buffered", tmp_path / "direct")
    got = load_safetensors_folder(tmp_path / "direct")
    source = load_safetensors_folder(sharded)
    if case == "one-file":
        assert got.keys() == source.keys() and all(got[k].equal(source[k]) for k in source)
    else:
        import torch

        fused = got["model.layers.1.self_attn.qkv_proj.weight"]
        parts = [source[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
        assert fused.equal(torch.cat(parts))


def test_a_filesystem_refusing_direct_writes_keeps_the_buffered_path(sharded: Path, tmp_path: Path, submitted, monkeypatch) -> None:
    from workbench.output import safetensors as writer_module

    monkeypatch.setattr(writer_module, "reopen_direct", lambda fd: None)
    wb.convert(sharded, tmp_path / "out", shard_size="5GB")
    assert submitted == []
    got = load_safetensors_folder(tmp_path / "out")
    source = load_safetensors_folder(sharded)
    assert all(got[k].equal(source[k]) for k in source)


def test_a_failing_direct_write_fails_the_run_and_commits_nothing(sharded: Path, tmp_path: Path, monkeypatch) -> None:
    _needs_direct(tmp_path)
    real_pwrite = os.pwrite

    def full_disk(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_disk)
    out = tmp_path / "out"
    with pytest.raises(WorkbenchError, match="(?i)space"):
        wb.convert(sharded, out, shard_size="5GB")
    left = sorted(os.listdir(out)) if out.exists() else []
    assert not [n for n in left if n.endswith((".safetensors", ".partial")) or n == "model.safetensors.index.json"], left


def test_the_plan_counts_the_direct_write_buffers(sharded: Path, tmp_path: Path, monkeypatch) -> None:
    _needs_direct(tmp_path)
    frame = wb.plan(sharded, dest=tmp_path / "out", shard_size="5GB").rss_breakdown
    assert "direct-write buffers" in frame.loc["buffers", "detail"]
    monkeypatch.setenv("WORKBENCH_DIRECT_IO", "0")
    direct_io.supported.cache_clear()
    without = wb.plan(sharded, dest=tmp_path / "out", shard_size="5GB").rss_breakdown
    added = frame.loc["buffers", "bytes"] - without.loc["buffers", "bytes"]
    assert added == min(direct_io.pool_bytes(), -(-wb.open_checkpoint(sharded).catalog.total_bytes // 4096) * 4096)
    direct_io.supported.cache_clear()


def test_the_read_cursor_assembles_any_tiling_of_scattered_sources(tmp_path: Path) -> None:
    from workbench.output.safetensors import SafetensorsWriter

    rng = random.Random(7)
    blobs = [bytes(rng.getrandbits(8) for _ in range(40_000)) for _ in range(2)]
    fds = []
    for k, blob in enumerate(blobs):
        path = tmp_path / f"s{k}"
        path.write_bytes(blob)
        fds.append(os.open(path, os.O_RDONLY))
    try:
        reads, expected, at = [], bytearray(), 0
        while at < 30_000:  # runs of the destination taken from random places, some adjacent in the source
            k = rng.randrange(2)
            length = rng.randrange(1, 3000)
            start = rng.randrange(0, 40_000 - length) if not reads or rng.random() < 0.6 else reads[-1][1] + reads[-1][3]
            if reads and rng.random() >= 0.6:
                k = fds.index(reads[-1][0])
                length = min(length, 40_000 - start)
                if length <= 0:
                    continue
            reads.append((fds[k], start, at, length))
            expected += blobs[k][start : start + length]
            at += length
        cursor = _ReadCursor(SafetensorsWriter.__new__(SafetensorsWriter), reads, 1000)
        got = bytearray(len(expected))
        position = 0
        while position < len(expected):
            step = min(rng.randrange(1, 9000), len(expected) - position)
            cursor.fill(memoryview(got)[position : position + step], 1000 + position)
            position += step
        assert got == expected
    finally:
        for fd in fds:
            os.close(fd)


def test_direct_writes_are_off_unless_asked(sharded: Path, tmp_path: Path, submitted, monkeypatch) -> None:
    monkeypatch.delenv("WORKBENCH_DIRECT_IO")
    direct_io.supported.cache_clear()
    assert "direct-write" not in wb.plan(sharded, dest=tmp_path / "out", shard_size="5GB").rss_breakdown.loc["buffers", "detail"]
    wb.convert(sharded, tmp_path / "out", shard_size="5GB")
    assert submitted == []
