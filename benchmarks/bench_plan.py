"""How long open, plan and convert take on checkpoints of many tensors, inside one process.

Per-tensor bookkeeping, not bytes, decides these numbers: a checkpoint of 100k tiny F32 tensors (real
data, ~17 MB, written once by make_llama_like.py) is opened, planned and converted with

- `identity`     no mapper: every tensor copied (pass-through re-shard),
- `strip`        `presets.strip_prefix("model.")` (a rename of every tensor),
- `bf16`         `dtype="bf16"` (a cast of every tensor; adjacent small ones batched),
- `fuse`         `presets.hf_to_fused` (q/k/v and gate/up concatenated; planned in span runs, `planning.span_runs`),

and a Llama-3.1-405B-shaped index (191 sparse shards from make_sparse.py: real headers, data as holes)
is opened and planned (identity and fuse; converting it would write 811 GB, so it is not converted).
Each case runs `--repeat` times in this process after one warm-up, and the table shows the minimum
per phase, wall and (in brackets) CPU seconds of this process: on a shared machine the minimum is the
least disturbed figure, and CPU seconds say what the work costs when other processes take turns.
Interpreter start-up and imports are not counted; `run.py` measures whole processes.

Usage: python benchmarks/bench_plan.py [--dir DIR] [--repeat 5] [--only identity,bf16] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_llama_like import make_tiny_tensors, tiny_llama_shape  # noqa: E402
from make_sparse import LLAMA_405B, make_sparse_llama  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.conversion import execute  # noqa: E402
from workbench.formats import open_catalog  # noqa: E402
from workbench.mapper import presets  # noqa: E402

# case -> (the mapper for a model config, dtype policy)
CASES: dict[str, tuple[Callable[[dict], object], object]] = {
    "identity": (lambda config: None, None),
    "strip": (lambda config: presets.strip_prefix("model."), None),
    "bf16": (lambda config: None, "bf16"),
    "fuse": (lambda config: presets.hf_to_fused(config), None),
}


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def measure(source: Path, config: dict, case: str, dest: Path | None) -> dict[str, float]:
    """Wall and CPU seconds of open, plan and (when `dest` is given) convert of one run."""
    make_mapper, dtype = CASES[case]
    gc.collect()  # the previous run's garbage is not this run's cost
    marks = [_now()]
    catalog = open_catalog(source)
    marks.append(_now())
    plan = wb.plan(catalog, make_mapper(config), dest=dest, dtype=dtype)
    marks.append(_now())
    if not plan.ok:
        raise SystemExit(f"{case}: the plan has errors: {[p.message for p in plan.problems if p.severity == 'error'][:3]}")
    phases = ["open", "plan"]
    if dest is not None:
        execute(plan, quiet=True)
        marks.append(_now())
        phases.append("convert")
        shutil.rmtree(dest)
    times = {"tensors": len(catalog)}
    for phase, (wall0, cpu0), (wall1, cpu1) in zip(phases, marks, marks[1:], strict=False):
        times[f"{phase}_s"] = wall1 - wall0
        times[f"{phase}_cpu_s"] = cpu1 - cpu0
    del plan, catalog
    return times


def bench(label: str, source: Path, config: dict, case: str, dest: Path | None, repeat: int) -> dict:
    """The minimum per phase over `repeat` runs after one warm-up."""
    runs = [measure(source, config, case, dest) for _ in range(repeat + 1)][1:]
    row: dict = {"checkpoint": label, "case": case, "tensors": runs[0]["tensors"]}
    for phase in ("open", "plan", "convert"):
        for unit in ("s", "cpu_s"):
            if f"{phase}_{unit}" in runs[0]:
                row[f"{phase}_{unit}"] = min(r[f"{phase}_{unit}"] for r in runs)
    for unit in ("s", "cpu_s"):
        row[f"total_{unit}"] = min(sum(r[f"{p}_{unit}"] for p in ("open", "plan", "convert") if f"{p}_{unit}" in r) for r in runs)
    return row


def print_table(rows: list[dict], repeat: int) -> None:
    """The rows as a markdown table: wall seconds, and in brackets this process's CPU seconds."""
    print(f"min of {repeat} runs in one process (after a warm-up): wall seconds (CPU seconds of the process)")
    print()
    print("| checkpoint | case | tensors | open s | plan s | convert s | total s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = [f"{r[f'{p}_s']:.3f} ({r[f'{p}_cpu_s']:.3f})" if f"{p}_s" in r else "-" for p in ("open", "plan", "convert", "total")]
        print(f"| {r['checkpoint']} | {r['case']} | {r['tensors']:,} | " + " | ".join(cells) + " |")
    for r in rows:
        if r["case"] == "fuse" and "convert_s" in r:  # issue 31's bar: a fusion of 100k tensors planned and run in < 1.5 s
            both = r["plan_s"] + r["convert_s"]
            print(f"\nfuse at {r['tensors']:,} tensors: plan {r['plan_s']:.3f} s + convert {r['convert_s']:.3f} s = {both:.3f} s "
                  f"({r['plan_cpu_s'] + r['convert_cpu_s']:.3f} s CPU); target < 1.5 s: {'met' if both < 1.5 else 'NOT met'}")


def run(folder: Path, repeat: int, only: list[str]) -> list[dict]:
    """Build (or reuse) both inputs under `folder` and time every case."""
    tiny, llama = folder / "tiny-100k", folder / "sparse-llama-405b"
    make_tiny_tensors(tiny)
    make_sparse_llama(llama)
    tiny_config = tiny_llama_shape(100_000).hf_config()
    rows = []
    for case in only:
        rows.append(bench("100k tiny tensors", tiny, tiny_config, case, folder / "out", repeat))
    for case in [c for c in only if c in ("identity", "fuse")]:
        rows.append(bench("llama-405b index (191 shards)", llama, LLAMA_405B.hf_config(), case, None, repeat))
    return rows


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: build the inputs, time, print a table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="where to build the inputs (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated cases of {', '.join(CASES)}")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    only = [c for c in args.only.split(",") if c]
    unknown = [c for c in only if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
    if args.dir is None:
        with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
            rows = run(Path(tmp), args.repeat, only)
    else:
        rows = run(args.dir, args.repeat, only)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows, args.repeat)


if __name__ == "__main__":
    main()
