"""Which non-tensor files travel with a conversion, and what happens to each.

Top-level extras (config.json, tokenizer files ...) are chosen by the source's format. Subfolders
that hold no tensors (a sentence-transformers `1_Pooling/`, a tokenizer folder) are copied whole,
with the same rules as top-level extras: a file or folder linked outside the source folder is never
read, only regular files are copied, per-checkpoint records (checksums) stay behind, and their bytes
count towards the free-space check. A subfolder holding tensors belongs to another model (diffusers'
`unet/`, a sentence-transformers `2_Dense/`) and is skipped; so are hidden folders (`.git`, the hub's
`.cache`), whose contents describe the source files. Every extra, copied or skipped, is listed with
the reason, so an output never looks complete while something was left behind silently.
One extra can be generated rather than copied: the config.json a Meta folder lacks, built from its params.json when
the mapper writes HF names (`with_generated_config`); the plan carries its text and the extras step writes it.

Files that hold weights are never extras, whatever format chose them: copied beside a converted output,
a `pytorch_model.bin` (or `tf_model.h5`, `model.gguf` ...) would be a second, stale copy of the model that
loaders may pick instead of the output (after a cast to bf16, an fp32 `.bin`). The rule (`weight_kind`):
a file holds weights when its name ends with a weight-file suffix (`formats.weight_files.WEIGHT_SUFFIXES`, or an
index of such files, `*.index.json`), or when its first bytes carry the signature of a weight container (GGUF,
HDF5, NumPy, a zip archive as `torch.save` writes, a pickle, a safetensors header) whatever its name.
Such a file at the top level is listed as skipped with the format it holds; in a subfolder it makes the
subfolder another model's (skipped whole).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..formats.links import leads_inside
from ..formats.safetensors_folder import CHECKSUMS_NAME, NOT_EXTRAS
from ..formats.weight_files import INDEX_SUFFIX, WEIGHT_SUFFIXES, names_weights
from .config_dtype import CONFIG_NAME, CONFIG_NAMES, KEEP, config_dtype_update, config_dtypes, read_config
from .config_edit import edit_config

COPIED = "copy"
UPDATED = "update"  # copied with changes (config.json dtype after a cast)
GENERATED = "generate"  # written from what the plan states (config.json built from a Meta folder's params.json)
SKIPPED = "skip"
SIGNATURES = (  # leading bytes -> what a file that starts with them holds
    (b"GGUF", "GGUF weights"),
    (b"\x89HDF\r\n\x1a\n", "HDF5 (TensorFlow/Keras) weights"),
    (b"\x93NUMPY", "a NumPy array"),
    (b"PK\x03\x04", "a zip archive (torch.save weights)"),
    (b"\x80\x02", "a pickle (torch.save weights)"), (b"\x80\x03", "a pickle (torch.save weights)"),
    (b"\x80\x04", "a pickle (torch.save weights)"), (b"\x80\x05", "a pickle (torch.save weights)"),
)
SNIFF_BYTES = 16
MAX_FILES = 10_000  # over all subfolders: a plan reads metadata only, never a whole tree
MAX_DEPTH = 16


@dataclass(frozen=True)
class Extra:
    """One non-tensor file or folder beside the weights: its path ('/'-separated, relative to the source
    root; an empty folder ends with '/'), what the conversion does with it, its size in bytes, and why
    (for skips and updates)."""

    path: str
    action: str
    size: int = 0
    reason: str = ""
    config: str = ""  # config.json only: the mapper's changes (JSON of quantized.config_changes), applied on update;
    # for a generated extra, the whole text written

    @property
    def written(self) -> bool:
        """True when the conversion writes this file into the destination."""
        return self.action in (COPIED, UPDATED, GENERATED)


def _inside(real_root: str, path: str) -> bool:
    return leads_inside(real_root, path)


def _kind_by_name(name: str) -> str | None:
    lower = name.lower()
    if lower.endswith(INDEX_SUFFIX):
        return "an index of weight files"
    return next((what for suffix, what in WEIGHT_SUFFIXES.items() if lower.endswith(suffix)), None)


def _kind_by_content(path: str) -> str | None:
    """What the first bytes of the regular file at `path` say it holds, or None (text, JSON, protobuf ...).
    Opened without blocking (never waits on a FIFO) and only when it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.read(fd, SNIFF_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    for signature, what in SIGNATURES:
        if head.startswith(signature):
            return what
    if len(head) >= 10 and head[8:10] == b'{"' and int.from_bytes(head[:8], "little") < 1 << 40:
        return "safetensors weights"
    return None


def weight_kind(name: str, path: str | None = None) -> str | None:
    """What weights the file `name` holds (by its name, else by its first bytes when `path` is given), or
    None when it holds none: such a file is never copied along as an extra."""
    return _kind_by_name(name) or (_kind_by_content(path) if path is not None else None)


def _weights_reason(what: str, chosen: bool) -> str:
    why = (f"holds {what}, which this conversion does not convert: copied beside the output it would be stale (a "
           "second copy of the model, or state made for the source's weights) and loaders may pick it instead")
    return why if chosen else why + " (it is not part of the source)"


def _source_record(name: str) -> bool:
    return name in NOT_EXTRAS or name.endswith("." + CHECKSUMS_NAME)


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


class _Budget:
    def __init__(self) -> None:
        self.files = 0


class _TooBig(Exception):
    pass


def _walk(real_root: str, folder: str, rel: str, ancestors: frozenset[str], depth: int, budget: _Budget,
          found: list[Extra]) -> str | None:
    """Collect `folder`'s files into `found`; return why the whole folder is skipped, or None."""
    if depth > MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH} folders"
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as exc:
        return f"cannot be listed ({exc.strerror or exc})"
    before = len(found)
    for entry in entries:
        path = f"{rel}/{entry.name}"
        if names_weights(entry.name) and not entry.is_dir():
            return f"holds tensors ({path}); it belongs to another model"
        if entry.is_symlink() and not _inside(real_root, entry.path):
            found.append(Extra(path, SKIPPED, 0, "a link leading outside the source folder"))
            continue
        if entry.is_dir():
            real = os.path.realpath(entry.path)
            if real in ancestors:
                found.append(Extra(path, SKIPPED, 0, "a link back to a folder that contains it"))
                continue
            why = _walk(real_root, entry.path, path, ancestors | {real}, depth + 1, budget, found)
            if why is not None:
                return why
            continue
        if not entry.is_file():
            found.append(Extra(path, SKIPPED, 0, "not a regular file"))
            continue
        if _source_record(entry.name):
            found.append(Extra(path, SKIPPED, _size(entry.path), "describes the source checkpoint only"))
            continue
        what = _kind_by_content(entry.path)
        if what is not None:
            return f"holds {what} ({path}); it belongs to another model"
        budget.files += 1
        if budget.files > MAX_FILES:
            raise _TooBig
        found.append(Extra(path, COPIED, _size(entry.path)))
    if len(found) == before:  # an empty folder (sentence-transformers' Normalize module) is made empty
        found.append(Extra(rel + "/", COPIED))
    return None


def _subfolder(real_root: str, entry: os.DirEntry, real_dest: str | None, budget: _Budget) -> list[Extra]:
    name = entry.name
    if name.startswith("."):
        return [Extra(name, SKIPPED, 0, "a hidden folder (tool state such as .git or .cache describes the source files)")]
    if entry.is_symlink() and not _inside(real_root, entry.path):
        return [Extra(name, SKIPPED, 0, "a link leading outside the source folder")]
    real = os.path.realpath(entry.path)
    if real == real_root:
        return [Extra(name, SKIPPED, 0, "a link back to the source folder")]
    if real_dest is not None and os.path.commonpath([real, real_dest]) == real:
        return [Extra(name, SKIPPED, 0, "holds the destination of this conversion")]
    found: list[Extra] = []
    start = budget.files
    try:
        why = _walk(real_root, entry.path, name, frozenset({real_root, real}), 1, budget, found)
    except _TooBig:
        why = f"more than {MAX_FILES} files in subfolders"
    if why is not None:
        budget.files = start
        return [Extra(name, SKIPPED, 0, why)]
    return found


def scan_extras(root: Path, top_level: Iterable[str], dest: Path | None = None, own: Iterable[str] = ()) -> list[Extra]:
    """Every extra of the source folder `root`: the format's top-level extras (copied), top-level entries
    left out for a reason worth telling, and the files of each subfolder (or the subfolder, skipped).
    Subfolders holding the checkpoint's own files (`own`, relative paths; e.g. DCP pipeline stages) are
    the source itself, not extras."""
    real_root = os.path.realpath(root)
    real_dest = os.path.realpath(dest) if dest is not None else None
    chosen = set(top_level)
    source_folders = {Path(rel).parts[0] for rel in own if len(Path(rel).parts) > 1}
    out: list[Extra] = []
    budget = _Budget()
    own_files = {rel for rel in own if len(Path(rel).parts) == 1}
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name in chosen or (entry.name not in own_files and _kind_by_name(entry.name) and not entry.is_dir()
                                     and not entry.name.lower().endswith(INDEX_SUFFIX)):
            out.append(_top_file(real_root, entry, entry.name in chosen))
        elif entry.is_dir() and entry.name not in source_folders:
            out.extend(_subfolder(real_root, entry, real_dest, budget))
        elif _source_record(entry.name):
            out.append(Extra(entry.name, SKIPPED, _size(entry.path), "describes the source checkpoint only"))
        elif entry.is_symlink() and not _inside(real_root, entry.path):
            out.append(Extra(entry.name, SKIPPED, 0, "a link leading outside the source folder"))
        elif not entry.is_file() and not stat.S_ISDIR(_lmode(entry)):
            out.append(Extra(entry.name, SKIPPED, 0, "not a regular file"))
    return out


def _top_file(real_root: str, entry: os.DirEntry, chosen: bool) -> Extra:
    """A top-level file the format chose as an extra (or one named as weights the source does not use):
    copied, unless it holds weights or leads outside the source folder."""
    if entry.is_symlink() and not _inside(real_root, entry.path):
        return Extra(entry.name, SKIPPED, 0, "a link leading outside the source folder")
    what = weight_kind(entry.name, entry.path if entry.is_file() else None)
    if what is not None:
        return Extra(entry.name, SKIPPED, _size(entry.path), _weights_reason(what, chosen))
    return Extra(entry.name, COPIED, _size(entry.path))


def _lmode(entry: os.DirEntry) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_mode
    except OSError:
        return 0


def with_config_dtype(root: Path, extras: list[Extra], dtype: str | None, mapper_changes: dict | None = None) -> list[Extra]:
    """Mark the top-level config.json for update when a dtype policy casts the weights, or when the mapper
    quantises or dequantises them (`mapper_changes`, from `mapper.presets.quantized.config_changes`); when its dtype
    cannot follow (fp8 weights), keep copying it and say why."""
    if dtype is None and not mapper_changes:
        return extras
    out = []
    for extra in extras:
        raw = read_config(root / CONFIG_NAME) if extra.path == CONFIG_NAME and extra.action == COPIED else None
        if raw is None:
            out.append(extra)
            continue
        if mapper_changes and "note" in mapper_changes:
            extra = Extra(extra.path, extra.action, extra.size, _join(extra.reason, mapper_changes["note"]))
        elif mapper_changes:
            name, quantization = _config_target(dtype, mapper_changes)
            new, changes = config_dtype_update(raw, name, quantization)
            if new is not None:
                out.append(Extra(extra.path, UPDATED, len(new), "the mapper changes the weights' quantisation: " + "; ".join(changes),
                                 json.dumps(mapper_changes, sort_keys=True)))
                continue
        if dtype is None:
            out.append(extra)
            continue
        name = CONFIG_NAMES.get(dtype)
        if name is None:
            stated = sorted(set(config_dtypes(raw)))
            why = (f"it says dtype {', '.join(stated)} but the weights are stored as {dtype}, which transformers does not "
                   "compute in: set its dtype (or quantization_config) yourself") if stated else ""
            out.append(Extra(extra.path, COPIED, extra.size, _join(extra.reason, why)))
            continue
        new, changes = config_dtype_update(raw, name)
        out.append(extra if new is None else Extra(extra.path, UPDATED, len(new), f"the weights are stored as {name}: " + "; ".join(changes)))
    return out


def with_layout_note(extras: list[Extra], change: str | None) -> list[Extra]:
    """Say on config.json that it is copied unchanged although the mapper changes the layout it describes."""
    if change is None:
        return extras
    why = f"the mapper {change}, so the config may not describe the output's layout; edit it for the target model"
    return [Extra(e.path, e.action, e.size, _join(e.reason, why)) if e.path == CONFIG_NAME and e.action in (COPIED, UPDATED)
            else e for e in extras]


def with_generated_config(extras: list[Extra], config: dict | None, dtype: str | None, why: str) -> list[Extra]:
    """Add config.json, generated from `config` (a dict, e.g. built from a Meta folder's params.json), when the
    source has none: the output then loads with transformers. A dtype policy's cast sets its dtype; `why` says
    where the values come from, for the plan ("from params.json")."""
    if config is None or any(e.path == CONFIG_NAME for e in extras):
        return extras
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    if dtype in CONFIG_NAMES:
        cast = config_dtype_update(text.encode("utf-8"), CONFIG_NAMES[dtype])[0]
        text = cast.decode("utf-8") if cast is not None else text
    return [Extra(CONFIG_NAME, GENERATED, len(text.encode("utf-8")), why, text), *extras]


def _join(first: str, second: str) -> str:
    return "; ".join(p for p in (first, second) if p)


def layout_change(groups: Iterable) -> str | None:
    """An example of how the binding's groups change the tensor layout a config describes (a rename,
    reshape, fusion or split), or None when every output is an input under the same name and shape (copies, casts,
    and updates in place such as a LoRA merge: `W` and the adapter's tensors make `W`)."""
    for group in groups:
        ins, outs = group.inputs, group.outputs
        kept = {(t.name, tuple(t.shape)) for t in ins}
        if all((t.name, tuple(t.shape)) in kept for t in outs):  # each output an input under its name and shape (a merge)
            continue
        if len(ins) == 1 and len(outs) == 1:
            if ins[0].name != outs[0].name:
                return f"renames {ins[0].name!r} to {outs[0].name!r}"
            return f"reshapes {ins[0].name!r} from {list(ins[0].shape)} to {list(outs[0].shape)}"
        names_in = ", ".join(repr(t.name) for t in ins[:3]) + (" ..." if len(ins) > 3 else "")
        names_out = ", ".join(repr(t.name) for t in outs[:3]) + (" ..." if len(outs) > 3 else "")
        return f"makes {names_out} from {names_in}"
    return None


def _config_target(dtype: str | None, mapper_changes: dict) -> tuple[str | None, object]:
    """(dtype name to write, quantization_config argument) for the mapper's changes; a dtype policy wins."""
    code = dtype or mapper_changes.get("dtype")
    quantization = mapper_changes.get("quantization_config", KEEP)
    return CONFIG_NAMES.get(code) if code else None, quantization


def with_config_updates(root: Path, extras: list[Extra], edits: dict, whys: dict, dtype: str | None) -> tuple[list[Extra], list[str]]:
    """Mark the written top-level config.json for update with the mapper's stated edits (`mapper.config_update`):
    its reason lists each change ("config.json: tie_word_embeddings true -> false (why)") and `Extra.config`
    carries the edits (key "set") beside any (de)quantisation changes, so the extras step writes the edited bytes.
    Returns the extras and the statements that could not be applied (no config.json written, a missing object)."""
    if not edits:
        return extras, []
    out: list[Extra] = []
    failed: list[str] = []
    found = False
    for extra in extras:
        if extra.path != CONFIG_NAME or not extra.written:
            out.append(extra)
            continue
        found = True  # (the dtype policy's update, if any, is kept: the edits apply to its bytes)
        raw = read_config(root / CONFIG_NAME) if extra.action != GENERATED else extra.config.encode("utf-8")
        current = updated_bytes(root, extra, dtype) if extra.action == UPDATED else raw
        new, changes, not_made = (None, [], [f"{key}: config.json cannot be read" for key in edits]) if current is None \
            else edit_config(current, edits)
        failed += not_made
        if new is None:
            out.append(extra)
            continue
        shown = "; ".join(f"config.json: {text}" + (f" ({whys[key]})" if whys.get(key) else "") for key, text in changes)
        if extra.action == GENERATED:
            out.append(Extra(extra.path, GENERATED, len(new), _join(extra.reason, shown), new.decode("utf-8")))
            continue
        stated = json.loads(extra.config) if extra.config else {}
        out.append(Extra(extra.path, UPDATED, len(new), _join(extra.reason, shown),
                         json.dumps({**stated, "set": dict(edits)}, sort_keys=True)))
    if not found:
        failed += [f"{key}: no config.json is written with this output" for key in edits]
    return out, failed


def updated_bytes(root: Path, extra: Extra, dtype: str | None) -> bytes | None:
    """The bytes an UPDATED or GENERATED extra is written with (None when it is copied as it is)."""
    if extra.action == GENERATED:
        return extra.config.encode("utf-8")
    if extra.action != UPDATED or extra.path != CONFIG_NAME:
        return None
    if extra.config:
        raw = read_config(root / extra.path)
        if raw is None:
            return None
        stated = json.loads(extra.config)
        new = config_dtype_update(raw, *_config_target(dtype, stated))[0]
        if stated.get("set"):
            edited = edit_config(new if new is not None else raw, stated["set"])[0]
            new = edited if edited is not None else new
        return new
    if dtype not in CONFIG_NAMES:
        return None
    raw = read_config(root / extra.path)
    return None if raw is None else config_dtype_update(raw, CONFIG_NAMES[dtype])[0]


def with_output_files(extras: list[Extra], files: Iterable) -> tuple[list[Extra], list[str]]:
    """Apply the mapper's `OutputFile` statements (`mapper.output_file`): each written one replaces the copy of the
    same name (or is added) as a generated extra carrying its text; one left out turns the copy into a skip with its
    reason. Returns the extras and why a file could not be made (its source unreadable, not UTF-8 text)."""
    from ..errors import MapperError

    out = list(extras)
    failed: list[str] = []
    for statement in files:
        index = next((i for i, e in enumerate(out) if e.path == statement.path), None)
        if not statement.written:
            if index is not None and out[index].written:
                old = out[index]
                out[index] = Extra(old.path, SKIPPED, old.size, statement.why or "the mapper leaves it out of the output")
            continue
        try:
            text = statement.content().decode("utf-8")
        except MapperError as exc:
            failed.append(str(exc))
            continue
        except UnicodeDecodeError:
            failed.append(f"Cannot write {statement.path!r}: its source {statement.source} is not UTF-8 text. Give a text file.")
            continue
        extra = Extra(statement.path, GENERATED, len(text.encode("utf-8")), statement.why or "stated by the mapper", text)
        if index is None:
            out.append(extra)
        else:
            out[index] = extra
    return out, failed
