"""Old module paths of the re-shelved package, kept importable for one release.

Notebooks written against 0.1 import e.g. `workbench.formats.safetensors_writer`; importing an old
path now gives the module at its new home (the same module object) and a `DeprecationWarning`
naming that home. Remove in the next release.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    "workbench.view": "workbench.explore.checkpoint",
    "workbench.stats": "workbench.explore.stats",
    "workbench.diffing": "workbench.explore.diff",
    "workbench.plots": "workbench.explore.plots",
    "workbench.verify": "workbench.explore.verify",
    "workbench.checksums": "workbench.explore.checksums",
    "workbench.layers": "workbench.explore.layers",
    "workbench.lightning_extract": "workbench.training.extract",
    "workbench.formats.lightning": "workbench.training.lightning",
    "workbench.cli_convert": "workbench.cli.convert",
    "workbench.planning.sizes": "workbench.display",
    "workbench.planning.text": "workbench.display",
    "workbench.formats.safetensors_writer": "workbench.output.safetensors",
    "workbench.formats.dcp_writer": "workbench.output.dcp",
    "workbench.engine.lock": "workbench.output.lock",
    "workbench.formats.restricted_pickle": "workbench.formats.pickle.unpickler",
    "workbench.formats.pickle_bounds": "workbench.formats.pickle.bounds",
    "workbench.engine.conversion": "workbench.conversion",
    "workbench.engine.launcher": "workbench.launch.launcher",
    "workbench.engine.local_run": "workbench.launch.local_run",
    "workbench.engine.worker": "workbench.launch.worker",
    "workbench.engine.job": "workbench.launch.job",
    "workbench.engine.inplace": "workbench.launch.inplace",
    "workbench.mapper.templates": "workbench.names",
}


class _AliasLoader:  # the import system's loader protocol (importlib.abc is not imported: it costs ~10 ms)
    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new_name}; import it from there (the old path goes away in the next release).",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new_name)

    def exec_module(self, module: ModuleType) -> None:
        """The module is the new one, already executed."""


class _MovedFinder:  # the meta path finder protocol
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new_name = MOVED.get(fullname)
        if new_name is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new_name))


def install() -> None:
    """Make the old paths importable (idempotent)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
