"""The `workbench` command: inspect, plan, convert, diff, verify."""

from .commands import main

__all__ = ["main"]
