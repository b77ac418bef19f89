"""Does `plan.rss_bytes` predict the RAM a conversion takes? Predicted vs measured peak RSS per workload.

Each workload is a real `workbench convert` in a fresh process on a synthetic Llama-shaped checkpoint of
`--size-gib` (F32, HF sharded; `make_llama_like.py synth`), measured by `/usr/bin/time -f %M` (the
"Maximum resident set size" of `/usr/bin/time -v`: for several ranks the largest single process). The
prediction is `wb.plan(...)` with the same arguments, made in this process without reading tensor data.

    pass        re-shard to 200 MB files: byte copies, no numpy, no torch
    cast        dtype bf16: chunked fp32 -> bf16 casts by numpy
    transpose   every MLP down/up projection transposed: torch, input + output held
    fusion      presets.hf_to_fused (q/k/v -> qkv, gate/up -> gate_up along dim 0): byte copies
    fusion+cast the same and bf16 (torch: the fused F32 result exists before its bf16 copy)
    transpose+cast  the transposes and bf16
    cast 2 ranks  the cast on 2 workers (launcher="local")

Every run imports its libraries from a private mirror of site-packages (`calibrate_rss.py`), so the page-cache
state of torch's shared objects is the one chosen here, whatever the venv's: workloads that import torch run
twice, "faulted" (the mirror's copies evicted, then paged in by the loader) and "written whole" (written again in
large chunks, as an install or a copy leaves them); on a kernel with large page-cache folios the second maps
~90 MiB more, and the prediction counts it.

Prints a markdown table (median of --repeat runs). The machine may be shared: other processes do not
change a process's RSS, but page-cache pressure and allocator state can move it by a few MiB.

Usage: python benchmarks/bench_rss.py [--size-gib 0.6] [--workdir benchmarks/_data] [--repeat 1] [--only pass,cast]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_llama_like import make_synthetic_llama  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from calibrate_rss import environment, evict, library_files, mirror_site_packages, rewrite_large  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.display import format_bytes  # noqa: E402
from workbench.planning.rss import rank_libraries  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIME = "/usr/bin/time"
SHARD = "200MB"
TRANSPOSE = """from workbench import mapper as M
mapper = M.Sequential(M.Transpose("model.layers.{i}.mlp.down_proj.weight"), M.Transpose("model.layers.{i}.mlp.up_proj.weight"))
"""
FUSED = """from workbench import mapper as M
mapper = M.presets.hf_to_fused(SOURCE)
"""


@dataclass(frozen=True)
class Workload:
    """One conversion: its CLI arguments and the same as `wb.plan` keywords."""

    name: str
    mapper_code: str | None = None
    dtype: str | None = None
    nproc: int = 1
    extra: tuple[str, ...] = field(default=())


WORKLOADS = (
    Workload("pass"),
    Workload("cast", dtype="bf16"),
    Workload("transpose", TRANSPOSE),
    Workload("fusion", FUSED),
    Workload("fusion+cast", FUSED, dtype="bf16"),
    Workload("transpose+cast", TRANSPOSE, dtype="bf16"),
    Workload("cast 2 ranks", dtype="bf16", nproc=2, extra=("--launcher", "local")),
)


def mapper_of(code: str | None, source: Path):
    if code is None:
        return None
    scope: dict = {"SOURCE": str(source)}
    exec(code, scope)  # our own mapper text above, never user input
    return scope["mapper"]


def measured_rss(argv: list[str], env: dict[str, str]) -> int:
    """Peak RSS in bytes by /usr/bin/time (not os.wait4: a forked child starts with our high-water mark)."""
    proc = subprocess.run([TIME, "-f", "%M", *argv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return int(proc.stderr.strip().splitlines()[-1]) * 1024


def run(workload: Workload, source: Path, scratch: Path, repeat: int, mirror: Path,
        copied: list[Path]) -> list[tuple[str, int, int, int]]:
    """(libraries and page-cache state, predicted RSS, median measured RSS, predicted tensor peak) of one
    workload: one row, or two for a torch workload (torch's files faulted in, then written whole)."""
    plan = wb.plan(source, mapper_of(workload.mapper_code, source), shard_size=SHARD, nproc=workload.nproc,
                   dtype=workload.dtype)
    argv = [sys.executable, "-m", "workbench", "convert", str(source), str(scratch / "out"), "--shard-size", SHARD,
            "--overwrite", "--nproc", str(workload.nproc), *workload.extra]
    if workload.dtype:
        argv += ["--dtype", workload.dtype]
    if workload.mapper_code:
        mapper_file = scratch / "mapper.py"
        mapper_file.write_text(workload.mapper_code.replace("SOURCE", repr(str(source))), encoding="utf-8")
        argv += ["--mapper", str(mapper_file)]
    libraries = "/".join(sorted({rank_libraries(plan, r) for r in range(plan.nproc)}))
    states = [("faulted", evict), ("written whole", rewrite_large)] if "torch" in libraries else [("", None)]
    torch_files = library_files(copied, mirror, "torch")
    rows = []
    for state, set_state in states:
        samples = []
        if set_state is not None:
            set_state(torch_files)
        for _ in range(repeat):
            samples.append(measured_rss(argv, environment(mirror)))
            shutil.rmtree(scratch / "out", ignore_errors=True)
        label = f"{libraries} ({state})" if state else libraries
        rows.append((label, plan.rss_bytes, int(statistics.median(samples)), plan.peak_bytes))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=0.6)
    parser.add_argument("--workdir", type=Path, default=ROOT / "benchmarks" / "_data")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--only", default="", help="comma-separated workload names")
    args = parser.parse_args(argv)
    if not os.access(TIME, os.X_OK):
        print(f"{TIME} is missing (Debian: apt-get install time)", file=sys.stderr)
        return 2
    source = args.workdir / f"llama-synth-{args.size_gib:g}gib"
    stamp = make_synthetic_llama(source, args.size_gib, shards=3)
    chosen = [w for w in WORKLOADS if not args.only or w.name in args.only.split(",")]
    print(f"input: {format_bytes(stamp['bytes'])} F32 Llama-shaped, {SHARD} output shards; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (a shared machine moves RSS by a few MiB at most)\n")
    print("| workload | imports | predicted tensor peak | predicted RSS | measured RSS (/usr/bin/time) | error |")
    print("|---|---|---:|---:|---:|---:|")
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="wb-bench-rss-") as tmp:
        mirror = Path(tmp) / "site-packages"
        copied = mirror_site_packages(mirror)
        for workload in chosen:
            for libraries, predicted, measured, peak in run(workload, source, Path(tmp), args.repeat, mirror, copied):
                error = (predicted - measured) / measured
                worst = max(worst, abs(error))
                print(f"| {workload.name} | {libraries} | {format_bytes(peak)} | {format_bytes(predicted)} | "
                      f"{format_bytes(measured)} | {error:+.1%} |", flush=True)
    print(f"\nlargest error: {worst:.1%}" + ("" if "torch" not in sys.modules else
          " (this process imported torch: its mapped pages stay in the page cache as they are)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
