"""`s3://bucket/prefix/` as a destination: multipart uploads, object metadata as the manifest, index last.

Through the s3fs/botocore client users configure for S3 sources (`formats.remote.s3_filesystem`: AWS
credentials, profile, region, `AWS_ENDPOINT_URL`). What lives under the prefix besides the output:

- `.workbench-lock.json`: the lock, written with `If-None-Match: *` (a conditional write: two runs cannot both
  create it). A lock left by a killed run on this host (its process is gone) is taken over; any other is a
  refusal naming its holder.
- `.workbench-convert.json`: the manifest of an unfinished run (the plan's fingerprint, file names and sizes).
- each output file, uploaded as one object (multipart above `part_size`), its metadata recording the plan's
  fingerprint and the file's SHA-256: an object appears only when its upload completed, so an object under
  a planned name with this fingerprint, the planned size and a checked ETag is a finished file.
- `.workbench-complete.json`: written after the index: this plan finished here (a re-run does nothing).

The index (or `.metadata`) is uploaded only after every planned object was checked, so a reader never sees an
index naming a missing or partial shard. Multipart uploads a killed run left are aborted by the next run's
`begin` (they are never resumed: the spool copy is gone with the killed process).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import PlanError
from .base import FinishedFile, RemoteDestination, RemoteState

LOCK_NAME = ".workbench-lock.json"
MANIFEST_NAME = ".workbench-convert.json"
COMPLETE_NAME = ".workbench-complete.json"
OWN_NAMES = (LOCK_NAME, MANIFEST_NAME, COMPLETE_NAME)
FINGERPRINT_KEY = "workbench-fingerprint"
SHA256_KEY = "workbench-sha256"
MIN_PART = 5 << 20  # S3's smallest part (all but the last)
DEFAULT_PART = 16 << 20  # held in memory while it uploads
DEFAULT_PART_THREADS = 4  # parts of one file in flight at once (per rank): each holds one part in memory
MAX_PARTS = 10_000


def _missing(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError) or "NoSuchKey" in str(exc) or "Not Found" in str(exc)


def _conflict(exc: BaseException) -> bool:
    return isinstance(exc, FileExistsError) or "PreconditionFailed" in str(exc) or "pre-conditions" in str(exc)


def multipart_etag(part_md5s: Sequence[bytes]) -> str:
    """The ETag S3 gives an object assembled from parts with these MD5 digests."""
    return f'"{hashlib.md5(b"".join(part_md5s)).hexdigest()}-{len(part_md5s)}"'  # noqa: S324 - S3's own scheme


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class S3Destination(RemoteDestination):
    """A conversion's output under `s3://bucket/prefix/` (see the module docstring)."""

    scheme = "s3://"

    def __init__(self, url: str, fingerprint: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(url, fingerprint, options)
        rest = url[len("s3://"):]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise PlanError(f"Cannot write to {url}: it names no bucket. Write it as s3://bucket/prefix/.", file=url)
        self.bucket, self.prefix = bucket, prefix.strip("/")
        from ...display import parse_size

        part = parse_size(self.options.get("part_size", DEFAULT_PART), what="part size")
        if part < MIN_PART:
            raise PlanError(f"Cannot write to {url} with part_size={part}: S3 parts are at least {MIN_PART} bytes. "
                            "Choose a larger part size.", file=url)
        self.part_size = part
        threads = self.options.get("part_threads", DEFAULT_PART_THREADS)
        try:
            self.part_threads = int(threads)
        except (TypeError, ValueError):
            self.part_threads = 0
        if not 1 <= self.part_threads <= 64:
            raise PlanError(f"Cannot write to {url} with part_threads={threads!r}: write a whole number of parts to "
                            "upload at once, from 1 to 64.", file=url)
        self._fs = None
        self._uploads: dict[str, str] = {}  # key -> UploadId of this process's unfinished multipart uploads
        self._streams: dict[str, dict[int, tuple[bytes, str]]] = {}  # name -> part number -> (MD5, ETag) put so far
        self.deferred: set[str] = set()  # files whose multipart upload is completed by `finish` (`defer`)
        self._guard = threading.Lock()
        self._locked = False

    # --- plumbing -----------------------------------------------------------------------------------------------

    @property
    def fs(self):
        """The s3fs file system (built on first use, in the process that uses it)."""
        if self._fs is None:
            from ...formats.remote import s3_filesystem

            self._fs = s3_filesystem()[0]
        return self._fs

    def key(self, name: str) -> str:
        """The object key of `name` under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def where(self, name: str = "") -> str:
        """`s3://bucket/key` of `name`, for messages."""
        return f"s3://{self.bucket}/{self.key(name)}"

    def call(self, method: str, name: str, **kwargs: Any) -> Any:
        """One S3 call about `name`; failures other than the ones callers test for become PlanErrors naming the object."""
        try:
            return self.fs.call_s3(method, Bucket=self.bucket, **kwargs)
        except (FileNotFoundError, FileExistsError):
            raise
        except Exception as exc:  # noqa: BLE001 - botocore/s3fs raise many kinds
            if _missing(exc) or _conflict(exc):
                raise
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PlanError(f"Cannot {method.replace('_', ' ')} {self.where(name)}: {type(exc).__name__}: {text}. Check the "
                            "bucket, your AWS credentials and AWS_ENDPOINT_URL, then run the same conversion again "
                            "(finished files are kept).", file=self.where(name)) from None

    def listing(self) -> dict[str, int]:
        """Name (relative to the prefix) -> size of every object under the prefix."""
        found: dict[str, int] = {}
        start = self.key("")
        token = None
        for _ in range(10_000):
            page = self.call("list_objects_v2", "", Prefix=start, **({"ContinuationToken": token} if token else {}))
            for entry in page.get("Contents") or ():
                found[str(entry["Key"])[len(start):]] = int(entry.get("Size") or 0)
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                break
        return found

    def read_json(self, name: str) -> dict | None:
        """A small JSON record of ours, or None when absent or unreadable."""
        try:
            body = self.call("get_object", name, Key=self.key(name))["Body"]
            data = json.loads(_read_all(self.fs, body))
        except Exception:  # noqa: BLE001 - a missing or damaged record is no record
            return None
        return data if isinstance(data, dict) else None

    def put_json(self, name: str, body: dict, **extra: Any) -> None:
        """Write one of our records (small)."""
        self.call("put_object", name, Key=self.key(name), Body=(json.dumps(body, indent=1, sort_keys=True) + "\n").encode(),
                  ContentType="application/json", **extra)

    def delete(self, name: str) -> None:
        """Delete an object (absent is fine)."""
        try:
            self.call("delete_object", name, Key=self.key(name))
        except (FileNotFoundError, OSError):
            pass

    def unfinished_uploads(self) -> list[tuple[str, str]]:
        """(key, UploadId) of the multipart uploads under the prefix not yet completed or aborted."""
        found: list[tuple[str, str]] = []
        kwargs: dict[str, Any] = {}
        for _ in range(10_000):
            page = self.call("list_multipart_uploads", "", Prefix=self.key(""), **kwargs)
            found += [(str(u["Key"]), str(u["UploadId"])) for u in page.get("Uploads") or ()]
            if not page.get("IsTruncated"):
                break
            kwargs = {"KeyMarker": page.get("NextKeyMarker"), "UploadIdMarker": page.get("NextUploadIdMarker")}
        return found

    # --- the interface ------------------------------------------------------------------------------------------

    def memory_terms(self) -> list[tuple[str, int, str]]:
        """The parts in flight (`part_threads` of them), each in memory with the copy botocore's request holds."""
        many = f"{self.part_threads} S3 parts" if self.part_threads > 1 else "an S3 part"
        return [("upload", 2 * self.part_threads * self.part_size,
                 f"{many} of {self.part_size:,} bytes in flight and botocore's copy of each")]

    def state(self, files: Mapping[str, int], *, overwrite: bool) -> RemoteState:
        """What the prefix holds for this plan (see `RemoteDestination.state`)."""
        state = RemoteState()
        present = self.listing()
        entries = sorted(n for n in present if n != LOCK_NAME)
        if not entries:
            return state
        manifest, record = self.read_json(MANIFEST_NAME), self.read_json(COMPLETE_NAME)
        ours = (manifest or record or {}).get("fingerprint") == self.fingerprint
        if record is not None and manifest is None and ours:
            done = self.completed()
            others = record.get("others") if isinstance(record.get("others"), dict) else {}
            if (all(n in done and done[n].size == s for n, s in files.items())
                    and all(present.get(n) == s for n, s in others.items())):
                state.complete, state.kept = True, {n: done[n] for n in files}
                return state
        if ours:
            done = self.completed()
            state.kept = {n: f for n, f in done.items() if files.get(n) == f.size}
            return state
        if overwrite:
            return state
        if manifest is not None or record is not None:
            what = "an unfinished" if manifest is not None else "a finished"
            state.errors.append(f"Cannot write to {self.url}: it holds {what} conversion of a different plan (another source, "
                                "mapper, or options such as dtype, shard size or output format). Choose another prefix, or "
                                "pass overwrite=True (--overwrite) to replace it.")
        else:
            shown = ", ".join(entries[:5]) + (" ..." if len(entries) > 5 else "")
            state.errors.append(f"Cannot write to {self.url}: the prefix is not empty ({len(entries)} objects: {shown}). Choose "
                                "an empty prefix, or pass overwrite=True (--overwrite) to replace the conversion's files there.")
        return state

    def lock(self) -> None:
        """Create the lock object with a conditional write; take over a lock whose process on this host is gone."""
        body = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "fingerprint": self.fingerprint}
        for _ in range(2):
            try:
                self.put_json(LOCK_NAME, body, IfNoneMatch="*")
                self._locked = True
                return
            except FileExistsError:
                pass
            except Exception as exc:  # noqa: BLE001
                if not _conflict(exc):
                    raise
            holder, tag = self._read_lock()
            pid = holder.get("pid")
            if holder.get("host") == body["host"] and isinstance(pid, int) and not _pid_alive(pid):
                self._remove_stale_lock(tag)  # its run was killed: nobody else can be writing under this host's lock
                continue
            who = f"process {pid} on {holder.get('host')}" if holder else "a run whose lock could not be read"
            raise PlanError(f"Cannot write to {self.url}: another conversion is writing there ({who}; {self.where(LOCK_NAME)}). "
                            "Wait for it to finish or stop it; if it is dead, delete that object and run again.",
                            file=self.where(LOCK_NAME))
        raise PlanError(f"Cannot lock {self.url}: the lock {self.where(LOCK_NAME)} keeps coming back. Another conversion "
                        "may be starting there; wait for it, then run again.", file=self.where(LOCK_NAME))

    def _read_lock(self) -> tuple[dict, str | None]:
        """The lock's body and ETag ({} and None when it cannot be read)."""
        try:
            answer = self.call("get_object", LOCK_NAME, Key=self.key(LOCK_NAME))
            data = json.loads(_read_all(self.fs, answer["Body"]))
        except Exception:  # noqa: BLE001 - gone, or not ours to parse
            return {}, None
        return (data if isinstance(data, dict) else {}), answer.get("ETag")

    def _remove_stale_lock(self, tag: str | None) -> None:
        """Delete the stale lock only if it is still the one read (`If-Match`): two runs taking over the same dead
        lock cannot both delete it, so at most one of them creates the next. A store without conditional deletes
        gets a plain delete."""
        if tag is None:
            return
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.key(LOCK_NAME), IfMatch=tag)
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001
            if _conflict(exc) or "pre-conditions" in str(exc):
                return  # another run replaced it first: the next round reads the new holder
            self.delete(LOCK_NAME)

    def begin(self, files: Mapping[str, int], kept: Sequence[str], markers: Sequence[str] = (),
              stale: Callable[[str], bool] | None = None) -> None:
        """Lock, hide the markers, abort leftover multipart uploads, remove stale planned objects, write the manifest."""
        self.lock()
        for name in (COMPLETE_NAME, *markers):  # first: from here on nothing there looks complete
            self.delete(name)
        for key, upload in self.unfinished_uploads():
            try:
                self.call("abort_multipart_upload", key, Key=key, UploadId=upload)
            except (FileNotFoundError, OSError):
                pass
        present = self.listing()
        for name in present:
            if name not in kept and (name in files or (stale is not None and "/" not in name and stale(name))):
                self.delete(name)
        self.put_json(MANIFEST_NAME, {"workbench_convert": 1, "fingerprint": self.fingerprint, "files": dict(files)})

    def defer(self, names: Sequence[str]) -> None:
        """These files are uploaded as multipart uploads left open; `finish` completes them last (see the base)."""
        self.deferred = set(names)

    def file_done(self, name: str, local_path: Path, size: int, sha256: str) -> None:
        """Upload `local_path` as `name` (multipart above the part size) and check the object's size and ETag; a
        deferred file's parts only (`defer`: `finish` completes it)."""
        metadata = {FINGERPRINT_KEY: self.fingerprint, SHA256_KEY: sha256}
        key = self.key(name)
        if name in self.deferred:
            self.open_stream(name, size)
            part = self.stream_part_size(size) or size
            with open(local_path, "rb") as f:
                for number, begin in enumerate(range(0, max(size, 1), part), 1):
                    self.put_part(name, number, os.pread(f.fileno(), min(part, size - begin), begin))
            with self._guard:
                self._streams.pop(name, None)
            return
        with open(local_path, "rb") as f:
            if size <= self.part_size:
                body = f.read()
                expected = f'"{hashlib.md5(body).hexdigest()}"'  # noqa: S324 - S3's ETag of a single-part object
                answer = self.call("put_object", name, Key=key, Body=body, Metadata=metadata)
                etag = answer.get("ETag")
            else:
                expected, etag = self._multipart(name, f.fileno(), size, metadata)
        head = self.call("head_object", name, Key=key)
        if int(head.get("ContentLength", -1)) != size or (etag is not None and etag != expected):
            raise PlanError(f"Cannot upload {name} to {self.where(name)}: the stored object has {head.get('ContentLength')} bytes "
                            f"and ETag {etag} where {size} bytes and {expected} were sent. Run the same conversion again.",
                            file=self.where(name))

    def _multipart(self, name: str, fd: int, size: int, metadata: dict[str, str]) -> tuple[str, str | None]:
        """Upload the file open as `fd` in parts, `part_threads` at a time; (expected ETag, S3's ETag).

        Each part is read (`os.pread`) by the thread that uploads it, so at most `part_threads` parts are in memory
        (`memory_terms`). On any failure the parts not started are cancelled, the running ones waited for, and the
        multipart upload aborted before the error is raised: no part lands after the abort, none is left behind.
        """
        from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

        key = self.key(name)
        part = max(self.part_size, -(-size // MAX_PARTS))
        upload = self.call("create_multipart_upload", name, Key=key, Metadata=metadata)["UploadId"]
        with self._guard:
            self._uploads[key] = upload

        failed = threading.Event()  # a part failed: the parts not yet started are not sent

        def one(number: int) -> tuple[bytes, str] | None:
            if failed.is_set():
                return None
            try:
                chunk = os.pread(fd, min(part, size - (number - 1) * part), (number - 1) * part)
                digest = hashlib.md5(chunk).digest()  # noqa: S324 - S3's ETag scheme
                answer = self.call("upload_part", name, Key=key, UploadId=upload, PartNumber=number, Body=chunk)
            except BaseException:
                failed.set()
                raise
            return digest, answer["ETag"]

        count = -(-size // part)
        try:
            with ThreadPoolExecutor(min(self.part_threads, count), thread_name_prefix="workbench-s3-part") as pool:
                futures = [pool.submit(one, number) for number in range(1, count + 1)]
                wait(futures, return_when=FIRST_EXCEPTION)
                for future in futures:
                    future.cancel()  # only those not started: the pool's exit waits for the running ones
            errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
            if errors:
                raise errors[0]
            results = [f.result() for f in futures]
            answer = self.call("complete_multipart_upload", name, Key=key, UploadId=upload,
                               MultipartUpload={"Parts": [{"PartNumber": n, "ETag": r[1]}
                                                          for n, r in enumerate(results, 1) if r is not None]})
        except BaseException:
            with self._guard:
                mine = self._uploads.pop(key, None) == upload  # else abort() took it over meanwhile
            if mine:
                try:
                    self.call("abort_multipart_upload", name, Key=key, UploadId=upload)
                except Exception:  # noqa: BLE001 - cleanup: the next run's begin aborts what is left
                    pass
            raise
        with self._guard:
            self._uploads.pop(key, None)
        return multipart_etag([r[0] for r in results if r is not None]), answer.get("ETag")

    def stream_part_size(self, size: int) -> int | None:
        """Files are uploaded part by part while they are written: `part_size` (more for files above 10,000 parts)."""
        return max(self.part_size, -(-size // MAX_PARTS))

    def open_stream(self, name: str, size: int) -> None:
        """Create the multipart upload of `name`, recorded with the fingerprint (the SHA-256 is not known yet: the
        object's checked ETag, the MD5 of its parts' MD5s, is its digest)."""
        key = self.key(name)
        upload = self.call("create_multipart_upload", name, Key=key, Metadata={FINGERPRINT_KEY: self.fingerprint})["UploadId"]
        with self._guard:
            self._uploads[key] = upload
            self._streams[name] = {}

    def put_part(self, name: str, number: int, data: bytes) -> None:
        """Upload one part of a streamed file (`open_stream`)."""
        key = self.key(name)
        with self._guard:
            upload = self._uploads[key]
        digest = hashlib.md5(data).digest()  # noqa: S324 - S3's ETag scheme
        answer = self.call("upload_part", name, Key=key, UploadId=upload, PartNumber=number, Body=data)
        with self._guard:
            self._streams[name][number] = (digest, answer["ETag"])

    def close_stream(self, name: str, size: int) -> None:
        """Complete the multipart upload of `name` and check the object's size and ETag against the parts sent."""
        key = self.key(name)
        with self._guard:
            upload, parts = self._uploads[key], self._streams.pop(name)
        if name in self.deferred:
            return  # `finish` completes it, last
        numbers = sorted(parts)
        if numbers != list(range(1, len(numbers) + 1)) or not numbers:
            raise PlanError(f"Cannot finish {self.where(name)}: parts {numbers[:5]} were uploaded, not every part from 1. "
                            "Run the same conversion again.", file=self.where(name))
        answer = self.call("complete_multipart_upload", name, Key=key, UploadId=upload,
                           MultipartUpload={"Parts": [{"PartNumber": n, "ETag": parts[n][1]} for n in numbers]})
        with self._guard:
            self._uploads.pop(key, None)
        expected, etag = multipart_etag([parts[n][0] for n in numbers]), answer.get("ETag")
        head = self.call("head_object", name, Key=key)
        if int(head.get("ContentLength", -1)) != size or (etag is not None and etag != expected):
            raise PlanError(f"Cannot upload {name} to {self.where(name)}: the stored object has {head.get('ContentLength')} bytes "
                            f"and ETag {etag} where {size} bytes and {expected} were sent. Run the same conversion again.",
                            file=self.where(name))

    def completed(self) -> dict[str, FinishedFile]:
        """The objects under the prefix recorded with this plan's fingerprint (size and SHA-256 from their metadata)."""
        done: dict[str, FinishedFile] = {}
        for name, size in self.listing().items():
            if name in OWN_NAMES or name.startswith("."):
                continue
            try:
                head = self.call("head_object", name, Key=self.key(name))
            except (FileNotFoundError, OSError):
                continue
            meta = {k.lower(): v for k, v in (head.get("Metadata") or {}).items()}
            if meta.get(FINGERPRINT_KEY) == self.fingerprint and int(head.get("ContentLength", -1)) == size:
                done[name] = FinishedFile(name, size, str(meta.get(SHA256_KEY, "")))
        return done

    def finish(self, uploads: Sequence[tuple[str, Path]], planned: Mapping[str, int]) -> None:
        """Check every planned object, upload `uploads` in order (the marker last), record completion, unlock."""
        done = self.completed()
        missing = [n for n, s in planned.items() if n not in self.deferred and (n not in done or done[n].size != s)]
        hidden = {n: s for n, s in planned.items()  # (one a killed finish completed already is there: kept)
                  if n in self.deferred and not (n in done and done[n].size == s)}
        pending = {key for key, _ in self.unfinished_uploads()}
        missing += [n for n in hidden if self.key(n) not in pending]
        if missing:
            raise PlanError(f"Cannot publish {self.url}: {len(missing)} planned file(s) are not finished there (e.g. "
                            f"{missing[0]}). No index was written; run the same conversion again to resume.",
                            file=self.where(missing[0]))
        others = {}
        for name, path in uploads:
            size = path.stat().st_size
            self.file_done(name, path, size, "")
            others[name] = size
        for name, size in hidden.items():  # the output's only files: readable only now, after config.json and co.
            self._complete_deferred(name, size)
        done = self.completed()
        self.put_json(COMPLETE_NAME, {"workbench_convert": 1, "complete": True, "fingerprint": self.fingerprint,
                                      "files": {n: {"size": f.size, "sha256": f.sha256} for n, f in sorted(done.items())
                                                if n in planned},
                                      "others": others})
        self.delete(MANIFEST_NAME)
        self.release()

    def _complete_deferred(self, name: str, size: int) -> None:
        """Complete the open multipart upload of `name` (any process's: its parts are listed from S3) and check it."""
        key = self.key(name)
        uploads = [u for k, u in self.unfinished_uploads() if k == key]
        if len(uploads) != 1:
            raise PlanError(f"Cannot publish {self.where(name)}: {len(uploads)} unfinished uploads of it where one was "
                            "expected. Run the same conversion again.", file=self.where(name))
        parts: list[dict] = []
        marker: dict[str, Any] = {}
        for _ in range(MAX_PARTS):
            page = self.call("list_parts", name, Key=key, UploadId=uploads[0], **marker)
            parts += page.get("Parts") or []
            if not page.get("IsTruncated"):
                break
            marker = {"PartNumberMarker": page.get("NextPartNumberMarker")}
        numbers = [int(p["PartNumber"]) for p in parts]
        if numbers != list(range(1, len(parts) + 1)) or sum(int(p["Size"]) for p in parts) != size:
            raise PlanError(f"Cannot publish {self.where(name)}: its upload holds parts {numbers[:5]} of "
                            f"{sum(int(p['Size']) for p in parts)} bytes where {size} were planned. Run the same "
                            "conversion again.", file=self.where(name))
        answer = self.call("complete_multipart_upload", name, Key=key, UploadId=uploads[0],
                           MultipartUpload={"Parts": [{"PartNumber": int(p["PartNumber"]), "ETag": p["ETag"]}
                                                      for p in parts]})
        with self._guard:
            self._uploads.pop(key, None)
        expected = multipart_etag([bytes.fromhex(str(p["ETag"]).strip('"')) for p in parts])
        head = self.call("head_object", name, Key=key)
        etag = answer.get("ETag")
        if int(head.get("ContentLength", -1)) != size or (etag is not None and etag != expected):
            raise PlanError(f"Cannot publish {self.where(name)}: the stored object has {head.get('ContentLength')} bytes "
                            f"and ETag {etag} where {size} bytes and {expected} were uploaded. Run the same conversion "
                            "again.", file=self.where(name))

    def release(self) -> None:
        """Delete the lock object (the job's rank 0 owns it, whichever process took it)."""
        self.delete(LOCK_NAME)
        self._locked = False

    def abort(self, *, keep_lock: bool = False) -> None:
        """Abort this process's unfinished multipart uploads; release the lock if this process took it."""
        with self._guard:
            pending, self._uploads, self._streams = dict(self._uploads), {}, {}
        for key, upload in pending.items():
            try:
                self.call("abort_multipart_upload", key, Key=key, UploadId=upload)
            except Exception:  # noqa: BLE001 - cleanup: the next run's begin aborts what is left
                pass
        if self._locked and not keep_lock:
            try:
                self.release()
            except Exception:  # noqa: BLE001
                pass


def _read_all(fs, body) -> bytes:
    """The whole body of a small object (our JSON records)."""
    from fsspec.asyn import sync

    async def read() -> bytes:
        try:
            return await body.read()
        finally:
            body.close()

    return sync(fs.loop, read)
