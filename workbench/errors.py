"""Error types: every failure a user can cause surfaces as a `WorkbenchError` with a one-paragraph message.

Messages follow the pattern "Cannot <do X>: <cause> (<value>). <Fix>." and name the file and the tensor
when there is one, so a user can act on them without reading a traceback.
"""

from __future__ import annotations


class WorkbenchError(Exception):
    """Base of every error this package raises on purpose (bad input, bad mapper, bad plan)."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.file = file
        self.tensor = tensor

    def __str__(self) -> str:
        return self.message


class CheckpointError(WorkbenchError):
    """A checkpoint on disk is malformed, incomplete, unsafe or unsupported."""


class CannotRead:
    """The error every reader raises when a checkpoint cannot be read, worded one way for all formats:
    "Cannot read <kind> <source> (<entry> '<name>'): <cause>. <fix>".

    A reader makes one at import, with its kind of file and the fix that fits most of its failures,
    and raises what calling it returns: `raise _fail(path, "the header is not valid UTF-8")`.
    """

    __slots__ = ("kind", "fix", "entry")

    def __init__(self, kind: str, fix: str, *, entry: str = "tensor") -> None:
        self.kind = kind
        self.fix = fix
        self.entry = entry

    def __call__(self, source: object, cause: str, tensor: str | None = None, fix: str = "") -> CheckpointError:
        """The error for `source` (and `tensor`, when one entry is at fault); `fix` replaces the default."""
        where = f" ({self.entry} {tensor!r})" if tensor else ""
        return CheckpointError(f"Cannot read {self.kind} {source}{where}: {cause}. {fix or self.fix}", file=str(source), tensor=tensor)


class MapperError(WorkbenchError):
    """A mapper cannot be built, bound to a source or applied."""


class PlanError(WorkbenchError):
    """A conversion cannot be planned or executed as asked."""


class UnsafeFileError(WorkbenchError):
    """A name the workbench writes (or reads back) holds a symlink, FIFO, directory or hard link: refused.

    `what` says what was found there ("a symlink", "a FIFO" ...).
    """

    def __init__(self, message: str, *, file: str | None = None, what: str = "") -> None:
        super().__init__(message, file=file)
        self.what = what


class CastOverflowError(PlanError):
    """A cast met values its target dtype cannot hold (they would become ±inf, saturate or wrap) and the
    run was asked to fail on that (`on_overflow="error"`, `--on-overflow error`)."""


class CastOverflowWarning(UserWarning):
    """A finished conversion cast values its target dtype cannot hold (`report.overflow` lists them)."""
