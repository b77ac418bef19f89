"""A tiny random GPT-2 HF model (GPT-2's own byte-level BPE vocabulary) and what llama.cpp's converter writes for it: a
family the workbench reads back (`M.presets.gguf_to_hf`: Conv1D weights transposed back) but does not write.

Two details of the tiny model make llama.cpp's converter and transformers' GGUF loader accept it, as they accept the
real GPT-2: config.json carries `n_ctx` (the converter reads it; transformers 5 no longer saves it), and n_positions is
1024 (transformers' GGUF loader maps the context length to n_ctx only, so n_positions keeps its default, 1024, and a
smaller position table would not load). Weights are F16, so HF -> GGUF F16 -> HF must give back the same bytes.

Kept apart from models.py and families.py, whose digests name the cached models of every other GGUF test; the folder
is cached under .cache/fixtures/gguf-models/ keyed by this file's digest, each GGUF under the converter's references."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

SEED = 1234
CASES = ("f16", "q8_0")  # what the tests read (and the pre-build builds)


def _build(folder: Path, vocab_gguf: Path) -> None:
    import torch
    import transformers
    from gguf_support.models import _byte_level_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    n_vocab = _byte_level_tokenizer(folder, vocab_gguf, "gpt2")
    end = n_vocab - 1  # <|endoftext|>
    config = transformers.GPT2Config(vocab_size=n_vocab, n_positions=1024, n_embd=64, n_layer=2, n_head=4, bos_token_id=end,
                                     eos_token_id=end)
    torch.manual_seed(SEED)
    model = transformers.GPT2LMHeadModel(config).to(torch.float16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    saved["n_ctx"] = saved["n_positions"]
    (folder / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def model_folder() -> Path:
    """The cached tiny GPT-2 with its tokenizer."""
    from gguf_support.reference import CACHE, SCRIPT, cached_folder, converter

    recipe = hashlib.sha256(Path(__file__).read_bytes() + (Path(__file__).parent / "models.py").read_bytes()).hexdigest()[:8]
    folder = CACHE / "gguf-models" / f"gpt2-gpt2-{SEED}-{recipe}"
    if (folder / "model.safetensors").is_file():
        return folder
    converter()  # the sdist holds GPT-2's vocabulary
    return cached_folder(folder, lambda aside: _build(aside, SCRIPT.parent / "models" / "ggml-vocab-gpt-2.gguf"))


def reference_gguf(outtype: str) -> Path:
    """What llama.cpp's converter writes for `model_folder()` with `--outtype outtype` (cached)."""
    from gguf_support.reference import ROOT, _run_converter, building

    folder = model_folder()
    out = ROOT / "references" / f"{folder.name}-{outtype}.gguf"
    if out.is_file():
        return out
    with building(out):
        if not out.is_file():
            _run_converter(None, folder, outtype, out)
    return out
