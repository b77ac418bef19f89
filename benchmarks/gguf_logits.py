"""Logits llama.cpp computes on the workbench's GGUF next to transformers' on the source model (a slow check).

Usage:
    PYTHONPATH=.:LLAMA_CPP_SITE python benchmarks/gguf_logits.py [--family llama] [--outtype f32 --outtype q8_0 ...]

LLAMA_CPP_SITE is a folder where llama-cpp-python is installed (built from the sdist the tests cache, e.g.
`pip install --target /tmp/llama-site .cache/fixtures/llama_cpp_python-0.3.36.tar.gz`, ~25 min on 2 shared
cores, so it is not part of `make test`). Once its libllama.so is built, the sdist's own `llama_cpp/` package
(plus `diskcache`) on PYTHONPATH with LLAMA_CPP_LIB_PATH=<folder of the .so files> is enough. For each type the tiny test model (tests/gguf_support) is converted with
`wb.convert(..., to="gguf")`, loaded by llama.cpp, and evaluated on the same token ids as transformers in
float32; prints a markdown table of the largest logit difference relative to the largest logit.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def transformers_logits(folder: Path, tokens: list[int]):
    """float32 logits of the HF model in `folder` on `tokens` (one sequence)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def llama_cpp_logits(path: Path, tokens: list[int]):
    """Logits llama.cpp computes for every position of `tokens` with the GGUF at `path`."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=len(tokens) + 8, logits_all=True, verbose=False, n_threads=1)
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def main() -> None:
    import numpy as np
    from gguf_support.reference import model_folder

    import workbench as wb

    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="llama")
    parser.add_argument("--outtype", action="append", default=[])
    args = parser.parse_args()
    src = model_folder(args.family)
    rng = np.random.default_rng(0)
    tokens = [1, *rng.integers(3, 200, size=15).tolist()]
    reference = transformers_logits(src, tokens)
    scale = float(np.abs(reference).max())
    print(f"| {args.family} GGUF type | max abs logit diff | relative to max logit | same argmax |")
    print("|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as work:
        for outtype in args.outtype or ["f32", "f16", "bf16", "q8_0", "q4_0"]:
            out = Path(work) / outtype
            wb.convert(src, out, to="gguf", dtype=outtype, quiet=True)
            got = llama_cpp_logits(out / "model.gguf", tokens)
            diff = float(np.abs(got - reference).max())
            same = float((got.argmax(-1) == reference.argmax(-1)).mean())
            print(f"| {outtype} | {diff:.4g} | {diff / scale:.2e} | {same:.0%} |", flush=True)


if __name__ == "__main__":
    main()
