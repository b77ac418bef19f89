"""What every peer script shares: argument parsing and the JSON result it hands back to run.py.

A peer is run in a fresh interpreter so its start-up and peak RSS are its own. It reports, besides its
own numbers, which heavy libraries it ended up importing: run.py measures an interpreter that imports
just those, to tell the working set apart from the libraries' fixed cost.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HEAVY_MODULES = ("torch", "transformers", "safetensors", "numpy", "pandas", "d9d", "pydantic", "workbench")


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the arguments every peer takes: SRC, DST and --result."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("source", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--result", type=Path, required=True, help="where to write this run's JSON result")
    return p


def imported_heavy_modules() -> list[str]:
    """The heavy top-level libraries this process has imported so far."""
    return [name for name in HEAVY_MODULES if name in sys.modules]


def versions(*distributions: str) -> str:
    """'name version' of each installed distribution, for the notes ('name ?' when unknown)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in distributions:
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} ?")
    return ", ".join(out)


def write_result(path: Path, **fields: Any) -> None:
    """Write the JSON result run.py reads: the given fields (e.g. `work_s`) plus the imported libraries."""
    fields.setdefault("modules", imported_heavy_modules())
    path.write_text(json.dumps(fields, indent=1, default=str))
