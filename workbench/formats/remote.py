"""Remote checkpoints as folders of byte ranges: the Hub (`hf://`), HTTP(S) and S3.

Readers of remote checkpoints never see a local path: they list a `RemoteStore`'s files (name, size,
version tag) and ask it for byte ranges. Transport is the libraries users already configure:
`huggingface_hub` resolves a repo and revision (tokens, `HF_ENDPOINT`, `HF_HUB_OFFLINE`) and its files
are read as HTTP ranges through `fsspec`; `https://` goes through fsspec's HTTP file system and `s3://`
through `s3fs` (AWS profiles, `AWS_ENDPOINT_URL`). Nothing here speaks HTTP by hand.

Every range read is checked: the body must have exactly the asked length (a server that ignores
`Range` and answers 200 with the whole file, or closes the connection early, is caught), and it must
come from the version listed when the checkpoint was opened (`If-Match` on the listed ETag for HTTP and
S3; Hub reads are pinned to the resolved commit). Dropped connections are retried; a file that changed
is an error, never mixed bytes.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlsplit

from ..errors import CheckpointError
from .remote_limits import (
    LISTING_CAP,
    MAX_LISTING_ENTRIES,
    MAX_LISTING_PAGES,
    Limits,
    Pace,
    Refused,
    ShortBody,
    Stalled,
    check_content_range,
    check_encoding,
    read_body,
)

SCHEMES = ("hf://", "http://", "https://", "s3://")
RETRIES = 4
_BACKOFF = (0.1, 0.3, 1.0, 2.0)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class RemoteError(CheckpointError):
    """A remote checkpoint cannot be listed or read (network, permissions, a server that misbehaves)."""


class RemoteUnreachable(RemoteError):
    """The server could not be reached, or did not answer in time (no HTTP status at all)."""


class RemoteFileChanged(RemoteError):
    """A remote file is not the version listed when the checkpoint was opened (its ETag changed)."""


def is_remote(source: object) -> bool:
    """True for a URL this module opens, or a bare `org/repo` Hub id that names no local path.

    A bare `a/b` is taken for a Hub id only when nothing local claims it: neither `a/b` nor the folder `a` exists
    here. When `a` is a local folder, `a/b` is a path the user meant (a typo such as `ck/qwen3` beside `ck/qwen2`)
    and gets the local "no such file or folder" error, never a network request naming a local path; `hf://a/b`
    always means the Hub."""
    if not isinstance(source, str):
        return False
    if source.startswith(SCHEMES):
        return True
    repo = source.split("@", 1)[0]
    return bool(_REPO_ID.match(repo)) and not os.path.exists(source) and not os.path.isdir(repo.split("/", 1)[0])


@dataclass(frozen=True)
class RemoteFile:
    """One listed file: its name relative to the store's root, size, and version tag (ETag, blob id)."""

    rel: str
    size: int
    tag: str = ""


@dataclass
class RemoteStats:
    """Requests and body bytes one store made and received (listing, HEADs and range GETs)."""

    requests: int = 0
    bytes: int = 0
    retries: int = 0
    per_file: dict[str, list[int]] = field(default_factory=dict)  # rel -> [requests, bytes]
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, rel: str, n_bytes: int, requests: int = 1) -> None:
        with self._lock:
            self.requests += requests
            self.bytes += n_bytes
            row = self.per_file.setdefault(rel, [0, 0])
            row[0] += requests
            row[1] += n_bytes

    def snapshot(self) -> dict:
        """A plain copy for reports and tests."""
        with self._lock:
            return {"requests": self.requests, "bytes": self.bytes, "retries": self.retries,
                    "per_file": {k: tuple(v) for k, v in self.per_file.items()}}


class RemoteStore:
    """A remote folder: `files` (listed lazily by the backend) and checked, retried range reads.

    `identity` names the exact content (URL plus commit for the Hub); the header cache keys on it and on
    each file's tag, so a new revision or a re-uploaded file is never served from the cache.
    """

    url: str
    identity: str
    offline: bool = False

    def __init__(self, url: str) -> None:
        self.url = url
        self.identity = url
        self.limits = Limits.from_env()
        self.redirects: dict[str, str] = {}  # host asked -> host that answered, when a redirect changed it
        self.stats = RemoteStats()
        self._files: dict[str, RemoteFile] | None = None

    # --- backend hooks --------------------------------------------------------------------------
    def _list(self) -> dict[str, RemoteFile] | None:
        """Every file under the root with size and tag, or None when the backend cannot list (HTTP)."""
        raise NotImplementedError

    def _probe(self, rel: str) -> RemoteFile | None:
        """Size and tag of one file (a HEAD), None when it does not exist."""
        raise NotImplementedError

    def _get(self, rel: str, start: int, end: int, file: RemoteFile, deadline: float,
             into: memoryview | None = None) -> bytes | bytearray | memoryview:
        """One try at bytes [start, end) of `file`, conditional on its tag where supported: exactly that many
        bytes, read within `limits` (Stalled, ShortBody: retried; Refused: a broken contract, not retried)."""
        raise NotImplementedError

    # --- shared behaviour -----------------------------------------------------------------------
    def listing(self) -> dict[str, RemoteFile] | None:
        """The store's files (one listing request the first time), or None when it cannot list."""
        if self._files is None:
            self._files = self._list()
        return self._files

    def set_listing(self, files: dict[str, RemoteFile]) -> None:
        """Use a listing from the cache (offline or pinned revisions) instead of asking the server."""
        self._files = dict(files)

    def file(self, rel: str) -> RemoteFile | None:
        """The listed (or probed) facts of one file, None when it does not exist."""
        files = self.listing()
        if files is not None:
            return files.get(rel)
        if self._probed is None:
            self._probed = {}
        if rel not in self._probed:
            if self.offline and self.probe_cache is not None:
                return self.probe_cache.get(rel)
            try:
                self._probed[rel] = self._call(rel, "look up", lambda: self._probe(rel))
            except RemoteUnreachable as exc:
                if self.probe_cache is None:
                    raise
                self.offline, self.offline_reason = True, exc.message  # reopen from what the last open found
                return self.probe_cache.get(rel)
        return self._probed[rel]

    _probed: dict[str, RemoteFile | None] | None = None
    # For a store that cannot list (HTTP): the files the last successful open found, from the header cache;
    # used instead of asking when the server cannot be reached.
    probe_cache: dict[str, RemoteFile] | None = None
    offline_reason: str = ""

    def probed(self) -> dict[str, RemoteFile]:
        """The files looked up so far that exist (what a reopen without the server needs)."""
        return {rel: f for rel, f in (self._probed or {}).items() if f is not None}

    def served_note(self) -> str:
        """' (served by HOST after a redirect)' when a redirect led to another host or port, else ''."""
        hosts = sorted(set(self.redirects.values()))
        return f" (served by {', '.join(hosts)} after a redirect)" if hosts else ""

    def where(self, rel: str) -> str:
        """The URL of one file, for messages."""
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    def read(self, rel: str, start: int, end: int, into: memoryview | None = None) -> bytes | bytearray | memoryview:
        """Bytes [start, end) of `rel`, exactly; retried after dropped connections and stalls (within the
        store's `limits`), refused when the server ignores or shifts the range, sends more than asked, or the
        file changed since it was listed. With `into` (a writable buffer of end - start bytes), the body is read
        straight into it and `into` is returned."""
        if end <= start:
            return b"" if into is None else into
        info = self.file(rel)
        if info is None:
            raise RemoteError(f"Cannot read {self.where(rel)}: the file is not there. Check the URL and revision.", file=self.where(rel))
        if end > info.size:
            raise RemoteError(
                f"Cannot read bytes {start}-{end} of {self.where(rel)}: the file has {info.size} bytes. "
                "The checkpoint changed or its headers lie; re-open it.",
                file=self.where(rel),
            )
        last: str = ""
        began = time.monotonic()
        deadline = began + self.limits.deadline_seconds
        attempt = 0
        while attempt < RETRIES and (attempt == 0 or time.monotonic() < deadline):
            if self.offline:
                why = "the server could not be reached when it was opened" if self.offline_reason else "offline mode (HF_HUB_OFFLINE)"
                raise RemoteError(f"Cannot read {self.where(rel)}: {why}, and tensor data is never cached. "
                                  "Go online to read tensor values; headers, tables and plans work offline.", file=self.where(rel))
            try:
                data = self._get(rel, start, end, info, deadline, into)
            except RemoteFileChanged:
                raise
            except Refused as exc:
                raise RemoteError(f"Cannot read bytes {start}-{end} of {self.where(rel)}: {exc}. The server (or a proxy) "
                                  "misbehaves; serve the files from a plain HTTP server with range support.",
                                  file=self.where(rel)) from None
            except FileNotFoundError:
                raise RemoteError(f"Cannot read {self.where(rel)}: the file is gone (HTTP 404). It was removed after the "
                                  "checkpoint was opened; re-open it.", file=self.where(rel)) from None
            except (Stalled, ShortBody) as exc:
                last = str(exc)
            except Exception as exc:  # noqa: BLE001 - the transport's errors vary by library; all are retried
                changed = _precondition_failed(exc)
                if changed:
                    raise RemoteFileChanged(
                        f"Cannot read {self.where(rel)}: the file changed on the server since the checkpoint was opened "
                        f"(its version {info.tag!r} no longer matches). Nothing mixing old and new bytes was written; "
                        "re-open the checkpoint and run again.",
                        file=self.where(rel),
                    ) from None
                if _permanent(exc):
                    raise RemoteError(f"Cannot read {self.where(rel)}: {_describe(exc)}. Check the URL and your credentials.",
                                      file=self.where(rel)) from None
                last = _describe(exc)
            else:
                self.stats.add(rel, len(data))
                return data
            attempt += 1
            self.stats.retries += 1
            pause = _BACKOFF[min(attempt - 1, len(_BACKOFF) - 1)]
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        raise RemoteError(
            f"Cannot read bytes {start}-{end} of {self.where(rel)}: {last} after {attempt} attempts in "
            f"{time.monotonic() - began:.0f} s. Check the connection (or the server) and run again; a conversion resumes "
            "from its finished shards.",
            file=self.where(rel),
        )

    def _call(self, rel: str, what: str, fn: Callable):
        try:
            return fn()
        except FileNotFoundError:
            return None
        except RemoteError:
            raise
        except Exception as exc:  # noqa: BLE001
            kind = RemoteError if _status(exc) is not None else RemoteUnreachable
            raise kind(f"Cannot {what} {self.where(rel)}: {_describe(exc)}. Check the URL, the connection and "
                       "your credentials.", file=self.where(rel)) from None


def _status(exc: BaseException) -> int | None:
    for attr in ("status", "status_code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int):
            return value
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    value = getattr(response, "status_code", None)
    return value if isinstance(value, int) else None


def _precondition_failed(exc: BaseException) -> bool:
    text = str(exc)  # s3fs turns botocore's PreconditionFailed into an OSError carrying S3's message
    return _status(exc) == 412 or "PreconditionFailed" in text or "pre-conditions you specified did not hold" in text


def _permanent(exc: BaseException) -> bool:
    status = _status(exc)
    return status is not None and 400 <= status < 500 and status not in (408, 429)


def _describe(exc: BaseException) -> str:
    status = _status(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"HTTP {status} ({text})" if status else f"{type(exc).__name__}: {text}"


# --- backends -----------------------------------------------------------------------------------


class HttpStore(RemoteStore):
    """`http(s)://host/folder/` (or a file URL) through the aiohttp session of fsspec's HTTP file system.

    Requests go through the session directly so that bodies are streamed within their budget
    (`remote_limits`), `Content-Range` and `Content-Encoding` are checked, and redirects are followed one hop
    at a time: a redirect from https to http is refused, one to another host is recorded in `redirects`
    (and named in the catalog's location) and does not carry the credentials along."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(url)
        import fsspec

        self._headers = dict(headers or {})
        self.fs = fsspec.filesystem("http", skip_instance_cache=True, headers=self._headers)
        self._base = url.rstrip("/")

    def _url(self, rel: str) -> str:
        return f"{self._base}/{quote(rel)}" if rel else self._base

    def _list(self) -> dict[str, RemoteFile] | None:
        return None

    def _run(self, coro):
        from fsspec.asyn import sync

        async def run():
            return await coro

        return sync(self.fs.loop, run)

    async def _respond(self, method: str, url: str, headers: dict[str, str], pace: Pace):
        """The response to `method url` after following redirects (at most `MAX_REDIRECTS`), body unread."""
        from yarl import URL

        session = await self.fs.set_session()
        target = URL(url, encoded=False)
        headers = {**headers, "Accept-Encoding": "identity"}
        for _ in range(MAX_REDIRECTS + 1):
            # No body is read before its Content-Encoding is checked (`check_encoding`), so the session's automatic
            # decompression never runs: a compressed body is refused unread.
            response = await pace.wait(session.request(method, target, headers=headers, allow_redirects=False))
            location = response.headers.get("Location")
            if response.status not in (301, 302, 303, 307, 308) or not location:
                return response
            response.close()
            nxt = target.join(URL(location))
            if target.scheme == "https" and nxt.scheme != "https":
                raise Refused(f"{target} redirects to {nxt}, from https to {nxt.scheme}; refusing to read over an "
                              "unencrypted connection")
            if nxt.scheme not in ("http", "https"):
                raise Refused(f"{target} redirects to {nxt}, which is not an http(s) URL")
            if (nxt.host, nxt.port) != (target.host, target.port):
                headers = {k: v for k, v in headers.items() if k.lower() not in ("authorization", "cookie")}
                start = URL(url, encoded=False)
                if (nxt.host, nxt.port) != (start.host, start.port):
                    self.redirects[f"{start.host}:{start.port}"] = f"{nxt.host}:{nxt.port}"
            target = nxt
        raise Refused(f"{url} redirects more than {MAX_REDIRECTS} times")

    def _probe(self, rel: str) -> RemoteFile | None:
        url = self._url(rel)

        async def head() -> RemoteFile | None:
            pace = Pace(self.limits, _host(url), 0, time.monotonic() + self.limits.deadline_seconds)
            response = await self._respond("HEAD", url, dict(self._headers), pace)
            try:
                if response.status == 404:
                    return None
                response.raise_for_status()
                check_encoding(response.headers.get("Content-Encoding"), url)
                size = response.headers.get("Content-Length")
                return RemoteFile(rel, int(size), response.headers.get("ETag", "") or "") if size and size.isdigit() else \
                    RemoteFile(rel, -1, "")
            finally:
                response.release()  # a HEAD has no body: the connection can serve the next request

        try:
            found = self._run(head())
        except Refused as exc:
            raise RemoteError(f"Cannot look up {self.where(rel)}: {exc}. Serve the files from a plain HTTP server.",
                              file=self.where(rel)) from None
        except Stalled as exc:
            raise RemoteUnreachable(f"Cannot look up {self.where(rel)}: {exc}. Check the connection and the server.",
                                    file=self.where(rel)) from None
        self.stats.add(rel, 0)
        if found is not None and found.size < 0:
            raise RemoteError(f"Cannot read {self.where(rel)}: the server does not say how big it is (no Content-Length). "
                              "Serve it from a server that does.", file=self.where(rel))
        return found

    def _get(self, rel: str, start: int, end: int, file: RemoteFile, deadline: float,
             into: memoryview | None = None) -> bytes | bytearray | memoryview:
        headers = dict(self._headers)
        if file.tag and not file.tag.startswith("W/") and self._conditional:
            headers["If-Match"] = file.tag
        headers["Range"] = f"bytes={start}-{end - 1}"
        return self._run(self._get_async(self._url(rel), headers, start, end, file.size, deadline, into))

    _conditional = True

    async def _get_async(self, url: str, headers: dict[str, str], start: int, end: int, size: int, deadline: float,
                         into: memoryview | None) -> bytearray | memoryview:
        want = end - start
        pace = Pace(self.limits, _host(url), want, deadline)
        response = await self._respond("GET", url, headers, pace)
        try:
            if response.status == 404:
                raise FileNotFoundError(url)
            response.raise_for_status()
            check_encoding(response.headers.get("Content-Encoding"), url)
            if response.status == 206:
                check_content_range(response.headers.get("Content-Range"), start, end, size, url)
            elif want != size or start != 0:
                raise Refused(f"the server ignored the Range request and answered {response.status} with the whole file "
                              f"({response.headers.get('Content-Length', 'unknown')} bytes) instead of bytes {start}-{end - 1}")
            length = response.headers.get("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) != want:
                if int(length) > want:
                    raise Refused(f"the server announced {int(length)} bytes for the {want} asked for")
                raise ShortBody(f"the server sent {int(length)} of {want} bytes")
            body = await read_body(response.content.read, want, pace, url, into=into)
        except BaseException:
            response.close()  # drop the connection: the rest of a refused or stalled body is never read
            raise
        response.release()  # a complete body: the connection goes back to the pool
        return body


MAX_REDIRECTS = 10


def _host(url: str) -> str:
    return urlsplit(url).netloc or url


class HubStore(HttpStore):
    """`hf://org/repo[@revision][/subfolder]`: huggingface_hub resolves the revision to a commit and lists
    the files (one `model_info` call); files are read as ranges of their `resolve/<commit>/` URLs."""

    def __init__(self, repo_id: str, revision: str | None, subfolder: str, url: str, repo_type: str = "model") -> None:
        from huggingface_hub import constants
        from huggingface_hub.utils import build_hf_headers

        self.repo_id = repo_id
        self.revision = revision or "main"
        self.subfolder = subfolder.strip("/")
        self.endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        self.offline = bool(os.environ.get("HF_HUB_OFFLINE") and os.environ["HF_HUB_OFFLINE"] not in ("0", "false", "False"))
        self.commit = self.revision if _COMMIT.match(self.revision) else None
        self.repo_type = repo_type
        super().__init__(url, headers=build_hf_headers())
        self.identity = f"hf:{self.endpoint}/{repo_id}@{self.commit or self.revision}/{self.subfolder}"

    def _list(self) -> dict[str, RemoteFile] | None:
        if self.offline:
            raise RemoteError(f"Cannot list {self.url}: offline mode (HF_HUB_OFFLINE) and no cached listing. "
                              "Open it once online first.", file=self.url)
        try:
            info = self._run(self._model_info())
        except (Refused, Stalled, ShortBody) as exc:
            raise RemoteUnreachable(f"Cannot open {self.url}: {exc}. Check HF_ENDPOINT and the connection.", file=self.url) from None
        except RemoteError:
            raise
        except Exception as exc:  # noqa: BLE001 - connection errors, a listing that is not the Hub's JSON ...
            kind = RemoteError if _status(exc) is not None else RemoteUnreachable
            raise kind(
                f"Cannot open {self.url}: {_describe(exc)}. Check the repo id, the revision and your token "
                "(hf auth login or HF_TOKEN).", file=self.url
            ) from None
        self.stats.add("", 0)
        self.commit = info.sha or self.revision
        self.identity = f"hf:{self.endpoint}/{self.repo_id}@{self.commit}/{self.subfolder}"
        prefix = self.subfolder + "/" if self.subfolder else ""
        files = {}
        for sibling in info.siblings or []:
            name = sibling.rfilename
            if not name.startswith(prefix) or sibling.size is None:
                continue
            rel = name[len(prefix):]
            tag = sibling.lfs.sha256 if sibling.lfs else (sibling.blob_id or "")
            files[rel] = RemoteFile(rel, int(sibling.size), tag)
        return files

    async def _model_info(self):
        """What `HfApi.model_info(files_metadata=True)` returns, asked the same way (same URL, headers, parsing into
        huggingface_hub's `ModelInfo`) but with the body read within `LISTING_CAP` and the store's pace."""
        from huggingface_hub.hf_api import ModelInfo

        url = f"{self.endpoint}/api/models/{self.repo_id}/revision/{quote(self.revision, safe='')}?blobs=true"
        pace = Pace(self.limits, _host(url), LISTING_CAP, time.monotonic() + self.limits.deadline_seconds)
        response = await self._respond("GET", url, dict(self._headers), pace)
        try:
            check_encoding(response.headers.get("Content-Encoding"), url)
            if response.status >= 400:
                why = response.headers.get("X-Error-Message") or response.reason or ""
                raise RemoteError(f"Cannot open {self.url}: HTTP {response.status} ({why}). Check the repo id, the revision "
                                  "and your token (hf auth login or HF_TOKEN).", file=self.url)
            body = await read_body(response.content.read, None, pace, url, cap=LISTING_CAP)
        finally:
            response.close()
        try:
            return ModelInfo(**json.loads(body))
        except (ValueError, TypeError, KeyError) as exc:
            raise RemoteError(f"Cannot open {self.url}: the Hub's answer is not a model listing ({exc}). Check "
                              "HF_ENDPOINT.", file=self.url) from None

    def _url(self, rel: str) -> str:
        from huggingface_hub import hf_hub_url

        path = f"{self.subfolder}/{rel}" if self.subfolder else rel
        return hf_hub_url(self.repo_id, path, revision=self.commit or self.revision, endpoint=self.endpoint)

    # Pinned to the commit: the content cannot change, and the CDN's ETag is not the listed blob id.
    _conditional = False


def s3_filesystem():
    """An s3fs file system configured as users configure S3 for sources and destinations alike: credentials,
    profile and region from the usual AWS configuration, the endpoint from `AWS_ENDPOINT_URL_S3` or
    `AWS_ENDPOINT_URL`. Returns (file system, endpoint URL or None)."""
    import s3fs

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    kwargs = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    return s3fs.S3FileSystem(skip_instance_cache=True, **kwargs), endpoint


class S3Store(RemoteStore):
    """`s3://bucket/prefix/` through s3fs (credentials and endpoint from the usual AWS configuration)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.fs, endpoint = s3_filesystem()
        self._host = urlsplit(endpoint).netloc if endpoint else "s3.amazonaws.com"
        self._base = url[len("s3://"):].rstrip("/")

    def _list(self) -> dict[str, RemoteFile] | None:
        try:
            found = self._find()
        except RemoteError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise RemoteError(f"Cannot list {self.url}: {_describe(exc)}. Check the bucket, the prefix and your AWS "
                              "credentials.", file=self.url) from None
        self.stats.add("", 0)
        files = {}
        for key, size, tag in found:
            if key == self._base:  # the URL names one object
                rel = ""
            elif key.startswith(self._base + "/"):
                rel = key[len(self._base) + 1:]
            else:
                continue
            files[rel] = RemoteFile(rel, size, tag)
        return files

    def _find(self) -> list[tuple[str, int, str]]:
        """(bucket/key, size, ETag) of every object whose key starts with the URL's prefix, page by page within the
        listing limits (`remote_limits.MAX_LISTING_PAGES`, `MAX_LISTING_ENTRIES`, `LISTING_CAP`): a server that
        answers with endless pages (or repeats a continuation token) is refused with the counts, never followed."""
        from fsspec.asyn import sync

        bucket, _, prefix = self._base.partition("/")

        def refuse(why: str) -> RemoteError:
            return RemoteError(f"Cannot list {self.url}: {why}. A model folder has far fewer files; check the prefix "
                               "(or the endpoint: a server that keeps sending pages is not S3).", file=self.url)

        async def pages() -> list[tuple[str, int, str]]:
            found: list[tuple[str, int, str]] = []
            token, seen, size = None, set(), 0
            for _ in range(MAX_LISTING_PAGES):
                kwargs = {"Bucket": bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
                page = await self.fs._call_s3("list_objects_v2", **kwargs)
                for entry in page.get("Contents") or ():
                    key, tag = str(entry.get("Key", "")), str(entry.get("ETag") or "")
                    size += len(key) + len(tag)
                    if not key.endswith("/"):  # a "folder" marker object holds nothing
                        found.append((f"{bucket}/{key}", int(entry.get("Size") or 0), tag))
                if len(found) > MAX_LISTING_ENTRIES or size > LISTING_CAP:
                    raise refuse(f"the listing holds more than {MAX_LISTING_ENTRIES:,} entries or {LISTING_CAP >> 20} MiB "
                                 f"of names ({len(found):,} entries, {size:,} bytes so far)")
                token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
                if not token:
                    return found
                if token in seen:
                    raise refuse(f"the server sent continuation token {str(token)[:40]!r} twice (a listing that loops)")
                seen.add(token)
            raise refuse(f"the listing did not end after {MAX_LISTING_PAGES:,} pages ({len(found):,} entries)")

        return sync(self.fs.loop, pages)

    def _get(self, rel: str, start: int, end: int, file: RemoteFile, deadline: float,
             into: memoryview | None = None) -> bytearray | memoryview:
        from fsspec.asyn import sync

        bucket, _, key = (f"{self._base}/{rel}" if rel else self._base).partition("/")
        extra = {"IfMatch": file.tag} if file.tag else {}
        where = self.where(rel)
        want = end - start

        async def fetch() -> bytearray | memoryview:
            pace = Pace(self.limits, self._host, want, deadline)
            resp = await pace.wait(self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                                    **extra))
            body = resp["Body"]
            try:
                check_encoding(resp.get("ContentEncoding"), where)
                whole = start == 0 and end == file.size  # a server may answer a whole-object range as a plain 200
                if resp.get("ContentRange") is not None or not whole:
                    check_content_range(resp.get("ContentRange"), start, end, file.size, where)
                length = resp.get("ContentLength")
                if isinstance(length, int) and length > want:
                    raise Refused(f"the server announced {length} bytes for the {want} asked for")
                return await read_body(body.read, want, pace, where, into=into)
            finally:
                body.close()

        return sync(self.fs.loop, fetch)


def open_store(url: str) -> RemoteStore:
    """The store for a URL (`hf://`, `http(s)://`, `s3://`) or a bare Hub repo id."""
    try:
        return _open_store(url)
    except ImportError as exc:
        raise RemoteError(f"Cannot open {url}: {exc.name or exc} is not installed. Install the remote extra: "
                          "pip install 'checkpoint-workbench[remote]'.", file=url) from None


def _open_store(url: str) -> RemoteStore:
    if url.startswith("s3://"):
        return S3Store(url)
    if url.startswith(("http://", "https://")):
        if not urlsplit(url).netloc:
            raise RemoteError(f"Cannot open {url}: the URL has no host. Write it as https://host/folder/.", file=url)
        return HttpStore(url)
    spec = url[len("hf://"):] if url.startswith("hf://") else url
    repo_type = "model"
    for prefix in ("models/",):
        if spec.startswith(prefix):
            spec = spec[len(prefix):]
    parts = spec.strip("/").split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise RemoteError(f"Cannot open {url}: a Hub source is hf://org/repo[@revision][/subfolder].", file=url)
    repo, revision = parts[1], None
    if "@" in repo:
        repo, revision = repo.split("@", 1)
        revision = unquote(revision)  # refs/pr/1 is written refs%2Fpr%2F1
    return HubStore(f"{parts[0]}/{repo}", revision, "/".join(parts[2:]), url if url.startswith("hf://") else "hf://" + url,
                    repo_type=repo_type)
