"""How the workbench creates files: never through a planted link, never half-written, always durable.

Every file the workbench writes (shards, `.partial` temporaries, the index, DCP `.metadata`, the
manifest, the lock, checksum sidecars, copied extras, launcher job files) goes through this module,
because the folders it writes into may be shared or untrusted:

- a new file is created with `O_CREAT | O_EXCL | O_NOFOLLOW`, so a symlink, FIFO or hard link planted
  at its name is never opened, truncated or written through (`create_exclusive`, `claim_temp`);
- a complete file appears under its final name by `rename` (which replaces the directory entry and
  never follows it) after `fsync`, and the folder is synced after (`AtomicWriter`, `atomic_write`);
- a file that must be opened as it exists (the lock, a file read back) is opened with `O_NOFOLLOW |
  O_NONBLOCK` and checked to be a regular file, so a FIFO cannot hang a run (`open_regular`).

The folder paths themselves (the destination the user named, its parents) are followed as given;
only the entries the workbench names inside them are held to these rules. A temporary name (`temp_name`:
`<name>.partial`, or a short hashed `<start of name>.<digest>.partial` when that would not fit the file
system's name limit, so that any name the file system accepts can be written) belongs to the workbench: whatever non-folder entry sits there (a crashed run's leftover, or a planted
link) is unlinked (never followed) and the name created afresh.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from .errors import UnsafeFileError

PARTIAL_SUFFIX = ".partial"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLAIM_TRIES = 8  # a name re-planted between our unlink and our create this many times is refused


def describe(mode: int) -> str:
    """What kind of entry an `st_mode` is, as the error messages say it ('a symlink', 'a FIFO' ...)."""
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a file" if stat.S_ISREG(mode) else "not a regular file"


def refusal(path: str | os.PathLike, what: str, verb: str = "write") -> UnsafeFileError:
    """The error for an entry the workbench will not write (or read) through."""
    path = Path(path)
    return UnsafeFileError(
        f"Cannot {verb} {path.name}: it is {what} ({path}). Remove it or choose another destination.", file=str(path), what=what
    )


def _lstat_mode(path: Path) -> int | None:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return None


def create_exclusive(path: str | os.PathLike, *, flags: int = os.O_WRONLY, mode: int = 0o644) -> int:
    """Create `path` as a new regular file and return its descriptor; any existing entry is refused.

    `O_EXCL` makes the kernel refuse a name that exists in any form (a dangling symlink included), so
    nothing planted there is ever opened.
    """
    path = Path(path)
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    except FileExistsError:
        found = _lstat_mode(path)
        what = "an existing file" if found is None or stat.S_ISREG(found) else describe(found)
        raise refusal(path, what) from None


def remove_entry(path: str | os.PathLike) -> bool:
    """Unlink `path` if it exists (a symlink is removed, never its target); a directory is refused.

    Returns True when something was removed.
    """
    path = Path(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except (IsADirectoryError, PermissionError) as exc:
        found = _lstat_mode(path)
        if found is not None and stat.S_ISDIR(found):
            raise refusal(path, "a directory") from None
        if found is not None:  # e.g. another user's entry in a sticky folder such as /tmp
            raise refusal(path, f"{describe(found)} this user may not remove") from None
        raise exc
    return True


def claim_temp(path: str | os.PathLike, *, flags: int = os.O_WRONLY, mode: int = 0o644) -> int:
    """Create the workbench's own temporary file `path` exclusively, first unlinking whatever is there.

    Used for temporary names (`temp_path`): a leftover of a crashed run is replaced, a planted symlink, FIFO
    or hard link is unlinked without being opened, a directory is refused.
    """
    path = Path(path)
    for _ in range(_CLAIM_TRIES):
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
        except FileExistsError:
            remove_entry(path)
    raise refusal(path, "re-created by another process each time it was removed")


def open_regular(path: str | os.PathLike, flags: int = os.O_RDONLY, *, verb: str | None = None) -> int:
    """Open an existing `path` that must be a regular file, without following a symlink at its name.

    A symlink, FIFO, socket, device or directory raises `UnsafeFileError` naming the path (a FIFO is
    opened non-blocking, so it cannot hang the caller). Opened for writing, a file with other hard links
    is refused too, since writing it would change the file behind those links. Missing files raise
    FileNotFoundError as `os.open` does.
    """
    path = Path(path)
    writing = (flags & os.O_ACCMODE) != os.O_RDONLY
    verb = verb or ("write" if writing else "read")
    try:
        fd = os.open(path, flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC, 0o644)
    except OSError as exc:
        found = _lstat_mode(path)
        if found is not None and not stat.S_ISREG(found):
            raise refusal(path, describe(found), verb) from None
        raise exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise refusal(path, describe(info.st_mode), verb)
        if writing and info.st_nlink > 1:
            raise refusal(path, f"a file with {info.st_nlink - 1} other hard link(s)", verb)
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_or_create(path: str | os.PathLike, flags: int = os.O_RDWR, *, verb: str = "write", mode: int = 0o644) -> int:
    """Create `path` exclusively, or open the regular file already there (as `open_regular` does).

    For files several processes share under one name, such as the destination lock.
    """
    path = Path(path)
    while True:
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
        except FileExistsError:
            pass
        try:
            return open_regular(path, flags, verb=verb)
        except FileNotFoundError:  # removed between the two opens: create it
            continue


def read_regular(path: str | os.PathLike) -> bytes:
    """The whole content of a regular file at `path` (opened as `open_regular` does)."""
    fd = open_regular(path)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make the renames and unlinks in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_into(temp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename `temp` over `final`: the entry at `final` (file, symlink, FIFO) is replaced, never followed.

    A directory at `final` is refused with `UnsafeFileError` instead of the kernel's bare error.
    """
    try:
        os.replace(temp, final)
    except OSError as exc:
        found = _lstat_mode(Path(final))
        if found is not None and stat.S_ISDIR(found):
            raise refusal(final, "a directory") from None
        raise exc


DEFAULT_NAME_MAX = 255  # bytes in one file name on Linux's and macOS's usual file systems
_HASHED_PREFIX_BYTES = 64  # how much of a too-long name its hashed temporary name keeps, for people reading the folder


def name_max(folder: str | os.PathLike | None) -> int:
    """The longest file name (in bytes) the file system of `folder` accepts; folders not made yet are asked
    through their nearest existing parent, and 255 is assumed when nothing can be asked."""
    if folder is None:
        return DEFAULT_NAME_MAX
    path = Path(folder)
    for candidate in (path, *path.parents):
        try:
            return int(os.pathconf(candidate, "PC_NAME_MAX"))
        except (FileNotFoundError, NotADirectoryError):
            continue
        except (OSError, ValueError):
            break
    return DEFAULT_NAME_MAX


def temp_name(name: str, folder: str | os.PathLike | None = None) -> str:
    """The temporary name under which the file `name` (in `folder`) is written before its rename.

    `<name>.partial` when it fits the file system's name limit; else the start of `name`, a digest of the
    whole name and `.partial` (`<start>.<16 hex>.partial`), which fits whenever `name` itself does. Either way
    the name depends on `name` alone (and the file system), so a resumed run finds a crashed run's
    temporaries, and every temporary ends in `.partial`.
    """
    plain = name + PARTIAL_SUFFIX
    raw = name.encode("utf-8", "surrogateescape")
    limit = name_max(folder)
    if len(raw) + len(PARTIAL_SUFFIX) <= limit:
        return plain
    tail = f".{hashlib.sha256(raw).hexdigest()[:16]}{PARTIAL_SUFFIX}"
    keep = max(0, min(_HASHED_PREFIX_BYTES, limit - len(tail)))
    return raw[:keep].decode("utf-8", "ignore") + tail


def temp_path(final: str | os.PathLike) -> Path:
    """The temporary path a file is written under before it is renamed to `final` (see `temp_name`)."""
    final = Path(final)
    return final.with_name(temp_name(final.name, final.parent))


class AtomicWriter:
    """Writes `path` through its temporary name (`temp_path`, `<path>.partial`): exclusive create, write, fsync, rename, folder fsync.

    Use as a context manager (`with AtomicWriter(p) as w: w.write(b"...")`): leaving normally commits,
    leaving with an exception removes the temporary file. `fd` is the raw descriptor for positional
    writes; `flags` may ask for `os.O_RDWR` when the writer reads its own bytes back.
    """

    def __init__(self, path: str | os.PathLike, *, flags: int = os.O_WRONLY, mode: int = 0o644, sync_dir: bool = True) -> None:
        self.path = Path(path)
        self.temp = temp_path(self.path)
        self.sync_dir = sync_dir
        self.fd: int | None = claim_temp(self.temp, flags=flags, mode=mode)

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append `data` (all of it); returns its length."""
        assert self.fd is not None, "the writer is closed"
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            view = view[os.write(self.fd, view):]
        return total

    def commit(self, *, sync_dir: bool | None = None) -> Path:
        """fsync the temporary file, rename it to the final name, fsync the folder; returns the final path."""
        assert self.fd is not None, "the writer is closed"
        try:
            os.fsync(self.fd)
        except BaseException:
            self.abort()
            raise
        os.close(self.fd)
        self.fd = None
        try:
            replace_into(self.temp, self.path)
        except BaseException:
            self.abort()
            raise
        if self.sync_dir if sync_dir is None else sync_dir:
            fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        """Close and remove the temporary file (nothing appears under the final name)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            os.unlink(self.temp)
        except FileNotFoundError:
            pass

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self.fd is not None:
            self.commit()


def atomic_write(path: str | os.PathLike, data: bytes | str | Iterable[bytes], *, sync_dir: bool = True) -> Path:
    """Write `data` (bytes, UTF-8 text, or an iterable of byte chunks) to `path` durably and atomically.

    Readers see the old file (or none) or the whole new one, never a part; nothing planted at `path`
    or at its temporary name is followed.
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    with AtomicWriter(path, sync_dir=sync_dir) as writer:
        for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
            writer.write(chunk)
    return Path(path)


def copy_atomic(source: str | os.PathLike, dest: str | os.PathLike, *, sync_dir: bool = True) -> Path:
    """Copy the regular file `source` to `dest` atomically (kernel copy where possible).

    `source` may be a symlink the caller has vetted, but must lead to a regular file: a FIFO or a folder
    is refused rather than read.
    """
    src = os.open(source, os.O_RDONLY | _NONBLOCK | _CLOEXEC)
    try:
        info = os.fstat(src)
        if not stat.S_ISREG(info.st_mode):
            raise refusal(source, describe(info.st_mode), "copy")
        with AtomicWriter(dest, sync_dir=sync_dir) as writer:
            assert writer.fd is not None
            kernel_copy = getattr(os, "copy_file_range", None)
            while True:
                try:
                    if kernel_copy is None:
                        raise OSError("no copy_file_range")
                    n = kernel_copy(src, writer.fd, 64 << 20)
                except OSError:  # no kernel copy between these file systems: read and write
                    kernel_copy = None
                    chunk = os.read(src, 1 << 20)
                    n = writer.write(chunk) if chunk else 0
                if n == 0:
                    break
    finally:
        os.close(src)
    return Path(dest)
