"""Ready-made mappers for common layouts. Each returns an ordinary mapper: export it, edit it, compose it.

Model facts (heads, kv heads, head size, biases) come from `config`: a config.json path, a
transformers config object or a dict. `layers` is the template of one decoder layer's prefix.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from ...catalog import TensorInfo
from ...dtypes import is_float, normalize_dtype
from ...errors import MapperError
from ...names import Template, placeholders_of
from ..base import Mapper
from ..bind import source_infos
from ..claim import Claim, template_regex
from ..compose import Parallel, PrefixScope, Sequential
from ..function import Function
from ..ops import Cast, Concat, Rename, Reshape, Split, Transpose
from ..state import Node, State
from .model_shape import AttentionShape, attention_shape

LAYERS = "model.layers.{i}"
LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _qkv(layers: str, suffix: str) -> list[str]:
    return [f"{layers}.self_attn.{p}_proj.{suffix}" for p in "qkv"]


def _suffixes(shape: AttentionShape) -> list[str]:
    return ["weight", "bias"] if shape.qkv_bias else ["weight"]


# -- claims: what each preset converts, so that nothing of its layout is left half-converted ----------------
def _claim(family: str, templates: Sequence[str], tails: str, hint: str) -> Claim:
    """A Claim over names `<template>.<tails regex>` for each template (placeholders: one segment each)."""
    heads = "|".join(template_regex(template) for template in templates)
    return Claim(family, f"(?:{heads})\\.(?:{tails})", hint)


_UNKNOWN_HINT = (
    "The preset does not know these tensors (or the config does not announce them: check attention_bias, mlp_bias, "
    "model_type). Convert or drop them in a step before the preset (e.g. M.Drop(name)), or write the mapper by hand."
)


def _alternatives(words: Iterable[str]) -> str:
    return "|".join(re.escape(word) for word in words)


# -- HF <-> fused q/k/v and gate/up ---------------------------------------------------------------------
def hf_to_fused(config: Any, *, layers: str = LAYERS) -> Mapper:
    """Separate HF q/k/v and gate/up projections -> `self_attn.qkv_proj` and `mlp.gate_up_proj` (dim 0).

    A q/k/v or gate/up tensor the config does not announce (a bias) is reported, not left unfused.
    """
    shape = attention_shape(config)
    ops: list[Mapper] = [Concat(_qkv(layers, s), f"{layers}.self_attn.qkv_proj.{s}") for s in _suffixes(shape)]
    ops += [
        Concat([f"{layers}.mlp.gate_proj.{s}", f"{layers}.mlp.up_proj.{s}"], f"{layers}.mlp.gate_up_proj.{s}")
        for s in _mlp_suffixes(shape)
    ]
    return Sequential(
        Parallel(*ops),
        _claim("HF separate q/k/v and gate/up (presets.hf_to_fused)",
               [f"{layers}.self_attn.{p}_proj" for p in "qkv"] + [f"{layers}.mlp.{p}_proj" for p in ("gate", "up")], ".*", _UNKNOWN_HINT),
    )


def fused_to_hf(config: Any, *, layers: str = LAYERS) -> Mapper:
    """`qkv_proj` / `gate_up_proj` -> separate HF projections (q/k/v sizes from the config)."""
    shape = attention_shape(config)
    sizes = [shape.q_rows, shape.kv_rows, shape.kv_rows]
    ops: list[Mapper] = [Split(f"{layers}.self_attn.qkv_proj.{s}", _qkv(layers, s), sizes=sizes) for s in _suffixes(shape)]
    ops += [
        Split(f"{layers}.mlp.gate_up_proj.{s}", [f"{layers}.mlp.gate_proj.{s}", f"{layers}.mlp.up_proj.{s}"])
        for s in _mlp_suffixes(shape)
    ]
    return Sequential(
        Parallel(*ops),
        _claim("fused qkv_proj / gate_up_proj (presets.fused_to_hf)",
               [f"{layers}.self_attn.qkv_proj", f"{layers}.mlp.gate_up_proj"], ".*", _UNKNOWN_HINT),
    )


def _mlp_suffixes(shape: AttentionShape) -> list[str]:
    return ["weight", "bias"] if shape.mlp_bias else ["weight"]


# -- HF <-> Meta original Llama ---------------------------------------------------------------------------
_META_TOP = (("model.embed_tokens.weight", "tok_embeddings.weight"), ("model.norm.weight", "norm.weight"))
_META_NORMS = (("input_layernorm", "attention_norm"), ("post_attention_layernorm", "ffn_norm"))
_META_MLP = (("mlp.gate_proj", "feed_forward.w1"), ("mlp.down_proj", "feed_forward.w2"), ("mlp.up_proj", "feed_forward.w3"))


def _meta_pairs(shape: AttentionShape) -> list[tuple[str, str]]:
    """Tensors that only change name: (HF name, Meta name)."""
    pairs = list(_META_TOP)
    if not shape.tie_word_embeddings:
        pairs.append(("lm_head.weight", "output.weight"))
    modules = [("self_attn.v_proj", "attention.wv", _suffixes(shape))]
    modules.append(("self_attn.o_proj", "attention.wo", ["weight", "bias"] if shape.o_bias else ["weight"]))
    modules += [(hf, meta, _mlp_suffixes(shape)) for hf, meta in _META_MLP]
    modules += [(hf, meta, ["weight"]) for hf, meta in _META_NORMS]
    pairs += [(f"{LAYERS}.{hf}.{s}", f"layers.{{i}}.{meta}.{s}") for hf, meta, suffixes in modules for s in suffixes]
    return pairs


def _rotary(shape: AttentionShape) -> list[tuple[str, str, int, list[int], list[int]]]:
    """Tensors whose rows follow the rotary pairing: (HF name, Meta name, leading size, trailing dims, final shape).

    q/k weights and biases are permuted within each head; q_norm/k_norm (one head_dim vector applied to
    every head) take the same permutation of their head_dim entries, so that norm-then-rotate computes
    the same scores in both layouts (an RMS norm commutes with permuting its entries and weight together).
    """
    out = []
    for hf, meta, heads in (("q_proj", "wq", shape.num_heads), ("k_proj", "wk", shape.num_kv_heads)):
        rows = heads * shape.head_dim
        out.append((f"{LAYERS}.self_attn.{hf}.weight", f"layers.{{i}}.attention.{meta}.weight", heads, [-1], [rows, -1]))
        if shape.qkv_bias:
            out.append((f"{LAYERS}.self_attn.{hf}.bias", f"layers.{{i}}.attention.{meta}.bias", heads, [], [rows]))
    if shape.qk_norm:
        for norm in ("q_norm", "k_norm"):
            out.append((f"{LAYERS}.self_attn.{norm}.weight", f"layers.{{i}}.attention.{norm}.weight", -1, [], [-1]))
    return out


def tied_output(config: Any) -> list[Mapper]:
    """For a config with `tie_word_embeddings` (Llama 3.2 1B / 3B): the op writing Meta's `output.weight` as a copy of
    `tok_embeddings.weight` (none otherwise). Meta's Transformer has its own output layer and its checkpoints hold it;
    without it, Meta's code loads with strict=False and runs an uninitialised output layer."""
    if not attention_shape(config).tie_word_embeddings:
        return []
    from ..function import Function

    return [Function("workbench.mapper.presets.output_presets:replicate", ("tok_embeddings.weight",), ("tok_embeddings.weight", "output.weight"),
                     infer="workbench.mapper.presets.output_presets:infer_replicate", params=(("n", 2),))]


def untied_output(config: Any) -> list[Mapper]:
    """For a config with `tie_word_embeddings`: the op that takes Meta's `output.weight` out (an HF tied model saves no
    head; transformers ties it to the embedding), after checking that it equals `tok_embeddings.weight` (Meta's
    checkpoints of tied models hold the head as the embedding's copy); none otherwise. A head that differs is refused:
    dropped, it would be replaced by the embedding on load."""
    if not attention_shape(config).tie_word_embeddings:
        return []
    from ..function import Function

    return [Function("workbench.mapper.presets.layouts:tied_embedding", ("tok_embeddings.weight", "output.weight"),
                     ("tok_embeddings.weight",), infer="workbench.mapper.presets.layouts:infer_tied_embedding")]


def tied_embedding(embedding: Any, output: Any) -> Any:
    """`embedding`, when `output` (Meta's head) holds the same values; else refused (see `untied_output`)."""
    import torch

    if embedding.shape != output.shape or not torch.equal(embedding, output):
        raise MapperError("Cannot convert Meta's output.weight to a tied HF model: it differs from tok_embeddings.weight, so "
                          "tying them (config.json says tie_word_embeddings: true) would change the model's logits. Set "
                          "tie_word_embeddings to false in config.json, so that the head is kept as lm_head.weight.",
                          tensor="output.weight")
    return embedding


def infer_tied_embedding(embedding: TensorInfo, output: TensorInfo) -> list[tuple[str, tuple[int, ...]]]:
    """The embedding's metadata; the head must have its shape and dtype."""
    if (embedding.dtype, tuple(embedding.shape)) != (output.dtype, tuple(output.shape)):
        raise MapperError(f"Cannot convert Meta's output.weight ({output.dtype} {list(output.shape)}) to a tied HF model: "
                          f"tok_embeddings.weight is {embedding.dtype} {list(embedding.shape)}, so they cannot be one tensor. "
                          "Set tie_word_embeddings to false in config.json.", tensor=output.name)
    return [(embedding.dtype, tuple(embedding.shape))]


def hf_to_meta(config: Any) -> Mapper:
    """HF Llama names -> Meta's original names, undoing HF's rotary permutation of q and k rows.

    HF stores each head's rows as [all first halves, all second halves]; Meta interleaves the pairs.
    Per head: view (2, head_dim/2, in), swap the first two dims, flatten back. Biases and q/k norms
    (Qwen2, Qwen3, `attention_bias` / `mlp_bias` models) follow; any other tensor of the HF layout is
    reported rather than left under its HF name. A tied model (`tie_word_embeddings`, Llama 3.2 1B / 3B) gets Meta's
    `output.weight` as the embedding's copy (`tied_output`): Meta's model has its own output layer.
    """
    shape = attention_shape(config)
    half = shape.head_dim // 2
    rotary = _rotary(shape)
    return Sequential(
        Parallel(
            *[Rename(hf, meta) for hf, meta in _meta_pairs(shape)],
            *[Reshape(hf, [lead, 2, half, *tail], dst=meta) for hf, meta, lead, tail, _ in rotary],
        ),
        Parallel(*[Transpose(meta, 1, 2) for _, meta, *_ in rotary]),
        Parallel(*[Reshape(meta, final) for _, meta, _, _, final in rotary]),
        *tied_output(config),
        Claim("HF Llama (presets.hf_to_meta)", r"(?:model|lm_head)\..*", _UNKNOWN_HINT),
    )


def meta_to_hf(config: Any) -> Mapper:
    """Meta's original Llama names -> HF names, applying the rotary permutation HF's converter applies. For a tied
    config the head Meta's checkpoint holds is checked to equal the embedding and left out (`untied_output`):
    transformers saves no `lm_head.weight` for a tied model."""
    shape = attention_shape(config)
    half = shape.head_dim // 2
    rotary = _rotary(shape)
    return Sequential(
        *untied_output(config),
        Parallel(
            *[Rename(meta, hf) for hf, meta in _meta_pairs(shape)],
            *[Reshape(meta, [lead, half, 2, *tail], dst=hf) for hf, meta, lead, tail, _ in rotary],
        ),
        Parallel(*[Transpose(hf, 1, 2) for hf, *_ in rotary]),
        Parallel(*[Reshape(hf, final) for hf, _, _, _, final in rotary]),
        Claim("Meta Llama (presets.meta_to_hf)", r"(?:layers|tok_embeddings|norm|output)\..*", _UNKNOWN_HINT),
    )


# -- HF <-> Megatron interleaved QKV ----------------------------------------------------------------------
MEGATRON_QKV = "model.layers.{i}.self_attention.linear_qkv"


def hf_to_megatron_qkv(config: Any, *, layers: str = LAYERS, qkv: str = MEGATRON_QKV) -> Mapper:
    """HF q/k/v -> one interleaved QKV: for each kv group, its query heads, then its key head, then its value head."""
    shape = attention_shape(config)
    groups, per_group, head = shape.num_kv_heads, shape.heads_per_group * shape.head_dim, shape.head_dim
    stages: list[list[Mapper]] = [[], [], []]
    for suffix in _suffixes(shape):
        tail = [-1] if suffix == "weight" else []
        q, k, v = _qkv(layers, suffix)
        stages[0] += [Reshape(q, [groups, per_group, *tail]), Reshape(k, [groups, head, *tail]), Reshape(v, [groups, head, *tail])]
        stages[1].append(Concat([q, k, v], f"{qkv}.{suffix}", dim=1))
        stages[2].append(Reshape(f"{qkv}.{suffix}", [groups * (per_group + 2 * head), *tail]))
    claim = _claim("HF q/k/v (presets.hf_to_megatron_qkv)", [f"{layers}.self_attn.{p}_proj" for p in "qkv"], ".*", _UNKNOWN_HINT)
    return Sequential(*[Parallel(*ops) for ops in stages], claim)


def megatron_qkv_to_hf(config: Any, *, layers: str = LAYERS, qkv: str = MEGATRON_QKV) -> Mapper:
    """Interleaved QKV (per kv group: q heads, k head, v head) -> HF q/k/v.

    Other tensors under the fused QKV module (e.g. Transformer Engine's `layer_norm_weight`) are reported.
    """
    shape = attention_shape(config)
    groups, per_group, head = shape.num_kv_heads, shape.heads_per_group * shape.head_dim, shape.head_dim
    stages: list[list[Mapper]] = [[], [], []]
    for suffix in _suffixes(shape):
        tail = [-1] if suffix == "weight" else []
        q, k, v = _qkv(layers, suffix)
        stages[0].append(Reshape(f"{qkv}.{suffix}", [groups, per_group + 2 * head, *tail]))
        stages[1].append(Split(f"{qkv}.{suffix}", [q, k, v], sizes=[per_group, head, head], dim=1))
        stages[2] += [Reshape(q, [shape.q_rows, *tail]), Reshape(k, [shape.kv_rows, *tail]), Reshape(v, [shape.kv_rows, *tail])]
    claim = _claim("Megatron interleaved QKV (presets.megatron_qkv_to_hf)", [qkv], ".*", _UNKNOWN_HINT)
    return Sequential(*[Parallel(*ops) for ops in stages], claim)


# -- LoRA -------------------------------------------------------------------------------------------------
def _lora_module(layers: str, target: str) -> str:
    return f"{layers}.{{block}}.{target}"


def _lora_claim(family: str, layers: str, targets: Sequence[str], tails: str, hint: str) -> Claim:
    return Claim(family, f"{template_regex(layers)}\\.[^.]+\\.(?:{_alternatives(targets)})\\.(?:{tails})", hint)


def lora_wrap(targets: Sequence[str] = LLAMA_LORA_TARGETS, *, layers: str = LAYERS, params: Sequence[str] = ("weight",)) -> Mapper:
    """Route base weights into PEFT's wrapped module: `x.weight` -> `x.base_layer.weight` for each target.

    A target's other own tensors (a bias when `params` lists only "weight") are reported, not left unwrapped.
    """
    return Sequential(
        Parallel(*[
            Rename(f"{_lora_module(layers, t)}.{p}", f"{_lora_module(layers, t)}.base_layer.{p}") for t in targets for p in params
        ]),
        _lora_claim("plain LoRA target modules (presets.lora_wrap)", layers, targets, "[^.]+",
                    "Pass them in params (e.g. params=('weight', 'bias')) or drop them in a step before the preset."),
    )


def lora_unwrap(targets: Sequence[str] = LLAMA_LORA_TARGETS, *, layers: str = LAYERS, params: Sequence[str] = ("weight",)) -> Mapper:
    """`x.base_layer.weight` -> `x.weight` for each target (the inverse of `lora_wrap`).

    Other `base_layer` tensors and adapter tensors (`lora_A`, `lora_B`, ...) under a target are reported:
    an unwrapped module cannot hold them.
    """
    return Sequential(
        Parallel(*[
            Rename(f"{_lora_module(layers, t)}.base_layer.{p}", f"{_lora_module(layers, t)}.{p}") for t in targets for p in params
        ]),
        _lora_claim("PEFT-wrapped LoRA target modules (presets.lora_unwrap)", layers, targets, r"base_layer\..*|lora_.*",
                    "Pass other base_layer tensors in params (e.g. params=('weight', 'bias')); merge the adapters first "
                    "(presets.lora_merge) or drop them in a step before the preset."),
    )


def lora_merge(
    scale: Any,
    targets: Sequence[str] = LLAMA_LORA_TARGETS,
    *,
    layers: str = LAYERS,
    wrapped: bool = True,
    adapter: str | None = None,
    source: str = "adapter",
    unmerge: bool = False,
    base: Any = None,
) -> Mapper:
    """Merge adapters into base weights: `W + scale * B @ A` (scale = lora_alpha / r), dropping A and B.

    Given a PEFT adapter folder (or its adapter_config.json, or {'config','tensors'}) instead of a number, read
    PEFT's own files: LoRA, rsLoRA, rank/alpha patterns, fan_in_fan_out, modules_to_save, LoRA biases, DoRA,
    with the adapter as source `source` of a multi-source catalog (workbench.mapper.presets.lora; `unmerge` reverses);
    `base`: the base model's folder (or its config.json as a mapping), read for tie_word_embeddings.
    `wrapped`: base weights sit at `x.base_layer.weight` (PEFT-wrapped) rather than `x.weight`;
    `adapter`: the adapter name in the keys (`lora_A.<adapter>.weight`), None when absent (saved adapters).
    Tensors under a target that the merge does not consume (a `base_layer.bias`, another adapter, DoRA's
    `lora_magnitude_vector`) are reported, not left in a half-merged module.
    """
    if not isinstance(scale, (int, float)):
        from .lora import peft_merge

        return peft_merge(scale, source=source, unmerge=unmerge, base=base)
    tag = f".{adapter}" if adapter else ""
    ops = []
    for target in targets:
        module = _lora_module(layers, target)
        base = f"{module}.base_layer.weight" if wrapped else f"{module}.weight"
        ops.append(Function(
            fn="workbench.mapper.presets.functions:merge_lora",
            inputs=[base, f"{module}.lora_A{tag}.weight", f"{module}.lora_B{tag}.weight"],
            outputs=[f"{module}.weight"],
            infer="workbench.mapper.presets.functions:infer_merge_lora",
            params={"scale": float(scale)},
        ))
    return Sequential(
        Parallel(*ops),
        _lora_claim("LoRA adapters (presets.lora_merge)", layers, targets, r"base_layer\..*|lora_.*",
                    "Rename other base_layer tensors in a step before the preset (M.Rename('<module>.base_layer.bias', "
                    "'<module>.bias')), merge other adapters separately, or drop them."),
    )


# -- prefixes and dtypes ----------------------------------------------------------------------------------
def strip_prefix(prefix: str = "model.") -> Mapper:
    """Remove `prefix` (e.g. 'model.' from Lightning, '_orig_mod.' from torch.compile) from names that have it."""
    return PrefixScope(Sequential(), source_prefix=prefix, target_prefix="")


def add_prefix(prefix: str = "model.") -> Mapper:
    """Put `prefix` in front of every name."""
    return PrefixScope(Sequential(), source_prefix="", target_prefix=prefix)


_DIGITS = re.compile(r"^\d+$")


def fold_names(names: Iterable[str]) -> dict[str, list[str]]:
    """Group names by their shape with numeric segments turned into placeholders ('layers.{n0}.w')."""
    folded: dict[str, list[str]] = {}
    for name in names:
        segments = name.split(".")
        count = 0
        for index, segment in enumerate(segments):
            if _DIGITS.match(segment):
                segments[index] = f"{{n{count}}}"
                count += 1
        folded.setdefault(".".join(segments), []).append(name)
    return folded


def cast_policy(source: Any, dtype: str = "bf16", *, keep: Sequence[str] = ("norm", "bias"), keep_dtype: str = "F32") -> Mapper:
    """Cast floating tensors to `dtype`, but those whose name has a segment containing one of `keep`
    (norms and biases by default) to `keep_dtype`. Non-float tensors are left alone.

    The source is read only to list names: layers fold into templates, so the mapper stays short.
    """
    target, kept_target = normalize_dtype(dtype), normalize_dtype(keep_dtype)
    infos = {info.name: info for info in source_infos(source)}
    ops: list[Mapper] = []
    folded = fold_names(infos)
    index = State({name: Node(None) for name in infos})
    for template, names in folded.items():
        if "{" in template:
            compiled = Template(template, placeholders_of(template))
            members = set(names)
            if any(n not in members and compiled.match(n.split(".")) is not None for n in index.candidates(compiled) if n in index.nodes):
                folded[template] = []  # the template would also catch other names: spell these out
                for name in names:
                    folded.setdefault(name, [name])
    for template, names in folded.items():
        floats = [name for name in names if is_float(infos[name].dtype)]
        if not floats:
            continue
        kept = any(word in segment for word in keep for segment in template.split("."))
        wanted = kept_target if kept else target
        if all(infos[name].dtype == wanted for name in floats):
            continue
        if len(floats) == len(names):
            ops.append(Cast(template, wanted))
        else:
            ops.extend(Cast(name, wanted) for name in floats if infos[name].dtype != wanted)
    return Parallel(*ops)


# -- several sources --------------------------------------------------------------------------------------
def average(sources: Any, weights: Sequence[float] | None = None, *, like: Any = None) -> Mapper:
    """The (weighted) mean of several checkpoints, tensor by tensor, fp32 accumulation (workbench.mapper.presets.averaging)."""
    from .averaging import average as build

    return build(sources, weights, like=like)
