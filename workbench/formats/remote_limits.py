"""Limits every remote request keeps: a byte budget, a minimum pace and a deadline.

A server is untrusted like a checkpoint file: it may send a body that never ends, a gzip bomb, more or
fewer bytes than it announced, a range other than the one asked for, or one byte every few seconds.
Bodies are therefore read here, chunk by chunk, from the transport's stream (aiohttp through fsspec for
HTTP and the Hub, aiobotocore through s3fs for S3), never with a read-everything call:

- **Budget.** A request reads at most the bytes it asked for (a range's length, or `LISTING_CAP` for a
  body of unknown size): one byte more and it stops with an error naming the URL and both sizes.
- **Pace.** In every window of `stall_seconds` (default 30 s) a try must receive `min_bytes` (64 KiB, or
  what is left when less): a server that drips a byte every few seconds ends the try at the window's
  end. The response headers must arrive within one window too; the body's first window starts then.
- **Deadline.** A request's tries start within `deadline_seconds` (default 150 s) of its first one and
  no wait outlasts it, so a dead or dripping server gives up within 2.5 minutes; a try that keeps the
  minimum pace is never cut in the middle.
- **Listings.** A paged listing (S3) reads at most `MAX_LISTING_PAGES` pages, `MAX_LISTING_ENTRIES` entries and
  `LISTING_CAP` bytes of keys and tags, and never follows a continuation token twice.
- **Notice.** After `notice_seconds` (default 5 s) without data, the wait hook (`set_wait_hook`; by
  default a warning on the `workbench.remote` logger) is told "waiting for <host>".

The limits come from the environment (`WORKBENCH_REMOTE_STALL_SECONDS`, `WORKBENCH_REMOTE_MIN_BYTES`,
`WORKBENCH_REMOTE_DEADLINE_SECONDS`, `WORKBENCH_REMOTE_NOTICE_SECONDS`) when a store is opened, or are set
on the store (`store.limits = Limits(...)`).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

LISTING_CAP = 512 << 20  # a body whose size nothing announced (an index, a listing) stops here
# A listing that comes in pages (S3's list_objects_v2, continued by a token) stops at whichever comes first: this
# many pages, this many entries, or LISTING_CAP bytes of names and tags; a token the server gave before ends it too.
# A model folder holds tens of files, a DCP run a few thousand: a server sending endless pages is refused.
MAX_LISTING_PAGES = 1_000
MAX_LISTING_ENTRIES = 200_000
READ_PIECE = 1 << 20  # bytes asked of the stream per read call
WaitHook = Callable[[str, float], object]
_wait_hook: WaitHook | None = None


class Stalled(Exception):
    """A try received less than the minimum in a window (or hit the deadline): retried by the store."""


class Refused(Exception):
    """A response that breaks the request's contract (size, range, encoding, redirect): never retried."""


def _env_float(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 else default


@dataclass(frozen=True)
class Limits:
    """The pace and deadline of one store's requests (see the module docstring)."""

    stall_seconds: float = 30.0
    min_bytes: int = 64 << 10
    deadline_seconds: float = 150.0
    notice_seconds: float = 5.0

    @classmethod
    def from_env(cls) -> Limits:
        """The defaults, overridden by the `WORKBENCH_REMOTE_*` environment variables."""
        return cls(
            stall_seconds=_env_float("WORKBENCH_REMOTE_STALL_SECONDS", cls.stall_seconds),
            min_bytes=int(_env_float("WORKBENCH_REMOTE_MIN_BYTES", cls.min_bytes)),
            deadline_seconds=_env_float("WORKBENCH_REMOTE_DEADLINE_SECONDS", cls.deadline_seconds),
            notice_seconds=_env_float("WORKBENCH_REMOTE_NOTICE_SECONDS", cls.notice_seconds),
        )


def set_wait_hook(hook: WaitHook | None) -> None:
    """Call `hook(host, seconds)` when a request has had no data for `notice_seconds` (None: log a warning)."""
    global _wait_hook
    _wait_hook = hook


def _notify(host: str, seconds: float) -> None:
    if _wait_hook is not None:
        _wait_hook(host, seconds)
    else:
        import logging  # here, not at import: a local conversion never loads the network stack or its logging

        logging.getLogger("workbench.remote").warning("waiting for %s: no data for %.0f s", host, seconds)


class Pace:
    """The clock of one try: how long the next wait may last, and whether the last window got enough."""

    def __init__(self, limits: Limits, host: str, want: int, deadline: float) -> None:
        self.limits, self.host, self.deadline = limits, host, deadline
        self.left = want
        now = time.monotonic()
        self._window_end = now + limits.stall_seconds
        self._window_bytes = 0
        self._need = min(limits.min_bytes, max(1, want))
        self._last_data = now
        self._noticed = False

    def _stall_text(self) -> str:
        return (f"fewer than {self._need} bytes arrived in {self.limits.stall_seconds:g} s "
                f"(got {self._window_bytes}; the window is WORKBENCH_REMOTE_STALL_SECONDS)")

    async def wait(self, step: Awaitable):
        """Await `step` (a header or body read) within the window and the deadline; Stalled when it does not come."""
        import asyncio  # only remote reads need it (this module is imported by every open)

        task = asyncio.ensure_future(step)
        while True:
            now = time.monotonic()
            end = min(self._window_end, self.deadline)
            notice = self._last_data + self.limits.notice_seconds if not self._noticed else end
            timeout = max(0.0, min(end, notice) - now)
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if done:
                return task.result()
            now = time.monotonic()
            if not self._noticed and now >= self._last_data + self.limits.notice_seconds:
                self._noticed = True
                _notify(self.host, now - self._last_data)
            if now >= end:
                task.cancel()
                if now >= self.deadline and now < self._window_end:
                    raise Stalled(f"the request's {self.limits.deadline_seconds:g} s deadline passed with {self._window_bytes} "
                                  "byte(s) received in the current window (WORKBENCH_REMOTE_DEADLINE_SECONDS)")
                raise Stalled(self._stall_text())

    def body_starts(self) -> None:
        """The response headers arrived within their window: the body's first window starts now."""
        now = time.monotonic()
        self._window_end, self._window_bytes, self._last_data, self._noticed = now + self.limits.stall_seconds, 0, now, False

    def got(self, n: int) -> None:
        """Count `n` bytes received; Stalled when a window ended without its minimum."""
        now = time.monotonic()
        self._window_bytes += n
        self.left -= n
        if n:
            self._last_data, self._noticed = now, False
        if now >= self._window_end:
            if self._window_bytes < self._need:
                raise Stalled(self._stall_text())
            self._window_end = now + self.limits.stall_seconds
            self._window_bytes = 0
            self._need = min(self.limits.min_bytes, max(1, self.left))


async def read_body(read: Callable[[int], Awaitable[bytes]], want: int | None, pace: Pace, where: str,
                    cap: int = LISTING_CAP, into: memoryview | None = None) -> bytearray | memoryview:
    """Read a body through `read(n)` (a stream's read): exactly `want` bytes when given (Refused for more,
    `ShortBody` for fewer), else at most `cap` bytes (Refused beyond). With `into` (a buffer of `want` bytes), the
    body goes straight into it, chunk by chunk: no second copy of a range is ever held."""
    limit = want if want is not None else cap
    out = bytearray() if into is None else None
    got = 0
    pace.body_starts()
    while got <= limit:
        chunk = await pace.wait(read(min(READ_PIECE, limit + 1 - got)))
        if not chunk:
            break
        if out is not None:
            out += chunk
        elif got + len(chunk) <= limit:
            into[got:got + len(chunk)] = chunk
        got += len(chunk)
        pace.got(len(chunk))
    if got > limit:
        if want is None:
            raise Refused(f"the body of {where} is larger than the {cap}-byte limit for a file whose size is not "
                          "announced; serve a real index (or set its Content-Length)")
        raise Refused(f"the server sent more than the {want} bytes asked for from {where}")
    if want is not None and got < want:
        raise ShortBody(f"the server sent {got} of {want} bytes")
    return out if out is not None else into


class ShortBody(Exception):
    """The body ended before the asked length: retried by the store (a dropped connection looks the same)."""


_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$")


def check_content_range(value: str | None, start: int, end: int, size: int | None, where: str) -> None:
    """Refuse a 206 whose `Content-Range` is not the asked bytes [start, end) of a file of `size` bytes."""
    m = _CONTENT_RANGE.match(value or "")
    if m is None:
        raise Refused(f"the server answered the range request for bytes {start}-{end - 1} of {where} with "
                      f"Content-Range {value!r}, which is not a byte range")
    first, last, total = int(m[1]), int(m[2]), m[3]
    if (first, last) != (start, end - 1) or (size is not None and total != "*" and int(total) != size):
        raise Refused(f"the server answered bytes {first}-{last}/{total} to a request for bytes {start}-{end - 1}"
                      + (f"/{size}" if size is not None else "") + f" of {where}")


def check_encoding(value: str | None, where: str) -> None:
    """Refuse a compressed body: bytes are asked with `Accept-Encoding: identity`, sizes are of the file itself."""
    if value and value.strip().lower() not in ("identity", ""):
        raise Refused(f"the server sent {where} with Content-Encoding {value.strip()!r} although identity was asked; "
                      "compressed bodies are refused (their size is not the file's)")
