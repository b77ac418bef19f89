"""mergekit's merge configs (the YAML `mergekit-yaml` reads) as a mapper over a multi-source checkpoint.

`config_mapper(config, names)` turns one config (already parsed: a mapping) into the mapper that does the same
merge, `names` mapping each model reference of the config to its source name in the multi-source checkpoint
(`wb.merge_config` opens it). The keys mergekit documents map as follows:

- `models:` (each `model` with its `parameters`) -> `M.presets.merge(merge_method, ...)`, the model's
  parameters first, then the global `parameters`;
- `slices:` (each with `sources`: `model`, `layer_range`, `parameters`; and its own `base_model` /
  `parameters`) -> `MergeSlices` plus a config.json update of `num_hidden_layers`;
- `merge_method`, `base_model`, `parameters`, `dtype`, `out_dtype` -> the same-named arguments;
- `tokenizer_source` / `tokenizer.source` (`base`, `union`, a model) and `chat_template`: the `tokenizer` steps
  `wb.merge_config` builds from the models' tokenizer files (`workbench/mergekit_tokenizer.py`: rows moved by
  token with `AlignVocabulary`, config.json's vocab_size, the tokenizer files as `OutputFile` statements);
  without them (a config mapped on its own) carried out where every model's vocabulary is the same
  (`same_vocabulary=True`), `base` over different vocabularies with the `align` step, otherwise refused;
- `tokenizer.tokens`, `tokenizer.pad_to_multiple_of`: carried out by those `tokenizer` steps, refused without;
- anything else (`modules:`, a misspelt key) -> `Refused`, a
  plan problem naming the key: mergekit ignores unknown keys silently, the workbench does not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import MapperError
from ..base import Mapper
from ..compose import Sequential
from ..config_update import ConfigUpdate
from ..merge.methods import METHODS
from ..merge.models import merge
from ..merge.refusal import Refused
from ..merge.slices import check_slices, merge_slices, num_layers

TOP_KEYS = ("models", "slices", "merge_method", "base_model", "parameters", "dtype", "out_dtype", "tokenizer_source",
            "tokenizer", "chat_template", "modules")
MODEL_KEYS = {"model", "parameters"}
SECTION_SETTINGS = ("tokens", "pad_to_multiple_of")  # of the tokenizer section, carried out by the `tokenizer` steps


def model_references(config: Mapping[str, Any]) -> list[str]:
    """Every model the config reads, the base model first (it becomes the checkpoint's primary source), then in
    order of mention; MapperError when a model entry is malformed."""
    refs: list[str] = []
    base = config.get("base_model")
    if base is not None:
        refs.append(_reference(base, "base_model"))
    for i, entry in enumerate(config.get("models") or []):
        if not isinstance(entry, Mapping) or "model" not in entry:
            raise MapperError(f"Cannot read merge config: models[{i}] is {entry!r}; give {{'model': PATH, 'parameters': {{...}}}}.")
        refs.append(_reference(entry["model"], f"models[{i}].model"))
    for i, item in enumerate(config.get("slices") or []):
        for j, src in enumerate(item.get("sources") or [] if isinstance(item, Mapping) else []):
            if isinstance(src, Mapping) and "model" in src:
                refs.append(_reference(src["model"], f"slices[{i}].sources[{j}].model"))
        if isinstance(item, Mapping) and item.get("base_model") is not None:
            refs.append(_reference(item["base_model"], f"slices[{i}].base_model"))
    if isinstance(config.get("tokenizer_source"), str) and config["tokenizer_source"] not in ("base", "union"):
        refs.append(_reference(config["tokenizer_source"], "tokenizer_source"))
    section = config.get("tokenizer")
    if isinstance(section, Mapping) and isinstance(section.get("source"), str) and section["source"] not in ("base", "union"):
        refs.append(_reference(section["source"], "tokenizer.source"))
    return list(dict.fromkeys(refs))


def _reference(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise MapperError(f"Cannot read merge config: {where} is {value!r}; give a model path or Hub id as text.")
    return value


def tokenizer_source(config: Mapping[str, Any]) -> tuple[str | None, list[Refused]]:
    """The config's tokenizer source (`tokenizer_source`, or `tokenizer.source`) and refusals of the tokenizer
    settings the workbench does not carry out."""
    refused: list[Refused] = []
    source = config.get("tokenizer_source")
    tokenizer = config.get("tokenizer")
    if tokenizer is not None:
        if source is not None:
            refused.append(Refused("tokenizer", "give either tokenizer_source or tokenizer, not both (mergekit refuses that too)."))
        if not isinstance(tokenizer, Mapping):
            refused.append(Refused("tokenizer", f"expected a mapping with 'source' (got {tokenizer!r})."))
        else:
            source = tokenizer.get("source", "union")  # mergekit's default for a tokenizer section
            for key in tokenizer:
                if key in SECTION_SETTINGS and tokenizer[key] not in (None, {}, []):
                    refused.append(Refused(f"tokenizer.{key}", "per-token embeddings and padding the vocabulary are carried "
                                           "out by wb.merge_config (it reads the models' tokenizers); this mapper was built "
                                           "without them. Use wb.merge_config, or remove the key."))
                elif key not in ("source", *SECTION_SETTINGS):
                    refused.append(Refused(f"tokenizer.{key}", f"mergekit's tokenizer section takes source, "
                                           f"{', '.join(SECTION_SETTINGS)}."))
    return source, refused


def config_mapper(config: Mapping[str, Any], names: Mapping[str, str], *, same_vocabulary: bool = True,
                  seed: int | None = None, align: Mapper | None = None, tokenizer: Sequence[Mapper] | None = None) -> Mapper:
    """The mapper doing the merge `config` describes (see the module docstring); `names`: model reference -> source
    name; `same_vocabulary`: whether every model's tokenizer has the same tokens at the same ids (the tokenizer
    settings are refused otherwise, unless `align` is given: the step moving every model's vocabulary rows to the
    output vocabulary, run before the merge); `seed`: the random methods' seed (mergekit's `--random-seed`);
    `tokenizer`: the steps carrying out `tokenizer_source` / `tokenizer.source` and `chat_template` (row moves,
    vocab_size, tokenizer files, refusals; built by `wb.merge_config`, which reads the models' tokenizer files) —
    given, they replace the refusals of those keys and run before the merge."""
    if not isinstance(config, Mapping):
        raise MapperError(f"Cannot read merge config: expected a mapping of keys such as merge_method, models (got {type(config).__name__}).")
    refused: list[Refused] = []
    for key in config:
        if key not in TOP_KEYS:
            refused.append(Refused(str(key), f"mergekit does not document it (it would ignore it silently). Supported keys: "
                                   f"{', '.join(k for k in TOP_KEYS if k != 'modules')}."))
    if config.get("modules") is not None:
        refused.append(Refused("modules", "multi-module (vision/text) merges are not supported; merge with models: or slices:."))
    if config.get("chat_template") is not None and tokenizer is None:
        refused.append(Refused("chat_template", "the workbench copies the primary model's tokenizer files as they are; set the "
                               "chat template in the output's tokenizer_config.json yourself."))
    source, more = tokenizer_source(config)
    handled = {f"tokenizer.{key}" for key in SECTION_SETTINGS} if tokenizer is not None else set()
    refused += [r for r in more if r.key not in handled]
    if source is not None and not same_vocabulary and align is None and tokenizer is None:
        if source == "base":
            why = ("moving the embedding and lm_head rows to the base vocabulary (the models' vocabularies differ) needs "
                   "base_model, models: (not slices) and a readable tokenizer.json in every model folder.")
        else:
            why = (f"{source!r} over different vocabularies (the models' vocabularies differ) needs a new tokenizer built "
                   "and written, which the workbench does not do (it does carry out tokenizer_source: base). Run mergekit "
                   "for this merge, or align the vocabularies first.")
        refused.append(Refused("tokenizer_source", why))
    method = config.get("merge_method")
    if not isinstance(method, str):
        raise MapperError(f"Cannot read merge config: merge_method is {method!r}; give one of mergekit's methods, e.g. 'slerp'.")
    models, slices = config.get("models"), config.get("slices")
    if bool(models) == bool(slices):
        if config.get("modules") is None:
            raise MapperError("Cannot read merge config: give exactly one of models: or slices: (mergekit's rule).")
        return Sequential(*refused)
    base = names[config["base_model"]] if config.get("base_model") is not None else None
    common = {"parameters": config.get("parameters") or {}, "dtype": config.get("dtype"), "out_dtype": config.get("out_dtype"),
              "seed": seed, "rng": "mergekit" if getattr(METHODS.get(method), "random", False) else "tensor"}
    # random methods draw from mergekit's one stream (its bytes under the same seed); the others need no stream
    if not isinstance(common["parameters"], Mapping):
        raise MapperError(f"Cannot read merge config: parameters is {common['parameters']!r}; give a mapping name -> value.")
    steps: list[Mapper] = [align] if align is not None and not same_vocabulary else []
    steps += list(tokenizer or [])
    if models:
        model_names, model_parameters = [], {}
        for i, entry in enumerate(models):
            unknown = sorted(set(entry) - MODEL_KEYS)
            for key in unknown:
                refused.append(Refused(f"models[{i}].{key}", f"a model entry takes {sorted(MODEL_KEYS)}."))
            name = names[entry["model"]]
            model_names.append(name)
            if entry.get("parameters"):
                model_parameters[name] = dict(entry["parameters"])
        steps.append(merge(method, model_names, base_model=base, model_parameters=model_parameters, **common))
    else:
        renamed = []
        for item in check_slices(slices):
            renamed.append({**item, "sources": [{**src, "model": names[src["model"]]} for src in item["sources"]],
                            **({"base_model": names[item["base_model"]]} if item.get("base_model") else {})})
        steps.append(merge_slices(method, renamed, base_model=base, **common))
        steps.append(ConfigUpdate("num_hidden_layers", num_layers(renamed), why="the slices make this many layers"))
    return Sequential(*steps, *refused) if len(steps) + len(refused) > 1 else steps[0]
