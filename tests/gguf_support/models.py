"""Tiny random HF checkpoints (Llama, Qwen2, Qwen3) with a byte-fallback BPE tokenizer llama.cpp accepts."""

from __future__ import annotations

import json
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


def build(folder: Path, family: str = "llama", dtype: str = "bfloat16") -> Path:
    """Write a tiny random `family` model (untied embeddings, GQA) with its tokenizer into `folder`."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    n_vocab = _tokenizer(folder)
    common = dict(vocab_size=n_vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2)
    if family == "llama":
        config = transformers.LlamaConfig(**common, head_dim=16)
        cls = transformers.LlamaForCausalLM
    elif family == "mistral":
        config = transformers.MistralConfig(**common, head_dim=16)
        cls = transformers.MistralForCausalLM
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
