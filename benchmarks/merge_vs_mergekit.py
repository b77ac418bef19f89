"""Merging three checkpoints: the workbench against `mergekit-yaml --lazy-unpickle` (mergekit 0.1.5, CPU), whole processes.

    python benchmarks/merge_vs_mergekit.py [--size-gib 1.1] [--methods linear,ties] [--repeats 1] [--shards 1]
                                           [--workdir /tmp/wb-merge-bench] [--keep]

Builds three bf16 Llama-shaped checkpoints of `--size-gib` each (benchmarks/make_llama_like.py: TinyLlama widths,
random values, one file each unless `--shards`), then for each method runs, back to back and alternating the
order per repeat, `mergekit-yaml CONFIG OUT --lazy-unpickle --no-copy-tokenizer` from the mergekit venv and the
workbench's merge of the same config (`wb.convert(sources, OUT, M.presets.merge(...))` in a fresh process, with
Python's bytecode cache on as a user's install has it; one warm-up run first). Peak RSS and wall time come from
`/usr/bin/time -v` around each command; the workbench's dry-run prediction (`plan.rss_bytes`, computed before any
tensor byte is read) is printed beside its measurement. The inputs and outputs live in `--workdir` and are
deleted at the end unless `--keep`. Issue 32's targets: peak RSS <= 1/4 of mergekit's, wall time <= mergekit's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENV = ROOT / ".cache" / "fixtures" / "venv-mergekit-0.1.5-torch-2.13.0"
MIB = 1 << 20

CONFIGS = {
    "linear": ({"weight": 1.0}, None, {}),
    "ties": ({"weight": 0.5, "density": 0.5}, "m0", {}),
    "slerp": ({}, "m0", {"t": [0, 0.5, 1]}),
}

WORKBENCH = r"""
import json, sys, time
import workbench as wb
from workbench import mapper as M
spec = json.loads(sys.argv[1])
mapper = M.presets.merge(spec["method"], spec["models"], base_model=spec["base"], parameters=spec["parameters"])
plan = wb.plan(spec["sources"], mapper)
assert plan.ok, plan.problems
print("PREDICTED", plan.rss_bytes, plan.peak_bytes, flush=True)
wb.convert(spec["sources"], spec["out"], mapper, quiet=True)
"""


def build(workdir: Path, size_gib: float, shards: int) -> list[Path]:
    """Three bf16 checkpoints of about `size_gib` each (different seeds), reused when already there."""
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    from make_llama_like import make_synthetic_llama

    folders = []
    for k in range(3):
        folder = workdir / f"m{k}"
        make_synthetic_llama(folder, size_gib=size_gib, shards=shards, seed=k, dtype="BF16")
        folders.append(folder)
    return folders


def timed(command: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of `command` under /usr/bin/time -v."""
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{command[0]} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1)) * 1024  # type: ignore[union-attr]
    return wall, peak, done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.1)
    parser.add_argument("--methods", default="linear")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/wb-merge-bench"))
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    if not (VENV / "bin" / "mergekit-yaml").exists():
        print(f"mergekit venv missing: {VENV} (make fixtures builds it)", file=sys.stderr)
        return 2
    workdir = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(workdir / "pycache"), "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    rows = []
    try:
        folders = build(workdir, args.size_gib, args.shards)
        size = sum(f.stat().st_size for f in folders[0].glob("*.safetensors"))
        for method in args.methods.split(","):
            model_params, base, parameters = CONFIGS[method]
            names = [f.name for f in folders]
            config = {"merge_method": method, "dtype": None, "models": [
                {"model": str(f), **({"parameters": model_params} if model_params and f.name != base else {})} for f in folders]}
            if base:
                config["base_model"] = str(workdir / base)
            if parameters:
                config["parameters"] = parameters
            config = {k: v for k, v in config.items() if v is not None}
            path = workdir / f"{method}.yml"
            path.write_text(json.dumps(config))
            spec = {"method": method, "models": names, "base": base,
                    "parameters": {**parameters, **{k: v for k, v in model_params.items()}},
                    "sources": {f.name: str(f) for f in folders}, "out": str(workdir / "out-wb")}
            if base:  # the base first: it is the primary source (its names unscoped)
                spec["sources"] = {base: spec["sources"][base], **spec["sources"]}
            mergekit = [str(VENV / "bin" / "mergekit-yaml"), str(path), str(workdir / "out-mk"), "--lazy-unpickle",
                        "--no-copy-tokenizer", "--random-seed", "0", "--quiet"]
            ours = [sys.executable, "-c", WORKBENCH, json.dumps(spec)]
            for out in ("out-mk", "out-wb"):
                shutil.rmtree(workdir / out, ignore_errors=True)
            timed(ours, env)  # warm-up (bytecode cache, page cache)
            results: dict[str, list[tuple[float, int]]] = {"mergekit": [], "workbench": []}
            predicted = 0
            for repeat in range(args.repeats):
                order = [("mergekit", mergekit), ("workbench", ours)]
                for side, command in order if repeat % 2 == 0 else order[::-1]:
                    for out in ("out-mk", "out-wb"):
                        shutil.rmtree(workdir / out, ignore_errors=True)
                    subprocess.run(["sync"], check=False)
                    time.sleep(1)
                    wall, peak, stdout = timed(command, env)
                    results[side].append((wall, peak))
                    found = re.search(r"PREDICTED (\d+)", stdout)
                    predicted = int(found.group(1)) if found else predicted
            mk_wall = statistics.median(w for w, _ in results["mergekit"])
            mk_rss = statistics.median(r for _, r in results["mergekit"])
            wb_wall = statistics.median(w for w, _ in results["workbench"])
            wb_rss = statistics.median(r for _, r in results["workbench"])
            rows.append((method, size, mk_wall, mk_rss, wb_wall, wb_rss, predicted))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n3 models x bf16, {args.shards} file(s) each, {args.repeats} repeat(s), {os.cpu_count()} CPUs\n")
    print("| method | size/model | mergekit wall | mergekit peak RSS | workbench wall | workbench peak RSS | predicted RSS | time ratio | RSS ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method, size, mk_wall, mk_rss, wb_wall, wb_rss, predicted in rows:
        print(f"| {method} | {size / MIB:.0f} MiB | {mk_wall:.1f} s | {mk_rss / MIB:.0f} MiB | {wb_wall:.1f} s | "
              f"{wb_rss / MIB:.0f} MiB | {predicted / MIB:.0f} MiB | {wb_wall / mk_wall:.2f}x | {wb_rss / mk_rss:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
