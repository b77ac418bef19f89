"""`M.presets.from_transformers`: bit for bit what transformers 5 holds in memory, and back to its files.

Each family is a tiny random model saved by transformers' own `save_pretrained` (scripts/make_families.py).
The reference is `from_pretrained(folder).state_dict()`; the inverse must give back the saved tensors.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

import workbench as wb  # noqa: E402
from workbench import mapper as M  # noqa: E402
from workbench.cli.commands import main as cli_main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ["llama", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"]


def _families_script():
    spec = importlib.util.spec_from_file_location("make_families", REPO / "scripts" / "make_families.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    make = _families_script()
    root = tmp_path_factory.mktemp("families")
    return {family: make.save(family, root / family) for family in FAMILIES}


def _reference(folder: Path) -> dict[str, torch.Tensor]:
    assert (folder / "config.json").is_file()  # never let from_pretrained fall back to a default (7B) config
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    return model, {name: tensor.detach() for name, tensor in model.state_dict().items()}


def _read(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_preset_gives_the_in_memory_layout_and_its_inverse_the_saved_files(family: str, family_dirs: dict[str, Path], tmp_path: Path) -> None:
    src = family_dirs[family]
    mapper = M.presets.from_transformers(src / "config.json")
    memory = tmp_path / "memory"
    wb.convert(src, memory, mapper, quiet=True)
    model, expected = _reference(src)
    got = _read(memory)
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    # the converted tensors load strictly into the model and give transformers' logits
    twin = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    twin.load_state_dict(got, strict=True)
    ids = torch.arange(12).reshape(2, 6) % model.config.vocab_size
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, model(ids).logits)
    # save direction: the inverse, from the same source, reproduces save_pretrained's tensors exactly
    back = tmp_path / "back"
    wb.convert(memory, back, mapper.inverse(wb.open_checkpoint(src)), quiet=True)
    original, restored = _read(src), _read(back)
    assert sorted(restored) == sorted(original)
    assert all(torch.equal(restored[name], original[name]) for name in original)
    # the mapper file is the single source of truth: to_code rebuilds an equal mapper
    namespace: dict = {}
    exec(mapper.to_code(), namespace)
    assert namespace["mapper"] == mapper


def test_experts_are_stacked_with_ranges_not_listed(family_dirs: dict[str, Path]) -> None:
    mapper = M.presets.from_transformers(family_dirs["mixtral"])
    stacks = {leaf.srcs: leaf.dst for leaf in mapper.leaves() if isinstance(leaf, M.Stack)}
    assert stacks == {
        ("model.layers.{i}.block_sparse_moe.experts.{e*}.w1.weight",): "model.layers.{i}.block_sparse_moe.experts.w1.weight",
        ("model.layers.{i}.block_sparse_moe.experts.{e*}.w3.weight",): "model.layers.{i}.block_sparse_moe.experts.w3.weight",
        ("model.layers.{i}.block_sparse_moe.experts.{e*}.w2.weight",): "model.layers.{i}.mlp.experts.down_proj",
    }
    code = mapper.to_code()
    assert ".experts.0." not in code and "natural order" in code


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "qwen2_moe"])
def test_config_alone_gives_a_mapper_that_fits_any_size_of_the_family(family: str, family_dirs: dict[str, Path]) -> None:
    src = family_dirs[family]
    from_files = M.presets.from_transformers(src)
    from_dict = M.presets.from_transformers(json.loads((src / "config.json").read_text()))  # names from transformers' own save
    assert from_dict == from_files
    if family == "deepseek_v3":
        return  # its default size (61 layers x 256 experts) takes ~13 s to derive: measured once, not in every run
    default = M.presets.from_transformers(json.loads((src / "config.json").read_text())["model_type"])  # a default-size config
    binding = default.bind(wb.open_checkpoint(src))
    assert binding.ok
    assert set(binding.outputs) == set(_reference(src)[1])


def test_a_tensor_the_model_does_not_have_is_a_problem_not_skipped(family_dirs: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "extra"
    folder.mkdir()
    (folder / "config.json").write_text((family_dirs["mixtral"] / "config.json").read_text())
    tensors = _read(family_dirs["mixtral"])
    tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, folder / "model.safetensors")
    plan = wb.plan(folder, M.presets.from_transformers(folder))
    assert not plan.ok
    (problem,) = plan.errors
    assert "experts.0.w1.weight_scale_inv" in problem.message and "no parameter" in problem.message


def test_a_registry_operation_without_equivalent_is_reported_by_name(family_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import conversion_mapping
    from transformers.core_model_loading import ConversionOps, WeightConverter

    class Rotate90(ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):  # pragma: no cover - never run
            raise AssertionError

    def rules(model, *args, **kwargs):
        return [WeightConverter("mlp.down_proj.weight", "mlp.down_proj.weight", operations=[Rotate90()])]

    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", rules)
    plan = wb.plan(family_dirs["llama"], M.presets.from_transformers(family_dirs["llama"]))
    assert not plan.ok
    assert {p.tensor for p in plan.errors} == {f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)}
    assert all("Rotate90" in p.message and "no workbench equivalent" in p.message for p in plan.errors)


def test_a_preset_of_another_family_reports_instead_of_half_converting(family_dirs: dict[str, Path]) -> None:
    plan = wb.plan(family_dirs["qwen2_moe"], M.presets.from_transformers("mixtral"))
    assert not plan.ok
    assert any("matches no tensor" in p.message for p in plan.errors)


def test_cli_convert_with_preset(family_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out = family_dirs["olmoe"], tmp_path / "out"
    assert cli_main(["plan", str(src), "--preset", "from_transformers"]) == 0
    assert "status: OK" in capsys.readouterr().out
    assert cli_main(["convert", str(src), str(out), "--preset", "from_transformers", "--quiet"]) == 0
    got, expected = _read(out), _reference(src)[1]
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    two = tmp_path / "two"  # presets chain: the second is built on what the first makes
    assert cli_main(["convert", str(src), str(two), "--preset", "from_transformers,strip_prefix", "--quiet"]) == 0
    assert sorted(_read(two)) == sorted(name.removeprefix("model.") for name in expected)
    assert cli_main(["plan", str(src), "--preset", "no_such_preset"]) == 2
    assert "has no such preset" in capsys.readouterr().err


def test_suggest_names_the_model_type_and_the_presets(family_dirs: dict[str, Path], tmp_path: Path) -> None:
    moe = wb.open_checkpoint(family_dirs["deepseek_v3"]).suggest()
    assert moe.attrs["model_type"] == "deepseek_v3" and list(moe.columns) == ["preset", "why"]
    assert list(moe["preset"]) == ["from_transformers"]
    dense = wb.open_checkpoint(family_dirs["llama"]).suggest()
    assert list(dense["preset"]) == ["hf_to_fused", "hf_to_meta"]  # Llama: nothing for transformers to convert
    config = json.loads((family_dirs["mixtral"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    fp8 = wb.open_checkpoint(family_dirs["mixtral"]).suggest(config)
    assert list(fp8["preset"]) == ["dequantize_fp8", "from_transformers"]
    assert "block [128, 128]" in fp8["why"][0]
    for name in moe["preset"]:
        assert callable(getattr(M.presets, name))


def test_builder_lists_the_presets_that_apply_first(family_dirs: dict[str, Path]) -> None:
    pytest.importorskip("ipywidgets")
    from workbench.widgets.builder import MapperBuilder

    builder = MapperBuilder(family_dirs["mixtral"])
    options = builder.preset_picker.options
    assert options[1][1] == "from_transformers" and options[1][0].startswith("★")
    builder.load_preset("from_transformers")
    assert builder.mapper == M.presets.from_transformers(family_dirs["mixtral"])


# -- quantised MoE checkpoints: dequantise, then transformers' layout, in one recipe (issue 31, item 2) -------------
FP8_BLOCK = (4, 4)  # divides every dim of the tiny DeepSeek-V3, so transformers' own dequantisation is exact too
FP8_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def deepseek_fp8(family_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DeepSeek-V3 (real values, 4 routed experts of 8 x 32 and a shared one) as a fine-grained FP8
    checkpoint: one tensor per expert, `weight_scale_inv` per 4 x 4 tile, quantization_config in config.json."""
    out = tmp_path_factory.mktemp("deepseek_fp8") / "fp8"
    base = family_dirs["deepseek_v3"]
    wb.convert(base, out, M.presets.quantize_fp8(block=FP8_BLOCK, source=base, targets=FP8_TARGETS), quiet=True)
    return out


def _dequantised_by_hand(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    scale = tensors[name + "_scale_inv"].repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)
    return (tensors[name].float() * scale).to(torch.bfloat16)


def test_dequantize_then_from_transformers_is_one_recipe_equal_to_the_stacked_reference(deepseek_fp8: Path, tmp_path: Path) -> None:
    mapper = M.Sequential(M.presets.dequantize_fp8(deepseek_fp8), M.presets.from_transformers(deepseek_fp8))
    plan = wb.plan(deepseek_fp8, mapper)
    assert plan.ok, plan.problems
    wb.convert(deepseek_fp8, tmp_path / "out", mapper, quiet=True)
    got, fp8 = _read(tmp_path / "out"), _read(deepseek_fp8)
    experts = "model.layers.1.mlp.experts"
    count = transformers.AutoConfig.from_pretrained(deepseek_fp8).n_routed_experts
    gate_up = torch.stack([torch.cat([_dequantised_by_hand(fp8, f"{experts}.{e}.gate_proj.weight"),
                                      _dequantised_by_hand(fp8, f"{experts}.{e}.up_proj.weight")]) for e in range(count)])
    down = torch.stack([_dequantised_by_hand(fp8, f"{experts}.{e}.down_proj.weight") for e in range(count)])
    assert torch.equal(got[f"{experts}.gate_up_proj"].view(torch.int16), gate_up.view(torch.int16))
    assert torch.equal(got[f"{experts}.down_proj"].view(torch.int16), down.view(torch.int16))
    assert not any(name.endswith("_scale_inv") or ".experts.0." in name for name in got)
    # transformers' own loading of the FP8 folder (it dequantises on CPU and stacks the experts) holds the same values
    model = transformers.AutoModelForCausalLM.from_pretrained(deepseek_fp8)
    theirs = model.state_dict()
    assert sorted(got) == sorted(theirs)
    for name, tensor in got.items():
        assert torch.equal(theirs[name].to(tensor.dtype), tensor), name
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


def test_from_transformers_alone_on_fp8_names_the_scales_and_the_recipe(deepseek_fp8: Path) -> None:
    plan = wb.plan(deepseek_fp8, M.presets.from_transformers(deepseek_fp8))
    assert not plan.ok
    (problem,) = plan.errors
    assert "weight_scale_inv" in problem.message and "M.presets.dequantize_fp8(config)" in problem.message


def test_suggest_proposes_the_one_recipe_on_an_fp8_moe_folder_and_it_plans(deepseek_fp8: Path) -> None:
    from workbench.mapper.presets.suggest import build_preset

    ck = wb.open_checkpoint(deepseek_fp8)
    offered = list(ck.suggest()["preset"])
    assert offered[0] == "dequantize_fp8,from_transformers" and "from_transformers" not in offered
    plan = wb.plan(ck, build_preset(offered[0], ck.catalog, deepseek_fp8 / "config.json"))
    assert plan.ok, plan.problems
    assert any(name.endswith("experts.gate_up_proj") for name in plan.outputs.index)


def test_dequantize_mxfp4_then_from_transformers_composes(tmp_path: Path) -> None:
    """gpt-oss stores its experts MXFP4 and already stacked: the same recipe plans, and from_transformers alone
    names the blocks and scales it would leave behind."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(3)
    tensors = {"model.embed_tokens.weight": torch.randn(100, 64, generator=gen).to(torch.bfloat16)}
    for proj, rows, cols in (("gate_up_proj", 128, 64), ("down_proj", 64, 64)):
        base = f"model.layers.0.mlp.experts.{proj}"
        tensors[base + "_blocks"] = torch.randint(0, 256, (4, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
        tensors[base + "_scales"] = torch.randint(118, 130, (4, rows, cols // 32), generator=gen, dtype=torch.uint8)
    tmp_path.joinpath("mx").mkdir()
    save_file(tensors, tmp_path / "mx" / "model.safetensors")
    config = {"model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 100,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
              "layer_types": ["full_attention"], "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "mx" / "config.json").write_text(json.dumps(config))
    src = tmp_path / "mx"
    alone = wb.plan(src, M.presets.from_transformers(src))
    assert not alone.ok and "_blocks" in alone.errors[0].message and "dequantize_mxfp4" in alone.errors[0].message
    recipe = M.Sequential(M.presets.dequantize_mxfp4(src), M.presets.from_transformers(src))
    plan = wb.plan(src, recipe)
    assert plan.ok, plan.problems
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"} <= set(plan.outputs.index)


def test_the_inverse_composes_stacked_experts_back_to_per_expert_fp8(family_dirs: dict[str, Path], deepseek_fp8: Path,
                                                                    tmp_path: Path) -> None:
    """transformers' layout (experts stacked) -> per-expert FP8 with block scales: the layout's inverse, then
    quantize_fp8 built on the names it makes, gives the FP8 checkpoint quantised from the saved files, byte for byte."""
    base = family_dirs["deepseek_v3"]
    wb.convert(base, tmp_path / "memory", M.presets.from_transformers(base), quiet=True)
    memory = wb.open_checkpoint(tmp_path / "memory")
    back = M.presets.from_transformers(base).inverse(wb.open_checkpoint(base))
    quantize = M.presets.quantize_fp8(block=FP8_BLOCK, source=back.bind(memory).outputs, targets=FP8_TARGETS)
    wb.convert(memory, tmp_path / "fp8", M.Sequential(back, quantize), quiet=True)
    got, expected = _read(tmp_path / "fp8"), _read(deepseek_fp8)
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k].view(torch.uint8), expected[k].view(torch.uint8)) for k in expected)
