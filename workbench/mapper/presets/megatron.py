"""Megatron-core GPT checkpoints as mappers: the TP/PP merge, and Megatron names -> HF Llama / Qwen2 names.

`megatron_merge(source)` turns a legacy checkpoint's per-rank shards (format 'megatron', named
`mp_rank_TT[_PPP]/<key>`) into the whole tensors a TP=1, PP=1 model holds, with ordinary ops, so the merge
shows in `to_code()` and runs streamed like any other mapper. Each parameter is merged by its parallel layout
in megatron-core:
- column-parallel (`linear_qkv`, `linear_fc1`): the TP shards concatenated on dim 0. `linear_qkv` holds whole
  query groups per rank ([q heads; k; v] per group), so the concatenation is every group in order;
- gated MLP (`swiglu`): each rank's `linear_fc1` is [gate_r; up_r]; the halves are split and reassembled as
  [gate_0 .. gate_T-1; up_0 .. up_T-1] (megatron's own `apply_swiglu_sharded_factory` layout);
- row-parallel (`linear_proj`, `linear_fc2` weights): concatenated on dim 1; their biases are replicated;
- vocabulary-parallel (`embedding.word_embeddings`, `output_layer`): concatenated on dim 0, then the padding
  rows (`padded_vocab_size` - true vocabulary) cut off when the true vocabulary size is known;
- replicated (layer norms, TE's fused `layer_norm_weight`s, q/k layernorms, position embeddings): rank 0's
  copy, checked equal on every TP rank by default;
- pipeline stages: each stage numbers its layers from 0; they become global layers (the layers of the earlier
  stages counted from the files), and a tied output layer's copy on the last stage is dropped.

`megatron_to_hf(source)` continues to HF Llama names (Qwen2 when the QKV projection has a bias): the fused
interleaved QKV split per query group (`presets.megatron_qkv_to_hf`), `linear_fc1` cut into gate_proj/up_proj,
norms, embeddings and output layer renamed. It also reads megatron `torch_dist` folders (global tensors with
the layers stacked on a leading axis). `hf_config(source)` gives the matching transformers config.

Mixture-of-experts layers (sequential local experts, `mlp.experts.local_experts.N`) merge like dense MLPs per
expert, expert-parallel ranks' local experts renumbered to global experts (dense weights from EP rank 0, the
others being data-parallel copies), and map to Mixtral's file names; grouped-GEMM experts (`experts.weight1`),
shared experts in HF names (Qwen2-MoE), experts with their own TP size, and virtual pipeline chunks are
refused with a message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ...catalog import Catalog, TensorInfo
from ...errors import MapperError
from ..base import Mapper
from ..bind import source_infos
from ..claim import Claim
from ..compose import Parallel, Sequential
from ..function import Function
from ..groups import Problem
from ..ops import Concat, Drop, Rename, Split, Unstack
from .layouts import _UNKNOWN_HINT, MEGATRON_QKV, megatron_qkv_to_hf

LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")
REPLICATED_TOP = ("embedding.position_embeddings.weight", "decoder.final_layernorm.weight", "decoder.final_layernorm.bias")
COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                   "mlp.linear_fc1.weight", "mlp.linear_fc1.bias")
ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
REPLICATED_LAYER = re.compile(
    r"^(?:input_layernorm|pre_mlp_layernorm|self_attention\.q_layernorm|self_attention\.k_layernorm)\.(?:weight|bias)$"
    r"|^(?:self_attention\.linear_qkv|mlp\.linear_fc1)\.layer_norm_(?:weight|bias)$"
    r"|^(?:self_attention\.linear_proj|mlp\.linear_fc2)\.bias$"
    r"|^mlp\.router\.(?:weight|bias|expert_bias)$|^mlp\.shared_experts\.gate_weight$"
)
# An expert's (or the shared experts') MLP is laid out like the dense MLP: the part after this prefix says how.
EXPERT = re.compile(r"^mlp\.(?:experts\.local_experts\.\d+|shared_experts)\.(?=linear_fc)")
LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
GATED = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")
HF_LAYERS = "model.layers.{i}"


def _catalog(source: Any) -> Catalog:
    catalog = getattr(source, "catalog", source)
    if not isinstance(catalog, Catalog):
        raise MapperError("Cannot build the Megatron merge: it needs the opened checkpoint (wb.open_checkpoint(folder)) "
                          "to read each shard's rank coordinates.")
    return catalog


def _args(catalog: Catalog) -> dict[str, Any]:
    try:
        value = json.loads(catalog.metadata.get("args", "{}"))
    except ValueError:
        value = {}
    return value if isinstance(value, dict) else {}


def _is_legacy(catalog: Any) -> bool:
    return isinstance(catalog, Catalog) and catalog.format == "megatron" and catalog.metadata.get("layout") == "legacy"


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


# ---------------------------------------------------------------------------------------------- replicas


def same_on_every_rank(*tensors: Any, names: Any = ()) -> Any:
    """The first tensor, after checking that every TP rank's copy of a replicated parameter is equal."""
    import torch

    first = tensors[0]
    for index, other in enumerate(tensors[1:], start=1):
        if other.shape != first.shape or not torch.equal(other, first):
            where = names[index] if index < len(names) else f"copy {index}"
            raise MapperError(
                f"Cannot merge {names[0] if names else 'a replicated tensor'!r}: {where!r} differs from it, although megatron "
                "keeps one copy per tensor-parallel rank of this parameter. The ranks drifted apart (or come from different "
                "saves); pass check_replicas=False to take rank 0's copy anyway.",
                tensor=str(names[0]) if names else None,
            )
    return first


def infer_same_on_every_rank(*infos: TensorInfo, names: Any = ()) -> list[tuple[str, tuple[int, ...]]]:
    """Output metadata of `same_on_every_rank`: the first copy's (checks that every copy has its dtype and shape)."""
    first = infos[0]
    for info in infos[1:]:
        if (info.dtype, tuple(info.shape)) != (first.dtype, tuple(first.shape)):
            raise MapperError(f"Cannot merge {first.name!r}: its copy {info.name!r} is {info.dtype} {list(info.shape)}, not "
                              f"{first.dtype} {list(first.shape)}. Check that the rank folders come from one save.",
                              tensor=first.name)
    return [(first.dtype, tuple(first.shape))]


# ---------------------------------------------------------------------------------------------- merge


def _shards(catalog: Catalog) -> dict[str, dict[int, str]]:
    """Global key -> {tp rank: source name}: pipeline stages' layers renumbered to global layers, expert-parallel
    ranks' local experts to global experts (EP rank e holds experts e*E/EP .. (e+1)*E/EP - 1), and the dense
    weights taken from EP rank 0 (the other EP ranks hold data-parallel copies)."""
    tp_of, pp_of, layer_of = (catalog.columns.get(c, {}) for c in ("tp", "pp", "layer"))
    ep_of = catalog.columns.get("ep", {})
    args = _args(catalog)
    ep_size = int(catalog.metadata.get("ep_size", "1"))
    experts = _int(args.get("num_experts"))
    etp = _int(args.get("expert_tensor_parallel_size"))
    if etp is not None and etp != int(catalog.metadata.get("tp_size", "1")):
        raise MapperError(f"Cannot merge this Megatron checkpoint: its experts use tensor parallelism {etp}, unlike the "
                          f"dense layers ({catalog.metadata.get('tp_size')}); that split is not supported yet.")
    if ep_size > 1 and (experts is None or experts % ep_size):
        raise MapperError(f"Cannot merge this expert-parallel Megatron checkpoint: its args give num_experts={experts!r}, "
                          f"which {ep_size} expert-parallel ranks cannot share evenly. Check the rank folders.")
    per_rank = experts // ep_size if experts and ep_size > 1 else None
    out: dict[str, dict[int, str]] = {}
    for name in catalog.tensors:
        folder, _, key = name.partition("/")
        if name not in tp_of or not key or key.startswith("optimizer."):
            continue
        ep = int(ep_of.get(name, 0))
        m = LAYER_KEY.match(key)
        if m:
            part = m[2]
            local = LOCAL_EXPERT.match(part)
            if local and per_rank is not None:
                if int(local[1]) >= per_rank:
                    raise MapperError(f"Cannot merge Megatron tensor {name!r}: its local expert {local[1]} is beyond the "
                                      f"{per_rank} experts each expert-parallel rank holds.", tensor=name)
                part = f"mlp.experts.local_experts.{ep * per_rank + int(local[1])}.{local[2]}"
            elif ep:
                continue  # a data-parallel copy of a dense weight
            key = f"decoder.layers.{layer_of[name]}.{part}"
        elif ep:
            continue
        out.setdefault(key, {})
        tp = int(tp_of[name])
        if tp in out[key]:
            other = out[key][tp]
            if key == "output_layer.weight" or pp_of.get(other) == pp_of.get(name):
                raise MapperError(f"Cannot merge Megatron tensor {name!r}: {other!r} holds the same global parameter on the same "
                                  "tensor-parallel rank. Check the rank folders.", tensor=name)
            continue
        out[key][tp] = name
    return out


def _part(key: str) -> str | None:
    """The layer-relative part of a key, an expert's MLP named like the dense MLP (`mlp.linear_fc1.weight`)."""
    m = LAYER_KEY.match(key)
    return EXPERT.sub("mlp.", m[2]) if m else None


def _layout(key: str) -> str:
    """'column', 'row', 'vocab' or 'replicated' for a global key; MapperError for a key of unknown layout."""
    if key in VOCAB_PARALLEL:
        return "vocab"
    if key in REPLICATED_TOP:
        return "replicated"
    part = _part(key)
    if part is not None:
        if part in COLUMN_PARALLEL:
            return "column"
        if part in ROW_PARALLEL:
            return "row"
        if REPLICATED_LAYER.match(part):
            return "replicated"
    raise MapperError(f"Cannot merge Megatron tensor {key!r}: its tensor-parallel layout is not known to the workbench "
                      "(column-, row-, vocabulary-parallel or replicated). Drop it (M.Drop) or merge it by hand.", tensor=key)


def _true_vocab(catalog: Catalog, vocab_size: int | None) -> int | None:
    if vocab_size is not None:
        return vocab_size
    return _int(_args(catalog).get("vocab_size"))


def megatron_merge(source: Any, *, vocab_size: int | None = None, check_replicas: bool = True) -> Mapper:
    """Legacy Megatron shards (`mp_rank_TT[_PPP]/<key>`) -> the whole tensors of a TP=1, PP=1 model (`<key>`).

    `vocab_size`: the true vocabulary (default: the checkpoint's `args.vocab_size`; when neither is known the
    padded rows stay). `check_replicas`: compare every TP rank's copy of replicated parameters (norms), which
    reads them all (they are small); False takes rank 0's copy unread.
    """
    catalog = _catalog(source)
    if not _is_legacy(catalog):
        raise MapperError(f"Cannot build the Megatron merge for a {catalog.format} checkpoint "
                          f"({catalog.metadata.get('layout', 'not legacy')}): it needs the legacy Megatron layout "
                          "(iter_N/mp_rank_*/model_optim_rng.pt). A torch_dist folder is already merged: use "
                          "presets.megatron_to_hf directly.")
    args = _args(catalog)
    tp_size = int(catalog.metadata.get("tp_size", "1"))
    tied = args.get("untie_embeddings_and_output_weights") is False
    swiglu = bool(args.get("swiglu", False))
    vocab = _true_vocab(catalog, vocab_size)
    shards = _shards(catalog)
    cut: list[Mapper] = []
    join: list[Mapper] = []
    trim: list[Mapper] = []
    drop: list[Mapper] = []
    for key, by_rank in shards.items():
        if sorted(by_rank) != list(range(tp_size)):
            raise MapperError(f"Cannot merge Megatron tensor {key!r}: it is held by tensor-parallel ranks {sorted(by_rank)}, "
                              f"not all {tp_size}. Copy every rank folder.", tensor=key)
        names = [by_rank[t] for t in range(tp_size)]
        layout = _layout(key)
        if key == "output_layer.weight" and tied and "embedding.word_embeddings.weight" in shards:
            join += [Drop(n) for n in names]  # the last stage's copy of the tied embedding
            continue
        if layout == "replicated":
            if check_replicas and tp_size > 1:
                join.append(Function("workbench.mapper.presets.megatron:same_on_every_rank", names, [key],
                                     infer="workbench.mapper.presets.megatron:infer_same_on_every_rank", params={"names": names}))
            else:
                join += [Rename(names[0], key), *[Drop(n) for n in names[1:]]]
        elif swiglu and layout == "column" and _part(key) in GATED:
            gates, ups = [f"{n}.gate" for n in names], [f"{n}.up" for n in names]
            cut += [Split(n, [g, u], dim=0) for n, g, u in zip(names, gates, ups, strict=True)]
            join.append(Concat([*gates, *ups], key, dim=0))
        elif layout == "row":
            join.append(Concat(names, key, dim=1) if tp_size > 1 else Rename(names[0], key))
        else:
            join.append(Concat(names, key, dim=0) if tp_size > 1 else Rename(names[0], key))
            if layout == "vocab" and vocab is not None:
                padded = sum(catalog.tensors[n].shape[0] for n in names)
                if vocab > padded:
                    raise MapperError(f"Cannot merge {key!r}: the true vocabulary ({vocab}) is larger than the padded one "
                                      f"({padded}). Check vocab_size.", tensor=key)
                if vocab < padded:
                    trim.append(Split(key, [key, f"{key}.vocab_padding"], sizes=[vocab, padded - vocab], dim=0))
                    drop.append(Drop(f"{key}.vocab_padding"))
    stages = [Parallel(*ops) for ops in (cut, join, trim, drop) if ops]
    return Sequential(*stages)


# ---------------------------------------------------------------------------------------------- HF names


def hf_config(source: Any, *, vocab_size: int | None = None) -> dict[str, Any]:
    """The transformers config (as a dict) of a Megatron GPT checkpoint's model: Llama, or Qwen2 with a QKV bias.

    Read from the checkpoint's args (legacy format); the true vocabulary from `vocab_size`, else `args.vocab_size`,
    else the padded size. Refuses models outside that family (no SwiGLU, no RMSNorm, no RoPE, linear biases).
    """
    catalog = _catalog(source)
    args = _args(catalog)
    if not args:
        raise MapperError(f"Cannot make an HF config for {catalog.location if hasattr(catalog, 'location') else catalog.root}: "
                          "it records no Megatron args. Pass config= (a config.json) instead.")
    problems = []
    if not args.get("swiglu"):
        problems.append("the MLP is not gated (swiglu is off)")
    if args.get("normalization") not in (None, "RMSNorm"):
        problems.append(f"normalization is {args.get('normalization')}")
    if args.get("position_embedding_type") not in (None, "rope"):
        problems.append(f"position embeddings are {args.get('position_embedding_type')}")
    if args.get("add_bias_linear"):
        problems.append("the linear layers have biases (add_bias_linear)")
    if problems:
        raise MapperError(f"Cannot map this Megatron model to HF Llama/Qwen2: {'; '.join(problems)}. Write the mapping by hand "
                          "(start from presets.megatron_merge).")
    experts = _int(args.get("num_experts"))
    heads = int(args["num_attention_heads"])
    hidden = int(args["hidden_size"])
    kv = int(args["num_query_groups"]) if args.get("group_query_attention") and args.get("num_query_groups") else heads
    vocab = vocab_size or _int(args.get("vocab_size")) or int(args["padded_vocab_size"])
    qwen = bool(args.get("add_qkv_bias"))
    if experts:
        if qwen:
            raise MapperError("Cannot map this Megatron model to HF: a mixture-of-experts model with a QKV bias (Qwen2-MoE) "
                              "is not mapped yet. Start from presets.megatron_merge.")
        return {
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": hidden,
            "intermediate_size": int(args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size") or 4 * hidden),
            "num_local_experts": experts, "num_experts_per_tok": int(args.get("moe_router_topk") or 2),
            "num_hidden_layers": int(args["num_layers"]), "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": int(args.get("kv_channels") or hidden // heads), "vocab_size": vocab,
            "rms_norm_eps": float(args.get("norm_epsilon") or 1e-5), "rope_theta": float(args.get("rotary_base") or 10000),
            "max_position_embeddings": int(args.get("max_position_embeddings") or args.get("seq_length") or 4096),
            "tie_word_embeddings": args.get("untie_embeddings_and_output_weights") is False, "hidden_act": "silu",
        }
    return {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "hidden_size": hidden, "intermediate_size": int(args.get("ffn_hidden_size") or 4 * hidden),
        "num_hidden_layers": int(args["num_layers"]), "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": int(args.get("kv_channels") or hidden // heads), "vocab_size": vocab,
        "rms_norm_eps": float(args.get("norm_epsilon") or 1e-5), "rope_theta": float(args.get("rotary_base") or 10000),
        "max_position_embeddings": int(args.get("max_position_embeddings") or args.get("seq_length") or 4096),
        "tie_word_embeddings": args.get("untie_embeddings_and_output_weights") is False, "hidden_act": "silu",
        **({} if qwen else {"attention_bias": False, "mlp_bias": False}),
    }


def _names(source: Any) -> list[str]:
    return [info.name for info in source_infos(source)]


def _hf_renames(names: set[str], stacked: dict[str, int]) -> tuple[list[Mapper], list[Mapper]]:
    """(unstack ops for torch_dist's stacked layers, rename/split ops) from merged Megatron names to HF names."""
    unstack: list[Mapper] = []
    for key, layers in stacked.items():
        part = key[len("decoder.layers."):]
        unstack.append(Unstack(key, [f"decoder.layers.{i}.{part}" for i in range(layers)], dim=0))
    parts = {m[2] for n in names if (m := LAYER_KEY.match(n))} | {k[len("decoder.layers."):] for k in stacked}
    src, dst = "decoder.layers.{i}", HF_LAYERS
    ops: list[Mapper] = []
    for suffix in ("weight", "bias"):
        if f"self_attention.linear_qkv.{suffix}" in parts:
            ops.append(Rename(f"{src}.self_attention.linear_qkv.{suffix}", f"{dst}.self_attention.linear_qkv.{suffix}"))
    for megatron, hf in (("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
                         ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
                         ("input_layernorm.weight", "input_layernorm.weight"),
                         ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
                         ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
                         ("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight")):
        if megatron in parts:
            ops.append(Rename(f"{src}.{megatron}", f"{dst}.{hf}"))
    if "mlp.linear_fc1.weight" in parts:
        ops.append(Split(f"{src}.mlp.linear_fc1.weight", [f"{dst}.mlp.gate_proj.weight", f"{dst}.mlp.up_proj.weight"], dim=0))
    if any(LOCAL_EXPERT.match(p) for p in parts):  # Mixtral's file layout: experts.{e}.w1 (gate), w3 (up), w2 (down)
        expert, moe = f"{src}.mlp.experts.local_experts.{{e}}", f"{dst}.block_sparse_moe"
        ops += [Rename(f"{src}.mlp.router.weight", f"{moe}.gate.weight"),
                Split(f"{expert}.linear_fc1.weight", [f"{moe}.experts.{{e}}.w1.weight", f"{moe}.experts.{{e}}.w3.weight"], dim=0),
                Rename(f"{expert}.linear_fc2.weight", f"{moe}.experts.{{e}}.w2.weight")]
    for megatron, hf in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                         ("decoder.final_layernorm.weight", "model.norm.weight"), ("output_layer.weight", "lm_head.weight")):
        if megatron in names:
            ops.append(Rename(megatron, hf))
    return unstack, ops


def megatron_to_hf(source: Any, *, config: Any = None, vocab_size: int | None = None, check_replicas: bool = True) -> Mapper:
    """A Megatron-core GPT checkpoint -> HF Llama (or Qwen2) names and layout, as one mapper.

    Legacy folders (format 'megatron') are merged first (`megatron_merge`); merged sources (a torch_dist folder,
    or the merge's output) are renamed directly, torch_dist's stacked layers unstacked. `config` (a config.json,
    dict or transformers config) gives the attention shape; by default it is made from the checkpoint's args
    (`hf_config`). Tensors of the Megatron layout the preset does not know are reported, not passed through.
    """
    qkv = MEGATRON_QKV  # the preset's template of the fused QKV module

    catalog = getattr(source, "catalog", source)
    legacy = _is_legacy(catalog)
    if config is None:
        if not (isinstance(catalog, Catalog) and _args(catalog)):
            raise MapperError("Cannot map Megatron names to HF without the model's config: pass config= (a config.json, "
                              "dict or transformers config). Megatron's own folders carry theirs (args; hf_config).")
        config = hf_config(catalog, vocab_size=vocab_size)
    vocab = vocab_size or _vocab_of(config)
    steps: list[Mapper] = []
    if legacy:
        merge = megatron_merge(catalog, vocab_size=vocab, check_replicas=check_replicas)
        steps.append(merge)
        names = set(merge.bind(catalog).raise_for_problems().outputs)
        stacked: dict[str, int] = {}
    else:
        infos = {info.name: info for info in source_infos(source)}
        names = set(infos)
        stacked = {n: infos[n].shape[0] for n in names if n.startswith("decoder.layers.") and not LAYER_KEY.match(n)
                   and not n.endswith("._extra_state") and infos[n].shape}
    unstack, renames = _hf_renames(names, stacked)
    if unstack:
        steps.append(Parallel(*unstack))
    if not legacy and vocab is not None:  # merged sources keep megatron's vocabulary padding: cut it
        trim = [(key, infos[key].shape[0]) for key in VOCAB_PARALLEL if key in infos and infos[key].shape[0] > vocab]
        if trim:
            steps.append(Parallel(*[Split(key, [key, f"{key}.vocab_padding"], sizes=[vocab, rows - vocab], dim=0) for key, rows in trim]))
            steps.append(Parallel(*[Drop(f"{key}.vocab_padding") for key, _ in trim]))
    steps += [Parallel(*renames), megatron_qkv_to_hf(config, qkv=qkv),
              Claim("Megatron GPT (presets.megatron_to_hf)", r"(?:decoder|embedding|output_layer)\..*", _UNKNOWN_HINT)]
    return Sequential(*steps)


VOCAB_OUTPUTS = (*VOCAB_PARALLEL, "model.embed_tokens.weight", "lm_head.weight")


def vocab_padding_problems(catalog: Any, outputs: Mapping[str, TensorInfo]) -> list[Problem]:
    """A plan warning when a Megatron source's vocabulary tensors reach the output with Megatron's padding rows.

    Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by` x TP (`padded_vocab_size`); the
    true size is `args.vocab_size`, which runs that read a tokenizer model often record as None. Then neither
    the merge nor `hf_config` knows where the padding starts: the rows stay, and the config says the padded size,
    so the HF model's logits include tokens no tokenizer has. The fix is the tokenizer's size as `vocab_size=`.
    """
    if not isinstance(catalog, Catalog) or catalog.format != "megatron":
        return []
    args = _args(catalog)
    padded = _int(args.get("padded_vocab_size"))
    if padded is None or _int(args.get("vocab_size")) is not None:
        return []
    kept = sorted(name for name in VOCAB_OUTPUTS if name in outputs and tuple(outputs[name].shape[:1]) == (padded,))
    if not kept:
        return []
    names = ", ".join(repr(name) for name in kept)
    return [Problem(
        "warning",
        f"{names} {'keeps' if len(kept) == 1 else 'keep'} Megatron's padded vocabulary ({padded} rows): the run's args do not record the true vocabulary "
        f"(args.vocab_size is None, padded_vocab_size={padded}), so the padding rows cannot be cut, and hf_config (a "
        f"config.json made from these args) says vocab_size {padded}: the model can predict tokens no tokenizer has. "
        "Pass the tokenizer's vocabulary size: megatron_to_hf(source, vocab_size=N) (or megatron_merge) and "
        "hf_config(source, vocab_size=N).",
        None, kept[0], kind="preset",
    )]


def _vocab_of(config: Any) -> int | None:
    from .model_shape import read_config

    data = read_config(config) if isinstance(config, (Mapping, str)) or hasattr(config, "to_dict") else {}
    return _int(data.get("vocab_size"))


__all__ = ["hf_config", "infer_same_on_every_rank", "megatron_merge", "megatron_to_hf", "same_on_every_rank",
           "vocab_padding_problems"]
