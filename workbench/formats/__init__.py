"""On-disk layouts. Each module detects its layout, lists tensors from headers, and reads byte ranges.

`open_catalog(path)` picks the first format whose `detect` accepts the path. Formats added later
(DCP, torch.save zips, atorch) register in `FORMATS`.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from pathlib import Path

from ..catalog import Catalog
from ..errors import CheckpointError
from ..names import is_unicode_text
from . import remote, safetensors_folder
from .safetensors import looks_like_safetensors

# (name, detect, open) in priority order.
FORMATS: list[tuple[str, Callable[[Path], bool], Callable[[Path], Catalog]]] = [
    ("safetensors", safetensors_folder.detect, safetensors_folder.open_path),
]


# Format name -> the keyword options its opener takes (e.g. which weights of a DeepSpeed run to list).
OPTIONS: dict[str, tuple[str, ...]] = {}


def register(name: str, detect: Callable[[Path], bool], open_: Callable[..., Catalog], *, first: bool = False,
             options: tuple[str, ...] = ()) -> None:
    """Add a format; `first=True` puts it ahead of the others (for more specific layouts). `options` names
    the keyword arguments `open_` accepts beyond the path."""
    entry = (name, detect, open_)
    if first:
        FORMATS.insert(0, entry)
    else:
        FORMATS.append(entry)
    OPTIONS[name] = tuple(options)


def _refuse_options(where: object, options: dict, name: str) -> None:
    unknown = sorted(set(options) - set(OPTIONS.get(name, ())))
    if unknown:
        takes = ", ".join(OPTIONS.get(name, ())) or "none"
        raise CheckpointError(f"Cannot open {where} with {', '.join(unknown)}: it is a {name} checkpoint, whose options "
                              f"are: {takes}. Drop the others.", file=str(where))


def open_catalog(path: str | os.PathLike, **options: object) -> Catalog:
    """Open any supported checkpoint (file, folder, or URL: hf://, http(s)://, s3://) from its headers alone.

    `options` go to the format's opener (e.g. `weights="module", moments=True` for a DeepSpeed run) and are
    recorded on the catalog, so that workers on other processes open the same selection."""
    catalog = _valid_names(_open_catalog(path, **options))
    if not options and not remote.is_remote(path) and os.path.isdir(path):
        from .recent import remember

        remember(Path(path), catalog)
    return catalog


def _valid_names(catalog: Catalog) -> Catalog:
    """Refuse a catalog with a tensor name that is not Unicode text: a lone UTF-16 surrogate, which a JSON escape
    (`\\ud800`) or a pickle's string can carry, and which no output header, file name or terminal can hold."""
    for name, info in catalog.tensors.items():
        if not is_unicode_text(name):
            where = f" ({info.file})" if info.file else ""
            raise CheckpointError(
                f"Cannot read {catalog.location}{where}: the tensor name {name!r} holds a lone UTF-16 surrogate (an unpaired "
                "\\ud800-\\udfff), which is not a Unicode character. The file is corrupt or crafted: re-export it with valid names.",
                file=str(catalog.location), tensor=None)
    return catalog


def _open_catalog(path: str | os.PathLike, **options: object) -> Catalog:
    if remote.is_remote(path):
        _refuse_options(path, options, "remote")
        from .remote_safetensors import open_url

        return open_url(str(path))
    p = Path(path)
    if not p.exists():
        hub = " (for a Hub repo, write hf://" + str(path) + ")" if isinstance(path, str) and remote._REPO_ID.match(path.split("@", 1)[0]) else ""
        raise CheckpointError(f"Cannot open checkpoint {p}: no such file or folder. Check the path{hub}.", file=str(p))
    for name, detect, open_ in FORMATS:
        if detect(p):
            if not options:
                return open_(p)
            _refuse_options(p, options, name)
            catalog = open_(p, **options)
            catalog.open_options = dict(options)
            return catalog
    if p.is_file() and looks_like_safetensors(p):
        _refuse_options(p, options, "safetensors")
        return safetensors_folder.open_file(p)
    kind = "folder" if p.is_dir() else "file"
    raise CheckpointError(
        f"Cannot open checkpoint {p}: this {kind} is not in a format the workbench knows "
        f"(tried: {', '.join(n for n, _, _ in FORMATS)}). Point at a .safetensors file, an HF model folder, "
        "or a supported training checkpoint.",
        file=str(p),
    )


# Training-checkpoint layouts: folders recognised by their marker files go first, torch.save files last. Their
# readers are imported on first use: a path is offered to a reader only when the names it holds could be that
# layout's (`_MARKERS`), so opening a safetensors folder imports none of them (8-15 ms of CPU of every command).
_MARKERS: dict[str, Callable[[Path, list[str]], bool]] = {
    # Each test is a necessary condition of the reader's own `detect`: it may say yes wrongly, never no wrongly.
    "dcp": lambda p, names: p.name == ".metadata" if not names else ".metadata" in names or any(_PP_STAGE.match(n) for n in names),
    "deepspeed": lambda p, names: "latest" in names or any(n.endswith("_optim_states.pt") for n in names),
    "megatron": lambda p, names: (".metadata" in names or "latest_checkpointed_iteration.txt" in names
                                  or any(n.startswith("mp_rank_") for n in names)),
    "atorch": lambda p, names: any(n.startswith("flat_meta.") for n in names),
    "meta_pth": lambda p, names: "params.json" in names,
    "torch_folder": lambda p, names: any(n.endswith((".bin.index.json", ".pt.index.json", ".pth.index.json")) for n in names),
    "torch_zip": lambda p, names: not names and p.is_file(),
    "gguf": lambda p, names: p.suffix == ".gguf" if not names else any(n.endswith(".gguf") for n in names),
}
_PP_STAGE = re.compile(r"^pp\d+$")


def _names(path: Path) -> list[str]:
    """A folder's entry names; [] for a file or an unreadable folder (whose own tests then decide)."""
    try:
        return os.listdir(path) if path.is_dir() else []
    except OSError:
        return []


class _Lazy:
    """`detect` and `open_path` of a reader module imported on first need (see `_MARKERS`)."""

    def __init__(self, module: str) -> None:
        self.module = module

    def _reader(self):  # noqa: ANN202 - a module
        return importlib.import_module(f"{__name__}.{self.module}")

    def detect(self, path: Path) -> bool:
        names = _names(path)
        # An empty (or unreadable) folder goes to the reader, which says what it makes of it.
        if (names or not path.is_dir()) and not _MARKERS[self.module](path, names):
            return False
        return self._reader().detect(path)

    def open_path(self, path: Path, **options: object) -> Catalog:
        return self._reader().open_path(path, **options)


def _register_lazy(name: str, module: str, *, first: bool = False, options: tuple[str, ...] = ()) -> None:
    lazy = _Lazy(module)
    register(name, lazy.detect, lazy.open_path, first=first, options=options)


_register_lazy("dcp", "dcp", first=True)
_register_lazy("deepspeed", "deepspeed", first=True, options=("weights", "moments"))
_register_lazy("megatron", "megatron", first=True, options=("optimizer",))
_register_lazy("atorch-flat", "atorch", first=True)
_register_lazy("meta-pth", "meta_pth", first=True)
_register_lazy("torch-sharded", "torch_folder")
_register_lazy("torch", "torch_zip")
_register_lazy("gguf", "gguf")
