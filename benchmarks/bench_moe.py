"""Frontier MoE checkpoints at full size: open, recipe, plan for 64 ranks, predicted RSS per rank, rank balance.

Each of the four shapes of `make_sparse_moe.py` (real headers, data as holes: DeepSeek-V3 671B FP8, Kimi-K2 1T
with 384 experts, Qwen3-MoE-235B bf16, GPT-OSS-120B MXFP4) is opened and planned with the one-line recipe that
makes transformers 5's bf16 layout with experts stacked:

- FP8:   `M.Sequential(M.presets.dequantize_fp8(cfg), M.presets.from_transformers(cfg))`
- MXFP4: `M.Sequential(M.presets.dequantize_mxfp4(cfg), M.presets.from_transformers(cfg))`
- bf16:  `M.presets.from_transformers(cfg)`

The table shows wall seconds of open, of the imports the recipe needs (torch, transformers' conversion registry and
the family's modeling module: a process's fixed cost, counted in the RSS prediction, timed apart), of building the
recipe (the two presets, each reading the folder's tensor list: read once, shared), of the plan for `--nproc`
ranks, the predicted peak RSS of
the largest rank, and the rank balance: the largest rank's bytes written over the smallest's (the run report's
definition, over the planned bytes each rank writes). Times are wall seconds and, in brackets, this process's CPU
seconds (on a shared machine the CPU seconds say what the work costs).

Usage: python benchmarks/bench_moe.py [--dir DIR] [--nproc 64] [--only deepseek_v3,gpt_oss] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_sparse_moe import FAMILIES, make_moe  # noqa: E402

import workbench as wb  # noqa: E402
from workbench import mapper as M  # noqa: E402
from workbench.formats import open_catalog  # noqa: E402

GIB = 1 << 30
PHASES = ("open", "imports", "recipe", "plan")


def recipe(family: str, folder: Path) -> M.Mapper:
    """The one-line recipe of `family` (see the module text)."""
    config = folder / "config.json"
    quant = json.loads(config.read_text()).get("quantization_config", {}).get("quant_method")
    layout = M.presets.from_transformers(config)
    if quant == "fp8":
        return M.Sequential(M.presets.dequantize_fp8(config), layout)
    if quant == "mxfp4":
        return M.Sequential(M.presets.dequantize_mxfp4(config), layout)
    return layout


def rank_written(plan: Any) -> list[int]:
    """Planned bytes each rank writes (output files' tensor bytes, or its share of a file written by several)."""
    written = [0] * plan.nproc
    for step in plan.steps:
        written[step.rank] += step.bytes_out
    return written


def balance(plan: Any) -> float:
    """Largest rank's bytes written over the smallest's (inf when a rank writes nothing)."""
    written = rank_written(plan)
    return max(written) / min(written) if min(written) else float("inf")


def import_fixed(folder: Path) -> None:
    """Import what building the recipe imports: torch, transformers' conversion registry, the family's modeling module."""
    import importlib

    import torch  # noqa: F401
    import transformers.conversion_mapping  # noqa: F401
    import transformers.core_model_loading  # noqa: F401

    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def measure(family: str, folder: Path, nproc: int) -> dict:
    """Open, import, recipe and plan times, predicted RSS per rank and balance of one shape."""
    stamp = make_moe(folder, family)
    gc.collect()
    marks = [(time.perf_counter(), time.process_time())]
    catalog = open_catalog(folder)
    marks.append((time.perf_counter(), time.process_time()))
    import_fixed(folder)
    marks.append((time.perf_counter(), time.process_time()))
    mapper = recipe(family, folder)
    marks.append((time.perf_counter(), time.process_time()))
    plan = wb.plan(catalog, mapper, nproc=nproc)
    marks.append((time.perf_counter(), time.process_time()))
    if not plan.ok:
        raise SystemExit(f"{family}: the plan has errors: {[p.message for p in plan.errors][:3]}")
    row = {"family": family, "tensors": len(catalog), "bytes": stamp["bytes"], "rss_gib": plan.rss_bytes / GIB,
           "peak_gib": plan.peak_bytes / GIB, "balance": balance(plan), "files": len(plan.output_file_list), "nproc": nproc}
    for phase, (wall0, cpu0), (wall1, cpu1) in zip(PHASES, marks, marks[1:], strict=False):
        row[f"{phase}_s"], row[f"{phase}_cpu_s"] = wall1 - wall0, cpu1 - cpu0
    return row


def print_table(rows: list[dict]) -> None:
    """The rows as the markdown table the README shows: wall seconds, in brackets this process's CPU seconds."""
    print(f"| shape | tensors | bytes | open s | imports s | recipe s | plan s ({rows[0]['nproc']} ranks) | RSS / rank | tensor peak | balance |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        times = " | ".join(f"{r[f'{p}_s']:.2f} ({r[f'{p}_cpu_s']:.2f})" for p in PHASES)
        print(f"| {r['family']} | {r['tensors']:,} | {r['bytes'] / 1e9:,.0f} GB | {times} | "
              f"{r['rss_gib']:.2f} GiB | {r['peak_gib']:.2f} GiB | {r['balance']:.2f} |")


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: build (or reuse) the sparse folders, measure, print a table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="where to build the sparse folders (default: a temp dir)")
    parser.add_argument("--nproc", type=int, default=64)
    parser.add_argument("--only", default=",".join(FAMILIES), help=f"comma-separated shapes of {', '.join(FAMILIES)}")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    only = [f for f in args.only.split(",") if f]
    if unknown := [f for f in only if f not in FAMILIES]:
        parser.error(f"unknown shape(s) {', '.join(unknown)}: choose from {', '.join(FAMILIES)}")
    import transformers  # noqa: F401 - a process's fixed cost, not the recipe's

    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        root = args.dir or Path(tmp)
        rows = [measure(family, root / family, args.nproc) for family in only]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
