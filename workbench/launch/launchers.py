"""The names of the ways to start workers, checked before anything starts (kept apart from `launcher`, whose process
handling a one-process conversion never imports)."""

from __future__ import annotations

from ..errors import PlanError

LAUNCHERS = ("auto", "torchrun", "local")


def check_launcher(launcher: str) -> str:
    """`launcher` when it names a known way to start workers; a PlanError otherwise."""
    if launcher not in LAUNCHERS:
        raise PlanError(f"Cannot start workers: unknown launcher {launcher!r}. Use 'auto' (the default: the local "
                        "launcher), 'local' (one machine, without torchrun's start-up) or 'torchrun'.")
    return launcher


__all__ = ["LAUNCHERS", "check_launcher"]
