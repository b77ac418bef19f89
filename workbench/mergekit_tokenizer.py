"""The tokenizer side of a mergekit merge config: the output vocabulary and the files that describe it.

`tokenizer_source` (or `tokenizer.source`) picks the output vocabulary, as mergekit 0.1.5 builds it:

- `base`: the base model's tokens below its config.json `vocab_size`;
- a model: that model's whole tokenizer (its files become the output's);
- `union`: the base model's tokenizer (the first model's without a base) plus every token another model has below
  its `vocab_size`: first the plain tokens no model adds as an added token, then the added tokens, each once (the
  first model's settings win), with ids after the base's. mergekit walks a hash map for the plain tokens and a set
  for the models, so the ids of the new tokens change from one mergekit run to the next; the workbench takes the
  models in config order (base first) and each model's tokens by id. The rows of every token are the same as
  mergekit's — only their order among the new tokens can differ — and the tests compare rows by token string.

Whatever the source, the output has one embedding (and lm_head) row per token of the output tokenizer, as in
mergekit: models sharing one vocabulary shorter than their rows (Qwen2's vocab_size pads beyond its tokenizer) come
out with the tokenizer's length. `base` and `union` start from the base's tokenizer stripped of its tokens at or
beyond vocab_size (`ModelTokenizer.stripped`; mergekit does this for BPE tokenizers only and fails otherwise).

The tokenizer section's `tokens` (a token's row from a model, a model's other token, or zeros; `force` for every
model) become row-table entries (`token_sources`), tokens the vocabulary lacks being added after the others, and
`pad_to_multiple_of` padding rows (`AlignVocabulary(pad=...)`, the mean of the rows above).

`chat_template` is written as chat_template.jinja (what transformers 5's save_pretrained, which mergekit calls,
writes): a literal Jinja template as given; `auto` the template most of the models carry (stripped, ties to the
first in config order); a built-in name (`chatml`, `llama3`, ...) the template file of an installed mergekit
package, read at plan time (the workbench ships none of mergekit's templates); a copied tokenizer_config.json loses
its own `chat_template` key so the two cannot disagree.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, "special_tokens_map.json", "added_tokens.json", TEMPLATE_FILE,
                   "chat_template.json", "vocab.json", "merges.txt")
SLOW_FILES = ("tokenizer.model", "added_tokens.json", "vocab.json", "merges.txt")  # stale beside a new vocabulary
MAX_TOKENIZER_BYTES = 256 << 20
ADDED_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


@dataclass(frozen=True)
class ModelTokenizer:
    """One model's tokenizer as a merge needs it: its folder, token -> id (model vocabulary and added tokens),
    its added tokens' entries (tokenizer.json's), its rows (config.json's vocab_size, else the token count) and its
    model type (tokenizer.json's, e.g. 'BPE')."""

    folder: str
    vocab: dict[str, int]
    added: tuple[dict, ...]
    size: int
    kind: str = ""

    @property
    def beyond(self) -> list[str]:
        """The tokens whose id is vocab_size or more (the model has no row for them)."""
        return [t for t, i in self.vocab.items() if i >= self.size]

    def stripped(self) -> ModelTokenizer:
        """This tokenizer without its tokens beyond vocab_size, as mergekit strips the base's (`strip_refusal` says
        when it cannot)."""
        return ModelTokenizer(self.folder, {t: i for t, i in self.vocab.items() if i < self.size},
                              tuple(t for t in self.added if int(t["id"]) < self.size), self.size, self.kind)

    def strip_refusal(self) -> str | None:
        """Why mergekit cannot strip this tokenizer's tokens beyond vocab_size (it fails the merge), or None."""
        if not self.beyond or self.kind == "BPE":
            return None
        return (f"{Path(self.folder).name}'s tokenizer has {len(self.beyond)} tokens at or beyond its config.json vocab_size "
                f"{self.size} (e.g. {self.beyond[0]!r}) and is a {self.kind or 'non-BPE'} tokenizer; mergekit strips such "
                "tokens from BPE tokenizers only and fails the merge otherwise. Set vocab_size to the tokenizer's length or "
                "use another tokenizer source.")


def read_tokenizer(folder: str) -> ModelTokenizer | None:
    """A local model folder's tokenizer (tokenizer.json and config.json's vocab_size); None when unreadable."""
    file = Path(folder) / TOKENIZER_JSON
    try:
        if not file.is_file() or file.stat().st_size > MAX_TOKENIZER_BYTES:
            return None
        data = json.loads(file.read_text(encoding="utf-8"))
        kind = str(data.get("model", {}).get("type") or "")
        raw = data.get("model", {}).get("vocab") or {}
        vocab = {str(entry[0]): i for i, entry in enumerate(raw)} if isinstance(raw, list) else {str(k): int(v) for k, v in raw.items()}
        added = tuple(dict(t) for t in data.get("added_tokens") or [])
        vocab.update({str(t["content"]): int(t["id"]) for t in added})
    except (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError):
        return None
    return ModelTokenizer(folder, vocab, added, _vocab_size(folder, len(vocab)), kind)


def _vocab_size(folder: str, fallback: int) -> int:
    try:
        value = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return fallback
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else fallback


def contiguous(vocab: dict[str, int]) -> bool:
    """True when the ids are 0 .. n-1, each once (a vocabulary the rows can follow)."""
    return sorted(vocab.values()) == list(range(len(vocab)))


def union_vocabulary(tokenizers: list[ModelTokenizer]) -> tuple[dict[str, int], list[dict]]:
    """(token -> id of the union, the added-token entries its tokenizer.json gains) for `tokenizers`, the first
    being the base whose tokenizer is extended (module docstring). The base's vocabulary must be contiguous and
    within its vocab_size (the caller checks)."""
    base = tokenizers[0]
    out = dict(base.vocab)
    base_added = {str(t["content"]) for t in base.added}
    plain: dict[str, None] = {}
    added: dict[str, dict] = {}
    for tok in tokenizers:
        for token, _ in sorted(((t, i) for t, i in tok.vocab.items() if i < tok.size), key=lambda item: item[1]):
            plain.setdefault(token)
        for entry in sorted(tok.added, key=lambda t: int(t["id"])):
            if int(entry["id"]) < tok.size:
                added.setdefault(str(entry["content"]), entry)
    entries: list[dict] = []
    next_id = max(out.values(), default=-1) + 1
    for token in plain:
        if token in added or token in out:
            continue
        out[token] = next_id
        entries.append({"id": next_id, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": True, "special": False})
        next_id += 1
    for token, entry in added.items():
        if token in base_added:
            continue
        if token in out:  # a plain token of the base that another model adds: it becomes an added token, same id
            entries.append(_entry(out[token], entry))
            continue
        out[token] = next_id
        entries.append(_entry(next_id, entry))
        next_id += 1
    return out, entries


def _entry(new_id: int, entry: dict) -> dict:
    return {"id": new_id, "content": str(entry["content"]), **{k: bool(entry.get(k, False)) for k in ADDED_FLAGS}}


def config_with(folder: str, *, added: list[dict] = (), drop_template: bool = False, keep_below: int = 0) -> str | None:
    """The text of `folder`'s tokenizer_config.json with the added tokens listed in its added_tokens_decoder (when
    it has one), those of id `keep_below` or more (when > 0) taken out of it, and its chat_template key removed
    (`drop_template`); None when nothing changes or it is absent."""
    file = Path(folder) / TOKENIZER_CONFIG
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    changed = False
    decoder = data.get("added_tokens_decoder")
    if keep_below and isinstance(decoder, dict):
        kept = {k: v for k, v in decoder.items() if not (k.isdigit() and int(k) >= keep_below)}
        changed = len(kept) != len(decoder)
        data["added_tokens_decoder"] = decoder = kept
    if added and isinstance(decoder, dict):
        for entry in added:
            decoder[str(entry["id"])] = {"content": entry["content"], **{k: entry[k] for k in sorted(ADDED_FLAGS)}}
        changed = True
    if drop_template and "chat_template" in data:
        del data["chat_template"]
        changed = True
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n" if changed else None


def has_template(folder: str) -> bool:
    """True when `folder`'s tokenizer_config.json holds a chat_template key."""
    try:
        data = json.loads((Path(folder) / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "chat_template" in data


def model_template(folder: str) -> str | None:
    """The chat template a model folder carries (chat_template.jinja, else tokenizer_config.json's, the 'default'
    one of a named list), as transformers loads it; None when it has none."""
    jinja = Path(folder) / TEMPLATE_FILE
    try:
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        data = json.loads((Path(folder) / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    value = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(value, list):
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    return value if isinstance(value, str) and value else None


def builtin_template(name: str) -> str | None:
    """mergekit's built-in template `name` from an installed mergekit package (found, not imported); None when
    mergekit is not installed or has no such template."""
    try:
        spec = importlib.util.find_spec("mergekit")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        file = Path(location) / "_data" / "chat_templates" / f"{name}.jinja"
        if file.is_file():
            return file.read_text(encoding="utf-8")
    return None


def chat_template(value: object, folders: list[str]) -> tuple[str | None, str | None]:
    """(the template to write, or None for none; why it is refused, or None) for the config's `chat_template`,
    `folders` the models in config order (for `auto`)."""
    if not isinstance(value, str) or not value:
        return None, f"expected a template name, 'auto' or a Jinja template as text (got {value!r})."
    if value == "auto":
        found = [t.strip() for t in (model_template(f) for f in folders) if t]
        return (Counter(found).most_common(1)[0][0] if found else None), None
    if len(value) < 256 and "\n" not in value and "{" not in value:
        text = builtin_template(value)
        if text is not None:
            return text, None
        if importlib.util.find_spec("mergekit") is None:
            return None, (f"{value!r} names one of mergekit's built-in templates, which the workbench reads from an "
                          "installed mergekit package (none is installed here). Install mergekit beside the workbench, or "
                          "give the template's Jinja text.")
    if len(value) < 20 or "{" not in value:
        return None, f"{value!r} is neither a built-in template name nor a Jinja template (mergekit refuses it too)."
    return value, None


def token_sources(tokens: Mapping, models: list[str], vocabularies: list[dict[str, int]], sizes: list[int],
                  base: int | None = None) -> tuple[dict, str | None]:
    """(token -> `TokenSource` of mergekit's `tokenizer.tokens` settings, why they are refused or None). `models`:
    the merged models in the row tables' order, with their vocabularies and rows (`base`: the base's index, whose
    vocabulary mergekit reads below its vocab_size only). A setting no model needs (every model has the token and it
    is not forced) changes nothing, as in mergekit."""
    from .mapper.merge.vocabulary import TokenSource

    out: dict[str, TokenSource] = {}
    for token, setting in tokens.items():
        setting = {} if setting is None else setting
        if not isinstance(token, str) or not isinstance(setting, Mapping) or set(setting) - {"source", "force"}:
            return {}, f"token {token!r}: expected {{source, force}} (got {setting!r})."
        force = setting.get("force", False)
        if not isinstance(force, bool):
            return {}, f"token {token!r}: force is true or false (got {force!r})."
        has = [0 <= v.get(token, -1) < n for v, n in zip(vocabularies, sizes, strict=True)]
        if not force and all(has):
            continue
        row, why = _token_row(token, setting.get("source"), models, vocabularies, sizes, base)
        if why is not None:
            return {}, why
        out[token] = TokenSource(row, force)
    return out, None


def _token_row(token: str, source: Any, models: list[str], vocabularies: list[dict[str, int]], sizes: list[int],
               base: int | None) -> tuple[tuple, str | None]:
    """The row table entry of one token's source (see token_sources)."""
    def model_index(ref: Any) -> int | None:
        return models.index(ref) if isinstance(ref, str) and ref in models else None

    if source is None:
        return (), f"token {token!r}: a model lacks it (or it is forced), so it needs a source (mergekit fails without one)."
    if isinstance(source, str):
        i = model_index(source)
        if i is None:
            return (), f"token {token!r}: its source {source!r} is not one of the merged models {models}."
        if not 0 <= vocabularies[i].get(token, -1) < sizes[i]:
            return (), f"token {token!r}: its source {source!r} does not have it."
        return ((i, vocabularies[i][token]),), None
    if isinstance(source, Mapping) and source.get("kind") == "zero" and set(source) == {"kind"}:
        return (), None
    if isinstance(source, Mapping) and source.get("kind") == "model_token" and set(source) <= {"kind", "model", "token", "token_id"}:
        i = model_index(source.get("model"))
        if i is None:
            return (), f"token {token!r}: its source model {source.get('model')!r} is not one of the merged models {models}."
        if ("token" in source) == ("token_id" in source):
            return (), f"token {token!r}: give exactly one of token and token_id (mergekit's rule)."
        if "token_id" in source:
            row = source["token_id"]
            if isinstance(row, bool) or not isinstance(row, int) or row < 0:
                return (), f"token {token!r}: token_id is a row number (got {row!r})."
            return ((i, row),), None
        vocab = vocabularies[i] if i != base else {t: r for t, r in vocabularies[i].items() if r < sizes[i]}
        if source["token"] not in vocab:
            return (), f"token {token!r}: {source['token']!r} is not in {models[i]!r}'s vocabulary."
        return ((i, vocab[source["token"]]),), None
    return (), (f"token {token!r}: source is a model, {{kind: zero}} or {{kind: model_token, model, token | token_id}} "
                f"(got {source!r}).")
