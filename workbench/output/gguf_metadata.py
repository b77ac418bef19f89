"""The key/value metadata of a GGUF file for an HF Llama-family folder, as llama.cpp's converter writes it.

Model parameters come from `config.json`; the tokenizer from the folder's tokenizer files (`gguf_vocab`: the
converter's SentencePiece, byte-fallback BPE and GPT-2 BPE routes); name and size label through the `gguf` package's
`Metadata` heuristics. Values are collected in a `GGUFWriter` (never opened) so their GGUF types are
exactly the ones llama.cpp's writer would give them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import PlanError
from .gguf_tokenizer_json import give_back_freed_heap
from .gguf_vocab import add_vocab

FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "BF16": 32}  # llama.cpp's LlamaFileType for an all-of-one-type file


def read_config(root: Path) -> dict[str, Any]:
    """`config.json` of an HF folder, refused clearly when missing or not JSON."""
    path = root / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanError(f"Cannot write GGUF for {root}: it has no config.json (the model's parameters). "
                        "Convert an HF model folder.") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise PlanError(f"Cannot write GGUF for {root}: config.json is not JSON ({exc}). Fix the file.") from None
    if not isinstance(config, dict):
        raise PlanError(f"Cannot write GGUF for {root}: config.json is not an object. Fix the file.")
    return config


def _model_parameters(writer: Any, config: dict[str, Any]) -> int:
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
    # llama.cpp's OLMoE converter writes 1e-5 whatever the config says (OLMoE's own value)
    writer.add_layer_norm_rms_eps(1e-5 if config.get("model_type") == "olmoe" else float(config["rms_norm_eps"]))
    experts = config.get("num_local_experts", config.get("num_experts"))
    if experts is not None:
        writer.add_expert_count(int(experts))
    if config.get("num_experts_per_tok") is not None:
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    if "head_dim" in config and config["head_dim"]:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    return head_dim


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
    """Every key/value pair, in llama.cpp's order, as the `gguf` package's `GGUFValue`s."""
    import logging

    import gguf

    logging.getLogger("gguf").setLevel(logging.WARNING)
    writer = gguf.GGUFWriter(None, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    meta = gguf.Metadata.load(None, root, None, counts[0])
    if meta.size_label is None and counts[0] > 0:
        meta.size_label = gguf.size_label(*counts)
    meta.set_gguf_meta_model(writer)
    head_dim = _model_parameters(writer, config)
    writer.add_file_type(FILE_TYPES[gguf_type])
    if arch in ("qwen2moe", "qwen3moe"):  # llama.cpp's Qwen2-MoE converter (Qwen3-MoE's too) adds the expert widths last
        if config.get("moe_intermediate_size") is not None:
            writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        if config.get("shared_expert_intermediate_size") is not None:
            writer.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))
    vocab_size = int(config["vocab_size"]) if config.get("vocab_size") else None
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
    try:
        found = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return found if isinstance(found, dict) else {}


def _count_tokens(root: Path) -> int:
    """Tokens of the folder's tokenizer, for a config without vocab_size."""
    import gguf

    writer = gguf.GGUFWriter(None, "llama")
    return add_vocab(writer, root, "llama", None)


__all__ = ["FILE_TYPES", "kv_metadata", "parameter_counts", "read_config"]
