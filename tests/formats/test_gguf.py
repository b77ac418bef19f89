"""GGUF files as inputs (`formats/gguf.py`): the workbench's own GGUF outputs and hand-written files (K-quants, a
405B-shaped header) listed as gguf-py reads them, split sets, metadata and tokenizer tables, values, stats, the CLI
and the Explorer. Hostile headers are in the corpus (tests/hostile/corpus.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from hostile import gguf_files as G

import workbench as wb
from workbench.cli.commands import main as cli_main
from workbench.errors import CheckpointError

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The workbench's GGUF outputs of a tiny Llama: one Q8_0 file, and F16 in 60 KB splits."""
    from gguf_support.reference import model_folder

    root = tmp_path_factory.mktemp("gguf-in")
    src = model_folder("llama")
    wb.convert(src, root / "q8", to="gguf", dtype="q8_0", quiet=True)
    wb.convert(src, root / "split", to="gguf", dtype="f16", shard_size="60KB", quiet=True)
    return {"src": src, "q8": root / "q8", "split": root / "split"}


def _k_quant_file(path: Path) -> tuple[Path, dict[str, bytes]]:
    """Q4_K and Q6_K tensors of random blocks with finite f16 scales, a BF16 and an I32 tensor, written by hand."""
    rng = np.random.default_rng(0)
    data = {}
    for name, shape, kind in (("k4", (3, 512), "Q4_K"), ("k6", (2, 256), "Q6_K")):
        blocks = rng.integers(0, 256, size=(G.nbytes(shape, kind),), dtype=np.uint8)
        scale_at = {"Q4_K": (0, 2), "Q6_K": (208,)}[kind]  # d (and dmin) of each block: small finite halves
        per = G.GGML[kind][2]
        for start in range(0, blocks.size, per):
            for at in scale_at:
                blocks[start + at:start + at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        data[name] = blocks.tobytes()
    data["b"] = (np.arange(8, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()  # exact in bfloat16
    data["ids"] = np.arange(6, dtype="<i4").tobytes()
    tensors = [("k4", (3, 512), "Q4_K"), ("k6", (2, 256), "Q6_K"), ("b", (2, 4), "BF16"), ("ids", (6,), "I32")]
    return G.write(path, [G.kv("general.architecture", "STRING", "llama")], tensors, data=data), data


def test_own_gguf_output_is_listed_as_gguf_py_reads_it(written: dict[str, Path]) -> None:
    ck = wb.open_checkpoint(written["q8"] / "model.gguf")
    reader = gguf.GGUFReader(written["q8"] / "model.gguf")
    assert ck.format == "gguf" and len(ck) == len(reader.tensors)
    table = ck.tensors
    for t in reader.tensors:
        logical = tuple(int(d) for d in reversed(t.shape))
        assert table.loc[t.name, "gguf_type"] == t.tensor_type.name
        assert table.loc[t.name, "logical_shape"] == logical
        assert table.loc[t.name, "nbytes"] == t.n_bytes
        assert ck.catalog.read_bytes(t.name) == np.asarray(t.data).tobytes(), t.name
        if t.tensor_type.name == "Q8_0":
            assert table.loc[t.name, "dtype"] == "U8" and table.loc[t.name, "stored_as"] == "raw blocks"
            assert table.loc[t.name, "shape"] == (*logical[:-1], logical[-1] // 32 * 34)
            assert table.loc[t.name, "block"] == (32, 34)
        else:
            assert table.loc[t.name, "shape"] == logical
            assert np.array_equal(ck.load(t.name).numpy(), np.asarray(t.data))
    assert ck.tensors["gguf_type"].value_counts().to_dict() == {"Q8_0": 16, "F32": 5}
    assert ck.summary().parameters == ck.parameter_count == 99_008  # values, not Q8_0 block bytes


def test_metadata_and_tokenizer_tables(written: dict[str, Path]) -> None:
    ck = wb.open_checkpoint(written["q8"])  # the output folder opens too
    reader = gguf.GGUFReader(written["q8"] / "model.gguf")
    meta = ck.metadata
    assert list(meta.index) == [k for k in reader.fields if not k.startswith("GGUF.")]
    assert meta.loc["general.architecture", "value"] == "llama"
    assert meta.loc["llama.block_count", ["type", "value"]].tolist() == ["UINT32", "2"]
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert meta.loc["tokenizer.ggml.tokens", "count"] == len(tokens)
    assert meta.loc["tokenizer.ggml.tokens", "value"].startswith(f"[{len(tokens)} × STRING] ['<unk>', '<s>'")
    vocab = ck.tokenizer
    assert vocab["token"].tolist() == tokens
    assert vocab["score"].tolist() == pytest.approx(reader.fields["tokenizer.ggml.scores"].contents())
    assert vocab.loc[0, "type"] == "control" and vocab.loc[3, "type"] == "byte"


def test_split_set_opens_from_its_folder_or_any_file(written: dict[str, Path]) -> None:
    files = sorted(written["split"].glob("model-*.gguf"))
    whole = wb.open_checkpoint(written["split"])
    assert len(files) > 2 and len(whole.files) == len(files)
    assert wb.open_checkpoint(files[1]).tensors.equals(whole.tensors)
    assert set(whole.tensors["file"]) == {f.name for f in files}
    assert "tokenizer.ggml.tokens" in whole.metadata.index  # from the first split
    files[-1].rename(files[-1].with_suffix(".gone"))
    try:
        with pytest.raises(CheckpointError, match=f"{files[-1].name}.*Download every split"):
            wb.open_checkpoint(files[0])
    finally:
        files[-1].with_suffix(".gone").rename(files[-1])


def test_k_quants_load_as_bytes_and_give_dequantised_stats(tmp_path: Path) -> None:
    path, data = _k_quant_file(tmp_path / "k.gguf")
    ck = wb.open_checkpoint(path)
    assert ck.tensors["gguf_type"].to_dict() == {"k4": "Q4_K", "k6": "Q6_K", "b": "BF16", "ids": "I32"}
    assert ck.tensors.loc["k4", "shape"] == (3, 2 * 144) and ck.tensors.loc["k4", "logical_shape"] == (3, 512)
    assert ck.load("k4").numpy().tobytes() == data["k4"]
    assert ck.load("b").float().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ck.load("ids").tolist() == list(range(6))
    values = gguf.quants.dequantize(np.frombuffer(data["k4"], np.uint8).reshape(3, 288), gguf.GGMLQuantizationType.Q4_K)
    stats = ck.stats(["k4", "b"], chunk_elements=512)
    assert stats.loc["k4", "min"] == pytest.approx(float(values.min())) and stats.loc["k4", "max"] == pytest.approx(float(values.max()))
    assert stats.loc["k4", "mean"] == pytest.approx(float(values.mean()), rel=1e-5)
    assert stats.loc["b", "max"] == 7
    figure = ck.plot_bytes("dtype")
    assert figure.axes and len(figure.axes[0].patches) == 3  # U8, BF16, I32


def test_a_405b_shaped_header_opens_quickly(tmp_path: Path) -> None:
    """1,137 tensors (~258 GB of data, a hole) and a 128,256-token vocabulary with 280,147 merges."""
    path = G.llama_405b(tmp_path / "405b.gguf")
    wb.open_checkpoint(path)  # gguf's constants imported once
    started = time.perf_counter()
    ck = wb.open_checkpoint(path)
    took = time.perf_counter() - started
    assert len(ck) == 1137 and ck.tensors["nbytes"].sum() > 250e9
    assert ck.tensors.loc["blk.125.ffn_down.weight", ["gguf_type", "logical_shape"]].tolist() == ["Q6_K", (16384, 53248)]
    assert ck.metadata.loc["tokenizer.ggml.merges", "count"] == 280_147
    assert took < 1.5, took  # ~0.16 s measured on 2 shared cores


def test_cli_inspect_verify_and_diff_on_gguf_outputs(written: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["inspect", str(written["q8"] / "model.gguf")]) == 0
    out = capsys.readouterr().out
    assert "gguf_type" in out and "logical_shape" in out
    assert "99,008 parameters" in out  # the values Q8_0 blocks hold, not their bytes (105,176)
    assert any(line.split()[:1] == ["blk.0.attn_q.weight"] and "Q8_0" in line and "[64, 64]" in line for line in out.splitlines())
    assert any(line.startswith("llama.block_count") and "UINT32" in line for line in out.splitlines())
    assert cli_main(["inspect", str(written["split"]), "--format", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["summary"]["format"] == "gguf" and listed["summary"]["files"] > 2
    assert {r["gguf_type"] for r in listed["tensors"]} == {"F16", "F32"}
    for folder in ("q8", "split"):
        assert cli_main(["verify", str(written[folder])]) == 0
        assert "OK - gguf" in capsys.readouterr().out
    assert cli_main(["diff", str(written["q8"]), str(written["split"])]) == 1  # they differ
    assert "16 shape changed" in capsys.readouterr().out  # Q8_0 bytes against F16 values; norms equal


def test_explorer_shows_gguf_types(written: dict[str, Path]) -> None:
    from workbench.widgets import Explorer

    explorer = Explorer(wb.open_checkpoint(written["q8"]))
    explorer.refresh()
    assert {"gguf_type", "logical_shape"} <= set(explorer.rows.columns)
    assert explorer.rows.loc["blk.{i}.attn_q.weight", ["count", "gguf_type"]].tolist() == [2, "Q8_0"]  # layers folded
    explorer.fold_toggle.value = False
    explorer.refresh()
    assert explorer.rows.loc["blk.0.attn_q.weight", ["gguf_type", "logical_shape"]].tolist() == ["Q8_0", (64, 64)]
