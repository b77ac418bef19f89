"""`wb.merge_config`: a mergekit merge config (YAML file or mapping) -> the multi-source checkpoint and its mapper.

    ck, mapper = wb.merge_config("merge.yml")
    wb.plan(ck, mapper).problems          # the dry-run: memory, files, and every key the workbench refuses
    wb.convert(ck, "merged/", mapper)

Model references are local folders or files (relative ones resolve against the config file's folder, or `root`),
`hf://`, `https://` and `s3://` URLs, or Hub ids `org/name` (read as `hf://org/name`, as mergekit reads them). Each
model becomes one source of the checkpoint, named after its folder (`base`, `ft1`, ...; made unique); the base
model (else the first model) is the primary source, whose config.json and tokenizer files the output gets.
`model+lora` references (mergekit's LoRA shorthand) are refused: open the adapter as a source and use
`M.presets.lora_merge` first.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from .errors import MapperError

URL = re.compile(r"^[a-z0-9+.-]+://", re.IGNORECASE)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


MAX_CONFIG_BYTES = 1 << 20  # a merge config is a few hundred bytes; a bigger file is refused before parsing
MAX_CONFIG_NODES = 100_000  # values counted with every alias expanded: YAML anchors cannot multiply the work


class MergeSetup(NamedTuple):
    """What `merge_config` returns: the multi-source checkpoint and the mapper (unpacks as `ck, mapper`)."""

    checkpoint: Any
    mapper: Any


def read_config(path_or_dict: Any) -> tuple[dict, Path]:
    """(the config as a dict, the folder relative model paths resolve against)."""
    if isinstance(path_or_dict, Mapping):
        _check_size(dict(path_or_dict), "(a mapping)")
        try:
            return json.loads(json.dumps(dict(path_or_dict))), Path.cwd()
        except (TypeError, ValueError):
            raise MapperError("Cannot read merge config: the mapping holds values that are not numbers, strings, lists or "
                              "mappings. Pass plain data, as YAML gives it.") from None
    path = Path(os.fspath(path_or_dict))
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        raise MapperError("Cannot read a merge config: PyYAML is not installed. Fix: pip install pyyaml.") from None
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise MapperError(f"Cannot read merge config {path}: it is larger than {MAX_CONFIG_BYTES} bytes. A merge config "
                              "is a short YAML file; check the path.")
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MapperError(f"Cannot read merge config {path}: {exc.strerror or exc}. Check the path.") from None
    except UnicodeDecodeError:
        raise MapperError(f"Cannot read merge config {path}: it is not UTF-8 text. Check the path.") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise MapperError(f"Cannot read merge config {path}: not valid YAML ({str(exc).splitlines()[0]}). Fix the file.") from None
    if not isinstance(data, dict):
        raise MapperError(f"Cannot read merge config {path}: expected a mapping of keys such as merge_method and models.")
    _check_size(data, str(path))
    return data, path.resolve().parent


def _check_size(data: Any, where: str) -> None:
    """Refuse a config whose values, aliases expanded, exceed MAX_CONFIG_NODES (a YAML 'billion laughs')."""
    budget = MAX_CONFIG_NODES
    stack = [data]
    while stack:
        value = stack.pop()
        budget -= 1
        if budget < 0:
            raise MapperError(f"Cannot read merge config {where}: it expands to more than {MAX_CONFIG_NODES} values "
                              "(YAML anchors repeated). A merge config is small; check the file.")
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def resolve_reference(ref: str, root: Path) -> str:
    """Where a model reference points: a URL as is, a local path (relative to `root`), else a Hub id as hf://."""
    if "+" in ref and not URL.match(ref):
        raise MapperError(f"Cannot merge model {ref!r}: mergekit's 'model+lora' shorthand is not supported. Open the adapter "
                          "as its own source and merge it with M.presets.lora_merge first.")
    if URL.match(ref):
        return ref
    local = Path(ref).expanduser()
    local = local if local.is_absolute() else root / local
    if local.exists() or not HUB_ID.match(ref):
        return str(local)
    return f"hf://{ref}"


def source_names(refs: list[str]) -> dict[str, str]:
    """model reference -> a unique source name (its last path segment, made unique with -2, -3, ...)."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for ref in refs:
        stem = re.sub(r"[^\w.-]", "_", ref.rstrip("/").rpartition("/")[2].removesuffix(".safetensors")) or "model"
        name, n = stem, 1
        while name in taken:
            n += 1
            name = f"{stem}-{n}"
        taken.add(name)
        out[ref] = name
    return out


def _vocabulary(path: str) -> dict | None:
    """token -> id of a local model folder's tokenizer.json (the model's vocabulary, a Unigram list by position, and
    the added tokens), as transformers' get_vocab() gives it; None when absent or unreadable."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        raw = data.get("model", {}).get("vocab") or {}
        vocab = {str(entry[0]): i for i, entry in enumerate(raw)} if isinstance(raw, list) else {str(k): int(v) for k, v in raw.items()}
        vocab.update({str(t["content"]): int(t["id"]) for t in data.get("added_tokens") or []})
        return vocab
    except (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError):
        return None


def _vocab_size(path: str, fallback: int) -> int:
    """config.json's vocab_size of a local model folder (the rows its embeddings have), else `fallback`."""
    try:
        value = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return fallback
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else fallback


VOCAB_TENSOR = re.compile(r"(?:^|\.)(?:embed_tokens|lm_head|wte|word_embeddings|embed_out)\.weight$")


def _alignment(config: dict, refs: list[str], names: dict[str, str], paths: dict[str, str], checkpoint: Any) -> Any:
    """For `tokenizer_source: base` over models of different vocabularies: the step moving every model's embedding
    and lm_head rows to the base model's vocabulary (mergekit's rule); None when it cannot be matched (the preset then
    refuses the key): no base model, slices, a model without a readable tokenizer.json, a base vocabulary with gaps."""
    from .mapper import Parallel
    from .mapper.merge.vocabulary import AlignVocabulary, align_rows

    base = config.get("base_model")
    if base is None or not config.get("models") or config.get("slices"):
        return None
    models = [entry["model"] for entry in config["models"]]
    models += [base] if base not in models else []
    vocabularies = [_vocabulary(paths[m]) for m in models]
    if any(v is None for v in vocabularies):
        return None
    sizes = [_vocab_size(paths[m], len(v)) for m, v in zip(models, vocabularies, strict=True)]
    b = models.index(base)
    out_vocab = {tok: i for tok, i in vocabularies[b].items() if i < sizes[b]}
    if sorted(out_vocab.values()) != list(range(len(out_vocab))):
        return None
    tables = align_rows(out_vocab, vocabularies, sizes, b)
    primary = names[refs[0]]
    tensors = [n for n in checkpoint.catalog.sources[primary].tensors if VOCAB_TENSOR.search(n)]

    def scoped(model: str, tensor: str) -> str:
        return tensor if names[model] == primary else f"{names[model]}::{tensor}"

    steps = [AlignVocabulary([scoped(m, t) for m in models], [scoped(m, t) for m in models], tables, dtype=config.get("dtype"))
             for t in sorted(tensors)]
    return steps[0] if len(steps) == 1 else Parallel(*steps) if steps else None


def same_vocabulary(paths: list[str]) -> bool:
    """True when every model has the same tokenizer vocabulary (token -> id) and it can be read; False otherwise."""
    vocabularies = [_vocabulary(p) for p in paths]
    return all(v is not None and v == vocabularies[0] for v in vocabularies)


def merge_config(path_or_dict: Any, *, root: str | os.PathLike | None = None, seed: int | None = None) -> MergeSetup:
    """Read a mergekit merge config (a YAML file or a mapping) and return `(checkpoint, mapper)`: the models opened as
    one multi-source checkpoint and the mapper that merges them as mergekit would (see workbench.mapper.presets.mergekit
    for the keys; unsupported ones are plan problems naming the key). `root`: the folder relative model paths resolve
    against (default: the config file's folder; the working folder for a mapping). `seed`: the random methods' seed
    (mergekit's `--random-seed`)."""
    from .explore.checkpoint import open_checkpoint
    from .mapper.presets.mergekit import config_mapper, model_references, tokenizer_source

    config, folder = read_config(path_or_dict)
    base = Path(root) if root is not None else folder
    refs = model_references(config)
    if not refs:
        raise MapperError("Cannot read merge config: it names no model. Give models: or slices: with model paths.")
    names = source_names(refs)
    paths = {ref: resolve_reference(ref, base) for ref in refs}
    source, _ = tokenizer_source(config)
    same = True if source is None else same_vocabulary([paths[r] for r in refs])
    checkpoint = open_checkpoint({names[ref]: paths[ref] for ref in refs})
    align = _alignment(config, refs, names, paths, checkpoint) if source == "base" and not same else None
    return MergeSetup(checkpoint, config_mapper(config, names, same_vocabulary=same, seed=seed, align=align))
