"""GGUF conversion in bounded memory without torch: each typed tensor is read, permuted, converted and written a
row chunk at a time (`mapper.presets.gguf_rows`, `engine.rows`), and the plan predicts the process's peak RSS."""

from __future__ import annotations

import json
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import workbench as wb
from tests.conftest import run_cli_measured
from workbench.catalog import TensorInfo
from workbench.mapper.presets.gguf_rows import ROW_BUDGET, RowJob, convert_rows, numpy_dtype, row_bytes
from workbench.planning.rss import rank_libraries, rss_parts
from workbench.planning.rss_calibration import LIBRARY_SPREAD
from workbench.planning.schedule import COPY, ROWS

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
pytest.importorskip("gguf")
ml_dtypes = pytest.importorskip("ml_dtypes")



pytestmark = pytest.mark.serial  # measures peak RSS: run alone (see conftest.SERIAL_MARKERS)


@pytest.fixture(scope="module")
def wide_vocab_llama(tmp_path_factory) -> Path:
    """A one-layer BF16 Llama (hidden 1024, 16 heads, 4 kv heads) whose embedding and lm_head are 128 MiB each."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from gguf_support.models import _tokenizer
        from make_llama_like import LlamaShape, write_sharded
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    folder = tmp_path_factory.mktemp("wide-vocab")
    _tokenizer(folder)
    shape = LlamaShape(hidden=1024, intermediate=2816, heads=16, kv_heads=4, layers=1, vocab=65536)

    def fill(info: TensorInfo) -> np.ndarray:
        values = (np.arange(info.numel, dtype=np.float32) % 251 - 125) * np.float32(0.004)
        return values.astype(ml_dtypes.bfloat16).view(np.uint16)

    write_sharded(folder, [(n, s, "BF16") for n, s in shape.tensors()], 1, fill)
    config = {**shape.hf_config(), "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "head_dim": shape.head_dim}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "F16", "BF16", "F32"])
def test_a_row_chunk_allocates_no_more_than_the_plan_counts(kind: str) -> None:
    """The held-bytes bound of one chunk (bytes read, float32 copy, the quantiser's results and scratch) covers what
    numpy allocates converting it, permutation included (tracemalloc sees numpy's buffers)."""
    source = "F32" if kind == "BF16" else "BF16"
    info = TensorInfo("q", source, (4096, 2048))
    job = RowJob((info,), TensorInfo("attn_q.weight", "U8", (1,)), kind, heads=32)
    rows = job.chunk_rows(ROW_BUDGET)
    assert rows % job.unit == 0 and 0 < job.held(rows) <= ROW_BUDGET
    data = (np.arange(rows * job.cols, dtype=np.float32) % 97 - 48).astype(numpy_dtype(source)).reshape(rows, job.cols)
    tracemalloc.start()
    try:
        out, _, _ = convert_rows(data, kind, rows // job.unit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.nbytes == rows * row_bytes(job.cols, kind)
    assert peak + data.nbytes <= job.held(rows), (peak, job.held(rows))


def test_a_128_mib_embedding_converts_in_row_chunks_without_torch_as_the_plan_predicts(wide_vocab_llama: Path, tmp_path: Path) -> None:
    """`workbench convert --to gguf --dtype q8_0` of a model with two 128 MiB tensors: every typed tensor is a ROWS
    step, the plan's tensor peak is one row chunk, the process imports neither torch nor transformers, and its
    peak RSS (VmHWM) is within 15 % of plan.rss_bytes (a whole embedding held would add 128 MiB and more)."""
    plan = wb.plan(wide_vocab_llama, to="gguf", dtype="q8_0", dest=tmp_path / "planned")
    assert {s.kind for s in plan.steps} == {ROWS}
    assert rank_libraries(plan, 0) == "numpy" and not plan.needs_torch and "no torch" in plan.summary()
    assert 1 * MIB < plan.peak_bytes <= ROW_BUDGET
    out = tmp_path / "out"
    imported, measured = run_cli_measured(["convert", str(wide_vocab_llama), str(out), "--to", "gguf", "--dtype", "q8_0", "--quiet"],
                                          whole_process=True)
    assert not imported & {"torch", "transformers"}
    low = plan.rss_bytes - LIBRARY_SPREAD.get("numpy", 0)  # numpy's shared objects faulted in, not written whole
    assert low - 0.15 * measured <= measured <= plan.rss_bytes + 0.15 * measured, json.dumps(
        {"predicted": plan.rss_bytes, "measured": measured, "parts": {p.part: p.bytes for p in rss_parts(plan, 0)}})
    import gguf

    written = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out / "model.gguf").tensors}
    assert written["token_embd.weight"] == written["blk.0.attn_q.weight"] == "Q8_0" and len(written) == len(plan.steps)


def test_same_dtype_tensors_stay_byte_copies_and_a_user_mapper_ahead_keeps_torch(wide_vocab_llama: Path) -> None:
    """bf16 output copies the matrices (permuted q/k too) and converts only the norms by rows; a mapper applied
    before the preset makes its groups ordinary torch computes (the row path recognises the preset's op alone)."""
    from workbench import mapper as M

    bf16 = wb.plan(wide_vocab_llama, to="gguf", dtype="bf16", dest="/tmp/unused")
    kinds = {s.group.outputs[0].name: s.kind for s in bf16.steps}
    assert kinds["blk.0.attn_q.weight"] == COPY and kinds["token_embd.weight"] == COPY
    assert kinds["blk.0.attn_norm.weight"] == ROWS
    scaled = wb.plan(wide_vocab_llama, M.Cast("model.layers.0.mlp.up_proj.weight", "F32"), to="gguf", dtype="q8_0",
                     dest="/tmp/unused")
    assert {s.group.outputs[0].name: s.kind for s in scaled.steps}["blk.0.ffn_up.weight"] == "compute"
    assert rank_libraries(scaled, 0) == "torch"


def test_values_beyond_f16_are_counted_on_the_row_path_and_in_whole_tensor_verification() -> None:
    """bfloat16 values beyond float16's range become inf in an F16 GGUF tensor: counted (so on_overflow applies)
    by the engine's row conversion and by `to_gguf` on whole tensors (verification), the same way."""
    import torch

    from workbench.mapper.presets.gguf_rows import to_gguf
    from workbench.overflow import collect

    values = np.array([[1.0, -7e4, 3e5, 2.0] * 8] * 2, dtype=np.float32)
    _, count, largest = convert_rows(values.astype(ml_dtypes.bfloat16), "F16", counted=True)
    assert (count, largest) == (32, float(ml_dtypes.bfloat16(3e5)))  # two per group of four, 16 groups
    with collect() as found:
        whole = to_gguf(torch.tensor(values, dtype=torch.bfloat16), kind="F16")
    assert whole.dtype == torch.float16 and torch.isinf(whole).sum() == 32
    assert sum(entry[0] for entry in found.counts.values()) == 32


def test_a_128k_token_vocabulary_is_read_without_torch_within_the_predicted_rss(tmp_path: Path) -> None:
    """A tiny Llama with Llama 3's real vocabulary (128,256 tokens, 280k merges, a 17 MB tokenizer.json rebuilt from
    llama.cpp's own ggml-vocab-llama-bpe.gguf): the whole process's peak RSS (planning's tokenizer read included)
    is within 15 % of plan.rss_bytes, which counts the read ("vocabulary"), and neither torch nor transformers is
    imported. Reading it with json.load (the vocabulary as lists) peaked near 245 MiB, twice the prediction."""
    sys.path.insert(0, str(REPO / "tests"))
    from gguf_support.reference import model_folder

    src = model_folder("llama", "llama3")
    plan = wb.plan(src, to="gguf", dtype="q8_0", dest=tmp_path / "planned")
    parts = {p.part: p.bytes for p in rss_parts(plan, 0)}
    assert parts["vocabulary"] > 30 * MIB
    imported, measured = run_cli_measured(["convert", str(src), str(tmp_path / "out"), "--to", "gguf", "--dtype", "q8_0", "--quiet"],
                                          whole_process=True)
    assert not imported & {"torch", "transformers"}
    low = plan.rss_bytes - LIBRARY_SPREAD.get("numpy", 0)  # numpy's shared objects faulted in, not written whole
    assert low - 0.15 * measured <= measured <= plan.rss_bytes + 0.15 * measured, json.dumps(
        {"predicted": plan.rss_bytes, "measured": measured, "parts": parts})
