"""Local servers for remote-checkpoint tests: nginx (HTTP ranges), a Hub endpoint, moto's S3, and faults.

- `Nginx`: Debian's nginx in the foreground on 127.0.0.1 serving a folder; its access log records
  method, URI, status, `$body_bytes_sent` and `$http_range` per request, so tests count requests/bytes.
- `HubServer`: the Hub's HTTP interface as huggingface_hub 2.x uses it to read a repo's files:
  `GET /api/models/{org}/{repo}/revision/{rev}?blobs=true` (HfApi.model_info with files_metadata:
  id, sha, siblings with rfilename/size/blobId/lfs) and `GET|HEAD /{org}/{repo}/resolve/{rev}/{path}`
  (ranges -> 206 with Content-Range, ETag and X-Repo-Commit headers). It serves files from
  `repos[(repo_id, commit)] = folder`, revision "main" naming the latest commit added.
- `FaultyServer`: HTTP ranges with a chosen fault: drop the connection mid-body (`drop`), answer 200
  with the whole file (`ignore_range`), send a complete-looking but short 206 whose Content-Length
  lies about the range (`short`), or change the file's ETag after every GET (`change`); and the lying
  modes (`LYING`), on every GET when `min_bytes=0`: a body that never ends (`endless`), a gzip bomb
  (`gzip_bomb`: `Content-Encoding: gzip`, 2 GiB of zeros in 2 MB), HEAD and GET disagreeing about the size
  (`size_mismatch`: HEAD says 1,000 bytes, the GET announces and sends 3 GiB), a range shifted by 4 bytes at
  the asked length (`shift`), and a drip of one byte per `drip_seconds` (`drip`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SETTLE_PATH = "/__settle__/"  # marker requests of `Nginx._settle`, left out of `requests()`
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    """nginx serving `root` at http://127.0.0.1:PORT/ with a counting access log."""

    def __init__(self, root: Path, prefix: Path, *, limit_rate: str = "") -> None:
        self.root, self.prefix = root, prefix
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = prefix / "access.log"
        for sub in ("logs", "tmp"):
            (prefix / sub).mkdir(parents=True, exist_ok=True)
        user = "user root;\n" if os.getuid() == 0 else ""
        (prefix / "nginx.conf").write_text(
            f"{user}worker_processes 1;\nerror_log {prefix}/error.log;\npid {prefix}/nginx.pid;\n"
            "events { worker_connections 64; }\n"
            "http {\n"
            "  log_format counted '$request_method $uri $status $body_bytes_sent \"$http_range\"';\n"
            f"  access_log {self.log} counted;\n"
            f"  client_body_temp_path {prefix}/tmp/body; proxy_temp_path {prefix}/tmp/proxy;\n"
            f"  fastcgi_temp_path {prefix}/tmp/fcgi; uwsgi_temp_path {prefix}/tmp/uwsgi; scgi_temp_path {prefix}/tmp/scgi;\n"
            "  etag on; sendfile on;\n"
            + (f"  limit_rate {limit_rate};\n" if limit_rate else "")
            +
            f"  server {{ listen 127.0.0.1:{self.port}; root {root}; location / {{ autoindex off; }} }}\n"
            "}\n"
        )
        self._settled = 0
        self.proc = subprocess.Popen(
            [NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: nothing nginx signals can reach the test run's
        )
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"nginx failed: {self.proc.stderr.read().decode()}") from None
                time.sleep(0.05)

    def requests(self) -> list[tuple[str, str, int, int, str]]:
        """(method, uri, status, body bytes, range) per logged request, every request answered so far included."""
        self._settle()
        rows = []
        if self.log.exists():
            for line in self.log.read_text().splitlines():
                m = re.match(r'(\S+) (\S+) (\d+) (\d+) "(.*)"', line)
                if m and not m[2].startswith(SETTLE_PATH):
                    rows.append((m[1], m[2], int(m[3]), int(m[4]), m[5]))
        return rows

    def reset(self) -> None:
        """Forget the requests logged so far (nginx keeps the file open in append mode: truncating it is enough)."""
        self._settle()
        self.log.write_text("")

    def _settle(self) -> None:
        """Wait until every request answered so far is in the access log. nginx logs a request after its last byte
        has left, so a client can have its answer before the line is written. A marker request settles it: the one
        worker process handles events in turn and logs each request as it finishes, so once the marker's line is
        there, so is every line of a request answered before it (a state, not a sleep)."""
        self._settled += 1
        marker = f"{SETTLE_PATH}{self._settled}"
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as conn:
            conn.sendall(f"GET {marker} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
            while conn.recv(65536):
                pass
        deadline = time.monotonic() + 30
        while not (self.log.exists() and f" {marker} " in self.log.read_text()):
            assert time.monotonic() < deadline, f"nginx never logged {marker}"
            time.sleep(0.01)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.proc.stderr:
            self.proc.stderr.close()


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """Inclusive (first, last) of a `bytes=a-b` header, clipped to the file."""
    if not header:
        return None
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if not m:
        return None
    if m[1] == "":
        n = int(m[2])
        return max(0, size - n), size - 1
    first = int(m[1])
    last = int(m[2]) if m[2] else size - 1
    return first, min(last, size - 1)


class _Quiet(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    log: list

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def handle_one_request(self) -> None:
        """Count the request as answering from its parse to its handler's end (its `record` included), so that
        `_Served.requests()` can wait for requests whose client already has the answer but whose line is not
        logged yet."""
        self._answering = False
        try:
            super().handle_one_request()
        finally:
            if self._answering:
                self.server.owner._answered()

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if parsed:
            self._answering = True
            self.server.owner._answering()
        return parsed

    def send_file_part(self, path: Path, etag: str, extra: dict[str, str], *, head: bool) -> None:
        size = path.stat().st_size
        rng = _parse_range(self.headers.get("Range"), size)
        match = self.headers.get("If-Match")
        if match and match != etag:
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.record(412, 0)
            return
        first, last = rng if rng else (0, size - 1)
        body_len = max(0, last - first + 1)
        self.send_response(206 if rng else 200)
        if rng:
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Length", str(body_len))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        for k, v in extra.items():
            self.send_header(k, v)
        self.end_headers()
        sent = 0
        if not head:
            with open(path, "rb") as fh:
                fh.seek(first)
                data = fh.read(body_len)
            self.wfile.write(data)
            sent = len(data)
        self.record(206 if rng else 200, sent)

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.lock:
            self.server.connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def record(self, status: int, sent: int) -> None:
        self.server.log.append((self.command, self.path, status, sent, self.headers.get("Range") or "-"))
        self.server.seen.append(dict(self.headers))  # every request's headers, for tests that check what was asked


class _Served:
    """A ThreadingHTTPServer on a free port, run in a thread; `log` counts requests like nginx's.

    A handler records its request after the answer's last byte, so a client can have the answer first: `requests()`
    and `reset()` wait until no request is being answered (a state, not a sleep; bounded, for a handler that a
    fault keeps busy after its client gave up)."""

    def __init__(self, handler: type, certfile: str | None = None) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        if certfile:  # https with this certificate (and key) file
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certfile)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.server.daemon_threads = True
        self.server.log = []
        self.server.seen = []
        self.server.connections = set()  # open client connections: `stop` closes them (a stopped server answers nothing)
        self.server.lock = threading.Lock()
        self.server.owner = self
        self._busy = 0
        self._idle = threading.Condition()
        self.url = f"{'https' if certfile else 'http'}://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _answering(self) -> None:
        with self._idle:
            self._busy += 1

    def _answered(self) -> None:
        with self._idle:
            self._busy -= 1
            self._idle.notify_all()

    def _settle(self, timeout: float = 30.0) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._busy == 0, timeout)

    def requests(self) -> list:
        self._settle()
        return list(self.server.log)

    def reset(self) -> None:
        self._settle()
        self.server.log.clear()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        with self.server.lock:
            open_connections = list(self.server.connections)
        for conn in open_connections:  # keep-alive connections would otherwise still be served
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def blob_id(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


class _HubHandler(_Quiet):
    def do_GET(self) -> None:
        self.route(head=False)

    def do_HEAD(self) -> None:
        self.route(head=True)

    def route(self, *, head: bool) -> None:
        hub: HubServer = self.server.owner
        path = self.path.split("?", 1)[0]
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path)
        if m:
            found = hub.lookup(m[1], m[2])
            if found is None:
                return self.error(404, "Repository or revision not found")
            commit, folder = found
            siblings = []
            for f in sorted(p for p in folder.rglob("*") if p.is_file()):
                digest = hashlib.sha256(f.read_bytes()).hexdigest()
                entry = {"rfilename": f.relative_to(folder).as_posix(), "size": f.stat().st_size, "blobId": blob_id(f)}
                if f.suffix == ".safetensors":
                    entry["lfs"] = {"size": f.stat().st_size, "sha256": digest, "pointerSize": 134}
                siblings.append(entry)
            body = json.dumps({"id": m[1], "modelId": m[1], "sha": commit, "private": False, "siblings": siblings}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.record(200, len(body))
            return
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            found = hub.lookup(m[1], m[2])
            if found is None:
                return self.error(404, "Revision not found")
            commit, folder = found
            from urllib.parse import unquote

            target = folder / unquote(m[3])
            if not target.is_file():
                return self.error(404, "Entry not found")
            return self.send_file_part(target, f'"{blob_id(target)}"', {"X-Repo-Commit": commit}, head=head)
        self.error(404, "Not found")

    def error(self, status: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.record(status, len(body))


class HubServer(_Served):
    """A local Hub endpoint (set HF_ENDPOINT to `url`) serving folders as repo commits."""

    def __init__(self) -> None:
        super().__init__(_HubHandler)
        self.repos: dict[tuple[str, str], Path] = {}
        self.main: dict[str, str] = {}

    def add(self, repo_id: str, folder: Path, commit: str | None = None) -> str:
        commit = commit or hashlib.sha1(f"{repo_id}{len(self.repos)}".encode()).hexdigest()
        self.repos[(repo_id, commit)] = folder
        self.main[repo_id] = commit
        return commit

    def lookup(self, repo_id: str, revision: str) -> tuple[str, Path] | None:
        commit = self.main.get(repo_id) if revision == "main" else revision
        folder = self.repos.get((repo_id, commit or ""))
        return None if folder is None else (commit, folder)


class _FaultHandler(_Quiet):
    def do_HEAD(self) -> None:
        self.serve(head=True)

    def do_GET(self) -> None:
        self.serve(head=False)

    def serve(self, *, head: bool) -> None:
        owner: FaultyServer = self.server.owner
        target = owner.root / self.path.lstrip("/").split("?", 1)[0]
        if not target.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.record(404, 0)
            return
        size = target.stat().st_size
        rng = _parse_range(self.headers.get("Range"), size)
        if owner.fault in LYING and (head or owner.armed(rng or (0, size - 1))):
            try:
                self.lie(owner, target, size, rng, head=head)
            except OSError:  # the client hung up, as it should
                pass
            self.close_connection = True
            return
        etag = f'"v{owner.version}"'
        fault = owner.fault if rng and owner.armed(rng) else None
        if owner.fault == "change" and not head:
            owner.version += 1  # every GET sees a new file version after it
        if fault is None or fault == "change":
            return self.send_file_part(target, etag if owner.fault != "change" or head else f'"v{owner.version - 1}"', {}, head=head)
        first, last = rng
        if fault == "ignore_range":
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.send_header("ETag", etag)
            self.end_headers()
            sent = 0
            try:
                with open(target, "rb") as fh:  # in blocks: the file may be large, the client may hang up
                    while block := fh.read(1 << 20):
                        self.wfile.write(block)
                        sent += len(block)
            except OSError:
                self.close_connection = True
            self.record(200, sent)
            return
        data = target.read_bytes()
        body = data[first:last + 1]
        half = body[: len(body) // 2]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        # 'short' lies: its Content-Length matches the half it sends, as if the range were complete.
        self.send_header("Content-Length", str(len(half) if fault == "short" else len(body)))
        self.send_header("ETag", etag)
        self.end_headers()
        if fault == "short":
            self.wfile.write(half)
            self.record(206, len(half))
            return
        self.wfile.write(half)
        self.wfile.flush()
        self.record(206, len(half))
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


    def lie(self, owner: FaultyServer, target: Path, size: int, rng: tuple[int, int] | None, *, head: bool) -> None:
        first, last = rng if rng else (0, size - 1)
        fault, etag = owner.fault, f'"v{owner.version}"'
        if fault == "size_mismatch":
            if head:
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.send_header("ETag", etag)
                self.end_headers()
                self.record(200, 0)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(3 << 30))
            self.send_header("ETag", etag)
            self.end_headers()
            return self.endless(b"\0" * (1 << 20), limit=3 << 30)
        if head:  # the other lies are in the bodies
            return self.send_file_part(target, etag, {}, head=True)
        if fault == "gzip_bomb":
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.send_header("Content-Encoding", "gzip")
            bomb = gzip_bomb()
            self.send_header("Content-Length", str(len(bomb)))
            self.send_header("ETag", etag)
            self.end_headers()
            self.wfile.write(bomb)
            self.record(206, len(bomb))
            return
        data = target.read_bytes()
        if fault == "shift":
            shifted = data[first + 4: last + 5].ljust(last - first + 1, b"\0")
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first + 4}-{last + 4}/{size}")
            self.send_header("Content-Length", str(len(shifted)))
            self.send_header("ETag", etag)
            self.end_headers()
            self.wfile.write(shifted)
            self.record(206, len(shifted))
            return
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("ETag", etag)
        if fault == "drip":
            self.send_header("Content-Length", str(last - first + 1))
            self.end_headers()
            for byte in data[first:last + 1]:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(owner.drip_seconds)
            return
        self.send_header("Connection", "close")  # endless: no length, the body ends when the connection does
        self.end_headers()
        self.endless(data[first:last + 1] + b"\0" * (1 << 20))

    def endless(self, block: bytes, limit: int | None = None) -> None:
        sent = 0
        while limit is None or sent < limit:
            self.wfile.write(block)
            sent += len(block)


@functools.cache
def gzip_bomb(total: int = 2 << 30, member: int = 64 << 20) -> bytes:
    """gzip members of `member` zero bytes, repeated to `total` bytes once inflated (~2 MB on the wire)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    one = packer.compress(b"\0" * member) + packer.flush()
    return one * (total // member)


LYING = ("endless", "gzip_bomb", "size_mismatch", "shift", "drip")


class FaultyServer(_Served):
    """Serves `root` with one fault on range GETs of at least `min_bytes`, the first `times` times
    (`times=None`: always). Faults: 'drop' (half the body, then the connection closes), 'short' (a 206
    whose Content-Length and body are half the asked range), 'ignore_range' (200 with the whole file),
    'change' (a new ETag after every GET); the lying modes are listed in `LYING` (module docstring)."""

    def __init__(self, root: Path, fault: str, *, times: int | None = 1, min_bytes: int = 1 << 16,
                 drip_seconds: float = 1.0) -> None:
        super().__init__(_FaultHandler)
        self.root, self.fault, self.times, self.min_bytes = root, fault, times, min_bytes
        self.drip_seconds = drip_seconds
        self.version = 1
        self._lock = threading.Lock()

    def armed(self, rng: tuple[int, int]) -> bool:
        if rng[1] - rng[0] + 1 < self.min_bytes:
            return False
        with self._lock:
            if self.times is None:
                return True
            if self.times > 0:
                self.times -= 1
                return True
            return False


class _RedirectHandler(_Quiet):
    def do_GET(self) -> None:
        self.move()

    def do_HEAD(self) -> None:
        self.move()

    def move(self) -> None:
        owner: RedirectServer = self.server.owner
        self.send_response(owner.status)
        self.send_header("Location", owner.target.rstrip("/") + self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()
        self.record(owner.status, 0)


class RedirectServer(_Served):
    """Answers every request with a redirect (`status`) to the same path under `target` (another host or port);
    with `certfile`, it serves https (a self-signed certificate the client is told to trust)."""

    def __init__(self, target: str, *, status: int = 302, certfile: str | None = None) -> None:
        self.target, self.status = target, status
        super().__init__(_RedirectHandler, certfile)


@contextlib.contextmanager
def faulty_servers(root: Path, **defaults):
    """`make(fault, **kw)` starts a `FaultyServer` over `root` (`defaults` give the keywords `kw` leaves out); every
    server made is stopped when the block ends."""
    servers: list[FaultyServer] = []

    def make(fault: str, **kw) -> FaultyServer:
        server = FaultyServer(root, fault, **{**defaults, **kw})
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.stop()


def isolated_cache(tmp_path: Path, monkeypatch) -> None:
    """The workbench's header cache under `tmp_path` and HF_HUB_OFFLINE unset: a test starts with nothing cached."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


# --------------------------------------------------------------------------- moto's S3 (destinations; H3)

MOTO_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


class MotoS3:
    """moto's S3 server on a free local port, in this process (`moto.server.ThreadedMotoServer`), with what tests of
    S3 destinations ask it: a bucket, the objects under a prefix, the multipart uploads not completed or aborted.

    moto keeps its buckets per process, whichever server made them: give each test a bucket of its own (`bucket()`)."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request it serves
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach this server through s3fs/boto3."""
        return {**MOTO_ENV, "AWS_ENDPOINT_URL": self.endpoint}

    @property
    def client(self):
        """A boto3 client of this server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                            region_name="us-east-1")

    def bucket(self, stem: str = "b") -> str:
        """A new, empty bucket's name."""
        import uuid

        name = f"{stem}-{uuid.uuid4().hex[:16]}"  # moto's buckets outlive a server in the same process
        self.client.create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """Key (relative to `prefix`) -> bytes of every object under `prefix`."""
        client = self.client
        start = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        found = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=start):
            for entry in page.get("Contents", []):
                found[entry["Key"][len(start):]] = client.get_object(Bucket=bucket, Key=entry["Key"])["Body"].read()
        return found

    def uploads(self, bucket: str) -> list[str]:
        """Keys of the multipart uploads in `bucket` neither completed nor aborted."""
        return [u["Key"] for u in self.client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]

    def upload_folder(self, folder: Path, bucket: str, prefix: str) -> str:
        """Upload a local folder's files; returns its s3:// URL."""
        client = self.client
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")
        return f"s3://{bucket}/{prefix}/"

    def stop(self) -> None:
        """Stop the server."""
        self.server.stop()

    def output(self, bucket: str, prefix: str) -> dict[str, bytes]:
        """The conversion output under `prefix`: every object but the workbench's own records (`.workbench-*`)."""
        return {k: v for k, v in self.objects(bucket, prefix).items() if not k.startswith(".workbench-")}


def folder_files(folder: Path) -> dict[str, bytes]:
    """A local conversion's output files (relative POSIX names -> bytes), without its `.workbench-*` records."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".workbench-")}
