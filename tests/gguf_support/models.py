"""Tiny random HF checkpoints (Llama, Llama 3.1 / 3.2 RoPE, Mistral, Qwen2, Qwen3, MoE) with one of three real tokenizer kinds llama.cpp reads:
a Llama-style byte-fallback BPE `tokenizer.json`, a SentencePiece `tokenizer.model` trained here, or GPT-2's own
byte-level BPE rebuilt from the vocabulary llama.cpp ships (`models/ggml-vocab-gpt-2.gguf`), which the converter
recognises by its pre-tokenizer hash."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

SEED = 1234


def _tokenizer(folder: Path) -> None:
    """A Llama-style byte-fallback BPE (no pre-tokenizer hash for llama.cpp to reject), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = []
    for a, b in (("▁", "t"), ("h", "e"), ("▁t", "he"), ("i", "n"), ("▁", "a")):
        for piece in (a, b):
            vocab.setdefault(piece, len(vocab))
        vocab.setdefault(a + b, len(vocab))
        merges.append((a, b))
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "model_max_length": 128,
    }))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return len(tok.get_vocab())


LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _byte_level_tokenizer(folder: Path, vocab_gguf: Path, kind: str) -> int:
    """A real byte-level BPE rebuilt from a vocabulary llama.cpp ships: GPT-2's (ggml-vocab-gpt-2.gguf), Qwen2's
    (ggml-vocab-qwen2.gguf, Qwen2's split regex) or Llama 3's (ggml-vocab-llama-bpe.gguf, its regex, merges
    ignored for whole-word tokens, BOS added by a template), saved as tokenizer.json; its vocabulary size."""
    import gguf
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    reader = gguf.GGUFReader(vocab_gguf)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    end = tokens[int(reader.fields["tokenizer.ggml.eos_token_id"].contents())]
    normal = {t: k for k, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == 1}
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == 3]
    tok = Tokenizer(models.BPE(vocab=normal, merges=merges, ignore_merges=kind == "llama3"))
    regex = {"qwen2": QWEN2_REGEX, "llama3": LLAMA3_REGEX}.get(kind)
    if regex is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if kind == "llama3":
        bos = tokens[int(reader.fields["tokenizer.ggml.bos_token_id"].contents())]
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                          special_tokens=[(bos, normal.get(bos, tokens.index(bos)))])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(folder / "tokenizer.json"))
    qwen2 = kind == "qwen2"
    config = {"bos_token": None if qwen2 else end, "eos_token": end, "unk_token": None if qwen2 else end, "model_max_length": 1024,
              "tokenizer_class": {"qwen2": "Qwen2Tokenizer", "llama3": "PreTrainedTokenizerFast"}.get(kind, "GPT2Tokenizer")}
    if qwen2:
        config["pad_token"] = end
    if kind == "llama3":
        config.update(bos_token=bos, unk_token=None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return len(tokens)


TRAIN_SENTENCEPIECE = """
import sys
import sentencepiece as spm
text, prefix = sys.argv[1], sys.argv[2]
lines = [line for line in open(text, encoding="utf-8").read().splitlines() if line.strip()]
spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=prefix, vocab_size=400, model_type="bpe",
                               byte_fallback=True, character_coverage=1.0, user_defined_symbols=["<tool>"], unk_id=0,
                               bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
"""


def _sentencepiece_tokenizer(folder: Path, train: Callable[[Path], None]) -> int:
    """A SentencePiece BPE `tokenizer.model` (trained by `train(prefix)`), an added token and Llama 2's
    tokenizer_config; the config's vocabulary is 4 longer than the model's, so the converter pads it."""
    train(folder / "tokenizer")
    from workbench.output.gguf.vocab import sentencepiece_pieces

    n_pieces = len(sentencepiece_pieces(folder / "tokenizer.model"))
    (folder / "added_tokens.json").write_text(json.dumps({"<extra_0>": n_pieces}))
    specials = {"0": "<unk>", "1": "<s>", "2": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "model_max_length": 128,
        "added_tokens_decoder": {**{k: {"content": v, "special": True} for k, v in specials.items()},
                                 str(n_pieces + 1): {"content": "<|tool_call|>", "special": False},
                                 str(n_pieces + 2): {"content": "▁plain", "special": False}},
    }))
    return n_pieces + 4


# Llama 3.1-3.3's rope block (config.json's rope_scaling, transformers v5's rope_parameters) but for the factor.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def build(folder: Path, family: str = "llama", dtype: str = "bfloat16", tokenizer: str = "fallback",
          vocab_gguf: Path | None = None, train: Callable[[Path], None] | None = None) -> Path:
    """Write a tiny random `family` model (untied embeddings, GQA) with a `tokenizer` ("fallback", "gpt2", "qwen2" or
    "llama3" rebuilt from `vocab_gguf`, or "spm" trained by `train`) into `folder`."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer in ("gpt2", "qwen2", "llama3"):
        n_vocab = _byte_level_tokenizer(folder, vocab_gguf, tokenizer)
    elif tokenizer == "spm":
        n_vocab = _sentencepiece_tokenizer(folder, train)
    else:
        n_vocab = _tokenizer(folder)
    common = dict(vocab_size=n_vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2)
    if family == "llama":
        config = transformers.LlamaConfig(**common, head_dim=16)
        cls = transformers.LlamaForCausalLM
    elif family == "llama31":  # Llama 3.1's RoPE scaling (llama.cpp generates rope_freqs.weight), one factor band value
        config = transformers.LlamaConfig(**{**common, "max_position_embeddings": 131072}, head_dim=16,
                                          rope_parameters=dict(LLAMA3_ROPE, factor=8.0))
        cls = transformers.LlamaForCausalLM
    elif family == "llama32":  # Llama 3.2 1B's shape of it: tied embeddings, factor 32, head_dim 64
        config = transformers.LlamaConfig(**{**common, "tie_word_embeddings": True, "max_position_embeddings": 131072}, head_dim=64,
                                          rope_parameters=dict(LLAMA3_ROPE, factor=32.0))
        cls = transformers.LlamaForCausalLM
    elif family == "mistral":
        config = transformers.MistralConfig(**common, head_dim=16)
        cls = transformers.MistralForCausalLM
    elif family == "mixtral":
        config = transformers.MixtralConfig(**common, head_dim=16, num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=64)
        cls = transformers.Qwen2MoeForCausalLM
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "olmoe":
        config = transformers.OlmoeConfig(**{**common, "rms_norm_eps": 1e-6}, num_experts=4, num_experts_per_tok=2)
        cls = transformers.OlmoeForCausalLM
    elif family == "deepseek_v3":  # MLA (both LoRA ranks), one dense layer then 4 routed + 1 shared expert, YaRN as V3 has it;
        # distinct widths so every MLA length llama.cpp writes is told apart; scoring_func is in V3's own config
        config = transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=64,
            qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, scoring_func="sigmoid",
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
        cls = transformers.DeepseekV3ForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif family == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=16)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(SEED)
    model = cls(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder
