"""Where does a remote conversion's time go? Conversion from a local range server vs fetching the same bytes.

Serves a synthetic Llama-shaped checkpoint (make_llama_like.py, F32, 4 shards) from Debian's nginx on
127.0.0.1 and times, best of `--repeat`:

- `fetch`        the byte ranges a conversion downloads (the plan's ranges: `chunk_ranges`), with the same
                 client (the workbench's RemoteStore over fsspec) and the same concurrency (`PARALLEL`),
                 bytes discarded: the network floor of a conversion
- `download`     the same, written into files and fsync'd (what download-then-convert pays first)
- `convert`      `wb.convert(url, out)`: pass-through into safetensors shards (fsync'd)
- `convert bf16` `wb.convert(url, out, dtype="bfloat16")`
- `local`        the same pass-through conversion from the files on disk, for reference

Requests and bytes are counted from nginx's access log. A loopback server is faster than any real link,
so the ratio convert/fetch is the workbench's overhead at its most visible.

`--rate 50m` makes nginx send at most that per connection (a link slower than the disk, as real ones are).

Usage: python benchmarks/bench_remote.py [--size-gib 0.25] [--repeat 3] [--rate 50m] [--workdir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from make_llama_like import make_synthetic_llama  # noqa: E402
from remote_servers import NGINX, Nginx  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.formats import remote_safetensors  # noqa: E402
from workbench.formats.remote import open_store  # noqa: E402


def fetch_like_a_conversion(url: str) -> int:
    """Download the ranges a pass-through conversion reads, PARALLEL at a time, and drop them; bytes fetched."""
    ck = wb.open_checkpoint(url)
    chunks = remote_safetensors.chunk_ranges(ck.catalog.tensors.values())
    store = open_store(url)
    pieces = [(c.rel, a, b) for c in chunks for a, b in c.pieces()]
    with ThreadPoolExecutor(remote_safetensors.PARALLEL) as pool:
        return sum(pool.map(lambda p: len(store.read(*p)), pieces))


def download(url: str, folder: Path) -> int:
    """`fetch` into files (written and fsync'd): the first half of download-then-convert."""
    ck = wb.open_checkpoint(url)
    chunks = remote_safetensors.chunk_ranges(ck.catalog.tensors.values())
    store = open_store(url)
    folder.mkdir(parents=True, exist_ok=True)
    fds = {rel: os.open(folder / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for rel in ck.catalog.files}

    def get(piece) -> int:
        rel, start, stop = piece
        return os.pwrite(fds[rel], store.read(rel, start, stop), start)

    try:
        with ThreadPoolExecutor(remote_safetensors.PARALLEL) as pool:
            total = sum(pool.map(get, [(c.rel, a, b) for c in chunks for a, b in c.pieces()]))
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return total


def best(fn, repeat: int, reset=None) -> float:
    times = []
    for _ in range(repeat):
        if reset is not None:
            reset()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=0.25)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--rate", default="", help="nginx limit_rate per connection, e.g. 50m (default: unlimited)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if NGINX is None:
        print("nginx is not installed (apt-get install nginx)", file=sys.stderr)
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-remote-"))
    data = work / "data"
    make_synthetic_llama(data / "synth", size_gib=args.size_gib)
    server = Nginx(data, work / "nginx", limit_rate=args.rate)
    url = f"{server.url}/synth/"
    out = work / "out"
    rows = []
    try:
        wb.open_checkpoint(url)  # headers cached: every timed run below measures the data path

        def clean() -> None:
            shutil.rmtree(out, ignore_errors=True)
            server.reset()

        def measured(name: str, fn) -> None:
            seconds = best(fn, args.repeat, clean)
            gets = [r for r in server.requests() if r[0] == "GET" and r[1].endswith(".safetensors")]
            rows.append({"what": name, "seconds": seconds, "requests": len(gets), "bytes": sum(r[3] for r in gets)})

        measured("fetch (same ranges, same client, same concurrency)", lambda: fetch_like_a_conversion(url))
        measured("download (fetch + write + fsync)", lambda: download(url, out))
        measured("convert (pass-through)", lambda: wb.convert(url, out, quiet=True, extras=False))
        measured("convert bf16", lambda: wb.convert(url, out, quiet=True, extras=False, dtype="bfloat16"))
        measured("local convert (reference)", lambda: wb.convert(data / "synth", out, quiet=True, extras=False))
    finally:
        server.stop()
    base = rows[0]["seconds"]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    total = sum(f.stat().st_size for f in (data / "synth").glob("*.safetensors"))
    rate = f", limit_rate {args.rate} per connection" if args.rate else ""
    print(f"checkpoint: {total / 2**20:.0f} MiB in 4 shards, nginx on 127.0.0.1{rate}, best of {args.repeat}; "
          f"ranges <= {remote_safetensors.CHUNK_BYTES >> 20} MiB, {remote_safetensors.PARALLEL} in parallel\n")
    print("| run | time | MiB/s | range requests | MiB downloaded | vs fetch |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        mib = r["bytes"] / 2**20
        rate = (total / 2**20) / r["seconds"]
        print(f"| {r['what']} | {r['seconds']:.2f} s | {rate:.0f} | {r['requests']} | {mib:.0f} | {r['seconds'] / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
