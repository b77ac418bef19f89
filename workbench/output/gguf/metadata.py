"""The key/value metadata of a GGUF file for an HF Llama-family folder, as llama.cpp's converter writes it.

Model parameters come from `config.json`; the tokenizer from the folder's tokenizer files (`vocab`: the
converter's SentencePiece, byte-fallback BPE and GPT-2 BPE routes); name and size label through the `gguf` package's
`Metadata` heuristics. Values are collected in a `GGUFWriter` (never opened) so their GGUF types are
exactly the ones llama.cpp's writer would give them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import PlanError
from .. import source_files
from ..config_values import ModelConfig
from .tokenizer_json import give_back_freed_heap
from .vocab import add_vocab

FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "BF16": 32}  # llama.cpp's LlamaFileType for an all-of-one-type file


def read_config(root: Path, output: str = "GGUF") -> ModelConfig:
    """`config.json` of an HF folder, read by the source-file rule (`source_files`) and its model parameters
    checked by type and range (`ModelConfig.checked`); refused clearly when missing, not JSON or out of range."""
    path = Path(root) / "config.json"
    config = source_files.read_json_object(path)
    if config is None:
        raise PlanError(f"Cannot write {output} for {root}: it has no config.json (the model's parameters). "
                        "Convert an HF model folder.", file=str(path))
    return ModelConfig(config, path).checked()


def _model_parameters(writer: Any, config: ModelConfig) -> int:
    import gguf

    heads = config.size("num_attention_heads")
    hidden = config.size("hidden_size")
    head_dim = config.size("head_dim", 0) or hidden // heads
    writer.add_block_count(config.size("num_hidden_layers"))
    writer.add_context_length(config.size("max_position_embeddings"))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config.size("intermediate_size"))
    writer.add_head_count(heads)
    deepseek = config.get("model_type") == "deepseek_v3"  # MLA is written as MQA: one K/V head
    writer.add_head_count_kv(1 if deepseek else config.size("num_key_value_heads", heads))
    rope = config.rope()
    _rope_scaling(writer, rope, config.size("original_max_position_embeddings", None), config)
    theta = config.real("rope_theta", None, where=rope, label="rope_theta (RoPE block)") if "rope_theta" in rope else config.real("rope_theta", None)
    if theta is not None:
        writer.add_rope_freq_base(theta)
    # llama.cpp's OLMoE converter writes 1e-5 whatever the config says (OLMoE's own value)
    writer.add_layer_norm_rms_eps(1e-5 if config.get("model_type") == "olmoe" else config.real("rms_norm_eps", 1e-6, below=1.0))
    experts = _first(config, "num_local_experts", "num_experts", "n_routed_experts")
    if experts is not None:
        writer.add_expert_count(config.count(experts))
    for key, add in (("num_experts_per_tok", writer.add_expert_used_count), ("n_group", writer.add_expert_group_count),
                     ("topk_group", writer.add_expert_group_used_count)):
        if config.get(key) is not None:
            add(config.count(key))
    score = _first(config, "score_function", "scoring_func", "score_func")
    if score is not None:  # the router's scoring function, as llama.cpp's expert gating function
        score = config[score]
        gating = {kind.name.lower(): kind for kind in gguf.ExpertGatingFuncType}
        if str(score) not in gating:
            raise PlanError(f"Cannot write GGUF: the router's scoring function {score!r} is not one the gguf package "
                            f"names ({', '.join(gating)}). Fix config.json or use llama.cpp's convert_hf_to_gguf.py.")
        writer.add_expert_gating_func(gating[str(score)])
    if config.get("head_dim"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    return head_dim


def _rope_scaling(writer: Any, rope: dict[str, Any], original_context: int | None, config: ModelConfig) -> None:
    """The RoPE scaling keys llama.cpp's converter writes for linear and YaRN scaling (none for Llama 3's `llama3`,
    whose factors are the generated `rope_freqs.weight` tensor: `rope`). `original_context`: config.json's
    original_max_position_embeddings, for a YaRN block without it. `rope`: the block `config.rope()` checked."""
    import gguf

    kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    label = "the RoPE block's {}".format
    if kind in ("su", "longrope"):
        raise PlanError(f"Cannot write GGUF: config.json's RoPE scaling type {kind!r} (LongRoPE, Phi-3's) needs the "
                        "rope_factors_long / rope_factors_short tensors llama.cpp's Phi-3 converter generates, and Phi-3 is "
                        "not a family the workbench maps to GGUF. Convert this model with llama.cpp's convert_hf_to_gguf.py.")
    if kind not in (None, "default", "linear", "yarn") and str(kind).lower() != "llama3":
        raise PlanError(f"Cannot write GGUF: config.json's RoPE scaling type {kind!r} is not one the workbench writes "
                        "(linear, yarn, llama3). Convert this model with llama.cpp's convert_hf_to_gguf.py.")
    if kind not in ("linear", "yarn") or factor is None:
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(factor)
    if kind == "yarn":
        original = config.size("original_max_position_embeddings", original_context, where=rope,
                                label=label("original_max_position_embeddings"))
        if original is None:
            raise PlanError(f"Cannot use {config.path}: its YaRN RoPE scaling names no original_max_position_embeddings, "
                            "which the GGUF keys need. Fix the file.", file=config.path)
        writer.add_rope_scaling_orig_ctx_len(original)
        for key, add in (("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
                         ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", writer.add_rope_scaling_yarn_beta_fast), ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            value = rope.get(key, rope.get("attn_factor")) if key == "attention_factor" else rope.get(key)
            if value is not None:
                add(value)


def _first(config: dict[str, Any], *keys: str) -> Any:
    """The first of `keys` present (not None) in `config`, as llama.cpp's converter looks hyperparameters up."""
    return next((k for k in keys if config.get(k) is not None), None)


def _deepseek_parameters(writer: Any, config: ModelConfig) -> None:
    """What llama.cpp's DeepSeek-V2 converter (V3's too) adds after the file type: dense leading layers, MLA's ranks
    and head widths (the cache holds kv_lora_rank + qk_rope_head_dim wide keys), shared experts and routing scale."""
    routed = config.count("n_routed_experts", None)
    dense = config.count("first_k_dense_replace", None)
    writer.add_leading_dense_block_count(dense if dense is not None else 0 if routed is not None else config.size("num_hidden_layers"))
    kv_lora_rank = config.size("kv_lora_rank", 512)
    writer.add_vocab_size(config.vocab())
    if config.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(config.size("q_lora_rank"))
    rope_dim = config.size("qk_rope_head_dim")
    writer.add_kv_lora_rank(kv_lora_rank)
    writer.add_key_length(kv_lora_rank + rope_dim)
    writer.add_value_length(kv_lora_rank)
    writer.add_key_length_mla(config.size("qk_nope_head_dim") + rope_dim)
    writer.add_value_length_mla(config.size("v_head_dim"))
    writer.add_expert_feed_forward_length(config.size(_first(config, "moe_intermediate_size", "intermediate_size") or "moe_intermediate_size"))
    if routed is not None:
        writer.add_expert_count(routed)
    writer.add_expert_shared_count(config.count("n_shared_experts", 0))
    if config.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(config.real("routed_scaling_factor"))
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(bool(config["norm_topk_prob"]))
    writer.add_rope_dimension_count(rope_dim)
    rope = config.rope()
    if rope.get("mscale_all_dim") is not None:  # llama.cpp's DeepSeek-2 YaRN factor, 0.1 x mscale_all_dim
        writer.add_rope_scaling_yarn_log_mul(0.1 * config.real("mscale_all_dim", where=rope, positive=False))


def parameter_counts(shapes: dict[str, tuple[int, ...]]) -> tuple[int, int, int, int]:
    """(total, shared, per-expert, experts) parameters of the planned tensors, counted as llama.cpp's writer counts
    them for the size label: a `*_exps.*` tensor of 3 or more dims holds experts along its third-last dim."""
    total = shared = expert = expert_sum = n_expert_tensors = 0
    for name, shape in shapes.items():
        size = 1
        for d in shape:
            size *= d
        if "_exps." in name and len(shape) >= 3:
            count = shape[-2 if ".bias" in name else -3]
            expert += size // count
            expert_sum += count
            n_expert_tensors += 1
        else:
            shared += size
        total += size
    return total, shared, expert, expert_sum // n_expert_tensors if n_expert_tensors else 0


def kv_metadata(root: Path, arch: str, config: dict[str, Any], gguf_type: str, counts: tuple[int, int, int, int]) -> dict[str, Any]:
    """Every key/value pair, in llama.cpp's order, as the `gguf` package's `GGUFValue`s. Config values are read by
    `ModelConfig`'s typed getters; the folder's files by `source_files` (the gguf package's own readers get a
    staged copy)."""
    import logging

    import gguf

    config = ModelConfig.of(config)

    logging.getLogger("gguf").setLevel(logging.WARNING)
    writer = gguf.GGUFWriter(None, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    with source_files.staged(root, ("README.md", "config.json", "generation_config.json")) as copy:  # what it reads
        meta = gguf.Metadata.load(None, copy, None, counts[0])
    if meta.size_label is None and counts[0] > 0:
        meta.size_label = gguf.size_label(*counts)
    meta.set_gguf_meta_model(writer)
    head_dim = _model_parameters(writer, config)
    writer.add_file_type(FILE_TYPES[gguf_type])
    if arch == "deepseek2":  # it rewrites key/value lengths and the expert count in place, as the converter does
        logging.getLogger("gguf").setLevel(logging.ERROR)  # (the writer warns of each rewritten key)
        _deepseek_parameters(writer, config)
        logging.getLogger("gguf").setLevel(logging.WARNING)
    if arch in ("qwen2moe", "qwen3moe"):  # llama.cpp's Qwen2-MoE converter (Qwen3-MoE's too) adds the expert widths last
        if config.get("moe_intermediate_size") is not None:
            writer.add_expert_feed_forward_length(config.size("moe_intermediate_size"))
        if config.get("shared_expert_intermediate_size") is not None:
            writer.add_expert_shared_feed_forward_length(config.size("shared_expert_intermediate_size"))
    vocab_size = config.vocab() or None
    if arch == "llama":  # llama.cpp's Llama converter (also Mistral) adds these two; Qwen's does not
        writer.add_vocab_size(vocab_size or _count_tokens(root))
        writer.add_rope_dimension_count(head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    prefix_space = _tokenizer_config(root).get("add_prefix_space")
    if arch == "llama" and prefix_space is not None:
        writer.add_add_space_prefix(bool(prefix_space))
    add_vocab(writer, root, arch, vocab_size)
    give_back_freed_heap()  # what reading tokenizer.json freed: not resident for the whole run
    return dict(writer.kv_data[0])


def _tokenizer_config(root: Path) -> dict[str, Any]:
    found = source_files.read_json(root / "tokenizer_config.json")
    return found if isinstance(found, dict) else {}


def _count_tokens(root: Path) -> int:
    """Tokens of the folder's tokenizer, for a config without vocab_size."""
    import gguf

    writer = gguf.GGUFWriter(None, "llama")
    return add_vocab(writer, root, "llama", None)


__all__ = ["FILE_TYPES", "kv_metadata", "parameter_counts", "read_config"]
