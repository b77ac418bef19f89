"""Paired A/B benchmark: `workbench convert` against `cp -r` + `sync` of the same files, whole processes.

Each pair runs both commands on the same input, back to back, in alternating order (A B, then B A, ...), so
a machine whose speed drifts slows both sides of a pair alike; the table quotes the median of the per-pair
ratios and their range. Each side is a fresh process started from here: wall time from start to exit, user
and system CPU from the kernel's accounting of that process and everything it waited for (`os.wait4`).
Before every run the output of the previous one is deleted, the source is read once (warm page cache for
both), pending writes are flushed (`sync`) and the machine idles `--settle` seconds; `--prime GIB` also
touches and frees that much memory just before the start (the state `run.py` measures in; see this folder's README.md,
"Why `run.py` and paired runs disagree", for why the two states give different ratios on a VM that returns free memory to its host). One warm-up
run of each side precedes the counted pairs of a workload.

Python's bytecode cache: `PYTHONDONTWRITEBYTECODE=1` (set on this project's shared machines) makes every
workbench process compile its ~100 modules from source again, 0.2-0.3 s of CPU a user's install never
pays. The children therefore run with the cache on, kept in WORKDIR/pycache (`PYTHONPYCACHEPREFIX`, so the
checkout stays clean); `--no-bytecode-cache` measures the compile-every-time state instead.

Workloads (the issue's targets in brackets):
  pass      pass-through re-shard of a bf16 Llama-shaped checkpoint (4 shards) into one 5 GB file [>= 1.0x]
  pass-256  the same into 256MB shards                                                             [>= 1.0x]
  fuse      q/k/v -> qkv_proj and gate/up -> gate_up_proj (dim-0 fusion) of the bf16 checkpoint    [>= 1.0x]
  cast      fp32 -> bf16 cast of an F32 checkpoint of the same size                               [>= 0.9x]
`cp -r` + `sync` copies the source folder of the same workload. Engine system CPU target: <= 1.2x cp's.

    python benchmarks/paired.py [--size-gib 1] [--pairs 5] [--only pass,fuse,cast] [--prime 0] [--settle 2]
                                [--workdir benchmarks/_data] [--strace]

`--strace` adds one run of each command under `strace -c -f` and prints the kernel time of the busiest
system calls (strace slows the run; its figures compare calls, not wall times).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYTHON = sys.executable
GIB = 1 << 30


@dataclass(frozen=True)
class Workload:
    """One conversion: its input (dtype of the synthetic checkpoint) and the `workbench convert` options."""

    name: str
    what: str
    source_dtype: str
    options: tuple[str, ...]
    target: float  # the throughput target, x cp -r + sync


WORKLOADS = [
    Workload("pass", "pass-through re-shard, bf16, 4 shards -> one 5GB file", "BF16", ("--shard-size", "5GB"), 1.0),
    Workload("pass-256", "pass-through re-shard, bf16, 4 shards -> 256MB shards", "BF16", ("--shard-size", "256MB"), 1.0),
    Workload("fuse", "dim-0 fusion (q/k/v, gate/up), bf16", "BF16", ("--preset", "hf_to_fused"), 1.0),
    Workload("cast", "fp32 -> bf16 cast", "F32", ("--dtype", "bf16"), 0.9),
]


@dataclass
class Run:
    """One whole-process run: wall seconds and the CPU the kernel charged to it and its children."""

    wall: float
    user: float
    sys: float
    status: int


@dataclass
class Pairs:
    """The runs of both sides of one workload, pair by pair."""

    workload: Workload
    source_bytes: int
    engine: list[Run] = field(default_factory=list)
    copy: list[Run] = field(default_factory=list)


def sync_all() -> None:
    subprocess.run(["sync"], check=False)


def warm(folder: Path) -> int:
    """Read every file of `folder` once (into the page cache); returns the bytes of its .safetensors files."""
    total = 0
    for path in sorted(folder.iterdir()):
        if path.is_file():
            with open(path, "rb") as fh:
                while fh.read(64 << 20):
                    pass
            if path.suffix == ".safetensors":
                total += path.stat().st_size
    return total


def prime(gib: float) -> None:
    """Touch and free `gib` GiB in a child process (recently freed memory for the next start)."""
    if gib > 0:
        code = "import mmap,sys; n=int(float(sys.argv[1])*(1<<30)); m=mmap.mmap(-1,n); [m.__setitem__(i, 1) for i in range(0, n, 4096)]; m.close()"
        subprocess.run([PYTHON, "-c", code, str(gib)], check=True)


def timed(argv: list[str], env: dict[str, str]) -> Run:
    """Run `argv` as a child; wall time and the child's own user/sys CPU (including what it waited for)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    if proc.returncode != 0:
        raise SystemExit(f"Cannot benchmark: {' '.join(argv)} exited with {proc.returncode}:\n{err[-2000:]}")
    return Run(wall, usage.ru_utime, usage.ru_stime, proc.returncode)


def engine_argv(workload: Workload, src: Path, dst: Path) -> list[str]:
    return [PYTHON, "-m", "workbench", "convert", str(src), str(dst), "--quiet", *workload.options]


def copy_argv(src: Path, dst: Path) -> list[str]:
    return ["sh", "-c", 'cp -r "$0" "$1" && sync "$1" "$1"/*', str(src), str(dst)]


def measure(workload: Workload, src: Path, scratch: Path, pairs: int, settle: float, prime_gib: float, env: dict[str, str]) -> Pairs:
    """`pairs` pairs of runs after one warm-up pair, the order alternating; each run starts from the same state."""
    result = Pairs(workload, warm(src))
    sides = {"engine": (result.engine, lambda dst: engine_argv(workload, src, dst)),
             "copy": (result.copy, lambda dst: copy_argv(src, dst))}

    def one(side: str) -> Run:
        dst = scratch / f"out-{side}"
        shutil.rmtree(dst, ignore_errors=True)
        warm(src)
        sync_all()
        time.sleep(settle)
        prime(prime_gib)
        run = timed(sides[side][1](dst), env)
        shutil.rmtree(dst, ignore_errors=True)
        return run

    one("engine")  # warm-up, not counted (writes the bytecode cache on a first run)
    one("copy")
    for k in range(pairs):
        order = ("engine", "copy") if k % 2 == 0 else ("copy", "engine")
        for side in order:
            sides[side][0].append(one(side))
        print(f"  {workload.name} pair {k + 1}/{pairs}: workbench {result.engine[-1].wall:.2f} s, cp -r + sync {result.copy[-1].wall:.2f} s",
              file=sys.stderr)
    return result


def spread(values: list[float], digits: int = 2) -> str:
    """`median (min-max)`."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def table(results: list[Pairs]) -> str:
    """The markdown table: per workload, both sides' medians and the per-pair ratios."""
    lines = [
        "| workload | GB | workbench wall s | `cp -r` + `sync` wall s | × cp+sync throughput | target | workbench user / sys s | cp user / sys s | sys × cp |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        speed = [c.wall / e.wall for e, c in zip(r.engine, r.copy, strict=True)]  # > 1: the engine is faster
        sys_ratio = [e.sys / c.sys if c.sys else float("inf") for e, c in zip(r.engine, r.copy, strict=True)]
        med = lambda runs, attr: statistics.median(getattr(x, attr) for x in runs)  # noqa: E731
        verdict = "pass" if statistics.median(speed) >= r.workload.target else "**below**"
        lines.append(
            f"| {r.workload.what} | {r.source_bytes / 1e9:.2f} | {spread([x.wall for x in r.engine])} | {spread([x.wall for x in r.copy])} "
            f"| {spread(speed)} | ≥ {r.workload.target:.1f} ({verdict}) | {med(r.engine, 'user'):.2f} / {med(r.engine, 'sys'):.2f} "
            f"| {med(r.copy, 'user'):.2f} / {med(r.copy, 'sys'):.2f} | {spread(sys_ratio)} |"
        )
    return "\n".join(lines)


def strace_summary(argv: list[str], dst: Path, env: dict[str, str], top: int = 6) -> str:
    """The busiest system calls of one run under `strace -c -f` (seconds in the kernel, calls)."""
    shutil.rmtree(dst, ignore_errors=True)
    sync_all()
    report = dst.parent / "strace.txt"
    subprocess.run(["strace", "-c", "-f", "-o", str(report), *argv], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shutil.rmtree(dst, ignore_errors=True)
    rows = []
    for line in report.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0].replace(".", "").isdigit() and parts[-1] not in ("total",):
            rows.append((float(parts[1]), parts[-1], parts[3]))
    rows.sort(reverse=True)
    return ", ".join(f"{name} {seconds:.3f} s ({calls} calls)" for seconds, name, calls in rows[:top])


def make_input(workdir: Path, size_gib: float, dtype: str) -> Path:
    folder = workdir / f"llama-synth-{size_gib:g}gib" if dtype == "F32" else workdir / f"llama-synth-{dtype.lower()}-{size_gib:g}gib"
    subprocess.run([PYTHON, str(HERE / "make_llama_like.py"), "synth", str(folder), "--size-gib", f"{size_gib:g}", "--dtype", dtype],
                   check=True, stdout=subprocess.DEVNULL)
    return folder


def main(argv: list[str] | None = None) -> None:
    """Measure the chosen workloads and print the table (also saved as WORKDIR/paired.md and paired.json)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0, help="size of each synthetic input (default 1)")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--only", default=",".join(w.name for w in WORKLOADS), help="workloads, comma-separated")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds of idle before each run")
    parser.add_argument("--prime", type=float, default=0.0, help="GiB touched and freed just before each run (run.py uses 6)")
    parser.add_argument("--workdir", type=Path, default=HERE / "_data")
    parser.add_argument("--strace", action="store_true", help="also one run of each side under strace -c -f")
    parser.add_argument("--workbench-args", default="", help="extra `workbench convert` options, e.g. --no-page-align")
    parser.add_argument("--no-bytecode-cache", action="store_true", help="children compile every module again (PYTHONDONTWRITEBYTECODE=1)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    chosen = [w for w in WORKLOADS if w.name in names]
    if len(chosen) != len(names):
        raise SystemExit(f"--only {args.only!r}: known workloads are {', '.join(w.name for w in WORKLOADS)}.")
    if args.workbench_args:
        chosen = [Workload(w.name, w.what + f" ({args.workbench_args})", w.source_dtype, (*w.options, *args.workbench_args.split()), w.target)
                  for w in chosen]
    args.workdir.mkdir(parents=True, exist_ok=True)
    scratch = args.workdir / "paired-scratch"
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    if args.no_bytecode_cache:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str((args.workdir / "pycache").resolve())
    inputs = {dtype: make_input(args.workdir, args.size_gib, dtype) for dtype in sorted({w.source_dtype for w in chosen})}
    load = os.getloadavg()[0]
    results = [measure(w, inputs[w.source_dtype], scratch, args.pairs, args.settle, args.prime, env) for w in chosen]
    lines = [
        f"Paired runs: {args.pairs} pairs per workload after a warm-up pair, order alternating, `--settle {args.settle:g}`, "
        f"`--prime {args.prime:g}`, bytecode cache {'off' if args.no_bytecode_cache else 'on'}; "
        f"{os.cpu_count()} CPUs, load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end. "
        "Ratios are per pair (cp+sync wall / workbench wall), median (min–max).",
        "",
        table(results),
    ]
    if args.strace and shutil.which("strace"):
        lines += ["", "Kernel time by system call (`strace -c -f`, one run each):", ""]
        for w in chosen:
            src = inputs[w.source_dtype]
            warm(src)
            lines.append(f"- {w.name}: workbench: {strace_summary(engine_argv(w, src, scratch / 'out-engine'), scratch / 'out-engine', env)}")
            lines.append(f"- {w.name}: cp -r + sync: {strace_summary(copy_argv(src, scratch / 'out-copy'), scratch / 'out-copy', env)}")
    text = "\n".join(lines)
    print(text)
    (args.workdir / "paired.md").write_text(text + "\n")
    raw = [{"workload": r.workload.name, "source_bytes": r.source_bytes,
            "engine": [vars(x) for x in r.engine], "copy": [vars(x) for x in r.copy]} for r in results]
    (args.workdir / "paired.json").write_text(json.dumps(raw, indent=1))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
