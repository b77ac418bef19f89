"""Merging (and unmerging) a PEFT LoRA adapter read from PEFT's own files into its base checkpoint.

The adapter folder holds `adapter_config.json` and `adapter_model.safetensors`; its keys look like
`base_model.model.<module>.lora_A.weight`. The mapper built here reads the adapter's tensors from the
source named `source` of a multi-source catalog (`adapter::base_model.model...`, see
workbench.formats.multi) and the base weights under their own names, and writes merged weights under
the base names, exactly as `PeftModel.merge_and_unload()` computes them:

- LoRA: `W + transpose(B @ A, fan_in_fan_out) * scaling`, scaling `alpha / r` (rsLoRA `alpha / sqrt(r)`),
  with `r` and `alpha` per module from `rank_pattern` / `alpha_pattern` (PEFT's matching rule);
- LoRA biases (`lora_bias=True`): `bias + lora_B.bias * scaling`;
- DoRA: `m / ‖W + ΔW‖ · (W + ΔW)`, the norm taken over each output row (PEFT's `get_weight_norm`:
  `linalg.norm(transpose(W + ΔW, fan_in_fan_out), dim=1)`), the factor broadcast along output rows;
- `modules_to_save` (and any other saved base parameter, e.g. `<module>.base_layer.bias` with `bias="all"` or
  `"lora_only"`): the adapter's copy replaces the base's; a replaced input embedding that the base ties its
  output head to is untied as PEFT does (`_replacements`, needs `base=`);
- PiSSA / OLoRA (`init_lora_weights`): onto the residual base PEFT recomputes when it loads the adapter
  (`residual_base`); the inits no merge can reproduce are refused (adapter_config.base_change).
The config is read and checked once (`adapter_config`): a value no adapter has (r 0, alpha NaN, "16") is a
problem naming the file and the key. Anything the adapter holds that this module does not understand (a key,
a config setting) becomes a problem of the plan, never silently ignored. `unmerge=True` builds the reverse
(`W - ΔW`), defined for plain LoRA and LoRA biases only: DoRA, residual inits and replaced modules cannot be
recovered from a merged weight.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...catalog import TensorInfo
from ...errors import MapperError
from ..base import Mapper
from ..compose import Parallel
from ..config_update import ConfigUpdate
from ..function import Function
from ..ops import Drop, Rename
from .adapter_config import CONFIG_FILE, AdapterSettings, pattern_key, read_config, short, validate

__all__ = ["CONFIG_FILE", "PEFT_PREFIX", "pattern_key", "peft_merge", "read_adapter", "residual_base"]

PEFT_PREFIX = "base_model.model."
_HERE = "workbench.mapper.presets.lora"

# Config keys whose value lora_merge reads (adapter_config.validate checks them) or that only describe training
# or initialisation: they do not change how a saved adapter merges. Any other key set to a non-default value is
# a problem of the plan.
_NEUTRAL = {
    "alpha_pattern", "rank_pattern", "r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out", "lora_bias",
    "modules_to_save", "target_modules", "peft_type", "task_type", "base_model_name_or_path", "revision",
    "peft_version", "inference_mode", "init_lora_weights", "lora_dropout", "layers_to_transform", "layers_pattern",
    "exclude_modules", "auto_mapping", "bias", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "qalora_group_size", "megatron_core", "ensure_weight_tying",
}
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_magnitude_vector)$")
_BASE_LAYER = ".base_layer."


def _is_default(value: Any) -> bool:
    return value is None or value is False or value in ({}, [], "none", "")


def read_adapter(adapter: str | os.PathLike | Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, TensorInfo], str]:
    """(config, adapter tensors by key, folder) of an adapter folder, its adapter_config.json, or
    a mapping {'config': {...}, 'tensors': {key: TensorInfo}} for adapters known from metadata only."""
    if isinstance(adapter, Mapping):
        if "config" in adapter and "tensors" in adapter and isinstance(adapter["config"], Mapping):
            return dict(adapter["config"]), dict(adapter["tensors"]), ""
        raise MapperError(
            "Cannot read the PEFT adapter: a mapping must hold 'config' (adapter_config.json contents, an object) and "
            "'tensors' (key -> TensorInfo). Pass the adapter folder instead."
        )
    path = Path(adapter)
    folder = path.parent if path.name == CONFIG_FILE else path
    config = read_config(folder / CONFIG_FILE)
    from ...formats import open_catalog

    catalog = open_catalog(folder)
    return config, dict(catalog.tensors), str(folder)


def _problem(keys: list[str], source: str, reason: str) -> Mapper:
    """An op whose binding reports `reason` as a plan problem; it consumes adapter tensors `keys` (at least one)."""
    names = [f"{source}::{key}" for key in keys]
    return Function(fn=f"{_HERE}:refuse", inputs=names, outputs=names, infer=f"{_HERE}:infer_refuse", params={"reason": reason})


def _unknown_keys(config: Mapping[str, Any]) -> list[str]:
    return [f"its config sets {short(key)}: {short(value)}, which lora_merge does not know how to merge"
            for key, value in sorted(config.items()) if key not in _NEUTRAL and not _is_default(value)]


def _saved_target(key: str) -> str:
    """The base tensor a saved base parameter replaces: `x.base_layer.bias` (bias='all'/'lora_only' on a target
    module, saved under PEFT's wrapper) is the base's `x.bias`; any other key names the base tensor itself."""
    name = key[len(PEFT_PREFIX):]
    head, sep, tail = name.rpartition(_BASE_LAYER)
    return f"{head}.{tail}" if sep else name


def peft_merge(
    adapter: str | os.PathLike | Mapping[str, Any],
    *,
    source: str = "adapter",
    unmerge: bool = False,
    base: Any = None,
) -> Mapper:
    """A mapper that merges the PEFT adapter (folder, adapter_config.json path, or {'config','tensors'}) into
    the base weights of a multi-source catalog whose adapter source is named `source` (see the module docstring);
    `unmerge=True` subtracts it from already merged weights instead.

    `base` (the base model's folder or URL, its opened checkpoint, or its config.json as a mapping) tells whether the base ties its output head
    to the input embedding: an adapter that replaces a tied embedding (modules_to_save) is then merged as PEFT
    does (see `_replacements`); without it such an adapter needs the base to have its own `lm_head.weight`.
    """
    config, tensors, folder = read_adapter(adapter)
    where = f"{folder} ({CONFIG_FILE})" if folder else "(given config)"
    settings = validate(config)
    config_problems = settings.problems + _unknown_keys(config)
    reason = (f"Cannot merge the PEFT adapter {where}: " + "; ".join(config_problems)
              + ". Fix adapter_config.json (or re-save the adapter with PEFT), or merge it with PEFT instead.")
    if config_problems and not tensors:
        raise MapperError(reason, file=folder or None)
    modules: dict[str, dict[str, str]] = {}
    replaced: dict[str, str] = {}  # base tensor -> the adapter's key of its saved copy
    ops: list[Mapper] = []
    for key in tensors:
        if not key.startswith(PEFT_PREFIX):
            ops.append(_problem([key], source, f"Cannot merge the PEFT adapter {where}: tensor {key!r} does not start with "
                                               f"{PEFT_PREFIX!r}, so its base module is unknown. Re-save the adapter with PEFT."))
            continue
        match = _LORA_KEY.match(key[len(PEFT_PREFIX):])
        if match:
            modules.setdefault(match["module"], {})[match["part"]] = key
        elif ".lora_" in key or "lora_embedding" in key:
            ops.append(_problem([key], source, f"Cannot merge the PEFT adapter {where}: tensor {key!r} is a LoRA part "
                                               "lora_merge does not know (e.g. an embedding or convolution adapter). Merge it with PEFT."))
        else:  # a saved base parameter (modules_to_save, bias='all'/'lora_only'): the adapter's copy replaces the base's
            replaced[_saved_target(key)] = key
    if config_problems:  # one problem; no merge is built on values no adapter has
        rest = [k for parts in modules.values() for k in parts.values()] + list(replaced.values())
        return Parallel(*ops, _problem(rest, source, reason)) if rest else _problem(list(tensors), source, reason)
    if unmerge:
        ops += [_problem([key], source, f"Cannot unmerge the PEFT adapter {where}: {target!r} was replaced by the adapter's "
                                        "copy (modules_to_save or bias), the original is not in the merged weights.")
                for target, key in replaced.items()]
    else:
        lora_biases = {f"{module}.bias" for module, parts in modules.items() if "lora_B.bias" in parts}
        kept = {t: k for t, k in replaced.items() if t not in lora_biases}
        ops += _replacements(kept, source, where, _base_facts(base) if kept else (None, None))
    for module, parts in modules.items():
        ops += _module_ops(module, parts, settings, replaced, source, where, unmerge)
    return Parallel(*ops)


# The module names of input embeddings that transformers ties an output head to (tie_word_embeddings).
INPUT_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings")
OUTPUT_HEAD = "lm_head.weight"


def _base_facts(base: Any) -> tuple[dict | None, set | None]:
    """(the base's config.json, its tensor names) as far as `base` tells: a folder or URL, an opened checkpoint or
    catalog (its tensor names, and config.json when it is local), or a config mapping; (None, None) without it.
    The adapter's own `base_model_name_or_path` is not followed: an untrusted file does not choose which local
    folder is read."""
    from ...catalog import Catalog

    if base is None:
        return None, None
    catalog = getattr(base, "catalog", base)
    if isinstance(base, Mapping) and not isinstance(catalog, Catalog):
        return dict(base), None
    from .suggest import find_config

    opened = None
    if not isinstance(catalog, Catalog):
        from ...formats import open_catalog

        catalog = opened = open_catalog(base)
    try:
        sources = getattr(catalog, "sources", None)
        if sources:  # a multi-source checkpoint: its primary source is the base
            catalog = next(iter(sources.values()))
        names = set(catalog.tensors)
        path = find_config(catalog.url or catalog.root, catalog)  # a URL's config.json is fetched like a local one
        config = read_config(path, "Fix the base model's config.json (or pass base=None).") if path is not None else None
    finally:
        if opened is not None and opened.reader is not None:
            opened.reader.close()
    return config, names


def _tied(config: dict | None, names: set | None) -> bool | None:
    """Whether the base ties its output head to its input embedding: its config.json says so (transformers then
    saves no lm_head.weight), or says nothing and the checkpoint has no head of its own; None when unknown."""
    if config is None:
        return None if names is None else OUTPUT_HEAD not in names
    value = config.get("tie_word_embeddings")
    if isinstance(value, bool):
        return value
    return None if names is None else OUTPUT_HEAD not in names


def _replacements(replaced: dict[str, str], source: str, where: str, facts: tuple[dict | None, set | None]) -> list[Mapper]:
    """The ops that put the adapter's saved copies (modules_to_save, trained biases) in place of the base's tensors.

    PEFT on a tied model (tie_word_embeddings) with `modules_to_save=["embed_tokens"]`: the trained copy replaces
    the embedding only; the output head keeps the base's embedding, so merge_and_unload unties them and
    save_pretrained writes `lm_head.weight` (the base embedding) beside the new embedding, with
    `tie_word_embeddings: false` in config.json. Here the base embedding moves to `lm_head.weight` (a rename, no
    arithmetic) and a `ConfigUpdate` states the config edit, so no loader re-ties the head. With `ensure_weight_tying` PEFT saves the head too:
    a copy the base does not hold is added rather than replaced. When whether the base is tied is unknown (no
    `base=`), an adapter that replaces an input embedding needs the base's own `lm_head.weight`, or is refused.
    """
    config, names = facts
    tied = _tied(config, names)
    ops: list[Mapper] = []
    for target, key in replaced.items():
        copy = Rename(f"{source}::{key}", target)
        module = target.rsplit(".", 2)[-2] if target.count(".") >= 1 else ""
        embedding = target.endswith(".weight") and module in INPUT_EMBEDDINGS and OUTPUT_HEAD not in replaced
        if target == OUTPUT_HEAD and tied and (names is None or target not in names):
            ops.append(copy)  # a tied head PEFT saved too (ensure_weight_tying), which the base does not hold: added
        elif embedding and tied and (names is None or OUTPUT_HEAD not in names):
            ops += [Rename(target, OUTPUT_HEAD), copy,  # untie as PEFT does: the head keeps the base embedding
                    ConfigUpdate("tie_word_embeddings", False, why="lora_merge unties the head from the replaced embedding, as PEFT does")]
        elif embedding and tied is None:
            # the base must then have its own head: if it has none (tied), binding stops here, this op in the message
            # (kept short: the whole op, `why` included, fits in the one-line form the binding message quotes)
            ops += [Drop(target), copy, Function(fn=f"{_HERE}:keep_head", inputs=[OUTPUT_HEAD], outputs=[OUTPUT_HEAD],
                                                 params={"why": "tied? pass base= to lora_merge"})]
        else:
            ops += [Drop(target), copy]
    return ops


def _module_ops(module: str, parts: dict[str, str], settings: AdapterSettings, replaced: dict[str, str], source: str,
                where: str, unmerge: bool) -> list[Mapper]:
    """The merge (or unmerge) of one LoRA module's weight and bias, or the problem that prevents it."""
    if "lora_A.weight" not in parts or "lora_B.weight" not in parts:
        return [_problem(list(parts.values()), source, f"Cannot merge the PEFT adapter {where}: module {module!r} lacks "
                         "lora_A or lora_B. The adapter file is incomplete; re-save it with PEFT.")]
    dora = "lora_magnitude_vector" in parts
    if dora != settings.use_dora:
        said = "use_dora is true but the adapter holds no lora_magnitude_vector for" if settings.use_dora else \
            "use_dora is false but the adapter holds a lora_magnitude_vector for"
        return [_problem(list(parts.values()), source, f"Cannot merge the PEFT adapter {where}: {said} module {module!r}, "
                         "so it is neither plain LoRA nor DoRA. Re-save the adapter with PEFT.")]
    if unmerge and (dora or settings.init):
        why = ("was rescaled by the DoRA magnitude vector and the norm it divided by is not in the merged weight" if dora else
               f"lost its top-r part to {settings.init} initialisation, which is not in the merged weight")
        return [_problem(list(parts.values()), source, f"Cannot unmerge the PEFT adapter {where}: {module!r} {why}. Keep "
                         "the base checkpoint instead.")]
    r, _ = settings.rank_alpha(module)
    scale = settings.scale(module)
    scoped = {part: f"{source}::{k}" for part, k in parts.items()}
    weight = f"{module}.weight"
    params: dict[str, Any] = {"scale": scale, "fan_in_fan_out": settings.fan_in_fan_out, "rank": int(r)}
    if settings.init:
        params["init"] = settings.init
    ops: list[Mapper] = []
    if dora:
        ops.append(Function(fn=f"{_HERE}:merge_dora", infer=f"{_HERE}:infer_merge_dora", params=params, outputs=[weight],
                            inputs=[weight, scoped["lora_A.weight"], scoped["lora_B.weight"], scoped["lora_magnitude_vector"]]))
    else:
        ops.append(Function(fn=f"{_HERE}:merge_linear", infer=f"{_HERE}:infer_merge_linear", outputs=[weight],
                            inputs=[weight, scoped["lora_A.weight"], scoped["lora_B.weight"]],
                            params={**params, "sign": -1.0 if unmerge else 1.0}))
    if "lora_B.bias" in parts:
        bias = f"{module}.bias"
        saved = replaced.get(bias)  # bias='all'/'lora_only' too: the LoRA bias adds to the adapter's trained bias
        if saved and not unmerge:
            ops.append(Drop(bias))
        ops.append(Function(fn=f"{_HERE}:merge_bias", infer=f"{_HERE}:infer_merge_bias", outputs=[bias],
                            inputs=[f"{source}::{saved}" if saved and not unmerge else bias, scoped["lora_B.bias"]],
                            params={"scale": scale, "sign": -1.0 if unmerge else 1.0}))
    return ops


# -- the callables the Function ops name -----------------------------------------------------------------
def _delta(lora_a: Any, lora_b: Any, scale: float, fan_in_fan_out: bool) -> Any:
    """PEFT's `get_delta_weight`: `transpose(B @ A, fan_in_fan_out) * scaling`, in float32 for half inputs."""
    import torch

    a, b = lora_a, lora_b
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        a, b = a.to(torch.float32), b.to(torch.float32)
    delta = b @ a
    if fan_in_fan_out:
        delta = delta.T
    return delta * scale


def residual_base(weight: Any, *, init: str, rank: int, scale: float, fan_in_fan_out: bool) -> Any:
    """The base weight PEFT applies a saved PiSSA / OLoRA adapter to: loading re-runs the initialisation, which
    subtracts `scaling · B₀A₀` — the top-`rank` part of the weight by SVD (PiSSA) or QR (OLoRA) — from it.

    The same float32 steps as PEFT's `pissa_init` / `olora_init`, in the same order, rounded to the weight's dtype
    as PEFT stores the residual.
    """
    import torch

    base = weight.to(torch.float32)
    if init == "pissa":
        rows = base.T if fan_in_fan_out else base
        v, s, uh = torch.linalg.svd(rows, full_matrices=False)
        sr = s[:rank] / scale
        lora_a = torch.diag(torch.sqrt(sr)) @ uh[:rank]
        lora_b = v[:, :rank] @ torch.diag(torch.sqrt(sr))
        rows = rows - scale * lora_b @ lora_a
        return (rows.T if fan_in_fan_out else rows).to(weight.dtype)
    if init == "olora":
        q, r = torch.linalg.qr(base)
        return (base - scale * q[:, :rank].contiguous() @ r[:rank].contiguous()).to(weight.dtype)
    raise MapperError(f"Cannot merge LoRA: init_lora_weights {init!r} is not one lora_merge reproduces (pissa, olora).")


def _base(weight: Any, init: str | None, rank: int, scale: float, fan_in_fan_out: bool) -> Any:
    """The weight the update adds to, in float32: the stored one, or PEFT's residual for PiSSA / OLoRA."""
    import torch

    if init:
        weight = residual_base(weight, init=init, rank=rank, scale=scale, fan_in_fan_out=fan_in_fan_out)
    return weight if weight.dtype == torch.float32 else weight.to(torch.float32)


def _finite(out: Any, scale: float, *inputs: Any) -> Any:
    """`out`, unless the merge made non-finite values from finite inputs (a huge but finite lora_alpha, or a result
    beyond the weight's dtype): refused rather than written."""
    import torch

    if bool(torch.isfinite(out).all()) or not all(bool(torch.isfinite(t).all()) for t in inputs):
        return out
    raise MapperError(f"Cannot merge LoRA: the merged values are not finite although the base and the adapter are "
                      f"(scaling {scale:g}, result {out.dtype}). Check lora_alpha / alpha_pattern in adapter_config.json")


def merge_linear(weight: Any, lora_a: Any, lora_b: Any, *, scale: float, fan_in_fan_out: bool, rank: int, sign: float = 1.0,
                 init: str | None = None) -> Any:
    """`W ± ΔW` (see `_delta`), computed in float32 and returned in the weight's dtype; `init`: see `residual_base`."""
    delta = _delta(lora_a, lora_b, scale, fan_in_fan_out)
    base = _base(weight, init, rank, scale, fan_in_fan_out)
    out = base + delta if sign > 0 else base - delta
    return _finite(out.to(weight.dtype), scale, weight, lora_a, lora_b)


def merge_dora(weight: Any, lora_a: Any, lora_b: Any, magnitude: Any, *, scale: float, fan_in_fan_out: bool, rank: int,
               init: str | None = None) -> Any:
    """PEFT's DoRA merge: `m / ‖W + ΔW‖_row · (W + ΔW)`, in float32, returned in the weight's dtype."""
    import torch

    delta = _delta(lora_a, lora_b, scale, fan_in_fan_out)
    merged = _base(weight, init, rank, scale, fan_in_fan_out) + delta
    rows = merged.T if fan_in_fan_out else merged
    norm = torch.linalg.norm(rows, dim=1)
    factor = (magnitude.to(torch.float32) / norm).view(-1, 1)
    if fan_in_fan_out:
        factor = factor.T
    return _finite((factor * merged).to(weight.dtype), scale, weight, lora_a, lora_b, magnitude)


def merge_bias(bias: Any, lora_bias: Any, *, scale: float, sign: float = 1.0) -> Any:
    """`bias ± lora_B.bias * scaling` (PEFT's `lora_bias=True`), in float32, returned in the bias's dtype."""
    import torch

    extra = lora_bias.to(torch.float32) * scale
    base = bias.to(torch.float32)
    return _finite((base + extra if sign > 0 else base - extra).to(bias.dtype), scale, bias, lora_bias)


def keep_head(tensor: Any, *, why: str) -> Any:
    """The output head unchanged: the op exists so that the plan needs the base's own head when lora_merge was not
    told whether the base ties it to the embedding the adapter replaces (see `_replacements`): binding a tied base,
    which has none, then fails on this op, whose `why` says what to do."""
    return tensor


def refuse(*tensors: Any, reason: str) -> Any:
    """Never computes: the op only exists to put `reason` in the plan."""
    raise MapperError(reason)


def infer_refuse(*infos: TensorInfo, reason: str) -> Any:
    """Report `reason` as a problem when the mapper is bound."""
    raise MapperError(reason, tensor=infos[0].name if infos else None)


def _fits(weight: TensorInfo, lora_a: TensorInfo, lora_b: TensorInfo, fan_in_fan_out: bool) -> bool:
    if len(weight.shape) != 2 or len(lora_a.shape) != 2 or len(lora_b.shape) != 2:
        return False
    rows, cols = weight.shape[::-1] if fan_in_fan_out else weight.shape
    return lora_b.shape[0] == rows and lora_a.shape[1] == cols and lora_b.shape[1] == lora_a.shape[0]


def infer_merge_linear(weight: TensorInfo, lora_a: TensorInfo, lora_b: TensorInfo, *, scale: float, fan_in_fan_out: bool,
                       rank: int, sign: float = 1.0, init: str | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """The weight's metadata; checks that the adapter's shapes fit the weight and the configured rank."""
    if not _fits(weight, lora_a, lora_b, fan_in_fan_out):
        layout = " (fan_in_fan_out: the weight is stored [in, out])" if fan_in_fan_out else ""
        raise MapperError(
            f"Cannot merge LoRA into {weight.name!r} {list(weight.shape)}{layout}: lora_A is {list(lora_a.shape)} and lora_B "
            f"is {list(lora_b.shape)}. Check that the adapter belongs to this base model.", tensor=weight.name)
    if lora_a.shape[0] != rank:
        raise MapperError(
            f"Cannot merge LoRA into {weight.name!r}: its rank is {lora_a.shape[0]} ({lora_a.name}) but adapter_config.json "
            f"says r={rank} for this module (r / rank_pattern). The scaling would be wrong; fix the config.", tensor=weight.name)
    if init and (weight.dtype not in ("F32", "F16", "BF16") or rank > min(weight.shape)):
        raise MapperError(
            f"Cannot merge the {init} adapter into {weight.name!r} ({weight.dtype} {list(weight.shape)}): PEFT's {init} "
            f"initialisation needs a float32/16 or bfloat16 weight with at least r={rank} rows and columns. Check that the "
            "adapter belongs to this base model.", tensor=weight.name)
    return [(weight.dtype, weight.shape)]


def infer_merge_dora(weight: TensorInfo, lora_a: TensorInfo, lora_b: TensorInfo, magnitude: TensorInfo, *, scale: float,
                     fan_in_fan_out: bool, rank: int, init: str | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """As `infer_merge_linear`, and the magnitude vector has one entry per output row."""
    out = infer_merge_linear(weight, lora_a, lora_b, scale=scale, fan_in_fan_out=fan_in_fan_out, rank=rank, init=init)
    rows = weight.shape[1] if fan_in_fan_out else weight.shape[0]
    if tuple(magnitude.shape) != (rows,):
        raise MapperError(f"Cannot merge DoRA into {weight.name!r}: its magnitude vector is {list(magnitude.shape)}, expected "
                          f"[{rows}]. Check that the adapter belongs to this base model.", tensor=weight.name)
    return out


def infer_merge_bias(bias: TensorInfo, lora_bias: TensorInfo, *, scale: float, sign: float = 1.0) -> list[tuple[str, tuple[int, ...]]]:
    """The bias's metadata; the LoRA bias must have its shape."""
    if tuple(bias.shape) != tuple(lora_bias.shape):
        raise MapperError(f"Cannot merge the LoRA bias {lora_bias.name!r} {list(lora_bias.shape)} into {bias.name!r} "
                          f"{list(bias.shape)}. Check that the adapter belongs to this base model.", tensor=bias.name)
    return [(bias.dtype, bias.shape)]
