"""Every GGML type gguf-py de-quantises (K-quants, IQ*, TQ*, MXFP4, NVFP4, ...), read back by `M.presets.gguf_to_hf`
(mapper/presets/gguf_dequant.py) a row chunk at a time: equal bit for bit to `gguf.quants.dequantize` of the whole
tensor, for a plain tensor and a q projection whose rows llama.cpp permuted. Files of random valid blocks
(gguf_support/kquants.py); the Llama file with most types at once and transformers' view of it are in
tests/mapper/test_gguf_inverse.py and tests/system/test_gguf_to_hf_transformers.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import workbench as wb
from workbench import mapper as M
from workbench.mapper.presets.gguf_dequant import (
    DEQUANT_BYTES_PER_VALUE,
    block_of,
    dequantized_rows,
    stored_row_bytes,
)
from workbench.mapper.row_jobs import row_job

gguf = pytest.importorskip("gguf")

from gguf_support.kquants import build_one_type, dequantisable_types, reference_values  # noqa: E402

TYPES = dequantisable_types()


def test_the_list_holds_the_newer_types() -> None:
    """The parametrisation below follows the installed gguf-py: it must hold the types this issue asks for."""
    assert {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
            "MXFP4", "Q4_K", "Q8_0", "BF16"} <= set(TYPES)
    assert set(TYPES) - {"F32", "F16", "BF16"} <= set(DEQUANT_BYTES_PER_VALUE)  # each one's memory measured, not guessed


@pytest.mark.parametrize("kind", TYPES)
def test_each_type_by_row_chunks_equals_gguf_py(kind: str, tmp_path: Path) -> None:
    path = build_one_type(tmp_path / f"{kind}.gguf", kind)
    ck = wb.open_checkpoint(path)
    assert ck.tensors.loc["token_embd.weight", "gguf_type"] == kind
    mapper = M.presets.gguf_to_hf(path, dtype="F32")
    plan = wb.plan(path, mapper, extras=False, chunk_size="16KB")
    steps = {s.group.outputs[0].name: s for s in plan.steps}
    embed = steps["model.embed_tokens.weight"]
    assert plan.ok and embed.kind == ("copy" if kind == "F32" else "rows")
    if embed.kind == "rows":
        job = row_job(embed.group)
        rows_per_chunk = job.chunk_rows(job.budget(16 << 10))
        assert 1 <= rows_per_chunk < job.rows  # several chunks (37 rows: the last one short unless one row each)
    report = wb.convert(path, tmp_path / "hf", mapper, extras=False, chunk_size="16KB", quiet=True, verify=True)
    assert report.verified
    out = load_file(tmp_path / "hf" / "model.safetensors")
    expected = reference_values(path)  # gguf-py on each whole tensor, q rows put back in HF order
    for ours, theirs in (("model.embed_tokens.weight", "token_embd.weight"), ("model.layers.0.self_attn.q_proj.weight",
                                                                            "blk.0.attn_q.weight")):
        assert out[ours].dtype == np.float32 and out[ours].shape == expected[theirs].shape, ours
        assert out[ours].tobytes() == expected[theirs].tobytes(), ours
        assert np.isfinite(out[ours]).all() and np.abs(out[ours]).max() > 0  # valid blocks: real values, not NaN or zeros


@pytest.mark.parametrize("kind", [k for k in TYPES if k not in ("F32", "F16", "BF16")])
def test_rows_split_at_any_whole_row_give_the_whole_tensor(kind: str) -> None:
    """`dequantized_rows` on rows [0, k) and [k, n) for every k, joined, equals gguf-py on all n rows (blocks never
    straddle a row, so a row boundary is a block boundary), and rounded to F16/BF16 equals rounding gguf-py's values."""
    import ml_dtypes
    from gguf_support.kquants import random_blocks

    block, _ = block_of(kind)
    cols = 2 * max(block, 128)
    raw = random_blocks(np.random.default_rng(7), (5, cols), kind)
    assert raw.shape == (5, stored_row_bytes(kind, cols))
    whole = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    for k in range(1, 5):
        parts = [dequantized_rows(part.reshape(-1), kind, cols, 0, "F32") for part in (raw[:k], raw[k:])]
        assert np.concatenate(parts).tobytes() == whole.tobytes(), k
    as_bf16 = dequantized_rows(raw.reshape(-1), kind, cols, 0, "BF16")
    assert as_bf16.tobytes() == whole.astype(ml_dtypes.bfloat16).tobytes()
    assert dequantized_rows(raw.reshape(-1), kind, cols, 0, "F16").tobytes() == whole.astype(np.float16).tobytes()


def test_a_type_gguf_py_cannot_dequantise_is_a_plan_problem_naming_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "q8k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_uint32("llama.attention.head_count", 4)
    writer.add_tensor("token_embd.weight", np.zeros((4, 292), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "Q8_K" not in TYPES  # gguf 0.19 has no de-quantiser for it: the run would fail mid-way without this check
    plan = wb.plan(path, M.presets.gguf_to_hf(path), extras=False, dest=tmp_path / "out")
    assert not plan.ok
    assert any("Cannot de-quantise 'token_embd.weight'" in p.message and "Q8_K" in p.message for p in plan.problems)
