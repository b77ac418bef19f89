"""Measure the start-up memory of conversion processes: the constants of `workbench/planning/rss_calibration.py`.

The RSS prediction (`plan.rss_bytes`) adds, to the plan's tensor bytes, what a process costs before it
holds any tensor: the interpreter, the modules its entry point imports, numpy or torch when its steps need
them, and the catalog and plan per source tensor. Those are measured here, on conversions of tiny
checkpoints (so their tensor bytes are negligible), as the kernel's peak RSS of each process
(the number `/usr/bin/time -v` prints as "Maximum resident set size"):

    interpreter   python -c pass
    cli           workbench convert, byte copies, N_SMALL tensors      - interpreter - metadata
    per tensor    (the same with N_LARGE tensors - with N_SMALL) / (N_LARGE - N_SMALL)
    numpy         workbench convert --dtype bf16 (numpy casts)         - the byte-copy run
    torch         workbench convert --mapper transpose.py (torch ops)  - the byte-copy run
    worker        a worker's peak RSS in a 2-process byte-copy run     - interpreter - metadata

A library's resident pages depend on how the kernel holds its files in the page cache: where the file
cache uses large folios (ext4 on Linux >= 6.16, xfs, btrfs), a library read sequentially (a fresh pip
install, a copy, a backup) is mapped a whole folio per fault, and torch then costs ~75 MB more than when
the loader paged its files in by faults. Each library is measured in both states (its files evicted
with posix_fadvise, then optionally read through once, no root needed); the larger is the constant,
the difference is LIBRARY_SPREAD.

Each run is repeated (--repeat, median kept). Usage:
    python scripts/calibrate_rss.py            # print the measured constants next to the current ones
    python scripts/calibrate_rss.py --write    # and rewrite workbench/planning/rss_calibration.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIME = "/usr/bin/time"
TARGET = ROOT / "workbench" / "planning" / "rss_calibration.py"
N_SMALL = 200
N_LARGE = 20200
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}


def peak_rss(argv: list[str]) -> int:
    """Peak RSS in bytes of a process, as `/usr/bin/time` reports it ("Maximum resident set size").

    Not `os.wait4` from this process: a child forked from a large parent starts with the parent's
    high-water mark (the kernel keeps it across exec), so only a small launcher gives the child's own.
    """
    if not os.access(TIME, os.X_OK):
        raise SystemExit(f"Cannot calibrate: {TIME} is missing. Install it (Debian: apt-get install time).")
    proc = subprocess.run([TIME, "-f", "%M", *argv], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"Cannot calibrate: {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return int(proc.stderr.strip().splitlines()[-1]) * 1024


def library_files(name: str) -> list[Path]:
    """The shared objects of an installed library (what the loader maps when it is imported)."""
    from importlib.util import find_spec

    spec = find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"Cannot calibrate: {name} is not installed in {sys.executable}.")
    package = Path(next(iter(spec.submodule_search_locations)))
    roots = [package, package.parent / f"{name}.libs"]
    return sorted(f for root in roots if root.is_dir() for f in root.rglob("*.so*") if f.is_file())


def set_page_cache(files: list[Path], sequential: bool) -> None:
    """Evict `files` from the page cache (pages no process maps); with `sequential`, read each through once."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if sequential:
                while os.read(fd, 1 << 20):
                    pass
        finally:
            os.close(fd)


def median_of(repeat: int, measure) -> int:
    return int(statistics.median(measure() for _ in range(repeat)))


def tiny_checkpoint(folder: Path, count: int) -> Path:
    """`count` small float32 tensors with Llama-like names in one model.safetensors."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.layers.{i // 8}.block_{i % 8}.proj.weight": np.full((8, 8), i % 7, np.float32) for i in range(count)}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def convert_argv(src: Path, dest: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "workbench", "convert", str(src), str(dest), "--overwrite", *extra]  # with its progress bar, as users run it


WORKER_DRIVER = """
import json, sys
import workbench as wb
report = wb.convert(sys.argv[1], sys.argv[2], nproc=2, launcher="local", quiet=True, overwrite=True)
print(json.dumps([r.rss_peak for r in report.ranks]))
"""


def worker_peak(src: Path, dest: Path) -> int:
    """The largest worker's peak RSS (its own measurement) in a 2-process byte-copy run."""
    out = subprocess.run([sys.executable, "-c", WORKER_DRIVER, str(src), str(dest)], env=ENV, check=True,
                         capture_output=True, text=True)
    return max(json.loads(out.stdout.strip().splitlines()[-1]))


def measure(repeat: int) -> dict:
    """Every constant, in bytes."""
    with tempfile.TemporaryDirectory(prefix="wb-rss-") as tmp:
        work = Path(tmp)
        small = tiny_checkpoint(work / "small", N_SMALL)
        large = tiny_checkpoint(work / "large", N_LARGE)
        transpose = work / "transpose.py"
        transpose.write_text("from workbench import mapper as M\nmapper = M.Transpose('model.layers.{i}.block_0.proj.weight')\n")
        out = work / "out"
        interpreter = median_of(repeat, lambda: peak_rss([sys.executable, "-c", "pass"]))
        copy_small = median_of(repeat, lambda: peak_rss(convert_argv(small, out)))
        copy_large = median_of(repeat, lambda: peak_rss(convert_argv(large, out)))
        runs = {"numpy": convert_argv(small, out, "--dtype", "bf16"), "torch": convert_argv(small, out, "--mapper", str(transpose))}
        library: dict[str, int] = {}
        spread: dict[str, int] = {}
        for name, argv in runs.items():
            states = []
            for sequential in (False, True):
                set_page_cache(library_files(name), sequential)
                states.append(median_of(repeat, lambda argv=argv: peak_rss(argv)) - copy_small)
            library[name], spread[name] = max(0, max(states)), abs(states[1] - states[0])
        worker = median_of(repeat, lambda: worker_peak(small, out))
    per_tensor = max(0, (copy_large - copy_small) // (N_LARGE - N_SMALL))
    return {
        "INTERPRETER": interpreter,
        "WORKBENCH": {
            "cli": copy_small - interpreter - per_tensor * N_SMALL,
            "worker": worker - interpreter - per_tensor * N_SMALL,
        },
        "LIBRARY": library,
        "LIBRARY_SPREAD": spread,
        "PER_TENSOR": per_tensor,
    }


def versions() -> str:
    import numpy
    import torch

    return (f"{platform.system()} {platform.machine()}, CPython {platform.python_version()}, numpy {numpy.__version__}, "
            f"torch {torch.__version__}")


def measured_with() -> dict[str, str]:
    """The versions the constants hold for (what planning.rss compares with the installed ones)."""
    from importlib.metadata import version

    return {"python": platform.python_version(), "numpy": version("numpy"), "torch": version("torch")}


def module_text(values: dict, repeat: int) -> str:
    """The calibration module, as `--write` leaves it."""
    return f'''"""Measured memory of conversion processes before they hold any tensor (bytes): what `planning.rss` adds to
the plan's tensor peak. Written by `python scripts/calibrate_rss.py --write` (see it for how each number is
measured: peak RSS of real `workbench convert` runs on tiny checkpoints, median of {repeat}); re-run it after a
Python, numpy or torch upgrade, or on a new platform.

Measured {date.today().isoformat()} on {versions()}.
"""

INTERPRETER = {values["INTERPRETER"]}  # python -c pass
WORKBENCH = {{"cli": {values["WORKBENCH"]["cli"]}, "worker": {values["WORKBENCH"]["worker"]}}}  # the entry point's modules and run state
LIBRARY = {{"numpy": {values["LIBRARY"]["numpy"]}, "torch": {values["LIBRARY"]["torch"]}}}  # added by importing and using each (the larger page-cache state)
LIBRARY_SPREAD = {{"numpy": {values["LIBRARY_SPREAD"]["numpy"]}, "torch": {values["LIBRARY_SPREAD"]["torch"]}}}  # how much less each costs when its files were paged in by faults
PER_TENSOR = {values["PER_TENSOR"]}  # catalog and plan, per source tensor
MEASURED_WITH = {measured_with()!r}  # planning.rss.calibration_mismatch compares these with what is installed
'''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {TARGET.relative_to(ROOT)}")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median kept)")
    args = parser.parse_args(argv)
    values = measure(args.repeat)
    sys.path.insert(0, str(ROOT))
    from workbench.planning import rss_calibration as current

    def mib(n: int) -> str:
        return f"{n / 2**20:.1f} MiB"

    rows = [("interpreter", current.INTERPRETER, values["INTERPRETER"])]
    rows += [(f"workbench ({k})", current.WORKBENCH[k], v) for k, v in values["WORKBENCH"].items()]
    rows += [(k, current.LIBRARY[k], v) for k, v in values["LIBRARY"].items()]
    rows += [(f"{k} spread", getattr(current, "LIBRARY_SPREAD", {}).get(k, 0), v) for k, v in values["LIBRARY_SPREAD"].items()]
    rows.append(("per tensor (bytes)", current.PER_TENSOR, values["PER_TENSOR"]))
    print("| constant | current | measured now |\n|---|---:|---:|")
    for name, old, new in rows:
        show = str if name.startswith("per tensor") else mib
        print(f"| {name} | {show(old)} | {show(new)} |")
    if args.write:
        TARGET.write_text(module_text(values, args.repeat), encoding="utf-8")
        print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
