"""The chunked cast's fast path: torch-free float32 -> bfloat16, one reused arena, writes behind the next piece.

Outputs must stay byte-identical to torch's `.to(dtype)` and the measured peak equal to the plan's.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import workbench as wb
from tests.conftest import load_safetensors_folder
from workbench.engine import bf16, cast_buffers
from workbench.errors import PlanError
from workbench.mapper import presets
from workbench.output.safetensors import SafetensorsWriter


def torch_bits(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_numpy_bf16_matches_torch_bit_for_bit_except_nan(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    patterns = np.concatenate([
        rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32),  # every kind of float, NaN excluded below
        np.array([0, 0x80000000, 1, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,  # zeros, subnormals, max, inf
                  0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF], dtype=np.uint32),  # ties to even, either side
    ])
    values = patterns.view(np.float32)
    values = values[~np.isnan(values)]
    out = bytearray(2 * len(values))
    overflowed = bf16.Float32ToBFloat16().convert(values.tobytes(), out, len(values))
    assert np.array_equal(np.frombuffer(out, dtype=np.uint16), torch_bits(values))
    finite = values[np.isfinite(values)]
    became_inf = np.isinf(torch.from_numpy(finite).to(torch.bfloat16).float().numpy())
    assert overflowed == (int(became_inf.sum()), float(np.abs(finite[became_inf]).max())) and overflowed[0] > 0
    with_nan = values.copy()
    with_nan[len(values) // 2] = np.nan
    assert bf16.Float32ToBFloat16().convert(with_nan.tobytes(), bytearray(2 * len(values)), len(values)) is None
    assert bf16.numpy_castable("F32", "BF16") and not bf16.numpy_castable("F16", "BF16")
    # The engine's form: values read from a file (at an offset that is not a multiple of 4) block by block.
    path = tmp_path / "values.bin"
    path.write_bytes(b"xyz" + values.tobytes() + with_nan.tobytes())
    staging = memoryview(bytearray(4 * bf16.BLOCK))
    fd = os.open(path, os.O_RDONLY)
    try:
        from_file = bytearray(2 * len(values))
        assert bf16.Float32ToBFloat16().convert_file(fd, 3, staging, from_file, len(values)) == overflowed
        assert from_file == out
        assert bf16.Float32ToBFloat16().convert_file(fd, 3 + 4 * len(values), staging, from_file, len(values)) is None
    finally:
        os.close(fd)


@pytest.fixture
def mixed_source(tiny_checkpoint) -> Path:
    """F32 tensors of several sizes (one holding NaN and infinities) and an F16 one: every path of the cast."""
    gen = torch.Generator().manual_seed(3)
    odd = torch.randn(5001, generator=gen)
    odd[[7, 4000]] = float("nan")
    odd[9] = float("inf")
    tensors = {
        "big.weight": torch.randn(300, 1000, generator=gen),
        "half.weight": torch.randn(64, 64, generator=gen).to(torch.float16),
        "odd.weight": odd,
        "small.bias": torch.randn(3, generator=gen),
        "tail.weight": torch.randn(999, 77, generator=gen),
    }
    return tiny_checkpoint(tensors, shards=2)


@pytest.mark.parametrize(("write_behind_min", "numpy_first"), [(0, True), (1 << 20, True), (0, False)])
def test_cast_is_bytewise_torch_and_peak_is_predicted(mixed_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      write_behind_min: int, numpy_first: bool) -> None:
    monkeypatch.setattr(cast_buffers, "WRITE_BEHIND_MIN", write_behind_min)  # 0: every piece written in the background
    monkeypatch.setattr(cast_buffers, "PREFER_TORCH_ONCE_IMPORTED", not numpy_first)  # pytest has imported torch
    outcomes: list[bool] = []
    convert = bf16.Float32ToBFloat16.convert_file  # the engine reads and converts block by block
    monkeypatch.setattr(bf16.Float32ToBFloat16, "convert_file",
                        lambda self, *a: outcomes.append(convert(self, *a)) or outcomes[-1])
    threads = torch.get_num_threads()
    dest = tmp_path / "out"
    plan = wb.plan(mixed_source, dest=dest, dtype="bf16", chunk_size="64KB")
    report = wb.convert(mixed_source, dest, dtype="bf16", chunk_size="64KB", quiet=True)
    expected = {n: t.to(torch.bfloat16) for n, t in load_safetensors_folder(mixed_source).items()}
    got = load_safetensors_folder(dest)
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name
    assert report.peak_tensor_bytes == report.predicted_peak_bytes == plan.peak_bytes == 16000 * 4 + 16000 * 2  # 64KB (decimal) of F32 per chunk
    assert report.bytes_read == plan.bytes_read and report.files_match_plan
    assert torch.get_num_threads() == threads  # the cast's single intra-op thread is given back
    assert {o is not None for o in outcomes} == ({True, False} if numpy_first else set())  # numpy, and torch for NaN chunks
    assert not [n for n in os.listdir(dest) if n.endswith(".partial")]


def test_fused_cast_mixes_piece_and_cast_steps_within_the_predicted_peak(llama_sample: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cast_buffers, "WRITE_BEHIND_MIN", 0)
    mapper = presets.hf_to_fused(llama_sample / "config.json")
    plan = wb.plan(llama_sample, mapper, dtype="bf16", chunk_size="8KB")
    kinds = {s.kind for s in plan.steps}
    assert kinds == {"cast", "pieces"}  # the fused outputs: each input cast on its own (`mapper.pieces`)
    report = wb.convert(llama_sample, tmp_path / "out", mapper, dtype="bf16", chunk_size="8KB", quiet=True)
    assert report.peak_tensor_bytes == plan.peak_bytes  # the cast arena is freed before a compute step holds its own


def test_a_failed_background_write_stops_the_run_cleanly(mixed_source: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cast_buffers, "WRITE_BEHIND_MIN", 0)
    calls = []
    original = SafetensorsWriter.write

    def failing_write(self, name, data, at=0):
        calls.append(threading.current_thread().name)
        if len(calls) == 4:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.partial_path))
        return original(self, name, data, at)

    monkeypatch.setattr(SafetensorsWriter, "write", failing_write)
    dest = tmp_path / "out"
    with pytest.raises(PlanError, match="the disk is full"):
        wb.convert(mixed_source, dest, dtype="bf16", chunk_size="64KB", quiet=True)
    assert len(calls) == 4 and all(c.startswith("workbench-cast-write") for c in calls)  # written behind, in the thread
    assert sorted(os.listdir(dest)) == [".workbench-convert.json"]  # only the resume manifest: no shard, no index


def test_a_float32_to_bfloat16_run_never_imports_torch(mixed_source: Path, tmp_path: Path) -> None:
    source = tmp_path / "f32"
    source.mkdir()
    tensors = {n: t for n, t in load_safetensors_folder(mixed_source).items() if t.dtype == torch.float32 and not t.isnan().any()}
    from safetensors.torch import save_file

    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    code = (
        "import sys, json, workbench as wb\n"
        "r = wb.convert(sys.argv[1], sys.argv[2], dtype='bf16', quiet=True)\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'peak': r.peak_tensor_bytes, 'predicted': r.predicted_peak_bytes}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(source), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["torch"] is False and result["peak"] == result["predicted"] > 0
    got = load_safetensors_folder(tmp_path / "out")
    assert all(torch.equal(got[n].view(torch.int16), t.to(torch.bfloat16).view(torch.int16)) for n, t in tensors.items())
