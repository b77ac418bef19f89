"""Peak RSS and wall time of `workbench convert --to gguf` next to llama.cpp's convert_hf_to_gguf.py on the same folder.

Usage:
    python benchmarks/gguf_vs_llama_cpp.py --size 1GiB [--size 2GiB] [--outtype q8_0] [--vocab 128256] [--tokenizer llama3]
        [--work /tmp/gguf-bench]
    python benchmarks/gguf_vs_llama_cpp.py --src HF_FOLDER [--outtype f16]

`--size` builds (once, reused while its stamp matches) a BF16 Llama of about that many bytes under `--work`:
TinyLlama widths (hidden 2048, intermediate 5632, 32 heads, 4 kv heads), layers filling the size, and the tiny
byte-fallback tokenizer of the GGUF tests (so the script accepts it), or with `--tokenizer llama3` Llama 3's real
vocabulary (128,256 tokens, 280k merges; a 17 MB tokenizer.json rebuilt, as the tests do, from llama.cpp's own
`models/ggml-vocab-llama-bpe.gguf`; the embedding then has 128,256 rows). Several sizes show whether the peak stays
flat as the model grows. Each tool runs in a child process of its own; its peak RSS is that child's ru_maxrss
(the largest single process). The workbench's engine resets the kernel's high-water mark when its run starts (to
report the run's own peak), which would hide the planning (the tokenizer read): it runs here with that reset off. The converter is the one the tests fetch (llama-cpp-python sdist, cached under
.cache/fixtures/). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

_WRAP = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")


def measure(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of one command, measured by a wrapper process of its own."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _WRAP, *cmd], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return seconds, int(done.stderr.strip().splitlines()[-1]) / 1024


def _bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (ml_dtypes: round to nearest even) bits, as uint16."""
    import ml_dtypes

    return values.astype(ml_dtypes.bfloat16).view(np.uint16)


LLAMA3_VOCAB = 128256


def _write_tokenizer(folder: Path, tokenizer: str) -> int:
    """The tests' byte-fallback tokenizer ("fallback") or Llama 3's real one ("llama3"); its vocabulary size."""
    from gguf_support.models import _byte_level_tokenizer, _tokenizer

    if tokenizer == "fallback":
        return _tokenizer(folder)
    from gguf_support.reference import converter

    return _byte_level_tokenizer(folder, converter().parent / "models" / "ggml-vocab-llama-bpe.gguf", tokenizer)


def make_bf16_llama(folder: Path, size_bytes: int, seed: int = 0, vocab: int = 0, tokenizer: str = "fallback") -> Path:
    """A BF16 Llama of about `size_bytes` with the GGUF tests' tokenizer (or Llama 3's: `tokenizer="llama3"`),
    written once (stamped) into `folder`. `vocab`: rows of the embedding and lm_head (default: the tokenizer's size);
    a Llama 3 size (128256) makes the largest single tensors 0.5 GB each, which is what a tool's peak follows."""
    from make_llama_like import GIB, STAMP, LlamaShape, _fresh, _stamp_matches, write_sharded

    base = LlamaShape()
    vocab = vocab or (LLAMA3_VOCAB if tokenizer == "llama3" else 0)
    embeddings = 2 * vocab * base.hidden * 2
    layers = max(1, round((size_bytes - embeddings) / (base.layer_elements() * 2)))
    stamp = {"kind": "gguf-bench-llama", "layers": layers, "seed": seed, "version": 1, **({"vocab": vocab} if vocab else {}),
             **({"tokenizer": tokenizer} if tokenizer != "fallback" else {})}
    if _stamp_matches(folder, stamp):
        return folder
    _fresh(folder)
    n_vocab = _write_tokenizer(folder, tokenizer)
    shape = LlamaShape(layers=layers, vocab=vocab or n_vocab)
    rng = np.random.default_rng(seed)

    def fill(info):
        if len(info.shape) == 1:
            return _bf16(np.ones(info.shape, dtype=np.float32))
        values = rng.standard_normal(info.numel, dtype=np.float32)
        values *= 0.02
        return _bf16(values)

    specs = [(n, s, "BF16") for n, s in shape.tensors()]
    write_sharded(folder, specs, max(1, round(size_bytes / (GIB / 2))), fill)
    config = {**shape.hf_config(), "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "head_dim": shape.head_dim,
              "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / STAMP).write_text(json.dumps(stamp))  # the shape follows from it (a stamp with the shape never matched)
    return folder


def parse_bytes(text: str) -> int:
    """'1GiB', '512MiB', '1.5GiB' -> bytes."""
    units = {"gib": 1 << 30, "mib": 1 << 20, "gb": 10**9, "mb": 10**6}
    low = text.strip().lower()
    for unit, scale in units.items():
        if low.endswith(unit):
            return int(float(low[: -len(unit)]) * scale)
    return int(low)


# `workbench convert` with the engine's high-water-mark reset off, so ru_maxrss covers planning too.
_WHOLE_PROCESS = ("import runpy, sys, workbench.engine.rank as rank; rank.reset_rss_peak = lambda: False; "
                  "sys.argv = ['workbench', *sys.argv[1:]]; runpy.run_module('workbench', run_name='__main__', alter_sys=True)")


def compare(src: Path, outtype: str, work: Path, env: dict[str, str]) -> list[tuple[str, float, float]]:
    """Run both tools once on `src`; (tool, seconds, peak RSS MiB) rows. Outputs are deleted after each run."""
    from gguf_support.reference import converter

    ours_out, ref_out = work / "wb-out", work / "ref.gguf"
    ours = [sys.executable, "-c", _WHOLE_PROCESS, "convert", str(src), str(ours_out), "--to", "gguf", "--dtype", outtype, "--overwrite", "--quiet"]
    theirs = [sys.executable, str(converter()), str(src), "--outtype", outtype, "--outfile", str(ref_out)]
    rows = [("workbench `--to gguf`", *measure(ours, env))]
    rows.append(("`convert_hf_to_gguf.py`", *measure(theirs, env)))
    same = (ours_out / "model.gguf").read_bytes() == ref_out.read_bytes() if (ours_out / "model.gguf").stat().st_size < 4 << 30 else None
    for path in (ours_out / "model.gguf", ref_out):
        path.unlink(missing_ok=True)
    if same is False:
        raise SystemExit(f"The two GGUF files of {src} differ: the comparison is not like for like.")
    return rows


def main() -> None:
    from gguf_support.reference import EXTRA

    parser = argparse.ArgumentParser()
    parser.add_argument("--src", help="an HF folder to convert (instead of --size)")
    parser.add_argument("--size", action="append", default=[], help="build a BF16 Llama of this size (repeatable), e.g. 1GiB")
    parser.add_argument("--outtype", default="q8_0")
    parser.add_argument("--vocab", type=int, default=0, help="embedding rows (default: the tokenizer's); 128256 = Llama 3's")
    parser.add_argument("--tokenizer", choices=["fallback", "llama3"], default="fallback",
                        help="the tests' tiny byte-fallback tokenizer, or Llama 3's real one (128,256 tokens)")
    parser.add_argument("--work", default="/tmp/gguf-bench")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{EXTRA}"}
    suffix = (f"-v{args.vocab}" if args.vocab else "") + (f"-{args.tokenizer}" if args.tokenizer != "fallback" else "")
    sizes = args.size or ["1GiB"]
    inputs = [Path(args.src)] if args.src else [make_bf16_llama(work / f"llama-{s}{suffix}", parse_bytes(s), vocab=args.vocab,
                                                                   tokenizer=args.tokenizer) for s in sizes]
    print(f"| input ({args.outtype}, one run each) | tool | seconds | peak RSS MiB | RSS ratio | time ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for src in inputs:
        size = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 2**20
        rows = compare(src, args.outtype, work, env)
        (_, t_ours, m_ours), (_, t_ref, m_ref) = rows
        for k, (tool, seconds, rss) in enumerate(rows):
            vocab = f", vocab {args.vocab:,}" if args.vocab else ""
            vocab += ", Llama 3 tokenizer" if args.tokenizer == "llama3" else ""
            label = f"{size:,.0f} MiB BF16 Llama{vocab}" if k == 0 else ""
            ratios = f"{m_ours / m_ref:.2f} | {t_ours / t_ref:.2f}" if k == 0 else " | "
            print(f"| {label} | {tool} | {seconds:.1f} | {rss:,.0f} | {ratios} |", flush=True)
    print(f"\n(`python benchmarks/gguf_vs_llama_cpp.py {' '.join(sys.argv[1:])}`; ratios are workbench / script; "
          "the GGUF files were compared byte for byte.)")


if __name__ == "__main__":
    main()
