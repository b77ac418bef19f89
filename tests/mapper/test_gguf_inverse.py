"""GGUF -> HF safetensors (`M.presets.gguf_to_hf`, mapper/presets/gguf_inverse.py): names, q/k permutation undone,
experts unstacked, every type de-quantised by row chunks as gguf-py computes it, round trips, config.json, suggest,
diff and the plan's memory. The transformers comparison is tests/system/test_gguf_to_hf_transformers.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import workbench as wb
from workbench import mapper as M
from workbench.errors import MapperError
from workbench.mapper.presets.gguf_inverse import gguf_to_hf_plan

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def kquant(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama GGUF with every de-quantisable type (K-quants of random valid blocks), tokenizer from llama.cpp's file."""
    from gguf_support.kquants import build
    from gguf_support.reference import reference_gguf

    return build(reference_gguf("llama", "f16"), tmp_path_factory.mktemp("kq") / "kquant.gguf")


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _expected(path: Path, planned: dict) -> dict[str, np.ndarray]:
    from gguf_support.kquants import reference_values

    ref = reference_values(path)
    return {name: np.ascontiguousarray(ref[t.source][t.expert] if t.expert >= 0 else ref[t.source]).reshape(t.shape)
            for name, t in planned.items()}


def test_every_type_dequantised_by_row_chunks_equals_gguf_py(kquant: Path, tmp_path: Path) -> None:
    mapper, planned = gguf_to_hf_plan(kquant, "F32")
    plan = wb.plan(kquant, mapper, extras=False, chunk_size="64KB")
    kinds = dict(zip(plan.groups["label"], plan.groups["kind"], strict=False))
    assert plan.ok and kinds["dequantize_gguf"] == "rows" and "(no torch)" in str(plan)
    assert {t.gguf_type for t in planned.values() if t.how == "dequantized"} >= {"Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K", "Q2_K", "Q3_K"}
    wb.convert(kquant, tmp_path / "hf", mapper, extras=False, chunk_size="64KB", quiet=True)
    out = load_file(tmp_path / "hf" / "model.safetensors")
    expected = _expected(kquant, planned)
    assert sorted(out) == sorted(expected)
    for name, values in expected.items():
        assert _same_bits(out[name], values), name
    # a q/k tensor really was permuted: the raw GGUF order differs from the HF order
    q = next(t for t in gguf.GGUFReader(kquant).tensors if t.name == "blk.0.attn_q.weight")
    raw = gguf.quants.dequantize(q.data, q.tensor_type)
    assert not np.array_equal(out["model.layers.0.self_attn.q_proj.weight"], raw.reshape(256, 256))


def test_default_keeps_float_types_and_casts_to_a_dtype(kquant: Path, tmp_path: Path) -> None:
    _, kept = gguf_to_hf_plan(kquant)
    assert kept["model.layers.0.mlp.up_proj.weight"].dtype == "BF16" and kept["model.layers.1.self_attn.q_proj.weight"].dtype == "F16"
    assert kept["model.embed_tokens.weight"].dtype == "F32" and kept["model.embed_tokens.weight"].how == "dequantized"
    mapper, planned = gguf_to_hf_plan(kquant, "bf16")
    wb.convert(kquant, tmp_path / "bf16", mapper, extras=False, quiet=True)
    out = load_file(tmp_path / "bf16" / "model.safetensors")
    import ml_dtypes

    for name, values in _expected(kquant, planned).items():
        assert _same_bits(out[name].view(np.uint16), values.astype(ml_dtypes.bfloat16).view(np.uint16)), name
    with pytest.raises(MapperError, match="Cannot write HF tensors as 'Q8_0'"):
        M.presets.gguf_to_hf(kquant, dtype="q8_0")


def test_plan_memory_is_one_chunk_whatever_the_tensor(kquant: Path) -> None:
    mapper = M.presets.gguf_to_hf(kquant, dtype="F32")
    small = wb.plan(kquant, mapper, extras=False, chunk_size="64KB")
    rows = small.groups[small.groups["kind"] == "rows"]
    permuted = rows.index.isin([k for k, step in enumerate(small.steps) if "attn_q" in step.group.inputs[0].name
                                or "attn_k" in step.group.inputs[0].name])
    assert rows[~permuted]["held_bytes"].max() <= 64 * 1024  # whatever the tensor's size: 1 MiB of Q4_K embeddings
    assert (rows["held_bytes"] < rows["bytes_out"] / 4).sum() >= 4
    assert rows[permuted]["held_bytes"].max() < 70 * 64 * 256  # q/k: one head's rows (64 x 256 values) of Q4_K, ~65 bytes a value


@pytest.mark.parametrize(("family", "outtype", "dtype"), [("llama", "bf16", "BF16"), ("mixtral", "bf16", "BF16"),
                                                         ("qwen2_moe", "f16", None)])
def test_round_trip_hf_gguf_hf_is_exact(family: str, outtype: str, dtype: str | None, tmp_path: Path) -> None:
    """HF -> the workbench's GGUF (llama.cpp's bytes) -> HF: the same names and values (F16: from an F16 copy)."""
    from gguf_support.reference import model_folder

    src = model_folder(family)
    if outtype == "f16":
        wb.convert(src, tmp_path / "src16", dtype="f16", quiet=True)
        src = tmp_path / "src16"
    wb.convert(src, tmp_path / "gguf", to="gguf", dtype=outtype, quiet=True)
    gguf_file = tmp_path / "gguf" / "model.gguf"
    wb.convert(gguf_file, tmp_path / "back", M.presets.gguf_to_hf(gguf_file, dtype=dtype), extras=False, quiet=True)
    original = load_file(src / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, values in original.items():  # norms come back F32 (llama.cpp keeps them F32): equal values
        got = back[name] if back[name].dtype == values.dtype else back[name].astype(values.dtype)
        assert _same_bits(got, values), name


def test_experts_unstacked_equal_gguf_py(tmp_path: Path) -> None:
    from gguf_support.reference import reference_gguf

    for family in ("mixtral", "qwen3_moe"):
        path = reference_gguf(family, "q8_0")
        mapper, planned = gguf_to_hf_plan(path, "F32")
        report = wb.convert(path, tmp_path / family, mapper, extras=False, quiet=True, verify=True)
        assert report.verified  # each expert converted again by rows from its byte range and compared
        out = load_file(tmp_path / family / "model.safetensors")
        expected = _expected(path, planned)
        assert any(t.expert == 3 for t in planned.values())
        for name, values in expected.items():
            assert _same_bits(out[name], values), name


def test_config_and_generation_config_from_metadata(tmp_path: Path) -> None:
    """The generated config.json has the source config's values (epsilon as written, not its float32 digits)."""
    from gguf_support.reference import model_folder, reference_gguf

    pytest.importorskip("transformers")  # held here: the tokenizer files are built in this process, no child importing
    pytest.importorskip("torch")  # both again (the child's route: tests/output/test_gguf_hf_tokenizer.py)
    path = reference_gguf("qwen2_moe", "q8_0")
    plan = wb.plan(path, M.presets.gguf_to_hf(path), dest=tmp_path / "out")
    generated = {e.path: e for e in plan.extra_files}
    config = json.loads(generated["config.json"].config)
    source = json.loads((model_folder("qwen2_moe") / "config.json").read_text())
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "tie_word_embeddings", "max_position_embeddings", "architectures"):
        assert config[key] == source[key], key
    assert config["rope_parameters"]["rope_theta"] == source["rope_parameters"]["rope_theta"]
    assert json.loads(generated["generation_config.json"].config)["eos_token_id"] == 151643
    from tokenizers import Tokenizer

    ours = Tokenizer.from_str(generated["tokenizer.json"].config)  # transformers' tokenizer of the GGUF vocabulary
    theirs = Tokenizer.from_file(str(model_folder("qwen2_moe") / "tokenizer.json"))
    text = "Hello world, 1234 tokens!\n  indented"
    assert ours.encode(text).ids == theirs.encode(text).ids


def test_suggest_and_diff_through_the_name_mapping(capsys: pytest.CaptureFixture[str]) -> None:
    from gguf_support.reference import model_folder, reference_gguf

    path = reference_gguf("mistral", "q8_0")
    ck = wb.open_checkpoint(path)
    assert "gguf_to_hf" in list(ck.suggest()["preset"])
    frame = ck.diff(model_folder("mistral"), values=True)
    row = frame.loc["model.layers.0.self_attn.q_proj.weight"]
    assert (row["status"], row["dtype"], row["other_dtype"], row["gguf_name"], row["gguf_type"]) == \
        ("dtype changed", "F32", "BF16", "blk.0.attn_q.weight", "Q8_0")
    assert 0 < row["max_abs_diff"] < 0.05  # Q8_0's error, with the permutation undone (else ~1)
    assert set(frame["status"]) == {"dtype changed"}
    assert frame.loc["model.norm.weight", "max_abs_diff"] == 0
    from workbench.cli.commands import main as cli_main

    assert cli_main(["diff", str(path), str(model_folder("mistral")), "--format", "json"]) == 1  # 1: they differ
    shown = json.loads(capsys.readouterr().out)
    assert any(r["name"] == "model.layers.0.self_attn.q_proj.weight" and r["gguf_type"] == "Q8_0" for r in shown["differences"])


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    from hostile import gguf_files as G

    path = G.write(tmp_path / "x.gguf", [G.kv("general.architecture", "STRING", "rwkv6")], [("token_embd.weight", (4, 32), "F32")],
                   data={"token_embd.weight": bytes(512)})
    with pytest.raises(MapperError, match="Cannot map GGUF architecture 'rwkv6'"):
        M.presets.gguf_to_hf(path)


@pytest.mark.serial  # measures peak RSS: run alone (see conftest.SERIAL_MARKERS)
def test_dequantising_128_mib_tensors_stays_within_the_predicted_rss(tmp_path: Path) -> None:
    """`workbench convert X.gguf OUT --preset gguf_to_hf` on Q4_K / Q6_K embeddings that are 128 MiB each in float32:
    ROWS steps, a tensor peak of one chunk, no torch, and a peak RSS (VmHWM, planning included) within 15 % of
    plan.rss_bytes (holding one de-quantised embedding would add 128 MiB)."""
    from conftest import run_cli_measured
    from gguf_support.kquants import build_wide

    from workbench.mapper.presets.gguf_dequant import ROW_BUDGET

    path = build_wide(tmp_path / "wide.gguf")
    plan = wb.plan(path, M.presets.gguf_to_hf(path), extras=False, dest=tmp_path / "planned")
    kinds = {s.group.outputs[0].name: s.kind for s in plan.steps}
    assert kinds["model.embed_tokens.weight"] == kinds["lm_head.weight"] == "rows" and kinds["model.norm.weight"] == "copy"
    assert plan.peak_bytes <= ROW_BUDGET and not plan.needs_torch
    imported, measured = run_cli_measured(["convert", str(path), str(tmp_path / "out"), "--preset", "gguf_to_hf", "--no-extras",
                                           "--quiet"], whole_process=True)
    assert not imported & {"torch", "transformers"}
    from workbench.planning.rss_calibration import LIBRARY_SPREAD

    tolerance = max(0.15 * measured, 8 << 20)  # the RSS rule; numpy's shared objects may be faulted in, not written whole
    assert plan.rss_bytes - LIBRARY_SPREAD.get("numpy", 0) - tolerance <= measured <= plan.rss_bytes + tolerance, (plan.rss_bytes, measured)
    out = wb.open_checkpoint(tmp_path / "out")
    assert out.tensors.loc["model.embed_tokens.weight", "nbytes"] == 128 << 20
