"""Local servers for remote-checkpoint tests: nginx (HTTP ranges), a Hub endpoint, moto's S3, and faults.

- `Nginx`: Debian's nginx in the foreground on 127.0.0.1 serving a folder; its access log records
  method, URI, status, `$body_bytes_sent` and `$http_range` per request, so tests count requests/bytes.
- `HubServer`: the Hub's HTTP interface as huggingface_hub 2.x uses it to read a repo's files:
  `GET /api/models/{org}/{repo}/revision/{rev}?blobs=true` (HfApi.model_info with files_metadata:
  id, sha, siblings with rfilename/size/blobId/lfs) and `GET|HEAD /{org}/{repo}/resolve/{rev}/{path}`
  (ranges -> 206 with Content-Range, ETag and X-Repo-Commit headers). It serves files from
  `repos[(repo_id, commit)] = folder`, revision "main" naming the latest commit added. It also accepts what
  huggingface_hub sends to write (repo creation, preupload, LFS uploads, NDJSON commits, pull requests; see the
  class), so `hf://` destinations are tested against it; `hub_writes(monkeypatch, hub)` points a test at it.
- `FaultyServer`: HTTP ranges with a chosen fault: drop the connection mid-body (`drop`), answer 200
  with the whole file (`ignore_range`), send a complete-looking but short 206 whose Content-Length
  lies about the range (`short`), or change the file's ETag after every GET (`change`); and the lying
  modes (`LYING`), on every GET when `min_bytes=0`: a body that never ends (`endless`), a gzip bomb
  (`gzip_bomb`: `Content-Encoding: gzip`, 2 GiB of zeros in 2 MB), HEAD and GET disagreeing about the size
  (`size_mismatch`: HEAD says 1,000 bytes, the GET announces and sends 3 GiB), a range shifted by 4 bytes at
  the asked length (`shift`), and a drip of one byte per `drip_seconds` (`drip`).
- `MotoS3`: moto's S3 server in this process; the fixtures `s3` (`s3_server`, one per module) and `_env`
  (`s3_destination_env`, autouse) are shared by the S3-destination modules, which import them.
- `torchrun_nodes`: N torchrun agents on this host meeting through a c10d rendezvous on 127.0.0.1 ("nodes").
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

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
    # Headers and body go out as two writes on a kept-alive connection: with Nagle's algorithm on, the body waits
    # for the client's delayed ACK of the headers (~40 ms a request on loopback), which made the Hub tests sleep.
    disable_nagle_algorithm = True
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
            rate = getattr(self.server.owner, "rate", 0)  # HubServer(rate=...): bytes per second per connection
            if rate:
                started, view = time.monotonic(), memoryview(data)
                for at in range(0, len(data), 1 << 18):
                    self.wfile.write(view[at:at + (1 << 18)])
                    time.sleep(max(0.0, started + (at + min(1 << 18, len(data) - at)) / rate - time.monotonic()))
            else:
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
    return _digests(path)[0]


def _digests(path: Path) -> tuple[str, str]:
    """(sha1, sha256) of a served file, computed once per version of it (size and mtime): every listing and every
    range GET needs them, and hashing a large file each time would make the fixture, not the client, the cost."""
    st = path.stat()
    return _digests_of(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _digests_of(path: str, size: int, mtime_ns: int) -> tuple[str, str]:
    sha1, sha256 = hashlib.sha1(), hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            sha1.update(block)
            sha256.update(block)
    return sha1.hexdigest(), sha256.hexdigest()


class _HubHandler(_Quiet):
    def do_GET(self) -> None:
        self.route(head=False)

    def do_HEAD(self) -> None:
        self.route(head=True)

    def route(self, *, head: bool) -> None:
        hub: HubServer = self.server.owner
        path = self.path.split("?", 1)[0]
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/auth-check(/write)?", path)
        if m:  # HfApi.auth_check: may this token read (write) the repo
            if m[1] not in hub.main:
                return self.error(404, "Repository not found", "RepoNotFound")
            refused = hub.refuse(self.headers.get("Authorization")) if m[2] else None
            return self.error(*refused) if refused else self.answer({})
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            found = hub.lookup(m[1], m[2] or "main")
            if found is None:
                if m[1] in hub.main:
                    return self.error(404, "Revision not found", "RevisionNotFound")
                return self.error(404, "Repository not found", "RepoNotFound")
            commit, folder = found
            siblings = []
            for f in sorted(p for p in folder.rglob("*") if p.is_file()):
                digest = _digests(f)[1]
                entry = {"rfilename": f.relative_to(folder).as_posix(), "size": f.stat().st_size, "blobId": blob_id(f)}
                if f.suffix == ".safetensors":
                    entry["lfs"] = {"size": f.stat().st_size, "sha256": digest, "pointerSize": 134}
                siblings.append(entry)
            return self.answer({"id": m[1], "modelId": m[1], "sha": commit, "private": m[1] in hub.private,
                                "siblings": siblings})
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

    def error(self, status: int, message: str, code: str = "") -> None:
        self.answer({"error": message}, status, {"X-Error-Message": message, **({"X-Error-Code": code} if code else {})})

    def answer(self, value, status: int = 200, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.record(status, len(body))

    # The write side, as huggingface_hub 2.x's create_repo / preupload_lfs_files / create_commit use it.
    def do_POST(self) -> None:
        self.write(put=False)

    def do_PUT(self) -> None:
        self.write(put=True)

    def body_to(self, out) -> int:
        """Copy the request body (Content-Length or chunked) into the binary file `out`; its length."""
        total = 0
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                out.write(self.rfile.read(size))
                self.rfile.readline()
                total += size
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return total
        left = int(self.headers.get("Content-Length") or 0)
        while left > 0:
            block = self.rfile.read(min(left, 1 << 20))
            if not block:
                break
            out.write(block)
            left -= len(block)
            total += len(block)
        return total

    def body(self) -> bytes:
        import io

        buf = io.BytesIO()
        self.body_to(buf)
        return buf.getvalue()

    def write(self, *, put: bool) -> None:
        from urllib.parse import parse_qs, unquote, urlsplit

        hub: HubServer = self.server.owner
        split = urlsplit(self.path)
        path, query = split.path, parse_qs(split.query)
        if path.startswith("/__lfs__/"):  # upload URLs the batch answer handed out (S3's part in the real Hub)
            return self.lfs_transfer(hub, path[len("/__lfs__/"):], put=put)
        # A pull request needs only read access (the Hub lets anyone who can read propose one); so does the LFS
        # batch call, which huggingface_hub makes without a ref for a pull request.
        proposal = query.get("create_pr") == ["1"] or path.endswith("/info/lfs/objects/batch")
        refused = hub.refuse(self.headers.get("Authorization"), read_is_enough=proposal)
        if refused:
            self.body()
            return self.error(*refused)
        if path == "/api/repos/create":
            request = json.loads(self.body() or b"{}")
            repo_id = f"{request.get('organization') or 'user'}/{request['name']}"
            if repo_id in hub.main:
                message = "You already created this model repo"
                return self.answer({"error": message, "url": f"{hub.url}/{repo_id}"}, 409, {"X-Error-Message": message})
            hub.create(repo_id, private=request.get("visibility") == "private" or bool(request.get("private")))
            return self.answer({"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/xet-write-token/([^/]+)", path)
        if m:
            self.body()
            return self.error(501, "This local Hub speaks LFS only: set HF_HUB_DISABLE_XET=1")
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit|branch)/([^/]+)", path) or re.fullmatch(
            r"/([^/]+/[^/]+)\.git/info/lfs/objects/(batch)()", path)
        if not m:
            self.body()
            return self.error(404, "Not found")
        repo_id, action, revision = m[1], m[2], unquote(m[3])
        if repo_id not in hub.main:
            self.body()
            return self.error(404, "Repository not found", "RepoNotFound")
        if action == "preupload":
            request = json.loads(self.body())
            files = [{"path": f["path"], "uploadMode": hub.upload_mode(f["path"], f["size"], base64.b64decode(f["sample"])),
                      "shouldIgnore": False, "oid": None} for f in request["files"]]
            return self.answer({"files": files, "commitOid": hub.main[repo_id]})
        if action == "batch":
            request = json.loads(self.body())
            return self.answer(hub.batch(request["objects"]), headers={"Content-Type": "application/vnd.git-lfs+json"})
        if action == "branch":
            self.body()
            if (repo_id, revision) in hub.branches:
                return self.error(409, "Reference already exists")
            hub.branches[(repo_id, revision)] = hub.main[repo_id]
            return self.answer({})
        lines = [json.loads(line) for line in self.body().splitlines() if line.strip()]
        try:
            return self.answer(hub.commit(repo_id, revision, lines, create_pr=query.get("create_pr") == ["1"]))
        except LookupError as exc:
            return self.error(404, str(exc), "RevisionNotFound")
        except ValueError as exc:
            return self.error(400, str(exc))

    def lfs_transfer(self, hub: HubServer, rest: str, *, put: bool) -> None:
        parts = rest.split("/")
        if parts == ["verify"]:
            request = json.loads(self.body())
            found = hub.objects / request["oid"]
            if not found.is_file() or found.stat().st_size != request["size"]:
                return self.error(404, f"Object {request['oid']} not found")
            return self.answer({})
        oid = parts[0]
        size = hub.pending.get(oid)
        if size is None:
            self.body()
            return self.error(404, f"No upload pending for {oid}")
        if put and len(parts) == 3 and parts[1] == "part":  # one part of a multipart upload
            target = hub.store / "parts" / oid / f"{int(parts[2]):05d}"
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:
                self.body_to(out)
            etag = hashlib.md5(target.read_bytes()).hexdigest()
            self.send_response(200)
            self.send_header("ETag", f'"{etag}"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.record(200, 0)
            return
        staged = hub.store / "parts" / f"{oid}.upload"
        staged.parent.mkdir(parents=True, exist_ok=True)
        if put:  # basic transfer: the whole object in one PUT
            with open(staged, "wb") as out:
                self.body_to(out)
        else:  # multipart completion: the parts, in order, with their ETags
            request = json.loads(self.body())
            folder = hub.store / "parts" / oid
            with open(staged, "wb") as out:
                for part in request["parts"]:
                    data = (folder / f"{part['partNumber']:05d}").read_bytes()
                    if f'"{hashlib.md5(data).hexdigest()}"' != part["etag"]:
                        return self.error(400, f"Part {part['partNumber']} of {oid}: ETag mismatch")
                    out.write(data)
            shutil.rmtree(folder, ignore_errors=True)
        problem = hub.accept(oid, size, staged)
        if problem:
            return self.error(400, problem)
        return self.answer({})


class HubServer(_Served):
    """A local Hub endpoint (set HF_ENDPOINT to `url`) serving folders as repo commits, and accepting writes.

    Reads: `repos[(repo_id, commit)] = folder`, `main[repo_id]` the latest commit of branch main. Writes, as
    huggingface_hub 2.x sends them (LFS only: clients must set HF_HUB_DISABLE_XET=1, the xet token endpoint
    says so): `POST /api/repos/create`; `POST /api/models/{repo}/preupload/{rev}` (uploadMode "lfs" for
    `LFS_SUFFIXES`, binary samples and files over 10 MiB, else "regular"); `POST /{repo}.git/info/lfs/objects/batch`
    (no actions for an object already stored; "basic" PUT, or "multipart" with `chunk_size`-byte parts when the
    object is larger than `chunk_size`, then a verify action); `POST /api/models/{repo}/commit/{rev}` (NDJSON:
    header, file, lfsFile, deletedFile, deletedFolder; `?create_pr=1` makes `refs/pr/N`); `POST
    /api/models/{repo}/branch/{name}`. Uploaded objects live under `store/objects/` (sha256 checked) and are
    invisible until a commit names them; each commit is a new folder under `store/commits/`, and `commits`
    lists them in order. With `tokens` (token -> "write" | "read"), writes without a known token answer 401 and
    writes with a read token 403 (`GET /api/models/{repo}/auth-check/write` answers the same). `rate` paces file
    bodies (bytes per second per connection), as nginx's limit_rate does."""

    LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".distcp", ".npy", ".h5", ".msgpack")

    def __init__(self, store: Path | None = None, *, chunk_size: int = 8 << 20,
                 tokens: dict[str, str] | None = None, rate: int = 0) -> None:
        import tempfile

        super().__init__(_HubHandler)
        self.repos: dict[tuple[str, str], Path] = {}
        self.main: dict[str, str] = {}
        self.branches: dict[tuple[str, str], str] = {}  # (repo_id, branch or "refs/pr/N") -> commit, beside main
        self.private: set[str] = set()
        self.commits: list[dict] = []  # every commit made through the API: repo, oid, ref, summary, description, files
        self.pending: dict[str, int] = {}  # oid -> size of uploads the batch endpoint handed out
        self.chunk_size, self.tokens = chunk_size, tokens
        self.rate = rate  # file bodies sent at most this many bytes per second per connection (0: unlimited)
        self.store = Path(store) if store else Path(tempfile.mkdtemp(prefix="hub-store-"))
        self.objects = self.store / "objects"
        self.objects.mkdir(parents=True, exist_ok=True)
        self._write_lock = threading.Lock()

    def add(self, repo_id: str, folder: Path, commit: str | None = None) -> str:
        commit = commit or hashlib.sha1(f"{repo_id}{len(self.repos)}".encode()).hexdigest()
        self.repos[(repo_id, commit)] = folder
        self.main[repo_id] = commit
        return commit

    def lookup(self, repo_id: str, revision: str) -> tuple[str, Path] | None:
        from urllib.parse import unquote

        revision = unquote(revision)
        if revision == "main":
            commit = self.main.get(repo_id)
        else:
            commit = self.branches.get((repo_id, revision), revision)
        folder = self.repos.get((repo_id, commit or ""))
        return None if folder is None else (commit, folder)

    def refuse(self, authorization: str | None, *, read_is_enough: bool = False) -> tuple[int, str] | None:
        """(status, message) when `tokens` are set and the Authorization header does not grant writes (or reads, for
        what `read_is_enough` for: opening a pull request)."""
        if self.tokens is None:
            return None
        token = (authorization or "").removeprefix("Bearer ").strip()
        role = self.tokens.get(token)
        if role is None:
            return 401, "Invalid credentials in Authorization header"
        if role != "write" and not read_is_enough:
            return 403, "You don't have the rights to write to this repository (read-only token)"
        return None

    def create(self, repo_id: str, *, private: bool = False) -> str:
        """A new repo whose first commit holds `.gitattributes`, as the Hub makes it."""
        folder = self.store / "commits" / hashlib.sha1(f"init {repo_id}".encode()).hexdigest()
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ".gitattributes").write_text("".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in self.LFS_SUFFIXES))
        if private:
            self.private.add(repo_id)
        return self.add(repo_id, folder, folder.name)

    def upload_mode(self, path: str, size: int, sample: bytes) -> str:
        lfs = path.endswith(self.LFS_SUFFIXES) or size > 10 << 20 or b"\0" in sample
        return "lfs" if lfs and size > 0 else "regular"

    def batch(self, objects: list[dict]) -> dict:
        answers, transfer = [], "basic"
        for obj in objects:
            oid, size = obj["oid"], int(obj["size"])
            stored = self.objects / oid
            answer = {"oid": oid, "size": size, "authenticated": True}
            if not (stored.is_file() and stored.stat().st_size == size):
                self.pending[oid] = size
                href = f"{self.url}/__lfs__/{oid}"
                upload = {"href": href}
                if size > self.chunk_size:
                    transfer = "multipart"
                    count = -(-size // self.chunk_size)
                    upload["header"] = {"chunk_size": str(self.chunk_size),
                                        **{f"{n:05d}": f"{href}/part/{n}" for n in range(1, count + 1)}}
                answer["actions"] = {"upload": upload, "verify": {"href": f"{self.url}/__lfs__/verify"}}
            answers.append(answer)
        return {"transfer": transfer, "objects": answers}

    def accept(self, oid: str, size: int, staged: Path) -> str:
        """Move an uploaded object in place when its size and sha256 are right; else why not."""
        digest = hashlib.sha256()
        with open(staged, "rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
        if staged.stat().st_size != size or digest.hexdigest() != oid:
            staged.unlink()
            return f"Object {oid}: uploaded {staged.stat().st_size if staged.exists() else 'bytes'} do not match its size/sha256"
        os.replace(staged, self.objects / oid)
        return ""

    def commit(self, repo_id: str, revision: str, lines: list[dict], *, create_pr: bool) -> dict:
        """Apply one NDJSON commit on top of `revision`; the new commit's answer (with its PR URL when `create_pr`)."""
        with self._write_lock:
            found = self.lookup(repo_id, revision)
            if found is None:
                raise LookupError(f"Revision {revision} not found")
            parent, parent_folder = found
            header = next((line["value"] for line in lines if line["key"] == "header"), {})
            if header.get("parentCommit") and header["parentCommit"] != parent:
                raise ValueError(f"parentCommit {header['parentCommit']} is not the head of {revision} ({parent})")
            oid = hashlib.sha1(json.dumps([repo_id, parent, lines, len(self.commits)]).encode()).hexdigest()
            folder = self.store / "commits" / oid
            for f in parent_folder.rglob("*"):
                if f.is_file():
                    target = folder / f.relative_to(parent_folder)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(f, target)
            files = []
            for line in lines:
                key, value = line["key"], line["value"]
                if key == "header":
                    continue
                target = folder / value["path"]
                if key in ("file", "lfsFile"):
                    target.parent.mkdir(parents=True, exist_ok=True)
                    files.append(value["path"])
                if key == "file":
                    target.write_bytes(base64.b64decode(value["content"]))
                elif key == "lfsFile":
                    stored = self.objects / value["oid"]
                    if not stored.is_file():
                        shutil.rmtree(folder, ignore_errors=True)
                        raise ValueError(f"Your push was rejected: LFS object {value['oid']} ({value['path']}) was never uploaded")
                    shutil.copyfile(stored, target)
                elif key == "deletedFile":
                    target.unlink(missing_ok=True)
                elif key == "deletedFolder":
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    shutil.rmtree(folder, ignore_errors=True)
                    raise ValueError(f"Unknown commit operation {key!r}")
            self.repos[(repo_id, oid)] = folder
            if create_pr:
                number = 1 + sum(1 for (repo, ref) in self.branches if repo == repo_id and ref.startswith("refs/pr/"))
                ref = f"refs/pr/{number}"
                self.branches[(repo_id, ref)] = oid
            elif revision == "main":
                ref = "main"
                self.main[repo_id] = oid
            else:
                ref = revision
                self.branches[(repo_id, revision)] = oid
            self.commits.append({"repo": repo_id, "oid": oid, "ref": ref, "summary": header.get("summary", ""),
                                 "description": header.get("description", ""), "files": files})
            answer = {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid, "success": True}
            if create_pr:
                answer["pullRequestUrl"] = f"{self.url}/{repo_id}/discussions/{ref.rsplit('/', 1)[1]}"
            return answer


def hub_writes(monkeypatch, hub: HubServer, token: str | None = "hf_test_write") -> None:
    """Point huggingface_hub at `hub` for writes in this process and its children: HF_ENDPOINT, HF_TOKEN (unset
    when `token` is None) and HF_HUB_DISABLE_XET (the fixture speaks LFS; huggingface_hub reads the flag at import,
    so the constant is patched too)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    no_file = str(hub.store / "no-token-file")  # a token stored by `hf auth login` on this machine is not used
    monkeypatch.setenv("HF_TOKEN_PATH", no_file)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", no_file)
    if token is None:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    else:
        monkeypatch.setenv("HF_TOKEN", token)


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
        from werkzeug.serving import WSGIRequestHandler

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request it serves
        WSGIRequestHandler.disable_nagle_algorithm = True  # as `_Quiet`'s: no delayed-ACK wait per request
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


@pytest.fixture(scope="module", name="s3")
def s3_server() -> Iterator[MotoS3]:
    """Fixture `s3`: one moto S3 server for a module's tests (each takes a bucket of its own); skipped without moto.
    A test module uses it by importing it: `from remote_servers import s3_server`."""
    pytest.importorskip("moto.server")
    server = MotoS3()
    yield server
    server.stop()


@pytest.fixture(name="_env", autouse=True)
def s3_destination_env(s3: MotoS3, tmp_path: Path, monkeypatch) -> None:
    """Autouse fixture `_env` of the S3-destination modules (imported beside `s3_server`): a header cache of the test's
    own (`isolated_cache`), the credentials and endpoint of `s3`, and the spool under the test's tmp_path."""
    isolated_cache(tmp_path, monkeypatch)
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WORKBENCH_SPOOL_DIR", str(tmp_path / "spool"))


def torchrun_nodes(args: list[str], envs: list[dict[str, str]], timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """`python -m torch.distributed.run --nnodes=N --nproc-per-node=1 ... ARGS`, one agent per env of `envs` (N of
    them), meeting through a c10d rendezvous on 127.0.0.1: N "nodes" on this host. Each agent leads a session of its own
    (torchrun passes SIGINT/SIGTERM on and stops worker groups; none of that may reach the test run's group); on a
    timeout every agent's whole group, workers too, is killed."""
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(envs)}", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=wb-{port}", *args]
    agents = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True) for env in envs]
    done = []
    for agent in agents:
        try:
            out, err = agent.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in agents:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            raise
        done.append(subprocess.CompletedProcess(command, agent.returncode, out, err))
    return done


def folder_files(folder: Path) -> dict[str, bytes]:
    """A local conversion's output files (relative POSIX names -> bytes), without its `.workbench-*` records."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".workbench-")}
