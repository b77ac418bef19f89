"""Hub -> S3: a conversion from `hf://` straight into `s3://`, against a plain fsspec copy of the same files.

Both ends are served locally: the Hub fixture (`tests/remote_servers.HubServer`, file bodies paced at `--rate`
per connection, like nginx's limit_rate in bench_remote.py) and moto's S3 server behind a TCP proxy that paces
each connection at `--rate` in both directions. Times, best of `--repeat`:

- `fsspec copy`   every shard read from its Hub `resolve/` URL with fsspec's HTTP file system and written with
                  s3fs (`open(..., "wb")`, multipart), the shards `--copy-threads` at a time: the plain way to
                  move the same bytes from the Hub to S3, without the workbench
- `convert`       `wb.convert("hf://org/synth", "s3://bench/out/")`, pass-through
- `convert bf16`  the same with `dtype="bfloat16"` (half the bytes uploaded)
- the two halves alone, to see which side bounds the conversion: `hf://` -> a local folder, a local copy of
  the files -> `s3://`

Usage: python benchmarks/bench_hub_s3.py [--size-gib 0.25] [--repeat 3] [--rate 40m] [--copy-threads 4]
       [--workdir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from make_llama_like import make_synthetic_llama  # noqa: E402
from remote_servers import HubServer  # noqa: E402

import workbench as wb  # noqa: E402

BLOCK = 1 << 18


def rate_bytes(text: str) -> int:
    """nginx's size syntax: 40m = 40 MiB, 512k = 512 KiB, plain bytes otherwise; '' or 0 is unlimited."""
    if not text:
        return 0
    unit = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if unit > 1 else text) * unit)


class PacedProxy:
    """A TCP proxy on 127.0.0.1 to `target` (host, port) that sends at most `rate` bytes per second per connection
    and direction (0: unlimited), as a link slower than the disk would."""

    def __init__(self, target: tuple[str, int], rate: int) -> None:
        self.target, self.rate = target, rate
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        started, sent = time.monotonic(), 0
        try:
            while data := src.recv(BLOCK):
                if self.rate:
                    if sent == 0 or time.monotonic() - started > 1.0 + sent / self.rate:  # idle keep-alive: restart the clock
                        started, sent = time.monotonic(), 0
                    sent += len(data)
                    time.sleep(max(0.0, started + sent / self.rate - time.monotonic()))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop = True
        self.sock.close()


def fsspec_copy(hub_url: str, files: list[str], s3, prefix: str, threads: int) -> int:
    """Copy each shard from its Hub resolve URL into S3 with plain fsspec/s3fs file objects; bytes copied."""
    import fsspec

    http = fsspec.filesystem("http")

    def one(name: str) -> int:
        with http.open(f"{hub_url}/org/synth/resolve/main/{name}", "rb", block_size=16 << 20) as src, \
                s3.open(f"{prefix}/{name}", "wb", block_size=16 << 20) as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
        return s3.size(f"{prefix}/{name}")

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, files))


def best(fn, repeat: int, reset) -> float:
    times = []
    for _ in range(repeat):
        reset()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    reset()
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=0.25)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rate", default="40m", help="per connection and direction, nginx syntax (default 40m; 0: unlimited)")
    parser.add_argument("--copy-threads", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rate = rate_bytes(args.rate if args.rate != "0" else "")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-hub-s3-"))
    data = work / "data" / "synth"
    make_synthetic_llama(data, size_gib=args.size_gib)
    files = sorted(p.name for p in data.iterdir() if p.is_file())

    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       "WORKBENCH_CACHE": str(work / "cache"), "WORKBENCH_SPOOL_DIR": str(work / "spool")})
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    proxy = PacedProxy(moto.get_host_and_port(), rate)
    hub = HubServer(work / "hub-store", rate=rate)
    hub.add("org/synth", data)
    os.environ.update({"HF_ENDPOINT": hub.url, "AWS_ENDPOINT_URL": proxy.url})
    import s3fs

    s3 = s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": proxy.url})
    s3.mkdir("bench")
    rows = []
    try:
        wb.open_checkpoint("hf://org/synth")  # headers cached: the timed runs measure the data path

        def reset() -> None:
            if s3.exists("bench/out"):
                s3.rm("bench/out", recursive=True)
            s3.invalidate_cache()
            shutil.rmtree(work / "cache" / "hub-ledger", ignore_errors=True)

        def measured(name: str, fn) -> None:
            rows.append({"what": name, "seconds": best(fn, args.repeat, reset)})

        measured("fsspec copy (HTTP -> s3fs)", lambda: fsspec_copy(hub.url, files, s3, "bench/out", args.copy_threads))
        measured("convert hf:// -> s3://, pass-through",
                 lambda: wb.convert("hf://org/synth", "s3://bench/out/", None, quiet=True, extras=False))
        measured("convert hf:// -> s3://, bf16",
                 lambda: wb.convert("hf://org/synth", "s3://bench/out/", None, quiet=True, extras=False, dtype="bfloat16"))
        local = work / "local-out"
        measured("convert hf:// -> local folder (the download side alone)",
                 lambda: wb.convert("hf://org/synth", local, None, quiet=True, extras=False, overwrite=True))
        measured("convert local -> s3:// (the upload side alone)",
                 lambda: wb.convert(data, "s3://bench/out/", None, quiet=True, extras=False))
        shutil.rmtree(local, ignore_errors=True)
    finally:
        hub.stop()
        proxy.stop()
        moto.stop()
    base = rows[0]["seconds"]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    total = sum((data / n).stat().st_size for n in files)
    pace = f"{args.rate} per connection and direction" if rate else "unlimited"
    print(f"checkpoint: {total / 2**20:.0f} MiB in {len(files)} files; Hub fixture and moto S3 on 127.0.0.1, {pace}; "
          f"best of {args.repeat}; fsspec copy {args.copy_threads} files at a time\n")
    print("| run | time | MiB/s (source bytes) | vs fsspec copy |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['what']} | {r['seconds']:.2f} s | {total / 2**20 / r['seconds']:.0f} | {r['seconds'] / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
