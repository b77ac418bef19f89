"""Where a conversion may write: a local folder, or a remote destination (`s3://`, `hf://`; `output/remote/`).

`Path("s3://bucket/prefix/")` is the relative path `s3:/bucket/prefix`, so without this check a remote
destination became a local folder literally named `s3:` and the run "succeeded". A destination that names a
scheme is either one `output/remote` writes to, or refused here, naming the URL and how to get the files there.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import PlanError
from .remote import SCHEMES, is_url, supported


def remote_url(dest: str | os.PathLike) -> str | None:
    """`dest` when it is a URL the workbench writes to (`s3://`, `hf://`); None for a local path; a PlanError for
    any other URL."""
    text = os.fspath(dest)
    if not is_url(text):
        return None
    assert isinstance(text, str)
    if supported(text):
        return text
    kinds = ", ".join(SCHEMES)
    raise PlanError(
        f"Cannot write to {text}: the workbench writes to local folders and to {kinds} destinations, not to "
        f"{text.split('://', 1)[0]}:// URLs. Convert into a local folder, then upload it with that store's own tool.",
        file=text,
    )


def local_destination(dest: str | os.PathLike) -> Path:
    """`dest` as an absolute local path; a PlanError when it is a URL (remote destinations go through `remote_url`)."""
    text = os.fspath(dest)
    if is_url(text):
        remote_url(text)  # an unsupported scheme: its own message
        raise PlanError(f"Cannot use {text} as a local folder: it is a remote destination. Pass it as the conversion's "
                        "destination (wb.convert / workbench convert), which uploads through a local spool.", file=str(text))
    return Path(os.path.abspath(text))
