"""The types public entry points take, named once so signatures say what they accept.

    wb.convert("ckpt/", "out/", mapper, rest="drop", to="dcp", launcher="local", on_overflow="error")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal, Protocol

from .catalog import Catalog


class HasCatalog(Protocol):
    """Anything that carries a catalog, such as an opened `Checkpoint`."""

    catalog: Catalog


CheckpointLike = str | os.PathLike | Catalog | HasCatalog | Mapping[str, str | os.PathLike]
"""A checkpoint file, folder or URL, an opened `Checkpoint`, a `Catalog`, or several named sources
(`{"base": "llama/", "adapter": "lora/"}`)."""

Rest = Literal["keep", "drop", "error"]
"""What happens to source tensors no operation mentions: passed through, left out, or refused."""

Launcher = Literal["auto", "torchrun", "local"]
"""How `nproc > 1` workers start on this machine: "auto" (the default: the local launcher), "local" (the
workbench's own, no torch import) or "torchrun" (torchrun's agent). Multi-node runs go under the user's torchrun."""

OnOverflow = Literal["warn", "error"]
"""What a cast does with values its dtype cannot hold: count and report them, or fail before the index."""

OutputName = str
"""A format registered in `workbench.output.OUTPUT_FORMATS`: "safetensors" (alias "hf") or "dcp"."""

__all__ = ["CheckpointLike", "HasCatalog", "Launcher", "OnOverflow", "OutputName", "Rest"]
