"""A Megatron run whose args do not know the true vocabulary (issue 29, D5b).

Megatron pads the vocabulary (250 -> 256 in the fixtures); tp2pp2's args record `vocab_size: None`. Converted
without `vocab_size=`, the padding rows stay and `hf_config` says 256: the plan warns, naming the tensors.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from workbench import mapper as M

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_megatron_fixtures.py"


@pytest.fixture(scope="module")
def megatron_root() -> Path:
    root = Path(subprocess.run([sys.executable, str(SCRIPT), "--print-root"], capture_output=True, text=True, check=True).stdout.strip())
    if not (root / "done").exists():
        pytest.skip("Megatron fixtures unavailable; run `python scripts/make_megatron_fixtures.py`")
    return root


def _vocab_warnings(plan) -> list:
    return [p for p in plan.problems if p.severity == "warning" and "padded vocabulary" in p.message]


def test_unknown_true_vocabulary_is_a_plan_warning(megatron_root: Path) -> None:
    ck = wb.open_checkpoint(megatron_root / "tp2pp2")
    assert M.presets.megatron_hf_config(ck)["vocab_size"] == 256  # what a config.json made from the args says
    plan = wb.plan(ck, M.presets.megatron_to_hf(ck), rest="drop")
    assert plan.ok and plan.outputs.loc["model.embed_tokens.weight", "shape"] == (256, 64)
    (warning,) = _vocab_warnings(plan)
    assert warning.tensor == "model.embed_tokens.weight"
    assert "256 rows" in warning.message and "args.vocab_size is None" in warning.message and "vocab_size=N" in warning.message
    # the default conversion of a legacy folder (the merge alone) says it too, under Megatron's names
    (merged,) = _vocab_warnings(wb.plan(ck))
    assert merged.tensor == "embedding.word_embeddings.weight"


def test_a_known_vocabulary_plans_without_the_warning(megatron_root: Path) -> None:
    ck = wb.open_checkpoint(megatron_root / "tp2pp2")
    plan = wb.plan(ck, M.presets.megatron_to_hf(ck, vocab_size=250), rest="drop")
    assert plan.outputs.loc["model.embed_tokens.weight", "shape"] == (250, 64) and not _vocab_warnings(plan)
    tp2 = wb.open_checkpoint(megatron_root / "tp2")  # its args know vocab_size=250
    assert not _vocab_warnings(wb.plan(tp2, M.presets.megatron_to_hf(tp2), rest="drop"))
