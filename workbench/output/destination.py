"""Where a conversion may write: a local folder. A URL is refused before anything is planned.

`Path("s3://bucket/prefix/")` is the relative path `s3:/bucket/prefix`, so without this check a remote
destination became a local folder literally named `s3:` and the run "succeeded". Until remote outputs
exist, every destination that names a scheme (`s3://`, `hf://`, `http(s)://`, `gs://`, `file://` ...) is
refused, naming the URL and how to get the files there.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import PlanError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def local_destination(dest: str | os.PathLike) -> Path:
    """`dest` as an absolute local path; a PlanError when it is a URL."""
    text = os.fspath(dest)
    if isinstance(text, str) and _URL.match(text):
        raise PlanError(
            f"Cannot write to {text}: it is a URL, and the workbench writes only to a local folder (remote "
            "destinations such as s3://, hf:// and http(s):// are not supported yet). Convert into a local folder, "
            "then upload it (e.g. `aws s3 sync OUT/ s3://bucket/prefix/`, or `hf upload org/repo OUT/`).",
            file=text,
        )
    return Path(os.path.abspath(text))
