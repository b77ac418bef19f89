"""How fast does a huge checkpoint open? Headers-only work on a 405B-shaped and a 100k-tensor checkpoint.

Both checkpoints are sparse files (see make_sparse.py): real headers, data as holes, so the numbers
are those of the real thing with a warm page cache. For each we time, best and median of `--repeat`:

- `open_catalog`                      parse and validate every header and the index
- `open_checkpoint(...).tensors`      the same plus the pandas table of tensors
- `.layers`                           folding into `model.layers.{i}...` patterns (on an opened checkpoint)
- `verify`                            the full structural check
- `workbench inspect` (subprocess)    what a user waits for at the shell, Python start-up included

Usage: python benchmarks/bench_open.py [--dir DIR] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_sparse import make_sparse_llama, make_sparse_tiny  # noqa: E402

from workbench.explore.checkpoint import open_checkpoint  # noqa: E402
from workbench.explore.verify import verify  # noqa: E402
from workbench.formats import open_catalog  # noqa: E402
from workbench.iostats import IO  # noqa: E402


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(best, median) wall seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def _cli_seconds(path: Path, repeat: int) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "workbench", "inspect", str(path)]
    return timed(lambda: subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL), repeat)


def bench_checkpoint(label: str, path: Path, repeat: int) -> list[dict]:
    """Time the header-only operations on one checkpoint; one row per operation."""
    IO.reset()
    catalog = open_catalog(path)
    io = IO.snapshot()
    header_bytes = sum(f.header_bytes for f in catalog.files.values())
    facts = {
        "checkpoint": label,
        "files": len(catalog.files),
        "tensors": len(catalog),
        "tensor_bytes": catalog.total_bytes,
        "bytes_read": io["bytes_read"],
        "header_bytes": header_bytes,
    }
    opened = open_checkpoint(path)
    steps: list[tuple[str, Callable[[], object]]] = [
        ("open_catalog", lambda: open_catalog(path)),
        ("open_checkpoint().tensors", lambda: open_checkpoint(path).tensors),
        (".layers (opened)", lambda: open_checkpoint(opened.catalog).layers),
        ("verify", lambda: verify(path)),
    ]
    rows = []
    for step, fn in steps:
        best, median = timed(fn, repeat)
        rows.append({**facts, "step": step, "best_s": best, "median_s": median})
    best, median = _cli_seconds(path, repeat)
    rows.append({**facts, "step": "workbench inspect (subprocess)", "best_s": best, "median_s": median})
    return rows


def print_table(rows: list[dict]) -> None:
    """The results as an aligned text table, one block per checkpoint."""
    seen = set()
    for row in rows:
        if row["checkpoint"] not in seen:
            seen.add(row["checkpoint"])
            print(
                f"\n{row['checkpoint']}: {row['files']} files, {row['tensors']:,} tensors, "
                f"{row['tensor_bytes'] / 1e9:,.1f} GB of tensors; open read {row['bytes_read']:,} bytes "
                f"(headers: {row['header_bytes']:,})"
            )
            print(f"  {'step':34s} {'best':>9s} {'median':>9s}")
        print(f"  {row['step']:34s} {row['best_s']:8.3f}s {row['median_s']:8.3f}s")


def run(folder: Path, repeat: int = 3) -> list[dict]:
    """Build (or reuse) both sparse checkpoints under `folder` and time them."""
    llama = folder / "sparse-llama-405b"
    tiny = folder / "sparse-100k-tensors"
    made = time.perf_counter()
    make_sparse_llama(llama)
    make_sparse_tiny(tiny)
    print(f"inputs ready in {time.perf_counter() - made:.1f}s under {folder}", file=sys.stderr, flush=True)
    return bench_checkpoint("llama-405b (191 shards, BF16)", llama, repeat) + bench_checkpoint("100k tiny tensors", tiny, repeat)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: build the inputs, time, print a table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="where to build the sparse checkpoints (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if args.dir is None:
        with tempfile.TemporaryDirectory(prefix="bench-open-") as tmp:
            rows = run(Path(tmp), args.repeat)
    else:
        rows = run(args.dir, args.repeat)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
