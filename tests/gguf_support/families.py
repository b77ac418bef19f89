"""Tiny random Phi-3, Gemma 2 and Gemma 3 (text) HF models, and what llama.cpp's converter writes for them: GGUF
files of families the workbench does not write but reads back (`M.presets.gguf_to_hf`) and transformers loads.

Kept apart from models.py, whose digest names the cached models every other GGUF test uses. Each folder is cached
under .cache/fixtures/gguf-models/ keyed by this file's digest, each GGUF under the converter's references."""

from __future__ import annotations

import hashlib
from pathlib import Path

TOKENIZERS = {"phi3": "spm", "gemma2": "spm", "gemma3": "gpt2"}
SEED = 1234


def _build(folder: Path, family: str, vocab_gguf: Path, train) -> None:
    import torch
    import transformers
    from gguf_support.models import _byte_level_tokenizer, _sentencepiece_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    kind = TOKENIZERS[family]
    n_vocab = _byte_level_tokenizer(folder, vocab_gguf, "gpt2") if kind == "gpt2" else _sentencepiece_tokenizer(folder, train)
    common = dict(vocab_size=n_vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    if family == "phi3":
        config = transformers.Phi3Config(**common, tie_word_embeddings=False, rms_norm_eps=1e-5, pad_token_id=0)
        cls = transformers.Phi3ForCausalLM  # the SentencePiece tokenizer_config names LlamaTokenizer: the converter's spm route
    elif family == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=16, rms_norm_eps=1e-6, pad_token_id=0, sliding_window=64)
        cls = transformers.Gemma2ForCausalLM
    elif family == "gemma3":
        config = transformers.Gemma3TextConfig(**common, head_dim=16, rms_norm_eps=1e-6, pad_token_id=0, sliding_window=64)
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(SEED)
    model = cls(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(folder)


def model_folder(family: str) -> Path:
    """The cached tiny `family` model (phi3, gemma2, gemma3) with its tokenizer."""
    from gguf_support.reference import CACHE, SCRIPT, _train_sentencepiece, cached_folder, converter

    recipe = hashlib.sha256(Path(__file__).read_bytes() + (Path(__file__).parent / "models.py").read_bytes()).hexdigest()[:8]
    folder = CACHE / "gguf-models" / f"{family}-{TOKENIZERS[family]}-{SEED}-{recipe}"
    if (folder / "model.safetensors").is_file():
        return folder
    converter()
    vocab = SCRIPT.parent / "models" / "ggml-vocab-gpt-2.gguf"
    return cached_folder(folder, lambda aside: _build(aside, family, vocab, _train_sentencepiece))


def reference_gguf(family: str, outtype: str) -> Path:
    """What llama.cpp's converter writes for `model_folder(family)` with `--outtype outtype` (cached)."""
    from gguf_support.reference import ROOT, _run_converter, building

    folder = model_folder(family)
    out = ROOT / "references" / f"{folder.name}-{outtype}.gguf"
    if out.is_file():
        return out
    with building(out):
        if not out.is_file():
            _run_converter(None, folder, outtype, out)
    return out
