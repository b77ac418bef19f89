"""Quantised weights: FP8 block scales and MXFP4 dequantised bit for bit against torch / transformers references
computed from the same bytes; FP8 quantisation bit-identical to transformers' Fp8Quantize and to a torch reference
of the same algorithm with partial edge tiles; plans count the scales; runs stay within the predicted peak."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench import mapper as M
from workbench.errors import MapperError
from workbench.mapper.presets import quantized as Q

BLOCK = (128, 128)
FP8_SHAPES = {  # name -> shape: edge tiles in both dims, a stacked expert tensor, an exact multiple
    "model.layers.0.self_attn.q_proj.weight": (200, 300),
    "model.layers.1.self_attn.q_proj.weight": (200, 300),
    "model.layers.0.mlp.down_proj.weight": (256, 129),
    "model.layers.1.mlp.down_proj.weight": (256, 129),
    "model.layers.0.mlp.experts.gate_up_proj": (3, 130, 256),
}


def _fp8_bytes(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # e4m3fn NaN patterns -> 1.5 (NaN payloads differ between libraries)
    return raw.view(torch.float8_e4m3fn)


def _scale_name(weight: str) -> str:
    return weight + Q.SCALE_SUFFIX


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8")
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.norm.weight": torch.randn(300, generator=gen).to(torch.bfloat16)}
    for name, shape in FP8_SHAPES.items():
        tensors[name] = _fp8_bytes(gen, shape)
        grid = (*shape[:-2], math.ceil(shape[-2] / BLOCK[0]), math.ceil(shape[-1] / BLOCK[1]))
        tensors[_scale_name(name)] = torch.rand(grid, generator=gen) * 2 + 1e-3
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = {"model_type": "deepseek_v3", "torch_dtype": "bfloat16",
              "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, tensors


def torch_dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, block, dtype) -> torch.Tensor:
    """Reference: each element times the scale of its tile, in float32, from quantization_config's block."""
    rows, cols = weight.shape[-2:]
    full = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.to(torch.float32) * full.to(torch.float32)).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_dequantize_fp8_converts_bit_exact_with_edge_tiles(fp8_checkpoint, tmp_path, dtype):
    folder, tensors = fp8_checkpoint
    mapper = M.presets.dequantize_fp8(folder / "config.json", dtype=dtype)
    out = tmp_path / "out"
    wb.convert(folder, out, mapper, dtype=None)
    got = load_file(out / "model.safetensors")
    target = torch.bfloat16 if dtype == "bf16" else torch.float32
    assert not [n for n in got if n.endswith("_scale_inv")]
    for name in FP8_SHAPES:
        assert _same_bits(got[name], torch_dequant_fp8(tensors[name], tensors[_scale_name(name)], BLOCK, target)), name
    assert _same_bits(got["model.norm.weight"], tensors["model.norm.weight"])
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == ("bfloat16" if dtype == "bf16" else "float32")


def test_dequantize_fp8_mapper_folds_layers_and_exports(fp8_checkpoint):
    folder, _ = fp8_checkpoint
    mapper = M.presets.dequantize_fp8(json.loads((folder / "config.json").read_text()), source=wb.open_checkpoint(folder))
    code = mapper.to_code()
    assert "model.layers.{n0}.self_attn.q_proj.weight_scale_inv" in code and "'block': [128, 128]" in code
    namespace: dict = {}
    exec(code, namespace)
    assert namespace["mapper"] == mapper
    assert mapper == M.from_json(mapper.to_json())


def test_transformers_own_dequantisation_is_wrong_on_edge_tiles(fp8_checkpoint):
    """Why the reference is computed from weight_block_size: transformers infers the block from the scale grid."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    _, tensors = fp8_checkpoint
    odd = "model.layers.0.mlp.down_proj.weight"  # 129 columns over 2 scale columns: refused
    with pytest.raises(ValueError, match="not divisible"):
        Fp8Dequantize(None)._dequantize_one(tensors[odd], tensors[_scale_name(odd)], torch.bfloat16)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"):  # silently wrong
        theirs = Fp8Dequantize(None)._dequantize_one(tensors[name], tensors[_scale_name(name)], torch.bfloat16)
        assert not _same_bits(theirs, torch_dequant_fp8(tensors[name], tensors[_scale_name(name)], BLOCK, torch.bfloat16))


def test_plan_counts_scales_as_group_inputs(fp8_checkpoint):
    folder, tensors = fp8_checkpoint
    plan = wb.plan(folder, M.presets.dequantize_fp8(folder / "config.json"))
    assert plan.ok, plan.problems
    for step in plan.steps:
        names = {t.name for t in step.group.inputs}
        weight = next((n for n in names if n in FP8_SHAPES), None)
        if weight is None:
            continue
        assert names == {weight, _scale_name(weight)}
        scale_bytes = tensors[_scale_name(weight)].numel() * 4
        out_bytes = tensors[weight].numel() * 2
        assert step.held_bytes >= tensors[weight].numel() + scale_bytes + out_bytes
    biggest = max(t.numel() * 3 for n, t in tensors.items() if n in FP8_SHAPES)
    assert plan.peak_bytes >= biggest


def test_multi_group_run_stays_within_predicted_peak(tmp_path, monkeypatch):
    """Three groups of 3 MB FP8 each, converted by row blocks (`fp8_rows`): the engine's ledger stays within the
    plan's peak, and the memory Python and numpy actually allocate during each step (tracemalloc) is the step's
    predicted bytes plus a small scratch: the kernel never materialises a float32 copy of the whole tensor."""
    import tracemalloc

    from workbench.engine import rows as engine_steps

    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for i in range(3):
        tensors[f"model.layers.{i}.mlp.up_proj.weight"] = _fp8_bytes(gen, (1500, 2000))
        tensors[f"model.layers.{i}.mlp.up_proj.weight_scale_inv"] = torch.rand(12, 16, generator=gen)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": list(BLOCK)}}))
    measured: list[tuple[int, int]] = []
    run_rows = engine_steps.run_rows

    def traced(ctx, step):
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        run_rows(ctx, step)
        measured.append((tracemalloc.get_traced_memory()[1] - start, step.held_bytes))

    monkeypatch.setattr(engine_steps, "run_rows", traced)
    tracemalloc.start()
    try:
        report = wb.convert(tmp_path, tmp_path / "out", M.presets.dequantize_fp8(tmp_path), quiet=True)
    finally:
        tracemalloc.stop()
    assert report.predicted_peak_bytes >= 3 * 1500 * 2000  # fp8 in + bf16 out of one group
    assert report.peak_tensor_bytes <= report.predicted_peak_bytes
    assert len(measured) == 3
    scratch = 1 << 20  # a few pieces of Q.PIECE values (a float32 copy of one weight would be 12 MB)
    for used, predicted in measured:
        assert predicted <= used <= predicted + scratch


def test_wrong_block_is_a_plan_problem_naming_the_scale(fp8_checkpoint):
    folder, _ = fp8_checkpoint
    plan = wb.plan(folder, M.presets.dequantize_fp8(folder / "config.json", block=(64, 64)))
    assert not plan.ok
    assert any("down_proj.weight_scale_inv' are F32 [2, 2], but block [64, 64] needs a float grid [4, 3]" in p.message
               and "weight_block_size" in p.message for p in plan.errors)


def test_dequantize_fp8_needs_a_block():
    with pytest.raises(MapperError, match="weight_block_size"):
        M.presets.dequantize_fp8({"model_type": "x"}, source={})


# -- quantisation -----------------------------------------------------------------------------------------
def torch_quant_fp8(weight: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: transformers' Fp8Quantize algorithm with zero-padded partial tiles (padding never raises a max)."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight.to(torch.float32).abs()
    amax = padded.reshape(grid[0], block[0], grid[1], block[1]).amax(dim=(1, 3))
    scale = torch.where(amax > 0, 448.0 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.ones_like(amax))
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    q = torch.clamp(weight.to(torch.float32) * full, min=-448.0, max=448.0).to(torch.float8_e4m3fn)
    return q, (1.0 / scale).to(torch.float32)


@pytest.mark.parametrize(("shape", "block"), [((200, 300), BLOCK), ((256, 384), BLOCK), ((1, 7), BLOCK), ((500, 515), (8, 16))])
def test_quantize_fp8_equals_torch_reference(shape, block):
    """Thousands of tiles in the last case: torch's `448 / amax` rounds twice (reciprocal, then product), and so must we."""
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)
    weight[0, : min(5, shape[1])] = 0
    q, inv = Q.quantize_fp8_tensor(weight, block=block)
    ref_q, ref_inv = torch_quant_fp8(weight, block)
    assert _same_bits(q, ref_q) and _same_bits(inv, ref_inv)
    zero = torch.zeros(3, 3, dtype=torch.bfloat16)
    q0, inv0 = Q.quantize_fp8_tensor(zero, block=(2, 2))
    assert torch.all(q0.to(torch.float32) == 0) and torch.all(inv0 == 1)


def test_quantize_fp8_equals_transformers_quantizer_on_whole_tiles():
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    class Quantizer:
        quantization_config = FineGrainedFP8Config(weight_block_size=[64, 32])

    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(128, 96, generator=gen) * 0.02).to(torch.bfloat16)
    theirs = Fp8Quantize(Quantizer())._quantize_one("m.q_proj.weight", weight)
    q, inv = Q.quantize_fp8_tensor(weight, block=(64, 32))
    assert _same_bits(q, theirs["m.q_proj.weight"]) and _same_bits(inv, theirs["m.q_proj.weight_scale_inv"])
    assert Q.fp8_quantization_config([64, 32]) == FineGrainedFP8Config(weight_block_size=[64, 32]).to_dict()


def test_quantize_then_dequantize_roundtrip_within_fp8_tolerance(tmp_path):
    gen = torch.Generator().manual_seed(3)
    tensors = {f"model.layers.{i}.self_attn.{p}.weight": (torch.randn(200, 300, generator=gen) * 0.05).to(torch.bfloat16)
               for i in range(2) for p in ("q_proj", "o_proj")}
    tensors["model.embed_tokens.weight"] = torch.randn(50, 300, generator=gen).to(torch.bfloat16)
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    wb.convert(src, tmp_path / "fp8", M.presets.quantize_fp8(block=BLOCK, source=src))
    fp8 = load_file(tmp_path / "fp8" / "model.safetensors")
    assert fp8["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 3)
    assert _same_bits(fp8["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == Q.fp8_quantization_config(BLOCK)
    wb.convert(tmp_path / "fp8", tmp_path / "back", M.presets.dequantize_fp8(tmp_path / "fp8"))
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    for name, original in tensors.items():
        if "proj" not in name:
            continue
        q, inv = torch_quant_fp8(original, BLOCK)
        assert _same_bits(fp8[name], q) and _same_bits(fp8[name + Q.SCALE_SUFFIX], inv), name
        assert _same_bits(back[name], torch_dequant_fp8(q, inv, BLOCK, torch.bfloat16)), name
        err = (back[name].float() - original.float()).abs()
        assert float((err / original.float().abs().clamp(min=1e-3)).median()) < 2 ** -4  # e4m3: 3 mantissa bits


# -- MXFP4 --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """gpt-oss layout: experts' gate_up/down as *_blocks [E, rows, in/32, 16] + *_scales [E, rows, in/32]."""
    folder = tmp_path_factory.mktemp("mxfp4")
    gen = torch.Generator().manual_seed(4)
    experts, hidden, inter = 4, 64, 96
    tensors = {}
    for i in range(2):
        prefix = f"model.layers.{i}.mlp.experts"
        for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            tensors[f"{prefix}.{proj}_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen,
                                                               dtype=torch.uint8)
            tensors[f"{prefix}.{proj}_scales"] = torch.randint(110, 140, (experts, rows, cols // 32), generator=gen,
                                                               dtype=torch.uint8)
            tensors[f"{prefix}.{proj}_bias"] = torch.randn(experts, rows, generator=gen).to(torch.bfloat16)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, tensors


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_dequantize_mxfp4_equals_transformers(mxfp4_checkpoint, tmp_path, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder, tensors = mxfp4_checkpoint
    wb.convert(folder, tmp_path / "out", M.presets.dequantize_mxfp4(folder, dtype=dtype))
    got = load_file(tmp_path / "out" / "model.safetensors")
    target = torch.bfloat16 if dtype == "bf16" else torch.float32
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        ref = convert_moe_packed_tensors(tensors[name], tensors[base + "_scales"], dtype=target)
        assert _same_bits(got[base], ref), base
        assert name not in got and base + "_scales" not in got
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


def test_mxfp4_numpy_path_and_fp4_table():
    """The kernel runs on numpy arrays alone; its FP4 decoding is transformers' table."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    blocks = np.arange(16, dtype=np.uint8).reshape(1, 1, 16) * np.uint8(17)  # both nibbles = 0..15
    scales = np.full((1, 1), 127, dtype=np.uint8)
    out = Q.dequantize_mxfp4_tensor(blocks, scales, dtype="F32", transpose=False)
    assert isinstance(out, np.ndarray)
    assert out.reshape(-1).tolist() == [v for v in FP4_VALUES for _ in range(2)]


def test_mxfp4_plan_counts_scales(mxfp4_checkpoint):
    folder, tensors = mxfp4_checkpoint
    plan = wb.plan(folder, M.presets.dequantize_mxfp4(folder))
    assert plan.ok, plan.problems
    compute = [s for s in plan.steps if any(t.name.endswith("_blocks") for t in s.group.inputs)]
    assert len(compute) == 4
    for step in compute:
        blocks = next(t for t in step.group.inputs if t.name.endswith("_blocks"))
        assert {t.name for t in step.group.inputs} == {blocks.name, blocks.name.replace("_blocks", "_scales")}
        scales = tensors[blocks.name.replace("_blocks", "_scales")]
        assert step.held_bytes >= blocks.nbytes + scales.numel() + blocks.nbytes * 2 * 2


# -- transformers and the CLI -------------------------------------------------------------------------------
def test_quantized_output_loads_in_transformers_as_fp8(tmp_path):
    """transformers reads our FP8 folder through its fine-grained FP8 quantizer (on CPU it dequantises while loading):
    no missing or unexpected keys, and its weights equal our own dequantisation bit for bit."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=100, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "base")
    wb.convert(tmp_path / "base", tmp_path / "fp8", M.presets.quantize_fp8(block=(32, 32)), quiet=True)
    fp8 = load_file(tmp_path / "fp8" / "model.safetensors")
    assert fp8["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8["model.layers.1.mlp.down_proj.weight_scale_inv"].shape == (2, 4)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    wb.convert(tmp_path / "fp8", tmp_path / "deq", M.presets.dequantize_fp8(tmp_path / "fp8"), quiet=True)
    ours = load_file(tmp_path / "deq" / "model.safetensors")
    theirs = model.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert _same_bits(tensor, theirs[name]), name


def test_cli_convert_with_exported_preset(fp8_checkpoint, tmp_path):
    from workbench.cli import main

    folder, tensors = fp8_checkpoint
    mapper_file = tmp_path / "dequant.py"
    mapper_file.write_text(M.presets.dequantize_fp8(folder).to_code())
    assert main(["convert", str(folder), str(tmp_path / "out"), "--mapper", str(mapper_file), "--quiet"]) == 0
    got = load_file(tmp_path / "out" / "model.safetensors")
    name = "model.layers.1.self_attn.q_proj.weight"
    assert _same_bits(got[name], torch_dequant_fp8(tensors[name], tensors[_scale_name(name)], BLOCK, torch.bfloat16))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"


def test_deepseek_v3_quantised_by_us_loads_in_transformers(tmp_path):
    """A tiny DeepSeek-V3 (MLA projections, shared and routed experts) quantised with quantize_fp8(source=...):
    transformers loads it with no missing or unexpected keys, and what it holds equals our dequantisation
    (its experts stacked per layer, as transformers 5 keeps them). Block 8 divides every dim: transformers'
    own dequantisation cannot do partial tiles (kv_a_proj_with_mqa has 40 rows)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, tie_word_embeddings=False)
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "base")
    targets = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    mapper = M.presets.quantize_fp8(block=(8, 8), source=tmp_path / "base", targets=targets)
    assert "model.layers.{n0}.mlp.experts.{n1}.gate_proj.weight_scale_inv" in mapper.to_code()
    wb.convert(tmp_path / "base", tmp_path / "fp8", mapper, quiet=True)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    wb.convert(tmp_path / "fp8", tmp_path / "deq", M.presets.dequantize_fp8(tmp_path / "fp8"), quiet=True)
    ours = load_file(tmp_path / "deq" / "model.safetensors")
    theirs = model.state_dict()
    experts = "model.layers.1.mlp.experts"
    ours[f"{experts}.gate_up_proj"] = torch.stack([
        torch.cat([ours.pop(f"{experts}.{e}.gate_proj.weight"), ours.pop(f"{experts}.{e}.up_proj.weight")]) for e in range(4)])
    ours[f"{experts}.down_proj"] = torch.stack([ours.pop(f"{experts}.{e}.down_proj.weight") for e in range(4)])
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        if theirs[name].dtype == torch.float32 != tensor.dtype:  # loaded in float32 by transformers (the routing bias;
            # more of the FP8 model since transformers 5.24): bfloat16 -> float32 is exact, so the values must be equal
            assert torch.equal(tensor.float(), theirs[name]), name
            continue
        assert _same_bits(tensor, theirs[name]), name


def test_gpt_oss_mxfp4_dequantised_equals_transformers_and_loads_as_bf16(tmp_path):
    """A tiny gpt-oss whose experts are stored MXFP4 (random blocks and scales, gpt-oss shapes): transformers'
    MXFP4 loader (dequantising on CPU) holds exactly what dequantize_mxfp4 writes, and our output folder loads
    in transformers as a plain bf16 gpt-oss (quantization_config removed) with the same tensors."""
    from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "base")
    tensors = load_file(tmp_path / "base" / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for i in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            experts, inputs, outputs = tensors.pop(f"model.layers.{i}.mlp.experts.{proj}").shape  # held [E, in, out]
            base = f"model.layers.{i}.mlp.experts.{proj}"
            tensors[base + "_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=gen, dtype=torch.uint8)
            tensors[base + "_scales"] = torch.randint(118, 130, (experts, outputs, inputs // 32), generator=gen, dtype=torch.uint8)
    (tmp_path / "mx").mkdir()
    save_file(tensors, tmp_path / "mx" / "model.safetensors", metadata={"format": "pt"})
    config_dict = json.loads((tmp_path / "base" / "config.json").read_text())
    config_dict["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "mx" / "config.json").write_text(json.dumps(config_dict))
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "mx", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    wb.convert(tmp_path / "mx", tmp_path / "deq", M.presets.dequantize_mxfp4(tmp_path / "mx"), quiet=True)
    ours = load_file(tmp_path / "deq" / "model.safetensors")
    theirs = model.state_dict()
    assert set(ours) == set(theirs)
    assert all(_same_bits(tensor, theirs[name]) for name, tensor in ours.items())
    assert "quantization_config" not in json.loads((tmp_path / "deq" / "config.json").read_text())
    plain, info = AutoModelForCausalLM.from_pretrained(tmp_path / "deq", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(_same_bits(tensor, plain.state_dict()[name]) for name, tensor in ours.items())


def test_partial_dequantisation_keeps_the_config_and_says_why(fp8_checkpoint):
    folder, _ = fp8_checkpoint
    full = M.presets.dequantize_fp8(folder, dtype="fp32")
    plan = wb.plan(folder, full)
    config = next(e for e in plan.extra_files if e.path == "config.json")
    assert config.action == "update" and "quantization_config removed" in config.reason
    assert "torch_dtype: bfloat16 -> float32" in config.reason
    plan = wb.plan(folder, M.Parallel(*full.mappers[:1]))
    config = next(e for e in plan.extra_files if e.path == "config.json")
    assert config.action == "copy" and "quantised tensors remain in the output" in config.reason


def test_names_spelled_out_where_a_template_would_catch_an_unscaled_weight():
    from workbench.catalog import TensorInfo

    infos = [TensorInfo("model.layers.0.self_attn.q_proj.weight", "F8_E4M3", (16, 16)),
             TensorInfo("model.layers.0.self_attn.q_proj.weight_scale_inv", "F32", (2, 2)),
             TensorInfo("model.layers.1.self_attn.q_proj.weight", "BF16", (16, 16)),  # kept in bf16, no scale
             *[TensorInfo(f"model.layers.{i}.mlp.up_proj.{s}", d, shape) for i in range(2)
               for s, d, shape in (("weight", "F8_E4M3", (16, 24)), ("weight_scale_inv", "F32", (2, 3)))]]
    source = {info.name: info for info in infos}
    mapper = M.presets.dequantize_fp8({"quantization_config": {"weight_block_size": [8, 8]}}, source=source)
    code = mapper.to_code()
    assert "'model.layers.0.self_attn.q_proj.weight'" in code and "model.layers.1.self_attn" not in code
    assert "model.layers.{n0}.mlp.up_proj.weight_scale_inv" in code
    outputs = mapper.bind(source).raise_for_problems().outputs
    assert outputs["model.layers.1.self_attn.q_proj.weight"].dtype == "BF16"
    assert {outputs[f"model.layers.{i}.mlp.up_proj.weight"].dtype for i in range(2)} == {"BF16"}
    assert not [n for n in outputs if n.endswith("_scale_inv")]


def test_a_dtype_policy_on_top_of_a_mapper_plans(fp8_checkpoint, tmp_path) -> None:
    """A mapper plus dtype= wraps each group's op in a cast: the plan still reads the mapper's config changes."""
    import workbench as wb
    from workbench import mapper as M

    folder, _ = fp8_checkpoint
    plan = wb.plan(folder, M.presets.dequantize_fp8(folder), dtype="fp32", dest=tmp_path / "out")
    assert plan.ok, plan.problems


def test_mxfp4_experts_are_dequantised_a_few_experts_at_a_time(mxfp4_checkpoint, tmp_path):
    """dequantize_mxfp4 offers a row job over experts (mapper.row_jobs): a small chunk size makes a `rows` step that
    holds one expert in and out (plus the scales), and the output is transformers' dequantisation, bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder, tensors = mxfp4_checkpoint
    mapper = M.presets.dequantize_mxfp4(folder)
    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    blocks, scales = tensors[name], tensors[name.replace("_blocks", "_scales")]
    expert = blocks[0].numel() + blocks[0].numel() * 2 * 2  # uint8 blocks in, bf16 values out (two a byte)
    plan = wb.plan(folder, mapper, chunk_size=expert)
    (step,) = [s for s in plan.steps if s.group.inputs[0].name == name]
    assert step.kind == "rows" and step.held_bytes == expert + scales.numel() + 3 * 4 * Q.PIECE
    report = wb.convert(folder, tmp_path / "out", mapper, chunk_size=expert, quiet=True, verify=True)
    assert report.verified
    got = load_file(tmp_path / "out" / "model.safetensors")
    base = name.removesuffix("_blocks")
    assert _same_bits(got[base], convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
