"""Regenerate the tiny sample checkpoints in `sample_checkpoints/` with the real transformers writers.

The samples are what notebooks, docs and tests open: an HF-sharded GQA Llama (several shards plus an
index) and a single-file BERT. Weights are random but seeded, so two runs write identical tensor bytes.

Usage: python scripts/make_samples.py [--out sample_checkpoints] [--check]
  --check  regenerate into a temp folder and fail if any file differs from the committed one.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "sample_checkpoints"
SEED = 20240607
# Small enough that the ~0.7 MB Llama lands in 3-4 shards.
LLAMA_SHARD_SIZE = 250_000


def make_llama(out: Path) -> Path:
    """A 4-layer GQA Llama (4 query heads, 2 key/value heads), float32, saved as HF shards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    folder = out / "tiny-llama"
    model.save_pretrained(folder, max_shard_size=LLAMA_SHARD_SIZE)
    return folder


def make_bert(out: Path) -> Path:
    """A 2-layer BERT encoder (with pooler), float32, saved as one `model.safetensors`."""
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        type_vocab_size=2,
    )
    torch.manual_seed(SEED + 1)
    model = BertModel(config).to(torch.float32).eval()
    folder = out / "tiny-bert"
    model.save_pretrained(folder)
    return folder


def generate(out: Path) -> list[Path]:
    """Write every sample under `out`, replacing previous copies; returns the sample folders."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tiny-llama", "tiny-bert"):
        shutil.rmtree(out / name, ignore_errors=True)
    folders = [make_llama(out), make_bert(out)]
    for folder in folders:
        for path in folder.iterdir():
            path.chmod(0o644)  # the safetensors writer creates files readable by their owner only
    return folders


# transformers stamps its own version into config.json and generation_config.json; the weights and every other
# field do not depend on it (checked under 5.23.0 and 5.24.0), so a newer transformers is not a difference.
VERSION_STAMP = re.compile(rb'"transformers_version": "[^"]*"')


def _unstamped(path: Path) -> bytes:
    """The file's bytes, with the value of a JSON file's `transformers_version` field blanked."""
    data = path.read_bytes()
    return VERSION_STAMP.sub(b'"transformers_version": ""', data) if path.suffix == ".json" else data


def differing_files(a: Path, b: Path) -> list[str]:
    """Relative paths of files present in only one of two trees or whose bytes differ (ignoring only the
    `transformers_version` stamp of JSON files)."""
    rels_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    rels_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    out = sorted(str(r) for r in rels_a ^ rels_b)
    for rel in sorted(rels_a & rels_b):
        if _unstamped(a / rel) != _unstamped(b / rel):
            out.append(str(rel))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--check", action="store_true", help="compare a fresh generation with --out instead of writing")
    args = parser.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            bad = [rel for name in ("tiny-llama", "tiny-bert") for rel in differing_files(Path(tmp) / name, args.out / name)]
        if bad:
            print("samples differ from a fresh generation: " + ", ".join(bad), file=sys.stderr)
            return 1
        print("samples are up to date")
        return 0
    for folder in generate(args.out):
        files = sorted(p for p in folder.iterdir() if p.is_file())
        total = sum(p.stat().st_size for p in files)
        print(f"{folder}: {len(files)} files, {total} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
