"""Pausing Python's cyclic garbage collector while a plan builds its many small objects.

Planning a checkpoint of 100k tensors creates about a million small objects (tensor infos, groups,
steps, layout entries) that all stay alive. Each automatic collection meanwhile walks every object
still young, so with the collector running, planning took ~40 % longer (measured on 100k tensors).
Nothing the planner makes is garbage until the plan is dropped, so pausing loses nothing.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable automatic garbage collection inside the block (nested use is fine); restore it after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
