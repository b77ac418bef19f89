"""compressed-tensors checkpoints made by the library's own compressors (tiny Llama and Qwen2 from a config, random
weights, scales from `calculate_qparams`) are dequantised by `M.presets.decompress` bit for bit as the library's
per-format compressors' `decompress()` do; the catalog says what each packed tensor is; plans stream by rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench import mapper as M
from workbench.errors import MapperError, WorkbenchError

ct = pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import BaseCompressor, ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStrategy,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

# name -> (compressed-tensors preset scheme, changes to its weight args, format forced or None)
SCHEMES = {
    "w4-group-sym": ("W4A16", {"group_size": 32}, None),
    "w4-group-asym": ("W4A16_ASYM", {"group_size": 32}, None),
    "w8-group-sym": ("W8A16", {"group_size": 32}, None),
    "w4-channel-asym": ("W4A16_ASYM", {"strategy": "channel", "group_size": None}, None),
    "w3-group-sym": ("W3A16", {"group_size": 32}, None),
    "int8-channel": ("INT8", {}, "int-quantized"),
    "naive-w8-group": ("W8A16", {"group_size": 32}, "naive-quantized"),
    "fp8-tensor": ("FP8", {}, None),
    "fp8-channel": ("FP8_DYNAMIC", {}, None),
    "fp8-block": ("FP8_BLOCK", {"block_structure": [32, 32]}, None),
    "nvfp4": ("NVFP4", {}, None),
}
FAMILIES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}


def _scheme(name: str) -> QuantizationScheme:
    preset, changes, _ = SCHEMES[name]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if changes:
        scheme.weights = scheme.weights.model_copy(update=changes)
    return scheme


def _calibrate(model: torch.nn.Module) -> None:
    """Scales and zero points from each weight's own min / max, through the library's `calculate_qparams`."""
    for _, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        args, weight = scheme.weights, module.weight.data
        if args.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
            grouped = weight.unflatten(-1, (-1, args.group_size))
            low, high = grouped.amin(-1), grouped.amax(-1)
        elif args.strategy == QuantizationStrategy.CHANNEL:
            low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
        elif args.strategy == QuantizationStrategy.BLOCK:
            b0, b1 = args.block_structure
            rows, cols = weight.shape
            padded = torch.nn.functional.pad(weight, (0, -cols % b1, 0, -rows % b0))
            tiles = padded.unflatten(0, (-1, b0)).unflatten(-1, (-1, b1)).transpose(1, 2)
            low, high = tiles.amin((-1, -2)), tiles.amax((-1, -2))
        else:
            low, high = weight.amin().reshape(1), weight.amax().reshape(1)
        global_scale = None
        if args.strategy == QuantizationStrategy.TENSOR_GROUP:
            global_scale = generate_gparam(weight.amin(), weight.amax())
            module.weight_global_scale.data.copy_(global_scale)
        scale, zero = calculate_qparams(low, high, args, global_scale=global_scale)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))


def make_checkpoint(folder: Path, scheme: str, family: str = "llama", seed: int = 0) -> Path:
    """A tiny `family` model (random weights, bf16) quantised with `scheme` and compressed by the library's own
    ModelCompressor, saved as model.safetensors + config.json (quantization_config as the library writes it)."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, FAMILIES[family])(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": _scheme(scheme)}, ignore=["lm_head"]))
    _calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=SCHEMES[scheme][2])
    compressor.compress_model(model)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.torch_dtype = torch.bfloat16
    model.config.save_pretrained(folder)
    compressor.update_config(str(folder))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def library_weights(folder: Path) -> dict[str, torch.Tensor]:
    """module.weight -> what the library's per-format compressor's `decompress()` gives, from the saved tensors."""
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    group = next(iter(quant["config_groups"].values()))
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    tensors = load_file(folder / "model.safetensors")
    modules = {name.rsplit(".", 1)[0] for name in tensors if name.endswith(".weight_scale")}
    out = {}
    for module in sorted(modules):
        local = {name[len(module) + 1:]: t for name, t in tensors.items() if name.rsplit(".", 1)[0] == module}
        out[f"{module}.weight"] = compressor.decompress(local, scheme)["weight"]
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[tuple[str, str], Path] = {}

    def get(scheme: str, family: str = "llama") -> Path:
        if (scheme, family) not in made:
            made[scheme, family] = make_checkpoint(tmp_path_factory.mktemp(f"{scheme}-{family}"), scheme, family)
        return made[scheme, family]

    return get


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_decompress_equals_the_library_bit_for_bit(checkpoints, tmp_path, scheme):
    folder = checkpoints(scheme)
    reference = library_weights(folder)
    assert len(reference) == 14  # 2 layers x 7 linears
    out = tmp_path / "out"
    wb.convert(folder, out, M.presets.decompress(folder))
    got = load_file(out / "model.safetensors")
    for name, expected in reference.items():
        assert _same_bits(got[name], expected.to(torch.bfloat16)), name
    leftovers = [n for n in got if n.rsplit(".", 1)[-1].startswith(("weight_", "input_"))]
    assert not leftovers
    original = load_file(folder / "model.safetensors")
    assert _same_bits(got["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config


@pytest.mark.parametrize("scheme", ["w4-group-asym", "fp8-channel", "nvfp4"])
def test_qwen2_and_fp32_output(checkpoints, tmp_path, scheme):
    folder = checkpoints(scheme, "qwen2")
    reference = library_weights(folder)
    out = tmp_path / "out"
    wb.convert(folder, out, M.presets.decompress(folder, dtype="fp32"))
    got = load_file(out / "model.safetensors")
    for name, expected in reference.items():
        assert _same_bits(got[name], expected.to(torch.float32)), name


def test_in_memory_kernel_equals_the_row_job(checkpoints):
    """The whole-tensor path (torch tensors, as `apply` passes them) gives the same bytes as the row path."""
    folder = checkpoints("w4-group-asym")
    tensors = load_file(folder / "model.safetensors")
    mapper = M.presets.decompress(folder)
    result = mapper.apply(tensors)
    reference = library_weights(folder)
    for name, expected in reference.items():
        assert _same_bits(result[name], expected.to(torch.bfloat16)), name


def test_plan_streams_rows_and_says_what_is_dequantised(checkpoints):
    folder = checkpoints("w4-group-sym")
    plan = wb.plan(folder, M.presets.decompress(folder), chunk_size=4096)
    assert plan.ok, plan.problems
    groups = plan.groups
    dequantised = groups[groups["label"] == "decompress_tensor"]
    assert len(dequantised) == 14 and set(dequantised["kind"]) == {"rows"}  # each packed weight a few rows at a time
    assert set(groups[groups["label"] != "decompress_tensor"]["kind"]) == {"copy"}  # norms, embeddings: copied
    assert "dequantised: 14 tensors (e.g. model.layers.0.mlp.down_proj.weight); copied as they are: 7 tensors" in plan.summary()
    largest = max(dequantised["bytes_out"])
    assert (dequantised["held_bytes"] < largest + 4096 + 3 * 1024 * 1024).all()  # one chunk + parts + scratch


def test_catalog_columns_say_what_each_tensor_is(checkpoints):
    ck = wb.open_checkpoint(checkpoints("w4-group-asym"))
    table = ck.tensors
    row = table.loc["model.layers.0.self_attn.q_proj.weight_packed"]
    assert row["quant_format"] == "pack-quantized" and row["quant_role"] == "packed"
    assert row["quant_bits"] == 4 and row["quant_group"] == "32" and not row["quant_sym"]
    assert set(row["quant_parts"]) == {"model.layers.0.self_attn.q_proj.weight_scale",
                                       "model.layers.0.self_attn.q_proj.weight_zero_point",
                                       "model.layers.0.self_attn.q_proj.weight_shape"}
    assert table.loc["model.layers.0.self_attn.q_proj.weight_zero_point", "quant_role"] == "zero_point"
    assert table.loc["model.norm.weight", "quant_format"] is None or str(table.loc["model.norm.weight", "quant_format"]) in ("nan", "<NA>", "None")


def test_suggest_offers_decompress(checkpoints):
    ck = wb.open_checkpoint(checkpoints("nvfp4"))
    presets = list(ck.suggest()["preset"])
    assert presets[0].startswith("decompress")


def test_missing_scale_and_wrong_shape_are_clear_errors(checkpoints, tmp_path):
    folder = checkpoints("w4-group-asym")
    tensors = load_file(folder / "model.safetensors")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight_zero_point"
    save_file({k: v for k, v in tensors.items() if k != name}, broken / "model.safetensors")
    with pytest.raises(MapperError, match="up_proj.*no weight_zero_point"):
        M.presets.decompress(broken)
    scale = "model.layers.0.self_attn.k_proj.weight_scale"
    save_file({**tensors, scale: tensors[scale][:, :1].contiguous()}, broken / "model.safetensors")
    with pytest.raises(WorkbenchError, match="k_proj.weight_scale.*expected"):
        M.presets.decompress(broken)


def make_moe_checkpoint(folder: Path, scheme: str = "w4-group-asym") -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Mixtral saved by transformers (one tensor per expert), every linear but the router and lm_head compressed
    with the library's own compressor for `scheme`; returns the folder and the library's decompressed weights."""
    import transformers
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationStatus

    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=128, num_local_experts=3, num_experts_per_tok=2)
    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    dense = load_file(folder / "model.safetensors")
    chosen = _scheme(scheme)
    chosen.format = CompressionFormat.pack_quantized.value
    compressor = BaseCompressor.get_value_from_registry(chosen.format)
    args = chosen.weights
    tensors, reference = {}, {}
    for name, weight in dense.items():
        module = name.removesuffix(".weight")
        if weight.ndim != 2 or module.rsplit(".", 1)[-1] not in ("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"):
            tensors[name] = weight
            continue
        grouped = weight.unflatten(-1, (-1, args.group_size))
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        local = compressor.compress({"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_zero_point": zero}, chosen)
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in local.items()})
        reference[name] = compressor.decompress(local, chosen)["weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    data = json.loads((folder / "config.json").read_text())
    quant = QuantizationConfig(config_groups={"group_0": chosen}, ignore=["lm_head"], format=chosen.format,
                               quantization_status=QuantizationStatus.COMPRESSED)
    data["quantization_config"] = {"quant_method": "compressed-tensors", **quant.model_dump(exclude=["quant_method"])}
    (folder / "config.json").write_text(json.dumps(data))
    return folder, reference


def test_decompress_then_transformers_layout_in_one_recipe(tmp_path):
    """`decompress,from_transformers` (what suggest proposes first): experts dequantised, then stacked as transformers 5
    holds them, equal to the library's decompression stacked by hand; from_transformers alone names the parts."""
    from workbench.mapper.presets.suggest import build_preset

    folder, reference = make_moe_checkpoint(tmp_path / "mixtral")
    ck = wb.open_checkpoint(folder)
    suggested = list(ck.suggest()["preset"])
    assert suggested[0] == "decompress,from_transformers"
    mapper = build_preset("decompress,from_transformers", ck, folder / "config.json")
    wb.convert(folder, tmp_path / "out", mapper)
    got = load_file(tmp_path / "out" / "model.safetensors")
    experts = "model.layers.1.mlp.experts"
    gate_up = torch.stack([torch.cat([reference[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"],
                                      reference[f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight"]]) for e in range(3)])
    assert _same_bits(got[f"{experts}.gate_up_proj"], gate_up)
    down = torch.stack([reference[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"] for e in range(3)])
    assert _same_bits(got[f"{experts}.down_proj"], down)
    assert _same_bits(got["model.layers.0.self_attn.q_proj.weight"], reference["model.layers.0.self_attn.q_proj.weight"])
    alone = wb.plan(folder, M.presets.from_transformers(folder / "config.json"))
    assert not alone.ok and any("decompress" in str(p) for p in alone.problems)


def test_mixed_precision_groups_by_regex_targets(tmp_path):
    """Two config groups (attention FP8 per channel, MLP int4 groups), each module's scheme found by its regex target;
    the mapper exports to code and verifies after the run."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    attention, mlp = _scheme("fp8-channel"), _scheme("w4-group-asym")
    attention.targets, mlp.targets = ["re:.*self_attn.*"], ["re:.*mlp.*"]
    apply_quantization_config(model, QuantizationConfig(config_groups={"attention": attention, "mlp": mlp}, ignore=["lm_head"]))
    _calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    folder = tmp_path / "mixed"
    model.config.save_pretrained(folder)
    compressor.update_config(str(folder))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors = load_file(folder / "model.safetensors")
    mapper = M.presets.decompress(folder)
    namespace: dict = {}
    exec(mapper.to_code(), namespace)
    assert namespace["mapper"] == mapper
    report = wb.convert(folder, tmp_path / "out", mapper, verify=True, quiet=True)
    assert report.verified
    got = load_file(tmp_path / "out" / "model.safetensors")
    for group in quant["config_groups"].values():
        scheme = QuantizationScheme.model_validate(group)
        library = BaseCompressor.get_value_from_registry(group["format"])
        kind = "self_attn" if group["targets"] == ["re:.*self_attn.*"] else "mlp"
        modules = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_scale") and f".{kind}." in n}
        assert len(modules) == (8 if kind == "self_attn" else 6)
        for module in modules:
            local = {n[len(module) + 1:]: t for n, t in tensors.items() if n.rsplit(".", 1)[0] == module}
            assert _same_bits(got[f"{module}.weight"], library.decompress(local, scheme)["weight"].to(torch.bfloat16)), module


def test_a_weight_shape_that_disagrees_stops_the_run_naming_the_tensor(checkpoints, tmp_path):
    folder = checkpoints("w4-group-sym")
    tensors = load_file(folder / "model.safetensors")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    name = "model.layers.1.mlp.gate_proj.weight_shape"
    save_file({**tensors, name: torch.tensor([96, 65])}, broken / "model.safetensors")
    with pytest.raises(WorkbenchError, match=r"gate_proj.weight_packed.*weight_shape holds \[96, 65\]"):
        wb.convert(broken, tmp_path / "out", M.presets.decompress(broken), quiet=True)
