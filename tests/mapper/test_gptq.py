"""GPTQ and AWQ checkpoints (tiny Llama-shaped linears, random integers packed as the formats document) are dequantised
by `M.presets.decompress` bit for bit as the references do: GPTQ as GPTQModel's `dequantize_weight` computes
(scales[g_idx] * (q - zero) in the scales' dtype; the original format's zeros stored minus one), the reference written
here from the integers before packing; AWQ equal to compressed-tensors' AutoAWQConverter followed by its
pack-quantized decompression, and to the same torch reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench import mapper as M
from workbench.errors import MapperError, WorkbenchError

LINEARS = {  # module -> (out, in)
    "self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
    "self_attn.o_proj": (64, 64), "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64), "mlp.down_proj": (64, 96),
}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ: [in, out] unsigned ints -> int32 [in * bits / 32, out], row i at bit (i mod 32/bits) * bits of word i // (32/bits)."""
    if bits == 3:
        return pack_3bit(values.T).T.contiguous()
    per = 32 // bits
    v = values.to(torch.int64).reshape(-1, per, values.shape[1])
    words = sum(v[:, k] << (k * bits) for k in range(per))
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack_3bit(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 3-bit values -> int32 [rows, cols * 3 / 32] as AutoGPTQ's `pack` writes them: per 32 values three
    words, ten values in each and the 11th and 22nd split across two words (2 + 1 and 1 + 2 bits)."""
    v = values.to(torch.int64)
    words = torch.zeros(v.shape[0], v.shape[1] // 32 * 3, dtype=torch.int64)
    for block in range(v.shape[1] // 32):
        i, w = 32 * block, 3 * block
        for j in range(10):
            words[:, w] |= v[:, i + j] << (3 * j)
        words[:, w] |= (v[:, i + 10] << 30) & 0xFFFFFFFF
        words[:, w + 1] |= (v[:, i + 10] >> 2) & 1
        for j in range(10):
            words[:, w + 1] |= v[:, i + 11 + j] << (3 * j + 1)
        words[:, w + 1] |= (v[:, i + 21] << 31) & 0xFFFFFFFF
        words[:, w + 2] |= (v[:, i + 21] >> 1) & 3
        for j in range(10):
            words[:, w + 2] |= v[:, i + 22 + j] << (3 * j + 2)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack_columns(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[rows, cols] unsigned ints -> int32 [rows, cols * bits / 32], packed along the columns (AWQ: in `order`)."""
    if bits == 3:
        return pack_3bit(values)
    per = 32 // bits
    order = order or list(range(per))
    v = values.to(torch.int64).reshape(values.shape[0], -1, per)
    words = sum(v[:, :, order[k]] << (k * bits) for k in range(per))
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def gemv_zeros_width(in_features: int, group: int) -> int:
    """AutoAWQ GEMV's width of qzeros (and of scales, times 8): groups in words of 8, rounded up for small groups."""
    multiple = 1 if group >= 128 else {64: 2, 32: 4}[group]
    return math.ceil(math.ceil(in_features // group / 8) / multiple) * multiple


def make_gptq(folder: Path, *, method: str = "gptq", bits: int = 4, group: int = 32, sym: bool = True,
              desc_act: bool = False, v2: bool = False, seed: int = 0, version: str = "gemm") -> dict[str, torch.Tensor]:
    """A Llama-shaped 2-layer GPTQ / AWQ checkpoint from random integers; returns the reference weights [out, in]
    (float16, computed from the integers before packing)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(128, 64, generator=gen).half(),
                                        "model.norm.weight": torch.ones(64).half()}
    expected = {}
    top = 2**bits
    for layer in range(2):
        for module, (out_f, in_f) in LINEARS.items():
            name = f"model.layers.{layer}.{module}"
            size = group if group > 0 else in_f  # group_size -1: one group per output channel
            groups = in_f // size
            q = torch.randint(0, top, (in_f, out_f), generator=gen)
            zeros = (torch.full((groups, out_f), top // 2) if sym
                     else torch.randint(1 if (method == "gptq" and not v2) else 0, top, (groups, out_f), generator=gen))
            scales = (torch.rand(groups, out_f, generator=gen) * 0.02 + 1e-3).half()
            if method == "gptq" and desc_act:
                g_idx = (torch.randperm(in_f, generator=gen) // size).to(torch.int32)
            else:
                g_idx = (torch.arange(in_f) // size).to(torch.int32)
            diff = (q - zeros[g_idx.long()]).to(torch.int16)
            expected[f"{name}.weight"] = (scales[g_idx.long()] * diff).T.contiguous()  # float16 arithmetic, as GPTQModel
            if method == "gptq":
                stored_zeros = zeros if v2 else zeros - 1
                tensors[f"{name}.qweight"] = pack_rows(q, bits)
                tensors[f"{name}.qzeros"] = pack_columns(stored_zeros, bits)
                tensors[f"{name}.g_idx"] = g_idx
            elif version == "gemv":  # AutoAWQ's WQLinear_GEMV.from_linear: by output rows, natural order, padded
                width = gemv_zeros_width(in_f, size)
                tensors[f"{name}.qweight"] = pack_columns(q.T.contiguous(), bits)
                tensors[f"{name}.qzeros"] = torch.nn.functional.pad(pack_columns(
                    torch.nn.functional.pad(zeros.T, (0, -groups % 8)), bits), (0, width - math.ceil(groups / 8)))
                tensors[f"{name}.scales"] = torch.nn.functional.pad(scales.T, (0, width * 8 - groups)).contiguous()
                continue
            else:
                tensors[f"{name}.qweight"] = pack_columns(q, bits, AWQ_ORDER)
                tensors[f"{name}.qzeros"] = pack_columns(zeros, bits, AWQ_ORDER)
            tensors[f"{name}.scales"] = scales
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if method == "gptq":
        quant = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
                 "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    else:
        quant = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": not sym, "version": version}
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
              "torch_dtype": "float16", "quantization_config": quant}
    (folder / "config.json").write_text(json.dumps(config))
    return expected


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


CASES = {
    "gptq-4-sym": dict(bits=4, sym=True),
    "gptq-4-asym-desc-act": dict(bits=4, sym=False, desc_act=True),
    "gptq-8-sym-desc-act": dict(bits=8, sym=True, desc_act=True),
    "gptq-8-asym": dict(bits=8, sym=False),
    "gptq-2-asym": dict(bits=2, sym=False),
    "gptq-4-asym-v2": dict(bits=4, sym=False, v2=True),
    "gptq-4-channel": dict(bits=4, sym=False, group=-1),
    "awq-4-zero-point": dict(method="awq", bits=4, sym=False),
    "gptq-3-asym-desc-act": dict(bits=3, sym=False, desc_act=True),
    "gptq-3-sym": dict(bits=3, sym=True),
    "gptq-3-asym-v2-channel": dict(bits=3, sym=False, v2=True, group=-1),
    "awq-gemv-4-zero-point": dict(method="awq", bits=4, sym=False, version="gemv"),
    "awq-gemv-4-midpoint": dict(method="awq", bits=4, sym=True, version="gemv", seed=5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_decompress_equals_the_reference_bit_for_bit(tmp_path, case):
    options = CASES[case]
    folder = tmp_path / "src"
    expected = make_gptq(folder, **options)
    for dtype, torch_dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        out = tmp_path / dtype
        mapper = M.presets.decompress(folder) if dtype == "fp16" else M.presets.decompress(folder, dtype="bf16")
        wb.convert(folder, out, mapper)
        got = load_file(out / "model.safetensors")
        assert sorted(got) == sorted([*expected, "model.embed_tokens.weight", "model.norm.weight"])
        for name, weight in expected.items():
            assert _same_bits(got[name], weight.to(torch_dtype)), (name, dtype)
        config = json.loads((out / "config.json").read_text())
        assert "quantization_config" not in config


def test_awq_equals_compressed_tensors_converter(tmp_path):
    """AWQ's GEMM order cross-checked against compressed-tensors: its AutoAWQConverter to pack-quantized, then the
    library's decompress()."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import QuantizationScheme

    folder = tmp_path / "awq"
    make_gptq(folder, method="awq", bits=4, sym=False, group=32, seed=3)
    tensors = load_file(folder / "model.safetensors")
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    converter = AutoAWQConverter.from_autoawq_config(quant)
    converted = converter.process(dict(tensors))
    group = next(iter(converter.update_config(None).config_groups.values()))
    scheme = QuantizationScheme.model_validate(group.model_dump())
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    wb.convert(folder, tmp_path / "out", M.presets.decompress(folder))
    got = load_file(tmp_path / "out" / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".qweight")]:
        module = name.removesuffix(".qweight")
        local = {k[len(module) + 1:]: v for k, v in converted.items() if k.rsplit(".", 1)[0] == module}
        reference = compressor.decompress(local, scheme)["weight"]
        assert _same_bits(got[f"{module}.weight"], reference), module


def test_catalog_columns_and_suggest(tmp_path):
    folder = tmp_path / "gptq"
    make_gptq(folder, bits=4, sym=False, desc_act=True)
    ck = wb.open_checkpoint(folder)
    table = ck.tensors
    row = table.loc["model.layers.1.mlp.down_proj.qweight"]
    assert (row["quant_format"], row["quant_role"], row["quant_bits"], row["quant_group"], bool(row["quant_sym"])) == (
        "gptq", "packed", 4, "32", False)
    assert set(row["quant_parts"]) == {f"model.layers.1.mlp.down_proj.{s}" for s in ("scales", "qzeros", "g_idx")}
    assert table.loc["model.layers.1.mlp.down_proj.g_idx", "quant_role"] == "g_idx"
    assert list(ck.suggest()["preset"])[0] == "decompress"


def test_plan_says_what_is_dequantised_and_counts_it(tmp_path):
    folder = tmp_path / "gptq"
    make_gptq(folder, bits=4)
    plan = wb.plan(folder, M.presets.decompress(folder))
    groups = plan.groups
    dequantised = groups[groups["label"] == "dequantize_gptq_tensor"]
    assert len(dequantised) == 14 and set(groups[groups["label"] != "dequantize_gptq_tensor"]["kind"]) == {"copy"}
    assert (dequantised["held_bytes"] >= dequantised["bytes_in"] + dequantised["bytes_out"]).all()


def test_malformed_gptq_is_refused_naming_the_tensor(tmp_path):
    folder = tmp_path / "gptq"
    make_gptq(folder, bits=4, sym=False)
    tensors = load_file(folder / "model.safetensors")
    bad = "model.layers.0.mlp.up_proj.qzeros"
    save_file({k: v for k, v in tensors.items() if k != bad}, folder / "model.safetensors")
    with pytest.raises(MapperError, match="up_proj.*no qzeros"):
        M.presets.decompress(folder)
    bad = "model.layers.1.self_attn.o_proj.scales"
    save_file({**tensors, bad: tensors[bad][:1].contiguous()}, folder / "model.safetensors")
    with pytest.raises(WorkbenchError, match="o_proj.scales.*expected"):
        M.presets.decompress(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["bits"] = 5
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(MapperError, match="5 bits is not supported"):
        M.presets.decompress(folder)


def test_inspect_shows_the_packed_columns(tmp_path, capsys):
    from workbench.cli import main

    folder = tmp_path / "awq"
    make_gptq(folder, method="awq", bits=4, sym=False)
    assert main(["inspect", str(folder), "--format", "json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)["tensors"]}
    row = records["model.layers.0.mlp.gate_proj.qweight"]
    assert (row["quant_format"], row["quant_role"], row["quant_bits"], row["quant_group"], row["quant_sym"]) == (
        "awq", "packed", 4, "32", False)
    assert row["quant_parts"] == ["model.layers.0.mlp.gate_proj.scales", "model.layers.0.mlp.gate_proj.qzeros"]
    assert "quant_format" not in records["model.norm.weight"] or records["model.norm.weight"]["quant_format"] is None


def test_the_explorer_shows_the_packed_columns(tmp_path):
    pytest.importorskip("ipywidgets")
    from workbench.widgets.explorer import Explorer

    folder = tmp_path / "gptq"
    make_gptq(folder, bits=8, sym=True, desc_act=True)
    explorer = Explorer(folder)
    assert "<th>quant_format</th>" in explorer.table.value
    explorer.select("model.layers.0.mlp.up_proj.qweight")
    assert "<th>quant_role</th><td>packed</td>" in explorer.details.value
    assert "<th>quant_bits</th><td>8</td>" in explorer.details.value


def test_a_g_idx_outside_the_groups_stops_the_run(tmp_path):
    folder = tmp_path / "gptq"
    make_gptq(folder, bits=4, desc_act=True)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.g_idx"
    save_file({**tensors, name: torch.full_like(tensors[name], 7)}, folder / "model.safetensors")
    with pytest.raises(WorkbenchError, match="g_idx model.layers.0.self_attn.q_proj.g_idx names groups outside 0..1"):
        wb.convert(folder, tmp_path / "out", M.presets.decompress(folder), quiet=True)


@pytest.mark.parametrize(("method", "key", "value", "why"), [
    ("gptq", "checkpoint_format", "marlin", "Marlin's GPU tile permutation"),
    ("awq", "version", "gemv_fast", "interleaved tile layout"),
    ("awq", "version", "marlin", "interleaved tile layout"),
    ("awq", "version", "exllama", "not one the workbench reads"),
])
def test_gpu_kernel_packings_are_refused_with_the_reason(tmp_path, method, key, value, why):
    folder = tmp_path / "q"
    make_gptq(folder, method=method, bits=4, sym=False)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"][key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(MapperError, match=why):
        M.presets.decompress(folder)
    assert "decompress" not in list(wb.open_checkpoint(folder).suggest()["preset"])  # not offered: it would refuse


def test_awq_gemv_streams_by_rows(tmp_path):
    """GEMV stores each output row's values together: its plan reads qweight by chunks of rows (a 'rows' step held
    below the whole weight in and out), and the output is the same at any chunk size."""
    folder = tmp_path / "gemv"
    expected = make_gptq(folder, method="awq", bits=4, sym=False, version="gemv")
    from workbench.mapper.row_jobs import row_job

    plan = wb.plan(folder, M.presets.decompress(folder), chunk_size=4096)
    steps = [s for s in plan.steps if s.group.outputs[0].name.endswith("proj.weight")]
    assert len(steps) == 14 and {s.kind for s in steps} == {"rows"}
    assert list(wb.open_checkpoint(folder).suggest()["why"])[0].startswith("AWQ 4-bit (gemv) packed weights")
    job = row_job(next(s for s in steps if s.group.outputs[0].name == "model.layers.0.mlp.gate_proj.weight").group)
    assert (job.rows, job.chunk_rows(job.budget(4096))) == (96, 4096 // (64 // 2 + 64 * 2))  # a chunk of whole rows
    wb.convert(folder, tmp_path / "out", M.presets.decompress(folder, dtype="fp16"), chunk_size=4096)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert all(_same_bits(got[n], w) for n, w in expected.items())
