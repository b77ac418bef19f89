"""Tiny base models and PEFT adapters, made with the real transformers and peft, cached per session.

PEFT initialises lora_B to zero (and DoRA's magnitude to the base norm), so every adapter here gets
random lora_B, biases and magnitudes: a merge that ignored them would not equal the base.
"""

from __future__ import annotations

from pathlib import Path

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)
GPT2 = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)


def base_model(kind: str, seed: int = 0):
    """A freshly initialised tiny Llama or GPT-2 (fp32)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**LLAMA))
    return GPT2LMHeadModel(GPT2Config(**GPT2))


def randomise(peft_model, seed: int = 1) -> None:
    """Give every adapter parameter (lora_B included) random values."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1 + (1.0 if "magnitude" in name else 0.0))


def make_case(root: Path, kind: str, **lora) -> tuple[Path, Path, dict]:
    """Save base/ and adapter/ in separate folders under `root`; return them and the merged state dict."""
    from peft import LoraConfig, get_peft_model

    base, adapter = root / "base", root / "adapter"
    model = base_model(kind)
    model.save_pretrained(base)
    peft_model = get_peft_model(model, LoraConfig(**lora))
    randomise(peft_model)
    peft_model.save_pretrained(adapter)
    merged = peft_model.merge_and_unload()
    return base, adapter, {k: v.detach().clone() for k, v in merged.state_dict().items()}
