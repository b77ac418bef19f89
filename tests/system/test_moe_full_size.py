"""Frontier MoE shapes at full size (sparse folders with real headers, `benchmarks/make_sparse_moe.py`): the one-line
recipe plans for 64 ranks within 4 GiB of predicted RSS per rank and a rank balance within 10 %.

The suite keeps what is fast: GPT-OSS-120B whole (687 tensors, 65 GB of MXFP4), and DeepSeek-V3 at full width (256
experts of 2048 x 7168, its real dense layers and vocabulary) with 6 of its 61 layers. `python benchmarks/bench_moe.py`
measures the four shapes whole (DeepSeek-V3, Kimi-K2, Qwen3-MoE-235B, GPT-OSS-120B)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import workbench as wb  # noqa: E402
from workbench.formats import open_catalog  # noqa: E402
from workbench.planning.ranks import BALANCE, written_spread  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
GIB = 1 << 30


def _benchmarks() -> tuple[Any, Any]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_moe
        import make_sparse_moe
    finally:
        sys.path.remove(str(BENCHMARKS))
    return make_sparse_moe, bench_moe


@pytest.mark.serial  # measures time
def test_gpt_oss_120b_opens_and_plans_for_64_ranks_within_the_bounds(tmp_path: Path) -> None:
    make, bench = _benchmarks()
    stamp = make.make_moe(tmp_path, "gpt_oss")
    assert stamp["tensors"] == 687 and 60e9 < stamp["bytes"] < 70e9
    started = time.perf_counter()
    catalog = open_catalog(tmp_path)
    opened = time.perf_counter()
    plan = wb.plan(catalog, bench.recipe("gpt_oss", tmp_path), nproc=64)
    planned = time.perf_counter()
    assert plan.ok, plan.errors
    assert opened - started < 5 and planned - opened < 30
    assert plan.rss_bytes <= 4 * GIB
    assert written_spread(plan.steps, 64) <= BALANCE
    experts = [s for s in plan.steps if s.group.outputs[0].name.endswith("mlp.experts.gate_up_proj")]
    assert experts and {s.kind for s in experts} == {"rows"}  # dequantised a few experts at a time


def test_deepseek_v3_at_full_width_plans_one_expert_per_rank_step_and_balances_64_ranks(tmp_path: Path) -> None:
    make, bench = _benchmarks()
    config = {**make.CONFIGS["deepseek_v3"], "num_hidden_layers": 6}  # 3 dense layers, 3 with 256 routed experts
    stamp = make.make_moe(tmp_path, "deepseek_v3", config, n_shards=16)
    assert stamp["tensors"] == 3 + 3 * 20 + 3 * (14 + 2 + 256 * 6 + 6)  # embeddings, norm, lm_head; dense; MoE layers
    plan = wb.plan(tmp_path, bench.recipe("deepseek_v3", tmp_path), nproc=64)
    assert plan.ok, plan.errors
    expert = 2 * 2048 * 7168  # one expert's gate + up rows, FP8
    scales = 2 * 16 * 56 * 4
    # one piece of the stack: FP8 in, its scales, gate and up dequantised (bf16), and joined along dim 1
    assert plan.peak_bytes == expert + scales + 2 * expert + 2 * expert
    assert plan.rss_bytes <= 4 * GIB
    assert written_spread(plan.steps, 64) <= BALANCE
    assert {s.kind for s in plan.steps if ".mlp.gate_proj" in s.group.outputs[0].name} == {"rows"}  # dense FP8 by rows
    shared = [f for f in plan.output_file_list if f.ranks]
    assert shared and all(len(f.ranks) > 1 for f in shared)
