"""tokenizer.json and tokenizer_config.json from a GGUF file's vocabulary, as transformers builds them (and its
config.json for the file, used for families the workbench has no config table for).

transformers converts a GGUF vocabulary (`tokenizer.ggml.*`: SentencePiece-style `llama` or byte-level `gpt2`, its
merges, token types and special ids) into a fast tokenizer when it opens `from_pretrained(..., gguf_file=...)`. The
files are that tokenizer saved, so the converted folder tokenises as transformers does with the GGUF file. It runs in
a child process: transformers' GGUF path imports torch, which the conversion process never needs (its memory plan
leaves torch out), and the parent holds only the files' text. Results are kept per file (path, size, mtime) for the
life of the process, so planning again costs nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FILES = ("tokenizer.json", "tokenizer_config.json")
# Keys transformers' save records about where it loaded from, not about the tokenizer.
_LOAD_KEYS = ("is_local", "local_files_only", "name_or_path")
TIMEOUT = 600
MAX_TEXT = 256 << 20  # a tokenizer.json larger than this is not read back
_CHILD = """
import os, sys
from transformers import AutoConfig, AutoTokenizer
folder, name, out = sys.argv[1:4]
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
try:
    AutoConfig.from_pretrained(folder, gguf_file=name).save_pretrained(os.path.join(out, "transformers"))
except Exception:
    pass
"""
TRANSFORMERS_CONFIG = "transformers/config.json"  # transformers' own config of the GGUF file, when it has one
_cache: dict[tuple[str, int, int], tuple[dict[str, str], str]] = {}


def tokenizer_files(path: str | os.PathLike) -> tuple[dict[str, str], str]:
    """({file name: text} of the tokenizer files for GGUF file `path`, why none: '' when made). Needs transformers
    (and the `tokenizers` and `gguf` packages) installed; otherwise returns no files and says so."""
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _cache:
        return _cache[key]
    if importlib.util.find_spec("transformers") is None:
        return {}, "transformers is not installed (pip install transformers) to build them from the GGUF vocabulary"
    with tempfile.TemporaryDirectory(prefix="wb-gguf-tokenizer-") as out:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(path.parent), path.name, out], capture_output=True, text=True,
                              timeout=TIMEOUT)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            result: tuple[dict[str, str], str] = ({}, f"transformers could not build them from the GGUF vocabulary ({last[:300]})")
        else:
            files = {}
            for name in (*FILES, TRANSFORMERS_CONFIG):
                target = Path(out) / name
                if target.is_file() and target.stat().st_size <= MAX_TEXT:
                    files[name] = target.read_text(encoding="utf-8")
            if "tokenizer_config.json" in files:
                config = json.loads(files["tokenizer_config.json"])
                for drop in _LOAD_KEYS:
                    config.pop(drop, None)
                # the generic fast tokenizer: tokenizer.json as built. A model's class (GemmaTokenizer) rebuilds its own
                # pipeline when loaded and then tokenises otherwise than the GGUF file (Gemma 3 with a byte-level BPE)
                config["tokenizer_class"] = "PreTrainedTokenizerFast"
                files["tokenizer_config.json"] = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
            result = (files, "")
    _cache[key] = result
    return result


__all__ = ["FILES", "TRANSFORMERS_CONFIG", "tokenizer_files"]
