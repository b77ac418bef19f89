"""The conversion benchmark harness: its inputs are what they claim, its measurements are the child's own."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


make = _load("bench_make_llama_like", BENCH / "make_llama_like.py")
run = _load("bench_run", BENCH / "run.py")


def test_llama_shape_reaches_requested_size_with_tinyllama_widths():
    shape = make.llama_shape_for_size(2 << 30)
    total = sum(4 * math.prod(s) for _, s in shape.tensors())
    assert (shape.hidden, shape.intermediate, shape.heads, shape.kv_heads) == (2048, 5632, 32, 4)
    assert 0.95 * (2 << 30) <= total <= 1.1 * (2 << 30)
    names = dict(shape.tensors())
    assert names["model.layers.0.self_attn.k_proj.weight"] == (256, 2048)  # 4 kv heads x 64
    assert names["model.layers.0.mlp.down_proj.weight"] == (2048, 5632)
    assert "lm_head.weight" in names


def test_tiny_checkpoint_is_hf_sharded_with_index_config_and_reused(tmp_path):
    folder = tmp_path / "tiny"
    stamp = make.make_tiny_tensors(folder, 200, shards=3)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert stamp["tensors"] == len(index["weight_map"]) >= 200
    assert len(set(index["weight_map"].values())) == 3
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == (stamp["tensors"] - 3) // 9
    shard = folder / sorted(set(index["weight_map"].values()))[0]
    raw = shard.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"F32"}
    before = shard.stat().st_mtime_ns
    make.make_tiny_tensors(folder, 200, shards=3)  # same stamp: reused, not rewritten
    assert shard.stat().st_mtime_ns == before


@pytest.mark.serial  # measures peak RSS and wall time
def test_child_peak_rss_is_the_childs_not_the_harness(tmp_path):
    ballast = bytearray(300 << 20)  # makes this process big; a small child must not look big
    ballast[::4096] = b"x" * len(ballast[::4096])
    small = run.run_child(["true"], tmp_path / "true.log")
    big = run.run_child([sys.executable, "-c", "b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096])"], tmp_path / "big.log")
    assert small.returncode == 0 and small.maxrss_kb < 50 << 10
    assert big.maxrss_kb > 200 << 10
    failed = run.run_child([sys.executable, "-c", "raise SystemExit('boom: exact reason')"], tmp_path / "fail.log")
    assert failed.returncode == 1
    assert "boom: exact reason" in run.last_error_line(tmp_path / "fail.log")
    hung = run.run_child(["sh", "-c", "sleep 30"], tmp_path / "hung.log", timeout=0.5)
    assert hung.returncode != 0 and "killed after" in hung.error and hung.wall_s < 10


def test_only_selects_by_prefix_and_keeps_the_baseline():
    names = [c.name for c in run.select(run.contenders(), "d9d")]
    assert names == ["cp-sync", "d9d-pass", "d9d-fuse"]
    with pytest.raises(SystemExit, match="matches no contender"):
        run.select(run.contenders(), "nope")


def test_end_to_end_report_on_tiny_input(tmp_path, capsys):
    run.main(["--workdir", str(tmp_path), "--only", "tiny-cp", "--repeat", "2", "--tiny-tensors", "300",
              "--settle", "0", "--prime", "0.01"])
    text = capsys.readouterr().out
    assert "| tiny-cp-sync |" in text and "### Targets" in text
    assert "0.01 GiB of memory touched and freed" in text
    raw = json.loads((tmp_path / "results.json").read_text())
    row = raw["contenders"]["tiny-cp-sync"]
    assert len(row["runs"]) == 2 and all(r["returncode"] == 0 for r in row["runs"])
    assert row["ratio_to_cp_sync"] == pytest.approx(1.0)
    assert not (tmp_path / "out" / "tiny-cp-sync").exists()  # outputs dropped between runs


paired = _load("bench_paired", BENCH / "paired.py")


def test_bf16_synthetic_checkpoint_has_bf16_tensors_and_the_bytes_asked_for(tmp_path):
    folder = tmp_path / "bf16"
    stamp = make.make_synthetic_llama(folder, 0.05, shards=2, dtype="BF16")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert stamp["dtype"] == "BF16" and index["metadata"]["total_size"] == stamp["bytes"]
    f32 = make.llama_shape_for_size(int(0.1 * (1 << 30)))  # the same element count at 4 bytes: twice the size
    assert stamp["shape"]["layers"] == f32.layers and stamp["bytes"] == sum(2 * math.prod(s) for _, s in f32.tensors())
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    shard = folder / index["weight_map"]["model.norm.weight"]
    raw = shard.read_bytes()
    start = 8 + int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:start])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    first, last = header["model.norm.weight"]["data_offsets"]
    assert raw[start + first : start + last] == b"\x80\x3f" * 2048  # norms are 1.0: bf16 0x3F80, little-endian


def test_paired_ratios_are_per_pair_medians():
    runs = lambda walls, sys_s: [paired.Run(w, 0.1, s, 0) for w, s in zip(walls, sys_s, strict=True)]  # noqa: E731
    result = paired.Pairs(paired.WORKLOADS[0], 10**9, engine=runs([1.0, 2.0, 1.0], [0.2, 0.4, 0.3]), copy=runs([2.0, 2.0, 3.0], [0.2, 0.2, 0.2]))
    row = paired.table([result]).splitlines()[-1]
    assert "| 2.00 (1.00–3.00) | ≥ 1.0 (pass) |" in row  # cp wall / workbench wall: 2, 1, 3
    assert row.endswith("| 1.50 (1.00–2.00) |")  # sys ratios 1, 2, 1.5


def test_paired_end_to_end_on_a_small_input(tmp_path, capsys):
    paired.main(["--workdir", str(tmp_path), "--only", "pass-256", "--pairs", "1", "--settle", "0", "--size-gib", "0.05"])
    text = capsys.readouterr().out
    assert "| pass-through re-shard, bf16, 4 shards -> 256MB shards | 0.09 |" in text
    assert (tmp_path / "paired.md").read_text().strip() == text.strip()
    raw = json.loads((tmp_path / "paired.json").read_text())
    assert raw[0]["workload"] == "pass-256" and len(raw[0]["engine"]) == len(raw[0]["copy"]) == 1
    assert not (tmp_path / "paired-scratch").exists()
