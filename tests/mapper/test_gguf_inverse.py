"""GGUF -> HF safetensors (`M.presets.gguf_to_hf`, mapper/presets/gguf_inverse.py): names, q/k permutation undone,
experts unstacked, every type de-quantised by row chunks as gguf-py computes it, round trips, config.json, suggest,
diff and the plan's memory. The transformers comparison is tests/system/test_gguf_to_hf_transformers.py."""

from __future__ import annotations

import importlib.util
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
                                                         ("qwen2_moe", "f16", None), ("deepseek_v3", "f16", None)])
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


def test_gpt2_round_trip_through_llama_cpp_is_exact(tmp_path: Path) -> None:
    """HF GPT-2 (F16) -> llama.cpp's converter (F16: Conv1D weights transposed, (out, in)) -> HF: the same names, shapes
    ((in, out) again) and bytes; the tied lm_head stays tied (the converter writes no output.weight)."""
    from gguf_support.gpt2 import model_folder, reference_gguf

    path = reference_gguf("f16")
    mapper, planned = gguf_to_hf_plan(path)
    assert planned["transformer.h.0.attn.c_attn.weight"].how == "copied, transposed"
    wb.convert(path, tmp_path / "back", mapper, extras=False, quiet=True, verify=True)
    original = load_file(model_folder() / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    assert original["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # HF's Conv1D: (in, out)
    for name, values in original.items():  # norms and biases come back F32 (llama.cpp keeps them F32): equal values
        got = back[name] if back[name].dtype == values.dtype else back[name].astype(values.dtype)
        assert _same_bits(got, values), name
    if importlib.util.find_spec("transformers") is not None:  # config.json: transformers' own, corrected
        config = json.loads({e.path: e for e in wb.plan(path, mapper, dest=tmp_path / "x").extra_files}["config.json"].config)
        source = json.loads((model_folder() / "config.json").read_text())
        for key in ("model_type", "n_embd", "n_layer", "n_head", "n_positions", "n_ctx", "vocab_size", "layer_norm_epsilon",
                    "tie_word_embeddings", "activation_function"):
            assert config[key] == source[key], key
        assert "_model_name_or_path" not in config


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


def test_deepseek_v3_kv_b_rebuilt_from_k_b_and_v_b_equals_gguf_py(tmp_path: Path) -> None:
    """llama.cpp's DeepSeek converter splits MLA's kv_b_proj per head into attn_k_b (transposed) and attn_v_b: from its
    Q8_0 file, kv_b_proj comes back as gguf-py's de-quantised parts joined again, every other tensor as gguf-py
    de-quantises it, and config.json has the source config's MLA and MoE values."""
    from gguf_support.kquants import reference_values
    from gguf_support.reference import model_folder, reference_gguf

    path = reference_gguf("deepseek_v3", "q8_0")
    mapper, planned = gguf_to_hf_plan(path, "F32")
    plan = wb.plan(path, mapper, dest=tmp_path / "hf")
    wb.convert(path, tmp_path / "hf", mapper, quiet=True, verify=True)
    out = load_file(tmp_path / "hf" / "model.safetensors")
    source = load_file(model_folder("deepseek_v3") / "model.safetensors")
    assert sorted(out) == sorted(source)  # every HF name, shared experts and the router's bias included
    ref = reference_values(path)
    for name, t in planned.items():
        if name.endswith("kv_b_proj.weight"):
            layer = name.split(".")[2]
            k_b, v_b = ref[f"blk.{layer}.attn_k_b.weight"], ref[f"blk.{layer}.attn_v_b.weight"]  # (4, 64, 32), (4, 32, 64)
            want = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
            assert t.gguf_type == "Q8_0" and "attn_k_b" in t.how
        else:
            want = ref[t.source][t.expert] if t.expert >= 0 else ref[t.source]
        assert out[name].shape == source[name].shape and _same_bits(out[name], np.ascontiguousarray(want).reshape(t.shape)), name
        assert np.abs(out[name] - source[name].astype(np.float32)).max() < 0.1, name  # Q8_0's error: rows in their places
    config = json.loads({e.path: e for e in plan.extra_files}["config.json"].config)
    want_config = json.loads((model_folder("deepseek_v3") / "config.json").read_text())
    for key in ("model_type", "architectures", "hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank",
                "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "qk_head_dim", "head_dim",
                "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace",
                "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "scoring_func", "rope_parameters",
                "intermediate_size", "rms_norm_eps", "tie_word_embeddings", "vocab_size"):
        assert config[key] == want_config[key], key
    if importlib.util.find_spec("transformers") is not None:  # tokenizer files from the vocabulary, though transformers
        from tokenizers import Tokenizer  # loads no deepseek2 model

        ours = Tokenizer.from_str({e.path: e for e in plan.extra_files}["tokenizer.json"].config)
        theirs = Tokenizer.from_file(str(model_folder("deepseek_v3") / "tokenizer.json"))
        text = "Hello world, 1234 tokens!\n  indented"
        assert ours.encode(text).ids == theirs.encode(text).ids


def test_deepseek_v2_softmax_gating_is_refused(tmp_path: Path) -> None:
    from hostile import gguf_files as G

    path = G.write(tmp_path / "v2.gguf", [G.kv("general.architecture", "STRING", "deepseek2"),
                                          G.kv("deepseek2.expert_gating_func", "UINT32", 1)],
                   [("token_embd.weight", (4, 32), "F32")], data={"token_embd.weight": bytes(512)})
    with pytest.raises(MapperError, match="DeepSeek-V2"):
        M.presets.gguf_to_hf(path)


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
@pytest.mark.parametrize("wide", [("Q4_K", "Q6_K"), ("IQ2_XXS", "IQ4_XS")])
def test_dequantising_128_mib_tensors_stays_within_the_predicted_rss(wide: tuple[str, str], tmp_path: Path) -> None:
    """`workbench convert X.gguf OUT --preset gguf_to_hf` on Q4_K / Q6_K (IQ2_XXS / IQ4_XS: grid look-ups) embeddings
    that are 128 MiB each in float32: ROWS steps, a tensor peak of one chunk, no torch, and a peak RSS (VmHWM, planning
    included) within 15 % of plan.rss_bytes (holding one de-quantised embedding would add 128 MiB)."""
    from conftest import run_cli_measured
    from gguf_support.kquants import build_wide

    from workbench.mapper.presets.gguf_dequant import ROW_BUDGET

    path = build_wide(tmp_path / "wide.gguf", wide=wide)
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
