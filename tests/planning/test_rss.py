"""`plan.rss_bytes`: the predicted process memory of each rank, part by part, and a real run measured against it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import workbench as wb
from tests.conftest import run_cli_measured
from workbench import mapper as M
from workbench.catalog import TensorInfo
from workbench.display import format_bytes
from workbench.output.safetensors import layout_file
from workbench.planning import rss_calibration as calibrated
from workbench.planning.rss import calibration_mismatch, intermediate_bytes, rank_libraries, rss_parts

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


pytestmark = pytest.mark.serial  # measures peak RSS: run alone (see conftest.SERIAL_MARKERS)


def f32(name: str, *shape: int) -> TensorInfo:
    return TensorInfo(name, "F32", tuple(shape))


def write_headers_only(folder: Path, name: str, infos: list[TensorInfo]) -> Path:
    """One safetensors file with a real header and zero data (planning never reads tensor data)."""
    folder.mkdir(parents=True, exist_ok=True)
    layout = layout_file(name, infos)
    with open(folder / name, "wb") as fh:
        fh.write(layout.header)
        fh.truncate(layout.size)
    return folder


@pytest.fixture
def two_layers(tmp_path: Path) -> Path:
    """Two Llama-like layers of 1 MiB projections (headers only: planning reads no data)."""
    names = [f"model.layers.{i}.mlp.{p}.weight" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    return write_headers_only(tmp_path / "src", "model.safetensors", [f32(n, 512, 512) for n in names])


def parts_of(plan, rank: int = 0) -> dict[str, int]:
    return {p.part: p.bytes for p in rss_parts(plan, rank)}


def test_byte_copies_cost_python_and_workbench_only(two_layers: Path) -> None:
    plan = wb.plan(two_layers)
    parts = parts_of(plan)
    assert parts["interpreter"] == calibrated.INTERPRETER
    assert parts["workbench"] == calibrated.WORKBENCH["cli"]  # one process: the command itself runs the rank
    assert parts["imports"] == 0 and parts["tensor peak"] == 0 == parts["intermediates"]
    assert parts["metadata"] == 6 * calibrated.PER_TENSOR
    assert plan.rss_bytes == sum(parts.values()) == plan.rank_rss_bytes(0)
    assert plan.rss_breakdown["bytes"].sum() == plan.rss_bytes


def test_numpy_casts_do_not_import_torch_and_the_arena_is_the_tensor_peak(two_layers: Path) -> None:
    plan = wb.plan(two_layers, dtype="bf16")
    assert rank_libraries(plan, 0) == "numpy"
    parts = parts_of(plan)
    assert parts["imports"] == calibrated.LIBRARY["numpy"] < calibrated.LIBRARY["torch"]
    assert parts["tensor peak"] == plan.peak_bytes > 0
    assert plan.rss_bytes == wb.plan(two_layers).rss_bytes + calibrated.LIBRARY["numpy"] + plan.peak_bytes


def test_tensor_ops_import_torch_and_fusion_with_a_cast_is_cast_piece_by_piece(two_layers: Path) -> None:
    transpose = wb.plan(two_layers, M.Transpose("model.layers.{i}.mlp.down_proj.weight"))
    assert rank_libraries(transpose, 0) == "torch"
    assert parts_of(transpose)["imports"] == calibrated.LIBRARY["torch"]
    assert parts_of(transpose)["tensor peak"] == 2 * MIB  # input and output of one 1 MiB transpose
    assert parts_of(transpose)["intermediates"] == 0

    fuse = M.Concat(["model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"],
                    "model.layers.{i}.mlp.gate_up_proj.weight")
    fused_bf16 = wb.plan(two_layers, fuse, dtype="bf16")
    step = next(s for s in fused_bf16.steps if "gate_up" in s.group.outputs[0].name)
    # each input cast on its own and written at its byte range (`mapper.pieces`): no F32 concatenation is made
    assert step.kind == "pieces" and step.held_bytes == MIB + MIB // 2  # one F32 input and its bf16 copy
    assert intermediate_bytes(step) == 0 and parts_of(fused_bf16)["intermediates"] == 0


def test_ranks_are_workers_and_the_largest_rank_is_the_plan_number(two_layers: Path) -> None:
    plan = wb.plan(two_layers, dtype="bf16", nproc=2, shard_size="3MB")
    per_rank = [plan.rank_rss_bytes(r) for r in range(2)]
    assert all(parts_of(plan, r)["workbench"] == calibrated.WORKBENCH["worker"] for r in range(2))
    assert plan.rss_bytes == max(per_rank)
    assert list(plan.rss_breakdown.columns) == ["rank 0", "rank 1", "detail"]
    assert "RAM to provision" in plan.summary()


def test_url_sources_add_the_prefetch_window_bounded_by_what_is_read(two_layers: Path, monkeypatch) -> None:
    from workbench.formats.remote_safetensors import PARALLEL
    from workbench.planning.rss import CONNECTION_BYTES, prefetch_bytes

    plan = wb.plan(two_layers)
    assert prefetch_bytes(plan, 0) == 0
    monkeypatch.setattr(plan.source, "url", "https://example.invalid/repo/")  # the reader stays local: only the window is asked
    # the six 1 MiB tensors are one 6 MiB range in the window; each copy step holds a 1 MiB copy cut from it; and
    # each fetching thread holds its own buffers
    assert prefetch_bytes(plan, 0) == 7 * MIB + PARALLEL * CONNECTION_BYTES


def test_a_remote_tensor_taken_whole_is_counted_once_and_the_window_holds_what_follows(tmp_path: Path, monkeypatch) -> None:
    from workbench.formats.remote_safetensors import PARALLEL, WINDOW_BYTES
    from workbench.planning.rss import CONNECTION_BYTES, prefetch_bytes, remote_peak_bytes

    big = [f32(f"model.layers.{i}.mlp.down_proj.weight", 10240, 1024) for i in range(6)]  # 40 MiB each: one range each
    plan = wb.plan(write_headers_only(tmp_path / "big", "model.safetensors", big), dtype="bf16")
    monkeypatch.setattr(plan.source, "url", "https://example.invalid/repo/")
    cast_extra = max(s.held_bytes for s in plan.steps) - 40 * MIB  # the cast's output beside its input
    # ranges are submitted while less than the 128 MiB window is ahead: four (the fourth starts at 120 MiB), the
    # one being cast among them (handed over, not copied), then the cast's output
    assert WINDOW_BYTES == 128 * MIB
    assert remote_peak_bytes(plan, 0) == 4 * 40 * MIB + cast_extra + PARALLEL * CONNECTION_BYTES
    assert prefetch_bytes(plan, 0) == remote_peak_bytes(plan, 0) - plan.peak_bytes


def _synthetic_llama(folder: Path) -> Path:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from make_llama_like import make_synthetic_llama
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    make_synthetic_llama(folder, 0.15, shards=2)
    return folder




def _one_large_tensor(folder: Path) -> Path:
    """A 320 MB float32 embedding beside a few small tensors: a transpose of it holds 640 MB of tensors."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"model.embed_tokens.weight": np.ones((40960, 2048), np.float32)}
    tensors |= {f"model.layers.{i}.input_layernorm.weight": np.ones(2048, np.float32) for i in range(4)}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc to read a process's peak RSS")
@pytest.mark.parametrize("workload", ["cast", "transpose"])
def test_a_real_conversion_peaks_within_15_percent_of_the_prediction(tmp_path_factory, workload: str) -> None:
    """`workbench convert` with numpy casts (a 160 MB Llama) and a torch op (a 320 MB embedding): the peak RSS
    (VmHWM) against plan.rss_bytes. torch's resident pages vary by LIBRARY_SPREAD (~75 MB) with the page
    cache (see planning.rss), so its workload is one where the tensors, what a user provisions for, dominate."""
    out = tmp_path_factory.mktemp("out") / workload
    if workload == "cast":
        source = _synthetic_llama(tmp_path_factory.getbasetemp() / "llama-150m")
        args = ["convert", str(source), str(out), "--shard-size", "100MB", "--dtype", "bf16"]
        plan = wb.plan(source, shard_size="100MB", dtype="bf16")
    else:
        source = _one_large_tensor(tmp_path_factory.mktemp("embedding"))
        mapper_file = out.parent / "transpose.py"
        mapper_file.write_text("from workbench import mapper as M\nmapper = M.Transpose('model.embed_tokens.weight')\n")
        args = ["convert", str(source), str(out), "--mapper", str(mapper_file)]
        plan = wb.plan(source, M.Transpose("model.embed_tokens.weight"))
    # Small noise only adds to a process's RSS (the allocator's state, the page cache): the smallest of up to three
    # runs is what the process itself needs.
    measured = None
    for _ in range(3):
        imported, run = run_cli_measured(args)
        expected = rank_libraries(plan, 0)  # the run imported what the plan said: numpy alone for the cast
        assert ("torch" if "torch" in imported else "numpy" if "numpy" in imported else "none") == expected
        measured = run if measured is None else min(measured, run)
        if abs(plan.rss_bytes - measured) <= 0.15 * measured:
            break
        shutil.rmtree(out, ignore_errors=True)
    assert plan.peak_bytes > 20 * MIB  # the tensor part matters: not only start-up is compared
    assert abs(plan.rss_bytes - measured) <= 0.15 * measured, json.dumps(
        {"predicted": plan.rss_bytes, "measured": measured, "parts": parts_of(plan), "calibrated for another build":
         calibration_mismatch(), "fix": "python scripts/calibrate_rss.py --write re-measures the constants here"})


def test_the_run_report_puts_the_prediction_next_to_the_measured_rss(llama_sample: Path, tmp_path: Path) -> None:
    plan = wb.plan(llama_sample, dtype="bf16")
    report = wb.convert(llama_sample, tmp_path / "out", dtype="bf16", quiet=True)
    assert report.ranks[0].predicted_rss_bytes == plan.rss_bytes == report.predicted_rss_bytes
    row = report.to_frame().loc["RSS peak"]
    assert row["predicted"] == plan.rss_bytes and row["measured"] == report.rss_peak > 0
    assert f"RSS peak             {format_bytes(plan.rss_bytes)}" in report.summary()


def test_a_run_in_a_larger_process_says_why_its_rss_exceeds_the_prediction(llama_sample: Path, tmp_path: Path) -> None:
    import torch  # noqa: F401  (this pytest process holds torch, pandas ...: far more than a fresh byte-copy process)

    report = wb.convert(llama_sample, tmp_path / "out", quiet=True)
    rank = report.ranks[0]
    assert rank.rss_baseline > 1.15 * rank.predicted_rss_bytes  # byte copies predict no numpy or torch
    assert report.rss_note is not None and "fresh process" in report.rss_note and report.rss_note in report.summary()
    fresh = type(report)(**{**report.__dict__, "ranks": [type(rank)(**{**rank.to_dict(), "rss_baseline": 1})]})
    assert fresh.rss_note is None


def test_constants_say_which_build_they_were_measured_on(monkeypatch) -> None:
    import numpy

    assert calibrated.MEASURED_WITH.keys() == {"python", "numpy", "torch"}
    monkeypatch.setitem(calibrated.MEASURED_WITH, "numpy", "0.0.1")
    assert calibration_mismatch() == f"numpy 0.0.1, installed {numpy.__version__}"
