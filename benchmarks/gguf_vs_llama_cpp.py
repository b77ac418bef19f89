"""Peak RSS and wall time of `wb.convert(..., to="gguf")` next to llama.cpp's convert_hf_to_gguf.py on one folder.

Usage: python benchmarks/gguf_vs_llama_cpp.py SRC_FOLDER [--outtype q8_0] [--work /tmp/x]
Each tool runs in its own child process; peak RSS is the child's ru_maxrss. The converter is the one the
tests fetch (llama-cpp-python sdist, cached under .cache/fixtures/).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


_WRAP = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")


def measure(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of one command, measured by a wrapper process of its own."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _WRAP, *cmd], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return seconds, int(done.stderr.strip().splitlines()[-1]) / 1024


def main() -> None:
    from gguf_support.reference import EXTRA, converter

    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("--outtype", default="q8_0")
    parser.add_argument("--work", default="/tmp/gguf-bench")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{EXTRA}"}
    ours = [sys.executable, "-m", "workbench", "convert", args.src, str(work / "wb"), "--to", "gguf", "--dtype", args.outtype, "--overwrite"]
    theirs = [sys.executable, str(converter()), args.src, "--outtype", args.outtype, "--outfile", str(work / "ref.gguf")]
    rows = [("workbench --to gguf", *measure(ours, env)), ("convert_hf_to_gguf.py", *measure(theirs, env))]
    size = sum(p.stat().st_size for p in Path(args.src).glob("*.safetensors")) / 2**20
    print(f"input: {args.src} ({size:.1f} MiB safetensors), outtype {args.outtype}")
    print(f"{'tool':24} {'seconds':>8} {'peak RSS MiB':>13}")
    for name, seconds, rss in rows:
        print(f"{name:24} {seconds:8.2f} {rss:13.0f}")


if __name__ == "__main__":
    main()
