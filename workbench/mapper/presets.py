"""Ready-made mappers for common layouts. Each returns an ordinary mapper: export it, edit it, compose it.

Model facts (heads, kv heads, head size, biases) come from `config`: a config.json path, a
transformers config object or a dict. `layers` is the template of one decoder layer's prefix.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from ..dtypes import is_float, normalize_dtype
from ..names import Template, placeholders_of
from .base import Mapper
from .bind import source_infos
from .compose import Parallel, PrefixScope, Sequential
from .function import Function
from .model_shape import AttentionShape, attention_shape
from .ops import Cast, Concat, Rename, Reshape, Split, Transpose
from .quantized import dequantize_fp8, dequantize_mxfp4, quantize_fp8  # noqa: F401 - quantised weights live in their own module
from .state import Node, State
from .transformers_layout import from_transformers  # noqa: F401 - the transformers-5 layout preset lives in its own module

LAYERS = "model.layers.{i}"
LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _qkv(layers: str, suffix: str) -> list[str]:
    return [f"{layers}.self_attn.{p}_proj.{suffix}" for p in "qkv"]


def _suffixes(shape: AttentionShape) -> list[str]:
    return ["weight", "bias"] if shape.qkv_bias else ["weight"]


# -- HF <-> fused q/k/v and gate/up ---------------------------------------------------------------------
def hf_to_fused(config: Any, *, layers: str = LAYERS) -> Mapper:
    """Separate HF q/k/v and gate/up projections -> `self_attn.qkv_proj` and `mlp.gate_up_proj` (dim 0)."""
    shape = attention_shape(config)
    ops: list[Mapper] = [Concat(_qkv(layers, s), f"{layers}.self_attn.qkv_proj.{s}") for s in _suffixes(shape)]
    ops.append(Concat([f"{layers}.mlp.gate_proj.weight", f"{layers}.mlp.up_proj.weight"], f"{layers}.mlp.gate_up_proj.weight"))
    return Parallel(*ops)


def fused_to_hf(config: Any, *, layers: str = LAYERS) -> Mapper:
    """`qkv_proj` / `gate_up_proj` -> separate HF projections (q/k/v sizes from the config)."""
    shape = attention_shape(config)
    sizes = [shape.q_rows, shape.kv_rows, shape.kv_rows]
    ops: list[Mapper] = [Split(f"{layers}.self_attn.qkv_proj.{s}", _qkv(layers, s), sizes=sizes) for s in _suffixes(shape)]
    ops.append(Split(f"{layers}.mlp.gate_up_proj.weight", [f"{layers}.mlp.gate_proj.weight", f"{layers}.mlp.up_proj.weight"]))
    return Parallel(*ops)


# -- HF <-> Meta original Llama ---------------------------------------------------------------------------
_META_TOP = (("model.embed_tokens.weight", "tok_embeddings.weight"), ("model.norm.weight", "norm.weight"))
_META_LAYER = (
    ("self_attn.v_proj", "attention.wv"), ("self_attn.o_proj", "attention.wo"),
    ("mlp.gate_proj", "feed_forward.w1"), ("mlp.down_proj", "feed_forward.w2"), ("mlp.up_proj", "feed_forward.w3"),
    ("input_layernorm", "attention_norm"), ("post_attention_layernorm", "ffn_norm"),
)


def _meta_pairs(shape: AttentionShape) -> list[tuple[str, str]]:
    pairs = list(_META_TOP)
    if not shape.tie_word_embeddings:
        pairs.append(("lm_head.weight", "output.weight"))
    pairs += [(f"{LAYERS}.{hf}.weight", f"layers.{{i}}.{meta}.weight") for hf, meta in _META_LAYER]
    return pairs


def _rotary(shape: AttentionShape) -> list[tuple[str, str, int]]:
    hf = _qkv(LAYERS, "weight")
    return [(hf[0], "layers.{i}.attention.wq.weight", shape.num_heads), (hf[1], "layers.{i}.attention.wk.weight", shape.num_kv_heads)]


def hf_to_meta(config: Any) -> Mapper:
    """HF Llama names -> Meta's original names, undoing HF's rotary permutation of q and k rows.

    HF stores each head's rows as [all first halves, all second halves]; Meta interleaves the pairs.
    Per head: view (2, head_dim/2, in), swap the first two dims, flatten back.
    """
    shape = attention_shape(config)
    half = shape.head_dim // 2
    rotary = _rotary(shape)
    return Sequential(
        Parallel(
            *[Rename(hf, meta) for hf, meta in _meta_pairs(shape)],
            *[Reshape(hf, [heads, 2, half, -1], dst=meta) for hf, meta, heads in rotary],
        ),
        Parallel(*[Transpose(meta, 1, 2) for _, meta, _ in rotary]),
        Parallel(*[Reshape(meta, [heads * shape.head_dim, -1]) for _, meta, heads in rotary]),
    )


def meta_to_hf(config: Any) -> Mapper:
    """Meta's original Llama names -> HF names, applying the rotary permutation HF's converter applies."""
    shape = attention_shape(config)
    half = shape.head_dim // 2
    rotary = _rotary(shape)
    return Sequential(
        Parallel(
            *[Rename(meta, hf) for hf, meta in _meta_pairs(shape)],
            *[Reshape(meta, [heads, half, 2, -1], dst=hf) for hf, meta, heads in rotary],
        ),
        Parallel(*[Transpose(hf, 1, 2) for hf, _, _ in rotary]),
        Parallel(*[Reshape(hf, [heads * shape.head_dim, -1]) for hf, _, heads in rotary]),
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
    return Sequential(*[Parallel(*ops) for ops in stages])


def megatron_qkv_to_hf(config: Any, *, layers: str = LAYERS, qkv: str = MEGATRON_QKV) -> Mapper:
    """Interleaved QKV (per kv group: q heads, k head, v head) -> HF q/k/v."""
    shape = attention_shape(config)
    groups, per_group, head = shape.num_kv_heads, shape.heads_per_group * shape.head_dim, shape.head_dim
    stages: list[list[Mapper]] = [[], [], []]
    for suffix in _suffixes(shape):
        tail = [-1] if suffix == "weight" else []
        q, k, v = _qkv(layers, suffix)
        stages[0].append(Reshape(f"{qkv}.{suffix}", [groups, per_group + 2 * head, *tail]))
        stages[1].append(Split(f"{qkv}.{suffix}", [q, k, v], sizes=[per_group, head, head], dim=1))
        stages[2] += [Reshape(q, [shape.q_rows, *tail]), Reshape(k, [shape.kv_rows, *tail]), Reshape(v, [shape.kv_rows, *tail])]
    return Sequential(*[Parallel(*ops) for ops in stages])


# -- LoRA -------------------------------------------------------------------------------------------------
def _lora_module(layers: str, target: str) -> str:
    return f"{layers}.{{block}}.{target}"


def lora_wrap(targets: Sequence[str] = LLAMA_LORA_TARGETS, *, layers: str = LAYERS, params: Sequence[str] = ("weight",)) -> Mapper:
    """Route base weights into PEFT's wrapped module: `x.weight` -> `x.base_layer.weight` for each target."""
    return Parallel(*[
        Rename(f"{_lora_module(layers, t)}.{p}", f"{_lora_module(layers, t)}.base_layer.{p}") for t in targets for p in params
    ])


def lora_unwrap(targets: Sequence[str] = LLAMA_LORA_TARGETS, *, layers: str = LAYERS, params: Sequence[str] = ("weight",)) -> Mapper:
    """`x.base_layer.weight` -> `x.weight` for each target (the inverse of `lora_wrap`)."""
    return Parallel(*[
        Rename(f"{_lora_module(layers, t)}.base_layer.{p}", f"{_lora_module(layers, t)}.{p}") for t in targets for p in params
    ])


def lora_merge(
    scale: Any,
    targets: Sequence[str] = LLAMA_LORA_TARGETS,
    *,
    layers: str = LAYERS,
    wrapped: bool = True,
    adapter: str | None = None,
    source: str = "adapter",
    unmerge: bool = False,
) -> Mapper:
    """Merge adapters into base weights: `W + scale * B @ A` (scale = lora_alpha / r), dropping A and B.

    Given a PEFT adapter folder (or its adapter_config.json, or {'config','tensors'}) instead of a number, read
    PEFT's own files: LoRA, rsLoRA, rank/alpha patterns, fan_in_fan_out, modules_to_save, LoRA biases, DoRA,
    with the adapter as source `source` of a multi-source catalog (workbench.mapper.lora; `unmerge` reverses).
    `wrapped`: base weights sit at `x.base_layer.weight` (PEFT-wrapped) rather than `x.weight`;
    `adapter`: the adapter name in the keys (`lora_A.<adapter>.weight`), None when absent (saved adapters).
    """
    if not isinstance(scale, (int, float)):
        from .lora import peft_merge

        return peft_merge(scale, source=source, unmerge=unmerge)
    tag = f".{adapter}" if adapter else ""
    ops = []
    for target in targets:
        module = _lora_module(layers, target)
        base = f"{module}.base_layer.weight" if wrapped else f"{module}.weight"
        ops.append(Function(
            fn="workbench.mapper.functions:merge_lora",
            inputs=[base, f"{module}.lora_A{tag}.weight", f"{module}.lora_B{tag}.weight"],
            outputs=[f"{module}.weight"],
            infer="workbench.mapper.functions:infer_merge_lora",
            params={"scale": float(scale)},
        ))
    return Parallel(*ops)


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
    """The (weighted) mean of several checkpoints, tensor by tensor, fp32 accumulation (workbench.mapper.average)."""
    from .average import average as build

    return build(sources, weights, like=like)


# The presets front ends offer (the builder's list, `workbench convert --preset NAME`, `ck.suggest()`):
# name under `M.presets` -> what it does, in a few words. Each is called with what its first parameter
# asks for (`config`: the model's config.json; `source`/`sources`: the checkpoint; nothing: its defaults;
# `lora_merge`: the folder of the source named 'adapter'), see `workbench.mapper.suggest.build_preset`.
# Register a new preset here to make it appear everywhere.
PRESETS: dict[str, str] = {
    "from_transformers": "checkpoint → transformers-5 in-memory layout (experts stacked)",
    "hf_to_fused": "HF → fused qkv_proj + gate_up_proj",
    "fused_to_hf": "fused → HF q/k/v + gate/up",
    "hf_to_meta": "HF Llama → Meta original",
    "meta_to_hf": "Meta original → HF Llama",
    "hf_to_megatron_qkv": "HF → Megatron interleaved QKV",
    "megatron_qkv_to_hf": "Megatron interleaved QKV → HF",
    "cast_policy": "cast to bf16 (norms and biases F32)",
    "strip_prefix": "strip the 'model.' prefix",
    "add_prefix": "add a 'model.' prefix",
    "dequantize_fp8": "FP8 block-scaled weights → bf16 (scales from quantization_config)",
    "dequantize_mxfp4": "MXFP4 experts (gpt-oss) → bf16, transformers layout",
    "quantize_fp8": "linear weights → FP8 with 128×128 block scales (+ quantization_config)",
    "lora_merge": "merge the PEFT adapter of source 'adapter'",
    "average": "average every source (uniform)",
}
