"""Run llama.cpp's convert_hf_to_gguf.py (argv[1]) with its own arguments, reading Qwen tokenizers as HF
byte-fallback BPE (the route it takes for Llama) instead of its GPT-2 pre-tokenizer hash check, which
rejects any freshly made tiny tokenizer. Tensors and architecture metadata stay the converter's own."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

script = Path(sys.argv[1])
sys.argv = [str(script), *sys.argv[2:]]
sys.path.insert(0, str(script.parent))
sys.path.insert(1, str(script.parent / "gguf-py"))
qwen = __import__("conversion.qwen", fromlist=["Qwen2Model"])
qwen.Qwen2Model.set_vocab = lambda self: self._set_vocab_llama_hf()
runpy.run_path(str(script), run_name="__main__")
