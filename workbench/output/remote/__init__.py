"""Remote destinations (`s3://`, `hf://`): the registry by URL scheme, and the refusal of other schemes.

`open_destination(url, fingerprint, options)` builds the destination object for a URL; `is_url(text)` says
whether a destination names a scheme at all. Each scheme's class lives in its own module, imported on first
use (boto/s3fs and huggingface_hub are optional).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ...errors import PlanError
from .base import FinishedFile, RemoteDestination, RemoteState

__all__ = ["FinishedFile", "RemoteDestination", "RemoteState", "SCHEMES", "is_url", "open_destination"]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

# scheme -> "module:Class" under workbench.output.remote
SCHEMES: dict[str, str] = {
    "s3://": "s3:S3Destination",
    "hf://": "hub:HubDestination",
}


def is_url(text: object) -> bool:
    """True when `text` names a scheme (`s3://`, `hf://`, `https://` ...), i.e. is not a local path."""
    return isinstance(text, str) and bool(_URL.match(text))


def supported(url: str) -> bool:
    """True when the workbench can write to `url`'s scheme."""
    return any(url.startswith(scheme) for scheme in SCHEMES)


def open_destination(url: str, fingerprint: str, options: Mapping[str, Any] | None = None) -> RemoteDestination:
    """The destination object for `url`; a PlanError for a scheme the workbench cannot write to."""
    import importlib

    for scheme, target in SCHEMES.items():
        if url.startswith(scheme):
            module, _, name = target.partition(":")
            try:
                cls = getattr(importlib.import_module(f"{__name__}.{module}"), name)
            except ImportError as exc:
                if (exc.name or "").startswith("workbench."):  # the scheme's own module is not part of this version
                    raise PlanError(f"Cannot write to {url}: {scheme} destinations are not available in this version of "
                                    "the workbench. Convert into a local folder, then upload it.", file=url) from None
                raise PlanError(f"Cannot write to {url}: {exc.name or exc} is not installed. Install the remote extra: "
                                "pip install 'checkpoint-workbench[remote]'.", file=url) from None
            return cls(url, fingerprint, options)
    raise PlanError(
        f"Cannot write to {url}: the workbench writes to local folders, s3://bucket/prefix/ and hf://org/repo, not to "
        f"{url.split('://', 1)[0]}:// URLs. Convert into a local folder, then upload it with that store's own tool.",
        file=url,
    )
