"""MkDocs hook for the documentation site: the CLI page shows the `workbench` command's own `--help` texts.

`docs/cli.md` holds the marker `<!-- workbench-help -->`; the hook replaces it with the help of the command and
of each subcommand, produced by this checkout's parser at build time, so the page cannot drift from the CLI.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

# The checkout this site documents, ahead of any installed copy (the `mkdocs` script does not put it on sys.path).
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARKER = "<!-- workbench-help -->"


def command_help(args: list[str]) -> str:
    """What `workbench ARGS --help` prints, 100 columns wide."""
    from workbench.cli import main

    out = io.StringIO()
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*args, "--help"])
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    return out.getvalue().rstrip()


def subcommands() -> list[str]:
    """The subcommands, in the order the top-level help lists them."""
    from workbench.cli.commands import SUBCOMMANDS

    return [sub.name for sub in SUBCOMMANDS]


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Replace the marker with one fenced help text per command."""
    if MARKER not in markdown:
        return markdown
    parts = ["## `workbench`", "", "```text", command_help([]), "```"]
    for name in subcommands():
        parts += ["", f"## `workbench {name}`", "", "```text", command_help([name]), "```"]
    return markdown.replace(MARKER, "\n".join(parts))
