"""Build every cached GGUF test model and llama.cpp reference ahead of the tests that read them.

conftest starts this in the background (niced, one thread) when a session collects GGUF tests: most of the
suite keeps one core busy, and the converter's runs (~5 s of CPU each, mostly importing torch and
transformers) fill the other one instead of adding to the suite's wall time. The tests ask for the same
things through `reference.py`, whose locks make whoever comes second wait for the first.

    python tests/gguf_support/prebuild.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gguf_support import families, gpt2  # noqa: E402
from gguf_support.reference import CASES, reference_gguf  # noqa: E402

# What tests/system/test_gguf_to_hf_transformers.py reads of families.py (not kept there: its digest names the models)
FAMILY_CASES = [("phi3", "q8_0"), ("gemma2", "q8_0"), ("gemma3", "f16")]


def main() -> int:
    for family, outtype, tokenizer in CASES:
        reference_gguf(family, outtype, tokenizer)
        print(f"built {family} {outtype} {tokenizer or ''}", flush=True)
    for family, outtype in FAMILY_CASES:
        families.reference_gguf(family, outtype)
        print(f"built {family} {outtype} (families.py)", flush=True)
    for outtype in gpt2.CASES:
        gpt2.reference_gguf(outtype)
        print(f"built gpt2 {outtype} (gpt2.py)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
