"""What the `workbench` command prints is safe for a terminal, whatever the checkpoint's names hold.

Tensor names, file names, metadata and config values come from untrusted files. Printed raw, a name such
as ``"\\x1b[2J\\x1b[31m..."`` clears the screen or rewrites what the user reads, and a lone surrogate
stops the output with an encoding error. One rule covers every CLI output: a character that is not
printable (what `str.isprintable` says: control characters, escapes, bidi overrides, surrogates ...)
is written as `repr` writes it (``\\x1b``, ``\\u202e``), except the layout characters the output itself
uses (newline and tab; carriage return on stderr, where the progress bar redraws its line).

`escape` applies the rule to one piece of text (names in tables, so columns line up on the escaped
text); `guarded_output` installs it on stdout and stderr for the whole command, so plans, reports,
warnings and error messages that quote names from a file are covered without each one knowing.
JSON output is unchanged by it: `json.dumps` already escapes every such character.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, TextIO


def _escaped(char: str) -> str:
    return repr(char)[1:-1] if char != "\\" else char


def escape(text: object, keep: str = "") -> str:
    """`text` as a string with every non-printable character except those in `keep` escaped as `repr` does."""
    text = text if isinstance(text, str) else str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else _escaped(c) for c in text)


class EscapingStream:
    """A text stream that escapes what `escape` escapes before writing to the stream it wraps.

    Everything else (fileno, isatty, encoding, flush ...) is the wrapped stream's, so the progress bar,
    `| head` handling and pytest's capture work through it unchanged.
    """

    def __init__(self, stream: TextIO, keep: str) -> None:
        self.stream = stream
        self.keep = keep

    def write(self, text: str) -> int:
        self.stream.write(escape(text, self.keep))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def guarded_output() -> Iterator[None]:
    """For the duration of a command, sys.stdout and sys.stderr escape non-printable characters."""
    saved = sys.stdout, sys.stderr
    sys.stdout = EscapingStream(sys.stdout, "\n\t")  # type: ignore[assignment]
    sys.stderr = EscapingStream(sys.stderr, "\n\t\r")  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
