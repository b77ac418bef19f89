"""`wb.merge_config`: a mergekit merge config (YAML file or mapping) -> the multi-source checkpoint and its mapper.

    ck, mapper = wb.merge_config("merge.yml")
    wb.plan(ck, mapper).problems          # the dry-run: memory, files, and every key the workbench refuses
    wb.convert(ck, "merged/", mapper)

Model references are local folders or files (relative ones resolve against the config file's folder, or `root`),
`hf://`, `https://` and `s3://` URLs, or Hub ids `org/name` (read as `hf://org/name`, as mergekit reads them). Each
model becomes one source of the checkpoint, named after its folder (`base`, `ft1`, ...; made unique); the base
model (else the first model) is the primary source, whose config.json and tokenizer files the output gets (the
tokenizer settings may replace the latter: `tokenizer_source` union or a model, `chat_template`; see
workbench/mergekit_tokenizer.py).
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
from .mergekit_tokenizer import (
    SLOW_FILES,
    TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    TOKENIZER_FILES,
    TOKENIZER_JSON,
    chat_template,
    config_with,
    contiguous,
    has_template,
    read_tokenizer,
    token_sources,
    union_vocabulary,
)

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
    """token -> id of a local model folder's tokenizer.json (its vocabulary, a Unigram list by position, and its
    added tokens), as transformers' get_vocab() gives it; None when absent or unreadable."""
    tokenizer = read_tokenizer(path)
    return None if tokenizer is None else tokenizer.vocab


VOCAB_TENSOR = re.compile(r"(?:^|\.)(?:embed_tokens|lm_head|wte|word_embeddings|embed_out)\.weight$")


def same_vocabulary(paths: list[str]) -> bool:
    """True when every model has the same tokenizer vocabulary (token -> id) and it can be read; False otherwise."""
    vocabularies = [_vocabulary(p) for p in paths]
    return all(v is not None and v == vocabularies[0] for v in vocabularies)


def _tokenizer_steps(config: dict, refs: list[str], names: dict[str, str], paths: dict[str, str], checkpoint: Any,
                     source: Any, same: bool) -> list[Any]:
    """The steps carrying out the config's tokenizer settings (mergekit_tokenizer's docstring): over different
    vocabularies (or with per-token settings or padding), the rows of every model moved to the output vocabulary
    (`AlignVocabulary`, before the merge) and config.json's vocab_size; the tokenizer files the output needs
    (`OutputFile`); the chat template. A setting that cannot be matched is a `Refused` step naming its key."""
    from .mapper.output_file import OutputFile

    steps: list[Any] = []
    folder, added, keep_below = paths[refs[0]], [], 0  # where the output's tokenizer files come from; tokens they gain
    if source is not None:
        steps, folder, added, keep_below = _vocabulary_steps(config, refs, names, paths, checkpoint, source, same)
    drop_template = False
    if config.get("chat_template") is not None:
        template = _template_steps(config["chat_template"], [paths[r] for r in refs], folder, OutputFile)
        replaced = {getattr(s, "path", None) for s in template} - {None}
        steps = [s for s in steps if getattr(s, "path", None) not in replaced] + template
        drop_template = any(getattr(s, "path", None) == TEMPLATE_FILE for s in template) and has_template(folder)
    text = config_with(folder, added=added, drop_template=drop_template, keep_below=keep_below)
    if text is not None:
        why = "; ".join(w for w, on in (("the added tokens listed", bool(added)),
                                         (f"the added tokens from id {keep_below} on left out", bool(keep_below)),
                                         ("its chat_template moved to chat_template.jinja", drop_template)) if on)
        steps = [s for s in steps if getattr(s, "path", None) != TOKENIZER_CONFIG]
        steps.append(OutputFile(TOKENIZER_CONFIG, text=text, why=why))
    return steps


def _vocabulary_steps(config: dict, refs: list[str], names: dict[str, str], paths: dict[str, str], checkpoint: Any,
                      source: Any, same: bool) -> tuple[list[Any], str, list[dict], int]:
    """(steps, the folder the output's tokenizer files come from, the added-token entries its tokenizer.json gains,
    the id from which its tokens are stripped or 0) for `tokenizer_source` (or the tokenizer section: source, tokens,
    pad_to_multiple_of). As mergekit, the output has one embedding (and lm_head) row per token of the output
    tokenizer (padded when asked): where the models share one vocabulary shorter than their rows (Qwen2's
    tokenizer has fewer tokens than its vocab_size), the rows beyond it are cut; `base` and `union` start from the
    base's tokenizer stripped of its tokens beyond vocab_size."""
    from .mapper.config_update import ConfigUpdate
    from .mapper.merge.refusal import Refused
    from .mapper.merge.vocabulary import align_rows, token_rows
    from .mapper.output_file import OutputFile

    primary = paths[refs[0]]
    if not isinstance(source, str) or not source:
        return [Refused("tokenizer_source", f"expected 'base', 'union' or a model (got {source!r}).")], primary, [], 0
    model_source = source not in ("base", "union")
    key = "tokenizer_source" if config.get("tokenizer_source") is not None else "tokenizer"

    def refuse(why: str, named: str = key) -> tuple[list[Any], str, list[dict], int]:
        return [Refused(named, why)], primary, [], 0

    base_tok = read_tokenizer(primary)  # mergekit's base: base_model, else the first model
    keep_below = 0
    if not model_source and base_tok is not None and base_tok.beyond:
        if base_tok.strip_refusal() is not None:
            return refuse(base_tok.strip_refusal())  # type: ignore[arg-type]
        keep_below = base_tok.size
    out_tok = read_tokenizer(paths[source]) if model_source else base_tok
    if model_source and out_tok is not None and out_tok.beyond:
        return refuse(f"{source!r}'s tokenizer has tokens at or beyond its config.json vocab_size {out_tok.size} (e.g. "
                      f"{out_tok.beyond[0]!r}), which mergekit keeps in the output vocabulary with no row and then fails "
                      "the merge. Use a tokenizer source whose tokens all have rows.")
    files: list[Any] = []
    if model_source and paths.get(source) != primary:
        files = _copied_files(paths[source], primary, OutputFile)
    folder = paths[source] if model_source else primary
    section = config.get("tokenizer") if isinstance(config.get("tokenizer"), Mapping) else {}
    tokens, pad = section.get("tokens") or {}, section.get("pad_to_multiple_of")
    base = config.get("base_model")
    if same and not tokens and not pad and (not model_source or same_vocabulary([paths[source], primary])):
        return _shared_vocabulary(config, refs, names, checkpoint, source, files, folder, out_tok, keep_below, refuse)
    if config.get("slices") or not config.get("models"):
        return refuse("moving the embedding and lm_head rows to another vocabulary (the models' vocabularies differ, or "
                      "tokens / pad_to_multiple_of are set) is carried out for models: configs, not slices: (mergekit plans "
                      "slices' vocabularies otherwise). Merge the slices of models sharing one tokenizer.")
    if source == "base" and base is None:
        return refuse("'base' over different vocabularies needs base_model (the vocabulary to move the rows to).")
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 1):
        return refuse(f"expected a positive whole number (got {pad!r}).", "tokenizer.pad_to_multiple_of")
    if not isinstance(tokens, Mapping):
        return refuse(f"expected a mapping token -> {{source, force}} (got {tokens!r}).", "tokenizer.tokens")
    models = _merged_models(config)
    tokenizers = [read_tokenizer(paths[m]) for m in models]
    missing = [m for m, t in zip(models, tokenizers, strict=True) if t is None]
    if missing:
        return refuse(f"the models' vocabularies differ and {missing[0]!r} has no readable tokenizer.json (mergekit would "
                      "assume the base's vocabulary). Add its tokenizer files.")
    added: list[dict] = []
    if source == "base":
        base_tok = tokenizers[models.index(base)]
        out = {tok: i for tok, i in base_tok.vocab.items() if i < base_tok.size}  # type: ignore[union-attr]
    elif source == "union":
        union_from = [read_tokenizer(paths[m]) for m in [refs[0]] + [m for m in models if m != refs[0]]]
        first = union_from[0].stripped() if union_from[0] is not None else None
        if first is None or not contiguous(first.vocab):
            return refuse(f"'union' extends {refs[0]!r}'s tokenizer, whose ids below its config.json vocab_size have "
                          "gaps (mergekit's rows follow the ids 0 .. n-1 and fail on them). Use another tokenizer source.")
        out, added = union_vocabulary([first, *union_from[1:]])  # type: ignore[list-item]
    else:
        tokenizer = read_tokenizer(paths[source])
        out = dict(tokenizer.vocab) if tokenizer is not None else {}
    if not contiguous(out):
        return refuse(f"the output vocabulary ({source!r}) has gaps in its ids, which rows cannot follow. Use another "
                      "tokenizer source.")
    for token in tokens:  # mergekit adds the tokens it is told about, as plain added tokens, after the rest
        if isinstance(token, str) and token not in out:
            out[token] = len(out)
            added.append({"id": out[token], "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": True, "special": False})
    vocabularies = [t.vocab for t in tokenizers]  # type: ignore[union-attr]
    sizes = [t.size for t in tokenizers]  # type: ignore[union-attr]
    sources, why = token_sources(tokens, models, vocabularies, sizes, models.index(base) if base in models else None)
    if why is not None:
        return refuse(why, "tokenizer.tokens")
    tables = token_rows(align_rows(out, vocabularies, sizes, models.index(base) if base in models else None),
                        out, vocabularies, sizes, sources)
    padded = -(-len(out) // pad) * pad if pad else len(out)
    steps = _align_steps(models, names, refs, checkpoint, tables, config.get("dtype"), padded - len(out))
    steps.append(ConfigUpdate("vocab_size", padded, why=f"tokenizer {source}: the output vocabulary"
                              + (f", padded to a multiple of {pad}" if padded != len(out) else "")))
    if added or keep_below:
        files = [f for f in files if f.path not in (TOKENIZER_JSON, *SLOW_FILES)]
        steps += _tokenizer_json(source, folder, primary, added, keep_below)
    return files + steps, folder, added, keep_below


def _merged_models(config: dict) -> list[str]:
    """The models a `models:` config merges, in config order, with base_model last when it is not among them."""
    models = [entry["model"] for entry in config["models"]]
    base = config.get("base_model")
    return models + ([base] if base is not None and base not in models else [])


def _tokenizer_json(source: str, folder: str, primary: str, added: list[dict], keep_below: int) -> list[Any]:
    """The output's tokenizer.json: `folder`'s with its tokens from id `keep_below` on stripped (when > 0) and
    `added` added; the slow tokenizer files, which would disagree, left out."""
    from .mapper.output_file import OutputFile

    what = (f"{Path(folder).name}'s tokenizer" + (f" with its tokens from id {keep_below} on stripped" if keep_below else "")
            + (f" and {len(added)} more tokens" if added else ""))
    steps = [OutputFile(TOKENIZER_JSON, source=str(Path(folder) / TOKENIZER_JSON), added=tuple(json.dumps(e) for e in added),
                        keep_below=keep_below, why=f"tokenizer {source}: {what}")]
    stale = sorted({n for n in SLOW_FILES for f in (folder, primary) if (Path(f) / n).is_file()})
    return steps + [OutputFile(name, why=f"tokenizer {source}: it does not hold the output vocabulary") for name in stale]


def _shared_vocabulary(config: dict, refs: list[str], names: dict[str, str], checkpoint: Any, source: str,
                       files: list[Any], folder: str, out_tok: Any, keep_below: int,
                       refuse: Any) -> tuple[list[Any], str, list[dict], int]:
    """The steps when every model shares one vocabulary: the tokenizer files (stripped beyond vocab_size for `base`
    and `union`) and, when the output tokenizer is shorter than the vocabulary tensors' rows, those rows cut to its
    length and config.json's vocab_size set to it, as mergekit's output has them."""
    from .mapper.config_update import ConfigUpdate

    if out_tok is None:
        return files, folder, [], 0
    vocab = out_tok.stripped().vocab if keep_below else out_tok.vocab
    rows = {t.shape[0] for ref in refs for n, t in checkpoint.catalog.sources[names[ref]].tensors.items()
            if VOCAB_TENSOR.search(n) and t.shape}
    steps: list[Any] = []
    if any(r > len(vocab) for r in rows):
        if not contiguous(vocab):
            return refuse(f"the output tokenizer's ids have gaps ({len(vocab)} tokens, ids up to {max(vocab.values())}); "
                          "mergekit's rows follow the ids 0 .. n-1 and fail on them. Use another tokenizer source.")
        if config.get("slices") or not config.get("models"):
            return refuse(f"the output tokenizer has {len(vocab)} tokens and the embedding {max(rows)} rows: mergekit cuts "
                          "the rows to the tokenizer's length, which the workbench carries out for models: configs, not "
                          "slices:. Merge with models:, or leave tokenizer_source out (the rows are then kept).")
        steps += _cut_steps(_merged_models(config), names, refs, checkpoint, len(vocab))
        steps.append(ConfigUpdate("vocab_size", len(vocab), why=f"tokenizer {source}: the output tokenizer's length "
                                  f"(the rows beyond it are cut, as mergekit does)"))
    if keep_below:
        files = [f for f in files if f.path not in (TOKENIZER_JSON, *SLOW_FILES)]
        steps += _tokenizer_json(source, folder, folder, [], keep_below)
    return files + steps, folder, [], keep_below


def _cut_steps(models: list[str], names: dict[str, str], refs: list[str], checkpoint: Any, length: int) -> list[Any]:
    """Each model's vocabulary tensors cut to their first `length` rows (the rest split off and dropped)."""
    from .mapper import Drop, Parallel, Sequential, Split

    primary = names[refs[0]]
    tensors = checkpoint.catalog.sources[primary].tensors
    steps = []
    for model in dict.fromkeys(models):
        for tensor in sorted(n for n in tensors if VOCAB_TENSOR.search(n)):
            name = tensor if names[model] == primary else f"{names[model]}::{tensor}"
            own = checkpoint.catalog.sources[names[model]].tensors.get(tensor)
            rest = (own.shape[0] if own is not None and own.shape else length) - length
            if rest <= 0:  # already the tokenizer's length (or shorter: the merge then says the shapes differ)
                continue
            steps.append(Sequential(Split(name, [name, name + ".beyond_tokenizer"], sizes=[length, rest]),
                                    Drop(name + ".beyond_tokenizer")))
    return [Parallel(*steps)] if len(steps) > 1 else steps


def _align_steps(models: list[str], names: dict[str, str], refs: list[str], checkpoint: Any, tables: Any,
                 dtype: Any, pad: int = 0) -> list[Any]:
    from .mapper import Parallel
    from .mapper.merge.vocabulary import AlignVocabulary

    primary = names[refs[0]]
    tensors = [n for n in checkpoint.catalog.sources[primary].tensors if VOCAB_TENSOR.search(n)]

    def scoped(model: str, tensor: str) -> str:
        return tensor if names[model] == primary else f"{names[model]}::{tensor}"

    steps = [AlignVocabulary([scoped(m, t) for m in models], [scoped(m, t) for m in models], tables, dtype=dtype,
                             pad=pad) for t in sorted(tensors)]
    return [Parallel(*steps)] if len(steps) > 1 else steps


def _copied_files(folder: str, primary: str, output_file: Any) -> list[Any]:
    """The tokenizer files of the model `folder` as the output's, and the primary's other ones left out."""
    why = f"tokenizer_source: the tokenizer of {Path(folder).name}"
    steps = [output_file(name, source=str(Path(folder) / name), why=why) for name in TOKENIZER_FILES
             if (Path(folder) / name).is_file()]
    steps += [output_file(name, why=why + " (which has no such file)") for name in (*TOKENIZER_FILES, *SLOW_FILES)
              if not (Path(folder) / name).is_file() and (Path(primary) / name).is_file()]
    return steps


def _template_steps(value: Any, folders: list[str], folder: str, output_file: Any) -> list[Any]:
    """chat_template.jinja holding the config's chat template (and `folder`'s chat_template.json, the output's,
    left out); a refusal naming chat_template when it cannot be matched. The caller removes a chat_template key
    from the output's tokenizer_config.json."""
    from .mapper.merge.refusal import Refused

    text, why = chat_template(value, folders)
    if why is not None:
        return [Refused("chat_template", why)]
    if text is None:  # 'auto' and no model has a template: mergekit leaves the tokenizer as it is
        return []
    what = "chat_template " + (repr(value) if len(value) < 40 else "(a Jinja template)")
    steps = [output_file(TEMPLATE_FILE, text=text, why=what)]
    steps += [output_file("chat_template.json", why=what)] if (Path(folder) / "chat_template.json").is_file() else []
    return steps


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
    steps = _tokenizer_steps(config, refs, names, paths, checkpoint, source, same)
    return MergeSetup(checkpoint, config_mapper(config, names, same_vocabulary=same, seed=seed, tokenizer=steps))
