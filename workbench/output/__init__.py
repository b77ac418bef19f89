"""WRITE: the output formats a conversion can produce, and the destination lock.

Each format is an `OutputFormat` (see `base.py`) registered here under the names users pass as
`to=` / `--to`; the planner lays files out through it and the engine fills and commits them through
it. Adding a format is one module defining a subclass, plus one `register` call below.
"""

from __future__ import annotations

from ..errors import PlanError
from .base import OutputFormat
from .dcp import DcpOutput
from .gguf import GgufOutput
from .pth import PthOutput
from .safetensors import SafetensorsOutput

OUTPUT_FORMATS: dict[str, OutputFormat] = {}
_ALIASES: dict[str, str] = {}


def register(output: OutputFormat, *aliases: str) -> None:
    """Make `output` available as `to=output.name` (and any alias)."""
    OUTPUT_FORMATS[output.name] = output
    for alias in aliases:
        _ALIASES[alias] = output.name


def output_format(name: str) -> OutputFormat:
    """The registered format called `name` (case-insensitive, aliases allowed); PlanError for anything else."""
    key = name.lower() if isinstance(name, str) else name
    key = _ALIASES.get(key, key)
    if key not in OUTPUT_FORMATS:
        choices = ", ".join(f"to={n!r}" for n in sorted({*OUTPUT_FORMATS, *_ALIASES}))
        raise PlanError(f"Cannot plan an output in format {name!r}: it is not an output format the workbench writes. "
                        f"Choose {choices}.")
    return OUTPUT_FORMATS[key]


register(SafetensorsOutput(), "hf")
register(DcpOutput())
register(GgufOutput())
register(PthOutput())

__all__ = ["OUTPUT_FORMATS", "OutputFormat", "output_format", "register"]
