"""Conversion benchmark: the workbench engine side by side with `cp -r` + `sync` and peer tools.

Every contender is one command run in a fresh interpreter, so its start-up and peak RSS are its own (peak
RSS as `/usr/bin/time -f %M` reports it). Before each run the source files are read once (page cache warm
for everyone) and pending writes are flushed; after it the output is deleted. Contenders that do not
fsync their outputs get them fsynced by this harness, and that time is counted: the physical baseline is
`cp -r` followed by `sync` of the copies, the durability the engine owes.

    python benchmarks/run.py [--size-gib 2] [--workdir DIR] [--only NAME,...] [--repeat N] [--settle SECONDS] [--prime GIB]

Prints one markdown report (also saved as WORKDIR/results.md, raw numbers in WORKDIR/results.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"
PYTHON = sys.executable

DATASETS = {
    "synth": "synthetic Llama-shaped F32 checkpoint (HF sharded, written by the workbench writer)",
    "hf": "LlamaForCausalLM saved by transformers (random init, F32)",
    "tiny": "100k tiny F32 tensors with Llama names (per-tensor overhead)",
}


@dataclass(frozen=True)
class Contender:
    """One command to time: `argv` may use {src}, {dst}, {result}, {python}, {peers}."""

    name: str
    dataset: str
    argv: tuple[str, ...]
    what: str
    durable: bool = False  # fsyncs its own outputs (otherwise the harness does, timed)
    ours: bool = False
    needs: str = ""  # an import the command requires; checked once, the reason shown if missing

    def command(self, src: Path, dst: Path, result: Path) -> list[str]:
        values = {"src": str(src), "dst": str(dst), "result": str(result), "python": PYTHON, "peers": str(PEERS)}
        return [part.format(**values) for part in self.argv]


def _peer(script: str, *extra: str) -> tuple[str, ...]:
    return ("{python}", f"{{peers}}/{script}", "{src}", "{dst}", "--result", "{result}", *extra)


RANK_SHARDS = "280MB"  # on the 2 GiB checkpoint: 4 bf16 files, 545 MB and 528 MB per rank

CP_SYNC = ("sh", "-c", 'cp -r "$0" "$1" && sync "$1" "$1"/*', "{src}", "{dst}")
CP_ONLY = ("cp", "-r", "{src}", "{dst}")


def contenders() -> list[Contender]:
    """Every contender, in table order. cp+sync comes first on each dataset: the others are compared to it."""
    wb = "workbench_convert.py"
    rows = [
        Contender("cp-sync", "synth", CP_SYNC, "`cp -r` + `sync` of the copies (physical baseline)", durable=True),
        Contender("cp", "synth", CP_ONLY, "`cp -r`, no sync (page cache only; not durable)", durable=True),
        Contender("wb-pass", "synth", _peer(wb, "--mode", "passthrough"), "workbench pass-through re-shard (5GB)", True, True, "workbench.conversion.convert"),
        Contender("wb-fuse", "synth", _peer(wb, "--mode", "fuse"), "workbench q/k/v + gate/up fusion", True, True, "workbench.mapper.presets"),
        Contender("wb-cast", "synth", _peer(wb, "--mode", "cast"), "workbench fp32->bf16 cast", True, True, "workbench.conversion.convert"),
        # Ranks own whole output files: at 5GB the cast writes one file and a second rank would idle, so the
        # rank comparison uses a shard size that gives each rank about half the bytes, on 1 and on 2 ranks.
        Contender("wb-cast-1r", "synth", _peer(wb, "--mode", "cast", "--shard-size", RANK_SHARDS), f"workbench fp32->bf16 cast, 1 rank, {RANK_SHARDS} shards", True, True, "workbench.conversion.convert"),
        Contender("wb-cast-2r", "synth", _peer(wb, "--mode", "cast", "--nproc", "2", "--shard-size", RANK_SHARDS), f"workbench fp32->bf16 cast, 2 ranks (torchrun), {RANK_SHARDS} shards", True, True, "workbench.conversion.convert"),
        Contender("wb-cast-2l", "synth", _peer(wb, "--mode", "cast", "--nproc", "2", "--launcher", "local", "--shard-size", RANK_SHARDS), f"workbench fp32->bf16 cast, 2 ranks (local launcher), {RANK_SHARDS} shards", True, True, "workbench.conversion.convert"),
        Contender("wb-pass-2r", "synth", _peer(wb, "--mode", "passthrough", "--nproc", "2", "--shard-size", RANK_SHARDS), f"workbench pass-through, 2 ranks (torchrun), {RANK_SHARDS} shards", True, True, "workbench.conversion.convert"),
        Contender("st-naive", "synth", _peer("safetensors_naive.py"), "safetensors load_file/save_file per shard"),
        Contender("st-naive-bf16", "synth", _peer("safetensors_naive.py", "--dtype", "bf16"), "safetensors load_file/.to(bf16)/save_file per shard"),
        Contender("d9d-pass", "synth", _peer("d9d_convert.py", "--mode", "passthrough"), "d9d streamed converter, pass-through", needs="d9d.model_state.io"),
        Contender("d9d-fuse", "synth", _peer("d9d_convert.py", "--mode", "fuse"), "d9d streamed converter, q/k/v + gate/up fusion", needs="d9d.model_state.io"),
        Contender("tf", "synth", _peer("transformers_roundtrip.py"), "transformers from_pretrained + save_pretrained"),
        Contender("hf-cp-sync", "hf", CP_SYNC, "`cp -r` + `sync` of the copies (physical baseline)", durable=True),
        Contender("hf-wb-pass", "hf", _peer(wb, "--mode", "passthrough"), "workbench pass-through re-shard (5GB)", True, True, "workbench.conversion.convert"),
        Contender("hf-wb-cast", "hf", _peer(wb, "--mode", "cast"), "workbench fp32->bf16 cast", True, True, "workbench.conversion.convert"),
        Contender("hf-tf", "hf", _peer("transformers_roundtrip.py"), "transformers from_pretrained + save_pretrained"),
        Contender("hf-tf-bf16", "hf", _peer("transformers_roundtrip.py", "--dtype", "bf16"), "transformers from_pretrained(dtype=bf16) + save_pretrained"),
        Contender("tiny-cp-sync", "tiny", CP_SYNC, "`cp -r` + `sync` of the copies (physical baseline)", durable=True),
        Contender("tiny-wb-pass", "tiny", _peer(wb, "--mode", "passthrough"), "workbench plan + pass-through convert", True, True, "workbench.conversion.convert"),
        Contender("tiny-wb-fuse", "tiny", _peer(wb, "--mode", "fuse"), "workbench plan + q/k/v + gate/up fusion", True, True, "workbench.mapper.presets"),
    ]
    return rows


def select(all_rows: Sequence[Contender], only: str | None) -> list[Contender]:
    """The contenders named by --only (a name, or a prefix before '-': 'd9d' picks d9d-pass and d9d-fuse),
    plus the cp+sync baseline of each dataset they use."""
    if not only:
        return list(all_rows)
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    known = {c.name for c in all_rows}
    picked = [c for c in all_rows if any(c.name == w or c.name.startswith(w + "-") for w in wanted)]
    if not picked:
        raise SystemExit(f"--only {only!r} matches no contender. Known: {', '.join(sorted(known))}.")
    datasets = {c.dataset for c in picked}
    return [c for c in all_rows if c in picked or (c.name.endswith("cp-sync") and c.dataset in datasets)]


# ---------------------------------------------------------------- measuring


@dataclass
class Measured:
    """One timed child process."""

    wall_s: float
    maxrss_kb: int
    returncode: int
    sync_s: float = 0.0
    result: dict = field(default_factory=dict)
    error: str = ""


TIME = shutil.which("time", path="/usr/bin:/bin")


def run_child(argv: Sequence[str], log: Path, env: dict[str, str] | None = None, timeout: float = 900.0) -> Measured:
    """Run one command, wall-timed, with its peak RSS (the max over it and its children).

    The peak comes from GNU time's `%M`: a child forked straight from this harness would inherit the
    harness's own RSS high-water mark through fork/exec, and wait4 would report that instead.
    A run longer than `timeout` seconds is killed (its whole process group) and reported as failed.
    """
    rss_file = log.with_suffix(".rss")
    launcher = [TIME, "-f", "%M", "-o", str(rss_file)] if TIME else []
    timed_out = threading.Event()
    with open(log, "wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen([*launcher, *argv], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

        def kill() -> None:
            timed_out.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # already reaped: keep Popen from waiting again
    maxrss = usage.ru_maxrss
    if TIME and rss_file.exists():
        lines = rss_file.read_text().split()
        maxrss = int(lines[-1]) if lines and lines[-1].isdigit() else maxrss
    measured = Measured(wall, maxrss, proc.returncode)
    if timed_out.is_set():
        measured.returncode = measured.returncode or -9
        measured.error = f"killed after {timeout:.0f} s (--timeout)"
    return measured


def fsync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then the folders: what `sync FILE...` does for cp."""
    folders = []
    for root, _, files in os.walk(folder):
        folders.append(root)
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for root in folders:
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def warm_cache(folder: Path) -> int:
    """Read every file of `folder` once so every contender starts with the source in the page cache."""
    total = 0
    buffer = bytearray(16 << 20)
    for path in sorted(folder.iterdir()):
        if path.is_file():
            with open(path, "rb", buffering=0) as fh:
                while n := fh.readinto(buffer):
                    total += n
    return total


def tensor_bytes(folder: Path) -> int:
    """Bytes of the source's safetensors files: what every converter has to read."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def last_error_line(log: Path) -> str:
    """The most telling line of a failed child's output (the exception line, else the last line)."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or "error:" in line or "Exception" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def check_import(module: str, log_dir: Path) -> str:
    """'' when `module` imports in a fresh interpreter, else the exact error."""
    head, _, tail = module.rpartition(".")
    code = f"from {head} import {tail}" if head else f"import {tail}"
    log = log_dir / f"check-{module}.log"
    measured = run_child([PYTHON, "-c", code], log)
    return "" if measured.returncode == 0 else f"`{code}` failed: {last_error_line(log)}"


class Baselines:
    """Peak RSS of a bare interpreter and of interpreters that only import a given set of libraries."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._cache: dict[tuple[str, ...], int] = {}

    def rss_kb(self, modules: Sequence[str] = ()) -> int:
        key = tuple(sorted(modules))
        if key not in self._cache:
            code = "; ".join(f"import {m}" for m in key) or "pass"
            runs = [run_child([PYTHON, "-c", code], self.log_dir / "baseline.log").maxrss_kb for _ in range(2)]
            self._cache[key] = min(runs)
        return self._cache[key]


# ---------------------------------------------------------------- data


def make_inputs(datasets: set[str], workdir: Path, size_gib: float, tiny_tensors: int) -> dict[str, Path]:
    """Write (or reuse) each needed input with make_llama_like.py in a child; returns dataset -> folder."""
    folders = {"synth": workdir / f"llama-synth-{size_gib:g}gib", "hf": workdir / "llama-transformers", "tiny": workdir / f"tiny-{tiny_tensors}"}
    kinds = {"synth": ["synth", "--size-gib", f"{size_gib:g}"], "hf": ["hf"], "tiny": ["tiny", "--tensors", str(tiny_tensors)]}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    for name in sorted(datasets):
        start = time.perf_counter()
        argv = [PYTHON, str(HERE / "make_llama_like.py"), kinds[name][0], str(folders[name]), *kinds[name][1:]]
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"Cannot write benchmark input {name!r} into {folders[name]}: {done.stderr.strip()[-800:]}")
        print(f"input {name}: {folders[name]} ready ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return {k: v for k, v in folders.items() if k in datasets}


# ---------------------------------------------------------------- running


@dataclass
class Row:
    """All runs of one contender."""

    contender: Contender
    runs: list[Measured] = field(default_factory=list)
    skipped: str = ""

    @property
    def ok_runs(self) -> list[Measured]:
        return [r for r in self.runs if r.returncode == 0]

    @property
    def wall_s(self) -> float | None:
        ok = self.ok_runs
        return statistics.median(r.wall_s + r.sync_s for r in ok) if ok else None

    @property
    def maxrss_kb(self) -> int | None:
        ok = self.ok_runs
        return max(r.maxrss_kb for r in ok) if ok else None

    @property
    def result(self) -> dict:
        """The child's own report from the run whose wall time is the median."""
        ok = sorted(self.ok_runs, key=lambda r: r.wall_s + r.sync_s)
        return ok[(len(ok) - 1) // 2].result if ok else {}

    @property
    def error(self) -> str:
        return self.skipped or next((r.error for r in self.runs if r.returncode != 0), "")


def run_once(c: Contender, src: Path, out_root: Path, log_dir: Path, k: int, timeout: float, settle: float = 0.0,
             prime_gib: float = 0.0) -> Measured:
    """Warm the cache, flush pending writes, settle and prime memory, run the contender, fsync its output if it does not, clean up.

    `settle` seconds of idling before the start give every contender the same memory state. On a VM that
    returns free memory to its host (virtio-balloon free page reporting), page-cache pages freed moments
    ago are cheap to reuse while pages already returned cost a host fault: here about 2.2 s of system time
    per GiB written, so the run after a deletion was up to 3x faster than one after a pause. Even after a
    pause, how much the previous run had freed still showed. `prime_gib` then touches and frees that much
    memory just before the start, so every contender finds the same amount of recently freed (cheap)
    memory, as on a machine that does not return its memory: the state a bare-metal host is always in.
    """
    dst = out_root / c.name
    result = out_root / f"{c.name}.json"
    for stale in (dst, result):
        if stale.is_dir():
            shutil.rmtree(stale)
        elif stale.exists():
            stale.unlink()
    warm_cache(src)
    os.sync()
    time.sleep(settle)
    prime_memory(prime_gib)
    log = log_dir / f"{c.name}-{k}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONHASHSEED": "0"}
    measured = run_child(c.command(src, dst, result), log, env, timeout)
    if measured.returncode != 0:
        measured.error = measured.error or last_error_line(log)
    else:
        if not c.durable and dst.exists():
            start = time.perf_counter()
            fsync_tree(dst)
            measured.sync_s = time.perf_counter() - start
        if result.exists():
            measured.result = json.loads(result.read_text())
    shutil.rmtree(dst, ignore_errors=True)
    if result.exists():
        result.unlink()
    os.sync()
    return measured


def prime_memory(gib: float) -> None:
    """Touch `gib` GiB in a child process and free it (nothing when 0): see `run_once`."""
    if gib > 0:
        subprocess.run([sys.executable, "-c", f"b = bytearray({int(gib * 2**30)}); b[::4096] = b'\\1' * len(b[::4096])"],
                       check=True)


def run_all(chosen: list[Contender], inputs: dict[str, Path], workdir: Path, repeat: int, timeout: float = 900.0,
            settle: float = 0.0, prime_gib: float = 0.0) -> list[Row]:
    """Run every contender `repeat` times, round-robin so slow drifts of the machine hit everyone alike.

    Each round starts one contender later than the previous one: what a run leaves behind (pages freed
    by deleting its output) must not always favour, or handicap, the same next contender.
    """
    out_root = workdir / "out"
    log_dir = workdir / "logs"
    out_root.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = [Row(c) for c in chosen]
    reasons: dict[str, str] = {}
    for row in rows:
        need = row.contender.needs
        if need and need not in reasons:
            reasons[need] = check_import(need, log_dir)
        row.skipped = reasons.get(need, "") if need else ""
    for k in range(repeat):
        shift = k % len(rows)
        for row in rows[shift:] + rows[:shift]:
            if row.skipped:
                continue
            c = row.contender
            measured = run_once(c, inputs[c.dataset], out_root, log_dir, k, timeout, settle, prime_gib)
            row.runs.append(measured)
            state = f"{measured.wall_s + measured.sync_s:.2f} s" if measured.returncode == 0 else f"FAILED: {measured.error}"
            print(f"[{k + 1}/{repeat}] {c.name}: {state}", file=sys.stderr)
    return rows


# ---------------------------------------------------------------- reporting


def _mb(kb: float | None) -> str:
    return "-" if kb is None else f"{kb / 1024:.0f}"


def row_numbers(row: Row, source_bytes: int, cp_wall: float | None, baselines: Baselines) -> dict:
    """The figures one table row shows (None where not applicable)."""
    wall = row.wall_s
    gbps = source_bytes / wall / 1e9 if wall else None
    ratio = cp_wall / wall if wall and cp_wall else None
    rss = row.maxrss_kb
    python_child = row.contender.argv[0] == "{python}"
    bare = baselines.rss_kb() if python_child and rss else None
    modules = row.result.get("modules", [])
    same = baselines.rss_kb(modules) if python_child and rss and modules else None
    return {
        "wall_s": wall, "gb_per_s": gbps, "ratio_to_cp_sync": ratio, "peak_rss_kb": rss,
        "above_bare_python_kb": rss - bare if bare is not None else None,
        "above_same_imports_kb": rss - same if same is not None else None,
        "baseline_modules": modules,
    }


def notes_of(row: Row) -> str:
    if row.error:
        return f"**not run**: {row.error}" if row.skipped else f"**failed**: {row.error}"
    parts = [row.contender.what]
    if row.result.get("notes"):
        parts.append(str(row.result["notes"]))
    if not row.contender.durable:
        sync = statistics.median(r.sync_s for r in row.ok_runs)
        parts.append(f"+{sync:.2f} s fsync of outputs by harness")
    if len(row.ok_runs) > 1:
        walls = sorted(r.wall_s + r.sync_s for r in row.ok_runs)
        parts.append(f"runs {walls[0]:.2f}-{walls[-1]:.2f} s")
    return "; ".join(parts)


def dataset_table(rows: list[Row], source_bytes: int, baselines: Baselines) -> tuple[str, dict[str, dict]]:
    """The markdown table of one dataset plus the numbers behind it."""
    cp_row = next((r for r in rows if r.contender.name.endswith("cp-sync")), None)
    cp_wall = cp_row.wall_s if cp_row else None
    lines = [
        "| contender | wall s | GB/s | x cp+sync | peak RSS MB | above bare python MB | above same imports MB | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    numbers = {}
    for row in rows:
        n = row_numbers(row, source_bytes, cp_wall, baselines)
        numbers[row.contender.name] = n
        f2 = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        lines.append(
            f"| {row.contender.name} | {f2(n['wall_s'], '.2f')} | {f2(n['gb_per_s'], '.2f')} | {f2(n['ratio_to_cp_sync'], '.2f')} "
            f"| {_mb(n['peak_rss_kb'])} | {_mb(n['above_bare_python_kb'])} | {_mb(n['above_same_imports_kb'])} | {notes_of(row)} |"
        )
    return "\n".join(lines), numbers


def tiny_section(rows: list[Row]) -> list[str]:
    """Plan + convert times of the 100k-tiny-tensor checkpoint, from inside the child."""
    lines = ["| contender | tensors | plan s | convert s | plan + convert s | wall incl. start-up s |", "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        if not row.contender.ours or not row.ok_runs:
            continue
        r = row.result
        plan_s, convert_s = r.get("plan_s"), r.get("convert_s")
        both = plan_s + convert_s if plan_s is not None and convert_s is not None else None
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"| {row.contender.name} | {r.get('tensors', '-')} | {f(plan_s)} | {f(convert_s)} | {f(both)} | {f(row.wall_s)} |")
    return lines


def peak_section(rows: list[Row]) -> list[str]:
    """Predicted (by the plan) against measured (by the engine) peak of tensor bytes held."""
    lines = ["| contender | predicted peak MB | measured peak MB | measured / predicted |", "|---|---:|---:|---:|"]
    for row in rows:
        if not row.contender.ours or not row.ok_runs:
            continue
        predicted = row.result.get("predicted_peak_bytes")
        measured = row.result.get("measured_peak_bytes")
        if predicted is None or measured is None:
            continue
        ratio = f"{measured / predicted:.3f}" if predicted else ("exact (nothing held: byte-level copies)" if measured == 0 else "-")
        lines.append(f"| {row.contender.name} | {predicted / 1e6:.1f} | {measured / 1e6:.1f} | {ratio} |")
    return lines


def _engine_speedup(one: Row | None, two: Row | None) -> float | None:
    """1-rank over 2-rank time spent converting: the slowest rank's own seconds, without process start-up."""
    if one is None or two is None or not one.ok_runs or not two.ok_runs:
        return None
    single = one.result.get("report", {}).get("rank_seconds") or []
    double = two.result.get("report", {}).get("rank_seconds") or []
    return max(single) / max(double) if single and double and max(double) > 0 else None


def target_checks(rows: dict[str, Row], numbers: dict[str, dict]) -> list[str]:
    """The issue's targets, each PASS / FAIL / n/a with the figure behind it."""
    checks = []

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    for name, floor, label in (("wb-pass", 0.8, "pass-through"), ("wb-fuse", 0.8, "dim-0 fusion"), ("wb-cast", 0.5, "fp32->bf16 cast")):
        ratio = numbers.get(name, {}).get("ratio_to_cp_sync")
        shown = "-" if ratio is None else f"{ratio:.2f}x"
        checks.append(f"| {label} throughput >= {floor}x cp+sync | {shown} | {verdict(None if ratio is None else ratio >= floor)} |")
    above = [
        (n, v["above_same_imports_kb"]) for n, v in numbers.items()
        if rows[n].contender.ours and rows[n].contender.dataset == "synth" and v.get("above_same_imports_kb") is not None
    ]
    if above:
        worst_name, worst = max(above, key=lambda item: item[1])
        checks.append(
            f"| peak RSS above interpreter baseline <= 150 MB (worst of ours on the synthetic checkpoint, "
            f"baseline = same imports) | {worst / 1024:.0f} MB ({worst_name}) | {verdict(worst / 1024 <= 150)} |"
        )
    else:
        checks.append("| peak RSS above interpreter baseline <= 150 MB | - | n/a |")
    tiny = [r for n, r in rows.items() if rows[n].contender.dataset == "tiny" and r.contender.ours and r.ok_runs]
    times = [(r.contender.name, r.result.get("plan_s", 0) + r.result.get("convert_s", 0)) for r in tiny if r.result.get("convert_s") is not None]
    if times:
        worst_name, worst = max(times, key=lambda item: item[1])
        checks.append(f"| plan + convert of 100k tiny tensors < 10 s | {worst:.2f} s ({worst_name}) | {verdict(worst < 10)} |")
    else:
        checks.append("| plan + convert of 100k tiny tensors < 10 s | - | n/a |")
    errors = []
    for r in rows.values():
        p, m = r.result.get("predicted_peak_bytes"), r.result.get("measured_peak_bytes")
        if r.contender.ours and p is not None and m is not None:
            errors.append((r.contender.name, abs(m - p) / p if p else (0.0 if m == 0 else float("inf"))))
    if errors:
        worst_name, worst = max(errors, key=lambda item: item[1])
        checks.append(f"| predicted peak tensor bytes within 10 % of measured | worst {worst * 100:.1f} % ({worst_name}) | {verdict(worst <= 0.10)} |")
    else:
        checks.append("| predicted peak tensor bytes within 10 % of measured | - | n/a |")
    one = numbers.get("wb-cast-1r", {}).get("wall_s")
    for two_name, how in (("wb-cast-2r", "torchrun"), ("wb-cast-2l", "local launcher")):
        two = numbers.get(two_name, {}).get("wall_s")
        speedup = one / two if one and two else None
        engine = _engine_speedup(rows.get("wb-cast-1r"), rows.get(two_name))
        inside = "" if engine is None else f" (inside the engine, start-up excluded: {engine:.2f}x)"
        shown = "-" if speedup is None else f"{speedup:.2f}x wall{inside}"
        checks.append(f"| 2 ranks ({how}) >= 1.6x faster than 1 on the cast (same {RANK_SHARDS} shards) | {shown} | "
                      f"{verdict(None if speedup is None else speedup >= 1.6)} |")
    one_rank = rows.get("wb-cast-1r")
    cpu, wall = (one_rank.result.get("cpu_s"), one_rank.result.get("work_s")) if one_rank else (None, None)
    if cpu and wall:
        cores = os.cpu_count() or 1
        checks.append(f"| (context) CPU use of the 1-rank cast, all threads | {cpu / wall:.2f} cores of {cores}: "
                      f"2 ranks can be at most {cores / (cpu / wall):.2f}x faster here | - |")
    return ["| target | measured | verdict |", "|---|---|---|", *checks]


def machine_line(load_at_start: float) -> str:
    """CPU, memory, versions and load: what a reader needs to judge the numbers."""
    mem = ""
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        total_kb = next(int(ln.split()[1]) for ln in meminfo if ln.startswith("MemTotal"))
        mem = f", {total_kb / 1e6:.0f} GB RAM"
    except (OSError, StopIteration):
        pass
    try:
        from importlib.metadata import version

        torch = f", torch {version('torch')}"
    except Exception:
        torch = ""
    return f"{platform.machine()}, {os.cpu_count()} CPUs{mem}, Python {platform.python_version()}{torch}, load average {load_at_start:.2f} at start, {os.getloadavg()[0]:.2f} at end"


def report(rows: list[Row], inputs: dict[str, Path], baselines: Baselines, args: argparse.Namespace, command: str, load: float) -> tuple[str, dict]:
    """The whole markdown report and the raw numbers."""
    machine = machine_line(load)
    out = [
        "## Conversion benchmark",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}.  ",
        f"Each contender ran {args.repeat} time(s) in a fresh process (median wall shown, max peak RSS). "
        "Before every run the source files were read once (page cache warm for everyone), pending writes flushed, "
        f"the machine left idle {args.settle:g} s and {args.prime:g} GiB of memory touched and freed just before the start, "
        "so every run starts from the same memory state. "
        "Wall time includes interpreter start-up and, for tools that do not fsync, the harness's fsync of their outputs "
        "(the durability cp+sync and the workbench provide). GB/s = source tensor-file bytes / wall (1 GB = 1e9 B). "
        f"Bare interpreter peak RSS: {baselines.rss_kb() / 1024:.0f} MB; 'above same imports' subtracts an interpreter "
        "that imported the same libraries the contender ended up importing.",
    ]
    by_name = {r.contender.name: r for r in rows}
    all_numbers: dict[str, dict] = {}
    for dataset, folder in inputs.items():
        subset = [r for r in rows if r.contender.dataset == dataset]
        source_bytes = tensor_bytes(folder)
        stamp = json.loads((folder / "bench_input.json").read_text())
        table, numbers = dataset_table(subset, source_bytes, baselines)
        all_numbers.update(numbers)
        out += ["", f"### {DATASETS[dataset]}", "", f"`{folder}`: {source_bytes / 2**30:.2f} GiB in {len(list(folder.glob('*.safetensors')))} files; {_describe(stamp)}", "", table]
        if dataset == "tiny":
            out += ["", "Plan and convert times measured inside the child (after imports):", "", *tiny_section(subset)]
    peak = peak_section(rows)
    if len(peak) > 2:
        out += ["", "### Predicted vs measured peak of tensor bytes held (engine report)", "", *peak]
    out += ["", "### Targets", "", *target_checks(by_name, all_numbers)]
    raw = {
        "command": command, "machine": machine, "repeat": args.repeat,
        "inputs": {k: str(v) for k, v in inputs.items()},
        "bare_python_rss_kb": baselines.rss_kb(),
        "contenders": {
            r.contender.name: {
                "dataset": r.contender.dataset, "what": r.contender.what, "error": r.error,
                "runs": [{"wall_s": m.wall_s, "sync_s": m.sync_s, "maxrss_kb": m.maxrss_kb, "returncode": m.returncode, "result": m.result} for m in r.runs],
                **all_numbers.get(r.contender.name, {}),
            }
            for r in rows
        },
    }
    return "\n".join(out) + "\n", raw


def _describe(stamp: dict) -> str:
    if stamp.get("kind") == "synthetic-llama":
        s = stamp["shape"]
        return f"hidden {s['hidden']}, intermediate {s['intermediate']}, heads {s['heads']}/{s['kv_heads']} kv, {s['layers']} layers, vocab {s['vocab']}"
    if stamp.get("kind") == "tiny-tensors":
        return f"{stamp['tensors']} tensors"
    return f"saved by transformers {stamp.get('transformers', '')}".strip()


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=2.0, help="size of the synthetic Llama checkpoint (default 2)")
    parser.add_argument("--workdir", type=Path, default=HERE / "_data", help="inputs, outputs, logs (default benchmarks/_data)")
    parser.add_argument("--only", help="comma-separated contender names or prefixes (e.g. wb,d9d); cp+sync always runs")
    parser.add_argument("--repeat", type=int, default=3, help="runs per contender; the median is shown (default 3)")
    parser.add_argument("--tiny-tensors", type=int, default=100_000, help="tensor count of the tiny-tensor checkpoint")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before one run is killed (default 900)")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds idle before each run, so every contender starts from the same memory state (default 5)")
    parser.add_argument("--prime", type=float, default=6.0, metavar="GIB",
                        help="GiB of memory touched and freed just before each run: every contender finds the same "
                             "recently freed memory (default 6; 0 turns it off)")
    parser.add_argument("--list", action="store_true", help="list the contenders and exit")
    args = parser.parse_args(argv)
    rows_all = contenders()
    if args.list:
        for c in rows_all:
            print(f"{c.name:14} {c.dataset:6} {c.what}")
        return
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1.")
    command = "python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if os.environ.get("PYTHONPATH"):
        command = f"PYTHONPATH={os.environ['PYTHONPATH']} {command}"
    chosen = select(rows_all, args.only)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average is {load:.2f}; other work on this machine will skew the numbers", file=sys.stderr)
    inputs = make_inputs({c.dataset for c in chosen}, workdir, args.size_gib, args.tiny_tensors)
    rows = run_all(chosen, inputs, workdir, args.repeat, args.timeout, args.settle, args.prime)
    baselines = Baselines(workdir / "logs")
    text, raw = report(rows, inputs, baselines, args, command, load)
    (workdir / "results.md").write_text(text)
    (workdir / "results.json").write_text(json.dumps(raw, indent=1, default=str))
    print(text)


if __name__ == "__main__":
    main()
