"""Do value stats and histograms read a tensor as fast as the engine's cast reads it? (issue 34 item 6)

Writes one F32 tensor of `--size-mib` (random normal values, one safetensors file), reads it once so the
page cache is warm for everyone, then times, in this process and best of `--repeat`:

    cast        `wb.convert(..., dtype="bf16")` of the file: the engine's read + cast + write
    stats       `Checkpoint.stats` with the Explorer's chunk size (what *Value stats* runs)
    histogram   `Checkpoint.plot_histogram`'s counting with the Explorer's chunk size (two passes: range,
                then counts; its speed counts both passes' bytes, as its progress bar does)

Each speed is source bytes read per second; the ratio column is speed / cast speed. The goal is >= 0.7.

Usage: python benchmarks/bench_stats.py [--size-mib 256] [--workdir DIR] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import workbench as wb
from workbench.explore.stats import histogram, tensor_stats
from workbench.widgets.explorer import READ_CHUNK_ELEMENTS

NAME = "model.big.weight"


def write_tensor(path: Path, size_bytes: int) -> Path:
    """One F32 tensor of random normal values, `size_bytes` long (rounded to 4096-value rows)."""
    rows = max(1, size_bytes // (4 * 4096))
    header = json.dumps({NAME: {"dtype": "F32", "shape": [rows, 4096], "data_offsets": [0, rows * 4096 * 4]}}).encode()
    header += b" " * (-len(header) % 8)
    rng = np.random.default_rng(0)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        for start in range(0, rows, 1024):
            fh.write(rng.standard_normal((min(1024, rows - start), 4096), dtype=np.float32).tobytes())
    return path


def best_seconds(action: Callable[[], object], repeat: int) -> float:
    """The shortest wall time of `repeat` runs (the machine may be shared: the best run is the least disturbed)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(workdir: Path, size_mib: int = 256, repeat: int = 3) -> dict[str, float]:
    """Speeds in bytes/s of `cast`, `stats` and `histogram` on the same file (see the module docstring)."""
    source = write_tensor(workdir / "values.safetensors", size_mib << 20)
    source.read_bytes()  # warm page cache for every contender
    checkpoint = wb.open_checkpoint(source)
    nbytes = checkpoint.catalog[NAME].nbytes
    import torch  # noqa: F401  (the chunk reader's import is not part of any timing)

    target = workdir / "cast"

    def cast() -> None:
        shutil.rmtree(target, ignore_errors=True)
        wb.convert(source, target, dtype="bf16", quiet=True)

    seconds = {
        "cast": best_seconds(cast, repeat),
        "stats": best_seconds(lambda: tensor_stats(checkpoint.catalog, NAME, READ_CHUNK_ELEMENTS), repeat),
        "histogram": best_seconds(lambda: histogram(checkpoint.catalog, NAME, chunk_elements=READ_CHUNK_ELEMENTS), repeat) / 2,
    }
    shutil.rmtree(target, ignore_errors=True)
    return {what: nbytes / s for what, s in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        speeds = measure(Path(tmp), args.size_mib, args.repeat)
    print(f"| read ({args.size_mib} MiB F32) | MiB/s | ratio to cast |\n|---|---|---|")
    for what, speed in speeds.items():
        print(f"| {what} | {speed / 2**20:,.0f} | {speed / speeds['cast']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
