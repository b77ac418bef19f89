"""Progress of a load or save on one rank: the engine's `Progress`, with a bar named for what it does."""

from __future__ import annotations

from ..engine.progress import Progress, ProgressCallback, make_bar


def rank_progress(total: int, *, rank: int, quiet: bool, callback: ProgressCallback | None, desc: str) -> Progress:
    """A progress sink counting `total` bytes; the bar shows on rank 0 only, the callback on every rank."""
    progress = Progress(total, rank=rank, bar=False, callback=callback)
    if not quiet and rank == 0:
        progress._bar = make_bar(total, desc=desc)
    return progress
