"""The `workbench` command: inspect, plan, convert, diff, verify."""

from .commands import main
from .fast_exit import exit_now


def entry() -> None:
    """The `workbench` console script: `main()`, then leave without the interpreter's tear-down where safe."""
    exit_now(main())


__all__ = ["entry", "main"]
