"""Pausing Python's cyclic garbage collector while a plan builds its many small objects (see
`workbench.collector`: the same pause the header parser uses)."""

from __future__ import annotations

from ..collector import gc_paused

__all__ = ["gc_paused"]
