"""GGUF output (`to="gguf"`) against llama.cpp's own converter run on the same folder: same tensors, types,
shapes, bytes and metadata, for every type the dtype policy offers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from gguf_support.header import read_header
from gguf_support.reference import CASES, model_folder, reference_gguf

import workbench as wb
from tests.conftest import output_names
from workbench.cli.commands import main as cli_main
from workbench.errors import PlanError

gguf = pytest.importorskip("gguf")


def _fields(reader) -> dict:
    return {k: (tuple(f.types), f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _tensors(reader) -> dict:
    return {t.name: (t.tensor_type.name, [int(d) for d in t.shape], bytes(np.asarray(t.data).view(np.uint8).reshape(-1)))
            for t in reader.tensors}


def _explain_difference(ours: Path, reference: Path) -> None:
    """Fail naming the first metadata key or tensor that differs (gguf-py's reader is slow on big vocabularies:
    used only once the bytes are known to differ)."""
    mine_reader, ref_reader = gguf.GGUFReader(ours), gguf.GGUFReader(reference)
    assert list(_fields(mine_reader)) == list(_fields(ref_reader))
    assert _fields(mine_reader) == _fields(ref_reader)
    mine, theirs = _tensors(mine_reader), _tensors(ref_reader)
    assert list(mine) == list(theirs)
    for name in theirs:
        assert mine[name][:2] == theirs[name][:2], name
        assert mine[name][2] == theirs[name][2], name
    raise AssertionError(f"{ours} and {reference} hold the same metadata and tensors but differ in bytes (padding?)")


@pytest.mark.parametrize(("family", "outtype", "tokenizer"), CASES)
def test_gguf_equals_llama_cpp_converter(family: str, outtype: str, tokenizer: str | None, tmp_path: Path) -> None:
    """Byte-identical files (so the same metadata, tensor names, types, shapes and data); a difference is explained
    key by key and tensor by tensor."""
    src = model_folder(family, tokenizer)
    wb.convert(src, tmp_path / "out", to="gguf", dtype=outtype, quiet=True)
    ours, reference = tmp_path / "out" / "model.gguf", reference_gguf(family, outtype, tokenizer)
    if ours.read_bytes() != reference.read_bytes():
        _explain_difference(ours, reference)
    header = read_header(ours)
    assert {kind for _, kind, _ in header.tensors} == ({"F32", outtype.upper()} if outtype != "f32" else {"F32"})


def test_each_tokenizer_route_writes_the_converters_vocabulary_keys(tmp_path: Path) -> None:
    """The three routes llama.cpp's converter takes, seen in the files both write (equal above)."""
    spm = read_header(reference_gguf("llama", "f16", "spm")).metadata
    assert spm["tokenizer.ggml.model"] == "llama" and spm["tokenizer.ggml.pre"] == "default"
    kinds = spm["tokenizer.ggml.token_type"]
    tokens = spm["tokenizer.ggml.tokens"]
    assert set(kinds) == {1, 3, 4, 5, 6}  # normal, control, user-defined, padding, byte pieces
    assert kinds[0] == 3  # <unk>: tokenizer_config marks it special, which makes it a control token
    assert tokens[-1] == f"[PAD{len(tokens) - 1}]" and kinds[-1] == 5 and tokens[-4] == "<extra_0>" and " plain" in tokens and kinds[tokens.index("<|tool_call|>")] == 3
    assert "tokenizer.ggml.merges" not in spm and len(spm["tokenizer.ggml.scores"]) == len(tokens)
    gpt2 = read_header(reference_gguf("llama", "q8_0", "gpt2")).metadata
    assert (gpt2["tokenizer.ggml.model"], gpt2["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    assert len(gpt2["tokenizer.ggml.merges"]) == 50000 and "tokenizer.ggml.scores" not in gpt2
    qwen = read_header(reference_gguf("qwen2", "q8_0")).metadata
    assert (qwen["tokenizer.ggml.model"], qwen["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    llama3 = read_header(reference_gguf("llama", "f16", "llama3")).metadata
    assert (llama3["tokenizer.ggml.pre"], llama3["tokenizer.ggml.add_bos_token"]) == ("llama-bpe", True)
    # A byte-level BPE whose pre-tokenizer the workbench cannot name for llama.cpp is refused, not guessed.
    odd = tmp_path / "odd"
    odd.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (odd / name).write_bytes((model_folder("llama", "gpt2") / name).read_bytes())
    tokenizer = json.loads((model_folder("llama", "gpt2") / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{L}+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (odd / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(PlanError, match="pre-tokenizer is not one the workbench names.*convert_hf_to_gguf.py"):
        wb.plan(odd, to="gguf")


def test_the_plan_lists_gguf_types_sizes_and_metadata_before_anything_is_written(tmp_path: Path) -> None:
    plan = wb.plan(model_folder("llama"), to="gguf", dtype="q8_0", dest=tmp_path / "out")
    assert plan.ok and [f.name for f in plan.output_file_list] == ["model.gguf"]
    layout = plan.output_file_list[0].layout
    types = {name: kind for name, kind, _ in layout.types}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    assert dict(layout.kv)["general.architecture"] == "llama" and dict(layout.kv)["general.file_type"] == 7
    text = plan.summary()
    assert re.search(r"blk\.0\.attn_q\.weight +Q8_0 +64x64", text) and "general.file_type" in text
    tables = dict((title, rows) for title, _, rows in plan.output_details)
    assert ("tokenizer.ggml.model", "llama") in tables["GGUF metadata (first file)"]
    assert "GGUF tensors" in plan._repr_html_()
    assert not (tmp_path / "out").exists()


def test_split_files_carry_llama_cpp_split_keys_and_hold_every_tensor(tmp_path: Path) -> None:
    wb.convert(model_folder("llama"), tmp_path / "out", to="gguf", dtype="f16", shard_size="60KB", quiet=True)
    names = output_names(tmp_path / "out")
    assert len(names) > 1 and names[0] == f"model-00001-of-{len(names):05d}.gguf"
    ref = _tensors(gguf.GGUFReader(reference_gguf("llama", "f16")))
    merged = {}
    for k, name in enumerate(names):
        reader = gguf.GGUFReader(tmp_path / "out" / name)
        fields = _fields(reader)
        assert fields["split.no"][1] == k and fields["split.count"][1] == len(names)
        assert fields["split.tensors.count"][1] == len(ref)
        merged.update(_tensors(reader))
    assert merged == ref


def test_cli_writes_gguf(tmp_path: Path) -> None:
    assert cli_main(["convert", str(model_folder("llama")), str(tmp_path / "o"), "--to", "gguf", "--dtype", "bf16"]) == 0
    assert (tmp_path / "o" / "model.gguf").read_bytes() == reference_gguf("llama", "bf16").read_bytes()


def test_a_folder_without_config_or_with_an_unknown_dtype_is_refused(tmp_path: Path, llama_sample: Path) -> None:
    with pytest.raises(PlanError, match="q4_k"):
        wb.plan(model_folder("llama"), to="gguf", dtype="q4_k")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((model_folder("llama") / "model.safetensors").read_bytes())
    with pytest.raises(PlanError, match="config.json"):
        wb.plan(bare, to="gguf")
    with pytest.raises(PlanError, match="model_type 'bert'.*deepseek_v3, llama, mistral, mixtral, olmoe, qwen2, qwen2_moe, qwen3, qwen3_moe"):
        wb.plan(Path(__file__).resolve().parents[2] / "sample_checkpoints" / "tiny-bert", to="gguf")
    phi = tmp_path / "longrope"  # LongRoPE (Phi-3): llama.cpp generates its factor tensors in a family not mapped here
    phi.mkdir()
    for file in model_folder("llama").iterdir():
        (phi / file.name).write_bytes(file.read_bytes())
    config = json.loads((phi / "config.json").read_text())
    config.pop("rope_parameters", None)  # Phi-3's hub config.json spells it rope_scaling
    config["rope_scaling"] = {"type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}
    (phi / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match="RoPE scaling type 'longrope' \\(LongRoPE, Phi-3's\\).*convert_hf_to_gguf.py"):
        wb.plan(phi, to="gguf")
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    config["model_type"] = "qwen2"  # llama.cpp's Qwen2 converter has no rope_freqs: refused rather than dropped
    (phi / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match="rope_type 'llama3'.*'qwen2' model"):
        wb.plan(phi, to="gguf")


def test_verify_rereads_gguf_through_its_own_header_and_catches_a_flipped_byte(tmp_path: Path) -> None:
    src = model_folder("llama")
    report = wb.convert(src, tmp_path / "out", to="gguf", dtype="q8_0", quiet=True, verify=True)
    assert report.verified and len(report.verification) == 21
    frame = report.verification
    q8 = frame[frame.check == "compute+dequantised"]
    assert len(q8) == 16 and (q8.max_abs_diff > 0).all()
    # Q8_0 error is at most half a quantisation step of the block's scale: |x| <= amax, step = amax / 127.
    src = wb.open_checkpoint(src)
    amax = float(src.load("model.layers.1.self_attn.q_proj.weight").float().abs().max())
    assert 0 < q8.loc["blk.1.attn_q.weight", "max_abs_diff"] <= amax / 127 / 2 * 1.01
    plan = wb.plan(src, to="gguf", dtype="q8_0", dest=tmp_path / "out2")
    wb.convert(src, tmp_path / "out2", to="gguf", dtype="q8_0", quiet=True)
    path = tmp_path / "out2" / "model.gguf"
    slot = next(t for t in plan.output_file_list[0].layout.tensors if t.name == "blk.1.attn_q.weight")
    data = bytearray(path.read_bytes())
    data[slot.begin + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    from workbench.engine.output_check import check_outputs

    assert check_outputs(plan).mismatches == ["blk.1.attn_q.weight"]


def test_split_gguf_written_by_two_worker_ranks_equals_one_process(tmp_path: Path) -> None:
    src = model_folder("llama")
    wb.convert(src, tmp_path / "one", to="gguf", dtype="q8_0", shard_size="60KB", quiet=True)
    wb.convert(src, tmp_path / "two", to="gguf", dtype="q8_0", shard_size="60KB", nproc=2, launcher="local", quiet=True)
    names = output_names(tmp_path / "one")
    assert len(names) > 1 and names == output_names(tmp_path / "two")
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_an_interrupted_split_gguf_resumes_keeping_the_finished_files(tmp_path: Path) -> None:
    src = model_folder("llama")
    out = tmp_path / "out"
    plan = wb.plan(src, to="gguf", dtype="f16", shard_size="60KB", dest=out)
    wb.convert(src, out, to="gguf", dtype="f16", shard_size="60KB", quiet=True)
    names = output_names(out)
    (out / names[-1]).unlink()  # as a run killed before its last file leaves it: the manifest says which plan
    from workbench.planning.destination import write_manifest

    write_manifest(out, plan.layout_fingerprint, plan.output_file_list)
    report = wb.convert(src, out, to="gguf", dtype="f16", shard_size="60KB", quiet=True)
    assert report.kept == names[:-1]
    merged = {}
    for name in names:
        merged.update(_tensors(gguf.GGUFReader(out / name)))
    assert merged == _tensors(gguf.GGUFReader(reference_gguf("llama", "f16")))


def test_q4_0_is_the_gguf_quantiser_applied_to_the_converters_f32_tensors(tmp_path: Path) -> None:
    """llama.cpp's converter writes no Q4_0 (its --outtype stops at q8_0): the reference is its F32 file, quantised
    by the gguf package's own Q4_0 quantiser; metadata equal but for general.file_type (2, MOSTLY_Q4_0)."""
    report = wb.convert(model_folder("llama"), tmp_path / "out", to="gguf", dtype="q4_0", quiet=True, verify=True)
    ours = gguf.GGUFReader(tmp_path / "out" / "model.gguf")
    f32 = gguf.GGUFReader(reference_gguf("llama", "f32"))
    mine, theirs = _fields(ours), _fields(f32)
    assert mine.pop("general.file_type")[1] == 2 and theirs.pop("general.file_type")[1] == 0
    assert mine == theirs
    source = {t.name: np.asarray(t.data) for t in f32.tensors}
    errors = {}
    for t in ours.tensors:
        if t.tensor_type.name == "F32":
            assert np.array_equal(np.asarray(t.data), source[t.name]), t.name
            continue
        assert t.tensor_type.name == "Q4_0", t.name
        expected = gguf.quants.quantize(source[t.name], gguf.GGMLQuantizationType.Q4_0)
        assert bytes(np.asarray(t.data)) == bytes(expected), t.name
        back = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType.Q4_0).reshape(source[t.name].shape)
        blocks = np.abs(source[t.name]).reshape(-1, 32).max(axis=1)
        # Q4_0 keeps 16 levels of step amax/8 per block: every value is within one step.
        assert (np.abs(back - source[t.name]).reshape(-1, 32).max(axis=1) <= blocks / 8 * 1.001).all(), t.name
        errors[t.name] = float(np.abs(back - source[t.name]).max())
    frame = report.verification
    q4 = frame[frame.check == "compute+dequantised"]
    assert report.verified and len(q4) == len(errors) == 16
    for name, error in errors.items():
        assert q4.loc[name, "max_abs_diff"] == pytest.approx(error, rel=1e-6), name


def test_mixtral_experts_are_stacked_per_layer_and_verify_dequantises_the_stacks(tmp_path: Path) -> None:
    report = wb.convert(model_folder("mixtral"), tmp_path / "out", to="gguf", dtype="q8_0", quiet=True, verify=True)
    reader = gguf.GGUFReader(tmp_path / "out" / "model.gguf")
    shapes = {t.name: (t.tensor_type.name, [int(d) for d in t.shape]) for t in reader.tensors}
    # GGUF lists dims innermost first: (columns, rows, experts).
    assert shapes["blk.0.ffn_gate_exps.weight"] == ("Q8_0", [64, 96, 4]) and shapes["blk.1.ffn_down_exps.weight"] == ("Q8_0", [96, 64, 4])
    assert shapes["blk.0.ffn_gate_inp.weight"] == ("F32", [64, 4])
    fields = _fields(reader)
    assert fields["llama.expert_count"][1] == 4 and fields["llama.expert_used_count"][1] == 2
    assert fields["general.size_label"][1] == "4x100K"
    frame = report.verification
    stacks = frame[frame.index.str.contains("_exps")]
    assert report.verified and len(stacks) == 6 and (stacks.check == "compute+dequantised").all() and (stacks.max_abs_diff > 0).all()


def test_deepseek_v3_mla_is_split_per_head_and_extra_layers_are_left_out(tmp_path: Path) -> None:
    """llama.cpp's absorbed MLA: kv_b_proj becomes attn_k_b (per head, the qk_nope rows, transposed) and attn_v_b (the
    v rows); --verify de-quantises both against those rows of the source. A layer past num_hidden_layers (DeepSeek's
    multi-token prediction) has no place in the file."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    for item in model_folder("deepseek_v3").iterdir():
        (src / item.name).write_bytes(item.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.2.input_layernorm.weight"] = tensors["model.layers.1.input_layernorm.weight"].clone()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    report = wb.convert(src, tmp_path / "out", to="gguf", dtype="q8_0", quiet=True, verify=True)
    header = read_header(tmp_path / "out" / "model.gguf")  # GPT-2's 50k-token vocabulary: too slow for GGUFReader
    shapes = {name: (kind, list(dims)) for name, kind, dims in header.tensors}
    assert not any(name.startswith("blk.2.") for name in shapes)
    # heads 4, kv_lora_rank 64, qk_nope_head_dim 32, v_head_dim 32; GGUF lists dims innermost first
    assert shapes["blk.1.attn_k_b.weight"] == ("Q8_0", [32, 64, 4]) and shapes["blk.1.attn_v_b.weight"] == ("Q8_0", [64, 32, 4])
    assert shapes["blk.1.exp_probs_b.bias"] == ("F32", [4]) and "blk.0.ffn_gate_exps.weight" not in shapes
    fields = header.metadata
    assert fields["deepseek2.attention.head_count_kv"] == 1 and fields["deepseek2.leading_dense_block_count"] == 1
    assert fields["deepseek2.attention.key_length"] == 64 + 16 and fields["deepseek2.attention.key_length_mla"] == 32 + 16
    frame = report.verification
    split = frame[frame.index.str.contains("attn_[kv]_b")]
    assert report.verified and len(split) == 4 and (split.check == "compute+dequantised").all()
    assert (split.max_abs_diff > 0).all() and (split.max_abs_diff < 0.05).all()


def _converter_rope_factors(grid: list[dict], **env: str) -> list[bytes]:
    """llama.cpp's own `LlamaModel.generate_extra_tensors` (imported from the sdist, run unmodified on a stand-in
    model object) for each rope block of `grid` (with a head_dim): the bytes of its rope_freqs tensor."""
    import os
    import subprocess
    import sys

    from gguf_support.reference import EXTRA, converter

    root = converter().parent
    code = """
import json, sys, types
from conversion.llama import LlamaModel
out = []
for case in json.loads(sys.argv[1]):
    head_dim = case.pop("head_dim")
    model = types.SimpleNamespace(rope_parameters=case, hparams={"head_dim": head_dim}, format_tensor_name=lambda kind: "rope_freqs.weight")
    (name, tensor), = LlamaModel.generate_extra_tensors(model)
    out.append(tensor.numpy().tobytes().hex())
print(json.dumps(out))
"""
    path = os.pathsep.join(map(str, (EXTRA, root, root / "gguf-py")))
    done = subprocess.run([sys.executable, "-c", code, json.dumps(grid)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return [bytes.fromhex(h) for h in json.loads(done.stdout.strip().splitlines()[-1])]


def _ours(case: dict) -> bytes:
    from workbench.output.gguf_rope import generated_tensors

    config = {"num_attention_heads": 1, "hidden_size": case["head_dim"], "rope_parameters": {k: v for k, v in case.items() if k != "head_dim"}}
    (made,) = generated_tensors(config, "llama")
    assert made.shape == (case["head_dim"] // 2,) and made.type == "F32"
    return made.data


ROPE_BLOCKS = [{"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": context}
               for theta in (500000.0, 10000.0) for factor, low, high, context in ((8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192),
                                                                                   (16.0, 2.0, 8.0, 1024), (8.0, 1.0, 4.0, 64))]


def test_rope_factors_equal_the_converters_for_llama_head_dims_and_thetas() -> None:
    """The numpy float32 factors against llama.cpp's torch code itself, for head dims 32, 64, 128 (Llama 3.2 1B, 3.1 8B)
    and thetas 500000 / 10000: equal bytes here, whatever torch's CPU kernels (SIMD or not)."""
    grid = [{**block, "head_dim": dim} for dim in (32, 64, 128) for block in ROPE_BLOCKS]
    expected = _converter_rope_factors([dict(case) for case in grid])
    assert [_ours(case) for case in grid] == expected
    assert len({e for e in expected}) > len(ROPE_BLOCKS)  # not all ones: the blocks give different factors


def test_rope_factors_are_the_correctly_rounded_ones_torch_computes_without_simd() -> None:
    """With torch's CPU kernels set to plain C++ (ATEN_CPU_CAPABILITY=default: `powf`, correctly rounded), every head
    dim and theta agrees; its SIMD `powf` (SLEEF, within 1 ulp) may differ by an ulp for some (see `llama3_rope_factors`)."""
    grid = [{**block, "rope_theta": theta, "head_dim": dim} for dim in (16, 48, 80, 96, 256) for theta in (1e6, 1e5, 10000.0)
            for block in ROPE_BLOCKS[:4]]
    assert [_ours(case) for case in grid] == _converter_rope_factors([dict(case) for case in grid], ATEN_CPU_CAPABILITY="default")


def test_llama31_split_output_starts_with_rope_freqs_resumes_and_two_ranks_write_the_same_bytes(tmp_path: Path) -> None:
    src = model_folder("llama31")
    out = tmp_path / "out"
    plan = wb.plan(src, to="gguf", dtype="f16", shard_size="40KB", dest=out)
    wb.convert(src, out, to="gguf", dtype="f16", shard_size="40KB", quiet=True)
    names = output_names(out)
    ref = _tensors(gguf.GGUFReader(reference_gguf("llama31", "f16")))
    assert len(names) > 2 and next(iter(ref)) == "rope_freqs.weight"
    merged = {}
    for k, name in enumerate(names):
        reader = gguf.GGUFReader(out / name)
        fields = _fields(reader)
        assert fields["split.tensors.count"][1] == len(ref)
        tensors = _tensors(reader)
        assert ("rope_freqs.weight" in tensors) == (k == 0)
        merged.update(tensors)
    assert list(merged)[0] == "rope_freqs.weight" and merged == ref
    first, layout = gguf.GGUFReader(out / names[0]).tensors[0], plan.output_file_list[0].layout
    assert first.name == "rope_freqs.weight" and int(first.data_offset) == layout.generated[0].begin
    assert layout.generated[0].end == len(layout.header) == layout.tensors[0].begin  # its bytes end the planned header
    # resume: the file holding rope_freqs is the one lost; kept files are recognised by their header (rope bytes included)
    saved = {name: (out / name).read_bytes() for name in names}
    (out / names[0]).unlink()
    from workbench.planning.destination import write_manifest

    write_manifest(out, plan.layout_fingerprint, plan.output_file_list)
    report = wb.convert(src, out, to="gguf", dtype="f16", shard_size="40KB", quiet=True, verify=True)
    assert report.kept == names[1:] and report.verified
    assert {name: (out / name).read_bytes() for name in names} == saved
    wb.convert(src, tmp_path / "two", to="gguf", dtype="f16", shard_size="40KB", nproc=2, launcher="local", quiet=True)
    assert {name: (tmp_path / "two" / name).read_bytes() for name in output_names(tmp_path / "two")} == saved


def test_llama31_plan_lists_rope_freqs_and_verify_recomputes_it(tmp_path: Path) -> None:
    src = model_folder("llama31")
    plan = wb.plan(src, to="gguf", dtype="q8_0", dest=tmp_path / "out")
    layout = plan.output_file_list[0].layout
    assert layout.types[0] == ("rope_freqs.weight", "F32", (8,))
    tables = dict((title, rows) for title, _, rows in plan.output_details)
    row = tables["GGUF tensors"][0]
    assert row[:5] == ("rope_freqs.weight", "F32", "8", "32 B", "model.gguf") and "generated from config.json" in row[5]
    assert "llama.rope.scaling.type" not in dict(layout.kv)  # llama.cpp writes no scaling keys for llama3
    assert re.search(r"rope_freqs\.weight +F32 +8 ", plan.summary())
    report = wb.convert(src, tmp_path / "out", to="gguf", dtype="q8_0", quiet=True, verify=True)
    assert report.verified and report.verification.loc["rope_freqs.weight", "check"] == "generated"
    path = tmp_path / "out" / "model.gguf"
    (slot,) = layout.generated
    data = bytearray(path.read_bytes())
    data[slot.begin + 1] ^= 0x40
    path.write_bytes(bytes(data))
    from workbench.engine.output_check import check_outputs

    assert check_outputs(plan).mismatches == ["rope_freqs.weight"]


def test_llama31_hub_spelling_of_the_rope_block_gives_the_same_tensors(tmp_path: Path) -> None:
    """Llama 3.1's hub config.json says `rope_scaling` (and rope_theta beside it), transformers v5 `rope_parameters`."""
    src = tmp_path / "hub"
    src.mkdir()
    for file in model_folder("llama31").iterdir():
        (src / file.name).write_bytes(file.read_bytes())
    config = json.loads((src / "config.json").read_text())
    block = config.pop("rope_parameters")
    config["rope_theta"] = block.pop("rope_theta")
    config["rope_scaling"] = block
    (src / "config.json").write_text(json.dumps(config))
    wb.convert(src, tmp_path / "out", to="gguf", dtype="f16", quiet=True)
    ours, ref = gguf.GGUFReader(tmp_path / "out" / "model.gguf"), gguf.GGUFReader(reference_gguf("llama31", "f16"))
    assert _tensors(ours) == _tensors(ref)
    mine, theirs = _fields(ours), _fields(ref)
    assert {k: v for k, v in mine.items() if not k.startswith("general.")} == {k: v for k, v in theirs.items() if not k.startswith("general.")}


def test_gguf_convert_and_verify_in_a_fresh_process_import_neither_torch_nor_transformers(tmp_path: Path) -> None:
    """--verify re-applies the row conversions and de-quantises with numpy and the gguf package, as the run converts."""
    from tests.conftest import run_cli_measured

    out = tmp_path / "out"
    imported, _ = run_cli_measured(["convert", str(model_folder("llama31")), str(out), "--to", "gguf", "--dtype", "q8_0",
                                    "--verify", "--quiet"])
    assert "numpy" in imported and not imported & {"torch", "transformers"}
    assert (out / "model.gguf").read_bytes() == reference_gguf("llama31", "q8_0").read_bytes()
