"""Where a checkpoint folder's symbolic links may lead.

An index, a shard name or an extra is untrusted: a link inside the folder must not make the workbench
read (or copy into an output) a file elsewhere on the machine. The one layout whose links legitimately
leave the folder is the Hugging Face cache, which `snapshot_download`, `hf download` and
`from_pretrained` fill: `models--org--name/snapshots/<commit>/` holds only links into the repo's
`blobs/` folder next to it. Those links are accepted, and only those.
"""

from __future__ import annotations

import os

_HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


def link_roots(folder: str | os.PathLike) -> tuple[str, ...]:
    """The real folders links in `folder` may lead into: the folder itself, plus the repo's `blobs/`
    folder when `folder` is a Hugging Face cache snapshot (and `blobs/` is a real folder, not a link)."""
    real = os.path.realpath(folder)
    roots = [real]
    snapshots = os.path.dirname(real)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith(_HUB_REPO_PREFIXES):
        blobs = os.path.join(repo, "blobs")
        if os.path.isdir(blobs) and not os.path.islink(blobs):
            roots.append(blobs)
    return tuple(roots)


def leads_inside(folder: str | os.PathLike, path: str | os.PathLike) -> bool:
    """True when `path` (after following every link) is inside `folder`, or inside a Hub cache snapshot's
    `blobs/` folder (see `link_roots`)."""
    real = os.path.realpath(path)
    return any(os.path.commonpath([root, real]) == root for root in link_roots(folder))
