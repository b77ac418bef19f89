"""Which presets apply to a checkpoint: the model type from its config.json, and the names it holds.

`suggest(names, config)` answers from metadata alone (tensor names and the config): it never reads a
tensor and never builds a model. Each row names a function of `workbench.mapper.presets` and says why
it applies; `build_preset(name, source, config)` calls that function with what it needs (the CLI's
`--preset NAME`).

A layout preset is offered only when it binds (as its plan would) to a representative sample of the
checkpoint (`representative`): every tensor outside repeated layers, and of each stack of numbered
layers its first layer plus the first layer of every distinct per-layer signature (tensor names within
the layer, dtypes and shapes). Layers with the same signature bind the same way, so the answer is the one
the whole table would give, at the cost of a few layers instead of 10^5 tensors.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ...catalog import TensorInfo
from ...errors import MapperError, WorkbenchError
from .model_shape import read_config

LLAMA_LIKE = ("llama", "mistral")
SCALE_SUFFIX = "_scale_inv"  # FP8 block scales beside their weight (quantized.SCALE_SUFFIX; quantized imports layouts)
# Layout presets built from the config alone: offered only when they bind to the checkpoint's tensors (when the
# caller passes TensorInfos, e.g. `catalog.tensors`), so a suggestion is never a plan that then fails.
BOUND_BEFORE_OFFERED = ("hf_to_fused", "fused_to_hf", "hf_to_meta", "meta_to_hf", "megatron_qkv_to_hf", "from_transformers")
MEGATRON_SHARD = re.compile(r"^mp_rank_\d{2}(?:_\d{3}){0,2}/")
# The first all-digit segment of a name: the index of a repeated layer ('model.layers.7.mlp...' -> '7').
LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def _transformers_changes(model_type: str, names: list[str]) -> int | None:
    """How many `names` transformers' registry rules for `model_type` touch (None: transformers or rules absent)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # pragma: no cover
        return None
    rules = get_checkpoint_conversion_mapping(model_type)
    if not rules:
        return None
    return sum(1 for name in names if any(rule.compiled_sources.search(name) for rule in rules))


def suggest(names: Iterable[str], config: Any = None) -> Any:
    """A DataFrame (columns `preset`, `why`) of the presets that apply; the model type is in `.attrs['model_type']`."""
    import pandas as pd

    model_type, rows = suggest_rows(names, config)
    frame = pd.DataFrame(rows, columns=["preset", "why"])
    frame.attrs["model_type"] = model_type
    return frame


def suggest_rows(names: Iterable[str], config: Any = None, *, registry: bool = True) -> tuple[str | None, list[tuple[str, str]]]:
    """The model type and (preset, why) rows. `registry=False` never imports transformers (nor torch): the
    transformers layout is then suggested when the names hold numbered experts, without counting the changes.
    When `names` is a mapping name -> TensorInfo (`catalog.tensors`), the layout presets in `BOUND_BEFORE_OFFERED`
    are bound first (metadata only) to its `representative` sample and left out when their binding has errors
    (from_transformers only with `registry=True`)."""
    infos = names if isinstance(names, Mapping) else None
    names = list(names)
    data = read_config(config)
    model_type = data.get("model_type")
    rows: list[tuple[str, str]] = []
    quant = data.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
    if method == "fp8" or any(n.endswith(".weight_scale_inv") for n in names):
        block = quant.get("weight_block_size") if isinstance(quant, dict) else None
        rows.append(("dequantize_fp8", f"FP8 weights with block scales (weight_scale_inv{f', block {block}' if block else ''}): "
                                       "dequantise to bf16/fp32"))
    if method == "mxfp4" or any(n.endswith("_blocks") for n in names) and any(n.endswith("_scales") for n in names):
        rows.append(("dequantize_mxfp4", "MXFP4 weights (*_blocks + *_scales): dequantise to bf16/fp32"))
    packed = _packed_method(quant, method, names)
    if packed:
        rows.append(("decompress", f"{packed} packed weights: dequantise to bf16 (or the config's dtype)"))
    if model_type and not registry:
        if any(re.search(r"\.experts\.\d+\.", n) for n in names):
            rows.append(("from_transformers", f"{model_type} stores one tensor per expert; transformers 5 holds them stacked "
                                              "(ck.suggest() in Python counts the tensors its rules change)"))
    elif model_type:
        changed = _transformers_changes(model_type, names)
        if changed:
            rows.append(("from_transformers", f"transformers 5 loads {model_type} through its conversion rules: {changed} of "
                                              f"{len(names)} tensors change (experts stacked, fused or renamed); this gives its "
                                              "in-memory layout (.inverse(source): the save direction)"))
    rows = _chain_dequantising(rows, names)
    if "token_embd.weight" in names and any(n.startswith("blk.") for n in names):
        rows.append(("gguf_to_hf", "llama.cpp GGUF tensors (token_embd, blk.N.*): HF names and layout, quantised types "
                                   "de-quantised, config.json and tokenizer files from the GGUF metadata"))
    has = set(n.split(".", 3)[-1] if n.startswith("model.layers.") else n for n in names)
    if {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"} <= has and data.get("num_attention_heads"):
        if {"mlp.gate_proj.weight", "mlp.up_proj.weight"} <= has:
            rows.append(("hf_to_fused", "separate q/k/v and gate/up projections: fuse them into qkv_proj and gate_up_proj"))
        if model_type in LLAMA_LIKE and not any(part in has for part in ("self_attn.q_proj.bias", "self_attn.q_norm.weight")):
            rows.append(("hf_to_meta", f"{model_type} in HF layout: Meta's original names with the rotary permutation undone"))
    if {"self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"} <= has:  # the layout hf_to_fused writes: both fused
        rows.append(("fused_to_hf", "fused qkv_proj/gate_up_proj: split back into HF projections"))
    shards = [n for n in names if MEGATRON_SHARD.match(n)]
    if shards:
        rows.append(("megatron_to_hf", "Megatron rank shards (mp_rank_*): merge TP/PP and map to HF Llama/Qwen2 names"))
        rows.append(("megatron_merge", "Megatron rank shards (mp_rank_*): merge TP/PP into whole tensors, Megatron names"))
    elif any(n.startswith("decoder.layers.") and ".self_attention.linear_qkv." in n for n in names):
        rows.append(("megatron_to_hf", "Megatron-core names (torch_dist or merged): map to HF Llama/Qwen2 names (needs config.json)"))
    elif any(n.startswith("model.layers.") and ".self_attention.linear_qkv." in n for n in names):
        rows.append(("megatron_qkv_to_hf", "Megatron interleaved QKV: split into HF q/k/v"))
    if any(n.startswith("layers.") and ".attention.wq." in n for n in names):
        rows.append(("meta_to_hf", "Meta original Llama names: HF names with HF's rotary permutation"))
    elif any(re.match(r"mp\d+/layers\.\d+\.attention\.wq\.", n) for n in names):
        rows.append(("meta_mp_merge", "Meta model-parallel files (mp<r>/...): merge into whole tensors; then meta_to_hf "
                                      "(--preset meta_mp_merge,meta_to_hf)"))
    checked = set(BOUND_BEFORE_OFFERED) - (set() if registry else {"from_transformers"})  # registry=False: no transformers
    checked |= {name for name, _ in rows if "," in name and (registry or "from_transformers" not in name)}
    if config is None:  # nothing to build them from: say so rather than offer a preset that cannot run as it is
        rows = [(name, why + " (needs the model's config.json beside the checkpoint)") if name in checked else (name, why)
                for name, why in rows]
    elif infos is not None and any(row[0] in checked for row in rows) \
            and all(isinstance(info, TensorInfo) for info in infos.values()):
        sample = representative(infos)
        rows = [row for row in rows if row[0] not in checked or _binds(row[0], sample, config)]
    return model_type, rows


def _chain_dequantising(rows: list[tuple[str, str]], names: list[str]) -> list[tuple[str, str]]:
    """With quantised tensors in the names and transformers' layout offered: the one recipe that dequantises then
    lays out (`dequantize_fp8,from_transformers`), first, instead of `from_transformers` alone (whose plan would
    name the scales left behind)."""
    kinds = {"decompress": True,  # offered only when the config describes packed weights
             "dequantize_fp8": any(n.endswith(SCALE_SUFFIX) for n in names),
             "dequantize_mxfp4": any(n.endswith("_blocks") for n in names) and any(n.endswith("_scales") for n in names)}
    first = [name for name, _ in rows if kinds.get(name)]
    if not first or "from_transformers" not in [name for name, _ in rows]:
        return rows
    chain = ",".join([*first, "from_transformers"])
    steps = ", ".join(f"M.presets.{name}(config)" for name in first)
    why = (f"quantised weights dequantised to bf16, then transformers 5's in-memory layout (experts stacked): "
           f"M.Sequential({steps}, M.presets.from_transformers(config)) (workbench convert --preset {chain})")
    return [(chain, why)] + [row for row in rows if row[0] != "from_transformers"]


def _packed_method(quant: Any, method: str, names: list[str]) -> str:
    """How the config says weights are packed ('compressed-tensors pack-quantized', 'GPTQ 4-bit', ...) when the names
    hold such weights, else ''."""
    if not isinstance(quant, dict):
        return ""
    sparsity = quant.get("sparsity_config") if isinstance(quant.get("sparsity_config"), dict) else {}
    if method in ("compressed-tensors", "compressed_tensors") and sparsity and any(n.endswith(".bitmask") for n in names):
        under = quant.get("format") if quant.get("config_groups") else None
        return f"compressed-tensors {sparsity.get('format') or 'sparse'}{f' + {under}' if under else ''}"
    if str(quant.get("format") or "") in ("marlin-24", "sparse-bitmask"):  # listed, but decompress refuses them
        return ""
    if method in ("compressed-tensors", "compressed_tensors") and any(
            n.endswith((".weight_packed", ".weight_scale")) for n in names):
        return f"compressed-tensors {quant.get('format') or 'packed'}"
    if method in ("gptq", "awq") and any(n.endswith(".qweight") for n in names):
        variant = quant.get("version") if method == "awq" else quant.get("checkpoint_format")
        if str(variant or "").lower() not in ("", "gptq", "gptq_v2", "gemm", "gemv"):  # Marlin and other GPU layouts
            return ""
        return f"{method.upper()} {quant.get('bits', 4)}-bit{f' ({variant})' if variant else ''}"
    return ""


def representative(infos: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    """A sub-catalog that binds as `infos` does, small however many layers it holds (in `infos`' order).

    A tensor whose name has an all-digit segment belongs to layer (stack, index): the stack is the name up to
    that segment ('model.layers.', 'model.vision_tower.blocks.'), the index the segment; the rest of the name
    is its place in the layer (so experts or sub-blocks stay inside their layer). Kept: every tensor with no
    such segment; of each stack, its lowest-numbered layer and the first layer of each distinct signature
    (sorted (place in the layer, dtype, shape) of its tensors). Dense and MoE layers, lightning and softmax
    attention layers, a layer with an extra bias or another shape each bring one layer; identical layers bind
    identically, so leaving them out changes no answer. Metadata only; one pass over the names.
    """
    layers: dict[tuple[str, str], list[str]] = {}
    kept: set[str] = set()
    for name in infos:
        match = LAYER_INDEX.search(name)
        if match is None:
            kept.add(name)
        else:
            layers.setdefault((name[: match.start(1)], match.group(1)), []).append(name)
    first: dict[str, tuple[int, tuple[str, str]]] = {}  # stack -> (lowest index, its layer)
    seen: set[tuple[str, tuple[Any, ...]]] = set()  # (stack, signature) already represented
    chosen: set[tuple[str, str]] = set()
    for (stack, index), names in layers.items():
        if stack not in first or int(index) < first[stack][0]:
            first[stack] = (int(index), (stack, index))
        start = len(stack) + len(index) + 1
        signature = tuple(sorted((name[start:], infos[name].dtype, tuple(infos[name].shape)) for name in names))
        if (stack, signature) not in seen:
            seen.add((stack, signature))
            chosen.add((stack, index))
    chosen.update(layer for _, layer in first.values())
    for layer in chosen:
        kept.update(layers[layer])
    return {name: info for name, info in infos.items() if name in kept}


def _binds(name: str, infos: Mapping[str, TensorInfo], config: Any) -> bool:
    """Whether preset `name`, built from `config`, binds to `infos` without errors (as its plan would)."""
    try:
        return bool(build_preset(name, infos, config).bind(infos).ok)
    except WorkbenchError:
        return False


def build_preset(name: str, source: Any, config: Any, options: dict[str, Any] | None = None) -> Any:
    """`workbench.mapper.presets.<name>` called with what it takes: the config, the source, or nothing.
    `options`: keyword arguments passed on when the preset takes them (e.g. `layers`), the others ignored.
    A comma-separated chain ('dequantize_fp8,from_transformers') is their Sequential, each preset built on what
    the ones before it make."""
    if "," in name:
        return build_chain([part.strip() for part in name.split(",") if part.strip()], source, config, options)
    from .. import presets

    factory = getattr(presets, name, None)
    if factory is None or not callable(factory) or name.startswith("_"):
        # the list of known presets imports every family module: made only for this message
        public = sorted(n for n in presets.__all__ if inspect.isfunction(getattr(presets, n)))
        raise MapperError(f"Cannot use preset {name!r}: workbench.mapper.presets has no such preset. Known: {', '.join(public)}.")
    params = _params(factory)
    first = next(iter(inspect.signature(factory).parameters), None)
    kwargs: dict[str, Any] = {}
    if name == "lora_merge":  # the adapter is a source of its own: the one named 'adapter'
        args: list[Any] = [_adapter_path(source)]
    elif first == "config":
        if config is None:
            raise MapperError(f"Cannot use preset {name!r}: it needs the model's config.json and none sits beside the source. "
                              "Put config.json next to the checkpoint.")
        args = [config]
        if "source" in params:
            kwargs["source"] = source
    elif first in ("source", "sources"):
        args = [source]
        if "config" in params and config is not None:  # e.g. megatron_to_hf(source, config=...): the HF config beside
            kwargs["config"] = config
    else:
        args = []
        if "source" in params:  # e.g. quantize_fp8(block, *, source=...): names from the checkpoint itself
            kwargs["source"] = source
    kwargs.update({key: value for key, value in (options or {}).items() if key in params})
    try:
        return factory(*args, **kwargs)
    except TypeError as exc:
        raise MapperError(f"Cannot use preset {name!r} from the command line: {exc}. Write a mapper file instead.") from None


def build_chain(names: list[str], source: Any, config: Any, options: dict[str, Any] | None = None) -> Any:
    """`Sequential` of the presets `names`, each built (`build_preset`) on the tensors the earlier ones make."""
    from ..compose import Sequential

    chain: list[Any] = []
    for name in names:
        if chain:  # a later preset sees what the earlier ones make (e.g. dequantize_fp8,from_transformers)
            source = Sequential(*chain).bind(source).raise_for_problems().outputs
        chain.append(build_preset(name, source, config, options))
    if not chain:
        raise MapperError("Cannot use an empty preset chain: name at least one preset (e.g. dequantize_fp8,from_transformers).")
    return chain[0] if len(chain) == 1 else Sequential(*chain)


def _adapter_path(source: Any) -> str:
    """The folder of the source named 'adapter' of a multi-source catalog (`{"base": ..., "adapter": ...}`)."""
    catalog = getattr(source, "catalog", source)
    path = (getattr(catalog, "source_paths", None) or {}).get("adapter")
    if path is None:
        raise MapperError("Cannot use preset 'lora_merge': there is no source named 'adapter'. Open the base and the PEFT "
                          "adapter folder together ({'base': ..., 'adapter': ...}, the builder's 'Add checkpoint', or "
                          "workbench convert BASE OUT --adapter LORA_DIR).")
    return path


def _params(factory: Any) -> set[str]:
    try:
        return set(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return set()


def find_config(path: Any, catalog: Any = None) -> Path | None:
    """config.json in the checkpoint's folder (or beside the checkpoint file), if any. For a remote checkpoint
    (`catalog` opened from a URL), the server's config.json, fetched into the catalog's local folder."""
    catalog = getattr(catalog, "catalog", catalog)
    fetch = getattr(getattr(catalog, "reader", None), "fetch_file", None)
    if getattr(catalog, "url", "") and fetch is not None:
        found = fetch("config.json")
        return found if found is not None and found.is_file() else None
    if getattr(catalog, "url", "") or "://" in str(path):  # a remote reader that fetches no files: no local stand-in
        return None
    root = Path(path)
    for folder in (root, root.parent) if not root.is_dir() else (root,):
        if (folder / "config.json").is_file():
            return folder / "config.json"
    return None


def model_config(path: Any, catalog: Any = None) -> Any:
    """The model's config for presets: config.json beside the checkpoint (`find_config`), else, for a Meta folder
    (params.json, no config.json), the HF Llama config built from params.json and its tensors (a dict, see
    `meta_config`); None when there is neither."""
    found = find_config(path, catalog)
    inner = getattr(catalog, "catalog", catalog)
    if found is not None or inner is None:
        return found
    from .meta_config import hf_config_from_meta, meta_params_of

    params = meta_params_of(getattr(inner, "metadata", {}) or {})
    return hf_config_from_meta(params, inner.tensors) if params is not None else None
