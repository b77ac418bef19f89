"""tokenizer.json and tokenizer_config.json from a GGUF file's vocabulary, as transformers builds them (and its
config.json for the file, used for families the workbench has no config table for).

transformers converts a GGUF vocabulary (`tokenizer.ggml.*`: SentencePiece-style `llama` or byte-level `gpt2`, its
merges, token types and special ids) into a fast tokenizer when it opens `from_pretrained(..., gguf_file=...)`. The
files are that tokenizer saved, so the converted folder tokenises as transformers does with the GGUF file. It runs in
a child process: transformers' GGUF path imports torch, which the conversion process never needs (its memory plan
leaves torch out), and the parent holds only the files' text. A process that has imported transformers and torch
already (a notebook, a test) builds them in-process instead: the child would import both again for nothing. Each
transformers GGUF open parses the whole vocabulary with gguf-py (seconds for a 150k-token one), so transformers' config
is built only when asked for. Results are kept per file (path, size, mtime) for the life of the process, so planning
again costs nothing.
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
_CHILD = "import sys; from workbench.output.gguf.hf_tokenizer import save; save(*sys.argv[1:4], config=sys.argv[4] == '1')"
TRANSFORMERS_CONFIG = "transformers/config.json"  # transformers' own config of the GGUF file, when it has one
_cache: dict[tuple[str, int, int, bool], tuple[dict[str, str], str]] = {}


def save(folder: str, name: str, out: str, config: bool = False) -> None:
    """Save transformers' tokenizer of GGUF file `folder`/`name` into `out` (and with `config`, its config into
    `out`/transformers): what the child process runs, or this process when it holds transformers already."""
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ValueError as exc:  # an architecture transformers does not load (deepseek2): its vocabulary it still reads
        if "is not supported yet" not in str(exc):
            raise
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
    if config:
        try:
            AutoConfig.from_pretrained(folder, gguf_file=name).save_pretrained(os.path.join(out, "transformers"))
        except Exception:  # noqa: BLE001 - no config for an architecture transformers does not know: none is returned
            pass


def tokenizer_files(path: str | os.PathLike, config: bool = False, *, child: bool | None = None) -> tuple[dict[str, str], str]:
    """({file name: text} of the tokenizer files for GGUF file `path`, why none: '' when made); with `config`,
    transformers' config.json of the file as well (TRANSFORMERS_CONFIG) when it has one. `child`: build them in a
    child process (True) or in this one (False); by default in this one only when it has imported transformers and
    torch already. Needs transformers (and the `tokenizers` and `gguf` packages) installed; otherwise returns no files
    and says so."""
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, config)
    if key in _cache:
        return _cache[key]
    if importlib.util.find_spec("transformers") is None:
        return {}, "transformers is not installed (pip install transformers) to build them from the GGUF vocabulary"
    if child is None:
        child = not {"transformers", "torch"} <= set(sys.modules)
    with tempfile.TemporaryDirectory(prefix="wb-gguf-tokenizer-") as out:
        failed = _run_child(path, out, config) if child else _run_here(path, out, config)
        if failed:
            result: tuple[dict[str, str], str] = ({}, f"transformers could not build them from the GGUF vocabulary ({failed[:300]})")
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


def _run_child(path: Path, out: str, config: bool) -> str:
    """`save` in a child process; its last error line, '' when done."""
    where = str(Path(__file__).resolve().parents[3])  # the child imports this very workbench
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path.parent), path.name, out, "1" if config else "0"],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)
    return (done.stderr.strip().splitlines() or ["no message"])[-1] if done.returncode else ""


def _run_here(path: Path, out: str, config: bool) -> str:
    """`save` in this process; the error, '' when done."""
    try:
        save(str(path.parent), path.name, out, config)
    except Exception as exc:  # noqa: BLE001 - reported as the child's failure is: no tokenizer files, and why
        return f"{type(exc).__name__}: {exc}"
    return ""


__all__ = ["FILES", "TRANSFORMERS_CONFIG", "save", "tokenizer_files"]
